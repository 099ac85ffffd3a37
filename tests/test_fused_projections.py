"""fuse_projections: q/k/v and gate/up as one GEMM each compute the same function, for every
architecture feature that touches them (Qwen2's q/k/v biases, Qwen3's q/k norms, NSA layers), and
the engine decodes the same tokens with them."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxspec.engine.runner import generate
from jaxspec.model.attention import NSA, Dense, Prefill
from jaxspec.model.config import ModelConfig, NSAConfig
from jaxspec.model.kv_cache import KVCache
from jaxspec.model.transformer import fuse_projections, init_random

QWEN3 = ModelConfig(arch="qwen3", vocab_size=128, hidden_size=64, intermediate_size=96,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=1000.0,
                    qk_norm=True)
QWEN2 = dataclasses.replace(QWEN3, arch="qwen2", qk_norm=False, qkv_bias=True)
NSA_CFG = dataclasses.replace(QWEN3, nsa=NSAConfig(compress_block=4, compress_stride=2,
                                                   select_block=8, num_selected=5, window=8))


def _forward(model, tokens, plan):
  cache = KVCache.create(model.cfg, tokens.shape[0], 64, jnp.float32)
  hidden, cache, _ = model(tokens, cache.chain_positions(tokens.shape[1]), cache, plan)
  return hidden, cache


@pytest.mark.parametrize("cfg,plan", [(QWEN3, Dense()), (QWEN2, Prefill()), (NSA_CFG, NSA())],
                         ids=["qwen3-qk-norm", "qwen2-bias", "nsa"])
def test_fused_model_computes_the_same_forward(cfg, plan):
  model = init_random(cfg, dtype=jnp.float32, seed=1)
  if cfg.qkv_bias:   # random init leaves biases at zero: give them values the fusion must keep
    for layer in model.layers:
      for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
        lin.bias[...] = 0.1 * jax.random.normal(jax.random.PRNGKey(7), lin.bias.shape)
  tokens = jax.random.randint(jax.random.PRNGKey(0), (2, 24), 0, cfg.vocab_size)
  want_h, want_cache = _forward(model, tokens, plan)
  assert fuse_projections(model) is model
  fuse_projections(model)   # idempotent
  got_h, got_cache = _forward(model, tokens, plan)
  np.testing.assert_allclose(got_h, want_h, rtol=1e-5, atol=1e-5)
  for got, want in zip(got_cache.k + got_cache.v, want_cache.k + want_cache.v):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  params = nnx.to_pure_dict(nnx.state(model))["layers"][0]
  assert set(params["self_attn"]) >= {"qkv_proj", "o_proj"} and "q_proj" not in params["self_attn"]
  assert set(params["mlp"]) == {"gate_up_proj", "down_proj"}
  width = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
  assert params["self_attn"]["qkv_proj"]["kernel"].shape == (cfg.hidden_size, width)
  assert ("bias" in params["self_attn"]["qkv_proj"]) == cfg.qkv_bias


def test_vegas_decodes_the_same_tokens_with_fused_projections():
  prompts = [list(range(3, 40)), list(range(50, 61))]
  runs = []
  for fused in (False, True):
    model = init_random(QWEN3, dtype=jnp.float32, seed=2)
    if fused:
      fuse_projections(model)
    tokens, _ = generate(model, prompts, method="vegas", gamma=3, sparsity=0.3, min_tokens=8,
                         max_new_tokens=24)
    runs.append(tokens)
  assert runs[0] == runs[1] and all(len(t) == 24 for t in runs[0])


def test_tensor_parallel_model_is_refused():
  model = init_random(QWEN3, dtype=jnp.float32)
  model.mesh = object()   # what jaxspec.model.sharding sets on a sharded model
  with pytest.raises(ValueError, match="one-device model"):
    fuse_projections(model)
  assert hasattr(model.layers[0].self_attn, "q_proj")
