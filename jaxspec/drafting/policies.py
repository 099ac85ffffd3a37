"""KV selection policies for self-drafting: which cache entries a draft step attends to.

One small interface (`SelectionPolicy`), one frozen, hashable dataclass per policy (static under
jit). Every round the loop asks a policy two things:

  verify_scores          the `ScoreSpec` the full-attention verification pass must also collect
                         (None: no scores)
  select_kv(cache, scores, first_row, accepted) -> the draft plan
                         runs after verification (and once after prefill), with the lengths
                         already moved to the accepted prefix; returns the attention plan every
                         draft step of the next round uses (`Sparse`, `QuestPages` or `Dense`)

A sparse plan is "selected prefix positions + a dense tail": the drafts see indices[:counts] of the
cache before `tail_start`, plus every position from `tail_start` on (the tokens accepted since the
scores were taken, and the drafts themselves). `first_row` is the cache position of the first
query row the scores came from, so the keys every collected row saw are [0, first_row].

Policies (token budget k = clamp(ceil(ratio * prefix), min_tokens, prefix), `budget`):
  vegas       Collect-2-Query scores (first draft row + bonus row, mean over query heads) of the
              last verification -> per-layer top-k over the keys both rows saw, as its
              `Scoring` says: `kind` 'logits' (the paper's choice) or 'weights'; `pool` > 1
              first replaces each position's score by the largest within pool // 2 positions
              of it (`pool_scores`), so that the top-k keeps spans around the keys that scored
              high rather than the keys alone (the paper takes the scores as they are: 1);
              `block` ranks aligned blocks of that many positions by their best score and
              keeps whole blocks (`per_layer_topk`): the same token budget in contiguous
              spans, from a top-k over block times fewer candidates (the paper ranks
              positions: 1, the default). Model-dependent (benchmarks/RESULTS.md, fifty-seventh
              session): 8 decoded the 0.5B 5.9% faster on an H200, the 1.5B as fast, and cost
              SmolLM2-135M 9.5% of its tokens a round teacher-forced at 4K. `window` > 0 keeps
              the prefix's newest `window` positions by position and ranks the rest of the
              budget (the paper ranks them all: 0). Lossless at any setting.
  vegas-all   the same over all gamma + 1 rows (SparseSpec-style ablation); vegas-last pools and
              blocks too.
  vegas-last  only the last accepted token's row. The corrected/bonus token itself (the paper's
              "last accepted token", its App. A) is not a query of this verification (it is fed
              next round), so we take the row that produced it: row a (input d_a, or the previous
              last token when a = 0), the newest token in the cache, which saw the whole accepted
              prefix. Its index varies per sequence and is known only from the verification's
              logits, i.e. after every attention layer ran, so verification dumps every row's
              scores ([L, B, T, S], `ScoreSpec(per_row=True)`) and the policy gathers row a.
  specextend  SpecExtend's cross-model retrieval applied layer-wise (as the Vegas paper does for its
              baseline): the last accepted token's softmax *weights* from the same all-rows dump,
              summed per 16-token page, top pages at the same token budget.
  streaming   StreamingLLM / MagicDec-Stream: 4 attention-sink tokens + the most recent window,
              together the same token budget.
  quest       Quest / MagicDec-Quest: per-page (16 tokens) channel-wise min/max key summaries,
              refreshed once per round here; the page scores are recomputed at every draft step
              from that step's query inside the attention (`QuestPages`), per KV head; the top
              ceil(k / 16) full pages, the partial last page in the dense tail.
  dense       full attention while drafting (the acceptance upper bound).

The first round after prefill: the prefill's own full attention gives one free score row, each
prompt's last token against the whole prompt (`Prefill(scores=...)`). It is the query closest to
the first drafts, so every score-based policy selects from it (with first_row = prompt_len - 1,
accepted = 0 it is exactly the 'last accepted token' row vegas-last and specextend use later).
Streaming and quest need no scores.

`backend` (bound once, by the engine) picks the top-k implementation: the Pallas kernel on the
'pallas' backend when there are enough rows to fill a GPU, always on 'interpret' (so that CPU tests
run it), the XLA threshold select otherwise. `mesh` (the model's tensor-parallel mesh, or None) is
where the scores live: they arrive replicated (summed across devices in the attention dispatch),
and every device selects the same positions from them; the Pallas top-k, which XLA cannot
partition, runs under `shard_map` on each device's full copy.
"""
from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from jaxspec.drafting import pages
from jaxspec.model.attention import Dense as DensePlan
from jaxspec.model.attention import Plan, QuestPages, ScoreSpec, Sparse, check_backend
from jaxspec.model.kv_cache import KVCache
from pallas_kernels import topk_select as _topk

SELF_DRAFTING = ("dense", "vegas", "vegas-all", "vegas-last", "specextend", "streaming", "quest")
SCORE_KINDS = ("logits", "weights")
NUM_SINKS = 4   # StreamingLLM's attention sinks
SCORE_POOL = 1  # the vegas family's default pooling width (`pool_scores`)
SCORE_BLOCK = 1  # the vegas family's default selection block (`per_layer_topk`): positions
SCORE_WINDOW = 0  # the vegas family's default recent window (`per_layer_topk`): none
POOLED = ("vegas", "vegas-all", "vegas-last")   # the policies a `Scoring` shapes


def budget(lengths: jax.Array, ratio: float, min_tokens: int, k_max: int) -> jax.Array:
  """Tokens to keep per sequence: clamp(ceil(ratio * len), min_tokens, len), at most k_max
  (ratio * len in float32)."""
  want = jnp.ceil(ratio * lengths.astype(jnp.float32)).astype(jnp.int32)
  return jnp.minimum(jnp.minimum(jnp.maximum(want, min_tokens), lengths), k_max).astype(jnp.int32)


def static_k_max(capacity: int, ratio: float, min_tokens: int) -> int:
  """Static size of the index buffers: the largest budget any prefix length <= capacity needs."""
  return max(1, min(capacity, max(min_tokens, math.ceil(ratio * capacity))))


# H200, ratio 0.07: 1536 rows x 33792, kernel 747 us vs XLA 1838; 16 rows x 131072, 699 vs 167.
_TOPK_KERNEL_MIN_ROWS = 256


def per_layer_topk(scores: jax.Array, prefix: jax.Array, *, ratio: float, min_tokens: int,
                   k_max: int, block: int = SCORE_BLOCK, window: int = SCORE_WINDOW,
                   backend: str = "reference", mesh: Mesh | None = None
                   ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """scores [L, B, S], prefix [B] -> per-layer top-k (indices [L, B, K], counts [L, B],
  tail_start [B]) with k = `budget(prefix, ratio, min_tokens, k_max)` tokens per sequence in every
  layer.

  block 1 ranks positions: K = k_max, the top k positions before the prefix end, tail_start =
  prefix. block > 1 ranks the prefix's whole aligned blocks of `block` positions by their largest
  score and keeps the best k // block of them, every position of each (K = (k_max // block) *
  block, counts a multiple of block); the partial last block joins the dense tail (tail_start =
  the prefix rounded down to a block), so a draft sees at most block - 1 more positions than at
  block 1. window > 0 keeps the prefix's newest w = min(window, k) positions whole, in the dense
  tail, and ranks only the positions before them for the other k - w (counts k - w; blocks as
  above, over the ranked positions): the same budget, its newest w tokens kept by position
  rather than by score, as H2O keeps a recent window beside its heavy hitters.

  On the 'pallas' and 'interpret' backends, the sorting-free threshold select of
  `pallas_kernels.topk_select` (exact, ties to the lower position, positions ascending; at 24
  layers x 64 sequences x 33K positions `lax.top_k` sorts every row, benchmarks/RESULTS.md): its
  Pallas kernel for bf16 scores on 'pallas' from `_TOPK_KERNEL_MIN_ROWS` rows up (one program a
  row leaves most SMs idle below that) and always on 'interpret', its XLA form otherwise. On
  'reference', the reference itself (`lax.top_k`: the same set, in descending score order; XLA:CPU
  compiles it in a fraction of the time the threshold search's 60 sibling reductions take). On a
  `mesh` the kernel runs under shard_map, each device over all rows of its (replicated) copy of
  the scores.
  """
  n_layers, b, s = scores.shape
  bf16 = scores.dtype == jnp.bfloat16
  if backend == "interpret" and bf16:
    method, interpret = "pallas", True
  elif backend == "pallas" and bf16 and n_layers * b >= _TOPK_KERNEL_MIN_ROWS:
    method, interpret = "pallas", False
  elif backend == "reference":
    method, interpret = "top_k", False
  else:
    method, interpret = "threshold", False
  k = budget(prefix, ratio, min_tokens, k_max)
  recent = jnp.minimum(window, k)                        # kept by position, not ranked
  k, ranked = k - recent, prefix - recent
  n_full = ranked // block                               # whole blocks before the window
  if block > 1:
    n_blocks = s // block
    scores = scores[..., :n_blocks * block].reshape(n_layers, b, n_blocks, block).max(-1)
    k, k_max = k // block, max(1, min(k_max // block, n_blocks))
  k = jnp.tile(k, n_layers)                              # [L * B]

  def select(scores, lengths, k):
    return _topk.topk_select(scores, lengths, k, k_max=k_max, method=method, interpret=interpret)
  if mesh is not None and method == "pallas":
    select = jax.shard_map(select, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)
  idx = select(scores.reshape(n_layers * b, -1), jnp.tile(n_full, n_layers), k)
  if block > 1:
    idx = (idx[..., None] * block + jnp.arange(block, dtype=idx.dtype)).reshape(n_layers * b, -1)
  return (idx.reshape(n_layers, b, -1), (k * block).reshape(n_layers, b),
          (n_full * block).astype(jnp.int32))


def pool_scores(scores: jax.Array, prefix: jax.Array, width: int) -> jax.Array:
  """scores [L, B, S], prefix [B] -> each position's largest score within width // 2 positions of
  it on either side, over positions < prefix only, so nothing past the prefix lends its score to
  the prefix's last keys (width odd; 1 returns the scores as they are)."""
  if width == 1:
    return scores
  valid = jnp.arange(scores.shape[-1])[None, None, :] < prefix[None, :, None]
  low = jnp.array(-jnp.inf, scores.dtype)
  return jax.lax.reduce_window(jnp.where(valid, scores, low), low, jax.lax.max, (1, 1, width),
                               (1, 1, 1), "SAME")


def _row_of_last_accepted(scores, accepted):
  """scores [L, B, T, S] (all-rows dump) or [L, B, S] (a single row) -> [L, B, S]."""
  if scores.ndim == 3:
    return scores
  return jnp.take_along_axis(scores, accepted[None, :, None, None], axis=2)[:, :, 0]


def check_score_pool(width: int) -> None:
  """Raise a one-line ValueError unless `width` is an odd positive integer (`pool_scores`)."""
  if not isinstance(width, int) or isinstance(width, bool) or width < 1 or width % 2 == 0:
    raise ValueError(f"score pool must be an odd positive integer (1: the scores as they are), "
                     f"got {width!r}")


def check_score_block(block: int) -> None:
  """Raise a one-line ValueError unless `block` is a positive integer (`per_layer_topk`)."""
  if not isinstance(block, int) or isinstance(block, bool) or block < 1:
    raise ValueError(f"score block must be a positive integer (1: positions ranked one by one), "
                     f"got {block!r}")


def check_score_window(window: int) -> None:
  """Raise a one-line ValueError unless `window` is a non-negative integer (`per_layer_topk`)."""
  if not isinstance(window, int) or isinstance(window, bool) or window < 0:
    raise ValueError(f"score window must be a non-negative integer (0: every kept position "
                     f"ranked by score), got {window!r}")


@dataclasses.dataclass(frozen=True)
class Scoring:
  """How the vegas family scores and ranks the keys it keeps, bound once (validated here).

  kind: the Collect-2 score, 'logits' (the paper's) or 'weights'; pool: each position ranks by
  the largest score within pool // 2 positions of it (odd; 1, the default: the scores as they
  are; `pool_scores`); block: the top-k keeps aligned blocks of this many positions, ranked by
  their best score (1, the default: position by position; `per_layer_topk`); window: the
  prefix's newest `window` positions are kept whole and only the rest of the budget is ranked
  (0, the default: every kept position ranked; `per_layer_topk`). Every setting is lossless: it
  changes what the drafts see, not the output distribution.
  """
  kind: str = "logits"
  pool: int = SCORE_POOL
  block: int = SCORE_BLOCK
  window: int = SCORE_WINDOW

  def __post_init__(self):
    if self.kind not in SCORE_KINDS:
      raise ValueError(f"score mode must be one of {', '.join(SCORE_KINDS)}, got {self.kind!r}")
    check_score_pool(self.pool)
    check_score_block(self.block)
    check_score_window(self.window)


@dataclasses.dataclass(frozen=True)
class SelectionPolicy:
  """Base: token budget settings shared by every policy. Subclasses override the hooks."""
  ratio: float = 0.07
  min_tokens: int = 256
  k_max: int = 256
  scoring: Scoring = Scoring()
  backend: str = "reference"
  mesh: Mesh | None = None
  name: ClassVar[str] = ""

  @property
  def prefill_scores(self) -> ScoreSpec | None:
    """Scores the prefill must return for the first round (None: no scores needed)."""
    return None

  @property
  def verify_scores(self) -> ScoreSpec | None:
    return None

  def select_kv(self, cache: KVCache, scores: jax.Array | None, first_row: jax.Array,
                accepted: jax.Array) -> Plan:
    raise NotImplementedError

  def top_plan(self, scores: jax.Array, prefix: jax.Array) -> Sparse:
    """The vegas family's plan: the top of `scores` [L, B, S] over the first `prefix` positions,
    pooled and blocked as the policy's `scoring` says."""
    idx, cnt, tail_start = per_layer_topk(
        pool_scores(scores, prefix, self.scoring.pool), prefix, ratio=self.ratio,
        min_tokens=self.min_tokens, k_max=self.k_max, block=self.scoring.block,
        window=self.scoring.window, backend=self.backend, mesh=self.mesh)
    return Sparse(indices=idx, counts=cnt, tail_start=tail_start)


@dataclasses.dataclass(frozen=True)
class Dense(SelectionPolicy):
  name: ClassVar[str] = "dense"

  def select_kv(self, cache, scores, first_row, accepted):
    return DensePlan()


@dataclasses.dataclass(frozen=True)
class Vegas(SelectionPolicy):
  """Verification-guided top-k over the keys every collected row saw, per layer."""
  name: ClassVar[str] = "vegas"
  score_rows: ClassVar[tuple[int, ...] | None] = (0, -1)   # Collect-2-Query

  @property
  def prefill_scores(self):
    return ScoreSpec(self.scoring.kind)

  @property
  def verify_scores(self):
    return ScoreSpec(self.scoring.kind, rows=self.score_rows)

  def select_kv(self, cache, scores, first_row, accepted):
    return self.top_plan(scores, first_row + 1)


@dataclasses.dataclass(frozen=True)
class VegasAll(Vegas):
  name: ClassVar[str] = "vegas-all"
  score_rows: ClassVar[tuple[int, ...] | None] = None


@dataclasses.dataclass(frozen=True)
class VegasLast(SelectionPolicy):
  """Top-k of the last accepted token's row (the row whose output was the corrected/bonus token)."""
  name: ClassVar[str] = "vegas-last"

  @property
  def prefill_scores(self):
    return ScoreSpec(self.scoring.kind)

  @property
  def verify_scores(self):
    return ScoreSpec(self.scoring.kind, per_row=True)

  def select_kv(self, cache, scores, first_row, accepted):
    # The keys that row saw: the whole accepted prefix.
    return self.top_plan(_row_of_last_accepted(scores, accepted), first_row + accepted + 1)


@dataclasses.dataclass(frozen=True)
class SpecExtend(SelectionPolicy):
  """The last accepted token's attention weights, per layer, aggregated to 16-token pages."""
  name: ClassVar[str] = "specextend"

  @property
  def prefill_scores(self):
    return ScoreSpec("weights")

  @property
  def verify_scores(self):
    return ScoreSpec("weights", per_row=True)

  def select_kv(self, cache, scores, first_row, accepted):
    prefix = first_row + accepted + 1
    row = _row_of_last_accepted(scores, accepted).astype(jnp.float32)      # [L, B, S]
    n_layers, b, s = row.shape
    mass = jnp.where(jnp.isfinite(row), row, 0.0).reshape(n_layers, b, s // pages.PAGE_SIZE,
                                                            pages.PAGE_SIZE).sum(-1)
    n_full = prefix // pages.PAGE_SIZE
    want = pages.pages_for_budget(budget(prefix, self.ratio, self.min_tokens, self.k_max))
    idx, cnt = pages.top_pages(mass, n_full[None], want[None],
                               pages.pages_for_budget(self.k_max), pages.PAGE_SIZE)
    return Sparse(indices=idx, counts=cnt, tail_start=n_full * pages.PAGE_SIZE)


@dataclasses.dataclass(frozen=True)
class Streaming(SelectionPolicy):
  """Attention sinks + recent window: sinks as indices, the window as the dense tail."""
  name: ClassVar[str] = "streaming"

  def select_kv(self, cache, scores, first_row, accepted):
    lengths = cache.lengths
    k = budget(lengths, self.ratio, self.min_tokens, self.k_max)
    sinks = jnp.minimum(NUM_SINKS, k)
    window = k - sinks
    n_layers, b = len(cache.k), cache.batch
    idx = jnp.broadcast_to(jnp.arange(NUM_SINKS, dtype=jnp.int32), (n_layers, b, NUM_SINKS))
    return Sparse(indices=idx, counts=jnp.broadcast_to(sinks, (n_layers, b)),
                  tail_start=lengths - window)


@dataclasses.dataclass(frozen=True)
class Quest(SelectionPolicy):
  """Quest: page summaries once per round; per-step page choice inside the attention."""
  name: ClassVar[str] = "quest"

  def select_kv(self, cache, scores, first_row, accepted):
    lengths = cache.lengths
    n_full = lengths // pages.PAGE_SIZE
    want = pages.pages_for_budget(budget(lengths, self.ratio, self.min_tokens, self.k_max))
    # Layer by layer: stacking the layers' keys first would copy the whole K cache every round.
    summaries = [pages.page_summaries(k, pages.PAGE_SIZE) for k in cache.k]
    n_layers = len(cache.k)
    return QuestPages(pages=jnp.broadcast_to(jnp.minimum(want, n_full), (n_layers, cache.batch)),
                      tail_start=n_full * pages.PAGE_SIZE,
                      page_min=jnp.stack([lo for lo, _ in summaries]),
                      page_max=jnp.stack([hi for _, hi in summaries]),
                      max_pages=pages.pages_for_budget(self.k_max))


POLICIES: dict[str, type[SelectionPolicy]] = {
    cls.name: cls for cls in (Dense, Vegas, VegasAll, VegasLast, SpecExtend, Streaming, Quest)}


def validate(method: str, *, ratio: float, min_tokens: int) -> None:
  """Raise a clear ValueError for settings no policy accepts (a `Scoring` checks its own)."""
  if method not in POLICIES:
    raise ValueError(f"unknown method {method!r} for self-drafting; choose one of "
                     f"{', '.join(SELF_DRAFTING)}")
  if not (isinstance(ratio, (int, float)) and 0 < ratio <= 1):
    raise ValueError(f"sparsity ratio must be in (0, 1], got {ratio!r}")
  if not isinstance(min_tokens, int) or min_tokens < 0:
    raise ValueError(f"min_tokens must be a non-negative integer, got {min_tokens!r}")


def make_policy(method: str, *, ratio: float, min_tokens: int, k_max: int,
                scoring: Scoring = Scoring(), backend: str = "reference",
                mesh: Mesh | None = None) -> SelectionPolicy:
  """The policy for a self-drafting method name (`scoring` shapes the vegas family's only)."""
  validate(method, ratio=ratio, min_tokens=min_tokens)
  check_scoring(scoring)
  return POLICIES[method](ratio=float(ratio), min_tokens=min_tokens, k_max=k_max,
                          scoring=scoring, backend=check_backend(backend), mesh=mesh)


def check_scoring(scoring: Scoring) -> Scoring:
  """`scoring` itself, or a one-line ValueError if it is not a `Scoring`."""
  if not isinstance(scoring, Scoring):
    raise ValueError(f"scoring must be a jaxspec.drafting.policies.Scoring, got {scoring!r}")
  return scoring
