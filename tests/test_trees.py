"""Draft trees: shape and flattening, masks, compaction, and lossless tree acceptance."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.engine import rejection, tree_acceptance as ta
from jaxspec.model import kv_cache
from jaxspec.engine.sampling import SamplingParams, probabilities
from jaxspec.drafting.trees import Tree, compact_layer, mask_from_bits

from chi2 import chi2_pvalue

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


# ----------------------------------------------------------------------------------------------
# Greedy acceptance

greedy = jax.jit(ta.verify_tree_greedy, static_argnames="tree")
emitted = jax.jit(ta.emitted_tokens, static_argnames="tree")


def _one_hot_logits(argmax_rows, v=10):
  return jax.nn.one_hot(jnp.asarray(argmax_rows), v) * 4.0 - 2.0


def test_greedy_by_hand():
  tree = Tree.from_widths((2, 1))             # BFS: 0 -> 1, 2; 1 -> 3; 2 -> 4
  # target argmax per row (row i: the token after node i) and the tree's tokens (node 0 ignored)
  target = [[3, 1, 6, 2, 4],    # node 2 (3) matches row 0, node 4 (6) matches row 2: bonus row 4
            [3, 1, 6, 2, 4],    # nothing matches row 0: correction 3
            [3, 5, 6, 2, 4],    # node 1 matches, its child 9 != 5: correction 5
            [3, 5, 5, 2, 4],    # both siblings are 3 and both children match: the first path
            [3, 5, 6, 2, 4]]    # node 1 matches, then node 3 (5): bonus row 3
  tokens = jnp.asarray([[8, 7, 3, 5, 6],
                        [8, 1, 2, 0, 0],
                        [8, 3, 4, 9, 9],
                        [8, 3, 3, 5, 5],
                        [8, 3, 4, 5, 0]], jnp.int32)
  v = greedy(tree, tokens, _one_hot_logits(target))
  np.testing.assert_array_equal(v.last_node, [4, 0, 1, 3, 3])
  np.testing.assert_array_equal(v.accepted, [2, 0, 1, 2, 2])
  np.testing.assert_array_equal(v.next_token, [4, 3, 5, 2, 2])
  np.testing.assert_array_equal(emitted(tree, tokens, v),
                                [[3, 6, 4], [3, -1, -1], [3, 5, -1], [3, 5, 2], [3, 5, 2]])
  # The same trees in DFS order give the same output.
  dfs = tree.flatten("dfs")
  perm = tree.permutation("dfs")
  w = greedy(dfs, tokens[:, perm], _one_hot_logits(np.asarray(target)[:, perm]))
  np.testing.assert_array_equal(perm[np.asarray(w.last_node)], v.last_node)
  np.testing.assert_array_equal(emitted(dfs, tokens[:, perm], w),
                                emitted(tree, tokens, v))


def test_greedy_takes_the_longest_matching_path():
  """Both depth-1 siblings carry the argmax; the first one's children miss, the second one's
  second child and its leaf match: the longer path wins over sibling order."""
  tree = Tree.from_widths((2, 2, 1))          # BFS: 1, 2 | 3, 4 (of 1), 5, 6 (of 2) | 7, 8, 9, 10
  tokens = np.full((1, tree.size), 9)
  target = np.zeros((1, tree.size), int)
  target[0, 0] = tokens[0, 1] = tokens[0, 2] = 1
  target[0, 1] = 7                            # nodes 3, 4 carry 9
  target[0, 2] = tokens[0, 6] = 4             # node 5 carries 9
  target[0, 6] = tokens[0, 10] = 5
  target[0, 10] = 8
  v = greedy(tree, jnp.asarray(tokens), _one_hot_logits(target))
  assert (int(v.last_node[0]), int(v.accepted[0]), int(v.next_token[0])) == (10, 3, 8)


def test_greedy_chain_equals_rejection():
  rng = np.random.default_rng(1)
  target = jnp.asarray(rng.normal(size=(64, 4, 5)), jnp.float32)
  drafts = jnp.asarray(np.where(rng.random((64, 3)) < 0.7, np.asarray(target[:, :3].argmax(-1)),
                                rng.integers(0, 5, (64, 3))), jnp.int32)
  tokens = jnp.concatenate([jnp.zeros((64, 1), jnp.int32), drafts], axis=1)
  chain = rejection.verify_greedy(drafts, target)
  tree = greedy(Tree.chain(3), tokens, target)
  np.testing.assert_array_equal(tree.accepted, chain.accepted)
  np.testing.assert_array_equal(tree.last_node, chain.accepted)
  np.testing.assert_array_equal(tree.next_token, chain.next_token)


# ----------------------------------------------------------------------------------------------
# Sampled acceptance
#
# A tiny Markov "model": the target's next-token distribution is P[token], the drafter's Q[token],
# so node i's target row is P[tokens[i]] and its draft row Q[tokens[i]]. The first emitted token
# must follow P[root] and, in rounds that accept a first draft t1, the second must follow P[t1].

V, ROUNDS, ROOT = 5, 100_000, 0


def markov(seed):
  rng = np.random.default_rng(seed)
  p = rng.dirichlet(np.ones(V) * 0.7, size=V)
  q = rng.dirichlet(np.ones(V) * 0.7, size=V)
  p[ROOT, 4] = 0.0                 # a token the target never emits but the drafter may propose
  p[ROOT] /= p[ROOT].sum()
  return p.astype(np.float32), q.astype(np.float32)


def draft(rng, tree, q, siblings, rounds=ROUNDS):
  """tokens [rounds, T]: each node's children drawn from Q[its token] as `siblings` says."""
  tokens = np.zeros((rounds, tree.size), np.int64)
  tokens[:, 0] = ROOT
  for node, kids in enumerate(tree.children):
    if not kids:
      continue
    dist = q[tokens[:, node]].astype(np.float64)                 # [rounds, V]
    w = len(kids)
    if siblings == "iid":
      u = rng.random((rounds, w, 1))
      tokens[:, kids] = np.minimum((np.cumsum(dist, -1)[:, None] < u).sum(-1), V - 1)
    elif siblings == "without_replacement":                       # Gumbel top-w, in order
      g = np.log(dist) + rng.gumbel(size=dist.shape)
      tokens[:, kids] = np.argsort(-g, axis=-1)[:, :w]
    else:                                                         # the top-w tokens of q
      tokens[:, kids] = np.argsort(-dist, axis=-1, kind="stable")[:, :w]
  return tokens


def run_tree(tree, p, q, siblings, seed=0):
  rng = np.random.default_rng(seed)
  tokens = draft(rng, tree, q, siblings)
  # A fresh function object per call: jit caches traces per function, and the broken-rule test
  # below must trace the monkeypatched residual.
  fn = jax.jit(lambda *a: ta.verify_tree_sampled(*a, siblings=siblings), static_argnums=1)
  v = fn(jax.random.PRNGKey(seed), tree, jnp.asarray(tokens, jnp.int32),
         jnp.asarray(q[tokens]), jnp.asarray(p[tokens]))
  return np.asarray(emitted(tree, jnp.asarray(tokens, jnp.int32), v)), np.asarray(v.accepted)


@pytest.mark.parametrize("siblings", ta.SIBLINGS)
def test_tree_sampling_follows_the_target(siblings):
  p, q = markov(0)
  tree = Tree.from_widths((2, 2))
  out, accepted = run_tree(tree, p, q, siblings)
  assert chi2_pvalue(np.bincount(out[:, 0], minlength=V), p[ROOT]) > 1e-3
  second = accepted >= 1
  # How often a first draft is accepted: with one-hot q_k, p(x_1) + p(x_2); with i.i.d. siblings
  # a1 + (1 - a1) a2, a_k = sum min(r_k, q); without replacement more than one draft's a1.
  a1 = np.minimum(p[ROOT], q[ROOT]).sum()
  if siblings == "deterministic":
    want = p[ROOT][np.argsort(-q[ROOT], kind="stable")[:2]].sum()
  else:
    r2 = np.maximum(p[ROOT] - q[ROOT], 0) / (1 - a1)
    want = a1 + (1 - a1) * np.minimum(r2, q[ROOT]).sum()
  if siblings == "without_replacement":
    assert second.mean() > a1 + 0.05
  else:
    assert abs(second.mean() - want) < 0.01, (second.mean(), want)
  for t1 in range(V):
    rows = second & (out[:, 0] == t1)
    if rows.sum() > 2_000:
      assert chi2_pvalue(np.bincount(out[rows, 1], minlength=V), p[t1]) > 1e-4, t1


@pytest.mark.parametrize("siblings", ["iid", "deterministic"])
def test_siblings_tried_against_the_unchanged_target_are_detected(siblings, monkeypatch):
  """The broken rule never updates the residual: every sibling is tried against the target p
  itself, and the correction after all siblings are rejected is drawn from p."""
  p, q = markov(0)
  monkeypatch.setattr(ta, "_sibling_residual", lambda r, qk: r)
  out, _ = run_tree(Tree.from_widths((2, 2)), p, q, siblings)
  assert chi2_pvalue(np.bincount(out[:, 0], minlength=V), p[ROOT]) < 1e-6


@pytest.mark.parametrize("sp", [SamplingParams(temperature=0.8, top_k=4), SamplingParams()])
def test_width_one_tree_is_the_chain_key_for_key(sp):
  """Tree.chain(gamma) gives rejection.verify_drafts' verdict for the same key, in every siblings
  mode: same accepted count, same next token. 'deterministic' is checked against the chain given
  one-hot draft distributions (what a deterministic draft is drawn from)."""
  b, gamma, vocab = 256, 3, 11
  rng = np.random.default_rng(5)
  target = jnp.asarray(rng.normal(size=(b, gamma + 1, vocab)), jnp.float32)
  q_logits = target[:, :gamma] + jnp.asarray(rng.normal(size=(b, gamma, vocab)), jnp.float32)
  chain_tree = Tree.chain(gamma)

  @jax.jit
  def verdicts(key, target, q_logits):
    """Draft, then verify as a chain and as a tree: one compilation (arguments, not closed-over
    constants, which XLA would spend seconds folding)."""
    k_draft, key = jax.random.split(key)
    q = probabilities(q_logits, sp)
    drafts = jax.random.categorical(k_draft, jnp.log(q), axis=-1).astype(jnp.int32)
    one_hot = jax.nn.one_hot(drafts, vocab)
    tokens = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), drafts], axis=1)
    leaf_row = jnp.zeros((b, 1, vocab))                                # unused
    out = {}
    for siblings in ta.SIBLINGS:
      q_chain = one_hot if siblings == "deterministic" else q
      out[siblings] = (rejection.verify_drafts(key, drafts, q_chain, target, sp),
                       ta.verify_tree(key, chain_tree, tokens,
                                      jnp.concatenate([q_chain, leaf_row], axis=1), target, sp,
                                      siblings))
    return out

  for siblings, (chain, tree) in verdicts(jax.random.PRNGKey(7), target, q_logits).items():
    np.testing.assert_array_equal(tree.accepted, chain.accepted, err_msg=siblings)
    np.testing.assert_array_equal(tree.last_node, chain.accepted, err_msg=siblings)
    np.testing.assert_array_equal(tree.next_token, chain.next_token, err_msg=siblings)
    assert 0 < int(chain.accepted.sum()) < b * gamma


def test_greedy_is_the_sampled_rule_on_one_hot_probabilities():
  """With one-hot targets and distinct top-w drafts the sampled rule takes the greedy path."""
  tree = Tree.from_widths((3, 2), order="dfs")
  b, vocab = 128, 6
  rng = np.random.default_rng(8)
  # drafts: at each node its children are the top-w tokens of a noisy copy of the target row
  target = rng.normal(size=(b, tree.size, vocab)).astype(np.float32)
  noisy = target + 0.7 * rng.normal(size=target.shape)
  tokens = np.zeros((b, tree.size), np.int64)
  for node, kids in enumerate(tree.children):
    if kids:
      tokens[:, kids] = np.argsort(-noisy[:, node], axis=-1)[:, :len(kids)]
  tokens = jnp.asarray(tokens, jnp.int32)
  fast = greedy(tree, tokens, jnp.asarray(target))
  general = jax.jit(ta.verify_tree_sampled, static_argnames=("tree", "siblings"))(
      jax.random.PRNGKey(0), tree, tokens, None, probabilities(target, SamplingParams()),
      siblings="deterministic")
  np.testing.assert_array_equal(fast.last_node, general.last_node)
  np.testing.assert_array_equal(fast.next_token, general.next_token)
  assert len(set(np.asarray(fast.accepted).tolist())) >= 3


def test_root_alone_is_plain_decoding():
  tree, tokens = Tree.from_widths(()), jnp.zeros((3, 1), jnp.int32)
  p = jax.nn.one_hot(jnp.asarray([[2], [0], [3]]), 4)
  for v in (greedy(tree, tokens, p),
            ta.verify_tree_sampled(jax.random.PRNGKey(0), tree, tokens, p, p)):
    np.testing.assert_array_equal(v.accepted, [0, 0, 0])
    np.testing.assert_array_equal(emitted(tree, tokens, v), [[2], [0], [3]])


def test_bad_arguments():
  tree = Tree.from_widths((2,))
  tokens, p = jnp.zeros((2, 3), jnp.int32), jnp.ones((2, 3, 4)) / 4
  with pytest.raises(ValueError, match="siblings"):
    ta.verify_tree_sampled(jax.random.PRNGKey(0), tree, tokens, p, p, siblings="topk")
  with pytest.raises(ValueError, match="draft_probs"):
    ta.verify_tree_sampled(jax.random.PRNGKey(0), tree, tokens, None, p)
  with pytest.raises(ValueError, match="tokens"):
    ta.verify_tree_greedy(tree, jnp.zeros((2, 4), jnp.int32), p)


# ----------------------------------------------------------------------------------------------
# Verification attention with the tree's ancestor bits (the pure-JAX reference; the kernels:
# test_tree_attention.py)

@pytest.mark.parametrize("order", ["bfs", "dfs"])
def test_tree_verification_equals_verifying_each_path(order):
  """One pass over the flattened tree with its ancestor bits gives, on each root-to-leaf path's
  rows, what verifying that path alone as a chain (its K/V contiguous after the prefix) gives."""
  from pallas_kernels.verify_attention import verify_attention_reference as ref
  tree = Tree.from_widths((2, 2, 1), order=order)
  t, b, s, hq, hkv, d = tree.size, 2, 40, 4, 2, 16
  rng = np.random.default_rng(11)
  lengths = jnp.asarray([5, 21], jnp.int32)
  normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  q, node_k, node_v = normal(b, t, hq, d), normal(b, t, hkv, d), normal(b, t, hkv, d)
  prefix_k, prefix_v = normal(b, s, hkv, d), normal(b, s, hkv, d)
  at = lengths[:, None] + jnp.arange(t)
  k, v = kv_cache.write(prefix_k, node_k, at), kv_cache.write(prefix_v, node_v, at)
  out, scores = ref(q, k, v, lengths, tree_bits=jnp.asarray(tree.ancestor_bits),
                    score_kind="weights", per_row=True)
  for path in tree.paths():
    path = list(path)
    at = lengths[:, None] + jnp.arange(len(path))
    pk = kv_cache.write(prefix_k, node_k[:, path], at)
    pv = kv_cache.write(prefix_v, node_v[:, path], at)
    want, want_scores = ref(q[:, path], pk, pv, lengths, score_kind="weights", per_row=True)
    np.testing.assert_allclose(out[:, path], want, atol=2e-6, rtol=1e-5)
    for i in range(b):      # the prefix keys' weights agree too
      n = int(lengths[i])
      np.testing.assert_allclose(np.asarray(scores[i, path, :n], np.float32),
                                 np.asarray(want_scores[i, :, :n], np.float32), rtol=1e-2)
  # the chain's bits are the causal rule
  chain = jnp.asarray(Tree.chain(t - 1).ancestor_bits)
  np.testing.assert_array_equal(ref(q, k, v, lengths, tree_bits=chain)[0], ref(q, k, v, lengths)[0])
  with pytest.raises(ValueError, match="tree_bits"):
    ref(q, k, v, lengths, tree_bits=chain[:-1])


def test_bfs_index_maps_each_node_to_its_breadth_first_place():
  tree = Tree.from_widths((2, 2, 1), "dfs")
  bfs, at = tree.flatten("bfs"), tree.bfs_index
  assert sorted(at.tolist()) == list(range(tree.size)) and at[0] == 0
  for i in range(1, tree.size):
    assert bfs.parents[at[i]] == at[tree.parents[i]]
    assert bfs.depths[at[i]] == tree.depths[i]
  assert (Tree.from_widths((2, 2, 1)).bfs_index == np.arange(tree.size)).all()
