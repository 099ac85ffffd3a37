"""Top-k selection of KV positions from criticality scores, at a sparsity ratio with a floor.

  scores   [B, L]  (any float dtype; positions >= lengths[b] are ignored)
  lengths  [B]     prefix length to select from
  k        = clamp(ceil(ratio * lengths[b]), min_tokens, lengths[b]), capped at the static k_max
Returns (indices [B, k_max] int32, counts [B] int32): the first counts[b] entries are the selected
positions (in descending score order for the reference); the rest are padding (value 0).
Ties: the reference keeps the lower position (lax.top_k's rule).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def budget(lengths: jax.Array, ratio: float, min_tokens: int, k_max: int) -> jax.Array:
  """Tokens to keep per sequence: clamp(ceil(ratio * len), min_tokens, len), at most k_max."""
  want = jnp.ceil(ratio * lengths.astype(jnp.float32)).astype(jnp.int32)
  return jnp.minimum(jnp.minimum(jnp.maximum(want, min_tokens), lengths), k_max).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("ratio", "min_tokens", "k_max"))
def topk_select_reference(scores, lengths, *, ratio: float, min_tokens: int, k_max: int):
  if scores.ndim != 2 or lengths.shape != scores.shape[:1]:
    raise ValueError(f"expected scores [B, L] and lengths [B]; got {scores.shape}, {lengths.shape}")
  if not 0 < k_max <= scores.shape[1]:
    raise ValueError(f"k_max={k_max} must be in [1, L={scores.shape[1]}]")
  counts = budget(lengths, ratio, min_tokens, k_max)
  s = scores.astype(jnp.float32)
  s = jnp.where(jnp.isnan(s), -jnp.inf, s)
  # Out-of-prefix positions must lose against every real score, -inf included.
  in_prefix = jnp.arange(scores.shape[1])[None] < lengths[:, None]
  key = jnp.where(in_prefix, jnp.maximum(s, jnp.finfo(jnp.float32).min), -jnp.inf)
  _, idx = jax.lax.top_k(key, k_max)
  idx = jnp.where(jnp.arange(k_max)[None] < counts[:, None], idx, 0)
  return idx.astype(jnp.int32), counts
