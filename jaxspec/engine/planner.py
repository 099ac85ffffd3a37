"""The planner: which precompiled decoding variant (strategy) runs the next chunk of rounds.

Speculation that pays at one context length or batch size can lose at another, and the best gamma,
KV ratio or tree shape depends on the prompt. The planner picks among strategies the runner
compiles before decoding starts (`Runner.precompile`), at chunk boundaries (between jitted chunks
of rounds: no host sync per round), in two steps:

  offline   a profile (`Profile`, JSON, made by `python -m benchmarks.plan_profile`) holds, per
            context bucket and batch size, per strategy, the mean accepted tokens per round and
            the fused round's latency; strategies are ranked by accepted tokens per second
            (accepted per round / round latency);
  run time  a `Controller` per request group starts from the best-ranked strategy of its bucket,
            keeps an exponential moving average (EMA) of accepted tokens per round, and after a
            warm-up, when the EMA stays below the strategy's profiled expectation by a margin for
            `patience` consecutive checks, moves to the next candidate: the next-ranked strategy
            not yet tried, or a strategy tried before if what it achieved then (its EMA at the
            time, per second of profiled latency) beats that; at most `max_switches` such moves
            per request group. When the context crosses into another bucket it re-plans: the new
            bucket's best strategy, the EMA and warm-up restarted.

A strategy (`Strategy`) is a hashable key that produces a `RunConfig`; it carries a precision
class label (`precision`), and a planner only ever ranks the strategies of the class it was
started in. Self-drafting strategies (Vegas's methods) and strict SSV strategies are lossless
('exact'): switching among them changes the speed, never the distribution of the output (greedy
output stays plain greedy decoding's in float32). SSV strategies (method 'ssv': an NSA target, the
runner's draft model, a gamma or tree, the SSV class and group) take their class as precision
class: 'reuse', 'approx' and 'approx_reuse' CHANGE the output, each its own way, so a planner of
such a class switches only among strategies that change it the same way (`jaxspec.ssv`).

A request group is the batch that one compiled chunk decodes: the chunk is shared, so one
strategy runs the whole batch, and its EMA is the batch's mean over active sequences.

Everything in this module is plain Python over plain numbers, except `Strategy.run_config` and
`switch_state`, the two points where a decision meets the engine.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from typing import Any, Mapping, Sequence

import jax.numpy as jnp
import numpy as np

from jaxspec.drafting.policies import Scoring

PROFILE_VERSION = 1
# Self-drafting methods whose drafter state is one `Sparse` plan of [L, B, k_max] token indices:
# `switch_state` can carry it from one strategy to another.
PLANNABLE = ("vegas", "vegas-all", "vegas-last")
SSV = "ssv"    # draft-model strategies over an NSA target: the state carries over unchanged
EXACT = "exact"


class ProfileError(ValueError):
  """A profile that cannot be used (the message is one line)."""


# -- strategies --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Strategy:
  """One precompiled variant: a self-drafting method with its gamma, KV ratio and draft shape, or
  SSV (method 'ssv') with its gamma or tree, class and group.

  tree: widths per depth ((2, 2, 1, 1)) or None for a chain of gamma drafts; with a tree, gamma
  is its depth. precision: the precision class this strategy belongs to (a label; every
  self-drafting strategy is lossless, 'exact'; an SSV strategy's is its class's, `ssv_precision`).
  ssv_class, group: SSV's class and rows per group (`jaxspec.ssv`), for method 'ssv' only;
  sparsity means nothing there."""
  method: str = "vegas"
  gamma: int = 6
  sparsity: float = 0.07
  tree: tuple[int, ...] | None = None
  tree_order: str = "bfs"
  precision: str = EXACT
  ssv_class: str = "strict"
  group: int = 1

  def __post_init__(self):
    from jaxspec import ssv
    if self.method not in (*PLANNABLE, SSV):
      raise ValueError(f"the planner switches among methods {', '.join((*PLANNABLE, SSV))}, "
                       f"not {self.method!r}")
    if self.method == SSV:
      ssv.check_class(self.ssv_class, "a strategy's SSV class")
      object.__setattr__(self, "group", ssv.check_group(self.group, "a strategy's SSV group"))
      own = ssv_precision(self.ssv_class)
      if self.precision not in (EXACT, own):
        raise ValueError(f"an SSV strategy of class {self.ssv_class!r} is of precision class "
                         f"{own!r}, not {self.precision!r}")
      object.__setattr__(self, "precision", own)
    elif (self.ssv_class, self.group) != ("strict", 1):
      raise ValueError(f"ssv_class and group are settings of SSV strategies, not of "
                       f"{self.method!r}")
    if not isinstance(self.gamma, int) or isinstance(self.gamma, bool) or self.gamma < 1:
      raise ValueError(f"a strategy's gamma must be a positive integer, got {self.gamma!r}")
    if not isinstance(self.sparsity, (int, float)) or not 0 < self.sparsity <= 1:
      raise ValueError(f"a strategy's sparsity must be in (0, 1], got {self.sparsity!r}")
    object.__setattr__(self, "sparsity", float(self.sparsity))
    if self.tree is not None:
      if not isinstance(self.tree, (tuple, list)) or not self.tree or not all(
          isinstance(w, int) and not isinstance(w, bool) and w >= 1 for w in self.tree):
        raise ValueError(f"a strategy's tree must be positive widths per depth, got {self.tree!r}")
      object.__setattr__(self, "tree", tuple(self.tree))
      if self.gamma != len(self.tree):
        raise ValueError(f"strategy gamma {self.gamma} is not its tree's depth {len(self.tree)}")
    if self.tree_order not in ("bfs", "dfs"):
      raise ValueError(f"a strategy's tree order must be bfs or dfs, got {self.tree_order!r}")
    if not isinstance(self.precision, str) or not self.precision:
      raise ValueError(f"a strategy's precision class must be a name, got {self.precision!r}")

  @property
  def key(self) -> str:
    """A short stable name, used in profiles and logs: 'vegas/g6/r0.07',
    'vegas/t2-2-1-1-bfs/r0.07' or 'ssv/g4/strict.G2'."""
    shape = (f"g{self.gamma}" if self.tree is None
             else f"t{'-'.join(map(str, self.tree))}-{self.tree_order}")
    if self.method == SSV:
      return f"{self.method}/{shape}/{self.ssv_class}.G{self.group}"
    return f"{self.method}/{shape}/r{self.sparsity:g}"

  @property
  def spare(self) -> int:
    """Cache slots one verification of this strategy needs past the sequence."""
    if self.tree is None:
      return self.gamma + 1
    size, level = 1, 1
    for w in self.tree:
      level *= w
      size += level
    return size

  def to_json(self) -> dict:
    d = {"method": self.method, "gamma": self.gamma, "sparsity": self.sparsity,
         "tree": None if self.tree is None else list(self.tree),
         "tree_order": self.tree_order, "precision": self.precision}
    if self.method == SSV:
      d.update(ssv_class=self.ssv_class, group=self.group)
    return d

  @classmethod
  def from_json(cls, d: Any) -> "Strategy":
    if not isinstance(d, dict):
      raise ValueError(f"a strategy must be an object, got {d!r}")
    unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
      raise ValueError(f"unknown strategy field(s) {', '.join(sorted(unknown))}")
    tree = d.get("tree")
    return cls(**dict(d, tree=None if tree is None else tuple(tree)))

  def run_config(self, base, *, min_tokens: int, scoring: Scoring, mesh=None):
    """`base` (a `RunConfig` for the cache's capacity, with the runner's sampling, stop ids,
    backend and dtype; for an SSV strategy, the runner's draft model and SSV settings) with this
    strategy's gamma, drafter and tree (and SSV class and group)."""
    from jaxspec.drafting import policies
    from jaxspec.drafting.self_drafting import SelfDrafter
    from jaxspec.drafting.trees import Tree
    tree = None if self.tree is None else Tree.from_widths(self.tree, self.tree_order)
    if self.method == SSV:
      ssv = dataclasses.replace(base.ssv, ssv_class=self.ssv_class, group=self.group)
      return dataclasses.replace(base, gamma=self.gamma, tree=tree, ssv=ssv)
    policy = policies.make_policy(
        self.method, ratio=self.sparsity, min_tokens=min_tokens,
        k_max=policies.static_k_max(base.capacity, self.sparsity, min_tokens),
        scoring=scoring, backend=base.backend, mesh=mesh)
    return dataclasses.replace(base, gamma=self.gamma, drafter=SelfDrafter(policy), tree=tree)


def ssv_precision(ssv_class: str) -> str:
  """An SSV class's precision class: strict is lossless ('exact'); the others are their own."""
  return EXACT if ssv_class == "strict" else ssv_class


def parse_strategy(text: str, precision: str = EXACT) -> Strategy:
  """'vegas:6@0.07', 'vegas-all:4', 'vegas:t2.2.1.1@0.1' (a tree of widths 2, 2, 1, 1;
  ':t2.2.1.1/dfs' verifies it in dfs order), 'vegas' (gamma 6, ratio 0.07); for SSV the part
  after '@' is the class and group: 'ssv:4@strict.2', 'ssv:t2.1@approx.4', 'ssv:4' (strict,
  groups of 1) -> a Strategy. One-line ValueError on bad text."""
  rest, _, ratio = text.strip().partition("@")
  method, _, shape = rest.partition(":")
  kw: dict = {"method": method, "precision": precision}
  try:
    if ratio and method == SSV:
      cls, _, group = ratio.partition(".")
      kw["ssv_class"] = cls
      if group:
        kw["group"] = int(group)
    elif ratio:
      kw["sparsity"] = float(ratio)
    if shape.startswith("t"):
      widths, _, order = shape[1:].partition("/")
      kw["tree"] = tuple(int(w) for w in widths.split("."))
      kw["gamma"] = len(kw["tree"])
      kw["tree_order"] = order or "bfs"
    elif shape:
      kw["gamma"] = int(shape)
  except ValueError:
    raise ValueError(f"cannot read strategy {text!r}: write method[:gamma | :tWIDTHS[/order]]"
                     "[@ratio | @class[.group] for ssv], e.g. vegas:6@0.07, vegas:t2.2.1.1@0.07 "
                     "or ssv:4@strict.2") from None
  return Strategy(**kw)


# -- the profile -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Expectation:
  """What the profile expects of a strategy in a bucket."""
  accepted: float    # mean accepted tokens per round (the accepted drafts + the corrected/bonus)
  round_s: float     # seconds per round of the fused decode loop

  @property
  def rate(self) -> float:
    """Expected tokens per second of one sequence: the ranking key."""
    return self.accepted / self.round_s


@dataclasses.dataclass(frozen=True)
class Bucket:
  """Measurements for sequences of up to `context` tokens in batches of `batch`."""
  context: int
  batch: int
  entries: tuple[tuple[str, Expectation], ...]   # (strategy key, expectation)


@dataclasses.dataclass(frozen=True)
class Profile:
  strategies: Mapping[str, Strategy]
  buckets: tuple[Bucket, ...]
  meta: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  def to_json(self) -> dict:
    return {"version": PROFILE_VERSION, "meta": dict(self.meta),
            "strategies": {k: s.to_json() for k, s in self.strategies.items()},
            "buckets": [{"context": b.context, "batch": b.batch,
                         "entries": {k: {"accepted_per_round": e.accepted, "round_s": e.round_s}
                                     for k, e in b.entries}} for b in self.buckets]}

  def save(self, path: str | os.PathLike) -> None:
    """Write the profile as JSON (atomically: a temp file renamed over `path`)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
      json.dump(self.to_json(), f, indent=1)
    os.replace(tmp, path)

  @classmethod
  def from_json(cls, d: Any) -> "Profile":
    """Raises ProfileError (one line) on anything missing, unknown or out of range."""
    if not isinstance(d, dict):
      raise ProfileError("a profile must be a JSON object")
    for field in ("version", "strategies", "buckets"):
      if field not in d:
        raise ProfileError(f"missing field {field!r}")
    if d["version"] != PROFILE_VERSION:
      raise ProfileError(f"version {d['version']!r}, this jaxspec reads version {PROFILE_VERSION}")
    if not isinstance(d["strategies"], dict) or not d["strategies"]:
      raise ProfileError("'strategies' must be a non-empty object")
    strategies = {}
    for key, spec in d["strategies"].items():
      try:
        strategies[key] = Strategy.from_json(spec)
      except (TypeError, ValueError) as e:
        raise ProfileError(f"strategy {key!r}: {e}") from None
      if strategies[key].key != key:
        raise ProfileError(f"strategy {key!r} describes {strategies[key].key!r}")
    if not isinstance(d["buckets"], list) or not d["buckets"]:
      raise ProfileError("'buckets' must be a non-empty list")
    buckets, seen = [], set()
    for i, b in enumerate(d["buckets"]):
      where = f"bucket {i}"
      if not isinstance(b, dict):
        raise ProfileError(f"{where} must be an object")
      for field in ("context", "batch", "entries"):
        if field not in b:
          raise ProfileError(f"{where}: missing field {field!r}")
      for field in ("context", "batch"):
        if not isinstance(b[field], int) or isinstance(b[field], bool) or b[field] < 1:
          raise ProfileError(f"{where}: {field} must be a positive integer, got {b[field]!r}")
      where = f"bucket context={b['context']} batch={b['batch']}"
      if (b["context"], b["batch"]) in seen:
        raise ProfileError(f"{where} appears twice")
      seen.add((b["context"], b["batch"]))
      if not isinstance(b["entries"], dict) or not b["entries"]:
        raise ProfileError(f"{where} has no entries")
      entries = []
      for key, e in b["entries"].items():
        if key not in strategies:
          raise ProfileError(f"{where}: unknown strategy {key!r} (not in 'strategies')")
        if not isinstance(e, dict) or {"accepted_per_round", "round_s"} - set(e):
          raise ProfileError(f"{where}, {key}: needs accepted_per_round and round_s")
        acc, sec = e["accepted_per_round"], e["round_s"]
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
                   and x > 0 for x in (acc, sec)):
          raise ProfileError(f"{where}, {key}: accepted_per_round and round_s must be positive "
                             f"numbers, got {acc!r} and {sec!r}")
        entries.append((key, Expectation(float(acc), float(sec))))
      buckets.append(Bucket(b["context"], b["batch"], tuple(entries)))
    if not isinstance(d.get("meta", {}), dict):
      raise ProfileError("'meta' must be an object")
    return cls(strategies, tuple(buckets), dict(d.get("meta", {})))

  @classmethod
  def load(cls, path: str | os.PathLike) -> "Profile":
    """Read a profile file; OSError or ProfileError, each one line naming the file."""
    try:
      with open(path) as f:
        d = json.load(f)
    except json.JSONDecodeError as e:
      raise ProfileError(f"{path}: not JSON ({e.msg}, line {e.lineno})") from None
    except OSError as e:
      raise OSError(f"cannot read profile {path}: {e.strerror or e}") from None
    try:
      return cls.from_json(d)
    except ProfileError as e:
      raise ProfileError(f"{path}: {e}") from None


# -- ranking and refinement --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Refinement:
  """Run-time refinement settings (SSV's Algorithm 1 uses an 8-step warm-up, 5 steps below
  expectation and at most two transitions per request; our checks come once per chunk of rounds,
  so persistence is counted in checks).

  alpha: EMA weight of one round's observation; warmup_rounds: rounds after a (re)plan or switch
  before the EMA is checked; margin: the EMA must fall below (1 - margin) x the expectation;
  patience: consecutive checks below before a switch; max_switches: switches per request group
  (a re-plan at a bucket crossing is not one)."""
  alpha: float = 0.3
  warmup_rounds: int = 16
  margin: float = 0.1
  patience: int = 2
  max_switches: int = 2

  def __post_init__(self):
    if not 0 < self.alpha <= 1:
      raise ValueError(f"EMA alpha must be in (0, 1], got {self.alpha!r}")
    if not 0 <= self.margin < 1:
      raise ValueError(f"margin must be in [0, 1), got {self.margin!r}")
    for name in ("warmup_rounds", "patience", "max_switches"):
      v = getattr(self, name)
      if not isinstance(v, int) or v < (1 if name == "patience" else 0):
        raise ValueError(f"{name} must be a {'positive' if name == 'patience' else 'non-negative'}"
                         f" integer, got {v!r}")


class Planner:
  """Ranks a profile's strategies of one precision class per bucket, and starts controllers.

  `Planner.load(path, precision=None)`: precision may be left out when the profile has one class."""

  def __init__(self, profile: Profile, precision: str | None = None,
               refinement: Refinement = Refinement()):
    classes = sorted({s.precision for s in profile.strategies.values()})
    if precision is None:
      if len(classes) > 1:
        raise ValueError(f"the profile holds precision classes {', '.join(classes)}: choose one")
      precision = classes[0]
    if precision not in classes:
      raise ValueError(f"the profile has no strategy of precision class {precision!r} "
                       f"(it has {', '.join(classes)})")
    self.profile, self.precision, self.refinement = profile, precision, refinement
    self.buckets = tuple(b for b in profile.buckets if any(
        profile.strategies[k].precision == precision for k, _ in b.entries))
    if not self.buckets:
      raise ValueError(f"no bucket of the profile measures a strategy of precision class "
                       f"{precision!r}")

  @classmethod
  def load(cls, path: str | os.PathLike, precision: str | None = None,
           refinement: Refinement = Refinement()) -> "Planner":
    return cls(Profile.load(path), precision, refinement)

  @functools.cached_property
  def strategies(self) -> tuple[Strategy, ...]:
    """Every strategy of the class in some bucket, in the profile's order."""
    keys = {k for b in self.buckets for k, _ in b.entries}
    return tuple(s for k, s in self.profile.strategies.items()
                 if k in keys and s.precision == self.precision)

  @property
  def spare(self) -> int:
    """Cache slots past a sequence that every strategy fits in (one cache serves them all)."""
    return max(s.spare for s in self.strategies)

  def bucket(self, context: int, batch: int) -> Bucket:
    """The profiled batch size closest from above (else the largest), then among its buckets the
    smallest context bucket that holds `context` (else the largest)."""
    batches = sorted({b.batch for b in self.buckets})
    size = next((x for x in batches if x >= batch), batches[-1])
    mine = sorted((b for b in self.buckets if b.batch == size), key=lambda b: b.context)
    return next((b for b in mine if b.context >= context), mine[-1])

  def ranking(self, bucket: Bucket) -> list[tuple[Strategy, Expectation]]:
    """The bucket's strategies of this class, best expected tokens per second first (ties: the
    profile's order)."""
    rows = [(self.profile.strategies[k], e) for k, e in bucket.entries
            if self.profile.strategies[k].precision == self.precision]
    return sorted(rows, key=lambda r: -r[1].rate)

  def controller(self, context: int, batch: int) -> "Controller":
    return Controller(self, context, batch)


class Controller:
  """Run-time refinement for one request group (see the module docstring).

  Call `observe(rounds, accepted_per_round, context)` at each chunk boundary with what the chunk
  did; it returns the strategy for the next chunk. `log` holds every change: dicts with round,
  context, from, to, reason ('fall': the EMA stayed below expectation; 'bucket': the context
  crossed into another bucket), and the EMA and expectation at that point."""

  def __init__(self, planner: Planner, context: int, batch: int):
    self.planner, self.batch = planner, batch
    self.settings = planner.refinement
    self.switches = 0
    self.rounds = 0
    self.log: list[dict] = []
    self._plan(planner.bucket(context, batch))

  def _plan(self, bucket: Bucket) -> None:
    self.bucket_ = bucket
    self.ranked = self.planner.ranking(bucket)
    self.tried: dict[Strategy, float] = {}    # strategy -> observed tokens/s when it was left
    self._enter(*self.ranked[0])

  def _enter(self, strategy: Strategy, expected: Expectation) -> None:
    self.strategy, self.expected = strategy, expected
    self.ema: float | None = None
    self.since = 0          # rounds since entering
    self.below = 0          # consecutive checks below expectation

  def _record(self, to: Strategy, reason: str, context: int) -> None:
    self.log.append({"round": self.rounds, "context": int(context), "from": self.strategy.key,
                     "to": to.key, "reason": reason,
                     "ema": None if self.ema is None else round(self.ema, 4),
                     "expected": round(self.expected.accepted, 4)})

  def observe(self, rounds: int, accepted_per_round: float, context: int) -> Strategy:
    """Fold in one chunk: `rounds` rounds (of the group), `accepted_per_round` the mean accepted
    tokens per round over them (NaN or rounds = 0: nothing ran), `context` the longest active
    sequence's length. Returns the strategy for the next chunk."""
    bucket = self.planner.bucket(context, self.batch)
    if bucket != self.bucket_:
      old, ema, since = self.strategy, self.ema, self.since
      best = self.planner.ranking(bucket)[0][0]
      if best != old:
        self._record(best, "bucket", context)
      self._plan(bucket)
      if self.strategy != old:
        return self.strategy
      # The same variant: what it has shown so far, this chunk included, still holds.
      self.ema, self.since = ema, since
    if rounds <= 0 or not math.isfinite(accepted_per_round):
      return self.strategy
    s = self.settings
    self.rounds += rounds
    self.since += rounds
    # Each of the chunk's rounds weighs alpha, as if observed one by one at the chunk's mean.
    keep = (1 - s.alpha) ** rounds
    self.ema = (accepted_per_round if self.ema is None
                else keep * self.ema + (1 - keep) * accepted_per_round)
    if self.since < s.warmup_rounds:
      return self.strategy
    self.below = self.below + 1 if self.ema < (1 - s.margin) * self.expected.accepted else 0
    if self.below < s.patience or self.switches >= s.max_switches:
      return self.strategy
    nxt = self._next()
    if nxt is not None:
      self.tried[self.strategy] = self.ema / self.expected.round_s
      self._record(nxt[0], "fall", context)
      self.switches += 1
      self._enter(*nxt)
    return self.strategy

  def _next(self) -> tuple[Strategy, Expectation] | None:
    """The next-ranked strategy not tried yet, or a tried one whose observed tokens per second
    beat that strategy's profiled rate (and the current one's observed rate)."""
    untried = [(st, e) for st, e in self.ranked if st not in self.tried and st != self.strategy]
    best = max(((self.tried[st], st, e) for st, e in self.ranked if st in self.tried),
               default=None, key=lambda t: t[0])
    now = self.ema / self.expected.round_s
    if best is not None and best[0] > now and (not untried or best[0] >= untried[0][1].rate):
      return best[1], best[2]
    return untried[0] if untried else None


# -- the engine side ---------------------------------------------------------------------------


def switch_state(state, config):
  """`state` (a `SpecState`) made ready for `config`'s strategy: the acceptance histogram restarts
  at the new gamma's width (the runner keeps the old one's counts). Self-drafting: the pending
  draft plan's index buffer is cut or padded to the new policy's k_max (its counts clamped); any
  plan keeps drafting lossless, and a cut one keeps the earliest selected positions for one
  round, until the next verification selects with the new ratio. SSV: nothing else changes (the
  draft model's cache is the same for every strategy)."""
  b = state.accept_hist.shape[0]
  hist = jnp.zeros((b, config.gamma + 1), jnp.int32)
  if config.ssv is not None:   # SSV: the draft model's cache does not depend on the strategy
    return state.replace(accept_hist=hist)
  plan = state.drafter
  k = config.drafter.policy.k_max
  have = plan.indices.shape[-1]
  if have >= k:
    idx = plan.indices[..., :k]
  else:
    idx = jnp.pad(plan.indices, [(0, 0)] * (plan.indices.ndim - 1) + [(0, k - have)])
  plan = plan.replace(indices=idx, counts=jnp.minimum(plan.counts, k))
  return state.replace(drafter=plan, accept_hist=hist)


def accepted_per_round(hist_delta: Sequence[Sequence[int]]) -> tuple[int, float]:
  """From a histogram delta [B, gamma + 1] of accepted drafts per sequence-round: (sequence-rounds,
  their mean accepted tokens per round incl. the corrected/bonus token; NaN for none)."""
  total = rounds = 0
  for row in hist_delta:
    for a, n in enumerate(row):
      total += (a + 1) * int(n)
      rounds += int(n)
  return rounds, (total / rounds if rounds else float("nan"))


class Tally:
  """Host-side acceptance counts of a run that switches: per strategy, the summed histogram of
  accepted drafts per round (their widths differ with gamma), and the last one read, so that each
  chunk's own rounds can be told apart."""

  def __init__(self):
    self.hists: dict[str, np.ndarray] = {}
    self._prev: np.ndarray | None = None
    self._rounds = 0

  def chunk(self, hist: np.ndarray, rounds: int) -> tuple[int, float]:
    """`hist` [B, gamma + 1]: the state's histogram now; `rounds`: the state's round counter.
    Returns (the group's rounds since the last call, their mean accepted tokens per
    sequence-round; NaN for none)."""
    hist = np.asarray(hist)
    delta = hist if self._prev is None else hist - self._prev
    self._prev = hist
    ran, self._rounds = int(rounds) - self._rounds, int(rounds)
    return ran, accepted_per_round(delta)[1]

  def close(self, key: str, hist: np.ndarray) -> None:
    """The strategy `key` ends with the state's histogram `hist` (the next one restarts at 0)."""
    hist = np.asarray(hist).sum(0)
    self.hists[key] = self.hists[key] + hist if key in self.hists else hist
    self._prev = None

  def summary(self) -> dict:
    """{key: {mean_accepted_tokens, verify_rounds}} per strategy, and the same over all of them
    under 'all'."""
    out, total, rounds = {}, 0, 0
    for key, h in self.hists.items():
      n, mean = accepted_per_round(h[None])
      out[key] = {"mean_accepted_tokens": round(mean, 4), "verify_rounds": n}
      total += mean * n if n else 0
      rounds += n
    out["all"] = {"mean_accepted_tokens": round(total / rounds, 4) if rounds else float("nan"),
                  "verify_rounds": rounds}
    return out
