"""A draft tree, drafted level by level by one model over its own cache (the tree form of `chain`).

The drafter feeds the root (and any tokens before it, as the chain does), then one batched step per
depth: the nodes of depth d, all at once, each seeing the prefix, its ancestors and itself (the
tree's ancestor bitmask in the attention plan). Their K/V are written in breadth-first order after
the root, whatever the order the tree is verified in: the nodes of one depth are then contiguous,
so every step writes one contiguous block. The deepest nodes are never fed (as the chain never
feeds its last draft).

Children of a node: the top-w tokens of its logits when greedy; when sampling, w draws without
replacement from the node's distribution q (Gumbel top-w), or for w = 1 exactly the chain's draw
(same key, same call), so a width-1 tree drafts what the chain drafts. Acceptance is
`tree_acceptance.verify_tree(..., siblings='without_replacement')`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.drafting.trees import Tree
from jaxspec.engine.sampling import SamplingParams, TopK, probabilities, sample_draft
from jaxspec.model.attention import Dense, Plan, Sparse
from jaxspec.model.kv_cache import KVCache
from jaxspec.model.transformer import Transformer

SIBLINGS = "without_replacement"


def tree_plan(plan: Plan, bits: np.ndarray, offset: int) -> Plan:
  """`plan` for a step whose rows carry ancestor bitmasks `bits` over the window that starts
  `offset` slots before the step's first row."""
  if not isinstance(plan, (Dense, Sparse)):
    raise ValueError(f"a draft tree needs a dense or sparse drafting plan; {type(plan).__name__} "
                     "chooses its keys per query token, one token per step")
  return plan.replace(tree_bits=jnp.asarray(bits), tree_offset=offset)


def _children(key: jax.Array, logits: jax.Array, width: int, sampling: SamplingParams
              ) -> tuple[jax.Array, jax.Array | None]:
  """logits [B, N, V] -> (width children per row [B, N, width], the rows' q [B, N, V] or None)."""
  b, n, vocab = logits.shape
  flat = logits.reshape(b * n, vocab)
  if sampling.greedy:
    return jax.lax.top_k(flat, width)[1].astype(jnp.int32).reshape(b, n, width), None
  flat = jax.lax.optimization_barrier(flat)   # written once, as in `chain.draft_chain`
  if width == 1:   # as a chain draws (`chain.draft_chain`); tree acceptance reads q dense
    tokens, q = sample_draft(key, flat, sampling)
    if isinstance(q, TopK):
      q = q.dense(vocab)
    return tokens.reshape(b, n, 1), q.reshape(b, n, vocab)
  q = probabilities(flat, sampling)
  noisy = jnp.where(q > 0, jnp.log(q) + jax.random.gumbel(key, q.shape, jnp.float32), -jnp.inf)
  return (jax.lax.top_k(noisy, width)[1].astype(jnp.int32).reshape(b, n, width),
          q.reshape(b, n, vocab))


def draft_tree(model: Transformer, cache: KVCache, first: jax.Array, plan: Plan, backend: str,
               tree: Tree, key: jax.Array, sampling: SamplingParams, fp8_mlp: bool = False
               ) -> tuple[KVCache, jax.Array, jax.Array | None]:
  """Feed `first` [B, T0] (its last token is the root) at cache.lengths.., then draft `tree`.

  Returns (the cache with the fed nodes' K/V written breadth-first after the root, lengths
  unchanged; drafts [B, T - 1] for nodes 1..T-1 in `tree`'s order; q [B, T, V] in `tree`'s order,
  row i the distribution node i's children were drawn from (zeros for leaves), or None when
  greedy). Depth d uses the d-th of tree.depth keys split from `key`, as chain step d does.
  `fp8_mlp`: the steps' MLPs multiply by their FP8 copies (`jaxspec.model.fp8`).
  """
  bfs, to_bfs = tree.flatten("bfs"), tree.bfs_index
  depths = np.asarray(bfs.depths)
  start, t0 = cache.lengths, first.shape[1]
  base = start + t0 - 1                                              # the root's slot
  keys = jax.random.split(key, tree.depth)
  b = first.shape[0]

  positions = start[:, None] + jnp.arange(t0, dtype=jnp.int32)[None]
  hidden, cache, _ = model(first, positions, cache, plan, backend, fp8_mlp)
  logits = model.logits(hidden[:, -1:])                              # [B, 1, V]: the root's row
  tokens = [jnp.zeros((b, 1), jnp.int32)]                            # bfs order; root filled later
  q_rows = []
  for d in range(tree.depth):
    level = np.flatnonzero(depths == d)                              # contiguous in bfs order
    kids = [bfs.children[int(p)] for p in level]
    width = max(len(k) for k in kids)
    chosen, q = _children(keys[d], logits, width, sampling)         # [B, n_d, width]
    rows = np.asarray([r for r, k in enumerate(kids) for _ in k], np.int32)
    cols = np.asarray([s for k in kids for s in range(len(k))], np.int32)
    tokens.append(chosen[:, rows, cols])                             # level d + 1, bfs order
    if q is not None:
      q_rows.append(q)
    if d + 1 == tree.depth:
      break
    nxt = np.flatnonzero(depths == d + 1)
    offset = int(nxt[0])
    step_plan = tree_plan(plan, bfs.ancestor_bits[nxt], offset)
    positions = jnp.broadcast_to(base[:, None] + d + 1, (b, len(nxt)))
    hidden, cache, _ = model(tokens[-1], positions, cache.replace(lengths=base + offset),
                             step_plan, backend, fp8_mlp)
    logits = model.logits(hidden)                                    # [B, n_{d+1}, V]

  bfs_tokens = jnp.concatenate(tokens, axis=1)                       # [B, T]
  drafts = bfs_tokens[:, to_bfs[1:]]
  probs = None
  if q_rows:
    q_bfs = jnp.concatenate(q_rows, axis=1)                          # the nodes above the deepest
    q_bfs = jnp.pad(q_bfs, ((0, 0), (0, tree.size - q_bfs.shape[1]), (0, 0)))
    probs = q_bfs[:, to_bfs]
  return cache.replace(lengths=start), drafts, probs
