"""SpecAttn (arXiv 2510.27641): draft-model speculative decoding whose verification attends sparsely,
over the keys the draft model's own attention pointed at.

This CHANGES the target's output: the target verifies with a masked (sparse) attention, so the
text is the masked target's, not the dense target's (the paper's "approximate verification").
Speculative sampling stays exact with respect to that masked target: greedy output equals greedy
decoding of the masked target (below), sampled output follows its distribution.

One round, for a sequence whose target cache holds [0, n):
  draft    the draft model's gamma dense steps (`DraftModelDrafter`) also return, per draft layer,
           the attention weights (mean over query heads) of the row that sampled each draft: the
           row of position n + s (s = 0..gamma-1: last_token, d_1..d_{gamma-1}) over keys
           [0, n + s].
  mask     for every target layer j >= `dense_layers` (2: the paper keeps the first two dense), the
           rows of draft layer f(j) (`jaxspec.specattn_map`): per row the smallest set of keys
           holding p of its mass (`pallas_kernels.topp_select`, exact, sorting-free: its Pallas
           kernel on the Pallas backend, the XLA 'threshold' search elsewhere, the same set), the
           gamma sets united, positions >= n dropped (the dense tail holds them).
           When the union exceeds the static cap K_max (`SpecAttnConfig.cap`, default the cache
           capacity: no cap), the K_max positions with the largest summed weight over the gamma
           rows are kept (`topk_select`, ties to the lower position). Target layers reading the
           same draft layer share one index list.
  verify   one target pass over [last_token, d_1..d_gamma]: layers < dense_layers dense, the rest
           `sparse_attention` over the united list (shared by all heads and all gamma + 1 rows) plus
           the dense tail [n, n + t] for row t. Softmax over the visible keys only, i.e. the
           attention is renormalised over the kept set.

Row alignment and the greedy-equality property. The mask is a per-round object: every row of a
round's verification sees the same list, made from the draft rows of that round. So the "masked
target" whose greedy decoding SpecAttn reproduces is defined round by round: at a round start n
the draft model drafts gamma tokens greedily, the mask M(n) is built as above, and the target
emits tokens one at a time under M(n) plus the dense tail from n, continuing while it agrees with
the drafts (at most gamma + 1 tokens); the next round starts after the first disagreement. Round
boundaries are a function of the token history alone, so this is an ordinary autoregressive
decoder with a history-dependent mask, and greedy speculative output equals it exactly in float32
(tests/test_specattn.py builds it independently, one token per target step, with the sorting
reference of top-p). Using the draft rows that sampled d_1..d_gamma (not the rewritten row n - 1
of the first draft step) makes every row come from the draft's view of the same round, and each
key set a row's draft query chose is united over the whole round, as in the paper.

Not supported: draft trees (one list per round is built from a chain's rows), tensor parallelism
(the top-p select is not placed under shard_map).
"""
from __future__ import annotations

import dataclasses
import numbers

import jax
import jax.numpy as jnp
from flax import struct

from jaxspec.drafting.draft_model import DraftModelDrafter
from jaxspec.engine.config import RunConfig
from jaxspec.engine.state import DecodeState, SpecState
from jaxspec.model.attention import Dense, LayerMapped, ScoreSpec
from jaxspec.model.kv_cache import KVCache
from jaxspec.model.transformer import Transformer
from pallas_kernels import topk_select as _topk
from pallas_kernels import topp_select as _topp

TOPP_METHODS = ("auto", "threshold", "pallas", "sort", "bisect10")
DEFAULT_TOP_P = 0.97
DENSE_LAYERS = 2   # the paper's: early layers' attention is diffuse (attention sinks)


def kernel_or_xla(method: str, scores: jax.Array, interpret: bool, kernel_fits: bool = True, *,
                  reference: str) -> str:
  """A selection method as given, 'auto' resolved: on a GPU (not interpreted), 'pallas' where its
  kernel takes the scores (bf16, and `kernel_fits`), else the XLA 'threshold' search; elsewhere
  `reference`, the sorting reference (on XLA:CPU it compiles and runs several times faster than
  the threshold search's sibling reductions). All return the same set."""
  if method != "auto":
    return method
  if interpret or jax.default_backend() != "gpu":
    return reference
  return "pallas" if kernel_fits and scores.dtype == jnp.bfloat16 else "threshold"


def check_top_p(p) -> float:
  """p as a float when it is a number in (0, 1]; else a one-line ValueError."""
  if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0 < p <= 1:
    raise ValueError(f"top_p_attn (SpecAttn's kept attention mass) must be in (0, 1], got {p!r}")
  return float(p)


@dataclasses.dataclass(frozen=True)
class SpecAttnConfig:
  """SpecAttn's per-pair settings, bound once (static under jit).

  layers: f(j), the draft layer each target layer reads (`jaxspec.specattn_map`); top_p: the kept
  attention mass per draft row, in (0, 1]; cap: K_max, the static length of a united index list
  (None: the cache capacity, i.e. no cap); dense_layers: the first target layers kept dense;
  topp_method: `topp_select`'s method, or 'auto' (default): 'pallas' compiled on a GPU with
  bf16 scores (2.2x the XLA 'threshold' search at the end-to-end shape, benchmarks/RESULTS.md),
  else 'threshold' on a GPU and 'sort' elsewhere (`kernel_or_xla`); all return the same set.
  """
  layers: tuple[int, ...]
  top_p: float = DEFAULT_TOP_P
  cap: int | None = None
  dense_layers: int = DENSE_LAYERS
  topp_method: str = "auto"

  def __post_init__(self):
    object.__setattr__(self, "top_p", check_top_p(self.top_p))
    object.__setattr__(self, "layers", tuple(int(i) for i in self.layers))
    if self.cap is not None and (isinstance(self.cap, bool) or not isinstance(self.cap, int)
                                 or self.cap < 1):
      raise ValueError(f"the SpecAttn index cap must be an integer >= 1, got {self.cap!r}")
    if not isinstance(self.dense_layers, int) or self.dense_layers < 0:
      raise ValueError(f"dense_layers must be a non-negative integer, got {self.dense_layers!r}")
    if self.dense_layers >= len(self.layers):
      raise ValueError(f"dense_layers ({self.dense_layers}) must leave a sparse layer of the "
                       f"target's {len(self.layers)}")
    if self.topp_method not in TOPP_METHODS:
      raise ValueError(f"top-p method must be one of {', '.join(TOPP_METHODS)}, got "
                       f"{self.topp_method!r}")

  @property
  def draft_layers(self) -> tuple[int, ...]:
    """The draft layers some sparse target layer reads, ascending (one index list each)."""
    return tuple(sorted(set(self.layers[self.dense_layers:])))

  @property
  def slots(self) -> tuple[int, ...]:
    """Per target layer: -1 (dense) or its draft layer's place in `draft_layers`."""
    used = self.draft_layers
    return tuple(-1 if j < self.dense_layers else used.index(i) for j, i in enumerate(self.layers))

  def k_max(self, capacity: int) -> int:
    return capacity if self.cap is None else min(self.cap, capacity)


def row_sets(idx: jax.Array, cnt: jax.Array, size: int) -> jax.Array:
  """Index lists idx [N, K] with cnt [N] valid entries -> membership [N, size] bool."""
  n, k = idx.shape
  valid = jnp.arange(k)[None] < cnt[:, None]
  return jnp.zeros((n, size + 1), bool).at[jnp.arange(n)[:, None],
                                           jnp.where(valid, idx, size)].set(True)[:, :size]


def capped_union(keep: jax.Array, weights: jax.Array, limit: jax.Array, k_max: int
                 ) -> tuple[jax.Array, jax.Array]:
  """keep [R, N, B, S] bool (R rows' selected positions), weights [R, N, B, S] (their attention
  weights), limit [B] -> (indices [N, B, k_max] ascending, counts [N, B]): the union over the R
  rows restricted to positions < limit, at most k_max of them: when it is longer, the k_max with
  the largest weight summed over the R rows (`topk_select`, ties to the lower position)."""
  _, n, b, s = keep.shape
  keep = keep.any(axis=0) & (jnp.arange(s) < limit[:, None])                   # [N, B, S]
  w = weights.astype(jnp.float32)
  total = jnp.where(keep, jnp.where(jnp.isfinite(w) & (w > 0), w, 0.0).sum(axis=0), -jnp.inf)
  count = jnp.minimum(keep.sum(-1, dtype=jnp.int32), k_max).reshape(-1)
  idx = _topk.topk_select(total.reshape(n * b, s), jnp.broadcast_to(limit, (n, b)).reshape(-1),
                          count, k_max=k_max)
  return idx.reshape(n, b, k_max), count.reshape(n, b)


def kept_union(rows: jax.Array, start: jax.Array, spec: SpecAttnConfig, k_max: int,
               interpret: bool = False) -> tuple[jax.Array, jax.Array]:
  """rows [gamma, U, B, S]: the draft rows of positions start + s (s = 0..gamma-1) over keys
  [0, start + s], for the U draft layers in use -> (indices [U, B, k_max] ascending, counts [U, B]):
  the union over s of each row's top-p set, restricted to positions < start, at most k_max of them
  (the largest summed weight first when the union is longer)."""
  g, u, b, s = rows.shape
  lengths = jnp.broadcast_to(start[None, None] + jnp.arange(g, dtype=jnp.int32)[:, None, None] + 1,
                             (g, u, b)).reshape(-1)
  method = kernel_or_xla(spec.topp_method, rows, interpret, reference="sort")
  idx, cnt = _topp.topp_select(rows.reshape(-1, s), lengths, p=spec.top_p, k_max=k_max,
                               method=method, interpret=interpret and method == "pallas")
  return capped_union(row_sets(idx, cnt, s).reshape(g, u, b, s), rows, start, k_max)


@struct.dataclass
class SpecAttnState:
  cache: KVCache          # the draft model's cache (as `DraftModelState`)
  prev_token: jax.Array   # [B] int32: the token at target position lengths - 1
  plan: LayerMapped       # the target's verification plan for the round just drafted
  kept: jax.Array         # [B] f32: summed over active rounds, the prefix keys a sparse layer
                          # reads (mean over the sparse target layers; STS: and their KV heads)
  prefix: jax.Array       # [B] f32: summed over the same rounds, the prefix length


@dataclasses.dataclass(frozen=True)
class SpecAttnDrafter(DraftModelDrafter):
  """A draft model drafts (as `DraftModelDrafter`) and its attention picks the target's keys.

  The round's skeleton (draft with scores, build the plan, verify over it) is shared with STS
  (`jaxspec.drafting.sts.STSDrafter`), which overrides the scores it collects (`draft_scores`),
  the selection (`select`) and the plan's shapes (`empty_plan`)."""
  name: str = "specattn"
  spec: SpecAttnConfig | None = None

  @property
  def draft_scores(self) -> ScoreSpec:
    """The weights of the row that sampled each draft (a step's last row), in the draft layers
    the map reads only: 'weights' added about a quarter to a collecting layer's attention at a
    draft step with the stored logits in float32 (benchmarks/RESULTS.md; float16 now, half the
    bytes, not yet timed)."""
    return ScoreSpec("weights", rows=(-1,), layers=self.spec.draft_layers)

  def start(self, draft: Transformer, prompts: jax.Array, prompt_lens: jax.Array,
            state: DecodeState, scores: None, config: RunConfig) -> SpecAttnState:
    dm = super().start(draft, prompts, prompt_lens, state, scores, config)
    return SpecAttnState(cache=dm.cache, prev_token=dm.prev_token,
                         plan=self.empty_plan(prompt_lens, config.capacity),
                         kept=jnp.zeros(prompt_lens.shape, jnp.float32),
                         prefix=jnp.zeros(prompt_lens.shape, jnp.float32))

  def empty_plan(self, lengths: jax.Array, capacity: int) -> LayerMapped:
    """A plan of the loop's shapes selecting nothing (every round's draft step replaces it)."""
    u, b, k = len(self.spec.draft_layers), lengths.shape[0], self.spec.k_max(capacity)
    return LayerMapped(indices=jnp.zeros((u, b, k), jnp.int32),
                       counts=jnp.zeros((u, b), jnp.int32), tail_start=lengths,
                       slots=self.spec.slots)

  def select(self, scores: jax.Array, start: jax.Array, config: RunConfig
             ) -> tuple[jax.Array, jax.Array]:
    """The round's draft scores [gamma, U, B, S] (`draft_scores`: the U draft layers in use) ->
    the plan's (indices, counts)."""
    return kept_union(scores, start, self.spec, self.spec.k_max(config.capacity),
                      interpret=config.backend != "pallas")

  def draft(self, target: Transformer, draft: Transformer, state: SpecState, config: RunConfig
            ) -> tuple[SpecState, jax.Array, jax.Array | None]:
    state, drafts, probs, scores = self.run_draft(draft, state, config,
                                                  Dense(scores=self.draft_scores))
    ds = state.decode
    start = jnp.minimum(ds.cache.lengths, ds.cache.capacity - config.reserve)   # as run_draft's
    idx, cnt = self.select(scores, start, config)
    plan = state.drafter.plan.replace(indices=idx, counts=cnt, tail_start=start)
    sparse = [u for u in self.spec.slots if u >= 0]
    active = ~ds.done
    dm = state.drafter
    dm = dm.replace(plan=plan,
                    kept=dm.kept + jnp.where(
                        active, cnt[jnp.asarray(sparse)].reshape(len(sparse), start.shape[0],
                                                                 -1).mean((0, 2)), 0.0),
                    prefix=dm.prefix + jnp.where(active, start, 0).astype(jnp.float32))
    return state.replace(drafter=dm), drafts, probs

  @staticmethod
  def kept_share(state: SpecAttnState) -> float:
    """The share of the prefix keys the sparse target layers read, over every active round so
    far (1 - it is their KV reduction; the new tokens' tail and the dense layers not counted)."""
    kept, prefix = jax.device_get((state.kept.sum(), state.prefix.sum()))
    return float(kept / prefix) if prefix > 0 else float("nan")

  def verify_plan(self, state: SpecState) -> LayerMapped:
    """The round's plan: dense layers, the rest over its index lists plus the dense tail."""
    return state.drafter.plan
