"""The vanilla decode loop: cached decoding vs full forward, batching, sampling, stops, errors."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.model.attention import Dense, Prefill
from jaxspec.model.config import ModelConfig
from jaxspec.engine.runner import Runner
from jaxspec.engine.state import bucket, make_batch, prompt_bucket
from jaxspec.model.kv_cache import KVCache
from jaxspec.model.transformer import init_random
from jaxspec.engine.sampling import (SamplingParams, filter_logits, sample_draft, top_k_entries,
                                     top_k_values)

CFG = ModelConfig(arch="qwen3", vocab_size=97, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True, rope_theta=1000.0)


@pytest.fixture(scope="module")
def model():
  return init_random(CFG, dtype=jnp.float32, seed=3)


def full_logits(model, tokens):
  """Logits of one sequence from a single full-sequence forward pass."""
  t = jnp.asarray([tokens], jnp.int32)
  cache = KVCache.create(CFG, 1, len(tokens), jnp.float32)
  hidden, _, _ = model(t, cache.chain_positions(len(tokens)), cache, Prefill())
  return np.asarray(model.logits(hidden)[0])


_RUNNERS = {}


def gen(model, prompts, *, max_new_tokens, max_len=None, seed=0, chunk=5, **settings):
  """Vanilla decoding; one Runner (so one set of compiled loops) per model and settings."""
  settings.setdefault("cache_dtype", jnp.float32)
  key = (id(model), tuple(sorted((k, str(v)) for k, v in settings.items())))
  if key not in _RUNNERS:
    _RUNNERS[key] = Runner(model, **settings)
  return _RUNNERS[key].generate(prompts, max_new_tokens=max_new_tokens, max_len=max_len,
                                seed=seed, chunk=chunk)


def test_cached_decoding_matches_full_forward(model):
  prompt = [5, 17, 3, 88, 41, 9, 60]
  out, stats = gen(model, [prompt], max_new_tokens=12)
  assert len(out[0]) == 12 and stats.new_tokens == 12 and stats.decode_tokens == 11
  logits = full_logits(model, prompt + out[0])
  # Every greedy token is the argmax of the full forward at the previous position.
  np.testing.assert_array_equal(logits[len(prompt) - 1:-1].argmax(-1), out[0])


def test_step_logits_match_full_forward(model):
  tokens = [5, 17, 3, 88, 41, 9, 60, 2, 71]
  ref = full_logits(model, tokens)
  cache = KVCache.create(CFG, 1, 16, jnp.float32)
  hidden, cache, _ = model(jnp.asarray([tokens[:4]]), cache.chain_positions(4), cache, Prefill())
  steps = [np.asarray(model.logits(hidden[0, -1]))]
  cache = cache.replace(lengths=cache.lengths + 4)
  for t in tokens[4:-1]:
    hidden, cache, _ = model(jnp.asarray([[t]]), cache.chain_positions(1), cache, Dense())
    cache = cache.replace(lengths=cache.lengths + 1)
    steps.append(np.asarray(model.logits(hidden[0, 0])))
  np.testing.assert_allclose(np.stack(steps), ref[3:-1], rtol=1e-4, atol=1e-4)


def test_batch_of_different_lengths_equals_each_alone(model):
  prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [30]]
  max_new = [6, 9, 4]
  together, _ = gen(model, prompts, max_new_tokens=max_new)
  for p, n, got in zip(prompts, max_new, together):
    alone, _ = gen(model, [p], max_new_tokens=n)
    assert alone[0] == got
    assert len(got) == n


def test_seeded_sampling_is_reproducible(model):
  sp = SamplingParams(temperature=1.0, top_p=0.95)
  a, _ = gen(model, [[1, 2, 3]] * 4, max_new_tokens=10, sampling=sp, seed=7)
  b, _ = gen(model, [[1, 2, 3]] * 4, max_new_tokens=10, sampling=sp, seed=7)
  c, _ = gen(model, [[1, 2, 3]] * 4, max_new_tokens=10, sampling=sp, seed=8)
  assert a == b
  assert a != c
  assert len({tuple(x) for x in a}) > 1  # rows of one batch draw different samples


def test_top_k_one_equals_greedy(model):
  greedy, _ = gen(model, [[9, 8, 7]], max_new_tokens=10)
  topk1, _ = gen(model, [[9, 8, 7]], max_new_tokens=10,
                 sampling=SamplingParams(temperature=1.3, top_k=1), seed=5)
  assert greedy == topk1


def test_stop_token_ends_sequence_and_is_kept(model):
  out, _ = gen(model, [[5, 17, 3]], max_new_tokens=12)
  stop = out[0][4]
  first = out[0].index(stop)
  stopped, _ = gen(model, [[5, 17, 3], [1, 2]], max_new_tokens=12, stop_ids=[stop])
  assert stopped[0] == out[0][:first + 1]


def test_cache_full_stops_generation(model):
  # max_len caps prompt + new tokens per sequence.
  out, _ = gen(model, [[1, 2, 3], [4] * 12], max_new_tokens=500, max_len=20)
  assert [len(o) for o in out] == [17, 8]


def test_filter_logits_definitions():
  logits = jnp.log(jnp.asarray([[0.5, 0.2, 0.15, 0.1, 0.05]]))
  kept = lambda sp: np.isfinite(np.asarray(filter_logits(logits, sp)))[0].tolist()
  assert kept(SamplingParams(1.0, top_k=2)) == [True, True, False, False, False]
  # Smallest top set with mass >= 0.8: 0.5 + 0.2 + 0.15.
  assert kept(SamplingParams(1.0, top_p=0.8)) == [True, True, True, False, False]
  assert kept(SamplingParams(1.0, top_p=0.7)) == [True, True, False, False, False]
  # min_p keeps p >= 0.25 * 0.5.
  assert kept(SamplingParams(1.0, min_p=0.25)) == [True, True, True, False, False]


@pytest.mark.parametrize("shape, k", [((3, 4, 1000), 20), ((2, 151936), 20), ((5, 129), 7),
                                      ((2, 100), 20), ((2, 4000), 200)])
def test_top_k_values_equals_lax_top_k(shape, k):
  # Coarse values: many ties, also across the block boundaries the fast path works with.
  x = jnp.round(jax.random.normal(jax.random.PRNGKey(k), shape) * 4) / 2
  x = x.at[..., 7].set(-jnp.inf).at[..., -1].set(jnp.inf)
  np.testing.assert_array_equal(top_k_values(x, k), jax.lax.top_k(x, k)[0])
  # The indices point at those values, k distinct entries of each row.
  values, idx = top_k_entries(x, k)
  np.testing.assert_array_equal(jnp.take_along_axis(x, idx, axis=-1), values)
  rows = np.asarray(idx).reshape(-1, k)
  assert all(len(set(r)) == k for r in rows.tolist())


@pytest.mark.parametrize("top_k, top_p", [(3, 0.5), (5, 0.9), (8, 0.99), (40, 0.7)])
def test_top_p_after_top_k_matches_full_sort(top_k, top_p):
  # The top-k + top-p path cuts among the k values only; it must keep exactly what top-k followed
  # by the full-vocabulary top-p keeps, ties with the k-th value included (coarse values force
  # many ties).
  logits = jnp.round(jax.random.normal(jax.random.PRNGKey(top_k), (6, 4, 50)) * 3) / 2
  both = filter_logits(logits, SamplingParams(1.0, top_k=top_k, top_p=top_p))
  after_k = filter_logits(logits, SamplingParams(1.0, top_k=top_k))
  reference = filter_logits(after_k, SamplingParams(1.0, top_p=top_p))
  np.testing.assert_array_equal(np.isfinite(both), np.isfinite(reference))
  assert np.isfinite(np.asarray(both)).sum(-1).min() >= 1


@pytest.mark.parametrize("sp", [SamplingParams(0.6, top_k=20, top_p=0.95), SamplingParams(0.8)],
                         ids=["top-k pairs", "whole rows"])
def test_drafts_sample_the_heads_bf16_rows_as_their_float32_values(sp):
  # The draft chain samples from the LM head's own bf16 rows, not a float32 copy of them: every
  # bf16 value is a float32 one, so the tokens and the distributions must be the same.
  model = init_random(CFG, dtype=jnp.bfloat16, seed=4)
  hidden = jax.random.normal(jax.random.PRNGKey(1), (5, CFG.hidden_size), jnp.bfloat16)
  rows = model.logits(hidden, dtype=None)
  assert rows.dtype == jnp.bfloat16 and model.logits(hidden).dtype == jnp.float32
  key = jax.random.PRNGKey(2)
  got, want = sample_draft(key, rows, sp), sample_draft(key, rows.astype(jnp.float32), sp)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=-1.0), "temperature"),
    (dict(top_k=-2), "top_k"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(min_p=1.0), "min_p"),
])
def test_invalid_sampling_values(kwargs, match):
  with pytest.raises(ValueError, match=match):
    SamplingParams(**kwargs)


def test_prompts_pad_to_eight_lengths_a_power_of_two():
  # Powers of two up to 128 tokens; past that, multiples of max(128, next power of two / 16).
  lens = (1, 17, 128, 129, 300, 1025, 16385, 24577, 32768)
  assert [prompt_bucket(n) for n in lens] == [16, 32, 128, 256, 384, 1152, 18432, 26624, 32768]
  assert [prompt_bucket(n, 1) for n in lens] == [bucket(n) for n in lens]
  for n in range(1, 70000, 97):
    padded = prompt_bucket(n)
    assert n <= padded <= bucket(n) and (n <= 1024 or padded - n < n / 8)
  assert make_batch([[1] * 300], 4).prompts.shape == (1, 384)
  assert make_batch([[1] * 300], 4, prompt_buckets=1).prompts.shape == (1, 512)
  for bad in (0, 3, 12):
    with pytest.raises(ValueError, match="prompt_buckets must be a power of two >= 1"):
      prompt_bucket(5, bad)


def test_a_prompt_padded_less_decodes_the_same_tokens(model):
  prompt = np.random.default_rng(1).integers(0, CFG.vocab_size, 300).tolist()
  fine, _ = gen(model, [prompt], max_new_tokens=6)                      # 384 rows prefilled
  coarse, _ = gen(model, [prompt], max_new_tokens=6, prompt_buckets=1)  # 512 rows
  assert fine == coarse and len(fine[0]) == 6
  with pytest.raises(ValueError, match=r"prompt_buckets must be a power of two >= 1 .*, got 3$"):
    Runner(model, prompt_buckets=3)


def test_bad_batches():
  with pytest.raises(ValueError, match="max_len"):
    make_batch([[1] * 30], 4, max_len=30)
  with pytest.raises(ValueError, match=r"prompts\[1\] must be a non-empty list"):
    make_batch([[1], []], 4)
  with pytest.raises(ValueError, match="max_new_tokens"):
    make_batch([[1]], 0)
