"""STS, Speculative Token Sparsity (`../shared/papers/sts.txt`): draft-model speculative decoding
whose verification reads, per target head, only the keys the draft model's mapped head attended to.

This CHANGES the target's output: the target verifies with a masked (sparse) attention, so the
text is the masked target's, not the dense target's. Speculative sampling stays exact with respect
to that masked target: greedy output equals greedy decoding of the masked target (below), sampled
output follows its distribution. The full KV cache is kept; only what verification reads is cut.

It is SpecAttn's round (`jaxspec.drafting.specattn`: the same drafter skeleton, row alignment and
union) with a per-head selection. One round, for a sequence whose target cache holds [0, n):
  draft    the draft model's gamma dense steps return, per head of each draft layer the map reads
           (`STSConfig.score_layers`), the attention weights of the row that sampled each draft
           (positions n + s, s = 0..gamma-1, over keys [0, n + s]): per KV head the mean over its
           query group (granularity 'kv', the default), or per query head ('q'; the pure-JAX
           reference collects these, the kernel does not).
  mask     every target layer j and head h reads its mapped draft head (`jaxspec.sts_map`, one map
           per budget k; without one the proportional map, draft layer floor(j * Ld / Lt) and head
           floor(h * Hd / Ht)). Per row: the top-k keys of that draft head (`topk_select`, exact,
           ties to the lower position). The gamma rows' sets are united, positions >= n dropped
           (the dense tail holds them), and when the union exceeds k the k keys with the largest
           weight summed over the rows are kept (`specattn.capped_union`): each target KV head
           reads at most k prefix keys. At 'q' granularity a KV head's list unites the rows of
           its G query heads' draft heads, capped at k the same way.
           Block variant (`block` = P > 1, the paper's §4.3): the same over pages of P tokens (a
           page's weight is the sum of its keys' weights; k // P pages per row and after the
           union), the kept pages' tokens below n. Token granularity is P = 1 of the same code.
  verify   one target pass over [last_token, d_1..d_gamma], every layer through `sparse_attention`
           with one index list per KV head ([B, Hkv, K]) plus the dense tail [n, n + t] for row t.
           Softmax over the visible keys only.

Costs: a KV head's list holds at most k positions (k // P pages), so verification gathers k rows
of K and V per KV head and layer, at either granularity, plus the gamma + 1 tail rows. The draft's
score collection adds, per step and collecting layer, its stored logits written and read back
(`verify_attention`'s `weights_store`: ~25% of that layer's attention at the 0.5B's shapes with
the logits in float32; they are stored in float16 now, half the bytes, not yet timed); the
selection runs each distinct draft head's top-k and each distinct tuple of rows' union once.

Row alignment and greedy equality are SpecAttn's (see its module docstring): the mask is a
per-round object made from the draft rows of that round, so the masked target is an autoregressive
decoder with a history-dependent mask; tests/test_sts.py builds it independently, one target token
per step.

The target's KV cache can live in host memory, each round copying only the rows its
verification reads (`jaxspec.engine.offload`, `Runner(..., kv_offload=...)`).

STS-PD, the sparse prefill of an appended turn, is `jaxspec.drafting.sts_prefill` (`Runner.extend`);
its selection is `head_select`, `head_union`'s core with each row's key range given.
Not built: draft trees, tensor parallelism.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec.drafting.specattn import SpecAttnDrafter, capped_union, kernel_or_xla, row_sets
from jaxspec.sts_map import GRANULARITIES, check_budget
from jaxspec.engine.config import RunConfig
from jaxspec.model.attention import LayerMapped, ScoreSpec
from pallas_kernels import topk_select as _topk


TOPK_METHODS = ("auto", "threshold", "pallas")


def proportional_heads(target_layers: int, target_heads: int, draft_layers: int,
                       draft_heads: int) -> tuple[tuple[tuple[int, int], ...], ...]:
  """The map without calibration: target (j, h) -> (floor(j * Ld / Lt), floor(h * Hd / Ht))."""
  return tuple(tuple((j * draft_layers // target_layers, h * draft_heads // target_heads)
                     for h in range(target_heads)) for j in range(target_layers))


@dataclasses.dataclass(frozen=True)
class STSConfig:
  """STS's per-pair settings, bound once (static under jit).

  heads: per target layer, per target head (KV heads at granularity 'kv', query heads at 'q'), the
  mapped (draft layer, draft head); draft_heads: the draft's heads per layer at that granularity;
  target_kv_heads: the target's KV heads; budget: k, the prefix keys each target KV head reads per
  round, >= block; block: P, tokens per page (1: token granularity); topk_method: the per-row
  top-k's `topk_select` method, 'auto' (default: its Pallas kernel compiled on a GPU at P = 1 with
  bf16 scores, else the XLA 'threshold' search on a GPU and `lax.top_k` elsewhere; the same set),
  'threshold' or 'pallas' (P = 1)."""
  heads: tuple[tuple[tuple[int, int], ...], ...]
  draft_heads: int
  target_kv_heads: int
  budget: int
  block: int = 1
  granularity: str = "kv"
  topk_method: str = "auto"

  def __post_init__(self):
    check_budget(self.budget)
    if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 1:
      raise ValueError(f"the STS block (tokens per page) must be an integer >= 1, got "
                       f"{self.block!r}")
    if self.block > self.budget:
      raise ValueError(f"the STS budget ({self.budget}) must hold at least one page of "
                       f"{self.block} tokens")
    if self.granularity not in GRANULARITIES:
      raise ValueError(f"granularity must be one of {', '.join(GRANULARITIES)}, got "
                       f"{self.granularity!r}")
    if self.topk_method not in TOPK_METHODS:
      raise ValueError(f"the STS top-k method must be one of {', '.join(TOPK_METHODS)}, got "
                       f"{self.topk_method!r}")
    if self.topk_method == "pallas" and self.block > 1:
      raise ValueError("the STS top-k method 'pallas' ranks bf16 token scores: block must be 1 "
                       "(page sums are float32)")

  @property
  def group(self) -> int:
    """Mapped target heads per target KV head (1 at 'kv', G at 'q')."""
    return len(self.heads[0]) // self.target_kv_heads

  @property
  def slots(self) -> tuple[int, ...]:
    """Per target layer its selection in the plan: every layer sparse, each its own."""
    return tuple(range(len(self.heads)))

  @property
  def score_layers(self) -> tuple[int, ...]:
    """The draft layers some target head reads, ascending: the only ones whose draft steps
    collect weights (each adds about a quarter to that layer's attention at a draft step)."""
    return tuple(sorted({i for layer in self.heads for i, _ in layer}))

  @property
  def table(self) -> tuple[int, ...]:
    """Per target (layer, head), layer-major: its draft head's flat index among the collected
    rows, (place of its layer in `score_layers`) * Hd + head."""
    place = {i: u for u, i in enumerate(self.score_layers)}
    return tuple(place[i] * self.draft_heads + e for layer in self.heads for i, e in layer)

  def pages(self, capacity: int) -> int:
    """Pages kept per row and per list: k // P, at most the cache's pages."""
    return min(self.budget // self.block, -(-capacity // self.block))

  def k_max(self, capacity: int) -> int:
    return min(self.pages(capacity) * self.block, capacity)

  @property
  def draft_scores(self) -> ScoreSpec:
    """The draft steps collect, per head, the weights of the row that sampled the draft, in the
    draft layers the map reads."""
    return ScoreSpec("weights", rows=(-1,), heads=self.granularity, layers=self.score_layers)


def head_union(rows: jax.Array, start: jax.Array, spec: STSConfig, capacity: int,
               interpret: bool = False) -> tuple[jax.Array, jax.Array]:
  """rows [gamma, Ls, B, Hd, S]: the draft's per-head rows, in the layers `spec.score_layers`
  (Ls of them, as `draft_scores` collects), of positions start + s over keys
  [0, start + s] -> (indices [Lt, B, Hkv, K] ascending, counts [Lt, B, Hkv]), K = `k_max`: per
  target layer and KV head, its mapped draft heads' per-row top-k pages, united over the rows (and
  over a KV group's query heads at 'q'), below start, capped at k // P pages, as token positions."""
  seen = start[None] + jnp.arange(rows.shape[0], dtype=jnp.int32)[:, None] + 1   # keys per row
  return head_select(rows, seen, start, spec, capacity, interpret)


def head_select(rows: jax.Array, seen: jax.Array, limit: jax.Array, spec: STSConfig,
                capacity: int, interpret: bool = False) -> tuple[jax.Array, jax.Array]:
  """`head_union` with each row's range given: rows [R, Ls, B, Hd, S], seen [R, B] (row r ranks
  the keys [0, seen[r, b]) only, its weights past them taken as 0; 0 leaves the row out), limit
  [B] (the positions kept: those below it) -> (indices [Lt, B, Hkv, K], counts [Lt, B, Hkv])."""
  g, ld, b, hd, s = rows.shape
  p, kp = spec.block, spec.pages(capacity)
  n_pages = -(-s // p)
  used = tuple(sorted(set(spec.table)))       # each draft head's top-k is computed once
  w = rows.swapaxes(2, 3).reshape(g, ld * hd, b, s)[:, jnp.asarray(used)]
  in_range = jnp.arange(s) < seen[:, None, :, None]
  w = jnp.where(jnp.isfinite(w) & (w > 0) & in_range, w, 0)
  method = kernel_or_xla(spec.topk_method, w, interpret, kernel_fits=p == 1, reference="top_k")
  if method == "pallas":          # bf16 token scores ranked as they are (P = 1: pages are tokens)
    pw = w.astype(jnp.bfloat16)
  else:
    pw = jnp.pad(w.astype(jnp.float32), ((0, 0),) * 3 + ((0, n_pages * p - s),))
    pw = pw.reshape(g, len(used), b, n_pages, p).sum(-1)                        # [g, N, B, Pn]
  page_len = jnp.broadcast_to(-(-seen[:, None] // p), (g, len(used), b)).reshape(-1)
  take = jnp.minimum(page_len, kp)
  idx = _topk.topk_select(pw.reshape(-1, n_pages), page_len, take, k_max=kp, method=method,
                          interpret=interpret and method == "pallas")
  keep = row_sets(idx, take, n_pages).reshape(g, len(used), b, n_pages)
  # Per target (layer, KV head): its draft rows, a KV group's G query heads' side by side. Units
  # reading the same draft rows (at 'kv', every target head mapped to one draft head) get the same
  # list, so each distinct tuple of rows is united once.
  units, grp = len(spec.table) // spec.group, spec.group
  unit_rows = [tuple(used.index(i) for i in spec.table[u * grp:(u + 1) * grp])
               for u in range(units)]
  distinct = sorted(set(unit_rows))
  sel = jnp.asarray(distinct)                                                   # [D, grp]

  def per_tuple(x):
    return x[:, sel].swapaxes(1, 2).reshape(g * grp, len(distinct), b, n_pages)

  pidx, pcnt = capped_union(per_tuple(keep), per_tuple(pw), -(-limit // p), kp)   # [D, B, kp]
  at = jnp.asarray([distinct.index(r) for r in unit_rows])
  pidx, pcnt = pidx[at], pcnt[at]                                               # [U*Hkv, B, ...]
  tokens = (pidx[..., None] * p + jnp.arange(p)).reshape(units, b, kp * p)
  # Pages ascend, so the positions below limit form a prefix (only the last page can cross it).
  in_list = jnp.broadcast_to(jnp.arange(kp)[:, None] < pcnt[..., None, None], (units, b, kp, p))
  valid = in_list.reshape(units, b, kp * p) & (tokens < limit[:, None])
  k = spec.k_max(capacity)
  idx = jnp.where(valid, tokens, 0)[..., :k]
  cnt = valid.sum(-1, dtype=jnp.int32)
  lt, hkv = len(spec.heads), spec.target_kv_heads
  return (idx.reshape(lt, hkv, b, k).swapaxes(1, 2), cnt.reshape(lt, hkv, b).swapaxes(1, 2))


@dataclasses.dataclass(frozen=True)
class STSDrafter(SpecAttnDrafter):
  """SpecAttn's round with STS's per-head selection (`head_union`); every target layer sparse."""
  name: str = "sts"
  spec: STSConfig | None = None

  @property
  def draft_scores(self) -> ScoreSpec:
    return self.spec.draft_scores

  def empty_plan(self, lengths: jax.Array, capacity: int) -> LayerMapped:
    lt, b = len(self.spec.heads), lengths.shape[0]
    hkv, k = self.spec.target_kv_heads, self.spec.k_max(capacity)
    return LayerMapped(indices=jnp.zeros((lt, b, hkv, k), jnp.int32),
                       counts=jnp.zeros((lt, b, hkv), jnp.int32), tail_start=lengths,
                       slots=self.spec.slots)

  def select(self, scores: jax.Array, start: jax.Array, config: RunConfig
             ) -> tuple[jax.Array, jax.Array]:
    return head_union(scores, start, self.spec, config.capacity,
                      interpret=config.backend != "pallas")
