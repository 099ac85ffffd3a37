"""The one attention dispatch point of the model.

Every attention layer calls `attend`; what it computes is described by an `AttentionPlan`, a pytree
whose static fields (mode, score collection, backend) select the code path and whose array fields
carry per-layer data (the selected KV positions of a sparse draft step). The pure-JAX references and
the Pallas kernels live side by side in `pallas_kernels/`; `backend` picks one.

Modes:
  prefill  the cache is empty for these sequences (lengths == 0): causal self-attention over the
           prompt. With scores on, the score row is each prompt's last token (see `jaxspec.drafting.policies`).
  dense    T new queries against the whole cache (plain decoding T=1, verification T=gamma+1).
           Optionally returns criticality scores (`score_kind`, `score_rows`), or with
           `score_per_row` one score row per query ([B, T, S]: the all-rows dump that policies keyed
           on the last accepted token need, since that row is known only after verification).
  sparse   T new queries against the selected prefix positions plus the dense tail.
  quest    one new query (a draft step) against Quest-selected pages plus the dense tail: the page
           scores are recomputed here from the current query and the per-page key summaries
           (`page_min`/`page_max`, see `jaxspec.drafting.pages`); `counts` [B] = pages to keep.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxspec.drafting import pages as _pages
from pallas_kernels import sparse_attention as _sparse
from pallas_kernels import verify_attention as _verify

MODES = ("prefill", "dense", "sparse", "quest")
BACKENDS = ("reference", "pallas")


def default_backend() -> str:
  """Pallas kernels on a GPU, the pure-JAX references elsewhere."""
  return "pallas" if jax.default_backend() == "gpu" else "reference"


@struct.dataclass
class AttentionPlan:
  mode: str = struct.field(pytree_node=False, default="dense")
  score_kind: str | None = struct.field(pytree_node=False, default=None)  # None|'logits'|'weights'
  score_rows: tuple[int, ...] | None = struct.field(pytree_node=False, default=(0, -1))
  backend: str = struct.field(pytree_node=False, default="reference")
  score_per_row: bool = struct.field(pytree_node=False, default=False)  # dense: scores [B, T, S]
  max_pages: int = struct.field(pytree_node=False, default=0)           # quest: static page cap
  query_lens: jax.Array | None = None   # [B] prefill: real prompt lengths (rows past it are padding)
  indices: jax.Array | None = None      # sparse: [L, B, K] or [L, B, Hkv, K]
  counts: jax.Array | None = None       # sparse: [L, B] or [L, B, Hkv]
  tail_start: jax.Array | None = None   # sparse, quest: [B]
  page_min: jax.Array | None = None     # quest: [L, B, P, Hkv, D] channel-wise key minimum per page
  page_max: jax.Array | None = None     # quest: [L, B, P, Hkv, D]

  def __post_init__(self):
    if self.mode not in MODES:
      raise ValueError(f"attention mode must be one of {MODES}, got {self.mode!r}")
    if self.backend not in BACKENDS:
      raise ValueError(f"attention backend must be one of {BACKENDS}, got {self.backend!r}")
    if self.score_kind not in (None, "logits", "weights"):
      raise ValueError(f"score_kind must be None, 'logits' or 'weights', got {self.score_kind!r}")

  def for_layer(self, i: int) -> "AttentionPlan":
    pick = lambda x: None if x is None else x[i]
    return self.replace(indices=pick(self.indices), counts=pick(self.counts),
                        page_min=pick(self.page_min), page_max=pick(self.page_max))


def attend(q: jax.Array, k_new: jax.Array, v_new: jax.Array, k_cache: jax.Array,
           v_cache: jax.Array, lengths: jax.Array, plan: AttentionPlan
           ) -> tuple[jax.Array, jax.Array | None]:
  """q/k_new/v_new [B, T, H, D] (the new tokens; their K/V already written into the cache).

  Returns (out [B, T, Hq, D], scores [B, S] bf16 ([B, T, S] with score_per_row) or None).
  """
  if plan.mode == "prefill":
    return _prefill(q, k_new, v_new, k_cache, v_cache, lengths, plan)
  if plan.mode == "dense":
    fn = _verify.verify_attention_reference if plan.backend == "reference" else _verify.verify_attention
    return fn(q, k_cache, v_cache, lengths, score_kind=plan.score_kind, score_rows=plan.score_rows,
              per_row=plan.score_per_row)
  if plan.mode == "quest":
    indices, counts = _quest_select(q, k_cache, plan)
    plan = plan.replace(indices=indices, counts=counts)
  fn = _sparse.sparse_attention_reference if plan.backend == "reference" else _sparse.sparse_attention
  out = fn(q, k_cache, v_cache, plan.indices, plan.counts, plan.tail_start, lengths)
  return out, None


def _quest_select(q, k_cache, plan):
  """Quest, per KV head: the `counts` pages with the largest q.k bound among the full pages
  before tail_start, as token positions [B, Hkv, max_pages * page_size] plus counts [B, Hkv]."""
  if q.shape[1] != 1:
    raise ValueError(f"quest attention scores pages per query: one new token per step, got T={q.shape[1]}")
  page_size = k_cache.shape[1] // plan.page_min.shape[1]
  scores = _pages.quest_scores(q[:, 0], plan.page_min, plan.page_max)       # [B, Hkv, P]
  n_full = (plan.tail_start // page_size)[:, None]
  return _pages.top_pages(scores, n_full, plan.counts[:, None], plan.max_pages, page_size)


def _prefill(q, k_new, v_new, k_cache, v_cache, lengths, plan):
  b, t = q.shape[:2]
  query_lens = plan.query_lens if plan.query_lens is not None else jnp.full((b,), t, jnp.int32)
  if plan.backend == "pallas":
    # cuDNN flash attention; the cache is empty, so the prompt's own K/V is everything to attend to.
    # cuDNN takes 16-bit inputs only; float32 runs fall back to XLA's (materialising) attention.
    impl = "cudnn" if q.dtype in (jnp.bfloat16, jnp.float16) else None
    out = jax.nn.dot_product_attention(q, k_new, v_new, is_causal=True,
                                       query_seq_lengths=query_lens,
                                       key_value_seq_lengths=query_lens, implementation=impl)
  else:
    out, _ = _verify.verify_attention_reference(q, k_new, v_new, jnp.zeros((b,), jnp.int32))
  scores = None
  if plan.score_kind is not None:
    # One score row per prompt: its last real token, against the whole prompt.
    last = jnp.take_along_axis(q, (query_lens - 1)[:, None, None, None], axis=1)
    _, scores = _verify.verify_attention_reference(
        last, k_cache, v_cache, lengths + query_lens - 1, score_kind=plan.score_kind, score_rows=(0,))
  return out, scores
