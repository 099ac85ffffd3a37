"""Verification attention: T new queries per sequence against the whole KV cache.

Shapes (GQA, Hq = G * Hkv):
  q        [B, T, Hq, D]   the T = gamma + 1 new tokens (T = 1 is plain decoding)
  k, v     [B, S, Hkv, D]  the KV cache, the T new entries already written at lengths[b] + t
  lengths  [B] int32       entries in the cache *before* the new tokens
Query row t of sequence b sits at position lengths[b] + t and sees keys j <= lengths[b] + t.

Optional criticality scores [B, S] (bf16): for each key j visible to every collected row, the mean
over collected rows and all Hq query heads of either the raw logit q.k (`score_kind='logits'`,
after masking, before softmax and before the 1/sqrt(D) scale) or the softmax weight
exp(scale * q.k - lse) (`score_kind='weights'`). Keys not visible to every collected row get -inf.
`score_rows` picks the rows (negative indices count from T): (0, -1) is Vegas's Collect-2-Query
(first draft + bonus), None is every row.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

NEG_INF = float("-inf")


def _check_shapes(q, k, v, lengths):
  if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape:
    raise ValueError(f"expected q [B,T,Hq,D] and k, v [B,S,Hkv,D]; got {q.shape}, {k.shape}, {v.shape}")
  b, _, hq, d = q.shape
  if k.shape[0] != b or k.shape[3] != d or hq % k.shape[2]:
    raise ValueError(f"q {q.shape} does not match cache {k.shape} (batch, head_dim, GQA grouping)")
  if lengths.shape != (b,):
    raise ValueError(f"lengths must be [B]={b}, got {lengths.shape}")


def normalize_rows(score_rows: tuple[int, ...] | None, t: int) -> tuple[int, ...]:
  rows = tuple(range(t)) if score_rows is None else tuple(r % t for r in score_rows)
  if not rows or any(not 0 <= r < t for r in rows):
    raise ValueError(f"score_rows {score_rows} out of range for T={t}")
  return tuple(sorted(set(rows)))


@functools.partial(jax.jit, static_argnames=("score_kind", "score_rows", "sm_scale"))
def verify_attention_reference(q, k, v, lengths, *, score_kind: str | None = None,
                               score_rows: tuple[int, ...] | None = (0, -1),
                               sm_scale: float | None = None):
  """Pure-JAX reference. Returns (out [B,T,Hq,D] in q.dtype, scores [B,S] bf16 or None)."""
  _check_shapes(q, k, v, lengths)
  b, t, hq, d = q.shape
  s, hkv = k.shape[1], k.shape[2]
  g = hq // hkv
  scale = d ** -0.5 if sm_scale is None else sm_scale
  qg = q.reshape(b, t, hkv, g, d).astype(jnp.float32)
  logits = jnp.einsum("bthgd,bshd->bhgts", qg, k.astype(jnp.float32))   # [B,Hkv,G,T,S]
  pos = lengths[:, None] + jnp.arange(t)[None]                           # [B,T]
  visible = jnp.arange(s)[None, None, :] <= pos[:, :, None]              # [B,T,S]
  masked = jnp.where(visible[:, None, None], logits * scale, NEG_INF)
  lse = jax.nn.logsumexp(masked, axis=-1, keepdims=True)
  probs = jnp.exp(masked - lse)
  out = jnp.einsum("bhgts,bshd->bthgd", probs, v.astype(jnp.float32)).reshape(b, t, hq, d)
  scores = None
  if score_kind is not None:
    if score_kind not in ("logits", "weights"):
      raise ValueError(f"score_kind must be 'logits' or 'weights', got {score_kind!r}")
    rows = jnp.asarray(normalize_rows(score_rows, t))
    per = logits if score_kind == "logits" else probs                    # [B,Hkv,G,T,S]
    mean = per[:, :, :, rows].mean(axis=(1, 2, 3))                       # [B,S]
    seen_by_all = visible[:, rows].all(axis=1)                           # [B,S]
    scores = jnp.where(seen_by_all, mean, NEG_INF).astype(jnp.bfloat16)
  return out.astype(q.dtype), scores
