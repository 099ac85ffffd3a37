"""topp_select (sorting-free top-p) against its sort-based reference, and the reference against a
float64 top-p. One batch of rows covers every case (continuous weights, ties, all-equal rows,
zero rows, special values, a long tail, rows shorter than the cap, rows over it), so each method
compiles once per p. Fresh random weights each run (the seed is in pytest's report: conftest.py)."""
import functools
import os

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import topk_select as tk
from pallas_kernels import topp_select as tp

_RNG = np.random.default_rng(int(os.environ["JAXSPEC_TEST_SEED"]))   # conftest.py
S, K_MAX = 520, 320                   # 520 = 8 blocks of 64 + 8
_PALLAS = dict(method="pallas", interpret=True, block=64)
# row -> (what it is, its length); built by _batch
_ROWS = ["continuous", "continuous short", "ties", "ties short", "all-equal", "all-equal short",
         "zeros", "length 0", "length 1", "special values", "inf", "long tail", "shorter than cap",
         "flat over cap"]
ROW = {name: i for i, name in enumerate(_ROWS)}


@functools.lru_cache(maxsize=None)
def _batch():
  """weights [14, S] f32 (bf16-exact, so both dtypes hold the same values), lengths [14]."""
  w = np.zeros((len(_ROWS), S), np.float32)
  n = np.full(len(_ROWS), S, np.int32)
  w[ROW["continuous"]] = np.exp(2 * _RNG.standard_normal(S))
  w[ROW["continuous short"]] = np.exp(2 * _RNG.standard_normal(S))
  n[ROW["continuous short"]] = _RNG.integers(2, S)
  w[ROW["ties"]] = _RNG.integers(0, 8, S) / 8          # few distinct values: ties at the boundary
  w[ROW["ties short"]] = _RNG.integers(0, 4, S) / 4
  n[ROW["ties short"]] = 333
  w[ROW["all-equal"]] = 0.375                          # p * mass lands on a tie: minimal set
  w[ROW["all-equal short"]] = 0.375
  n[ROW["all-equal short"]] = 100
  w[ROW["length 0"]] = 1.0
  n[ROW["length 0"]] = 0
  w[ROW["length 1"]] = 1.0
  n[ROW["length 1"]] = 1
  x = _RNG.random(S)
  x[::5], x[1::7], x[2::11], x[3] = np.nan, -x[1::7], -0.0, 1e-30   # NaN, negative, -0 count as 0
  w[ROW["special values"]] = x
  w[ROW["inf"]] = _RNG.random(S)
  w[ROW["inf"], 17] = np.inf                           # the largest finite: all the mass
  # One large weight and a tail that p needs, each under max / 1024: too small for 10 halvings
  # of [0, max] to resolve.
  w[ROW["long tail"]] = 1e-3 * _RNG.uniform(0.85, 0.95, S)
  w[ROW["long tail"], 40] = 1.0
  w[ROW["shorter than cap"]] = _RNG.random(S)
  w[ROW["shorter than cap"], 3] = 1e-30                # p = 1 keeps even this one
  n[ROW["shorter than cap"]] = 37
  w[ROW["flat over cap"]] = _RNG.uniform(0.9, 1.0, S)  # top-p needs > K_MAX positions
  w = np.asarray(jnp.asarray(w, jnp.bfloat16).astype(jnp.float32))
  return w, n


def _call(method, p, dtype=jnp.float32):
  """The batch through one method; the reference always in f32 (the batch is bf16-exact)."""
  w, n = _batch()
  knobs = {"threshold": {}, "pallas": _PALLAS, "bisect10": dict(method="bisect10"),
           "reference": None}[method]
  args = (jnp.asarray(w, dtype), jnp.asarray(n))
  if knobs is None:
    out = tp.topp_select_reference(*args, p=p, k_max=K_MAX)
  else:
    out = tp.topp_select(*args, p=p, k_max=K_MAX, **knobs)
  return tuple(map(np.asarray, out))


def _clean(w, n):
  """The weights as the contract reads them: NaN, negative and out-of-prefix -> 0."""
  w = np.where(np.isnan(w) | (w < 0), 0, np.minimum(w, np.finfo(np.float32).max)).astype(np.float64)
  w[np.arange(S) >= n] = 0
  return w


def _check_layout(idx, cnt, n):
  for i, c in enumerate(cnt):
    assert 0 <= c <= min(K_MAX, max(n[i], 0)), (_ROWS[i], c)
    assert np.all(np.diff(idx[i, :c]) > 0), _ROWS[i]          # ascending positions
    assert np.all(idx[i, :c] < n[i]), _ROWS[i]                # inside the prefix
    assert not idx[i, c:].any(), _ROWS[i]                     # padding is 0


@pytest.mark.parametrize("method,dtype,p", [("threshold", jnp.bfloat16, 0.75),
                                            ("threshold", jnp.bfloat16, 1.0),
                                            ("threshold", jnp.float32, 0.75),
                                            ("pallas", jnp.bfloat16, 0.75),
                                            ("pallas", jnp.bfloat16, 1.0)])
def test_topp_select_returns_the_reference_set(method, dtype, p):
  """Exactly the reference's positions and counts on every row (integer masses: no rounding can
  split them), ties, all-equal rows, p = 1 and short rows included; f32 weights search 32-bit
  keys, bf16 16-bit ones."""
  idx, cnt = _call(method, p, dtype)
  ref, ref_cnt = _call("reference", p)
  np.testing.assert_array_equal(cnt, ref_cnt)
  np.testing.assert_array_equal(idx, ref)
  _check_layout(idx, cnt, _batch()[1])


@pytest.mark.parametrize("p", [0.75, 1.0])
def test_reference_is_top_p(p):
  """The reference keeps the first `count` positions of a stable descending order, `count` the
  fewest whose float64 mass reaches p of the row (to the f32 rounding of the target) or K_MAX."""
  w, n = _batch()
  idx, cnt = _call("reference", p)
  for i, name in enumerate(_ROWS):
    row = _clean(w[i], n[i])
    order = np.argsort(-row, kind="stable")
    c = cnt[i]
    assert set(idx[i, :c]) == set(order[:c]), name            # largest first, ties lower first
    total = row.sum()
    if total == 0:
      assert c == 0, name
      continue
    mass = np.cumsum(row[order])
    assert row[order[c - 1]] > 0, name                         # zeros are never kept
    if c < K_MAX:
      assert mass[c - 1] >= p * total * (1 - 1e-6), name       # reaches p ...
    if c > 1:
      assert mass[c - 2] < p * total * (1 + 1e-6), name        # ... and one fewer does not
  positive = [(_clean(w[i], n[i]) > 0).sum() for i in range(len(_ROWS))]
  if p == 1.0:                                                 # every positive weight, capped
    np.testing.assert_array_equal(cnt, np.minimum(positive, K_MAX))
  else:
    assert cnt[ROW["all-equal short"]] == 75                   # ceil(0.75 * 100), the lowest
    np.testing.assert_array_equal(idx[ROW["all-equal short"], :75], np.arange(75))
    assert cnt[ROW["inf"]] == 1 and idx[ROW["inf"], 0] == 17
    assert 1 < cnt[ROW["long tail"]] < 200
  flat = min(int(np.ceil(p * S)), K_MAX)                       # 390, or over the cap at p = 1
  assert cnt[ROW["all-equal"]] == flat                         # the lowest positions
  np.testing.assert_array_equal(idx[ROW["all-equal"], :flat], np.arange(flat))
  assert cnt[ROW["flat over cap"]] == K_MAX
  assert cnt[ROW["length 1"]] == 1 and cnt[ROW["shorter than cap"]] <= 37


def test_over_the_cap_keeps_topk_selects_set():
  """A top-p set longer than k_max is cut to the k_max largest weights: topk_select's set."""
  w, n = _batch()
  idx, cnt = _call("threshold", 0.75)
  k = jnp.minimum(jnp.asarray(n, jnp.int32), K_MAX)     # everything in the prefix, capped
  top = tk.topk_select_reference(jnp.asarray(w), jnp.asarray(n), k, k_max=K_MAX)
  top = np.asarray(top)
  for i in [ROW["flat over cap"]]:
    assert cnt[i] == K_MAX
    assert set(idx[i]) == set(top[i]), _ROWS[i]


def test_bisect10_is_the_papers_approximation():
  """The 10-step float bisection keeps a superset of the exact set holding at least p of the
  mass, and keeps every positive weight when the boundary weight is under max / 1024."""
  w, n = _batch()
  p = 0.75
  idx, cnt = _call("bisect10", p)
  ref, ref_cnt = _call("reference", p)
  _check_layout(idx, cnt, n)
  for i, name in enumerate(_ROWS):
    row = _clean(w[i], n[i])
    if cnt[i] < K_MAX:
      assert set(ref[i, :ref_cnt[i]]) <= set(idx[i, :cnt[i]]), name
      assert row[idx[i, :cnt[i]]].sum() >= p * row.sum() * (1 - 1e-6), name
  tail = ROW["long tail"]
  assert 1 < ref_cnt[tail] < 200 and cnt[tail] == K_MAX       # all 520 positive, capped


def test_topp_select_rejects_bad_input():
  w = jnp.ones((3, 64), jnp.bfloat16)
  n = jnp.full((3,), 64, jnp.int32)
  for p in (0, 0.0, -0.5, 1.0001, 2, float("nan"), "0.9"):
    with pytest.raises(ValueError, match=r"p must be a number in \(0, 1\]"):
      tp.topp_select(w, n, p=p, k_max=8)
  with pytest.raises(ValueError, match=r"p must be"):
    tp.topp_select_reference(w, n, p=1.5, k_max=8)
  with pytest.raises(ValueError, match="expected weights"):
    tp.topp_select(w[0], n, p=0.9, k_max=8)
  with pytest.raises(ValueError, match="expected weights"):
    tp.topp_select(w, n[:2], p=0.9, k_max=8)
  with pytest.raises(ValueError, match="k_max"):
    tp.topp_select(w, n, p=0.9, k_max=65)
  with pytest.raises(ValueError, match="k_max"):
    tp.topp_select(w, n, p=0.9, k_max=0)
  with pytest.raises(ValueError, match="float"):
    tp.topp_select(jnp.ones((3, 64), jnp.int32), n, p=0.9, k_max=8)
  with pytest.raises(ValueError, match="method"):
    tp.topp_select(w, n, p=0.9, k_max=8, method="radix")
  with pytest.raises(ValueError, match="bf16"):
    tp.topp_select(w.astype(jnp.float32), n, p=0.9, k_max=8, **_PALLAS)
  with pytest.raises(ValueError, match="digit"):
    tp.topp_select(w, n, p=0.9, k_max=8, **dict(_PALLAS, digit=3))
  with pytest.raises(ValueError, match="block"):
    tp.topp_select(w, n, p=0.9, k_max=8, **dict(_PALLAS, block=48))
