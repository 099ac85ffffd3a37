"""Lossless acceptance of a draft tree, verified in one pass (the tree form of `rejection`).

Inputs, in the tree's flattened order (`trees.Tree`, static):
  tokens        [B, T] int32   node i's token; tokens[:, 0] is the root (the last emitted token,
                               never checked)
  target rows   [B, T, V]      row i: the target distribution of node i's children (logits for
                               greedy, probabilities p for sampling); leaf rows give the bonus
  draft_probs   [B, T, V]      row i: the drafter's distribution q at node i, the one node i's
                               children were drawn from (leaf rows unused)
The verdict: the deepest accepted node (`last_node`, 0 when no draft is accepted), how many drafts
that is (`accepted` = its depth), and the next token, drawn from the last accepted node's target
distribution or from the residual its rejected children left. The round emits the drafts on the
root-to-`last_node` path (`trees.accepted_path`) and then `next_token`, exactly as many tokens
sampled one at a time from the target would be distributed.

Greedy: the longest root path whose tokens equal the target's argmax at each parent (ties: the
first in flattened order, which follows sibling order in both BFS and DFS); the next token is the
argmax at its last node.

Sampling: recursive rejection sampling over siblings, the multi-step speculative sampling of
SpecInfer (Miao et al., 2024, Algorithm 2) and Sequoia's variant for siblings drawn without
replacement (Chen et al., 2024, Algorithm 1). At the current node (the root first) with target
distribution p, start from r_1 = p and try its children x_1..x_w in sibling order:
  * child k, drawn from q_k, is accepted with probability min(1, r_k(x_k) / q_k(x_k));
  * if it is rejected, r_{k+1} = norm(max(0, r_k - q_k)) (`rejection.residual_distribution`);
  * on acceptance the walk moves to x_k and starts again there with r_1 = p of that node;
  * if every child is rejected (or the node is a leaf), the next token is drawn from r_{w+1}
    (a leaf's r_1 = p: the bonus token).
Given the history, the step at child k emits x with probability min(r_k, q_k)(x) and otherwise
hands on r_{k+1}, whose mass is 1 - sum min(r_k, q_k): min(r_k, q_k) + max(0, r_k - q_k) = r_k, so
by induction over the siblings each node emits exactly p. This needs q_k to be the distribution of
x_k given the earlier siblings, which depends on how the drafter chose them (static `siblings`):
  * 'iid': each child drawn independently from the node's q: q_k = q (SpecInfer);
  * 'without_replacement': children drawn one after another from q without the earlier siblings
    (e.g. Gumbel top-k): q_k = norm(q with x_1..x_{k-1} set to 0) (Sequoia);
  * 'deterministic': the children are fixed functions of the context, e.g. the top-w tokens of q:
    q_k is one-hot at x_k, so child k is accepted with probability r_k(x_k) and a rejection zeroes
    x_k in r and renormalises; draft_probs is unused and may be None.
A width-1 tree (a chain) under 'iid' or 'without_replacement' is `rejection.verify_sampled`, key for
key (same uniforms, same resampling draw).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxspec.engine import rejection
from jaxspec.engine.sampling import SamplingParams, draw, probabilities
from jaxspec.drafting.trees import Tree, accepted_path

SIBLINGS = ("iid", "without_replacement", "deterministic")


@struct.dataclass
class TreeVerdict:
  accepted: jax.Array     # [B] int32 in [0, tree.depth]: drafts accepted (depth of last_node)
  last_node: jax.Array    # [B] int32: flattened index of the deepest accepted node (0: the root)
  next_token: jax.Array   # [B] int32: the correction or the bonus token


def _check(tree: Tree, tokens: jax.Array, target: jax.Array):
  if tokens.ndim != 2 or tokens.shape[1] != tree.size:
    raise ValueError(f"tokens must be [B, T={tree.size}], got {tokens.shape}")
  if target.shape[:2] != tokens.shape:
    raise ValueError(f"target rows must be [B, T={tree.size}, V], got {target.shape}")


def _rows(x: jax.Array, node: jax.Array) -> jax.Array:
  """x [B, T, ...], node [B] -> x[b, node[b]]."""
  return jnp.take_along_axis(x, node.reshape((-1, 1) + (1,) * (x.ndim - 2)), axis=1)[:, 0]


def verify_tree_greedy(tree: Tree, tokens: jax.Array, target_logits: jax.Array) -> TreeVerdict:
  """Greedy tree verification: tokens [B, T], target_logits [B, T, V]."""
  _check(tree, tokens, target_logits)
  t = tree.size
  target = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)             # [B, T]
  parents = jnp.asarray([0] + list(tree.parents[1:]))
  match = (tokens == target[:, parents]).at[:, 0].set(True)                  # root always
  on_path = jnp.asarray(tree.mask)                                           # [T, T]
  ok = jnp.all(match[:, None, :] | ~on_path[None], axis=-1)                  # [B, T]
  # The deepest matching node; among equals the first in flattened order.
  depths = jnp.asarray(tree.depths)
  rank = jnp.where(ok, depths * t + (t - 1 - jnp.arange(t)), -1)
  last = jnp.argmax(rank, axis=-1).astype(jnp.int32)
  return TreeVerdict(accepted=depths[last], last_node=last,
                     next_token=jnp.take_along_axis(target, last[:, None], axis=1)[:, 0])


def _sibling_residual(r: jax.Array, q: jax.Array) -> jax.Array:
  """r_{k+1} = norm(max(0, r_k - q_k)) after child k is rejected."""
  return rejection.residual_distribution(r, q)


def verify_tree_sampled(key: jax.Array, tree: Tree, tokens: jax.Array,
                        draft_probs: jax.Array | None, target_probs: jax.Array,
                        siblings: str = "iid") -> TreeVerdict:
  """Recursive rejection sampling over the tree (the rule in the module docstring).

  tokens [B, T], draft_probs q [B, T, V] (None for 'deterministic'), target_probs p [B, T, V].
  Static shapes, no host sync: a loop over depth, siblings unrolled, [B, V] operations.
  """
  _check(tree, tokens, target_probs)
  if siblings not in SIBLINGS:
    raise ValueError(f"siblings must be one of {SIBLINGS}, got {siblings!r}")
  if siblings != "deterministic" and (draft_probs is None
                                      or draft_probs.shape != target_probs.shape):
    raise ValueError(f"draft_probs must be [B, T, V] like target_probs {target_probs.shape} "
                     f"for siblings={siblings!r}, got "
                     f"{None if draft_probs is None else draft_probs.shape}")
  b, _, vocab = target_probs.shape
  depth, width = tree.depth, tree.max_width
  k_accept, k_resample = jax.random.split(key)
  # Drawn as [B, depth * width] so a chain uses the same uniforms as rejection.verify_sampled.
  u = jax.random.uniform(k_accept, (b, depth * width), jnp.float32).reshape(b, depth, width)
  children = jnp.asarray(tree.child_table)

  def level(d, carry):
    """Try the children of `cur`, in sibling order, against the residual r."""
    cur, r, live = carry          # live: every level so far accepted a child
    q = None if siblings == "deterministic" else _rows(draft_probs, cur)       # [B, V]
    taken = jnp.zeros((b, vocab), bool)   # earlier siblings' tokens ('without_replacement')
    nxt, moved = cur, jnp.zeros((b,), bool)
    for k in range(width):
      child = children[cur, k]
      valid = live & ~moved & (child >= 0)
      x = jnp.take_along_axis(tokens, jnp.maximum(child, 0)[:, None], axis=1)[:, 0]
      if siblings == "deterministic":
        qk = jax.nn.one_hot(x, vocab, dtype=r.dtype)
      elif siblings == "without_replacement" and k > 0:
        rest = jnp.where(taken, 0.0, q)
        total = jnp.sum(rest, axis=-1, keepdims=True)
        qk = rest / jnp.where(total > 0, total, 1.0)
      else:
        qk = q
      qx = jnp.take_along_axis(qk, x[:, None], axis=1)[:, 0]
      rx = jnp.take_along_axis(r, x[:, None], axis=1)[:, 0]
      # u < r/q written without the division; q(x) = 0 (a token its q cannot have drawn) rejects.
      accept = valid & (qx > 0) & (u[:, d, k] * qx < rx)
      r = jnp.where((valid & ~accept)[:, None], _sibling_residual(r, qk), r)
      nxt = jnp.where(accept, child, nxt)
      moved = moved | accept
      if siblings == "without_replacement":
        taken = taken | jax.nn.one_hot(x, vocab, dtype=bool)
    r = jnp.where(moved[:, None], _rows(target_probs, nxt), r)
    return nxt, r, moved

  # A loop over depth rather than an unrolled walk: it compiles several times faster (CPU).
  init = (jnp.zeros((b,), jnp.int32), target_probs[:, 0], jnp.ones((b,), bool))
  cur, r, _ = jax.lax.fori_loop(0, depth, level, init)
  next_token = draw(k_resample, r)
  return TreeVerdict(accepted=jnp.asarray(tree.depths)[cur], last_node=cur,
                     next_token=next_token)


def verify_tree(key: jax.Array, tree: Tree, tokens: jax.Array, draft_probs: jax.Array | None,
                target_logits: jax.Array, sampling: SamplingParams,
                siblings: str = "iid") -> TreeVerdict:
  """Accept a draft tree against the verification logits under `sampling` (the tree form of
  `rejection.verify_drafts`): target_logits [B, T, V] go through `sampling.probabilities` here;
  draft_probs [B, T, V] are `sampling.probabilities` of the drafter's logits at each node (unused,
  may be None, when greedy or 'deterministic'). Jit with `tree`, `sampling`, `siblings` static."""
  if sampling.greedy:
    return verify_tree_greedy(tree, tokens, target_logits)
  return verify_tree_sampled(key, tree, tokens, draft_probs,
                             probabilities(target_logits, sampling), siblings)


def emitted_tokens(tree: Tree, tokens: jax.Array, verdict: TreeVerdict,
                   pad: int = -1) -> jax.Array:
  """The round's output [B, depth + 1] int32: the accepted drafts in path order, then next_token
  at column `accepted`, `pad` after."""
  path = accepted_path(tree, verdict.last_node)[:, 1:]                       # [B, depth]
  drafts = jnp.take_along_axis(tokens, jnp.maximum(path, 0), axis=1)
  out = jnp.concatenate([drafts, jnp.full((drafts.shape[0], 1), pad, drafts.dtype)], axis=1)
  col = jnp.arange(tree.depth + 1)[None]
  acc = verdict.accepted[:, None]
  return jnp.where(col < acc, out, jnp.where(col == acc, verdict.next_token[:, None], pad))
