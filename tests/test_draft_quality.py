"""benchmarks.draft_quality: teacher-forced expected acceptance, on a tiny random model."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.draft_quality import (ORACLE, _scoring_label, cache_capacity,
                                      expected_acceptance, expected_tokens, summary)
from jaxspec.drafting.policies import Scoring, make_policy, static_k_max
from jaxspec.engine.sampling import SamplingParams
from jaxspec.model.fp8 import add_fp8_mlps
from jaxspec.model.config import ModelConfig
from jaxspec.model.transformer import init_random
from subproc import run_module

CFG = ModelConfig(arch="qwen3", vocab_size=96, hidden_size=64, intermediate_size=128,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
PAPER = SamplingParams(temperature=0.6, top_k=20, top_p=0.95)
CONTEXT, GAMMA, STRIDE, ROUNDS = 96, 4, 3, 3
CAPACITY = cache_capacity(CONTEXT + ROUNDS * STRIDE + GAMMA + 1)


@pytest.fixture(scope="module")
def setup():
  model = init_random(CFG, dtype=jnp.float32, seed=1)
  n = CONTEXT + ROUNDS * STRIDE + GAMMA + 1
  tokens = jax.random.randint(jax.random.PRNGKey(0), (2, n), 0, CFG.vocab_size, jnp.int32)
  return model, tokens


def _alpha(setup, method, ratio, min_tokens=4, backend="reference", score="logits", score_pool=1,
           score_block=1, score_window=0):
  model, tokens = setup
  oracle = method == ORACLE
  policy = make_policy("vegas" if oracle else method, ratio=ratio, min_tokens=min_tokens,
                       k_max=static_k_max(CAPACITY, ratio, min_tokens),
                       scoring=Scoring(kind=score, pool=score_pool, block=score_block,
                                       window=score_window))
  return expected_acceptance(model, tokens, CONTEXT, policy, gamma=GAMMA, stride=STRIDE,
                             rounds=ROUNDS, sampling=PAPER, backend=backend, oracle=oracle)


@pytest.mark.parametrize("method,ratio", [("dense", 0.07), ("vegas", 1.0), ("streaming", 1.0),
                                          ("quest", 1.0), ("vegas-last", 1.0),
                                          ("specextend", 1.0), (ORACLE, 1.0)])
def test_drafts_that_read_every_key_are_always_accepted(setup, method, ratio):
  """Dense drafting, or a policy keeping every key, drafts with the target's own distributions:
  alpha = 1 at every position, so the rounds' bookkeeping (positions, tails, the drafts' K/V
  overwritten by verification) matches the verification pass exactly."""
  alpha = _alpha(setup, method, ratio)
  assert alpha.shape == (ROUNDS, 2, GAMMA)
  np.testing.assert_allclose(alpha, 1.0, atol=1e-4)
  np.testing.assert_allclose(expected_tokens(alpha), GAMMA + 1, atol=1e-3)


def test_a_small_selection_drafts_other_distributions(setup):
  """Streaming over a few keys of a random model's near-uniform attention: the drafts differ
  from the target, and every alpha is a probability."""
  alpha = _alpha(setup, "streaming", 0.05)
  assert np.all((alpha >= 0) & (alpha <= 1 + 1e-5))
  assert alpha.mean() < 0.999


def test_the_oracle_selects_the_keys_the_drafts_weigh_most(setup):
  """At a budget that bites the oracle's drafts differ from vegas's, and on the kernels
  (interpret mode: the per-row weights' second pass, the sparse draft kernel) the oracle gives
  the reference's alphas."""
  vegas, oracle = (_alpha(setup, m, 0.1) for m in ("vegas", ORACLE))
  assert np.all((oracle >= 0) & (oracle <= 1 + 1e-5)) and oracle.mean() < 0.999
  assert np.abs(oracle - vegas).max() > 1e-4
  np.testing.assert_allclose(_alpha(setup, ORACLE, 0.1, backend="interpret"), oracle, atol=1e-5)


def test_softmax_weights_select_other_keys_than_logits_and_so_draft_other_distributions(setup):
  logits, weights = (_alpha(setup, "vegas", 0.1, score=kind) for kind in ("logits", "weights"))
  assert np.all((weights >= 0) & (weights <= 1 + 1e-5))
  assert np.abs(weights - logits).max() > 1e-4


def test_pooled_scores_select_other_keys_and_so_draft_other_distributions(setup):
  plain, pooled = (_alpha(setup, "vegas", 0.1, score_pool=w) for w in (1, 5))
  assert np.all((pooled >= 0) & (pooled <= 1 + 1e-5))
  assert np.abs(pooled - plain).max() > 1e-4


def test_block_selection_selects_other_keys_and_so_draft_other_distributions(setup):
  plain, blocked = (_alpha(setup, "vegas", 0.1, score_block=n) for n in (1, 4))
  assert np.all((blocked >= 0) & (blocked <= 1 + 1e-5))
  assert np.abs(blocked - plain).max() > 1e-4


def test_a_recent_window_selects_other_keys_and_so_draft_other_distributions(setup):
  plain, windowed = (_alpha(setup, "vegas", 0.1, score_window=w) for w in (0, 4))
  assert np.all((windowed >= 0) & (windowed <= 1 + 1e-5))
  assert np.abs(windowed - plain).max() > 1e-4


@pytest.mark.parametrize("score", ["logits", "weights"])
def test_the_kernels_give_the_references_alphas(setup, score):
  """The rounds on the Pallas kernels (interpret mode: the verification kernel's Collect-2 scores,
  the weights from its stored logits, the sparse draft kernel) give the reference's alphas, in
  float32, at a selection that bites."""
  ref = _alpha(setup, "vegas", 0.1, score=score)
  assert ref.mean() < 0.999
  np.testing.assert_allclose(_alpha(setup, "vegas", 0.1, backend="interpret", score=score), ref,
                             atol=1e-5)


def test_row_labels_name_the_scoring_settings_that_vary():
  runs = [Scoring(kind=kind, block=8) for kind in ("logits", "weights")]
  assert [_scoring_label(s, runs) for s in runs] == [" score logits", " score weights"]
  runs = [Scoring(kind=kind, pool=pool) for kind in ("logits", "weights") for pool in (1, 9)]
  assert _scoring_label(runs[3], runs) == " score weights pool 9"
  assert _scoring_label(runs[0], runs[:1]) == ""
  assert _scoring_label(runs[3], runs, oracle=True) == " pool 9"    # the oracle ranks by weights


def test_fp8_drafts_change_only_the_drafts(setup):
  """Dense drafts with FP8 MLPs: verification keeps the model's weights, so the drafts' q now
  differs from p (alpha below 1), by little (alpha near 1)."""
  model, tokens = setup
  add_fp8_mlps(model)
  policy = make_policy("dense", ratio=0.07, min_tokens=4, k_max=CAPACITY)
  alpha = expected_acceptance(model, tokens, CONTEXT, policy, gamma=GAMMA, stride=STRIDE,
                              rounds=ROUNDS, sampling=PAPER, fp8_mlp=True)
  assert 0.9 < alpha.mean() < 0.9999


def test_expected_tokens_and_the_paired_difference():
  alpha = np.array([[[1.0, 1.0, 0.5], [0.5, 0.5, 0.5]]])        # [rounds, B, gamma]
  np.testing.assert_allclose(expected_tokens(alpha), [[3.5, 1.875]])
  row = summary(alpha, base=np.zeros_like(alpha))
  assert row["expected_tokens"] == pytest.approx((3.5 + 1.875) / 2)
  assert row["diff_from_first"] == pytest.approx((3.5 + 1.875) / 2 - 1.0)
  assert row["alpha_by_position"] == [0.75, 0.75, 0.5]


def test_bad_settings_are_one_line_errors(setup):
  model, tokens = setup
  policy = make_policy("vegas", ratio=0.5, min_tokens=4, k_max=64)
  with pytest.raises(ValueError, match="stride must be in 1..gamma"):
    expected_acceptance(model, tokens, CONTEXT, policy, gamma=GAMMA, stride=GAMMA + 2,
                        rounds=1, sampling=PAPER)
  with pytest.raises(ValueError, match="need"):
    expected_acceptance(model, tokens, CONTEXT, policy, gamma=GAMMA, stride=STRIDE,
                        rounds=ROUNDS + 5, sampling=PAPER)


@pytest.mark.parametrize("args,message", [
    (["--stride=10"], "stride must be in 1..gamma + 1 = 9, got 10"),
    (["--methods=vegas,magic"], "unknown self-drafting methods ['magic']"),
    (["--temperature=0"], "temperature must be > 0"),
    (["--draft_mlp=model,int4"], "--draft_mlp takes model and fp8, got ['model', 'int4']"),
    (["--score=logits,probs"], "--score takes logits and weights, got ['logits', 'probs']"),
    (["--score_pool=1,x"], "--score_pool takes odd positive integers, got 1,x"),
    (["--score_pool=1,4"], "--score_pool: score pool must be an odd positive integer"),
    (["--score_block=1,y"], "--score_block takes positive integers, got 1,y"),
    (["--score_block=8,0"], "--score_block: score block must be a positive integer"),
    (["--score_window=0,z"], "--score_window takes non-negative integers, got 0,z"),
    (["--score_window=0,-8"], "--score_window: score window must be a non-negative integer"),
    (["--backend=pallas"], "--backend=pallas runs the kernels on a GPU; jax's backend here is cpu")])
def test_the_command_refuses_bad_settings_in_one_line(tmp_path, args, message):
  out = tmp_path / "dq.json"
  res = run_module("benchmarks.draft_quality", *args, f"--out={out}", timeout=300)
  assert res.returncode == 1 and message in res.stderr, res.stderr[-1000:]
  assert len(res.stderr.strip().splitlines()) == 1
  assert not out.exists()
