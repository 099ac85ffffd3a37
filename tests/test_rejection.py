"""Speculative sampling as pure functions: the accept/resample output follows p, exactly."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.engine import rejection, sampling
from jaxspec.engine.sampling import SamplingParams, probabilities

from chi2 import chi2_pvalue

V, GAMMA, N = 6, 3, 200_000
verify_drafts = jax.jit(rejection.verify_drafts, static_argnames=("sampling",))


def random_dists(seed):
  rng = np.random.default_rng(seed)
  p = rng.dirichlet(np.ones(V) * 0.7, size=GAMMA + 1)
  q = rng.dirichlet(np.ones(V) * 0.7, size=GAMMA)
  p[0, 5] = 0.0          # a token the target never emits but the draft may propose
  p[0] /= p[0].sum()
  return p.astype(np.float32), q.astype(np.float32)


def run_sampled(p, q, seed=0):
  """N independent rounds with fixed per-position p [gamma+1, V] and q [gamma, V]."""
  k_draft, k_verify = jax.random.split(jax.random.PRNGKey(seed))
  qb = jnp.broadcast_to(jnp.asarray(q), (N, GAMMA, V))
  pb = jnp.broadcast_to(jnp.asarray(p), (N, GAMMA + 1, V))
  drafts = jax.random.categorical(k_draft, jnp.log(qb), axis=-1).astype(jnp.int32)
  # A fresh function object per call: jit caches traces per function, and the broken-sampler test
  # below must trace the monkeypatched residual.
  verdict = jax.jit(lambda *a: rejection.verify_sampled(*a))(k_verify, drafts, qb, pb)
  return np.asarray(drafts), np.asarray(verdict.accepted), np.asarray(verdict.next_token)


def emitted_at(drafts, accepted, next_token, j):
  """Token emitted at round position j (0-based) for the rounds that reach it (accepted >= j)."""
  reach = accepted >= j
  tok = np.where(accepted == j, next_token, drafts[:, min(j, GAMMA - 1)])
  return tok[reach]


def test_each_emitted_position_follows_the_target():
  p, q = random_dists(0)
  drafts, accepted, nxt = run_sampled(p, q)
  for j in range(GAMMA + 1):
    tok = emitted_at(drafts, accepted, nxt, j)
    assert len(tok) > 5_000
    assert chi2_pvalue(np.bincount(tok, minlength=V), p[j].astype(np.float64)) > 1e-3, j


def test_acceptance_rate_is_the_overlap_of_p_and_q():
  p, q = random_dists(1)
  _, accepted, _ = run_sampled(p, q, seed=1)
  overlap = np.minimum(p[:GAMMA], q).sum(-1)     # P(accept draft i) = sum_x min(p, q)
  at_least = np.array([(accepted >= i).mean() for i in range(GAMMA + 1)])
  np.testing.assert_allclose(at_least[1:] / at_least[:-1], overlap, atol=0.01)


def test_skipping_the_residual_is_detected():
  p, q = random_dists(0)
  orig = rejection.residual_distribution
  try:
    rejection.residual_distribution = lambda p, q: p   # resample from p: biased towards q's mass
    drafts, accepted, nxt = run_sampled(p, q)
  finally:
    rejection.residual_distribution = orig
  tok = emitted_at(drafts, accepted, nxt, 0)
  assert chi2_pvalue(np.bincount(tok, minlength=V), p[0].astype(np.float64)) < 1e-6


def test_residual_distribution():
  p = jnp.asarray([[0.5, 0.3, 0.2], [0.2, 0.3, 0.5]])
  q = jnp.asarray([[0.2, 0.3, 0.5], [0.2, 0.3, 0.5]])
  r = np.asarray(rejection.residual_distribution(p, q))
  np.testing.assert_allclose(r[0], [1.0, 0.0, 0.0])
  np.testing.assert_allclose(r[1], [0.2, 0.3, 0.5])      # p == q: no residual mass, fall back to p


def test_leading_true():
  ok = jnp.asarray([[True, True, False], [False, True, True], [True, True, True]])
  np.testing.assert_array_equal(rejection.leading_true(ok), [2, 0, 3])


def test_greedy_is_argmax_agreement():
  target = np.full((3, 4, 5), -1.0, np.float32)
  # argmax of the target per position: seq 0 -> 1 2 3 4, seq 1 -> 0 0 0 0, seq 2 -> 4 3 2 1
  for b, row in enumerate([[1, 2, 3, 4], [0, 0, 0, 0], [4, 3, 2, 1]]):
    target[b, np.arange(4), row] = 1.0
  drafts = jnp.asarray([[1, 2, 3], [0, 1, 0], [4, 3, 2]], jnp.int32)
  v = rejection.verify_greedy(drafts, jnp.asarray(target))
  np.testing.assert_array_equal(v.accepted, [3, 1, 3])
  np.testing.assert_array_equal(v.next_token, [4, 0, 1])   # bonus, correction, bonus


@pytest.mark.parametrize("sp", [SamplingParams(), SamplingParams(temperature=0.7, top_k=1)])
def test_greedy_path_equals_the_general_rule_on_one_hot_probabilities(sp):
  key = jax.random.PRNGKey(3)
  rng = np.random.default_rng(4)
  target = rng.normal(size=(64, GAMMA + 1, 11)).astype(np.float32)
  draft_logits = target[:, :GAMMA] + 0.8 * rng.normal(size=(64, GAMMA, 11)).astype(np.float32)
  drafts = jnp.asarray(draft_logits.argmax(-1), jnp.int32)
  fast = verify_drafts(key, drafts, probabilities(draft_logits, sp), target, sampling=sp)
  general = jax.jit(lambda k, d, ql, pl: rejection.verify_sampled(
      k, d, probabilities(ql, sp), probabilities(pl, sp)))(key, drafts, draft_logits, target)
  np.testing.assert_array_equal(fast.accepted, general.accepted)
  np.testing.assert_array_equal(fast.next_token, general.next_token)
  assert 0 < int(fast.accepted.sum()) < 64 * GAMMA     # both outcomes occur


def test_same_transforms_shape_p_and_q():
  """With top-k 2 the output can only be one of the target's two best tokens, whatever q says."""
  sp = SamplingParams(temperature=1.0, top_k=2)
  b = 4000
  target = jnp.broadcast_to(jnp.asarray([0.0, 3.0, 2.5, 1.0, -1.0]), (b, 2, 5))
  draft_logits = jnp.broadcast_to(jnp.asarray([3.0, 0.0, 2.9, 0.0, 0.0]), (b, 1, 5))
  drafts = jax.random.categorical(jax.random.PRNGKey(0),
                                  jnp.log(probabilities(draft_logits, sp)), -1).astype(jnp.int32)
  v = verify_drafts(jax.random.PRNGKey(1), drafts, probabilities(draft_logits, sp), target,
                    sampling=sp)
  first = np.where(np.asarray(v.accepted) == 1, np.asarray(drafts[:, 0]), np.asarray(v.next_token))
  p = np.asarray(probabilities(target[0, 0], sp), np.float64)
  assert set(np.unique(first)) <= {1, 2}
  assert chi2_pvalue(np.bincount(first, minlength=5), p) > 1e-3


@pytest.mark.parametrize("sp", [SamplingParams(temperature=0.6, top_k=20, top_p=0.95),
                                SamplingParams(temperature=1.0, top_p=0.9),
                                SamplingParams(temperature=0.7, top_k=5),
                                SamplingParams(temperature=1.3)])
def test_verification_from_logits_is_the_dense_rule(sp):
  """`verify_drafts` takes p's thresholds, max and mass per position and builds one row of p per
  sequence; `verify_sampled` takes the whole p. Same keys, same logits (with ties, as bf16 logits
  have): the same verdicts, and the same tokens where the two p agree to float rounding."""
  rng = np.random.default_rng(11)
  b, v = 512, 300
  target = jnp.asarray(np.round(rng.normal(size=(b, GAMMA + 1, v)) * 8) / 4, jnp.float32)
  draft_logits = target[:, :GAMMA] + jnp.asarray(rng.normal(size=(b, GAMMA, v)), jnp.float32)
  key_d, key_v = jax.random.split(jax.random.PRNGKey(12))
  q = probabilities(draft_logits, sp)
  drafts = jax.random.categorical(key_d, jnp.log(q), axis=-1).astype(jnp.int32)
  fast = verify_drafts(key_v, drafts, q, target, sampling=sp)
  dense = jax.jit(rejection.verify_sampled)(key_v, drafts, q, probabilities(target, sp))
  np.testing.assert_array_equal(fast.accepted, dense.accepted)
  np.testing.assert_array_equal(fast.next_token, dense.next_token)
  assert 0 < int(fast.accepted.sum()) < b * GAMMA           # accepts and rejections both occur


def _threshold(row: np.ndarray, sp: SamplingParams) -> float:
  """HF's top-k then top-p on one row in float64: the smallest value kept."""
  srt = -np.sort(-row)
  thr = srt[sp.top_k - 1] if 0 < sp.top_k < len(row) else -np.inf
  if sp.top_p < 1:
    kept = srt[srt >= thr]
    probs = np.exp(kept - kept[0]) / np.exp(kept - kept[0]).sum()
    thr = kept[(np.cumsum(probs) - probs) < sp.top_p].min()
  return thr


@pytest.mark.parametrize("sp", [SamplingParams(temperature=0.6, top_k=20, top_p=0.95),
                                SamplingParams(temperature=1.0, top_k=40, top_p=0.999),
                                SamplingParams(temperature=1.0, top_p=0.9),
                                SamplingParams(temperature=0.7, top_k=5),
                                SamplingParams(temperature=1.3)])
def test_kept_mass_is_the_mass_of_the_entries_at_or_above_the_threshold(sp):
  """`kept_mass` sums a top-p cut above the k-th value over the k largest values only; rows of
  both kinds (a cut above the k-th value and none), ties at the k-th value included, against the
  whole row summed in float64."""
  rng = np.random.default_rng(17)
  # Quarter steps tie as bf16 logits do; the scale spread gives sharp rows (top-p cuts inside the
  # top-k) and flat ones (it keeps all k and their ties).
  logits = np.round(rng.normal(size=(256, 500)) * rng.choice([1.0, 16.0], (256, 1)) * 4) / 4
  x = sampling.scaled(jnp.asarray(logits, jnp.float32), sp)
  thr, m, mass = jax.jit(sampling.kept_mass, static_argnums=1)(x, sp)
  xs = np.asarray(x, np.float64)
  np.testing.assert_array_equal(thr[:, 0], [_threshold(row, sp) for row in xs])
  np.testing.assert_array_equal(m[:, 0], xs.max(-1))
  want = np.where(xs < np.asarray(thr), 0.0, np.exp(xs - xs.max(-1, keepdims=True))).sum(-1)
  np.testing.assert_allclose(mass[:, 0], want, rtol=1e-5)
  if sp.top_k and sp.top_p < 1:
    kth = -np.sort(-xs, axis=-1)[:, sp.top_k - 1]
    cut_inside = np.asarray(thr)[:, 0] > kth
    assert 0 < cut_inside.sum() < len(xs)       # both branches ran
    assert ((xs == kth[:, None]).sum(-1) > 1).any()   # and ties at the k-th value


def test_min_p_verification_takes_the_dense_rule():
  sp = SamplingParams(temperature=0.8, top_k=30, min_p=0.05)
  rng = np.random.default_rng(13)
  target = jnp.asarray(rng.normal(size=(64, GAMMA + 1, 50)) * 2, jnp.float32)
  q = probabilities(target[:, :GAMMA] + 0.5, sp)
  drafts = jnp.argmax(q, axis=-1).astype(jnp.int32)
  key = jax.random.PRNGKey(14)
  got = verify_drafts(key, drafts, q, target, sampling=sp)
  want = rejection.verify_sampled(key, drafts, q, probabilities(target, sp))
  np.testing.assert_array_equal(got.accepted, want.accepted)
  np.testing.assert_array_equal(got.next_token, want.next_token)


def test_sample_with_probs_is_sample_and_probabilities():
  """The draft step's one filtering pass gives the same token as `sample` and the same
  distribution as `probabilities`, which verification used to recompute from the logits."""
  sp = SamplingParams(temperature=0.7, top_k=5, top_p=0.9)
  logits = jnp.asarray(np.random.default_rng(8).normal(size=(16, 50)), jnp.float32)
  key = jax.random.PRNGKey(9)
  tokens, probs = sampling.sample_with_probs(key, logits, sp)
  np.testing.assert_array_equal(tokens, sampling.sample(key, logits, sp))
  np.testing.assert_array_equal(probs, probabilities(logits, sp))
  assert int((probs[0] > 0).sum()) <= 5


def test_draw_follows_the_probabilities_and_never_a_zero():
  """`sampling.draw`, the two-level inverse-transform sampler every token is drawn with: over a
  vocabulary that is not a whole number of blocks, with whole blocks of zeros between the kept
  entries, unnormalised rows, and a row with a single kept entry in its last block."""
  v = 3 * sampling.DRAW_BLOCK + 37
  rng = np.random.default_rng(21)
  probs = np.zeros((2, v), np.float32)
  kept = np.array([0, 5, sampling.DRAW_BLOCK + 1, 3 * sampling.DRAW_BLOCK + 36])   # block 2 empty
  probs[0, kept] = rng.dirichlet(np.ones(len(kept))) * 3.0
  probs[1, v - 1] = 0.25
  n = 100_000
  rows = jnp.broadcast_to(jnp.asarray(probs[0]), (n, v))
  tokens = np.asarray(jax.jit(sampling.draw)(jax.random.PRNGKey(3), rows))
  assert chi2_pvalue(np.bincount(tokens, minlength=v), probs[0] / probs[0].sum()) > 1e-3
  np.testing.assert_array_equal(sampling.draw(jax.random.PRNGKey(4), jnp.asarray(probs[1:])),
                                [v - 1])
  # Leading axes are kept; a row with nothing to draw still gives a token of the vocabulary.
  assert sampling.draw(jax.random.PRNGKey(5), jnp.ones((2, 3, v))).shape == (2, 3)
  assert int(sampling.draw(jax.random.PRNGKey(6), jnp.zeros((1, v)))[0]) < v


TOP_K_SETTINGS = [SamplingParams(temperature=0.6, top_k=20, top_p=0.95),
                  SamplingParams(temperature=0.7, top_k=5),
                  SamplingParams(temperature=0.8, top_k=30, top_p=0.9, min_p=0.05)]


@pytest.mark.parametrize("sp", TOP_K_SETTINGS)
def test_top_k_draft_is_probabilities_where_nothing_ties(sp):
  """`sample_top_k`, what chain drafts draw from: without ties across the k-th logit its
  distribution is `probabilities` itself, and every token it draws has positive probability."""
  v = 700                                       # more than top_k blocks of 128: the two-stage path
  logits = jnp.asarray(np.random.default_rng(5).normal(size=(16, 3, v)) * 3, jnp.float32)
  tokens, q = jax.jit(sampling.sample_top_k, static_argnames="sp")(jax.random.PRNGKey(6),
                                                                   logits, sp)
  assert q.ids.shape == q.probs.shape == (16, 3, sp.top_k) and tokens.shape == (16, 3)
  np.testing.assert_allclose(q.dense(v), probabilities(logits, sp), atol=1e-6)
  assert (q.prob_of(tokens) > 0).all()
  assert sampling.top_k_drafts(sp, v) and not sampling.top_k_drafts(sp, sp.top_k)


def test_top_k_draft_keeps_exactly_k_of_tied_logits():
  """Coarse logits tie across the k-th largest: the whole-row filter keeps every tied entry, the
  top-k draft exactly k distinct tokens, all inside that filter's support, summing to one."""
  sp = SamplingParams(temperature=1.0, top_k=8)
  logits = jnp.round(jax.random.normal(jax.random.PRNGKey(2), (32, 500)))
  _, q = sampling.sample_top_k(jax.random.PRNGKey(3), logits, sp)
  dense = np.asarray(probabilities(logits, sp))
  assert ((dense > 0).sum(-1) > 8).any()                        # ties past the k-th happen here
  ids = np.asarray(q.ids)
  assert all(len(set(r)) == 8 for r in ids.tolist())
  assert (np.take_along_axis(dense, ids, axis=-1) > 0).all()
  np.testing.assert_allclose(np.asarray(q.probs).sum(-1), 1.0, rtol=1e-6)


def test_top_k_draft_verifies_as_its_dense_form_and_follows_the_target():
  """Verification reads a TopK q as it would the same q over the whole vocabulary (identical
  verdicts from one key), and the emitted tokens follow p at every position."""
  rng = np.random.default_rng(7)
  k = 3
  p, _ = random_dists(7)
  ids = np.argsort(-p[:GAMMA], axis=-1)[:, :k].astype(np.int32)    # p's likeliest, [gamma, k]
  probs = rng.dirichlet(np.ones(k), size=GAMMA).astype(np.float32)
  q = sampling.TopK(ids=jnp.broadcast_to(jnp.asarray(ids), (N, GAMMA, k)),
                    probs=jnp.broadcast_to(jnp.asarray(probs), (N, GAMMA, k)))
  k_draft, k_verify = jax.random.split(jax.random.PRNGKey(8))
  j = jax.random.categorical(k_draft, jnp.log(q.probs), axis=-1)
  drafts = jnp.take_along_axis(q.ids, j[..., None], axis=-1)[..., 0]
  pb = jnp.broadcast_to(jnp.asarray(p), (N, GAMMA + 1, V))
  verify = jax.jit(rejection.verify_sampled)
  verdict = verify(k_verify, drafts, q, pb)
  dense = verify(k_verify, drafts, q.dense(V), pb)
  np.testing.assert_array_equal(verdict.accepted, dense.accepted)
  np.testing.assert_array_equal(verdict.next_token, dense.next_token)
  accepted, nxt = np.asarray(verdict.accepted), np.asarray(verdict.next_token)
  for i in range(GAMMA + 1):
    tok = emitted_at(np.asarray(drafts), accepted, nxt, i)
    assert len(tok) > 5_000
    assert chi2_pvalue(np.bincount(tok, minlength=V), p[i].astype(np.float64)) > 1e-3, i
