"""NSA attention (jaxspec.model.nsa): the reference against a naive per-query implementation,
SSV's schedules (exact merged groups, shared index, refresh/reuse), and a tiny random NSA model
that prefills, decodes and verifies like a full recompute."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxspec.drafting.trees import Tree, compact_layers
from jaxspec.engine.runner import Runner
from jaxspec.model import nsa
from jaxspec.model.attention import NSA, Dense, Prefill, Sparse, as_nsa
from jaxspec.model.config import ModelConfig, NSAConfig
from jaxspec.model.kv_cache import KVCache
from jaxspec.model.transformer import init_random

# Tiny NSA: compression blocks of 4 every 2 tokens, selection blocks of 8, 5 of them (initial, 2
# local, 2 by importance), a window of 8.
NSA_CFG = NSAConfig(compress_block=4, compress_stride=2, select_block=8, num_selected=5, window=8)
B, S, HQ, HKV, D = 2, 96, 4, 2, 16
TREE = Tree.from_widths((2, 2, 1))            # 11 nodes, 3 deep


# ----------------------------------------------------------------------------------------------
# The naive implementation: one query at a time, from the raw tokens of its own path, float64

def naive_row(q, keys, values, wk, wv, gates, cfg: NSAConfig):
  """q [Hq, D], the row's path keys/values [p + 1, Hkv, D] (positions 0 .. p, the row last),
  compression weights [Hkv, l, D, D], gates [Hq, 3] -> (out [Hq, D], the selected blocks of each
  KV head)."""
  hq, d = q.shape
  hkv = keys.shape[1]
  g = hq // hkv
  p = len(keys) - 1
  l, st, ls, n, w = (cfg.compress_block, cfg.compress_stride, cfg.select_block, cfg.num_selected,
                     cfg.window)

  def softmax_attend(qh, k, v):
    if len(k) == 0:
      return np.zeros(0), np.zeros(d)
    logits = k @ qh / np.sqrt(d)
    e = np.exp(logits - logits.max())
    probs = e / e.sum()
    return probs, probs @ v

  blocks = [c for c in range(p + 1) if c * st + l - 1 <= p]
  ck = np.array([keys[c * st:c * st + l].mean(0) + np.einsum("lhd,hlde->he",
                keys[c * st:c * st + l], wk) for c in blocks]).reshape(-1, hkv, d)
  cv = np.array([values[c * st:c * st + l].mean(0) + np.einsum("lhd,hlde->he",
                values[c * st:c * st + l], wv) for c in blocks]).reshape(-1, hkv, d)
  cur = p // ls
  out = np.zeros((hq, d))
  selected = []
  for h in range(hkv):
    importance = np.zeros(cur + 1)
    for head in range(h * g, (h + 1) * g):
      probs, cmp = softmax_attend(q[head], ck[:, h], cv[:, h])
      out[head] += gates[head, 0] * cmp
      for c, pr in zip(blocks, probs):            # every selection block the block overlaps
        for j in range(cur + 1):
          if c * st < (j + 1) * ls and c * st + l > j * ls:
            importance[j] += pr
    score = importance.copy()
    score[[j for j in (0, cur - 1, cur) if j >= 0]] = np.inf
    chosen = sorted(np.argsort(-score, kind="stable")[:n].tolist())
    selected.append(chosen)
    in_sel = np.isin(np.arange(p + 1) // ls, chosen)
    in_win = np.arange(p + 1) > p - w
    for head in range(h * g, (h + 1) * g):
      out[head] += gates[head, 1] * softmax_attend(q[head], keys[in_sel, h], values[in_sel, h])[1]
      out[head] += gates[head, 2] * softmax_attend(q[head], keys[in_win, h], values[in_win, h])[1]
  return out, selected


def naive(q, k_cache, v_cache, lengths, wk, wv, gates, cfg, tree: Tree | None = None):
  """Every row of every sequence alone: out [B, T, Hq, D] and its selected blocks as lists."""
  q, k_cache, v_cache, wk, wv, gates = (np.asarray(x, np.float64)
                                        for x in (q, k_cache, v_cache, wk, wv, gates))
  b, t = q.shape[:2]
  out = np.zeros(q.shape)
  selected = {}
  for bi in range(b):
    n0 = int(lengths[bi])
    for row in range(t):
      path = tree.path_table[row][tree.path_table[row] >= 0] if tree else np.arange(row + 1)
      slots = np.concatenate([np.arange(n0), n0 + path])
      out[bi, row], selected[bi, row] = naive_row(q[bi, row], k_cache[bi, slots],
                                                  v_cache[bi, slots], wk, wv, gates[bi, row], cfg)
  return out, selected


# ----------------------------------------------------------------------------------------------
# Random inputs for the reference

extend = jax.jit(nsa.extend_compressed, static_argnames=("count", "cfg"))
compressed_attention = jax.jit(nsa.compressed_attention, static_argnames=("tree",))


def make_inputs(seed, t, lengths, cfg=NSA_CFG, tree: Tree | None = None):
  """q, the raw cache, and NSAInputs whose compressed cache holds every block of the raw cache
  (slots as positions: right for the committed blocks and a chain's new ones; a tree's new blocks
  there mix branches, and the reference must not read them)."""
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.normal(size=(B, t, HQ, D)) * 2, jnp.float32)
  k_cache = jnp.asarray(rng.normal(size=(B, S, HKV, D)), jnp.float32)
  v_cache = jnp.asarray(rng.normal(size=(B, S, HKV, D)), jnp.float32)
  wk, wv = (jnp.asarray(rng.normal(size=(HKV, cfg.compress_block, D, D)) * 0.1, jnp.float32)
            for _ in range(2))
  gates = jnp.asarray(rng.uniform(size=(B, t, HQ, 3)), jnp.float32)
  c = nsa.num_compressed(S, cfg)
  ck, cv = extend(jnp.zeros((B, c, HKV, D)), jnp.zeros((B, c, HKV, D)), k_cache, v_cache, wk, wv,
                  jnp.zeros((B,), jnp.int32), S, cfg)
  inputs = nsa.NSAInputs(gates=gates, ck=ck, cv=cv, wk=wk, wv=wv, cfg=cfg)
  bits = None if tree is None else jnp.asarray(tree.ancestor_bits)
  return q, k_cache, v_cache, jnp.asarray(lengths, jnp.int32), inputs, bits


def selected_lists(indices):
  idx = np.asarray(indices)
  return {(b, t): [[int(j) for j in idx[b, t, h] if j >= 0] for h in range(idx.shape[2])]
          for b in range(idx.shape[0]) for t in range(idx.shape[1])}


@pytest.mark.parametrize("t, lengths, tree", [
    (1, (40, 77), None),          # decoding, a different length per sequence
    (8, (37, 62), None),          # a chain whose drafts complete blocks (and cross block 5)
    (TREE.size, (38, 21), TREE),  # a tree over a selection-block boundary
    (8, (0, 0), None),            # a prefill: nothing cached
], ids=["decode", "chain", "tree", "prefill"])
def test_reference_equals_naive(t, lengths, tree):
  q, k, v, lens, inputs, bits = make_inputs(0, t, lengths, tree=tree)
  out, indices = nsa.nsa_attention(q, k, v, lens, inputs, tree_bits=bits)
  want, want_sel = naive(q, k, v, lens, inputs.wk, inputs.wv, inputs.gates, NSA_CFG, tree)
  assert selected_lists(indices) == want_sel
  np.testing.assert_allclose(np.asarray(out), want, rtol=2e-5, atol=2e-5)
  # Some rows chose among more blocks than the forced ones.
  if max(lengths) > 40:
    assert any(len(s) == NSA_CFG.num_selected for rows in want_sel.values() for s in rows)


def test_a_block_completed_by_a_draft_is_visible_from_its_last_token_on():
  """Chain rows at lengths = 45 .. 52: compression block 22 (tokens 44 .. 47) is completed by
  row 2's token. Garbage written into that compressed entry changes rows 2.. and no row before."""
  cfg = NSA_CFG
  q, k, v, lens, inputs, _ = make_inputs(2, 8, (45, 45))
  block = 22
  assert block * cfg.compress_stride + cfg.compress_block - 1 == 45 + 2
  lay = nsa.layout(lens, 8)
  clean, _ = compressed_attention(q, k, v, inputs, lens, lay, tree=False)
  spoiled = inputs.replace(ck=inputs.ck.at[:, block].set(50.0), cv=inputs.cv.at[:, block].set(50.0))
  dirty, _ = compressed_attention(q, k, v, spoiled, lens, lay, tree=False)
  same = np.all(np.asarray(clean) == np.asarray(dirty), axis=(0, 2, 3))
  np.testing.assert_array_equal(same, [True, True] + [False] * 6)


def test_extend_compressed_writes_only_completed_blocks():
  cfg = NSA_CFG
  q, k, v, _, inputs, _ = make_inputs(3, 1, (0, 0))
  c = nsa.num_compressed(S, cfg)
  zeros = jnp.zeros((B, c, HKV, D))
  start = jnp.asarray([10, 31], jnp.int32)
  ck, _ = extend(zeros, zeros, k, v, inputs.wk, inputs.wv, start, 5, cfg)
  for b, s0 in enumerate((10, 31)):
    written = [i for i in range(c) if np.any(np.asarray(ck[b, i]) != 0)]
    want = [i for i in range(c) if s0 <= i * 2 + 3 < s0 + 5]   # last token among the 5 new
    assert written == want
    # The same blocks as compressing the whole cache at once, to float32 rounding: XLA:CPU may
    # order a product's sums differently for another number of tokens (seen on an AMD EPYC).
    np.testing.assert_allclose(np.asarray(ck[b, want]), np.asarray(inputs.ck[b, want]),
                               rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# SSV's schedules

def test_merged_schedule_is_each_row_alone_bit_for_bit():
  """Groups of 3 chain rows (the last group 2); the tree's case runs through the model below."""
  q, k, v, lens, inputs, _ = make_inputs(4, 8, (70, 43))
  alone, idx = nsa.nsa_attention(q, k, v, lens, inputs)
  merged, idx_m = nsa.nsa_attention(q, k, v, lens, inputs, group=3)
  np.testing.assert_array_equal(np.asarray(idx_m), np.asarray(idx))
  np.testing.assert_array_equal(np.asarray(merged), np.asarray(alone))
  # The groups did merge different selections.
  sel = np.asarray(idx)
  assert any(not np.array_equal(sel[:, r], sel[:, r + 1]) for r in range(2))


def test_shared_index_equals_per_row_when_the_selections_agree():
  """Rows at 24 .. 31 all hold block 3 and see only blocks 0 .. 3 (4 <= n): one selection."""
  q, k, v, lens, inputs, _ = make_inputs(5, 8, (24, 24))
  own, idx = nsa.nsa_attention(q, k, v, lens, inputs)
  shared, idx_s = nsa.nsa_attention(q, k, v, lens, inputs, group=3, shared=True)
  assert (np.asarray(idx) == np.asarray(idx[:, :1])).all()
  np.testing.assert_array_equal(np.asarray(idx_s), np.asarray(idx))
  np.testing.assert_array_equal(np.asarray(shared), np.asarray(own))


def test_shared_index_takes_the_last_row_and_keeps_the_window_exact():
  q, k, v, lens, inputs, _ = make_inputs(6, 8, (70, 51))
  group = 3                                     # groups 0-2, 3-5, 6-7
  own, idx = nsa.nsa_attention(q, k, v, lens, inputs)
  shared, idx_s = nsa.nsa_attention(q, k, v, lens, inputs, group=group, shared=True)
  idx, idx_s = np.asarray(idx), np.asarray(idx_s)
  np.testing.assert_array_equal(idx_s, idx[:, [2, 2, 2, 5, 5, 5, 7, 7]])
  assert not np.array_equal(idx_s, idx)
  # Rows whose own selection was the group's are unchanged; the others differ.
  own, shared = np.asarray(own), np.asarray(shared)
  for b in range(B):
    for t in range(8):
      if np.array_equal(idx[b, t], idx_s[b, t]):
        np.testing.assert_array_equal(shared[b, t], own[b, t])
      else:
        assert not np.allclose(shared[b, t], own[b, t])
  # Only the selected branch changed: with its gate shut, shared == per row.
  no_sel = inputs.replace(gates=inputs.gates.at[..., 1].set(0.0))
  a, _ = nsa.nsa_attention(q, k, v, lens, no_sel)
  b_, _ = nsa.nsa_attention(q, k, v, lens, no_sel, group=group, shared=True)
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b_))


def test_reuse_layers_take_the_nearest_refresh_layers_blocks():
  layers = [make_inputs(10 + i, 8, (60 + 7 * i, 33 + 5 * i)) for i in range(4)]
  refresh = (True, False, True, False)

  def layer(i, indices):
    q, k, v, lens, inputs, _ = layers[i]
    return nsa.nsa_attention(q, k, v, lens, inputs.replace(indices=indices))

  outs, used = nsa.run_schedule(refresh, layer)
  for i, src in enumerate((0, 0, 2, 2)):
    q, k, v, lens, inputs, _ = layers[i]
    own, own_idx = nsa.nsa_attention(q, k, v, lens, inputs)
    if i == src:
      np.testing.assert_array_equal(np.asarray(used[i]), np.asarray(own_idx))
      np.testing.assert_array_equal(np.asarray(outs[i]), np.asarray(own))
    else:
      np.testing.assert_array_equal(np.asarray(used[i]), np.asarray(used[src]))
      copied, _ = nsa.nsa_attention(q, k, v, lens, inputs.replace(indices=used[src]))
      np.testing.assert_array_equal(np.asarray(outs[i]), np.asarray(copied))
      assert not np.array_equal(np.asarray(used[i]), np.asarray(own_idx))


@pytest.mark.parametrize("refresh, match", [
    ((False, True), "layer 0 must be a refresh layer"),
    ((True,), "one bool per layer"),
    ((True, 1), "one bool per layer"),
])
def test_bad_refresh_schedule(refresh, match):
  with pytest.raises(ValueError, match=match):
    nsa.check_refresh(refresh, 2)


# ----------------------------------------------------------------------------------------------
# Config

@pytest.mark.parametrize("kwargs, match", [
    (dict(compress_block=0), "compress_block must be a positive integer"),
    (dict(window=2.5), "window must be a positive integer"),
    (dict(compress_block=4, compress_stride=8), "would skip tokens"),
    (dict(num_selected=2), "at least 3"),
])
def test_bad_nsa_config(kwargs, match):
  with pytest.raises(ValueError, match=match):
    NSAConfig(**kwargs)


def test_nsa_config_defaults_and_round_trip():
  assert dataclasses.astuple(NSAConfig()) == (32, 16, 64, 16, 512)
  cfg = ModelConfig.from_dict(CFG.to_dict())
  assert cfg == CFG and cfg.nsa == NSA_CFG
  with pytest.raises(ValueError, match="NSAConfig"):
    dataclasses.replace(CFG, nsa={"window": 8})


# ----------------------------------------------------------------------------------------------
# The model

CFG = ModelConfig(arch="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=HQ, num_kv_heads=HKV, head_dim=D, rope_theta=1000.0,
                  tie_word_embeddings=True, nsa=NSA_CFG)


@pytest.fixture(scope="module")
def model():
  return init_random(CFG, dtype=jnp.float32, seed=0)


FULL = 64      # every prefill and full recompute: 2 sequences right-padded to 64 tokens


# XLA's default CPU fusion emitters (the suite runs with its older ones, conftest.py): the merged
# groups' bit-for-bit equality (test_schedules_in_the_model) holds under them, as a user compiles;
# the older emitters round some of the logits' last bits differently for the two shapes.
@functools.partial(jax.jit, static_argnums=0,
                   compiler_options={"xla_cpu_use_fusion_emitters": True})
def _forward(graphdef, state, tokens, positions, cache, plan):
  model = nnx.merge(graphdef, state)
  hidden, cache, _ = model(tokens, positions, cache, plan)
  return model.logits(hidden), cache


def forward(model, tokens, positions, cache, plan):
  return _forward(*nnx.split(model), jnp.asarray(tokens, jnp.int32), positions, cache, plan)


@functools.partial(jax.jit, static_argnums=0)
def _blocks(graphdef, state, tokens, positions, cache, plan):
  return nnx.merge(graphdef, state)(tokens, positions, cache, plan)[2]


@functools.partial(jax.jit, static_argnums=(0, 4))
def _recompress(graphdef, state, cache, start, count):
  return nnx.merge(graphdef, state).recompress(cache, start, count)


def padded(sequences):
  return [list(x) + [0] * (FULL - len(x)) for x in sequences]


def prefill(model, prompts, plan=Prefill()):
  """(logits [2, FULL, vocab], the cache with lengths at the prompts' lengths)."""
  cache = KVCache.create(CFG, len(prompts), S, jnp.float32)
  logits, cache = forward(model, padded(prompts), cache.chain_positions(FULL), cache, plan)
  return logits, cache.replace(lengths=jnp.asarray([len(p) for p in prompts], jnp.int32))


def full_logits(model, sequences):
  """Each sequence's logits from one forward pass over all of it, an empty cache."""
  logits, _ = prefill(model, sequences)
  return [np.asarray(logits[i, :len(x)]) for i, x in enumerate(sequences)]


def test_init_random_builds_the_nsa_parameters(model):
  attn = model.layers[0].self_attn
  assert attn.compress_k.shape == (HKV, NSA_CFG.compress_block, D, D)
  assert attn.g_proj.kernel.shape == (CFG.hidden_size, HQ * 3)
  cache = KVCache.create(CFG, 2, S, jnp.float32)
  assert len(cache.ck) == CFG.num_layers and cache.ck[0].shape == (2, 47, HKV, D)
  assert KVCache.create(dataclasses.replace(CFG, nsa=None), 2, S).ck == ()


def test_greedy_decoding_equals_a_full_recompute(model):
  """Prompts of 25 and 44 tokens, 14 greedy tokens each one step at a time; each token is the
  argmax of, and each step's logits equal, one forward pass over the whole sequence."""
  rng = np.random.default_rng(7)
  prompts = [rng.integers(0, CFG.vocab_size, n).tolist() for n in (25, 44)]
  logits, cache = prefill(model, prompts)
  steps = [np.asarray(logits[[0, 1], [24, 43]])]
  for _ in range(13):
    token = steps[-1].argmax(-1)[:, None]
    logits, cache = forward(model, token, cache.lengths[:, None], cache, Dense())
    cache = cache.replace(lengths=cache.lengths + 1)
    steps.append(np.asarray(logits[:, 0]))
  steps = np.stack(steps, axis=1)                                  # [2, 14, vocab]
  new = steps.argmax(-1)
  for i, (prompt, full) in enumerate(zip(prompts, full_logits(model, [
      p + new[i].tolist() for i, p in enumerate(prompts)]))):
    np.testing.assert_array_equal(full[len(prompt) - 1:-1].argmax(-1), new[i])
    np.testing.assert_allclose(steps[i], full[len(prompt) - 1:-1], atol=2e-5)


def test_tree_verification_rows_equal_a_full_recompute(model):
  """A tree of 11 rows after prompts of 41 and 30 tokens: each row's logits are the full
  recompute's at the end of its path; after the accepted paths are compacted and their
  compression blocks rewritten, the next token's logits are too."""
  rng = np.random.default_rng(8)
  prompts = [rng.integers(0, CFG.vocab_size, n).tolist() for n in (41, 30)]
  _, cache = prefill(model, prompts)
  nodes = rng.integers(0, CFG.vocab_size, (2, TREE.size))
  positions = cache.lengths[:, None] + jnp.asarray(TREE.depths)[None]
  logits, tree_cache = forward(model, nodes, positions, cache,
                               Dense(tree_bits=jnp.asarray(TREE.ancestor_bits)))
  paths = [TREE.path_table[leaf] for leaf in TREE.leaves]           # every leaf is 3 deep
  for path in paths:
    fulls = full_logits(model, [p + nodes[i, path].tolist() for i, p in enumerate(prompts)])
    for i, full in enumerate(fulls):
      np.testing.assert_allclose(logits[i, path], full[len(prompts[i]):], atol=2e-5)
  last = jnp.asarray([TREE.leaves[-1], TREE.leaves[1]], jnp.int32)
  tree_cache = tree_cache.replace(k=compact_layers(tree_cache.k, cache.lengths, TREE, last),
                                  v=compact_layers(tree_cache.v, cache.lengths, TREE, last))
  tree_cache = _recompress(*nnx.split(model), tree_cache, cache.lengths, TREE.depth + 1)
  tree_cache = tree_cache.replace(lengths=cache.lengths + TREE.depth + 1)
  logits, _ = forward(model, [[5], [6]], tree_cache.lengths[:, None], tree_cache, Dense())
  sequences = [p + nodes[i, TREE.path_table[int(last[i])]].tolist() + [5 + i]
               for i, p in enumerate(prompts)]
  for i, full in enumerate(full_logits(model, sequences)):
    np.testing.assert_allclose(logits[i, 0], full[-1], atol=2e-5)


def test_schedules_in_the_model(model):
  """Tree verification after prompts of 57 and 35 tokens: merged groups of 4 rows leave the
  model's logits bit for bit as they are; reusing layer 0's selection in layer 1 changes them."""
  rng = np.random.default_rng(9)
  prompts = [rng.integers(0, CFG.vocab_size, n).tolist() for n in (57, 35)]
  _, cache = prefill(model, prompts)
  nodes = rng.integers(0, CFG.vocab_size, (2, TREE.size))
  positions = cache.lengths[:, None] + jnp.asarray(TREE.depths)[None]
  bits = jnp.asarray(TREE.ancestor_bits)
  strict, _ = forward(model, nodes, positions, cache, Dense(tree_bits=bits))
  merged, _ = forward(model, nodes, positions, cache, NSA(tree_bits=bits, group=4))
  reuse, _ = forward(model, nodes, positions, cache, NSA(tree_bits=bits, refresh=(True, False)))
  np.testing.assert_array_equal(np.asarray(merged), np.asarray(strict))
  assert not np.allclose(np.asarray(reuse), np.asarray(strict))
  used = _blocks(*nnx.split(model), jnp.asarray(nodes, jnp.int32), positions, cache,
                 NSA(tree_bits=bits, refresh=(True, False), collect=True))
  n = NSA_CFG.num_selected
  assert used.shape == (CFG.num_layers, 2, TREE.size, HKV, n) and used.dtype == jnp.int32
  np.testing.assert_array_equal(used[1], used[0])
  own = _blocks(*nnx.split(model), jnp.asarray(nodes, jnp.int32), positions, cache,
                NSA(tree_bits=bits, collect=True))
  np.testing.assert_array_equal(own[0], used[0])
  assert (np.asarray(own[1]) != np.asarray(own[0])).any()   # layer 1 selects otherwise on its own


def test_a_refresh_mask_runs_every_schedule_in_one_program():
  """NSA(refresh_mask=...), the schedule as data (the calibration's form), gives each static
  schedule's logits and selected blocks on a 3-layer model, a reuse layer after a reuse layer
  included, and the four schedules share one compiled program."""
  model = init_random(dataclasses.replace(CFG, num_layers=3), dtype=jnp.float32, seed=0)
  rng = np.random.default_rng(9)
  prompts = [rng.integers(0, CFG.vocab_size, n).tolist() for n in (57, 35)]
  cache = KVCache.create(model.cfg, 2, S, jnp.float32)
  _, cache = _forward(*nnx.split(model), jnp.asarray(padded(prompts), jnp.int32),
                      cache.chain_positions(FULL), cache, Prefill())
  cache = cache.replace(lengths=jnp.asarray([len(p) for p in prompts], jnp.int32))
  nodes = rng.integers(0, CFG.vocab_size, (2, 5))
  positions = cache.chain_positions(5)
  compiled = _forward._cache_size()
  outputs = []
  for refresh in [(True, True, True), (True, False, True), (True, True, False),
                  (True, False, False)]:
    static, _ = forward(model, nodes, positions, cache, NSA(refresh=refresh))
    outputs.append(np.asarray(static))
    masked, _ = forward(model, nodes, positions, cache, NSA(refresh_mask=jnp.asarray(refresh)))
    np.testing.assert_allclose(np.asarray(masked), np.asarray(static), rtol=0, atol=1e-6)
    args = (*nnx.split(model), jnp.asarray(nodes, jnp.int32), positions, cache)
    np.testing.assert_array_equal(
        _blocks(*args, NSA(refresh_mask=jnp.asarray(refresh), collect=True)),
        _blocks(*args, NSA(refresh=refresh, collect=True)))
  assert not np.allclose(outputs[0], outputs[-1])   # the schedules differ: a mask is not ignored
  # One program for the four masks, one per static schedule.
  assert _forward._cache_size() - compiled == 1 + 4
  for plan in (NSA(refresh_mask=jnp.ones(2, bool)),
               NSA(refresh_mask=jnp.ones(3, bool), refresh=(True, True, True))):
    with pytest.raises(ValueError, match="refresh_mask is one bool per layer"):
      forward(model, nodes, positions, cache, plan)


def test_plans_an_nsa_model_refuses(model):
  assert as_nsa(Dense(tree_bits=jnp.asarray(TREE.ancestor_bits))).tree_bits is not None
  sparse = Sparse(indices=jnp.zeros((1, 1, 1), jnp.int32), counts=jnp.zeros((1, 1), jnp.int32),
                  tail_start=jnp.zeros((1,), jnp.int32))
  with pytest.raises(ValueError, match="an NSA model runs NSA, Prefill"):
    as_nsa(sparse)
  with pytest.raises(ValueError, match="NSA models run method 'none', 'draft' or 'ssv'"):
    Runner(model, method="vegas")
  with pytest.raises(ValueError, match="an NSA draft model drafts chains only"):
    Runner(model, method="draft", draft_model=model, tree=(2, 1))
