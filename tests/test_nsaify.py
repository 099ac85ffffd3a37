"""NSA weights that need no training (jaxspec.model.nsaify): a dense model NSA-ified equals the
dense model while a row's whole prefix is inside both its window and its selected blocks, and
differs past that; an NSA checkpoint in fla-org/native-sparse-attention's layout loads; `nsa:SPEC`
loads SPEC NSA-ified."""
import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from jaxspec.io.loading import load_model
from jaxspec.io.weights import WeightsError, flat
from jaxspec.io.weights import hf as hf_weights
from jaxspec.model.attention import Prefill
from jaxspec.model.config import ModelConfig, NSAConfig
from jaxspec.model.kv_cache import KVCache
from jaxspec.model.nsaify import check_gates, nsaify
from jaxspec.model.transformer import init_random

DENSE = ModelConfig(arch="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=1000.0)
SMALL = NSAConfig(compress_block=8, compress_stride=4, select_block=8, num_selected=4, window=16)
WIDE = NSAConfig(compress_block=8, compress_stride=4, select_block=8, num_selected=8, window=64)
T = 48


@functools.partial(jax.jit, static_argnums=0)
def _logits(graphdef, state, tokens, cache):
  m = nnx.merge(graphdef, state)
  hidden, _, _ = m(tokens, cache.chain_positions(tokens.shape[1]), cache, Prefill())
  return m.logits(hidden)


def logits(model, tokens):
  cache = KVCache.create(model.cfg, 1, 64, jnp.float32)
  return np.asarray(_logits(*nnx.split(model), jnp.asarray([tokens], jnp.int32), cache)[0])


@pytest.fixture(scope="module")
def dense():
  return init_random(DENSE, dtype=jnp.float32, seed=3)


@pytest.fixture(scope="module")
def tokens():
  return np.random.default_rng(0).integers(0, DENSE.vocab_size, T).tolist()


def test_nsaified_equals_dense_while_the_prefix_fits(dense, tokens):
  """WIDE: 48 tokens inside a 64-token window and 8 selected blocks of 8: every row is dense. SMALL
  (window 16, 4 blocks of 8): rows 0-15 are dense; rows from 32 on see less than their prefix."""
  want = logits(dense, tokens)
  np.testing.assert_allclose(logits(nsaify(dense, WIDE), tokens), want, atol=2e-5)
  small = logits(nsaify(dense, SMALL), tokens)
  np.testing.assert_allclose(small[:16], want[:16], atol=2e-5)
  assert np.abs(small[32:] - want[32:]).max(-1).min() > 1e-3


def test_nsaify_builds_fixed_gates_and_mean_pooling(dense):
  model = nsaify(dense, SMALL, gates=(0.0, 0.25, 1.0))
  attn = model.layers[1].self_attn
  assert model.cfg == dataclasses.replace(DENSE, nsa=SMALL)
  assert not np.asarray(attn.compress_k[...]).any() and not np.asarray(attn.g_proj.kernel).any()
  gates = jax.nn.sigmoid(jnp.asarray(attn.g_proj.bias).reshape(DENSE.num_heads, 3))
  np.testing.assert_array_equal(np.asarray(gates), np.tile([0.0, 0.25, 1.0], (4, 1)))
  np.testing.assert_array_equal(np.asarray(attn.q_proj.kernel),
                                np.asarray(dense.layers[1].self_attn.q_proj.kernel))


@pytest.mark.parametrize("gates, match", [((0.5, 0.5), "3 numbers"), ((0, 1.5, 0), "in \\[0, 1\\]"),
                                          (("a", 0, 0), "numbers")])
def test_bad_gates(gates, match):
  with pytest.raises(ValueError, match=match) as e:
    check_gates(gates)
  assert "\n" not in str(e.value)


def test_nsaify_refuses_an_nsa_model(dense):
  with pytest.raises(ValueError, match="already has NSA"):
    nsaify(nsaify(dense, SMALL))


def write_hf(path, model, hf_config):
  """`model` as an HF safetensors dir under the names `hf_weights.key_map` gives its config."""
  params = {k: np.asarray(v) for k, v in flat(nnx.to_pure_dict(nnx.state(model))).items()}
  tensors = {}
  for name, (target, fn) in hf_weights.key_map(model.cfg).items():
    if target in params:
      tensors[name] = np.ascontiguousarray(fn(params[target]))   # both maps are involutions
  path.mkdir()
  save_file(tensors, str(path / "model.safetensors"))
  (path / "config.json").write_text(json.dumps(hf_config))
  return tensors


FLA_CONFIG = dict(model_type="nsa", vocab_size=64, hidden_size=32, intermediate_size=64,
                  num_hidden_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=1000.0,
                  block_size=8, block_counts=3, window_size=16, norm_eps=1e-6,
                  tie_word_embeddings=False, eos_token_id=2)


def test_an_fla_nsa_checkpoint_loads(tmp_path, tokens):
  """A random NSA model whose compression is a plain mean and whose gates have no bias, written
  under fla-org/native-sparse-attention's names, loads back to the same logits."""
  cfg = ModelConfig.from_hf(FLA_CONFIG)
  assert cfg.nsa == NSAConfig(compress_block=8, compress_stride=8, select_block=8,
                              num_selected=3, window=16)
  model = init_random(cfg, dtype=jnp.float32, seed=5)
  for layer in model.layers:
    attn = layer.self_attn
    attn.compress_k[...] = jnp.zeros_like(attn.compress_k[...])
    attn.compress_v[...] = jnp.zeros_like(attn.compress_v[...])
    attn.g_proj.bias[...] = jnp.zeros_like(attn.g_proj.bias[...])
  tensors = write_hf(tmp_path / "fla", model, FLA_CONFIG)
  assert {"model.embeddings.weight", "model.layers.1.attn.g_proj.weight",
          "model.layers.0.mlp_norm.weight"} <= set(tensors)
  loaded = load_model(tmp_path / "fla", dtype=jnp.float32)
  assert loaded.cfg == cfg
  np.testing.assert_array_equal(logits(loaded.model, tokens), logits(model, tokens))


def test_an_fla_config_without_its_shape_is_one_line():
  with pytest.raises(ValueError, match="no 'num_heads'") as e:
    ModelConfig.from_hf({k: v for k, v in FLA_CONFIG.items() if k != "num_heads"})
  assert "\n" not in str(e.value)


def test_nsa_spec_loads_the_dense_model_nsaified(tmp_path, dense, tokens):
  write_hf(tmp_path / "dense", dense, dict(
      model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
      rope_theta=1000.0, rms_norm_eps=1e-6, tie_word_embeddings=False))
  loaded = load_model(f"nsa:{tmp_path / 'dense'}", dtype=jnp.float32)
  assert loaded.cfg.nsa == NSAConfig()
  want = logits(nsaify(dense), tokens)   # the defaults: a 512 window, so the dense logits too
  np.testing.assert_allclose(logits(loaded.model, tokens), want, atol=1e-6)
  np.testing.assert_allclose(want, logits(dense, tokens), atol=2e-5)
  with pytest.raises(WeightsError, match="no such checkpoint"):
    load_model(f"nsa:{tmp_path / 'absent'}")
