"""Bad arguments to the Python API: one ValueError naming the argument, before anything runs."""
import dataclasses

import jax.numpy as jnp
import pytest

from jaxspec import requests
from jaxspec.engine.runner import Runner, generate
from jaxspec.engine.state import make_batch
from jaxspec.io.loading import load_model
from jaxspec.model.config import ModelConfig, RopeScaling
from jaxspec.model.transformer import init_random

CFG = ModelConfig(arch="llama", vocab_size=50, hidden_size=32, intermediate_size=64, num_layers=1,
                  num_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=64,
                  eos_token_ids=(7,))


@pytest.fixture(scope="module")
def model():
  return init_random(CFG, dtype=jnp.float32)


def vegas(model, prompts, **kw):
  return generate(model, prompts, method="vegas", gamma=2, sparsity=0.5, min_tokens=4,
                  **{"cache_dtype": jnp.float32, **kw})


BAD_CALLS = [
    (dict(chunk=0), r"chunk\w* must be an integer >= 1, got 0"),   # used to hang: zero-step chunks
    (dict(chunk=2.5), r"chunk\w* must be an integer"),
    (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1, got 0"),
    (dict(max_new_tokens=4.5), "max_new_tokens must be an integer >= 1 or one per prompt, got 4.5"),
    (dict(max_new_tokens=True), "max_new_tokens must be an integer"),
    (dict(max_new_tokens=[4, 4, 4]), "max_new_tokens has 3 entries for 1 prompts"),
    (dict(max_new_tokens=[0]), r"max_new_tokens\[0\] must be an integer >= 1"),
    (dict(prompts=[[1, 50, 2]]),
     r"prompts\[0\]\[1\] = 50 is not a token id of this model \(ids are \[0, 50\)\)"),
    (dict(prompts=[[1, -3]]), r"prompts\[0\]\[1\] = -3 is not a token id"),
    (dict(prompts=[[1.0, 2.0]]), r"prompts\[0\] must hold integer token ids, got float64"),
    (dict(prompts=[[True, False]]), r"prompts\[0\] must hold integer token ids, got bool"),
    (dict(prompts=[[1], []]), r"prompts\[1\] must be a non-empty list"),
    (dict(prompts=[]), "prompts is empty"),
    (dict(prompts=["hello"]), r"prompts\[0\] is a string; encode it"),
    (dict(stop_ids=[99]), r"stop_ids must be token ids in \[0, 50\), got 99"),
    (dict(cache_dtype=jnp.int8), "cache_dtype must be a floating-point dtype .* got int8"),
    (dict(max_len=65), "max_len=65 exceeds the model's context of 64 tokens"),
    (dict(prompts=[[1] * 64]), "the prompt of 64 tokens exceeds the model's context of 64 tokens"),
]


@pytest.mark.parametrize("kwargs, match", BAD_CALLS)
def test_generate_names_the_bad_argument(model, kwargs, match):
  kwargs = dict(kwargs)
  prompts = kwargs.pop("prompts", [[1, 2, 3]])
  for run in (generate, vegas):
    with pytest.raises(ValueError, match=match):
      run(model, prompts, **kwargs)


def test_profile_rounds_counts(model):
  for kwargs, match in [(dict(rounds=0), "rounds must be an integer >= 1"),
                        (dict(warmup=-1), "warmup must be an integer >= 0")]:
    with pytest.raises(ValueError, match=match):
      Runner(model, method="vegas", gamma=2, sparsity=0.5).profile_rounds([[1, 2, 3]], **kwargs)


def test_make_batch_checks_its_own_arguments():
  with pytest.raises(ValueError, match=r"max_new_tokens has 2 entries for 3 prompts"):
    make_batch([[1], [2], [3]], [4, 4])
  with pytest.raises(ValueError, match=r"prompts\[0\] must hold integer token ids"):
    make_batch([[0.5]], 4)


def test_context_is_the_model_s_unless_rope_scaling_extends_it():
  # Default max_len stops at the context instead of allocating past it.
  assert requests.check_context(60, None, 100, CFG) == 64
  assert requests.check_context(10, None, 20, CFG) == 30
  yarn = dataclasses.replace(CFG, rope_scaling=RopeScaling(
      kind="yarn", factor=4.0, original_max_position_embeddings=64))
  assert requests.context_limit(yarn) == 256
  assert requests.check_context(10, 200, 20, yarn) == 200
  with pytest.raises(ValueError, match="max_len=300 exceeds the model's context of 256 tokens "
                                       "with its RoPE scaling"):
    requests.check_context(10, 300, 20, yarn)


def test_generation_stops_at_the_model_s_eos_by_default(model):
  # Which tokens a random model emits is arbitrary: take its first one as the EOS id.
  first = generate(model, [[1, 2, 3]], max_new_tokens=1, cache_dtype=jnp.float32)[0][0][0]
  m = init_random(dataclasses.replace(CFG, eos_token_ids=(first,)), dtype=jnp.float32)
  out, stats = generate(m, [[1, 2, 3]], max_new_tokens=8, cache_dtype=jnp.float32)
  assert out == [[first]] and stats.new_tokens == 1
  out, _ = generate(m, [[1, 2, 3]], max_new_tokens=8, stop_ids=(), cache_dtype=jnp.float32)
  assert len(out[0]) == 8


def test_load_model_refuses_an_integer_dtype(tmp_path):
  with pytest.raises(ValueError, match="dtype must be a floating-point dtype .* got int8"):
    load_model(tmp_path, dtype=jnp.int8)
