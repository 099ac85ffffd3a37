"""Static draft trees: the shape, its flattening, the tree attention mask, accepted-path compaction.

A tree of T nodes is verified in one pass of T query rows. Node 0 is the root: the last emitted
token, not yet in the cache (row 0 of the chain's gamma + 1 rows); every other node is a draft token
whose parent is the token before it. Node i sits at position `lengths + depth(i)` and sees the
prefix, its ancestors and itself. Row i of the verification logits is the target distribution of
i's children (for the chain, p_{i+1}); the rows of the leaves give the bonus token.

A `Tree` is a tuple of parent indices in flattened order with every parent before its children
(parents[i] < i, which breadth-first and depth-first orders both satisfy). Siblings keep their order
in either flattening: it is the order acceptance tries them in, so sibling k should be the drafter's
k-th proposal. The tree is static (frozen, hashable): pass it to jit as a static argument; all the
index tables below are numpy constants.

The chain of gamma drafts is `Tree.chain(gamma)`, widths (1,) * gamma.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

ORDERS = ("bfs", "dfs")


def _const(x: np.ndarray) -> np.ndarray:
  x.setflags(write=False)
  return x


@dataclasses.dataclass(frozen=True)
class Tree:
  """parents[i]: the parent of node i in flattened order; parents[0] = -1 (the root)."""
  parents: tuple[int, ...]

  def __post_init__(self):
    try:
      parents = tuple(int(p) for p in self.parents)
    except (TypeError, ValueError):
      raise ValueError(f"parents must be a sequence of integers, got {self.parents!r}") from None
    if not parents or parents[0] != -1:
      raise ValueError(f"node 0 must be the root (parent -1), got parents {parents}")
    for i, p in enumerate(parents[1:], start=1):
      if not 0 <= p < i:
        raise ValueError(f"node {i} has parent {p}: every node but the root needs a parent "
                         f"that comes before it (0 <= parent < {i}); parents {parents}")
    object.__setattr__(self, "parents", parents)

  # --- construction

  @classmethod
  def from_widths(cls, widths: tuple[int, ...] | list[int], order: str = "bfs") -> "Tree":
    """Every node at depth d - 1 gets widths[d - 1] children: (2, 2, 1, 1) is 1 + 2 + 4 + 4 + 4
    = 15 nodes, 14 drafts, 4 deep. widths () is the root alone (plain decoding)."""
    widths = tuple(widths)
    if any(isinstance(w, bool) or not isinstance(w, (int, np.integer)) or w < 1 for w in widths):
      raise ValueError(f"widths must be integers >= 1 (children per node at each depth), got "
                       f"{widths}")
    parents, level = [-1], [0]
    for w in widths:
      nxt = []
      for p in level:
        for _ in range(w):
          nxt.append(len(parents))
          parents.append(p)
      level = nxt
    return cls(tuple(parents)).flatten(order)

  @classmethod
  def chain(cls, gamma: int) -> "Tree":
    return cls.from_widths((1,) * gamma)

  def flatten(self, order: str) -> "Tree":
    """The same tree in breadth-first ('bfs') or depth-first pre-order ('dfs'), siblings in their
    current order. `permutation(order)` maps the new indices to the current ones."""
    perm = self.permutation(order)
    inv = np.empty(self.size, np.int64)
    inv[perm] = np.arange(self.size)
    return Tree(tuple(-1 if i == 0 else int(inv[self.parents[i]]) for i in perm))

  def permutation(self, order: str) -> np.ndarray:
    """[T] int: new flattened index -> current index, for order 'bfs' or 'dfs'."""
    if order not in ORDERS:
      raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    if order == "bfs":
      out, queue = [], [0]
      while queue:
        out.append(queue.pop(0))
        queue.extend(self.children[out[-1]])
    else:
      out, stack = [], [0]
      while stack:
        out.append(stack.pop())
        stack.extend(reversed(self.children[out[-1]]))
    return _const(np.asarray(out, np.int32))

  @functools.cached_property
  def bfs_index(self) -> np.ndarray:
    """[T] int32: each node's index in this tree's breadth-first flattening (`flatten('bfs')`)."""
    out = np.empty(self.size, np.int32)
    out[self.permutation("bfs")] = np.arange(self.size)
    return _const(out)

  # --- structure

  @property
  def size(self) -> int:
    """T: nodes, root included (the verification rows)."""
    return len(self.parents)

  @functools.cached_property
  def children(self) -> tuple[tuple[int, ...], ...]:
    kids = [[] for _ in self.parents]
    for i, p in enumerate(self.parents[1:], start=1):
      kids[p].append(i)
    return tuple(tuple(k) for k in kids)

  @functools.cached_property
  def depths(self) -> np.ndarray:
    """[T] int32: depth of each node (root 0). Node i's position is lengths + depths[i]."""
    d = np.zeros(self.size, np.int32)
    for i, p in enumerate(self.parents[1:], start=1):
      d[i] = d[p] + 1
    return _const(d)

  @property
  def depth(self) -> int:
    """The most drafts a round can accept."""
    return int(self.depths.max())

  @property
  def max_width(self) -> int:
    """The most children of one node (1 for a chain; 0 for the root alone)."""
    return max(len(c) for c in self.children)

  @functools.cached_property
  def child_table(self) -> np.ndarray:
    """[T, max_width] int32: the children of each node in sibling order, -1 padded."""
    table = np.full((self.size, max(self.max_width, 1)), -1, np.int32)
    for i, kids in enumerate(self.children):
      table[i, :len(kids)] = kids
    return _const(table)

  @functools.cached_property
  def path_table(self) -> np.ndarray:
    """[T, depth + 1] int32: row i holds i's ancestors from the root (column 0) to i itself
    (column depths[i]), -1 after."""
    table = np.full((self.size, self.depth + 1), -1, np.int32)
    for i in range(self.size):
      node = i
      for d in range(self.depths[i], -1, -1):
        table[i, d] = node
        node = self.parents[node]
    return _const(table)

  @property
  def leaves(self) -> tuple[int, ...]:
    return tuple(i for i, c in enumerate(self.children) if not c)

  def paths(self) -> tuple[tuple[int, ...], ...]:
    """The root-to-leaf paths, as node indices, leaves in flattened order."""
    return tuple(tuple(int(n) for n in self.path_table[leaf, :self.depths[leaf] + 1])
                 for leaf in self.leaves)

  # --- attention masks

  @functools.cached_property
  def mask(self) -> np.ndarray:
    """[T, T] bool: mask[i, j] = node j is an ancestor of node i or i itself. Row i's keys among
    the T new ones; every row also sees the whole prefix."""
    m = np.zeros((self.size, self.size), bool)
    rows = np.arange(self.size)[:, None]
    table = self.path_table
    m[np.broadcast_to(rows, table.shape)[table >= 0], table[table >= 0]] = True
    return _const(m)

  @functools.cached_property
  def ancestor_bits(self) -> np.ndarray:
    """[T] int32, T <= 32: bit j of row i is mask[i, j] (bit 31 is the sign bit)."""
    if self.size > 32:
      raise ValueError(f"an int32 ancestor bitmask holds at most 32 nodes; this tree has "
                       f"{self.size}: use the dense `mask`")
    weights = np.left_shift(np.uint32(1), np.arange(self.size, dtype=np.uint32))
    bits = (self.mask.astype(np.uint32) * weights[None, :]).sum(axis=1, dtype=np.uint32)
    return _const(bits.view(np.int32))


def mask_from_bits(bits: jax.Array, size: int) -> jax.Array:
  """Expand ancestor bitmasks [..., R] int32 to a bool mask [..., R, size] (what a kernel does per
  row of a tile: (bits >> j) & 1)."""
  shifts = jnp.arange(size, dtype=jnp.int32)
  return (jnp.right_shift(bits[..., None], shifts) & 1).astype(bool)


# ----------------------------------------------------------------------------------------------
# Accepted-path compaction

def accepted_path(tree: Tree, last_node: jax.Array) -> jax.Array:
  """last_node [B] int32 (the deepest accepted node) -> [B, depth + 1] int32: the accepted nodes'
  flattened indices from the root, -1 past the last one."""
  return jnp.asarray(tree.path_table)[last_node]


def compact_layer(layer: jax.Array, lengths: jax.Array, tree: Tree,
                  last_node: jax.Array) -> jax.Array:
  """Move the accepted nodes' K/V to contiguous positions after the prefix.

  layer [B, S, H, D]: one cache layer holding the T tree entries at lengths[b] + node (flattened
  order); lengths [B] int32: the prefix before the root; last_node [B] int32: the deepest accepted
  node. The accepted node at depth d moves from lengths + path[d] to lengths + d, d = 1..depth of
  last_node (the root stays where it is): a gather and a scatter of `tree.depth` entries per
  sequence, the ones past the accepted depth dropped. Afterwards positions
  lengths .. lengths + depth(last_node) hold what writing the accepted tokens' K/V contiguously
  would have (their positions were already lengths + depth), and the caller advances lengths by
  depth(last_node) + 1 as for a chain. Entries past that are left as they are.
  """
  if tree.depth == 0:
    return layer
  b, s = layer.shape[:2]
  rows = jnp.arange(b)[:, None]
  path = accepted_path(tree, last_node)[:, 1:]                          # [B, depth]
  d = jnp.arange(1, tree.depth + 1, dtype=jnp.int32)[None]
  src = lengths[:, None] + jnp.maximum(path, 0)
  dst = jnp.where(path >= 0, lengths[:, None] + d, s)                   # s: dropped
  return layer.at[rows, dst].set(layer[rows, src], mode="drop")


def compact_layers(layers: tuple[jax.Array, ...], lengths: jax.Array, tree: Tree,
                   last_node: jax.Array) -> tuple[jax.Array, ...]:
  """`compact_layer` over a tuple of layers (a KVCache's k or v)."""
  return tuple(compact_layer(x, lengths, tree, last_node) for x in layers)
