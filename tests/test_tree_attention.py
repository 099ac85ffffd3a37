"""Draft-tree masks in the attention kernels (interpret mode) and their references.

One semantic everywhere: with `tree_bits` (one int32 per query row, `Tree.ancestor_bits`) a row
sees what the plan shows it before `lengths` and key lengths + i iff bit i of its bits is set. All
inputs are float32, so kernel and reference agree to float rounding. Cache entries that no row may
see and that lie past the keys the bits name hold NaN: a kernel reading one gives NaN.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.drafting.trees import Tree
from jaxspec.model import kv_cache
from jaxspec.model.attention import Dense, Sparse, attend
from pallas_kernels import online_softmax
from pallas_kernels import sparse_attention as sp
from pallas_kernels import verify_attention as va

TREE = Tree.from_widths((2, 2, 1))          # 11 nodes, 4 root-to-leaf paths of 4 nodes
T = TREE.size
B, S, HQ, HKV, D = 4, 48, 4, 2, 16          # GQA 2: 22 packed rows in a 32-row tile
KNOBS = dict(block_k=16, num_splits=2)      # splits [0, 32) and [32, 48) of 16-key blocks
# An empty prefix; a block ending on node 1 (at 15, which only its subtree sees, so that block must
# be masked); a window across the split boundary; a window ending at the cache end.
LENGTHS = np.array([0, 14, 27, S - T], np.int32)
# Sequences 0 and 1 hold the tree in BFS order, 2 and 3 in DFS order ([B, T] bits).
ORDERS = ("bfs", "bfs", "dfs", "dfs")
TREES = tuple(TREE.flatten(o) for o in ORDERS)
BITS = jnp.asarray(np.stack([tr.ancestor_bits for tr in TREES]))


def _normal(rng, *shape):
  return jnp.asarray(rng.normal(size=shape), jnp.float32)


def _poison(x, keep):
  """x [B, S, H, D]; keep [B, S] or [B, S, H] bool: NaN everywhere else."""
  keep = keep if keep.ndim == 3 else keep[:, :, None]
  return jnp.where(jnp.asarray(keep)[..., None], x, jnp.nan)


def _tree_inputs(rng):
  """Queries of the T nodes, each node's K/V [B, T, Hkv, D], a prefix cache, and that cache with
  the nodes' K/V written at lengths + node."""
  q = _normal(rng, B, T, HQ, D)
  node_k, node_v = _normal(rng, B, T, HKV, D), _normal(rng, B, T, HKV, D)
  prefix_k, prefix_v = _normal(rng, B, S, HKV, D), _normal(rng, B, S, HKV, D)
  at = jnp.asarray(LENGTHS)[:, None] + jnp.arange(T)
  k, v = kv_cache.write(prefix_k, node_k, at), kv_cache.write(prefix_v, node_v, at)
  return q, node_k, node_v, prefix_k, prefix_v, k, v


def _below(ends):
  return np.arange(S)[None] < np.asarray(ends)[:, None]


def _close_scores(got, want):
  """bf16 scores: -inf in the same places, the rest within bf16 rounding of each other."""
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  assert not np.isnan(got).any() and not np.isnan(want).any()
  np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
  fin = np.isfinite(want)
  assert fin.any()
  np.testing.assert_allclose(got[fin], want[fin], rtol=1e-2, atol=1e-6)


def _selection(rng, ends, hkv=None, kk=12):
  """Distinct positions below ends[b], one list per sequence or per KV head, random counts."""
  shape = (B,) if hkv is None else (B, hkv)
  idx, cnt = np.zeros(shape + (kk,), np.int32), np.zeros(shape, np.int32)
  for pos in np.ndindex(*shape):
    avail = int(ends[pos[0]])
    c = int(rng.integers(0, min(kk, avail) + 1))
    idx[pos][:c] = rng.permutation(avail)[:c]
    idx[pos][c:] = rng.integers(0, S, kk - c)                    # padding, never read
    cnt[pos] = c
  return idx, cnt


def _sparse_keep(idx, cnt, tail_start, window_end):
  """[B, S, Hkv] what some row may see: the selection, the tail, the window."""
  keep = np.zeros((B, S, HKV), bool)
  for i in range(B):
    keep[i, min(tail_start[i], LENGTHS[i]):window_end[i]] = True
    for h in range(HKV):
      sel = idx[i, h, :cnt[i, h]] if idx.ndim == 3 else idx[i, :cnt[i]]
      keep[i, sel, h] = True
  return keep


# ----------------------------------------------------------------------------------------------
# verify_attention

VERIFY_SCORES = [
    dict(),
    dict(score_kind="logits", score_rows=(0, -1)),
    dict(score_kind="weights", score_rows=(1, 3)),               # rows sharing root and node 1
    dict(score_kind="logits", per_row=True),
    dict(score_kind="weights", per_row=True),
]


@pytest.mark.parametrize("opts", VERIFY_SCORES, ids=lambda o: "-".join(map(str, o.values())))
def test_verify_tree_kernel_equals_reference(opts):
  rng = np.random.default_rng(1)
  q, k, v = _normal(rng, B, T, HQ, D), _normal(rng, B, S, HKV, D), _normal(rng, B, S, HKV, D)
  lengths = jnp.asarray(LENGTHS)
  seen = _below(LENGTHS + T)
  out, scores = va.verify_attention(q, _poison(k, seen), _poison(v, seen), lengths,
                                    tree_bits=BITS, interpret=True, **KNOBS, **opts)
  ref, ref_scores = va.verify_attention_reference(q, k, v, lengths, tree_bits=BITS, **opts)
  assert not np.isnan(np.asarray(out)).any()
  np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)
  # The tree changes the output: the causal rule would show later siblings' keys.
  assert np.abs(np.asarray(ref) - np.asarray(va.verify_attention_reference(q, k, v, lengths)[0])
                ).max() > 1e-2
  if not opts:
    assert scores is None and ref_scores is None
    return
  _close_scores(scores, ref_scores)
  sc = np.asarray(ref_scores, np.float32)
  if opts.get("per_row"):
    # Row t sees the prefix and exactly its tree's ancestors.
    for i, tr in enumerate(TREES):
      n = LENGTHS[i]
      np.testing.assert_array_equal(np.isfinite(sc[i, :, :n + T]),
                                    np.concatenate([np.ones((T, n), bool), tr.mask], axis=1))
  else:
    # Collected rows: (0, -1) share the root; (1, 3) the root and node 1 (node 3 is node 1's child
    # in BFS order, its grandchild in DFS order).
    shared = 1 if opts["score_rows"] == (0, -1) else 2
    for i in range(B):
      np.testing.assert_array_equal(np.isfinite(sc[i]), np.arange(S) < LENGTHS[i] + shared)


@pytest.mark.parametrize("order", ["bfs", "dfs"])
def test_one_tree_level_against_the_written_window(order):
  """The nodes of depth 2 as the only query rows, after the shallower nodes were written: their
  rows of ancestor_bits address the window of every node so far (more keys than rows). The
  output and per-row scores are the full tree call's rows, though the slots of the deeper nodes
  hold other values (not yet written); verify and sparse, kernel and reference."""
  tree = TREE.flatten(order)
  rows = np.flatnonzero(tree.depths == 2)                        # 4 rows
  written = tree.depths <= 2
  window = int(np.flatnonzero(written).max()) + 1                # BFS 7 keys, DFS 10 (with holes)
  rng = np.random.default_rng(2)
  q, node_k, node_v, prefix_k, prefix_v, k, v = _tree_inputs(rng)
  lengths = jnp.asarray(LENGTHS)
  # The level's cache: deeper nodes' slots hold something else (the prefix cache's entries there).
  wat = lengths[:, None] + jnp.asarray(np.flatnonzero(written))
  wk = kv_cache.write(prefix_k, node_k[:, written], wat)
  wv = kv_cache.write(prefix_v, node_v[:, written], wat)
  bits = jnp.asarray(tree.ancestor_bits[rows])                   # [4], the [T] form
  seen = _below(LENGTHS + window)
  opts = dict(score_kind="weights", per_row=True)

  full, full_scores = va.verify_attention_reference(q, k, v, lengths,
                                                    tree_bits=jnp.asarray(tree.ancestor_bits),
                                                    **opts)
  ref, ref_scores = va.verify_attention_reference(q[:, rows], wk, wv, lengths, tree_bits=bits,
                                                  **opts)
  out, scores = va.verify_attention(q[:, rows], _poison(wk, seen), _poison(wv, seen), lengths,
                                    tree_bits=bits, interpret=True, **KNOBS, **opts)
  np.testing.assert_allclose(ref, full[:, rows], atol=1e-6, rtol=1e-6)
  np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)
  _close_scores(ref_scores, np.asarray(full_scores, np.float32)[:, rows])
  _close_scores(scores, ref_scores)

  # Sparse: a dense tail of 5 before lengths (where there is one) and a selection before it.
  tail_start = np.maximum(LENGTHS - 5, 0).astype(np.int32)
  idx, cnt = _selection(rng, tail_start)
  sel = (jnp.asarray(idx), jnp.asarray(cnt), jnp.asarray(tail_start), lengths)
  keep = _sparse_keep(idx, cnt, tail_start, LENGTHS + window)
  full = sp.sparse_attention_reference(q, k, v, *sel, tree_bits=jnp.asarray(tree.ancestor_bits))
  ref = sp.sparse_attention_reference(q[:, rows], wk, wv, *sel, tree_bits=bits)
  out = sp.sparse_attention(q[:, rows], _poison(wk, keep), _poison(wv, keep), *sel,
                            tree_bits=bits, interpret=True, block_k=16)
  np.testing.assert_allclose(ref, full[:, rows], atol=1e-6, rtol=1e-6)
  np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)


def _paths_as_chains(q, prefix_k, prefix_v, node_k, node_v, lengths):
  """Each sequence's root-to-leaf paths as chains of their own: [B * P, depth + 1, ...] queries
  and caches holding the path's K/V contiguously after the prefix (every path of TREE has
  depth + 1 nodes), and the function taking the paths' rows of a [B, T, ...] tree output."""
  paths = np.stack([np.asarray(tr.paths()) for tr in TREES])    # [B, P, n]
  p, n = paths.shape[1:]
  take = lambda x: x[np.arange(B)[:, None, None], paths].reshape((B * p, n) + x.shape[2:])
  rep = lambda x: jnp.repeat(x, p, axis=0)
  at = rep(lengths)[:, None] + jnp.arange(n)
  ck = kv_cache.write(rep(prefix_k), take(node_k), at)
  cv = kv_cache.write(rep(prefix_v), take(node_v), at)
  return take(q), ck, cv, rep(lengths), take


def test_kernels_on_a_tree_equal_each_path_as_a_chain():
  """One pass over the flattened tree (BFS in two sequences, DFS in two) gives, on each
  root-to-leaf path's rows, what a chain of that path alone gives (its K/V contiguous after the
  prefix): both kernels, outputs and the prefix keys' per-row weights."""
  rng = np.random.default_rng(3)
  q, node_k, node_v, prefix_k, prefix_v, k, v = _tree_inputs(rng)
  lengths = jnp.asarray(LENGTHS)
  cq, ck, cv, clen, rows = _paths_as_chains(q, prefix_k, prefix_v, node_k, node_v, lengths)
  p = len(TREE.paths())

  opts = dict(score_kind="weights", per_row=True)
  out, scores = va.verify_attention(q, k, v, lengths, tree_bits=BITS, interpret=True, **KNOBS,
                                    **opts)
  want, want_scores = va.verify_attention(cq, ck, cv, clen, interpret=True, **KNOBS, **opts)
  np.testing.assert_allclose(rows(out), want, atol=1e-5, rtol=1e-5)
  sc = np.asarray(rows(scores), np.float32)                       # [B * P, n, S]
  ws = np.asarray(want_scores, np.float32)
  for i in range(B * p):                                         # the prefix keys' weights
    m = int(clen[i])
    np.testing.assert_allclose(sc[i, :, :m], ws[i, :, :m], rtol=1e-2, atol=1e-6)

  # Sparse: the same selection and tail for every path of a sequence.
  tail_start = np.maximum(LENGTHS - 5, 0).astype(np.int32)
  idx, cnt = _selection(rng, tail_start, hkv=HKV)
  sel = (jnp.asarray(idx), jnp.asarray(cnt), jnp.asarray(tail_start))
  out = sp.sparse_attention(q, k, v, *sel, lengths, tree_bits=BITS, interpret=True, block_k=16)
  want = sp.sparse_attention(cq, ck, cv, *(jnp.repeat(x, p, axis=0) for x in sel), clen,
                             interpret=True, block_k=16)
  np.testing.assert_allclose(rows(out), want, atol=1e-5, rtol=1e-5)


def test_chain_as_bits_is_the_chain_bitwise():
  """Tree.chain(T - 1)'s bits give exactly the call without bits: kernels and references."""
  rng = np.random.default_rng(4)
  t = 5
  q, k, v = _normal(rng, B, t, HQ, D), _normal(rng, B, S, HKV, D), _normal(rng, B, S, HKV, D)
  lengths = jnp.asarray(np.array([0, 15, 27, S - t], np.int32))   # 15: a block ends on the root
  chain = jnp.asarray(Tree.chain(t - 1).ancestor_bits)
  opts = dict(score_kind="weights", score_rows=(0, -1))
  for fn in (functools.partial(va.verify_attention, interpret=True, **KNOBS),
             va.verify_attention_reference):
    a, b = fn(q, k, v, lengths, tree_bits=chain, **opts), fn(q, k, v, lengths, **opts)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(np.asarray(a[1], np.float32), np.asarray(b[1], np.float32))
  _, per_row = va.verify_attention_reference(q, k, v, lengths, tree_bits=chain,
                                             score_kind="logits", per_row=True)
  np.testing.assert_array_equal(
      np.asarray(per_row, np.float32),
      np.asarray(va.verify_attention_reference(q, k, v, lengths, score_kind="logits",
                                               per_row=True)[1], np.float32))
  tail_start = np.array([0, 10, 27, 30], np.int32)
  idx, cnt = _selection(rng, tail_start)
  sel = (jnp.asarray(idx), jnp.asarray(cnt), jnp.asarray(tail_start), lengths)
  for fn in (functools.partial(sp.sparse_attention, interpret=True, block_k=16),
             sp.sparse_attention_reference):
    np.testing.assert_array_equal(fn(q, k, v, *sel, tree_bits=chain), fn(q, k, v, *sel))


# ----------------------------------------------------------------------------------------------
# sparse_attention

@pytest.mark.parametrize("per_head", [False, True])
def test_sparse_tree_kernel_equals_reference(per_head):
  """Tails: none (no prefix), the whole prefix (its last block also holds node 1), one starting
  past lengths (the tree's keys are still seen by their bits, the prefix only through the
  selection), and 9 dense keys before a window at the cache end; the selection comes before."""
  rng = np.random.default_rng(5 + per_head)
  q, k, v = _normal(rng, B, T, HQ, D), _normal(rng, B, S, HKV, D), _normal(rng, B, S, HKV, D)
  lengths = jnp.asarray(LENGTHS)
  tail_start = np.array([0, 0, 30, 28], np.int32)
  idx, cnt = _selection(rng, np.minimum(tail_start, LENGTHS), HKV if per_head else None)
  sel = (jnp.asarray(idx), jnp.asarray(cnt), jnp.asarray(tail_start), lengths)
  keep = _sparse_keep(idx, cnt, tail_start, LENGTHS + T)
  out = sp.sparse_attention(q, _poison(k, keep), _poison(v, keep), *sel, tree_bits=BITS,
                            interpret=True, block_k=16, num_splits=2)
  ref = sp.sparse_attention_reference(q, k, v, *sel, tree_bits=BITS)
  assert not np.isnan(np.asarray(out)).any()
  np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)
  assert np.abs(np.asarray(ref) - np.asarray(sp.sparse_attention_reference(q, k, v, *sel))
                ).max() > 1e-2


def test_tree_bounds():
  """(full, end): the keys every row sees end at `full`, those any row sees at `end`."""
  lengths = jnp.asarray([0, 10, 40], jnp.int32)
  cases = [(Tree.chain(4).ancestor_bits, 1, 5),           # a chain: the causal rule's bounds
           (TREE.ancestor_bits, 1, T),                     # a tree's rows share the root only
           (TREE.ancestor_bits[[3, 7]], 2, 8),             # node 3 and its child share 0, 1, 3
           ([0b1011, 0b0111], 2, 4),
           ([-1, -1], 32, 32),                              # all 32 bits, bit 31 the sign bit
           ([0x7fffffff, -1], 31, 32),
           ([0, 0], 0, 0)]                                  # the prefix alone
  for bits, run, width in cases:
    bits = jnp.broadcast_to(jnp.asarray(bits, jnp.int32), (3, len(bits)))
    full, end = online_softmax.tree_bounds(bits, lengths, S)
    np.testing.assert_array_equal(full, np.minimum(lengths + run, S))
    np.testing.assert_array_equal(end, np.minimum(lengths + width, S))


def test_bad_tree_bits():
  q, k = jnp.zeros((2, 3, 4, 16)), jnp.zeros((2, 20, 2, 16))
  z = jnp.zeros((2,), jnp.int32)
  for bad in (jnp.zeros((4,), jnp.int32), jnp.zeros((3, 3), jnp.int32),
              jnp.zeros((3,), jnp.float32)):
    with pytest.raises(ValueError, match="tree_bits"):
      va.verify_attention_reference(q, k, k, z, tree_bits=bad)
    with pytest.raises(ValueError, match="tree_bits"):
      va.verify_attention(q, k, k, z, tree_bits=bad, interpret=True)
    with pytest.raises(ValueError, match="tree_bits"):
      sp.sparse_attention(q, k, k, jnp.zeros((2, 4), jnp.int32), z, z, z, tree_bits=bad,
                          interpret=True)


# ----------------------------------------------------------------------------------------------
# The dispatch

def test_plans_carry_tree_bits_to_every_backend():
  rng = np.random.default_rng(6)
  q, k, v = _normal(rng, B, T, HQ, D), _normal(rng, B, S, HKV, D), _normal(rng, B, S, HKV, D)
  lengths = jnp.asarray(LENGTHS)
  tail_start = jnp.asarray(np.maximum(LENGTHS - 5, 0))
  idx, cnt = _selection(rng, np.asarray(tail_start))
  layers = 2
  sparse = Sparse(jnp.asarray(np.stack([idx] * layers)), jnp.asarray(np.stack([cnt] * layers)),
                  tail_start, BITS)                                # positional, tree_bits last
  dense = Dense(tree_bits=BITS)
  assert sparse.for_layer(1).tree_bits is BITS and dense.for_layer(1).tree_bits is BITS
  leaves = jax.tree_util.tree_leaves(dense)
  assert len(leaves) == 1 and leaves[0] is BITS                   # data, not static
  want_dense = va.verify_attention_reference(q, k, v, lengths, tree_bits=BITS)[0]
  want_sparse = sp.sparse_attention_reference(q, k, v, jnp.asarray(idx), jnp.asarray(cnt),
                                              tail_start, lengths, tree_bits=BITS)
  for backend in ("reference", "interpret"):
    got, _ = attend(q, None, None, k, v, lengths, dense.for_layer(0), backend)
    np.testing.assert_allclose(got, want_dense, atol=1e-5, rtol=1e-5)
    got, _ = attend(q, None, None, k, v, lengths, sparse.for_layer(0), backend)
    np.testing.assert_allclose(got, want_sparse, atol=1e-5, rtol=1e-5)
