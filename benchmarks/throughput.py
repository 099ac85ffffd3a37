"""Steady-state decode throughput with continuous batching, several methods in one run.

  python -m benchmarks.throughput --model=qwen2.5-coder-0.5b --workload=short --batch=64 \
      --methods=none,streaming,quest,specextend,vegas-all,vegas --gammas=vegas=6,default=4
  python -m benchmarks.throughput --model=qwen2.5-coder-0.5b --workload=long --batch=16
  python -m benchmarks.throughput --model=qwen2.5-coder-0.5b --workload=continuation --batch=16
  python -m benchmarks.throughput --model=random:qwen3-8b --workload=scale --batch=4
  python -m benchmarks.throughput --model=random:qwen3-8b --workload=scale --batch=4 --tp=2

Workloads (`benchmarks.workloads`):
  short         AIME25 + GSM8K with the chat template, --max_new_tokens 4096 (short input, long
                output);
  long          16K-32K-token Frankenstein passages + a question, with the chat template,
                --max_new_tokens 1024;
  continuation  16K-32K-token Frankenstein passages as plain text (no chat template, no
                question), continued for --max_new_tokens 1024: the long-input workload of
                MagicDec and TriForce (PG-19);
  scale         random weights, a cache filled to --context tokens: time per step / round only
                (acceptance and repetition mean nothing on random weights).
--prompt_min_tokens / --prompt_max_tokens set the passage lengths of long and continuation; a book
too short for them, or min > max, is a one-line error.

Honest by default: requests stop at the model's end-of-sequence tokens, and sampling follows the
paper (temperature 0.6, top-p 0.95, top-k 20). --ignore_eos is a stress mode (every request runs
to max_new_tokens, keeping contexts long when the model would stop early); a run made with it
says so in every label ("vegas:6 (ignore_eos)"), in the JSON (top-level `ignore_eos`, `eos`) and
in the plot's title. Beside acceptance every method reports how repetitive its text is: the share
of distinct 4-grams in each finished request's output (`benchmarks.common.distinct_ngram_share`;
every request that finished during the run, warm-up included), its mean and minimum over
requests, and the share of requests that ended at EOS, so degenerate text (a loop that drafts
well) shows. The share falls as an output grows, and a faster method finishes more and longer
requests in the same window, so rows are compared on the requests every row finished
(`distinct_4gram_share_matched`, the table's `matched4`; `repetition_matched_requests` says how
many): a lossless method's matched share equals vanilla's within noise. Each method's row also
pairs its shares with vanilla's request by request (`distinct_4gram_share_paired`: the mean
difference, its standard error and the Wilcoxon signed-rank p; the table's `paired4` and `p`;
`python -m benchmarks.repetition` computes it for JSONs on record).

For each method, B slots decode the request stream; whenever a sequence finishes, at the next chunk
boundary (every --chunk_rounds rounds; `none=32,default=8` gives vanilla calls of its own length)
its slot is refilled with the next request (prefill of one prompt, padded to one of
--prompt_buckets lengths per power of two, + `jaxspec.engine.batching.insert_slot`); with
--stagger (default) the first B requests have staggered lengths, so finishes and refills spread
evenly from the start. After --warmup_s seconds the harness counts, over --measure_s seconds, the
tokens produced and the wall time (refill prefills included, as a serving engine's throughput
counter would; decode-only throughput is reported too, and the refills' share of the window and
milliseconds each), the mean accepted tokens per round, and (--profile) the drafting /
verification / selection time shares (`Runner.time_phases`) over a few rounds of the serving batch
as it stands at the end of the window. Same prompts and seed for all methods. A --methods entry
`vegas@0.05` runs vegas at its own ratio and `vegas:6` at its own gamma, so one run can hold a
method at 0.07 and at its tuned
(gamma, ratio). Method `draft` drafts with the separate --draft_model (same tokenizer); method
`specattn` too, and verifies over the draft's top-p attention sets (`specattn@0.95` keeps 0.95 of
the mass, default --top_p_attn; layer map from --specattn_map, else proportional; at most
--attn_cap keys per layer). Method `sts`
drafts with --draft_model and verifies each KV head over the top-k keys of its mapped draft head
(`sts@256`: budget k = 256, default --sts_budget; --sts_block pages; head map from --sts_map, made
for that budget, else proportional). SpecAttn and STS CHANGE the output (approximate
verification): their tok/s are not a lossless method's. Method `ssv` (an NSA --model) verifies
under SSV's schedule, drafted by --draft_model or, without one, by the NSA model itself:
`ssv@approx` runs that class, `ssv@approx_reuse.2` that class with groups of 2 rows (default
--ssv_class, --ssv_group; reuse classes read --ssv_schedule). Its reuse and approx classes CHANGE
the output; strict is lossless.
--plan=PROFILE.json (a profile from `python -m benchmarks.plan_profile`) adds two rows after the
--methods: `static-best`, the profile's best strategy for the batch's context bucket and batch size
(re-chosen when the context crosses a bucket, never refined at run time), and `plan`, the same
planner with run-time refinement (`jaxspec.engine.planner`); both over the same stream. A profile
of SSV strategies plans with --draft_model (and --ssv_schedule for the reuse classes).
--tp=N shards the model (and the draft model) over N devices (`jaxspec.model.sharding`); the
copy ceiling in the JSON is still one device's. --disaggregate (short and long workloads) prefills
the refills on a second device while the first one decodes (`Runner.serve`). --fp8_drafts runs
the speculative methods' draft steps on FP8 copies of the MLP weights (`jaxspec.model.fp8`, one
device); the JSON's header says so. --score_pool=W pools the vegas family's scores over W
positions before its top-k (`jaxspec.drafting.policies.pool_scores`), --score_block=N has its
top-k keep aligned blocks of N positions and --score_window=W keep the prefix's newest W positions
whole, ranking the rest of the budget (`jaxspec.drafting.policies.per_layer_topk`); the header
records all three.
"""
from __future__ import annotations

import dataclasses
import os
import sys

import jax
import jax.numpy as jnp
from absl import app, flags

from benchmarks import workloads
from benchmarks.common import (copy_ceiling, device_name, eos_label, eos_settings, error_text,
                               filled_state, git_commit, kernel_families, kernel_table, load,
                               matched_repetition, paired_repetition, read_throughput_json,
                               repetition_summary, time_fn, write_json)
from jaxspec import cli, requests, ssv
from jaxspec.drafting import policies
from jaxspec.drafting.draft_model import DraftModelState
from jaxspec.drafting.specattn import DEFAULT_TOP_P, SpecAttnState
from jaxspec.engine.runner import DRAFT_MODEL_METHODS
from jaxspec.engine.runner import Runner
from jaxspec.engine.sampling import SamplingParams
from jaxspec.engine.state import PROMPT_BUCKETS, SpecState, capacity_for, check_prompt_buckets
from jaxspec.io.loading import check_draft_pair
from jaxspec.model.attention import default_backend
from jaxspec.model.sharding import make_mesh
from jaxspec.model.transformer import fuse_projections

WORKLOADS = [*workloads.WORKLOADS, "scale"]
DEFAULT_MAX_NEW = {"short": 4096, "long": 1024, "continuation": 1024}

_MODEL = flags.DEFINE_string("model", "qwen2.5-coder-0.5b", "jaxspec model spec, or random:<shape>")
_DRAFT_MODEL = flags.DEFINE_string("draft_model", None, "methods draft, specattn, sts, ssv: the "
                                   "draft model (a jaxspec model spec sharing --model's tokenizer, "
                                   "or random:<shape>; ssv without one drafts with --model)")
_WORKLOAD = flags.DEFINE_enum("workload", "short", WORKLOADS, "see module doc")
_METHODS = flags.DEFINE_list("methods", ["none", "streaming", "quest", "specextend", "vegas-all",
                                         "vegas"],
                             "methods to run, in order; method@ratio overrides --sparsity, "
                             "method:gamma (or method@ratio:gamma) --gammas, method/2.2.1.1 "
                             "drafts that tree")
_GAMMAS = flags.DEFINE_list("gammas", ["vegas=6", "default=4"],
                            "gamma per method: method=g entries and default=g")
_TREE = flags.DEFINE_list("tree", None, "draft a tree of these widths per depth (e.g. 2,2,1,1) "
                          "for every speculative entry without its own ('vegas/2.2.1.1')")
_TREE_ORDER = flags.DEFINE_enum("tree_order", "bfs", ["bfs", "dfs"], "verification order of trees")
_SPARSITY = flags.DEFINE_float("sparsity", 0.07, "KV ratio for drafting")
_TOP_P_ATTN = flags.DEFINE_float("top_p_attn", DEFAULT_TOP_P, "specattn: kept draft attention mass "
                                 "(specattn@p overrides it)")
_SPECATTN_MAP = flags.DEFINE_string("specattn_map", None, "specattn: layer map JSON from "
                                    "jaxspec.specattn_map (default: the proportional map)")
_ATTN_CAP = flags.DEFINE_integer("attn_cap", None, "specattn: the most prefix keys a "
                                 "verification layer reads (default: no cap, so its index lists "
                                 "are as long as the cache: at 16K-32K tokens set one)")
_STS_BUDGET = flags.DEFINE_integer("sts_budget", 256, "sts: keys per target KV head and round "
                                  "(sts@k overrides it)")
_STS_BLOCK = flags.DEFINE_integer("sts_block", 1, "sts: tokens per page (1: token granularity)")
_STS_MAP = flags.DEFINE_string("sts_map", None, "sts: head map JSON from jaxspec.sts_map, made for "
                               "the entry's budget (default: the proportional map)")
_SSV_CLASS = flags.DEFINE_string("ssv_class", "strict", "ssv: strict (lossless), reuse, approx or "
                                 "approx_reuse (these CHANGE the output; ssv@class overrides it)")
_SSV_GROUP = flags.DEFINE_integer("ssv_group", 1, "ssv: rows per merged group (ssv@class.G "
                                  "overrides it)")
_SSV_SCHEDULE = flags.DEFINE_string("ssv_schedule", None, "ssv reuse classes: the refresh/reuse "
                                    "schedule JSON from jaxspec.ssv_calibrate")
_MIN_TOKENS = flags.DEFINE_integer("min_tokens", 256, "smallest KV budget")
_SCORE = flags.DEFINE_enum("score", "logits", ["logits", "weights"], "vegas scores")
_SCORE_POOL = flags.DEFINE_integer("score_pool", policies.SCORE_POOL, "vegas family: the scores' "
                                   "pooling width before the top-k (odd; 1: as they are)")
_SCORE_BLOCK = flags.DEFINE_integer("score_block", policies.SCORE_BLOCK, "vegas family: the "
                                    "top-k keeps aligned blocks of this many positions (1: "
                                    "position by position)")
_SCORE_WINDOW = flags.DEFINE_integer("score_window", policies.SCORE_WINDOW, "vegas family: the "
                                     "prefix's newest positions kept whole, the rest of the "
                                     "budget ranked (0: none)")
_BATCH = flags.DEFINE_integer("batch", 64, "decode slots")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", None, "per request (default 4096 short, 1024 "
                                "long and continuation)")
_PROMPT_MIN = flags.DEFINE_integer("prompt_min_tokens", 16384, "long and continuation workloads: "
                                   "shortest prompt")
_PROMPT_MAX = flags.DEFINE_integer("prompt_max_tokens", None, "long and continuation workloads: "
                                   "longest prompt (default 32768, or less so that it and "
                                   "--max_new_tokens fit the model's context)")
_CONTEXT = flags.DEFINE_integer("context", 131072, "scale workload: tokens in the cache")
_REQUESTS = flags.DEFINE_integer("num_requests", 512, "requests in the stream (cycled data)")
_WARMUP = flags.DEFINE_float("warmup_s", 20.0, "seconds before measuring (compile excluded)")
_MEASURE = flags.DEFINE_float("measure_s", 40.0, "seconds measured per method")
_CHUNK = flags.DEFINE_list("chunk_rounds", ["8"], "rounds (or steps) per compiled call: N for "
                           "every method, or method=N entries and default=N (none=32,default=8)")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.6, "sampling (the paper's Qwen3 settings)")
_TOP_P = flags.DEFINE_float("top_p", 0.95, "")
_TOP_K = flags.DEFINE_integer("top_k", 20, "")
_SEED = flags.DEFINE_integer("seed", 0, "seed of the workload's prompts and of decoding's random "
                               "draws (the same seed and code give the same outputs)")
_IGNORE_EOS = flags.DEFINE_bool("ignore_eos", False, "stress mode: generate max_new_tokens for "
                                "every request (steady long contexts when the model would stop "
                                "early); labels, JSON and plot title say so")
_STAGGER = flags.DEFINE_bool("stagger", True, "the first B requests stop after max_new * (i + 1) "
                             "/ B tokens, so slots finish spread out as in a long-running server "
                             "(not all at once, then B refills in a row)")
_TRACE = flags.DEFINE_bool("trace", False, "scale workload: GPU time per kernel of one chunk "
                           "(jax.profiler) and per kernel family (attention, selection, GEMMs, "
                           "sorts, other) in the JSON")
_PROFILE = flags.DEFINE_bool("profile", True, "measure phase time shares (speculative methods)")
_PLOT_ONLY = flags.DEFINE_string("plot_only", None, "redraw the PNG of an existing JSON and exit")
_OUT = flags.DEFINE_string("out", None,
                           "JSON path (default benchmarks/out/throughput_<workload>.json)")
_TP = flags.DEFINE_integer("tp", 1, "tensor parallelism: devices to shard the model over")
_PLAN = flags.DEFINE_string("plan", None, "a planner profile JSON (benchmarks.plan_profile): add "
                            "rows static-best and plan (run-time refinement); not with "
                            "--workload=scale")
_FUSE = flags.DEFINE_bool("fuse_projections", True, "run the models with q/k/v and gate/up "
                          "each fused into one GEMM (jaxspec.model.transformer.fuse_projections), "
                          "as jaxspec.generate does; on one device (--tp > 1 keeps them apart)")
_FP8_DRAFTS = flags.DEFINE_bool("fp8_drafts", False, "speculative methods' draft steps multiply "
                                "by FP8 copies of the MLP weights (jaxspec.model.fp8); "
                                "verification keeps the model's weights, so the text's "
                                "distribution is unchanged")
_PROMPT_BUCKETS = flags.DEFINE_integer("prompt_buckets", PROMPT_BUCKETS, "padded prompt lengths "
                                       "per power of two (a power of two; 1: powers of two)")
_DISAGGREGATE = flags.DEFINE_bool("disaggregate", False, "prefill refills on a second device "
                                  "while the first one decodes (short and long workloads)")


def _scoring() -> policies.Scoring:
  """--score, --score_pool, --score_block and --score_window (`cli.scoring`)."""
  return cli.scoring(_SCORE.value, _SCORE_POOL.value, _SCORE_BLOCK.value, _SCORE_WINDOW.value)


def _fusing() -> bool:
  """Whether the models run with fused projections: --fuse_projections, on one device."""
  return _FUSE.value and _TP.value == 1


def _fuse(*models) -> None:
  """Fuse every model given (None skipped) when `_fusing()`."""
  if not _fusing():
    return
  for m in models:
    if m is not None:
      fuse_projections(m)


def parse_entry(entry: str) -> tuple[str, float, int]:
  """A --methods entry -> (method, ratio, gamma). 'vegas' runs at --sparsity, 'vegas@0.05' at its
  own ratio, 'vegas:6' or 'vegas@0.05:6' at its own gamma; otherwise gamma comes from --gammas:
  the entry itself, then its method, then 'default'. A draft tree (`entry_tree`) sets gamma to
  its depth."""
  entry, widths = entry_tree(entry)
  if widths is not None:
    return entry.partition(":")[0].partition("@")[0], parse_entry(entry)[1], len(widths)
  name, _, own_gamma = entry.partition(":")
  method, _, ratio = name.partition("@")
  gamma = own_gamma or for_entry(dict(item.split("=") for item in _GAMMAS.value), entry, 4)
  if method == "ssv":   # ssv@class.G names a class, not a ratio (`ssv_entry`)
    return method, _SPARSITY.value, int(gamma)
  default = {"specattn": _TOP_P_ATTN.value, "sts": _STS_BUDGET.value}.get(method, _SPARSITY.value)
  return method, float(ratio) if ratio else default, int(gamma)


def chunk_rounds(entry: str) -> int:
  """A --methods entry's rounds (or steps) per compiled call from --chunk_rounds: the entry itself,
  then its method, then 'default' (a bare N). Each method is best at its own length: a call costs
  a few ms besides its steps, and a finished slot waits for its call's end to be refilled (on
  workload (a), RESULTS.md forty-third session: vanilla decodes 4% faster at 32 steps a call than
  at 8, vegas 9% slower at 32 rounds than at 8). One-line ValueError on a bad value."""
  table = {}
  for item in _CHUNK.value:
    key, _, value = item.rpartition("=")
    try:
      table[key or "default"] = int(value)
    except ValueError:
      raise ValueError(f"--chunk_rounds: {item!r} is not N or method=N") from None
    if table[key or "default"] < 1:
      raise ValueError(f"--chunk_rounds: {item!r}: a call runs at least one round")
  return for_entry(table, entry, 8)


def for_entry(table: dict, entry: str, fallback):
  """A per-method flag's value (--gammas, --chunk_rounds) for a --methods entry: the entry's own,
  then its method's, then 'default', then `fallback`."""
  method = entry_tree(entry)[0].partition(":")[0].partition("@")[0]
  return table.get(entry, table.get(method, table.get("default", fallback)))


def entry_tree(entry: str) -> tuple[str, tuple[int, ...] | None]:
  """A --methods entry's draft tree: 'vegas/2.2.1.1' drafts the tree of widths (2, 2, 1, 1);
  without one a speculative entry takes --tree, if given. Returns (the entry without it, the
  widths or None)."""
  base, _, tree = entry.partition("/")
  if tree:
    try:
      return base, tuple(int(w) for w in tree.split("."))
    except ValueError:
      raise ValueError(f"{entry!r}: a tree is widths joined by dots, such as vegas/2.2.1.1") from None
  if _TREE.value and base.partition(":")[0].partition("@")[0] != "none":
    return base, tuple(int(w) for w in _TREE.value)
  return base, None


def ssv_entry(entry: str) -> tuple[str, int]:
  """An ssv entry's (class, group): 'ssv' takes --ssv_class and --ssv_group, 'ssv@approx' its
  own class, 'ssv@approx.2' its own class and group. One-line ValueError on a bad one."""
  name = entry_tree(entry)[0].partition(":")[0]
  spec = name.partition("@")[2]
  cls, _, group = spec.partition(".")
  cls = ssv.check_class(cls or _SSV_CLASS.value, f"{entry!r}: the SSV class")
  if not group:
    return cls, ssv.check_group(_SSV_GROUP.value, "--ssv_group")
  try:
    return cls, ssv.check_group(int(group), f"{entry!r}: the SSV group")
  except ValueError:
    raise ValueError(f"{entry!r}: an ssv entry is ssv, ssv@class or ssv@class.G with G a "
                     "positive integer") from None


def phase_times(runner: Runner, state):
  """(state, draft / verify / select seconds per round and shares) over 4 rounds of `state`."""
  state, phases = runner.time_phases(state, rounds=4, warmup=1)
  return state, {k: v for k, v in phases.items() if k.endswith(("_share", "_per_round"))}


def plan_ssv_settings(planner, model, draft_model) -> dict:
  """A planner of SSV strategies: the Runner's draft model (--draft_model; none: the NSA model
  drafts for itself) and, for the reuse classes, the refresh schedule (--ssv_schedule)."""
  if not any(s.method == "ssv" for s in planner.strategies):
    return {}
  cls = planner.strategies[0].ssv_class
  return dict(draft_model=draft_model,
              refresh=reuse_schedule(cls, model, f"--plan: SSV class {cls}"))


def reuse_schedule(cls: str, model, what: str) -> tuple[bool, ...] | None:
  """--ssv_schedule checked against `model` for a reuse class `cls`; None for the other classes.
  `what` opens the one-line error when the flag is missing."""
  if cls not in ssv.REUSE_CLASSES:
    return None
  if not _SSV_SCHEDULE.value:
    raise ValueError(f"{what} needs --ssv_schedule")
  return ssv.load_schedule(_SSV_SCHEDULE.value, model)


def make_runner(model, draft_model, entry: str, sampling: SamplingParams, stop_ids, backend: str
                ) -> Runner:
  method, ratio, g = parse_entry(entry)
  widths = entry_tree(entry)[1]
  if method == "specattn":
    layers = None
    if _SPECATTN_MAP.value:
      from jaxspec.specattn_map import load_map
      layers = load_map(_SPECATTN_MAP.value, model, draft_model).layers
    settings = dict(top_p_attn=ratio, layer_map=layers, attn_cap=_ATTN_CAP.value)
  elif method == "sts":
    budget = int(ratio)
    head_map = None
    if _STS_MAP.value:
      from jaxspec.sts_map import load_map
      head_map = load_map(_STS_MAP.value, model, draft_model, budget)
    settings = dict(sts_budget=budget, sts_block=_STS_BLOCK.value, head_map=head_map)
  elif method == "ssv":
    cls, group = ssv_entry(entry)
    settings = dict(ssv_class=cls, ssv_group=group,
                    refresh=reuse_schedule(cls, model, f"{entry!r}: ssv class {cls}"))
  else:
    settings = dict(sparsity=ratio)
  return Runner(model, method=method, gamma=None if widths else g,
                min_tokens=_MIN_TOKENS.value, scoring=_scoring(),
                draft_model=draft_model if method in (*DRAFT_MODEL_METHODS, "ssv") else None,
                sampling=sampling, stop_ids=stop_ids, backend=backend, tree=widths,
                tree_order=_TREE_ORDER.value, prompt_buckets=_PROMPT_BUCKETS.value,
                fp8_drafts=_FP8_DRAFTS.value and method != "none", **settings)


def scale_state(runner: Runner, batch: int, context: int, max_len: int, steps_total: int):
  """A state whose cache holds `context` random tokens per sequence; for self-drafting the
  policy's first selection, from random stand-in scores (random like the weights); for a draft
  model its cache filled likewise."""
  cap = capacity_for(max_len, runner.spare)
  cfg, mesh = runner.model.cfg, runner.mesh
  ds = filled_state(cfg, batch, context, cap, steps_total, mesh=mesh)
  if not runner.speculative:
    return ds
  config = runner.config(cap)
  if runner.draft_model is not None:   # a draft model's methods, and ssv (drafted by itself too)
    drafter = DraftModelState(cache=filled_state(runner.draft_model.cfg, batch, context - 1, cap,
                                                 steps_total, seed=1, mesh=mesh).cache,
                              prev_token=jnp.ones((batch,), jnp.int32))
    if runner.method in ("specattn", "sts"):
      # A copy of the lengths: the loop donates the state, and one buffer cannot go twice.
      zeros = jnp.zeros((batch,), jnp.float32)
      drafter = SpecAttnState(cache=drafter.cache, prev_token=drafter.prev_token,
                              plan=config.drafter.empty_plan(jnp.copy(ds.cache.lengths), cap),
                              kept=zeros, prefix=jnp.zeros_like(zeros))
  else:
    scores = None
    if config.drafter.prefill_scores is not None:
      scores = jax.random.normal(jax.random.PRNGKey(1), (cfg.num_layers, batch, cap), jnp.bfloat16)
    drafter = jax.jit(lambda ds, scores: config.drafter.start(None, None, None, ds, scores,
                                                              config))(ds, scores)
  return SpecState(decode=ds, drafter=drafter,
                   accept_hist=jnp.zeros((batch, config.gamma + 1), jnp.int32),
                   rounds=jnp.zeros((), jnp.int32))


def scale_run(model, draft_model, methods, batch: int, context: int, sampling: SamplingParams,
              backend: str) -> list[dict]:
  """Random weights: ms per vanilla step and per speculative round over a filled cache, the
  seconds its chunk took to compile, the draft / verify / select shares (--profile), and (--trace)
  GPU time per kernel of one compiled chunk."""
  cfg = model.cfg
  rows = []
  steps = 8
  for entry in methods:
    method, ratio, g = parse_entry(entry)
    try:
      runner = make_runner(model, draft_model, entry, sampling, (), backend)
      holder = [scale_state(runner, batch, context, context + 64 * (g + 1), steps * 64)]
      holder[0], compile_s = runner.step(holder[0], steps)   # compiles the chunk, then runs it

      def run():
        holder[0] = runner.step(holder[0], steps)[0]
        return holder[0]
      t = time_fn(run, warmup=1, reps=3) / steps
      row = dict(method=entry, gamma=g, sparsity=ratio, batch=batch, context=context,
                 ms_per_round=t * 1e3, compile_s=round(compile_s, 2),
                 note="random weights: acceptance meaningless; ms per step (none) or per "
                      "draft+verify round")
      if _TRACE.value:
        # The families sum the listed kernels: 200 list a whole chunk (the 60 most expensive
        # held 98.5-99.2% of its GPU time at the 0.5B's and 1.5B's shapes).
        row["trace"] = kernel_table(run, top=200)
        row["trace"]["per"] = f"one chunk of {steps} rounds"
        families = kernel_families(row["trace"]["kernels"])
        row["trace"]["families_us"] = families
        total = row["trace"]["device_us"] or 1.0   # 0 where no GPU stream was traced
        row["trace"]["family_shares"] = {name: round(us / total, 4)
                                         for name, us in families.items()}
      if runner.speculative and _PROFILE.value:
        holder[0], row["phases"] = phase_times(runner, holder[0])
      rows.append(row)
      holder = None  # free this cache before the next method
    except Exception as e:
      rows.append(dict(method=entry, gamma=g, error=error_text(e)))
    print({k: v for k, v in rows[-1].items() if k != "trace"}, file=sys.stderr)
    for k in rows[-1].get("trace", {}).get("kernels", [])[:12]:
      print(f"   {k['us']:>10.1f} us {k['calls']:>5}x  {k['name']}", file=sys.stderr)
    if "trace" in rows[-1]:
      print("   shares of GPU time: " + ", ".join(
          f"{name} {share:.1%}" for name, share in rows[-1]["trace"]["family_shares"].items()),
            file=sys.stderr)
  return rows


def ignored_eos(payload: dict) -> bool:
  """Whether a run's JSON was made with --ignore_eos (JSON written before the `ignore_eos` field
  existed: from its command line)."""
  if "ignore_eos" in payload:
    return bool(payload["ignore_eos"])
  given = ("--ignore_eos", "--ignore_eos=true", "--ignore_eos=True", "--ignore_eos=1")
  return any(arg in given for arg in payload.get("argv", "").split())


def row_label(row: dict, ignore_eos: bool) -> str:
  return row.get("label") or eos_label(row["method"], ignore_eos)


def plot_title(payload: dict) -> str:
  """Workload, batch, device and EOS; the model and the opt-in draft settings the run used (as
  its JSON records them); what the bar labels are."""
  title = eos_label(f"{payload['workload']}, B={payload['batch']}, {payload['device']}",
                    ignored_eos(payload))
  run = [os.path.basename(str(payload["model"]).rstrip("/"))] if payload.get("model") else []
  if payload.get("fp8_drafts"):
    run.append("FP8 drafts")
  if payload.get("score", "logits") != "logits":
    run.append(f"Collect-2 {payload['score']}")
  if payload.get("score_pool", 1) > 1:
    run.append(f"scores pooled over {payload['score_pool']}")
  if payload.get("score_block", 1) > 1:
    run.append(f"score blocks of {payload['score_block']}")
  if payload.get("score_window", 0) > 0:
    run.append(f"newest {payload['score_window']} kept")
  return (title + ("\n" + ", ".join(run) if run else "")
          + "\nlabels: accepted / round; distinct 4-grams, common requests")


def plot(payload: dict, png_path: str) -> None:
  """Bars per method: tokens/s with refills and decode-only, labelled with accepted tokens per
  round and the mean distinct-4-gram share over the requests every row finished."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  rows = [r for r in payload["rows"] if r.get("tokens_per_s")]
  if not rows:
    return
  ignore = ignored_eos(payload)
  names = [row_label(r, ignore) for r in rows]
  x = range(len(rows))
  fig, ax = plt.subplots(figsize=(max(4.4, 1.6 + 1.0 * len(rows)), 3.4))
  ax.bar([i - 0.2 for i in x], [r["tokens_per_s"] for r in rows], 0.4, label="with refills")
  ax.bar([i + 0.2 for i in x], [r["decode_only_tokens_per_s"] for r in rows], 0.4,
         label="decode only")
  for i, r in zip(x, rows):
    share = r.get("distinct_4gram_share_matched")
    text = f"{r.get('mean_accepted_tokens', 1.0):.2f}" + ("" if share is None else f"\n{share:.2f}")
    ax.text(i + 0.2, r["decode_only_tokens_per_s"], text, ha="center", va="bottom", fontsize=7)
  ax.set_ylim(0, 1.15 * max(r["decode_only_tokens_per_s"] for r in rows))   # room for labels
  ax.set_xticks(list(x), names, rotation=20, fontsize=8)
  ax.set_ylabel("tokens / s")
  ax.set_title(plot_title(payload), fontsize=8)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(png_path, dpi=100)


def summary_table(rows: list[dict], ignore_eos: bool) -> str:
  """The closing table: speed against method 'none', acceptance beside the repetition measures
  (mean distinct-4-gram share over each row's requests and over the requests all rows finished,
  the mean paired difference from vanilla's and its Wilcoxon p, share of requests that ended at
  EOS), phase shares."""
  base = next((r for r in rows if r.get("method") == "none" and r.get("tokens_per_s")), None)
  width = max([12] + [len(row_label(r, ignore_eos)) for r in rows])
  lines = [f"{'method':<{width}} {'g':>2} {'tok/s':>8} {'x none':>6} {'decode tok/s':>12} "
           f"{'x none':>6} {'acc/round':>9} {'distinct4':>9} {'matched4':>8} {'paired4':>7} "
           f"{'p':>4} {'eos':>5} "
           f"{'draft':>5} {'verify':>6} {'select':>6} {'ms/refill':>9}"]
  for r in rows:
    label = row_label(r, ignore_eos)
    if "error" in r or r.get("tokens_per_s") is None:
      lines.append(f"{label:<{width}} "
                   f"{r.get('error', 'nothing measured (stream ran out in warm-up)')[:80]}")
      continue
    ph = r.get("phases", {})
    x = r["tokens_per_s"] / base["tokens_per_s"] if base else float("nan")
    xd = (r["decode_only_tokens_per_s"] / base["decode_only_tokens_per_s"] if base
          else float("nan"))
    share, stopped = r.get("distinct_4gram_share_mean"), r.get("stopped_share")
    matched, refill = r.get("distinct_4gram_share_matched"), r.get("ms_per_refill")
    paired = r.get("distinct_4gram_share_paired")
    diff, p = ((f"{paired['mean_diff']:+.3f}", f"{paired['wilcoxon_p']:.2f}") if paired
               else ("-", "-"))
    g = "-" if r.get("gamma") is None or r["method"] == "none" else r["gamma"]   # plan: switches
    lines.append(
        f"{label:<{width}} {g:>2} "
        f"{r['tokens_per_s']:>8.0f} {x:>6.2f} {r['decode_only_tokens_per_s']:>12.0f} {xd:>6.2f} "
        f"{r.get('mean_accepted_tokens', 1.0):>9.2f} "
        f"{'-' if share is None else f'{share:.3f}':>9} "
        f"{'-' if matched is None else f'{matched:.3f}':>8} "
        f"{diff:>7} {p:>4} "
        f"{'-' if stopped is None else f'{stopped:.2f}':>5} {ph.get('draft_share', 0):>5.2f} "
        f"{ph.get('verify_share', 0):>6.2f} {ph.get('select_share', 0):>6.2f} "
        f"{'-' if refill is None else f'{refill:.0f}':>9}")
  return "\n".join(lines)


def main(argv):
  del argv
  cli.quiet_logging()
  if _PLOT_ONLY.value:
    try:
      payload = read_throughput_json(_PLOT_ONLY.value)
    except (OSError, ValueError) as e:
      cli.fail("benchmarks.throughput", f"--plot_only={_PLOT_ONLY.value}: {e}")
    matched_repetition(payload["rows"])   # JSONs older than the field
    plot(payload, _PLOT_ONLY.value.removesuffix(".json") + ".png")
    return
  prog = "benchmarks.throughput"
  workload, ignore_eos = _WORKLOAD.value, _IGNORE_EOS.value
  if workload in ("long", "continuation"):   # before the model loads
    try:
      workloads.check_prompt_range(_PROMPT_MIN.value,
                                   _PROMPT_MAX.value or workloads.PASSAGE_MAX,
                                   workloads.LONG_ROOM if workload == "long" else 0)
    except ValueError as e:
      cli.fail(prog, str(e))
  try:
    make_mesh(_TP.value)   # too few devices: one line before anything loads
    check_prompt_buckets(_PROMPT_BUCKETS.value)
    _scoring()
    for entry in _METHODS.value:
      chunk_rounds(entry)
  except ValueError as e:
    cli.fail(prog, str(e))
  planner = None
  if _PLAN.value:
    if workload == "scale":
      cli.fail(prog, "--plan needs real prompts and acceptance: not with --workload=scale")
    from jaxspec.engine import planner as planning
    try:
      planner = planning.Planner.load(_PLAN.value)
    except (OSError, ValueError) as e:
      cli.fail(prog, str(e))
  backend = default_backend()
  out_path = _OUT.value or f"benchmarks/out/throughput_{workload}.json"
  sampling = SamplingParams(_TEMPERATURE.value, _TOP_K.value, _TOP_P.value)
  header = dict(device=device_name(), commit=git_commit(), model=_MODEL.value,
                workload=workload, batch=_BATCH.value, sparsity=_SPARSITY.value,
                min_tokens=_MIN_TOKENS.value, backend=backend, tp=_TP.value,
                sampling=dict(temperature=sampling.temperature, top_p=sampling.top_p,
                              top_k=sampling.top_k, seed=_SEED.value),
                disaggregate=_DISAGGREGATE.value, attn_cap=_ATTN_CAP.value,
                fuse_projections=_fusing(), fp8_drafts=_FP8_DRAFTS.value,
                score=_SCORE.value, score_pool=_SCORE_POOL.value, score_block=_SCORE_BLOCK.value,
                score_window=_SCORE_WINDOW.value,
                prompt_buckets=_PROMPT_BUCKETS.value,
                argv=" ".join(sys.argv),
                xla_flags=os.environ.get("XLA_FLAGS", ""))
  if workload == "scale":
    model, _ = load(_MODEL.value, _TP.value)
    draft_model = load(_DRAFT_MODEL.value, _TP.value)[0] if _DRAFT_MODEL.value else None
    _fuse(model, draft_model)
    bw, rates_gbps = copy_ceiling()
    header.update(copy_gbps=bw / 1e9, copy_rates_gbps=rates_gbps,
                  eos="not applicable: random weights, a fixed number of steps per call")
    rows = scale_run(model, draft_model, _METHODS.value, _BATCH.value, _CONTEXT.value, sampling,
                     backend)
    write_json(out_path, dict(header, rows=rows))
    return
  from jaxspec.io.loading import load_model
  loaded = load_model(_MODEL.value, dtype=jnp.bfloat16, tp=_TP.value)
  draft_model = None
  if _DRAFT_MODEL.value:
    draft = load_model(_DRAFT_MODEL.value, dtype=jnp.bfloat16, tp=_TP.value)
    check_draft_pair(loaded, draft, _MODEL.value, _DRAFT_MODEL.value)
    draft_model = draft.model
  _fuse(loaded.model, draft_model)
  max_new = _MAX_NEW.value or DEFAULT_MAX_NEW[workload]
  try:
    contexts = [requests.context_limit(m.cfg) for m in (loaded.model, draft_model) if m]
    prompt_max = workloads.prompt_max_tokens(_PROMPT_MAX.value, min(contexts), max_new)
    prompts = workloads.build(workload, loaded.tokenizer, _REQUESTS.value, _PROMPT_MIN.value,
                              prompt_max, _SEED.value)
  except ValueError as e:   # passages longer than the context, or than the book
    cli.fail(prog, str(e))
  stop_ids = () if ignore_eos else loaded.stop_ids
  header.update(eos_settings(ignore_eos, loaded.stop_ids), max_new_tokens=max_new,
                prompt_tokens=dict(min=min(map(len, prompts)), max=max(map(len, prompts))))
  capacity_len = max(len(p) for p in prompts) + max_new
  rows = []
  entries = list(_METHODS.value) + (["static-best", "plan"] if planner else [])
  for entry in entries:
    outputs = {}
    try:
      if entry in ("static-best", "plan"):
        # static-best: the profile's choice per bucket, never refined (no switches allowed).
        refine = planner.refinement if entry == "plan" else dataclasses.replace(
            planner.refinement, max_switches=0)
        runner = Runner(loaded.model, min_tokens=_MIN_TOKENS.value, scoring=_scoring(),
                        sampling=sampling, stop_ids=stop_ids,
                        backend=backend,
                        prompt_buckets=_PROMPT_BUCKETS.value,
                        planner=planning.Planner(planner.profile, planner.precision, refine),
                        **plan_ssv_settings(planner, loaded.model, draft_model))
        ratio = None
      else:
        ratio = parse_entry(entry)[1]
        runner = make_runner(loaded.model, draft_model, entry, sampling, stop_ids, backend)
      row, state = runner.serve(prompts, _BATCH.value, max_new, max_len=capacity_len,
                                chunk=chunk_rounds(entry), warmup_s=_WARMUP.value,
                                measure_s=_MEASURE.value, seed=_SEED.value, stagger=_STAGGER.value,
                                on_finish=outputs.__setitem__, disaggregate=_DISAGGREGATE.value)
      row.update(method=entry, label=eos_label(entry, ignore_eos), sparsity=ratio,
                 chunk_rounds=chunk_rounds(entry))
      if not _DISAGGREGATE.value and (row.get("idle_slot_share") or 0) > 0.01:
        # Without --disaggregate a slot idles only when the stream has run out, and idle slots
        # still ride along in every step: faster methods run dry sooner and look slower.
        print(f"throughput: {entry}: the request stream ran out, "
              f"{row['idle_slot_share']:.0%} of slot-chunks idle; raise --num_requests",
              file=sys.stderr)
      # Repetition is judged on the text, whatever the stop rule: a trailing EOS counts as ended.
      row.update(repetition_summary(outputs, loaded.stop_ids))
      if _PROFILE.value and runner.speculative and runner.planner is None:
        # Phase shares on the serving batch as it stands at the end (steady state, mixed lengths);
        # the state it returns is dropped here, or its caches would stay on the device while the
        # next method allocates its own (an out-of-memory at B=32 x 32K with a draft model).
        row["phases"] = phase_times(runner, state)[1]
      state = runner = None
    except Exception as e:
      row = dict(method=entry, label=eos_label(entry, ignore_eos),
                 error=error_text(e, 500))
    rows.append(row)
    print({k: v for k, v in row.items() if k != "per_request"}, file=sys.stderr)
    matched = matched_repetition(rows)
    vanilla = next((r for r in rows if r.get("method") == "none"), None)
    for r in rows:
      if vanilla is not None and r is not vanilla and "per_request" in r:
        r["distinct_4gram_share_paired"] = paired_repetition(vanilla, r)
    # Rewritten after every method: keep what finished if a later method dies.
    write_json(out_path, dict(header, rows=rows, repetition_matched_requests=matched))
  plot(dict(header, rows=rows), out_path.removesuffix(".json") + ".png")
  print("\n" + summary_table(rows, ignore_eos))


if __name__ == "__main__":
  app.run(main)
