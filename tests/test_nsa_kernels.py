"""SSV's NSA kernels (pallas_kernels/nsa_attention.py: interpret mode on a CPU, compiled on a GPU)
against the pure-JAX references of jaxspec.model.nsa: the compressed branch and block
importance, the fused selected and window branches under the exact merged and the shared-index
schedules, chain and tree rows (BFS and DFS), blocks completed by drafts mid-verification, and a
tiny NSA model run through the kernels.

The kernels read a cache whose slots past the new rows hold NaN, so reading one shows up as NaN
in the output (the references get the clean cache). Shapes and configurations are shared between
the tests so that the interpret-mode kernels compile few times."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxspec.drafting.trees import Tree
from jaxspec.model import nsa
from jaxspec.model.attention import Prefill
from jaxspec.model.config import NSAConfig
from jaxspec.model.kv_cache import KVCache
from jaxspec.model.transformer import init_random
from pallas_kernels import nsa_attention as nk
from test_nsa import CFG, D, NSA_CFG, S, extend, padded

T_CHAIN = 8
# 8 query heads per KV head: a row alone and a shared group of 2 fill a 16-row query tile, a
# merged group of 4 a 32-row one (the bit-for-bit check covers a change of tile).
HQ, HKV = 16, 2
LAYOUTS = {
    # name: (rows, lengths, tree). The chain's drafts complete compression blocks and cross from
    # selection block 7 into 8 (sequence 0) and 4 into 5 (sequence 1); the trees straddle blocks.
    "chain": (T_CHAIN, (59, 37), None),
    "tree-bfs": (11, (57, 38), Tree.from_widths((2, 2, 1), "bfs")),
    "tree-dfs": (11, (46, 29), Tree.from_widths((2, 2, 1), "dfs")),
}
# (group, shared): each row alone, merged groups of 4, shared groups of 2. Each compiles the
# kernels once per layout kind (chain, tree) and compiling is most of the time these tests take,
# so trees run the merged schedule only: the shared schedule differs from it in what XLA gives
# the kernel (one list per group, no ownership test), not in how it treats a tree.
MERGED, SHARED = 4, 2
SCHEDULES = {False: ((1, False), (MERGED, False), (SHARED, True)),
             True: ((1, False), (MERGED, False))}

# On a GPU (pytest tests/test_nsa_kernels.py there) the kernels compile for it instead, and
# float32 products run in full float32 on both sides (by default XLA and Triton use TF32 there,
# ~1e-3 apart). A merged group's larger query tile changes the order of the sums on a GPU, so
# "bit for bit" becomes "to float32 rounding" there.
INTERPRET = jax.default_backend() == "cpu"
KERNEL_BACKEND = "interpret" if INTERPRET else "pallas"
if not INTERPRET:
  jax.config.update("jax_default_matmul_precision", "highest")
SAME_TILE_TOL = dict(rtol=0, atol=0) if INTERPRET else dict(rtol=1e-5, atol=1e-6)

# The programs here are tiny: compiling them is nearly all the time these tests take, and XLA's
# backend optimisations would double it. XLA's default CPU fusion emitters (the suite's are the
# older ones, conftest.py): the merged groups' bit-for-bit equality (SAME_TILE_TOL) holds under
# them, as a user compiles; the older ones round some last bits differently for the two shapes.
FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True,
        "xla_cpu_use_fusion_emitters": True}
reference = jax.jit(nsa.nsa_attention, static_argnames=("group", "shared"), compiler_options=FAST)
kernels = jax.jit(nk.nsa_attention, static_argnames=("group", "shared", "splits", "interpret"),
                  compiler_options=FAST)


@functools.partial(jax.jit, static_argnames=("tree",), compiler_options=FAST)
def reference_all(q, k, v, lens, inputs, bits, tree):
  """The reference's compressed branch and importance, its layer (each row alone: the merged
  schedule's output too) and, for a chain, its layer under the shared schedule."""
  lay = nsa.layout(lens, q.shape[1], bits)
  shared = () if tree else nsa.nsa_attention(q, k, v, lens, inputs, group=SHARED, shared=True)
  return (*nsa.compressed_attention(q, k, v, inputs, lens, lay, tree=tree),
          *nsa.nsa_attention(q, k, v, lens, inputs, tree_bits=bits), shared)


@functools.partial(jax.jit, compiler_options=FAST)
def kernel_compressed(q, k, v, lens, inputs, bits):
  """The compressed kernel as `nk.nsa_attention` runs it: (out, importance, the layout)."""
  lay, path = nk.route(k, v, lens, inputs.wk, inputs.wv, bits, t=q.shape[1], cfg=NSA_CFG)
  out, imp = nk.nsa_compressed(q, inputs.ck, inputs.cv, lens, lay.pos, path, cfg=NSA_CFG,
                               num_blocks=nsa.num_select_blocks(S, NSA_CFG), interpret=INTERPRET)
  return out, imp, lay


def make_inputs(seed, t, lengths, tree=None):
  """test_nsa.make_inputs with HQ query heads over HKV KV heads."""
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.normal(size=(2, t, HQ, D)) * 2, jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(2, S, HKV, D)), jnp.float32) for _ in range(2))
  wk, wv = (jnp.asarray(rng.normal(size=(HKV, NSA_CFG.compress_block, D, D)) * 0.1, jnp.float32)
            for _ in range(2))
  gates = jnp.asarray(rng.uniform(size=(2, t, HQ, 3)), jnp.float32)
  c = nsa.num_compressed(S, NSA_CFG)
  zeros = jnp.zeros((2, c, HKV, D))
  ck, cv = extend(zeros, zeros, k, v, wk, wv, jnp.zeros((2,), jnp.int32), S, NSA_CFG)
  inputs = nsa.NSAInputs(gates=gates, ck=ck, cv=cv, wk=wk, wv=wv, cfg=NSA_CFG)
  bits = None if tree is None else jnp.asarray(tree.ancestor_bits)
  return q, k, v, jnp.asarray(lengths, jnp.int32), inputs, bits


def poisoned(x, lengths, t):
  """The cache with NaN in every slot past the new rows."""
  keep = np.arange(x.shape[1])[None] < (np.asarray(lengths) + t)[:, None]
  return jnp.where(jnp.asarray(keep)[:, :, None, None], x, jnp.nan)


def inputs_for(name, seed=0):
  t, lengths, tree = LAYOUTS[name]
  return make_inputs(seed, t, lengths, tree)


@pytest.mark.parametrize("name", LAYOUTS)
def test_kernels_match_the_reference(name):
  """The compressed kernel's output and importance (hence the selection), then the layer under
  each schedule, against the reference; the merged schedule bit for bit each row alone."""
  q, k, v, lens, inputs, bits = inputs_for(name)
  t = q.shape[1]
  kp, vp = poisoned(k, lens, t), poisoned(v, lens, t)
  cmp, imp, lay = kernel_compressed(q, kp, vp, lens, inputs, bits)
  want_cmp, want_imp, want_out, want_idx, want_shared = reference_all(
      q, k, v, lens, inputs, bits, tree=bits is not None)
  np.testing.assert_allclose(np.asarray(cmp), np.asarray(want_cmp), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(imp), np.asarray(want_imp), rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(nsa.select_blocks(imp, lay.pos, NSA_CFG)),
                                np.asarray(want_idx))
  # Rows chose among more blocks than the forced ones, and adjacent rows chose differently.
  sel = np.asarray(want_idx)
  assert (sel >= 0).sum(-1).max() == NSA_CFG.num_selected
  assert any(not np.array_equal(sel[:, r], sel[:, r + 1]) for r in range(t - 1))

  outs = {}
  for group, shared in SCHEDULES[bits is not None]:
    out, idx = kernels(q, kp, vp, lens, inputs, tree_bits=bits, group=group, shared=shared,
                       interpret=INTERPRET)
    outs[group, shared] = out = np.asarray(out)
    assert np.isfinite(out).all()
    want, want_i = want_shared if shared else (want_out, want_idx)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(want_i))
    np.testing.assert_allclose(out, np.asarray(want), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(outs[MERGED, False], outs[1, False], **SAME_TILE_TOL)
  if bits is None:
    # Other shares of the key tiles (the default here is n = 5 a branch): one program a branch,
    # and 2 shares, bit for bit each row alone under the same shares.
    for splits in (1, 2):
      alone, merged = (np.asarray(kernels(q, kp, vp, lens, inputs, group=group, splits=splits,
                                          interpret=INTERPRET)[0]) for group in (1, MERGED))
      np.testing.assert_allclose(merged, np.asarray(want_out), rtol=1e-5, atol=1e-5)
      np.testing.assert_allclose(merged, alone, **SAME_TILE_TOL)
  if (SHARED, True) in outs:     # the groups' selections differed, so sharing changed some rows
    assert not np.allclose(outs[SHARED, True], outs[1, False])


@functools.partial(jax.jit, static_argnames=("splits", "importance"), compiler_options=FAST)
def compressed_in_shares(q, lens, inputs, *, splits, importance=True):
  """The chain's compressed kernel with 16-block key tiles (3 tiles at the chain's shapes) in
  `splits` shares (None: the default for these 16 row tiles)."""
  lay = nsa.layout(lens, q.shape[1], None)
  return nk.nsa_compressed(q, inputs.ck, inputs.cv, lens, lay.pos, cfg=NSA_CFG, block_c=16,
                           num_blocks=nsa.num_select_blocks(S, NSA_CFG), splits=splits,
                           importance=importance, interpret=INTERPRET)


def test_compressed_branch_in_shares_matches_the_reference():
  """The two-launch form a chain takes when its programs do not fill the GPU: key tiles and
  importance tiles split over programs, the shares merged in XLA. Output, importance and the
  selection they give equal the reference's, and the one-launch kernel's to float32 rounding."""
  q, k, v, lens, inputs, _ = inputs_for("chain", seed=3)
  lay = nsa.layout(lens, T_CHAIN, None)
  want_cmp, want_imp = nsa.compressed_attention(q, k, v, inputs, lens, lay, tree=False)
  want_idx = np.asarray(nsa.select_blocks(want_imp, lay.pos, NSA_CFG))
  one = compressed_in_shares(q, lens, inputs, splits=(1, 1))
  for splits in ((3, 2), None):
    out, imp = compressed_in_shares(q, lens, inputs, splits=splits)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want_cmp), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(imp), np.asarray(want_imp), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(nsa.select_blocks(imp, lay.pos, NSA_CFG)), want_idx)
    np.testing.assert_allclose(np.asarray(out), np.asarray(one[0]), rtol=1e-6, atol=1e-6)
  out, imp = compressed_in_shares(q, lens, inputs, splits=(3, 2), importance=False)
  assert imp is None
  np.testing.assert_allclose(np.asarray(out), np.asarray(want_cmp), rtol=1e-5, atol=1e-5)


def test_compressed_shares_only_while_the_programs_do_not_fill_the_gpu():
  # 8 (sequence, KV head, row tile) programs at 16K (1023 blocks, 256 selection blocks): the
  # default aims at ~528 programs, one a tile at most; 132 programs fill an H100's SMs alone.
  assert nk.compressed_splits(8, 1023, 256, 64, 16) == (16, 16)
  assert nk.compressed_splits(64, 1023, 256, 64, 16) == (9, 9)
  assert nk.compressed_splits(132, 1023, 256, 64, 16) == (1, 1)
  with pytest.raises(ValueError, match="splits must be two positive counts"):
    nk.nsa_compressed(jnp.zeros((1, 1, 2, 16)), jnp.zeros((1, 47, 1, 16)),
                      jnp.zeros((1, 47, 1, 16)), jnp.zeros((1,), jnp.int32),
                      jnp.zeros((1, 1), jnp.int32), cfg=NSA_CFG, num_blocks=12, splits=(0, 1),
                      interpret=True)


def test_a_block_completed_by_a_draft_is_visible_from_its_last_token_on():
  """Chain rows at 45 .. 52 (the chain layout's shapes): compression block 22 (tokens 44 .. 47)
  is completed by row 2's token. Garbage in that compressed entry changes the kernel's compressed
  output and importance for rows 2.. and for no row before."""
  q, k, v, lens, inputs, _ = make_inputs(2, T_CHAIN, (45, 45))     # the chain's shapes
  block = 22
  assert block * NSA_CFG.compress_stride + NSA_CFG.compress_block - 1 == 45 + 2
  clean = kernel_compressed(q, k, v, lens, inputs, None)
  spoiled = inputs.replace(ck=inputs.ck.at[:, block].set(50.0), cv=inputs.cv.at[:, block].set(50.0))
  dirty = kernel_compressed(q, k, v, lens, spoiled, None)
  for a, b_ in zip(clean[:2], dirty[:2]):
    same = np.all(np.asarray(a) == np.asarray(b_), axis=(0, 2, 3))
    np.testing.assert_array_equal(same, [True, True] + [False] * 6)


def test_reuse_layer_takes_the_given_blocks():
  """inputs.indices given (a reuse layer): no importance pass, those blocks under the merged
  schedule."""
  q, k, v, lens, inputs, _ = inputs_for("chain", seed=5)
  _, own = reference(q, k, v, lens, inputs)
  given = inputs.replace(indices=own[:, ::-1])          # each row another row's blocks
  got, used = kernels(q, poisoned(k, lens, T_CHAIN), poisoned(v, lens, T_CHAIN), lens, given,
                     group=MERGED, interpret=INTERPRET)
  want, _ = reference(q, k, v, lens, given)
  np.testing.assert_array_equal(np.asarray(used), np.asarray(own[:, ::-1]))
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
  assert not np.allclose(np.asarray(got), np.asarray(reference(q, k, v, lens, inputs)[0]))


# Selection blocks of 16 keys fill the kernel's 16-key tile (no padded keys, as at the paper's
# l' = 64), and a window of 40 spans several tiles, the middle ones seen whole by every row.
WIDE_CFG = NSAConfig(compress_block=16, compress_stride=8, select_block=16, num_selected=4,
                     window=40)
WIDE_S = 192


def wide_indices(rng, pos, hkv, cfg):
  """[B, T, Hkv, n] ascending: block 0, the row's own block and n - 2 others before it."""
  b, t = pos.shape
  out = np.zeros((b, t, hkv, cfg.num_selected), np.int32)
  for i in range(b):
    for r in range(t):
      cur = pos[i, r] // cfg.select_block
      for h in range(hkv):
        rest = rng.choice(np.arange(1, cur), cfg.num_selected - 2, replace=False)
        out[i, r, h] = sorted({0, cur, *rest.tolist()})
  return jnp.asarray(out)


@pytest.mark.parametrize("name", ["chain", "tree-bfs"])
def test_kernels_at_tile_sized_blocks_and_a_wide_window(name):
  """At l' = 16 (a selection block fills a tile) and a 40-key window, the kernels (given blocks,
  as a reuse layer takes them) match the reference each row alone, in merged groups of 4 and over
  2 shares, and a merged group matches each row alone bit for bit (float32, interpret mode)."""
  t, _, tree = LAYOUTS[name]
  lengths = (150, 97)
  rng = np.random.default_rng(7)
  q = jnp.asarray(rng.normal(size=(2, t, HQ, D)) * 2, jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(2, WIDE_S, HKV, D)), jnp.float32) for _ in range(2))
  wk, wv = (jnp.asarray(rng.normal(size=(HKV, 16, D, D)) * 0.1, jnp.float32) for _ in range(2))
  c = nsa.num_compressed(WIDE_S, WIDE_CFG)
  zeros = jnp.zeros((2, c, HKV, D))
  ck, cv = extend(zeros, zeros, k, v, wk, wv, jnp.zeros((2,), jnp.int32), WIDE_S, WIDE_CFG)
  bits = None if tree is None else jnp.asarray(tree.ancestor_bits)
  lens = jnp.asarray(lengths, jnp.int32)
  pos = np.asarray(nsa.layout(lens, t, bits).pos)
  inputs = nsa.NSAInputs(gates=jnp.asarray(rng.uniform(size=(2, t, HQ, 3)), jnp.float32),
                         ck=ck, cv=cv, wk=wk, wv=wv, cfg=WIDE_CFG,
                         indices=wide_indices(rng, pos, HKV, WIDE_CFG))
  want = np.asarray(reference(q, k, v, lens, inputs, tree_bits=bits)[0])
  kp, vp = poisoned(k, lens, t), poisoned(v, lens, t)
  for splits in (1, 2):
    alone, merged = (np.asarray(kernels(q, kp, vp, lens, inputs, tree_bits=bits, group=group,
                                        splits=splits, interpret=INTERPRET)[0])
                     for group in (1, MERGED))
    np.testing.assert_allclose(alone, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(merged, alone, **SAME_TILE_TOL)


# ----------------------------------------------------------------------------------------------
# The model, backend 'interpret' (or 'pallas' on a GPU) against 'reference'

@pytest.fixture(scope="module")
def one_layer():
  """test_nsa's tiny NSA model with one layer (each layer adds the kernels' compile again)."""
  return init_random(dataclasses.replace(CFG, num_layers=1), dtype=jnp.float32, seed=1)


@functools.partial(jax.jit, static_argnums=(0, 5), compiler_options=FAST)
def _forward(graphdef, state, tokens, positions, cache, backend, plan):
  model = nnx.merge(graphdef, state)
  hidden, cache, _ = model(tokens, positions, cache, plan, backend)
  return model.logits(hidden), cache


def test_model_logits_with_the_kernels_equal_the_references(one_layer):
  """A prefill of prompts of 52 and 33 tokens right-padded to 64 slots (an empty cache, every
  block completed by the call itself): the same logits through the kernels as through the
  references."""
  rng = np.random.default_rng(11)
  prompts = [rng.integers(0, CFG.vocab_size, n).tolist() for n in (52, 33)]
  graphdef, state = nnx.split(one_layer)
  cache = KVCache.create(one_layer.cfg, 2, S, jnp.float32)
  tokens = jnp.asarray(padded(prompts), jnp.int32)
  positions = cache.chain_positions(tokens.shape[1])
  logits = {backend: np.asarray(_forward(graphdef, state, tokens, positions, cache, backend,
                                         Prefill())[0])
            for backend in ("reference", KERNEL_BACKEND)}
  np.testing.assert_allclose(logits[KERNEL_BACKEND], logits["reference"], rtol=1e-4, atol=1e-4)
