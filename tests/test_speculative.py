"""The self-speculative loop: lossless against vanilla decoding, greedy and sampled, for every method."""
import itertools
import json
import pathlib
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxspec.engine import rejection, tree_acceptance
from jaxspec.drafting import policies as selection
from jaxspec.model.attention import Prefill
from jaxspec.model.config import ModelConfig
from jaxspec.model.kv_cache import KVCache
from jaxspec.model.transformer import init_random
from jaxspec.engine.sampling import SamplingParams, probabilities
from jaxspec.engine.runner import Runner, generate
from jaxspec.engine.speculative import acceptance_summary

METHODS = ("none", *selection.SELF_DRAFTING)

from chi2 import chi2_pvalue

CFG = ModelConfig(arch="qwen3", vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=1000.0)
PROMPT_LENS = (9, 120, 75, 37)
MAX_NEW = 40
MIN_TOKENS = 4
RATIOS = (0.05, 0.15, 0.4)
GAMMAS = (1, 3, 6)
SPARSE = [m for m in METHODS if m not in ("none", "dense")]


def sharpen(model, qk=8.0, other=2.0, head=1.0):
  """Scale a random model's weights so that its attention is peaked and its next token depends on
  specific context tokens. With the default 0.02-std init, attention is near uniform: any subset
  of the context gives nearly the same output, drafts almost never get rejected and the text
  loops, so a losslessness test would pass without exercising rejection."""
  for layer in model.layers:
    for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj):
      lin.kernel[...] = lin.kernel[...] * qk
    for lin in (layer.self_attn.v_proj, layer.self_attn.o_proj, layer.mlp.gate_proj,
                layer.mlp.up_proj, layer.mlp.down_proj):
      lin.kernel[...] = lin.kernel[...] * other
  model.lm_head.kernel[...] = model.lm_head.kernel[...] * head
  return model


@pytest.fixture(scope="module")
def model():
  return sharpen(init_random(CFG, dtype=jnp.float32, seed=3))


@pytest.fixture(scope="module")
def prompts():
  rng = np.random.default_rng(0)
  return [rng.integers(0, CFG.vocab_size, n).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def vanilla(model, prompts):
  out, _ = generate(model, prompts, max_new_tokens=MAX_NEW, cache_dtype=jnp.float32)
  return out


def spec(model, prompts, **kw):
  kw.setdefault("min_tokens", MIN_TOKENS)
  kw.setdefault("max_new_tokens", MAX_NEW)
  kw.setdefault("cache_dtype", jnp.float32)
  return generate(model, prompts, **kw)


# Every method with two of the three gammas, the one left out and the ratio rotating, so that each
# gamma meets most methods and each method several ratios without compiling the full product
# (every case is a compile of its own).
CASES = [(m, g, RATIOS[(i + j) % len(RATIOS)])
         for i, m in enumerate(METHODS[1:]) for j, g in enumerate(GAMMAS)
         if j != i % len(GAMMAS)]


@pytest.mark.parametrize("method, gamma, ratio", CASES)
def test_greedy_equals_vanilla(model, prompts, vanilla, method, gamma, ratio):
  out, stats = spec(model, prompts, method=method, gamma=gamma, sparsity=ratio)
  assert out == vanilla
  by_pos = stats.extra["acceptance_by_position"]
  assert len(by_pos) == gamma
  if method == "dense":
    # Full attention drafts exactly what verification computes: every draft is accepted.
    assert by_pos == [1.0] * gamma
    assert stats.extra["mean_accepted_tokens"] == gamma + 1
  else:
    # The test means something only if drafting saw less than the whole context and got some
    # drafts wrong; those rejected drafts must not have leaked into the output.
    lens = jnp.asarray(PROMPT_LENS)
    assert (selection.budget(lens, ratio, MIN_TOKENS, 10_000) < lens).all()
    assert stats.extra["mean_accepted_tokens"] < gamma + 1
    assert min(by_pos) < 1.0


def test_pooled_scores_keep_greedy_equal_to_vanilla(model, prompts, vanilla):
  out, stats = spec(model, prompts, method="vegas", gamma=GAMMAS[0], sparsity=RATIOS[0],
                    scoring=selection.Scoring(pool=5))
  assert out == vanilla
  assert stats.extra["mean_accepted_tokens"] < GAMMAS[0] + 1   # some drafts were rejected


def test_block_selection_keeps_greedy_equal_to_vanilla(model, prompts, vanilla):
  out, stats = spec(model, prompts, method="vegas", gamma=GAMMAS[0], sparsity=RATIOS[0],
                    scoring=selection.Scoring(block=4))
  assert out == vanilla
  assert stats.extra["mean_accepted_tokens"] < GAMMAS[0] + 1   # some drafts were rejected


def test_a_recent_window_keeps_greedy_equal_to_vanilla(model, prompts, vanilla):
  out, stats = spec(model, prompts, method="vegas", gamma=GAMMAS[0], sparsity=RATIOS[0],
                    scoring=selection.Scoring(window=3))
  assert out == vanilla
  assert stats.extra["mean_accepted_tokens"] < GAMMAS[0] + 1   # some drafts were rejected


def test_acceptance_summary():
  # per sequence, rounds with a = 0, 1, 2, 3 accepted drafts: a = 0, 0, 1, 3 and a = 3
  acc = acceptance_summary(np.array([[2, 1, 0, 1], [0, 0, 0, 1]]))
  assert acc["verify_rounds"] == 5
  assert acc["mean_accepted_tokens"] == (1 + 1 + 2 + 4 + 4) / 5
  assert acc["acceptance_by_position"] == [3 / 5, 2 / 3, 1.0]


def test_none_is_vanilla(model, prompts, vanilla):
  out, _ = spec(model, prompts, method="none", gamma=3, sparsity=0.1, chunk=64)
  assert out == vanilla


def test_a_small_batch_loop_compiles_with_xla_s_triton_gemms(model, prompts, vanilla, monkeypatch):
  """Above SMALL_BATCH sequences the loop's GEMMs are cuBLAS's; up to it XLA's Triton GEMMs stay
  (the faster there on an H200: RESULTS.md, thirty-ninth session). The runner compiles each
  batch's chunk with its own options, and the text does not change (they are ignored on a CPU)."""
  from jaxspec.engine import runner as runner_lib
  small = {"xla_disable_hlo_passes": "rematerialization"}
  assert runner_lib.loop_compiler_options(1) == runner_lib.loop_compiler_options(16) == small
  assert runner_lib.loop_compiler_options(17) == {**small, "xla_gpu_enable_triton_gemm": False}
  monkeypatch.setattr(runner_lib, "SMALL_BATCH", 1)   # two sequences get the large batch's loop
  runner = Runner(model, method="vegas", gamma=3, sparsity=0.15, min_tokens=MIN_TOKENS,
                  cache_dtype=jnp.float32)
  one, _ = runner.generate(prompts[:1], max_new_tokens=MAX_NEW)
  two, _ = runner.generate(prompts[:2], max_new_tokens=MAX_NEW)
  assert one == vanilla[:1] and two == vanilla[:2]
  batch = lambda n: types.SimpleNamespace(cache=types.SimpleNamespace(lengths=np.zeros(n)))
  loops = {runner_lib.chunk_fn(batch(1)), runner_lib.chunk_fn(batch(2))}
  assert len(loops) == 2 and loops <= {key[0] for key in runner._compiled}


def test_stops_ragged_budgets_and_chunks(model, prompts, vanilla):
  stop = vanilla[1][17]     # a token the second sequence emits mid-way
  max_new = [40, 23, 5, 31]
  ref, _ = generate(model, prompts, max_new_tokens=max_new, stop_ids=(stop,),
                    cache_dtype=jnp.float32)
  seen = []
  out, stats = spec(model, prompts, method="vegas", gamma=3, sparsity=0.15, stop_ids=(stop,),
                    max_new_tokens=max_new, chunk=2,
                    on_chunk=lambda tokens, num_new, done: seen.append((num_new.copy(), done.copy())))
  assert out == ref
  assert any(len(o) < n for o, n in zip(out, max_new))            # some sequence stopped early
  assert all(o[-1] == stop or len(o) == n for o, n in zip(out, max_new))
  assert len(seen) >= 3 and seen[-1][1].all()                     # streamed between chunks
  assert stats.new_tokens == sum(map(len, out))   # the token sampled at prefill counts too
  assert stats.decode_tokens == stats.new_tokens - len(out)


def test_profile_rounds_reports_phase_shares(model, prompts):
  runner = Runner(model, method="vegas", gamma=3, sparsity=0.15, min_tokens=MIN_TOKENS,
                  cache_dtype=jnp.float32)
  prof = runner.profile_rounds(prompts, rounds=3, warmup=1)
  shares = [prof[f"{k}_share"] for k in ("draft", "verify", "select")]
  assert all(s > 0 for s in shares) and abs(sum(shares) - 1) < 1e-9
  assert 1 <= prof["mean_accepted_tokens"] <= 4 and len(prof["acceptance_by_position"]) == 3


@pytest.mark.parametrize("kwargs, match", [
    (dict(gamma=0), "gamma"),
    (dict(sparsity=0.0), "sparsity"),
    (dict(sparsity=1.01), "sparsity"),
    (dict(min_tokens=-2), "min_tokens"),
    (dict(method="medusa"), "unknown method"),
    (dict(scoring=dict(pool=9)), "scoring must be a jaxspec.drafting.policies.Scoring"),
])
def test_bad_input_raises(model, kwargs, match):
  args = dict(method="vegas", gamma=3, sparsity=0.1)
  args.update(kwargs)
  with pytest.raises(ValueError, match=match):
    generate(model, [[1, 2, 3]], **args)


# ----------------------------------------------------------------------------------------------
# Sampling: the distribution of the generated tokens is plain sampling's, exactly.

V = 8
SMALL = ModelConfig(arch="llama", vocab_size=V, hidden_size=32, intermediate_size=64, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=1000.0)
N_SEQ, N_NEW = 2000, 4
SAMPLING = SamplingParams(temperature=0.9, top_k=6)
# The benchmarks' default, the paper's; with V = 8 its top-k keeps every token and top-p truncates.
PAPER_SAMPLING = SamplingParams(temperature=0.6, top_k=20, top_p=0.95)


@pytest.fixture(scope="module")
def small():
  model = sharpen(init_random(SMALL, dtype=jnp.float32, seed=1), head=20.0)
  prompt = np.random.default_rng(0).integers(0, V, 24).tolist()
  return model, prompt, exact_distribution(model, prompt)


def exact_distribution(model, prompt, sampling=SAMPLING):
  """P(t_1..t_4 | prompt) under plain sampling, for all V**4 continuations, by the chain rule on
  one teacher-forced forward pass of every V**3 prefix."""
  prefixes = np.array(list(itertools.product(range(V), repeat=N_NEW - 1)), np.int32)
  tokens = np.concatenate([np.tile(prompt, (len(prefixes), 1)), prefixes], axis=1)
  graphdef, params = nnx.split(model)

  @jax.jit
  def probs(params, tokens):
    m = nnx.merge(graphdef, params)
    cache = KVCache.create(SMALL, tokens.shape[0], tokens.shape[1], jnp.float32)
    hidden, _, _ = m(tokens, cache.chain_positions(tokens.shape[1]), cache, Prefill())
    return probabilities(m.logits(hidden[:, len(prompt) - 1:]), sampling)   # [M, N_NEW, V]

  p = np.asarray(probs(params, jnp.asarray(tokens)), np.float64)
  rows = np.arange(len(prefixes))
  joint = np.prod([p[rows, i, prefixes[:, i]] for i in range(N_NEW - 1)], axis=0)
  return (joint[:, None] * p[:, N_NEW - 1]).reshape(-1)


def sequence_counts(samples: np.ndarray, n_cells: int) -> np.ndarray:
  """[N, n] sampled sequences -> how often each of the V**n sequences occurred."""
  cell = np.ravel_multi_index(samples.T, (V,) * samples.shape[1])
  return np.bincount(cell, minlength=n_cells)


def sample_sequences(model, prompt, method, sampling=SAMPLING, **kw):
  common = dict(max_new_tokens=N_NEW, sampling=sampling, seed=1, cache_dtype=jnp.float32)
  if method == "none":
    out, _ = generate(model, [prompt] * N_SEQ, **common)
    return np.array(out), None
  out, stats = generate(model, [prompt] * N_SEQ, method=method, gamma=3, sparsity=0.05,
                        min_tokens=1, **common, **kw)
  return np.array(out), stats


def test_exact_distribution_is_plain_sampling(small):
  model, prompt, probs = small
  assert abs(probs.sum() - 1) < 1e-6
  samples, _ = sample_sequences(model, prompt, "none")
  assert chi2_pvalue(sequence_counts(samples, len(probs)), probs, min_expected=5) > 1e-3


def small_draft_model():
  """A separate random drafter for the tiny-vocabulary model (method 'draft')."""
  cfg = ModelConfig(**{**SMALL.__dict__, "num_layers": 1})
  return sharpen(init_random(cfg, dtype=jnp.float32, seed=2), head=20.0)


@pytest.mark.parametrize("method, fp8_drafts",
                         [("vegas", False), ("draft", False), ("vegas", True)])
def test_speculative_sampling_is_plain_sampling(small, method, fp8_drafts):
  """With FP8 drafts too (`jaxspec.model.fp8`): they change q, never the output's distribution."""
  model, prompt, probs = small
  kw = dict(draft_model=small_draft_model()) if method == "draft" else {}
  samples, stats = sample_sequences(model, prompt, method, fp8_drafts=fp8_drafts, **kw)
  assert stats.extra["acceptance_by_position"][0] < 0.97    # drafts differ from the target
  assert chi2_pvalue(sequence_counts(samples, len(probs)), probs, min_expected=5) > 1e-3


@pytest.mark.parametrize("method", ["vegas", "draft"])
def test_speculative_sampling_at_the_papers_settings_is_plain_sampling(small, method):
  model, prompt, _ = small
  probs = exact_distribution(model, prompt, PAPER_SAMPLING)
  # Top-p leaves some continuations no mass: the test must see a truncated distribution.
  assert (probs == 0).mean() > 0.5
  kw = dict(draft_model=small_draft_model()) if method == "draft" else {}
  samples, stats = sample_sequences(model, prompt, method, PAPER_SAMPLING, **kw)
  assert stats.extra["acceptance_by_position"][0] < 0.97    # drafts differ from the target
  assert chi2_pvalue(sequence_counts(samples, len(probs)), probs, min_expected=5) > 1e-3


@pytest.mark.parametrize("method", ["vegas", "draft"])
def test_a_broken_sampler_fails_the_same_test(small, monkeypatch, method):
  model, prompt, probs = small
  kw = dict(draft_model=small_draft_model()) if method == "draft" else {}
  # Resample rejected positions from p instead of norm(max(0, p - q)). A different (static)
  # chunk makes jit trace the loop again, now with the broken function.
  monkeypatch.setattr(rejection, "residual_distribution", lambda p, q: p)
  samples, _ = sample_sequences(model, prompt, method, chunk=7, **kw)
  jax.clear_caches()                             # leave no compiled broken loop behind
  assert chi2_pvalue(sequence_counts(samples, len(probs)), probs, min_expected=5) < 1e-6


@pytest.mark.parametrize("method, widths", [("vegas", (2, 1, 1)), ("draft", (3, 2, 1))])
def test_tree_sampling_is_plain_sampling(small, method, widths):
  model, prompt, probs = small
  kw = dict(draft_model=small_draft_model()) if method == "draft" else {}
  samples, stats = sample_sequences(model, prompt, method, tree=widths, **kw)
  assert stats.extra["acceptance_by_position"][0] < 0.97
  assert chi2_pvalue(sequence_counts(samples, len(probs)), probs, min_expected=5) > 1e-3


@pytest.mark.parametrize("method, widths", [("vegas", (2, 1, 1)), ("draft", (3, 2, 1))])
def test_siblings_tried_against_the_unchanged_target_fail(small, monkeypatch, method, widths):
  model, prompt, probs = small
  kw = dict(draft_model=small_draft_model()) if method == "draft" else {}
  # A rejected child leaves r as it was: the next sibling (and the correction) is tried against
  # the target's distribution itself, not the residual the rejection left.
  monkeypatch.setattr(tree_acceptance, "_sibling_residual", lambda r, q: r)
  samples, _ = sample_sequences(model, prompt, method, chunk=7, tree=widths, **kw)
  jax.clear_caches()
  assert chi2_pvalue(sequence_counts(samples, len(probs)), probs, min_expected=5) < 1e-6


# ----------------------------------------------------------------------------------------------
# Real weights

AIME25 = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data" / "aime25.jsonl"

@pytest.fixture(scope="module")
def smollm2(weights_smollm2_ckpt):
  # The session's converted checkpoint (the same bfloat16 weights as the demo name's
  # checkpoints/smollm2-135m), not the demo name: that would convert into the repo's checkpoints/
  # from whichever test worker got there, and loading by demo name is tested in test_weights.py.
  from jaxspec.io import loading
  if not AIME25.exists():
    pytest.skip(f"{AIME25} is missing")
  return loading.load_model(weights_smollm2_ckpt, dtype=jnp.float32)


def test_smollm2_greedy_vegas_equals_vanilla(smollm2):
  """Vegas (gamma 6, ratio 0.1) on real weights, a ragged batch of AIME25 prompts. Vegas only: a
  real-weight case costs about a minute of compiling SmolLM2's 30 layers, and the other methods'
  greedy equality is checked on the tiny model above."""
  from jaxspec.io.loading import apply_chat_template
  tok = smollm2.tokenizer
  with open(AIME25) as f:
    problems = [json.loads(line)["problem"] for line in itertools.islice(f, 2)]
  prompts = [tok.encode(apply_chat_template(tok, p), add_special_tokens=False) for p in problems]
  prompts.append(prompts[0][:40])            # a third, much shorter prompt: ragged batch
  ref, _ = generate(smollm2.model, prompts, max_new_tokens=24, cache_dtype=jnp.float32)
  out, stats = generate(smollm2.model, prompts, method="vegas", gamma=6, sparsity=0.1,
                        min_tokens=8, max_new_tokens=24, cache_dtype=jnp.float32)
  assert out == ref
  assert stats.extra["mean_accepted_tokens"] >= 1
