"""fuse_projections: q/k/v and gate/up as one GEMM each compute the same function, for every
architecture feature that touches them (Qwen2's q/k/v biases, Qwen3's q/k norms, NSA layers), and
the engine decodes the same tokens with them; on a GPU a one-row projection runs as a two-row
GEMM."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxspec.engine.runner import generate
from jaxspec.model.attention import NSA, Dense, Prefill, ScoreSpec, Sparse
from jaxspec.model.config import ModelConfig, NSAConfig
from jaxspec.model.kv_cache import KVCache
from jaxspec.model.transformer import _project, fuse_projections, init_random

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


@pytest.mark.parametrize("backend", ["gpu", "cpu"])
def test_a_one_row_projection_runs_as_two_rows_on_a_gpu(monkeypatch, backend):
  """XLA's GPU compiler would run a one-row product as an elementwise product and a reduction;
  there `_project` gives the GEMM two rows and returns the first: linear(x)'s values and shape.
  XLA:CPU keeps one row (its two-row bfloat16 GEMMs are the slower)."""
  monkeypatch.setattr(jax, "default_backend", lambda: backend)   # read when the program is traced
  lin = nnx.Linear(8, 5, use_bias=True, rngs=nnx.Rngs(0))
  for shape in [(1, 1, 8), (1, 8), (2, 1, 8), (1, 3, 8)]:
    x = jax.random.normal(jax.random.PRNGKey(shape[-2]), shape)
    np.testing.assert_allclose(_project(lin, x), lin(x), rtol=1e-6, atol=1e-6)
    assert _project(lin, x).shape == shape[:-1] + (5,)
  one_row = jax.jit(lambda x: _project(lin, x)).lower(jnp.ones((1, 1, 8))).as_text()
  assert "dot_general" in one_row
  assert ("tensor<1x2x8xf32>" in one_row) == (backend == "gpu")


CALLS = {   # plan, T new tokens, whether `rope_write` runs
    "draft-step": (lambda lengths, layers, b: Sparse(
        indices=jnp.tile(jnp.array([1, 4, 9, 15], jnp.int32), (layers, b, 1)),
        counts=jnp.full((layers, b), 4, jnp.int32), tail_start=lengths - 3), 1, True),
    "verify-collect2": (lambda *_: Dense(scores=ScoreSpec()), 4, True),
    "verify-tree": (lambda *_: Dense(tree_bits=jnp.array([0b1, 0b11, 0b101], jnp.int32)), 3, True),
    # 4 query rows of head_dim 16: the decode kernel runs its KV heads as one wide head
    "decode-wide-heads": (lambda *_: Dense(), 1, False),
}


@pytest.mark.parametrize("call", list(CALLS))
@pytest.mark.parametrize("cfg", [QWEN3, QWEN2], ids=["qwen3-qk-norm", "qwen2-bias"])
def test_kernel_backends_write_the_cache_in_one_kernel(cfg, call):
  """On the kernel backends draft, verification and decode steps run RoPE, the cache write and
  the query packing as `rope_write` (where their attention kernel takes packed queries): the
  interpret backend gives the reference backend's hidden states, cache and scores, and its
  program holds that kernel once a layer."""
  make_plan, t, fused = CALLS[call]
  model = init_random(cfg, dtype=jnp.float32, seed=1)
  fuse_projections(model)
  b, prompt, cap = 2, 24, 64
  tokens = jax.random.randint(jax.random.PRNGKey(0), (b, prompt), 0, cfg.vocab_size)
  cache = KVCache.create(cfg, b, cap, jnp.float32)
  _, cache, _ = model(tokens, cache.chain_positions(prompt), cache, Prefill())
  cache = cache.replace(lengths=jnp.array([prompt, prompt - 5], jnp.int32))
  plan = make_plan(cache.lengths, cfg.num_layers, b)
  step = tokens[:, -t:]

  def run(backend):
    return model(step, cache.chain_positions(t), cache, plan, backend)

  want_h, want_cache, want_scores = run("reference")
  got_h, got_cache, got_scores = run("interpret")
  np.testing.assert_allclose(got_h, want_h, rtol=1e-5, atol=1e-5)
  for got, want in zip(got_cache.k + got_cache.v, want_cache.k + want_cache.v):
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  if want_scores is not None:
    np.testing.assert_allclose(np.asarray(got_scores, np.float32),
                               np.asarray(want_scores, np.float32), rtol=2e-2, atol=2e-2)
  program = str(jax.make_jaxpr(lambda: run("interpret")[0])())
  assert program.count("name=rope_write\n") == (cfg.num_layers if fused else 0)
  assert "rope_write" not in str(jax.make_jaxpr(lambda: run("reference")[0])())


def test_vegas_decodes_the_same_tokens_on_the_kernels_with_fused_projections():
  """Prefill, draft steps and verification through `rope_write` and the kernels (interpret
  mode): greedy float32 output and acceptance equal the reference backend's."""
  prompts = [list(range(3, 40)), list(range(50, 61))]
  model = fuse_projections(init_random(QWEN3, dtype=jnp.float32, seed=2))
  kw = dict(method="vegas", gamma=3, sparsity=0.3, min_tokens=8, max_new_tokens=16)
  ref, ref_stats = generate(model, prompts, backend="reference", **kw)
  out, stats = generate(model, prompts, backend="interpret", **kw)
  assert out == ref
  assert stats.extra["mean_accepted_tokens"] == ref_stats.extra["mean_accepted_tokens"]


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
