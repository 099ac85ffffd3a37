"""The flash-attention inner-loop step, shared by `verify_attention` and `sparse_attention`.

Each kernel program keeps, for its M query rows, an unnormalised accumulator acc [M, D] f32, the
running max m [M] f32 of the base-2 logits seen so far and the softmax denominator l [M] f32. The
caller computes one block of logits s [M, bk] (scaled by sm_scale * LOG2E, masked entries -inf) and
`update` folds it and its V block in. The kernels store (acc, m, l) unnormalised; the split
partials are merged and normalised by `verify_attention.combine_splits`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

LOG2E = 1.4426950408889634
# Finite start for running maxima: a block whose keys are all masked for a row then gives
# exp2(-inf - (-1e30)) = 0 instead of exp2(-inf + inf) = NaN.
MAX_INIT = -1e30

State = tuple[jax.Array, jax.Array, jax.Array]   # (acc [M, D], m [M], l [M]), all f32


def dot(a: jax.Array, b: jax.Array) -> jax.Array:
  """a [M, K] @ b [K, N] with f32 accumulation (pl.dot is removed in jax 0.12)."""
  return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def dot_t(a: jax.Array, b: jax.Array) -> jax.Array:
  """a [M, K] @ b [N, K]^T with f32 accumulation."""
  return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def init(m_rows: int, d: int) -> State:
  """The state before any block: acc = 0, m = MAX_INIT, l = 0."""
  return (jnp.zeros((m_rows, d), jnp.float32), jnp.full((m_rows,), MAX_INIT, jnp.float32),
          jnp.zeros((m_rows,), jnp.float32))


def update(state: State, s: jax.Array, v: jax.Array) -> State:
  """Fold one block in: s [M, bk] f32 base-2 logits (-inf where masked), v [bk, D] its values."""
  acc, m_i, l_i = state
  m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
  alpha = jnp.exp2(m_i - m_new)
  p = jnp.exp2(s - m_new[:, None])
  l_new = l_i * alpha + jnp.sum(p, axis=1)
  # p in V's dtype (bf16) so the p.V product runs on the tensor cores, accumulating in f32.
  acc = acc * alpha[:, None] + dot(p.astype(v.dtype), v)
  return acc, m_new, l_new
