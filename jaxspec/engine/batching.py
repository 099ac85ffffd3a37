"""Continuous batching at round granularity: put a freshly prefilled sequence into a finished slot.

Decode states (`decode.DecodeState`, `speculative.SpecState`) are pytrees whose per-sequence leaves
carry the batch on one axis (axis 0 for the cache and token buffers, axis 1 for per-layer selection
data [L, B, ...]). `insert_slot` copies a batch-1 state of the same static sizes into slot `slot` of
a batch-B state, leaf by leaf, on the axis where the two differ; leaves without a batch axis (the
PRNG key, round counters) keep the big state's values.
"""
from __future__ import annotations

import functools

import jax


def _batch_axis(big: jax.Array, small: jax.Array) -> int | None:
  if big.shape == small.shape:
    return None
  diff = [i for i, (a, b) in enumerate(zip(big.shape, small.shape)) if a != b]
  if big.ndim != small.ndim or len(diff) != 1 or small.shape[diff[0]] != 1:
    raise ValueError(f"cannot insert a leaf of shape {small.shape} into {big.shape}: the states "
                     "must have the same static sizes and differ only in batch")
  return diff[0]


@functools.partial(jax.jit, donate_argnames=("big",))
def insert_slot(big, small, slot: jax.Array):
  """Write batch-1 `small` into slot `slot` of `big` (donated). Returns the updated big state.

  A batch-1 `big` is refused: no leaf differs in shape, so the batch axis cannot be told apart
  (the caller can use `small` itself)."""
  big_leaves, treedef = jax.tree_util.tree_flatten(big)
  small_leaves = treedef.flatten_up_to(small)
  axes = [_batch_axis(b, s) for b, s in zip(big_leaves, small_leaves)]
  if all(a is None for a in axes):
    raise ValueError("insert_slot needs a state of batch > 1 to insert into; at batch 1 the "
                     "fresh state replaces it")
  return treedef.unflatten([
      b if a is None else jax.lax.dynamic_update_slice_in_dim(b, s.astype(b.dtype), slot, a)
      for b, s, a in zip(big_leaves, small_leaves, axes)])
