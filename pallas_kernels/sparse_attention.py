"""Gathered sparse attention for drafting: selected prefix positions plus a dense recent tail.

Shapes (GQA, Hq = G * Hkv):
  q           [B, T, Hq, D]
  k, v        [B, S, Hkv, D]     the KV cache, the T new entries already written at lengths[b] + t
  indices     [B, K] int32       selected prefix positions, shared by all heads (token granularity),
              or [B, Hkv, K]     one list per KV head (per-head masks: STS, SparseSpec)
  counts      [B] or [B, Hkv]    how many of `indices` are valid; the rest is padding and ignored
  tail_start  [B] int32          every position from here on is attended densely (the tokens written
                                 since the selection was made); selected indices must be < tail_start
  lengths     [B] int32          entries in the cache before the T new tokens
Query row t sees {indices[b, :counts[b]]} U {j : tail_start[b] <= j <= lengths[b] + t}.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def _check(q, k, v, indices, counts, tail_start, lengths):
  b, _, hq, d = q.shape
  if k.ndim != 4 or k.shape != v.shape or k.shape[0] != b or k.shape[3] != d or hq % k.shape[2]:
    raise ValueError(f"q {q.shape} does not match cache {k.shape}")
  per_head = indices.ndim == 3
  if indices.ndim not in (2, 3) or indices.shape[0] != b or (per_head and indices.shape[1] != k.shape[2]):
    raise ValueError(f"indices must be [B,K] or [B,Hkv,K]; got {indices.shape} for cache {k.shape}")
  if counts.shape != indices.shape[:-1]:
    raise ValueError(f"counts {counts.shape} must match indices {indices.shape[:-1]}")
  if tail_start.shape != (b,) or lengths.shape != (b,):
    raise ValueError("tail_start and lengths must be [B]")


@functools.partial(jax.jit, static_argnames=("sm_scale",))
def sparse_attention_reference(q, k, v, indices, counts, tail_start, lengths, *,
                               sm_scale: float | None = None):
  """Pure-JAX reference: builds the visibility mask over the whole cache. Returns [B,T,Hq,D]."""
  _check(q, k, v, indices, counts, tail_start, lengths)
  b, t, hq, d = q.shape
  s, hkv = k.shape[1], k.shape[2]
  g = hq // hkv
  scale = d ** -0.5 if sm_scale is None else sm_scale
  idx = indices if indices.ndim == 3 else jnp.broadcast_to(indices[:, None], (b, hkv, indices.shape[-1]))
  cnt = counts if counts.ndim == 2 else jnp.broadcast_to(counts[:, None], (b, hkv))
  valid = jnp.arange(idx.shape[-1]) < cnt[..., None]                          # [B,Hkv,K]
  selected = jnp.zeros((b, hkv, s), bool)
  selected = selected.at[jnp.arange(b)[:, None, None], jnp.arange(hkv)[None, :, None],
                         jnp.where(valid, idx, s)].set(True, mode="drop")       # [B,Hkv,S]
  pos = lengths[:, None] + jnp.arange(t)[None]                                # [B,T]
  j = jnp.arange(s)
  tail = (j[None, None] >= tail_start[:, None, None]) & (j[None, None] <= pos[:, :, None])  # [B,T,S]
  visible = selected[:, :, None] | tail[:, None]                               # [B,Hkv,T,S]
  qg = q.reshape(b, t, hkv, g, d).astype(jnp.float32)
  logits = jnp.einsum("bthgd,bshd->bhgts", qg, k.astype(jnp.float32)) * scale
  logits = jnp.where(visible[:, :, None], logits, -jnp.inf)
  probs = jax.nn.softmax(logits, axis=-1)
  out = jnp.einsum("bhgts,bshd->bthgd", probs, v.astype(jnp.float32))
  return out.reshape(b, t, hq, d).astype(q.dtype)
