"""Pallas kernels (interpret mode on the CPU) against their pure-JAX references.

Every test draws fresh random inputs; the run's seed is in pytest's report (conftest.py). Cache
positions a kernel must not read hold NaN, so reading one shows up as NaN in the output; interpret
mode fills kernel output buffers with NaN before the kernel runs, so an element left unwritten
shows up too.
"""
import functools
import itertools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import online_softmax
from pallas_kernels import rope_write as rw
from pallas_kernels import sparse_attention as sp
from pallas_kernels import swiglu_quant as sq
from pallas_kernels import topk_select as tk
from pallas_kernels import verify_attention as va

_SEED = itertools.count(1)
_RNG = np.random.default_rng(int(os.environ["JAXSPEC_TEST_SEED"]))   # conftest.py


def _key():
  return jax.random.PRNGKey(int(_RNG.integers(1 << 30)) + next(_SEED))


def _normal(shape, dtype=jnp.bfloat16):
  return jax.random.normal(_key(), shape, jnp.float32).astype(dtype)


def _rel_err(a, b):
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _poison(x, keep):
  """x [B, S, H, D]; keep [B, S] or [B, S, H] bool: NaN everywhere else."""
  keep = keep if keep.ndim == 3 else keep[:, :, None]
  return jnp.where(jnp.asarray(keep)[..., None], x, jnp.nan).astype(x.dtype)


def _lengths(b, s, t):
  """Lengths with the edge cases: empty cache, one entry, odd, full (lengths = S - T)."""
  base = [0, 1, 37, s - t, int(_RNG.integers(0, s - t + 1))]
  return np.array(base[:b], np.int32)


# ----------------------------------------------------------------------------------------------
# verify_attention

VERIFY_CASES = [
    # T, Hq, Hkv, D, score_kind, score_rows, knobs
    (1, 8, 2, 128, None, (0, -1), dict(block_k=16, num_splits=3)),       # GQA 4, decode
    (1, 7, 1, 64, "logits", (0, -1), dict(block_k=16, num_splits=2)),    # GQA 7
    (2, 2, 2, 64, "logits", (0, -1), dict(block_k=16, num_splits=3)),    # GQA 1
    (7, 7, 1, 64, "weights", (0, -1), dict(block_k=32, num_splits=2)),
    (12, 4, 1, 128, "logits", None, dict(block_k=16, num_splits=3)),     # all rows
    (12, 8, 2, 64, "weights", None, dict(block_k=16, num_splits=4)),
    (7, 4, 1, 128, "logits", (1, 3), {}),                                # default knobs
    (11, 12, 2, 128, "logits", (0, -1), {}),          # a 128-row tile at its defaults (1.5B)
    (1, 14, 2, 64, None, (0, -1), dict(block_k=16, num_splits=3)),       # heads as one, 0.5B
    (2, 8, 4, 16, None, (0, -1), {}),                                    # heads as one, T = 2
]


_B, _S = 4, 80   # S: not a multiple of the blocks; the lengths hit 0, 1, odd and S - T


def _verify_both(t, hq, hkv, d, knobs, **opts):
  """Kernel (on a cache poisoned past what the rows see) and reference on fresh inputs."""
  b, s = _B, _S
  q = _normal((b, t, hq, d))
  k, v = _normal((b, s, hkv, d)), _normal((b, s, hkv, d))
  lengths = _lengths(b, s, t)
  seen = np.arange(s)[None] < (lengths + t)[:, None]
  got = va.verify_attention(q, _poison(k, seen), _poison(v, seen), jnp.asarray(lengths),
                            interpret=True, **opts, **knobs)
  return q, got, va.verify_attention_reference(q, k, v, jnp.asarray(lengths), **opts)


@pytest.mark.parametrize("t,hq,hkv,d,kind,rows,knobs", VERIFY_CASES)
def test_verify_attention(t, hq, hkv, d, kind, rows, knobs):
  q, (out, scores), (ref, ref_scores) = _verify_both(t, hq, hkv, d, knobs, score_kind=kind,
                                                     score_rows=rows)
  b, s = _B, _S
  assert out.shape == q.shape and out.dtype == q.dtype
  assert not np.isnan(np.asarray(out, np.float32)).any()
  assert _rel_err(out, ref) < 1e-2
  if kind is None:
    assert scores is None
    return
  sc, rs = np.asarray(scores, np.float32), np.asarray(ref_scores, np.float32)
  assert scores.shape == (b, s) and scores.dtype == jnp.bfloat16
  assert not np.isnan(sc).any()
  np.testing.assert_array_equal(np.isinf(sc), np.isinf(rs))     # -inf exactly where unseen
  fin = np.isfinite(rs)
  np.testing.assert_allclose(sc[fin], rs[fin], rtol=2e-2, atol=2e-2 * np.abs(rs[fin]).max())
  # The ranking: the top-k set of the kernel's scores is the reference's, where no near-tie
  # sits at the boundary.
  for i in range(b):
    n = int(fin[i].sum())
    kk = min(5, n - 1)
    if kk < 1:
      continue
    order = np.argsort(-rs[i][fin[i]], kind="stable")
    vals = rs[i][fin[i]][order]
    if vals[kk - 1] - vals[kk] <= 2e-2 * np.abs(vals).max():
      continue
    got = np.argsort(-np.where(fin[i], sc[i], -np.inf), kind="stable")[:kk]
    assert set(got) == set(np.flatnonzero(fin[i])[order[:kk]])


STORE_CASES = [
    # T, Hq, Hkv, D, score_rows, score_heads, knobs
    (1, 7, 1, 64, (0, -1), "mean", dict(block_k=16, num_splits=3)),   # a draft step, GQA 7
    (1, 14, 2, 64, (-1,), "kv", dict(block_k=16, num_splits=2)),       # STS's rows per KV head
    (3, 4, 2, 64, (0, -1), "mean", dict(block_k=32, num_splits=2)),    # a row between the two
    (9, 12, 2, 128, (0, -1), "mean", dict(block_k=16, num_splits=3)),  # Collect-2, the 1.5B's G
    (5, 14, 2, 64, (0, 2, -1), "kv", dict(block_k=32, num_splits=2)),  # three rows, per KV head
]


@pytest.mark.parametrize("store", [True, jnp.float32, False])
@pytest.mark.parametrize("t,hq,hkv,d,rows,heads,knobs", STORE_CASES)
def test_weights_from_stored_logits_equal_the_second_pass(t, hq, hkv, d, rows, heads, knobs, store):
  """'weights' from the main pass's stored logits (float16 from the bf16 cache, or float32) and
  from the second pass over K: both the reference's, -inf exactly where a collected row does not
  see the key."""
  knobs = dict(knobs, weights_store=store is not False)
  if store is jnp.float32:
    knobs["weights_store_dtype"] = jnp.float32
  _, (out, scores), (ref, ref_scores) = _verify_both(
      t, hq, hkv, d, knobs, score_kind="weights", score_rows=rows, score_heads=heads)
  assert _rel_err(out, ref) < 1e-2
  assert scores.shape == ref_scores.shape == ((_B, hkv, _S) if heads == "kv" else (_B, _S))
  sc, rs = np.asarray(scores, np.float32), np.asarray(ref_scores, np.float32)
  assert not np.isnan(sc).any()
  np.testing.assert_array_equal(np.isinf(sc), np.isinf(rs))
  fin = np.isfinite(rs)
  np.testing.assert_allclose(sc[fin], rs[fin], rtol=2e-2, atol=1e-3)


def _kernel_names(t, hq, d, hkv=1, **opts):
  q, k = jnp.zeros((1, t, hq, d), jnp.bfloat16), jnp.zeros((1, 32, hkv, d), jnp.bfloat16)
  jaxpr = jax.make_jaxpr(lambda q, k: va.verify_attention(
      q, k, k, jnp.zeros((1,), jnp.int32), interpret=True, **opts))(q, k)
  return set(re.findall(r"verify_attention_\w+", str(jaxpr)))


def test_decode_runs_its_kv_heads_as_one_wide_head_where_one_tile_holds_every_row():
  """T * Hq <= 16 rows, head_dim < 128, Hkv a power of two with Hkv * D <= 128, no scores: one
  program reads all Hkv heads' D columns of a key (Qwen2.5-0.5B decode: G = 14 over 128
  columns)."""
  names = _kernel_names
  assert names(1, 14, 64, hkv=2) == {"verify_attention_t1_g14_d128"}
  assert names(2, 8, 16, hkv=4) == {"verify_attention_t2_g8_d64"}
  assert names(1, 14, 64, hkv=2, score_kind="logits") == {
      "verify_attention_t1_g7_d64_scores_pad"}
  assert names(2, 14, 64, hkv=2) == {"verify_attention_t2_g7_d64"}      # 28 rows: two tiles
  assert names(1, 9, 64, hkv=3) == {"verify_attention_t1_g3_d64"}       # 192 columns
  assert names(1, 8, 128, hkv=2) == {"verify_attention_t1_g4_d128"}     # head_dim 128 already


PAD_CASES = [
    # T, Hq, Hkv, D, score_heads, knobs
    (9, 7, 1, 64, "mean", dict(block_k=16, num_splits=3)),   # 63 of 64 rows: one padding row
    (2, 14, 2, 64, "kv", dict(block_k=16, num_splits=2)),    # per KV head
    (7, 4, 1, 128, "mean", {}),                              # head_dim 128, default knobs
    (8, 8, 2, 64, "mean", dict(block_k=16, num_splits=2)),   # 32 of 32 rows: a 64-row tile
]


@pytest.mark.parametrize("t,hq,hkv,d,heads,knobs", PAD_CASES)
def test_padding_row_and_product_logits_match_the_reference(t, hq, hkv, d, heads, knobs):
  """Collect-2's 'logits' from the query tile's padding row (the summed query rounded to bf16)
  and from the k @ qsum product (kept to about 2^-16): each gives the reference's output, its
  -inf entries and its scores within the bf16 tolerance, and names its kernel for its path."""
  opts = dict(score_kind="logits", score_heads=heads)
  for store in (True, False):
    _, (out, scores), (ref, ref_scores) = _verify_both(t, hq, hkv, d,
                                                       dict(knobs, logits_store=store), **opts)
    assert _rel_err(out, ref) < 1e-2
    sc, rs = np.asarray(scores, np.float32), np.asarray(ref_scores, np.float32)
    assert sc.shape == ((_B, hkv, _S) if heads == "kv" else (_B, _S))
    np.testing.assert_array_equal(np.isinf(sc), np.isinf(rs))
    fin = np.isfinite(rs)
    np.testing.assert_allclose(sc[fin], rs[fin], rtol=2e-2, atol=2e-2 * np.abs(rs[fin]).max())
  # Each path names its kernel.
  assert _kernel_names(t, hq, d, hkv=hkv, logits_store=True, **opts, **knobs) == {
      f"verify_attention_t{t}_g{hq // hkv}_d{d}_scores_pad"}
  assert _kernel_names(t, hq, d, hkv=hkv, logits_store=False, **opts, **knobs) == {
      f"verify_attention_t{t}_g{hq // hkv}_d{d}_scores_sum"}


def test_padding_row_kernel_pairs_its_blocks_below_head_dim_128():
  """At head_dim 64 the padding row's kernel folds the blocks every row sees two an iteration (a
  third loop; PAD_CASES check its results); at head_dim 128, and with scores off, it does not."""
  def loops(d, **opts):
    q, k = jnp.zeros((1, 9, 7, d), jnp.bfloat16), jnp.zeros((1, 64, 1, d), jnp.bfloat16)
    return str(jax.make_jaxpr(lambda q, k: va.verify_attention(
        q, k, k, jnp.zeros((1,), jnp.int32), interpret=True, **opts))(q, k)).count("while[")
  assert loops(64, score_kind="logits") == 3
  assert loops(64, score_kind="logits", logits_store=False) == 2
  assert loops(64) == loops(128) == loops(128, score_kind="logits") == 2
  # blocks_per_rescale overrides the default either way; 1 keeps the two loops.
  assert loops(64, score_kind="logits", blocks_per_rescale=1) == 2
  assert loops(128, blocks_per_rescale=4) == 3
  q, k = jnp.zeros((1, 9, 7, 64), jnp.bfloat16), jnp.zeros((1, 64, 1, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="blocks_per_rescale must be a positive integer, got 0"):
    va.verify_attention(q, k, k, jnp.zeros((1,), jnp.int32), interpret=True, blocks_per_rescale=0)


@pytest.mark.parametrize("fold,opts,store", [(3, dict(score_kind="logits"), None), (4, {}, None),
                                             (3, dict(score_kind="logits"), False)])
def test_blocks_folded_under_one_rescale_match_the_reference(fold, opts, store):
  """Three or four key blocks an iteration, with a remainder of single blocks (16-key blocks over
  splits of 8-9 blocks): the reference's output and Collect-2 scores."""
  _, (out, scores), (ref, ref_scores) = _verify_both(
      9, 7, 1, 64, dict(block_k=16, num_splits=2, blocks_per_rescale=fold, logits_store=store),
      **opts)
  assert _rel_err(out, ref) < 1e-2
  if opts:
    sc, rs = np.asarray(scores, np.float32), np.asarray(ref_scores, np.float32)
    np.testing.assert_array_equal(np.isinf(sc), np.isinf(rs))
    fin = np.isfinite(rs)
    np.testing.assert_allclose(sc[fin], rs[fin], rtol=2e-2, atol=2e-2 * np.abs(rs[fin]).max())


def test_logits_store_is_chosen_where_a_tile_of_at_most_64_rows_has_one_free():
  """The defaults: the padding row where a tile of at most 64 rows has one free (the 0.5B's and
  the 1.5B's 9-row rounds) or where rows that fill a tile of at most 32 get one of twice the rows
  (Qwen3-8B's 8-row rounds); the product where the rows fill 64 or outgrow it; asking for the
  padding row where it cannot run is an error."""
  names = functools.partial(_kernel_names, hkv=2, score_kind="logits")
  assert names(9, 14, 64) == {"verify_attention_t9_g7_d64_scores_pad"}       # 63 of 64 rows
  assert names(9, 12, 128) == {"verify_attention_t9_g6_d128_scores_pad"}     # 54 of 64
  assert names(8, 8, 64) == {"verify_attention_t8_g4_d64_scores_pad"}        # 32 of 32: 64
  assert names(16, 8, 64) == {"verify_attention_t16_g4_d64_scores_sum"}      # 64 of 64
  assert names(10, 14, 64) == {"verify_attention_t10_g7_d64_scores_sum"}     # 70 of 128
  full, free = (jnp.zeros((1, t, 4, 64), jnp.bfloat16) for t in (16, 2))  # 64 and 8 rows
  k = jnp.zeros((1, 32, 1, 64), jnp.bfloat16)
  lengths = jnp.zeros((1,), jnp.int32)
  for q, opts in ((full, dict(score_kind="logits")),
                  (free, dict(score_kind="logits", per_row=True)),
                  (free, dict(score_kind="weights")),
                  (free, dict(score_kind="logits", tree_bits=jnp.asarray([1, 3], jnp.int32)))):
    with pytest.raises(ValueError, match="logits_store"):
      va.verify_attention(q, k, k, lengths, interpret=True, logits_store=True, **opts)


def test_weights_store_is_chosen_by_the_bytes_it_moves():
  """From a bf16 cache, a draft step (T = 1, G = 7, head_dim 64) and Collect-2 over 8 rows (2 x 7
  collected packed rows: 56 float16 bytes a key written and read, against 128 of K) store their
  logits; all 8 rows' weights (224 bytes) take the second pass; bad requests are errors."""
  assert _kernel_names(1, 7, 64, score_kind="weights") == {"verify_attention_t1_g7_d64_scores_store"}
  assert _kernel_names(8, 7, 64, score_kind="weights") == {"verify_attention_t8_g7_d64_scores_store"}
  names = _kernel_names(8, 7, 64, score_kind="weights", score_rows=None)
  assert "verify_attention_t8_g7_d64" in names and "verify_attention_weights_g7_d64" in names
  q = jnp.zeros((1, 2, 2, 64), jnp.bfloat16)
  k = jnp.zeros((1, 32, 1, 64), jnp.bfloat16)
  lengths = jnp.zeros((1,), jnp.int32)
  for opts in (dict(score_kind="logits"), dict(score_kind="weights", per_row=True),
               dict(score_kind="weights", tree_bits=jnp.asarray([1, 3], jnp.int32))):
    with pytest.raises(ValueError, match="weights_store"):
      va.verify_attention(q, k, k, lengths, interpret=True, weights_store=True, **opts)


PER_ROW_CASES = [
    # T, Hq, Hkv, D, score_kind, knobs
    (1, 8, 2, 128, "logits", dict(block_k=16, num_splits=3)),     # GQA 4, one row
    (7, 7, 1, 64, "logits", dict(block_k=32, num_splits=2)),      # GQA 7
    (12, 2, 2, 64, "logits", dict(block_k=16, num_splits=4)),     # GQA 1, T = 12
    (12, 4, 1, 128, "weights", dict(block_k=16, num_splits=3)),
    (2, 2, 2, 64, "weights", dict(block_k=16, num_splits=4)),
    (7, 14, 2, 64, "weights", {}),                                # GQA 7, default knobs
]


@pytest.mark.parametrize("t,hq,hkv,d,kind,knobs", PER_ROW_CASES)
def test_verify_attention_per_row_scores(t, hq, hkv, d, kind, knobs):
  _, (out, scores), (ref, ref_scores) = _verify_both(t, hq, hkv, d, knobs, score_kind=kind,
                                                     per_row=True)
  assert _rel_err(out, ref) < 1e-2
  assert scores.shape == (_B, t, _S) and scores.dtype == jnp.bfloat16
  sc, rs = np.asarray(scores, np.float32), np.asarray(ref_scores, np.float32)
  assert not np.isnan(sc).any()
  np.testing.assert_array_equal(np.isinf(sc), np.isinf(rs))     # -inf exactly where unseen
  fin = np.isfinite(rs)
  np.testing.assert_allclose(sc[fin], rs[fin], rtol=2e-2, atol=2e-2 * np.abs(rs[fin]).max())


def test_per_row_weights_survive_a_huge_logit_on_a_later_key():
  """A key only a later row sees, with a logit far above what an earlier row's log-sum-exp covers:
  its weight for that earlier row overflows unless the kernel masks it, and an inf there would
  turn the later row's weight for the same key into NaN."""
  b, s, t, hq, hkv, d = 2, 48, 3, 4, 2, 64
  q = _normal((b, t, hq, d)) * 0.1
  k, v = _normal((b, s, hkv, d)) * 0.1, _normal((b, s, hkv, d))
  lengths = jnp.array([5, 30], jnp.int32)
  hot = lengths + 1                                 # seen by rows 1 and 2, not by row 0
  k = k.at[jnp.arange(b), hot].set(8.0)
  q = q.at[:, 0].set(8.0)                           # row 0's logit there: 4096 / 8 = 512 nats
  _, sc = va.verify_attention(q, k, v, lengths, score_kind="weights", per_row=True,
                              interpret=True, block_k=16, num_splits=2)
  _, rs = va.verify_attention_reference(q, k, v, lengths, score_kind="weights", per_row=True)
  sc, rs = np.asarray(sc, np.float32), np.asarray(rs, np.float32)
  assert not np.isnan(sc).any()
  np.testing.assert_array_equal(np.isinf(sc), np.isinf(rs))
  fin = np.isfinite(rs)
  np.testing.assert_allclose(sc[fin], rs[fin], rtol=2e-2, atol=2e-2)


def test_reference_per_row_scores_are_each_row_alone():
  """Row t of the per-row dump is what the single-row reference gives for query t at lengths + t:
  the semantics the policies keyed on the last accepted token rely on."""
  b, s, t, hq, hkv, d = 3, 50, 5, 4, 2, 64
  q, k, v = _normal((b, t, hq, d)), _normal((b, s, hkv, d)), _normal((b, s, hkv, d))
  lengths = jnp.array([0, 17, s - t], jnp.int32)
  for kind in ("logits", "weights"):
    _, rows = va.verify_attention_reference(q, k, v, lengths, score_kind=kind, per_row=True)
    for i in range(t):
      _, one = va.verify_attention_reference(q[:, i:i + 1], k, v, lengths + i, score_kind=kind,
                                             score_rows=(0,))
      a, r = np.asarray(rows[:, i], np.float32), np.asarray(one, np.float32)
      np.testing.assert_array_equal(np.isinf(a), np.isinf(r))
      fin = np.isfinite(r)
      np.testing.assert_allclose(a[fin], r[fin], rtol=1e-2, atol=1e-2 * np.abs(r[fin]).max())


def test_summed_query_high_low_parts_keep_the_f32_sum():
  """The score path's summed query: high + low bf16 parts give the f32 row sum to ~2^-16, where
  the high part alone is off by up to 2^-9 (the test fails if the low part is dropped)."""
  qp = _normal((2, 3, 16, 64))
  rows = [0, 1, 5, 6]
  want = np.asarray(qp, np.float32)[:, :, rows].sum(axis=2)
  parts = np.asarray(va._summed_query(qp, rows, jnp.bfloat16), np.float32)   # [2, 3, 16, 64]
  assert parts.shape == (2, 3, 16, 64) and not parts[:, :, 2:].any()
  scale = np.abs(want).max()
  assert np.abs(parts[:, :, 0] + parts[:, :, 1] - want).max() < 2 ** -15 * scale
  assert np.abs(parts[:, :, 0] - want).max() > 2 ** -12 * scale


def test_verify_partials_fully_written():
  """Every partial output element that the combine reads was written by the kernel."""
  b, s, t, hq, hkv, d = 3, 70, 3, 4, 2, 64
  g = hq // hkv
  q = _normal((b, hkv, 16, d))
  k, v = _normal((b, s, hkv, d)), _normal((b, s, hkv, d))
  lengths = jnp.array([0, 22, s - t], jnp.int32)
  qsum = va._summed_query(q, [r * g + i for r in (0, 2) for i in range(g)], k.dtype)
  fn = functools.partial(va._verify_unbatched, sm_scale=0.1, t=t, g=g, block_k=16, num_splits=3,
                         score_mode="sum", num_warps=4, num_stages=2, interpret=True)
  o, m, l, part = jax.vmap(fn)(q, k, v, lengths, qsum)
  for x in (o, m, l):
    assert not np.isnan(np.asarray(x)).any()
  part = np.asarray(part)                                    # [B, Hkv, S]
  for i, n in enumerate(np.asarray(lengths)):
    assert not np.isnan(part[i, :, :n + 1]).any()            # keys seen by both collected rows


def test_default_splits_stay_within_the_program_budget():
  splits = online_softmax.default_splits
  assert splits(32, 1024, 528, at_most=True) == 16      # 512 programs, not 544
  assert splits(32, 1024, 528) == 17                    # the sparse kernel's rounding
  assert splits(1000, 1024, 528, at_most=True) == 1     # never zero
  assert splits(4, 3, 528, at_most=True) == 3           # never more than the blocks


@pytest.mark.parametrize("p", [1, 3, online_softmax.UNROLLED_SPLITS,
                               online_softmax.UNROLLED_SPLITS + 1, 264])
def test_combine_splits_is_softmax_over_all_splits(p):
  """Split partials merge to the softmax over every split's keys, term by term or reduced; a row
  no split saw stays 0; a long split axis stays a few ops (compile time: unrolled, the merge made a
  1.5B's decode loop at B = 1 take 44 s to compile on an H200)."""
  n, m_rows, d = 5, 3, 8                                   # keys per split
  rng = np.random.default_rng(p)
  s = rng.normal(size=(2, p, m_rows, n)) * 4               # base-2 logits
  s[0, :, 1] = -np.inf                                     # row 1 of sequence 0 sees nothing
  v = rng.normal(size=(2, p, n, d))
  m = np.where(np.isinf(s).all(-1), online_softmax.MAX_INIT, s.max(-1))
  e = np.exp2(s - m[..., None])
  o, l = np.einsum("bpmn,bpnd->bpmd", e, v), e.sum(-1)
  out, lse2 = online_softmax.combine_splits(*(jnp.asarray(x, jnp.float32) for x in (o, m, l)))
  for b in (0, 1):
    full = s[b].transpose(1, 0, 2).reshape(m_rows, p * n)
    values = v[b].reshape(p * n, d)
    for r in range(m_rows):
      if np.isinf(full[r]).all():
        np.testing.assert_array_equal(np.asarray(out[b, r]), 0.0)
        continue
      pr = np.exp2(full[r] - full[r].max())
      np.testing.assert_allclose(np.asarray(out[b, r]), pr @ values / pr.sum(), rtol=1e-4,
                                 atol=1e-5)
      np.testing.assert_allclose(float(lse2[b, r]), full[r].max() + np.log2(pr.sum()), rtol=1e-5)
  if p > online_softmax.UNROLLED_SPLITS:
    jaxpr = jax.make_jaxpr(online_softmax.combine_splits)(
        *(jnp.asarray(x, jnp.float32) for x in (o, m, l)))
    assert len(jaxpr.eqns) <= 20, len(jaxpr.eqns)


def test_verify_defaults_keep_long_rounds_within_the_gpu():
  tiling = va.tiling
  # A 128-row tile at head_dim 128 (the 1.5B's rounds from gamma = 10) reads 64 keys a block:
  # 128 with Collect-2's scores asks for more shared memory than an H100 or H200 has.
  assert tiling(128, 11, 12, 2, 128, 24576, "logits")[0] == 64
  assert tiling(128, 9, 12, 2, 128, 24576, "logits")[0] == 128        # 64 rows: as before
  # A 128-row scored tile at head_dim 64 (the 0.5B's from gamma = 9) runs two warpgroups.
  assert tiling(128, 11, 14, 2, 64, 24576, "logits")[1] == 8
  assert tiling(128, 11, 14, 2, 64, 24576, None)[1] == 4
  # No scored split spans exactly 64 blocks at head_dim 128 (3 would, at B = 128 x 24576).
  assert tiling(128, 9, 12, 2, 128, 24576, "logits")[2] == 2
  assert tiling(64, 9, 12, 2, 128, 24576, "logits")[2] == 6           # 32 blocks each
  assert tiling(4, 13, 32, 8, 128, 131072, "logits")[2] == 24         # 43 blocks each
  # The padding row's store takes the plain kernel's ~4 programs an SM, 64 blocks a split or not.
  store = functools.partial(tiling, logits_store=True)
  assert store(64, 9, 12, 2, 128, 24576, "logits")[2] == 4
  assert store(4, 12, 32, 8, 128, 131072, "logits")[2] == 16
  assert store(128, 9, 14, 2, 64, 24576, "logits") == (64, 4, 2)
  assert store(64, 7, 14, 2, 64, 24576, "logits") == (64, 4, 4)
  assert tiling(128, 11, 12, 2, 128, 24576, "logits", 32, 2, 5) == (32, 2, 5)   # given knobs


def test_verify_attention_bad_shapes():
  q = jnp.zeros((2, 3, 4, 64), jnp.bfloat16)
  k = jnp.zeros((2, 50, 2, 64), jnp.bfloat16)
  with pytest.raises(ValueError):
    va.verify_attention(q, k, k, jnp.zeros((3,), jnp.int32), interpret=True)
  with pytest.raises(ValueError):
    va.verify_attention(q, k[..., :32], k[..., :32], jnp.zeros((2,), jnp.int32), interpret=True)
  with pytest.raises(ValueError):
    va.verify_attention(q[:, :, :3], k, k, jnp.zeros((2,), jnp.int32), interpret=True)
  with pytest.raises(ValueError):
    va.verify_attention(q, k, k, jnp.zeros((2,), jnp.int32), score_kind="probs", interpret=True)
  with pytest.raises(ValueError):
    va.verify_attention(q, k, k, jnp.zeros((2,), jnp.int32), block_k=24, interpret=True)


# ----------------------------------------------------------------------------------------------
# sparse_attention

def _selection(b, hkv, s, kk, tail_start, per_head, count_mode):
  """Distinct random positions below tail_start; count_mode 'all', 'zero' or 'random'."""
  shape = (b, hkv) if per_head else (b,)
  idx = np.zeros(shape + (kk,), np.int32)
  cnt = np.zeros(shape, np.int32)
  for pos in np.ndindex(*shape):
    avail = int(tail_start[pos[0]])
    c = {"all": min(kk, avail), "zero": 0,
         "random": int(_RNG.integers(0, min(kk, avail) + 1))}[count_mode]
    idx[pos][:c] = _RNG.permutation(avail)[:c]
    idx[pos][c:] = _RNG.integers(0, s, kk - c)       # padding: any value, never read
    cnt[pos] = c
  return idx, cnt


SPARSE_CASES = [
    # T, Hq, Hkv, D, per_head, K, count_mode, knobs
    (1, 4, 1, 64, False, 90, "all", dict(block_k=16, num_splits=3)),     # K = whole prefix
    (2, 8, 2, 128, True, 40, "random", dict(block_k=16, num_splits=2)),  # per-head lists
    (7, 7, 1, 64, False, 0, "zero", {}),                                  # K = 0: tail only
    (12, 2, 2, 128, True, 24, "zero", dict(block_k=16, tail_splits=3)),  # empty rows, GQA 1
    (12, 4, 1, 64, False, 33, "random", dict(block_k=16, num_splits=2, tail_splits=2)),
    # T * G = 160 packed rows > MAX_ROWS: run as row slices of 32 and 8 (STS-PD's large chunks)
    (40, 8, 2, 64, True, 20, "random", dict(block_k=16)),
]


@pytest.mark.parametrize("t,hq,hkv,d,per_head,kk,count_mode,knobs", SPARSE_CASES)
def test_sparse_attention(t, hq, hkv, d, per_head, kk, count_mode, knobs):
  b, s = 4, 100
  q = _normal((b, t, hq, d))
  k, v = _normal((b, s, hkv, d)), _normal((b, s, hkv, d))
  lengths = _lengths(b, s, t)
  # Tails: the whole new block, a longer recent window, an empty one (rows see only the
  # selection, or nothing), and one starting mid-way.
  tail_start = np.array([lengths[0], max(lengths[1] - 5, 0), lengths[2] + t, lengths[3] - 9])
  tail_start = np.clip(tail_start, 0, s).astype(np.int32)
  idx, cnt = _selection(b, hkv, s, kk, tail_start, per_head, count_mode)
  args = (jnp.asarray(idx), jnp.asarray(cnt), jnp.asarray(tail_start), jnp.asarray(lengths))
  # Poison every cache entry that no row may see.
  keep = np.zeros((b, s, hkv), bool)
  for i in range(b):
    keep[i, tail_start[i]:lengths[i] + t] = True
    for h in range(hkv):
      sel = idx[i, h, :cnt[i, h]] if per_head else idx[i, :cnt[i]]
      keep[i, sel, h] = True
  out = sp.sparse_attention(q, _poison(k, keep), _poison(v, keep), *args, interpret=True, **knobs)
  ref = sp.sparse_attention_reference(q, k, v, *args)
  assert out.shape == q.shape and out.dtype == q.dtype
  assert not np.isnan(np.asarray(out, np.float32)).any()
  assert not np.isnan(np.asarray(ref, np.float32)).any()
  assert _rel_err(out, ref) < 1e-2


def test_sparse_counts_outside_the_list_read_as_the_whole_list_or_nothing():
  """The kernel clamps each count to [0, K] itself (its caller passes them as they are)."""
  b, s, t, hq, hkv, d, kk = 2, 64, 1, 4, 2, 64, 24
  q = _normal((b, t, hq, d))
  k, v = _normal((b, s, hkv, d)), _normal((b, s, hkv, d))
  idx = jnp.asarray(np.stack([_RNG.permutation(40)[:kk] for _ in range(b)]), jnp.int32)
  tail_start, lengths = jnp.full((b,), 40, jnp.int32), jnp.full((b,), 50, jnp.int32)
  out = sp.sparse_attention(q, k, v, idx, jnp.array([kk + 9, -3], jnp.int32), tail_start,
                            lengths, interpret=True, block_k=16, num_splits=2)
  ref = sp.sparse_attention_reference(q, k, v, idx, jnp.array([kk, 0], jnp.int32), tail_start,
                                      lengths)
  assert _rel_err(out, ref) < 1e-2


def test_sparse_fully_masked_rows_are_zero():
  b, s, t, hq, hkv, d = 2, 40, 3, 4, 2, 64
  q = _normal((b, t, hq, d))
  k, v = _normal((b, s, hkv, d)), _normal((b, s, hkv, d))
  idx = jnp.zeros((b, 8), jnp.int32)
  out = sp.sparse_attention(q, k, v, idx, jnp.zeros((b,), jnp.int32),
                            jnp.full((b,), s, jnp.int32), jnp.array([5, 30], jnp.int32),
                            interpret=True)
  ref = sp.sparse_attention_reference(q, k, v, idx, jnp.zeros((b,), jnp.int32),
                                      jnp.full((b,), s, jnp.int32), jnp.array([5, 30], jnp.int32))
  assert not np.asarray(out, np.float32).any()
  assert not np.asarray(ref, np.float32).any()


def test_sparse_attention_bad_shapes():
  q = jnp.zeros((2, 1, 4, 64), jnp.bfloat16)
  k = jnp.zeros((2, 50, 2, 64), jnp.bfloat16)
  z = jnp.zeros((2,), jnp.int32)
  with pytest.raises(ValueError):
    sp.sparse_attention(q, k, k, jnp.zeros((2, 3, 8), jnp.int32), jnp.zeros((2, 3), jnp.int32),
                        z, z, interpret=True)
  with pytest.raises(ValueError):
    sp.sparse_attention(q, k, k, jnp.zeros((2, 8), jnp.int32), jnp.zeros((2, 2), jnp.int32), z, z,
                        interpret=True)
  with pytest.raises(ValueError):
    sp.sparse_attention(q, k, k, jnp.zeros((2, 8), jnp.int32), z, z[:1], z, interpret=True)


def test_sparse_attention_takes_packed_queries():
  """Queries packed already (`PackedQueries`) give the unpacked call's output, in the kernel and
  in the reference."""
  b, s, t, hq, hkv, d, kk = 3, 64, 2, 6, 2, 32, 12
  q = _normal((b, t, hq, d))
  k, v = _normal((b, s, hkv, d)), _normal((b, s, hkv, d))
  idx = jnp.asarray(np.stack([_RNG.permutation(40)[:kk] for _ in range(b)]), jnp.int32)
  args = (idx, jnp.full((b,), kk, jnp.int32), jnp.full((b,), 40, jnp.int32),
          jnp.array([45, 50, 40], jnp.int32))
  packed = online_softmax.PackedQueries(
      online_softmax.pack_queries(q, hkv, online_softmax.pow2_rows(t * hq // hkv)), t, hq)
  want = sp.sparse_attention(q, k, v, *args, interpret=True)
  got = sp.sparse_attention(packed, k, v, *args, interpret=True)
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
  np.testing.assert_array_equal(
      np.asarray(sp.sparse_attention_reference(packed, k, v, *args), np.float32),
      np.asarray(sp.sparse_attention_reference(q, k, v, *args), np.float32))
  with pytest.raises(ValueError, match="do not hold"):
    sp.sparse_attention(online_softmax.PackedQueries(packed.rows, t + 4, hq), k, v, *args,
                        interpret=True)


def test_verify_attention_takes_packed_queries():
  """Queries packed already give the unpacked call's output and scores; the decode that runs its
  KV heads as one wide head refuses them."""
  b, s, t, hq, hkv, d = 2, 48, 5, 4, 2, 32
  q = _normal((b, t, hq, d))
  k, v = _normal((b, s, hkv, d)), _normal((b, s, hkv, d))
  lengths = jnp.array([20, 41], jnp.int32)
  packed = online_softmax.PackedQueries(online_softmax.pack_queries(q, hkv, 16), t, hq)
  for kw in ({}, dict(score_kind="logits")):
    want = va.verify_attention(q, k, v, lengths, interpret=True, **kw)
    got = va.verify_attention(packed, k, v, lengths, interpret=True, **kw)
    for g, w in zip(got, want):
      if w is not None:
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
  np.testing.assert_array_equal(
      np.asarray(va.verify_attention_reference(packed, k, v, lengths)[0], np.float32),
      np.asarray(va.verify_attention_reference(q, k, v, lengths)[0], np.float32))
  one = online_softmax.PackedQueries(online_softmax.pack_queries(q[:, :1], hkv, 16), 1, hq)
  assert va.runs_heads_as_columns(1, hq, hkv, d, None, False)
  with pytest.raises(ValueError, match="wide head"):
    va.verify_attention(one, k, v, lengths, interpret=True)


# ----------------------------------------------------------------------------------------------
# rope_write

ROPE_WRITE_CASES = [
    # B, T, Hq, Hkv, D, S, qk_norm, lengths (None: random, room for T), dtype
    (3, 1, 12, 2, 64, 40, False, None, jnp.bfloat16),      # a draft step, G = 6
    (2, 3, 6, 3, 32, 16, True, None, jnp.bfloat16),        # three tokens, Hkv = 3, Qwen3's norms
    (2, 2, 4, 2, 16, 8, False, [7, 3], jnp.float32),       # the first's second token past S
    (2, 1, 2, 2, 16, 8, False, [8, 0], jnp.float32),       # a whole write past S, G = 1
]


@pytest.mark.parametrize("b,t,hq,hkv,d,s,norm,lengths,dtype", ROPE_WRITE_CASES)
def test_rope_write(b, t, hq, hkv, d, s, norm, lengths, dtype):
  """The kernel equals the reference: the caches written at lengths + t only (slots past S
  dropped), every other entry unchanged. Rotated rows (queries, keys) agree to one rounding step
  of the dtype: whether x*cos + rotate_half(x)*sin fuses into an FMA is the compiler's choice;
  values (never rotated) and the zero padding are bit for bit."""
  qkv = _normal((b, t, hq + 2 * hkv, d), dtype)
  angles = jnp.asarray(_RNG.uniform(0, 50, (b, t, d)), jnp.float32)
  cos, sin = jnp.cos(angles), jnp.sin(angles)
  k_cache, v_cache = _normal((b, s, hkv, d), dtype), _normal((b, s, hkv, d), dtype)
  lengths = jnp.asarray(_RNG.integers(0, s - t + 1, b) if lengths is None else lengths, jnp.int32)
  norms = dict(q_norm=_normal((d,), dtype), k_norm=_normal((d,), dtype)) if norm else {}
  want = rw.rope_write_reference(qkv, cos, sin, k_cache, v_cache, lengths, num_heads=hq, **norms)
  got = rw.rope_write(qkv, cos, sin, k_cache, v_cache, lengths, num_heads=hq, interpret=True,
                      **norms)
  assert (got[0].t, got[0].num_heads) == (t, hq)
  m_rows = online_softmax.pow2_rows(t * hq // hkv)
  assert got[0].rows.shape == (b, hkv, m_rows, d) and got[0].rows.dtype == dtype
  # One step of the dtype relative, plus an absolute term for sums that cancel.
  step = dict(rtol=2.0 ** -7, atol=1e-5) if dtype == jnp.bfloat16 else dict(rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(np.asarray(got[0].rows, np.float32),
                             np.asarray(want[0].rows, np.float32), **step)
  assert not np.asarray(got[0].rows[:, :, t * hq // hkv:], np.float32).any()   # zero padding
  np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(want[2]))
  for cache, g, w in ((k_cache, got[1], want[1]), (v_cache, got[2], want[2])):
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), **step)
    written = np.zeros((b, s), bool)
    for i in range(b):
      written[i, int(lengths[i]):int(lengths[i]) + t] = True
    np.testing.assert_array_equal(np.asarray(g)[~written], np.asarray(cache)[~written])
    if written.any():   # the new rows differ from the random ones they replace
      assert not np.array_equal(np.asarray(g)[written], np.asarray(cache)[written])


def test_rope_write_is_the_models_rope_and_packing():
  """The reference is what the model's XLA path computes: `apply_rope`, `kv_cache.write`,
  `pack_queries`."""
  from jaxspec.model.kv_cache import write
  from jaxspec.model.rope import apply_rope
  b, t, hq, hkv, d, s = 2, 2, 4, 2, 16, 10
  qkv = _normal((b, t, hq + 2 * hkv, d))
  angles = jnp.asarray(_RNG.uniform(0, 50, (b, t, d)), jnp.float32)
  cos, sin = jnp.cos(angles), jnp.sin(angles)
  cache = _normal((b, s, hkv, d))
  lengths = jnp.array([3, 8], jnp.int32)
  q, k_cache, v_cache = rw.rope_write_reference(qkv, cos, sin, cache, cache, lengths,
                                                num_heads=hq)
  slots = lengths[:, None] + jnp.arange(t)[None]
  np.testing.assert_array_equal(
      np.asarray(q.rows, np.float32),
      np.asarray(online_softmax.pack_queries(apply_rope(qkv[:, :, :hq], cos, sin), hkv, 16),
                 np.float32))
  np.testing.assert_array_equal(
      np.asarray(k_cache, np.float32),
      np.asarray(write(cache, apply_rope(qkv[:, :, hq:hq + hkv], cos, sin), slots), np.float32))
  np.testing.assert_array_equal(np.asarray(v_cache, np.float32),
                                np.asarray(write(cache, qkv[:, :, hq + hkv:], slots), np.float32))


def test_rope_write_bad_shapes():
  qkv = jnp.zeros((2, 1, 8, 16))
  cache = jnp.zeros((2, 10, 2, 16))
  cs = jnp.zeros((2, 1, 16))
  z = jnp.zeros((2,), jnp.int32)
  with pytest.raises(ValueError, match="query heads"):
    rw.rope_write(qkv, cs, cs, cache, cache, z, num_heads=6, interpret=True)
  with pytest.raises(ValueError, match="cos/sin"):
    rw.rope_write(qkv, cs[:, :, :8], cs, cache, cache, z, num_heads=4, interpret=True)
  with pytest.raises(ValueError, match="q_norm"):
    rw.rope_write(qkv, cs, cs, cache, cache, z, num_heads=4, q_norm=jnp.ones(16), interpret=True)


# ----------------------------------------------------------------------------------------------
# swiglu_quant

# (rows, activation columns, block): one chunk; a chunk and the rest in falling powers of two
# (96 = 64 + 32, 200 = 128 + 64 + 8); the 0.5B's 4864 columns in chunks of 1024.
@pytest.mark.parametrize("m,f,block", [(3, 64, 64), (5, 96, 64), (2, 200, 128), (4, 4864, 1024)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_swiglu_quantize(m, f, block, dtype):
  """The kernel's e4m3 values and row scales equal the reference's, but for the odd value on a
  rounding boundary, where the two programs' float32 exp and division may round apart (the
  module's contract): that value is one e4m3 step away, and such values are rare; dequantized
  the kernel's values are SwiGLU within e4m3's rounding (half a step: 2^-4 of a value); no row
  clips, whatever its range."""
  gate_up = _normal((m, 2 * f), jnp.float32) * jnp.exp(jnp.linspace(-8.0, 8.0, m))[:, None]
  gate_up = gate_up.astype(dtype)
  in_scale, w_scale = jnp.float32(0.37), jnp.float32(0.05)
  q, row_scale = sq.swiglu_quantize(gate_up, in_scale, w_scale, block=block, interpret=True)
  want_q, want_scale = sq.swiglu_quantize_reference(gate_up, in_scale, w_scale)
  assert q.shape == (m, f) and q.dtype == sq.FP8 and row_scale.shape == (m,)
  bits = [np.asarray(jax.lax.bitcast_convert_type(v, jnp.uint8)).astype(np.int32)
          for v in (q, want_q)]
  sign, mag = [b >> 7 for b in bits], [b & 0x7F for b in bits]   # e4m3: sign, then magnitude
  apart = bits[0] != bits[1]
  assert np.all(~apart | ((sign[0] == sign[1]) & (np.abs(mag[0] - mag[1]) == 1))), \
      "kernel and reference more than one e4m3 step apart"
  assert apart.sum() <= max(1, apart.size // 100), f"{apart.sum()} of {apart.size} values apart"
  np.testing.assert_allclose(row_scale, want_scale, rtol=1e-6)
  x = gate_up.astype(jnp.float32) * (in_scale * w_scale)
  a = jax.nn.silu(x[:, :f]) * x[:, f:]
  rs = np.asarray(row_scale)[:, None]
  got, a = np.asarray(q, np.float32) * rs, np.asarray(a)
  assert np.abs(np.asarray(q, np.float32)).max(axis=1).tolist() == [448.0] * m   # amax: no clip
  # Half a step: 2^-4 of a normal value, 2^-10 of the row's scale among e4m3's subnormals.
  assert np.all(np.abs(got - a) <= (2 ** -4 * np.abs(a) + 2 ** -10 * rs) * (1 + 1e-6))


def test_swiglu_quantize_keeps_a_zero_row_finite():
  gate_up = _normal((2, 64)).at[1].set(0)
  q, row_scale = sq.swiglu_quantize(gate_up, jnp.float32(1), jnp.float32(1), interpret=True)
  assert np.isfinite(np.asarray(q, np.float32)).all() and not np.asarray(q[1], np.float32).any()
  assert float(row_scale[1]) > 0


def test_swiglu_quantize_bad_shapes():
  with pytest.raises(ValueError, match=r"\[M, 2F\]"):
    sq.swiglu_quantize(jnp.zeros((4, 33)), jnp.float32(1), jnp.float32(1), interpret=True)
  with pytest.raises(ValueError, match="scalars"):
    sq.swiglu_quantize(jnp.zeros((4, 32)), jnp.ones(4), jnp.float32(1), interpret=True)
  with pytest.raises(ValueError, match="power of two"):
    sq.swiglu_quantize(jnp.zeros((4, 32)), jnp.float32(1), jnp.float32(1), block=48,
                       interpret=True)


# ----------------------------------------------------------------------------------------------
# topk_select

_PALLAS_TOPK = dict(method="pallas", interpret=True, block=16)   # 700 = 43 tiles + 12: 3 groups


def _budget(lengths, ratio, min_tokens, k_max):
  """The selection policies' k (clamp(ceil(ratio * len), min_tokens, len), at most k_max), in
  numpy: the kernels take k as given."""
  want = np.ceil(np.float32(ratio) * lengths.astype(np.float32))    # the budget rule is in f32
  return np.minimum(np.minimum(np.maximum(want, min_tokens), lengths), k_max).astype(np.int32)


def _check_topk(idx, ref, k, lengths):
  """idx [B, k_max] from topk_select against the reference's ref, k[b] selected per row."""
  idx, ref = np.asarray(idx), np.asarray(ref)
  for i in range(idx.shape[0]):
    c = k[i]
    assert set(idx[i, :c]) == set(ref[i, :c])        # same set, ties to the lower position
    assert np.all(np.diff(idx[i, :c]) > 0)           # ascending positions
    assert np.all(idx[i, :c] < max(lengths[i], 1))
    assert not idx[i, c:].any()                      # padding is 0
    assert not ref[i, c:].any()


@pytest.mark.parametrize("dtype,method", [(jnp.bfloat16, "threshold"), (jnp.float32, "threshold"),
                                          (jnp.bfloat16, "pallas-d2"), (jnp.bfloat16, "pallas-d4")])
@pytest.mark.parametrize("data", ["normal", "ties", "special"])
def test_topk_select_matches_reference_set(dtype, method, data):
  b, l = 5, 700
  x = _RNG.standard_normal((b, l)).astype(np.float32)
  if data == "ties":
    x = np.round(x * 2)                       # few distinct values: ties across the boundary
  elif data == "special":
    x[:, ::5] = -np.inf
    x[:, 3::11] = np.nan
    x[:, 7] = np.inf
  lengths = np.array([0, 1, 333, l, int(_RNG.integers(1, l))], np.int32)
  k = _budget(lengths, 0.07, 8, 60)
  scores = jnp.asarray(x, dtype)
  knobs = dict(_PALLAS_TOPK, digit=int(method[-1])) if method.startswith("pallas") else {}
  idx = tk.topk_select(scores, jnp.asarray(lengths), jnp.asarray(k), k_max=60, **knobs)
  ref = tk.topk_select_reference(scores, jnp.asarray(lengths), jnp.asarray(k), k_max=60)
  _check_topk(idx, ref, k, lengths)


@pytest.mark.parametrize("method", ["threshold", "pallas"])
def test_topk_select_takes_any_k_per_row(method):
  """k is the caller's: none, one, all of the prefix, k_max, and anything between, per row."""
  b, l, k_max = 6, 300, 120
  scores = jnp.asarray(np.round(_RNG.standard_normal((b, l)) * 3), jnp.bfloat16)   # with ties
  lengths = np.array([300, 300, 50, 50, 200, 7], np.int32)
  k = np.array([0, 120, 50, 1, int(_RNG.integers(2, 120)), 7], np.int32)
  knobs = _PALLAS_TOPK if method == "pallas" else {}
  idx = tk.topk_select(scores, jnp.asarray(lengths), jnp.asarray(k), k_max=k_max, **knobs)
  ref = tk.topk_select_reference(scores, jnp.asarray(lengths), jnp.asarray(k), k_max=k_max)
  _check_topk(idx, ref, k, lengths)
  np.testing.assert_array_equal(np.asarray(idx)[2, :50], np.arange(50))   # k = the whole prefix


def test_topk_select_top_k_method_is_reference():
  scores = _normal((3, 200), jnp.float32)
  lengths = jnp.array([5, 100, 200], jnp.int32)
  k = jnp.asarray(_budget(np.asarray(lengths), 0.1, 2, 20))
  a = tk.topk_select(scores, lengths, k, k_max=20, method="top_k")
  r = tk.topk_select_reference(scores, lengths, k, k_max=20)
  np.testing.assert_array_equal(np.asarray(a), np.asarray(r))
  with pytest.raises(ValueError):
    tk.topk_select(scores, lengths, k, k_max=201)
  with pytest.raises(ValueError):
    tk.topk_select(scores, lengths[:2], k, k_max=20)
  with pytest.raises(ValueError):
    tk.topk_select(scores, lengths, k[:2], k_max=20)


def test_topk_select_pallas_equals_threshold_and_checks_its_input():
  """The kernel and the XLA form return the same array: same positions, same order, zero padding
  (the wide score range of bf16 exercises every digit pass)."""
  x = _RNG.standard_normal((6, 1000)).astype(np.float32) * np.exp(_RNG.uniform(-30, 30, (6, 1)))
  scores = jnp.asarray(x, jnp.bfloat16)
  lengths = jnp.array([1000, 999, 513, 64, 1, 0], jnp.int32)
  k = jnp.asarray(_budget(np.asarray(lengths), 0.3, 16, 300))
  a = tk.topk_select(scores, lengths, k, k_max=300, **_PALLAS_TOPK)
  r = tk.topk_select(scores, lengths, k, k_max=300, method="threshold")
  np.testing.assert_array_equal(np.asarray(a), np.asarray(r))
  with pytest.raises(ValueError, match="bf16"):
    tk.topk_select(scores.astype(jnp.float32), lengths, k, k_max=300, **_PALLAS_TOPK)
  with pytest.raises(ValueError, match="digit"):
    tk.topk_select(scores, lengths, k, k_max=300, **dict(_PALLAS_TOPK, digit=3))
