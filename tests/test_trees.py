"""Draft trees: shape and flattening, masks, compaction."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import kv_cache
from jaxspec.trees import Tree, compact_layer, mask_from_bits

# ----------------------------------------------------------------------------------------------
# Shape, flattening, masks

# widths (2, 1): a root with two children, each with one child.
#   BFS: 0 -> 1, 2;  1 -> 3;  2 -> 4        DFS: 0 -> 1, 3;  1 -> 2;  3 -> 4
BFS_21 = dict(parents=(-1, 0, 0, 1, 2), depths=[0, 1, 1, 2, 2],
              mask=[[1, 0, 0, 0, 0],
                    [1, 1, 0, 0, 0],
                    [1, 0, 1, 0, 0],
                    [1, 1, 0, 1, 0],
                    [1, 0, 1, 0, 1]],
              bits=[0b1, 0b11, 0b101, 0b1011, 0b10101], paths=((0, 1, 3), (0, 2, 4)))
DFS_21 = dict(parents=(-1, 0, 1, 0, 3), depths=[0, 1, 2, 1, 2],
              mask=[[1, 0, 0, 0, 0],
                    [1, 1, 0, 0, 0],
                    [1, 1, 1, 0, 0],
                    [1, 0, 0, 1, 0],
                    [1, 0, 0, 1, 1]],
              bits=[0b1, 0b11, 0b111, 0b1001, 0b11001], paths=((0, 1, 2), (0, 3, 4)))


@pytest.mark.parametrize("order,want", [("bfs", BFS_21), ("dfs", DFS_21)])
def test_flattening_by_hand(order, want):
  tree = Tree.from_widths((2, 1), order=order)
  assert tree.parents == want["parents"]
  np.testing.assert_array_equal(tree.depths, want["depths"])
  np.testing.assert_array_equal(tree.mask, np.asarray(want["mask"], bool))
  np.testing.assert_array_equal(tree.ancestor_bits, want["bits"])
  assert tree.ancestor_bits.dtype == np.int32
  assert tree.paths() == want["paths"]
  assert (tree.size, tree.depth, tree.max_width) == (5, 2, 2)


def test_default_tree_2211():
  bfs = Tree.from_widths((2, 2, 1, 1))
  dfs = Tree.from_widths((2, 2, 1, 1), order="dfs")
  for tree in (bfs, dfs):
    assert (tree.size, tree.depth, tree.max_width) == (15, 4, 2)
    assert np.bincount(tree.depths).tolist() == [1, 2, 4, 4, 4]
    assert len(tree.paths()) == 4 and all(len(p) == 5 for p in tree.paths())
  assert bfs.parents == (-1, 0, 0, 1, 1, 2, 2, 3, 4, 5, 6, 7, 8, 9, 10)
  assert dfs.parents == (-1, 0, 1, 2, 3, 1, 5, 6, 0, 8, 9, 10, 8, 12, 13)
  assert dfs.paths()[0] == (0, 1, 2, 3, 4)        # DFS: the first path is contiguous
  np.testing.assert_array_equal(bfs.depths, [0, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4])


def test_reflattening_is_a_relabelling():
  """bfs <-> dfs through `flatten` is the same tree: permutation maps the nodes, masks follow."""
  bfs = Tree.from_widths((3, 2, 1))
  dfs = bfs.flatten("dfs")
  perm = bfs.permutation("dfs")                   # dfs index -> bfs index
  assert dfs == Tree.from_widths((3, 2, 1), order="dfs")
  assert dfs.flatten("bfs") == bfs
  np.testing.assert_array_equal(dfs.depths, bfs.depths[perm])
  np.testing.assert_array_equal(dfs.mask, bfs.mask[np.ix_(perm, perm)])
  assert sorted(tuple(perm[list(p)]) for p in dfs.paths()) == sorted(bfs.paths())
  # Any valid parent list flattens; siblings keep their order.
  odd = Tree((-1, 0, 0, 2, 1))
  assert odd.flatten("bfs").parents == (-1, 0, 0, 1, 2)
  assert odd.flatten("dfs").parents == (-1, 0, 1, 0, 3)


def test_chain_is_the_width_one_tree():
  chain = Tree.chain(4)
  assert chain == Tree.from_widths((1, 1, 1, 1), order="dfs") == Tree((-1, 0, 1, 2, 3))
  np.testing.assert_array_equal(chain.mask, np.tril(np.ones((5, 5), bool)))   # causal
  np.testing.assert_array_equal(chain.depths, np.arange(5))
  assert chain.paths() == ((0, 1, 2, 3, 4),)
  assert Tree.from_widths(()).size == 1 and Tree.from_widths(()).depth == 0


def test_bitmask_expands_to_the_mask_up_to_32_nodes():
  for tree in (Tree.from_widths((2, 2, 1, 1)), Tree.from_widths((31,)),   # 32 nodes: bit 31
               Tree.from_widths((2, 3, 1), order="dfs")):
    bits = jnp.asarray(tree.ancestor_bits)
    np.testing.assert_array_equal(mask_from_bits(bits, tree.size), tree.mask)
  assert Tree.from_widths((31,)).ancestor_bits[-1] < 0
  big = Tree.from_widths((32,))
  assert big.mask.shape == (33, 33)
  with pytest.raises(ValueError, match="at most 32 nodes"):
    big.ancestor_bits


def test_static_and_hashable():
  a, b = Tree.from_widths([2, 2, 1, 1]), Tree(tuple(np.int64(p) for p in
                                                    Tree.from_widths((2, 2, 1, 1)).parents))
  assert a == b and hash(a) == hash(b) and {a: 1}[b] == 1
  with pytest.raises(Exception):
    a.parents = ()
  f = jax.jit(lambda x, tree: x + tree.depth, static_argnames="tree")
  assert int(f(1, tree=a)) == 5


@pytest.mark.parametrize("bad,match", [
    (lambda: Tree(()), "root"),
    (lambda: Tree((0, 0)), "root"),
    (lambda: Tree((-1, -1)), "node 1 has parent -1"),
    (lambda: Tree((-1, 0, 2)), "node 2 has parent 2"),
    (lambda: Tree((-1, 0, 5, 1)), "node 2 has parent 5"),
    (lambda: Tree(("a",)), "integers"),
    (lambda: Tree.from_widths((2, 0)), "widths"),
    (lambda: Tree.from_widths((1.5,)), "widths"),
    (lambda: Tree.from_widths((True,)), "widths"),
    (lambda: Tree.from_widths((2,), order="pre"), "order"),
])
def test_validation(bad, match):
  with pytest.raises(ValueError, match=match):
    bad()


# ----------------------------------------------------------------------------------------------
# Compaction

@pytest.mark.parametrize("order", ["bfs", "dfs"])
def test_compaction_equals_writing_the_accepted_path_contiguously(order):
  """One sequence per possible last node: after compaction the cache up to the new length is the
  cache that writing the accepted nodes' K/V at lengths + 0..depth would give."""
  tree = Tree.from_widths((2, 2, 1), order=order)
  t, s, h, d = tree.size, 32, 2, 4
  b = t
  rng = np.random.default_rng(0)
  lengths = jnp.asarray(rng.integers(0, s - t + 1, size=b), jnp.int32)
  prefix = jnp.asarray(rng.normal(size=(b, s, h, d)), jnp.float32)
  node_kv = jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32)     # K/V of each node
  cache = kv_cache.write(prefix, node_kv, lengths[:, None] + jnp.arange(t))
  last = jnp.arange(t, dtype=jnp.int32)
  out = jax.jit(compact_layer, static_argnames="tree")(cache, lengths, tree=tree, last_node=last)
  out, cache, prefix, node_kv = map(np.asarray, (out, cache, prefix, node_kv))
  for i in range(b):
    path = tree.path_table[i, :tree.depths[i] + 1]
    start, end = int(lengths[i]), int(lengths[i]) + len(path)
    want = prefix[i].copy()
    want[start:end] = node_kv[i, path]          # the accepted tokens' K/V written contiguously
    np.testing.assert_array_equal(out[i, :end], want[:end])
    # at most depth entries move: the rest of the tree and what follows it are untouched
    np.testing.assert_array_equal(out[i, end:], cache[i, end:])
