"""FP8 copies of the MLP weights (`jaxspec.model.fp8`): the products they give, and drafts that
use them while verification keeps the model's weights (greedy output equal to vanilla's)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxspec.engine.config import RunConfig
from jaxspec.engine.runner import Runner, generate
from jaxspec.model import fp8, transformer
from jaxspec.model.attention import Dense
from jaxspec.model.config import ModelConfig
from jaxspec.model.kv_cache import KVCache
from jaxspec.model.transformer import fuse_projections, init_random

CFG = ModelConfig(arch="qwen3", vocab_size=128, hidden_size=64, intermediate_size=96,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=1000.0,
                  qk_norm=True)


def _representable(key, shape, scale):
  """Values e4m3 holds exactly, times a power of two, with every row's and column's amax exactly
  448 * scale (so any scale that is an amax / 448 is that power of two and quantizing loses
  nothing)."""
  grid = jnp.asarray([0, 0.5, 1, 1.5, 2, 3, 4, 6, 8, 12, 16, 24, 32, 448], jnp.float32)
  v = grid[jax.random.randint(key, shape, 0, len(grid) - 1)]
  v = v * jnp.where(jax.random.bernoulli(jax.random.fold_in(key, 1), 0.5, shape), -1, 1)
  return v.at[:, 0].set(448.0).at[0, :].set(-448.0) * scale


@pytest.mark.parametrize("input_bound", [None, 448 * 2.0 ** -4], ids=["row-scales", "bound"])
def test_a_product_of_values_fp8_holds_is_exact(input_bound):
  w = _representable(jax.random.PRNGKey(0), (48, 40), 2.0 ** -9)     # a kernel [in, out]
  x = _representable(jax.random.PRNGKey(1), (6, 48), 2.0 ** -4)
  m = fp8.FP8Matrix(w, input_bound=input_bound)
  assert m.values.dtype == fp8.FP8 and m.values.shape == (40, 48)    # [out, in]
  assert float(m.scale[...]) == 2.0 ** -9
  np.testing.assert_array_equal(m(x), x @ w)


@pytest.mark.parametrize("input_bound", [None, 6.0], ids=["row-scales", "bound"])
def test_a_product_of_random_values_is_close_and_not_exact(input_bound):
  k1, k2 = jax.random.split(jax.random.PRNGKey(2))
  w = 0.02 * jax.random.normal(k1, (256, 192), jnp.float32)
  x = jnp.clip(jax.random.normal(k2, (3, 5, 256), jnp.float32), -6, 6)
  got, want = fp8.FP8Matrix(w, input_bound=input_bound)(x), x @ w
  assert got.shape == want.shape == (3, 5, 192) and got.dtype == x.dtype
  err = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
  assert 0.005 < err < 0.08        # e4m3 keeps 3 mantissa bits: a few percent, never zero


def test_rows_far_outside_e4m3_s_range_keep_their_own_scales():
  """Without a bound each row is scaled by its own amax: rows far past 448 and rows far below
  e4m3's smallest normal in one input neither clip nor vanish (a convert past 448 gives NaN)."""
  w = jnp.eye(32, dtype=jnp.float32)
  x = jax.random.normal(jax.random.PRNGKey(3), (4, 32), jnp.float32)
  x = x * jnp.asarray([1e5, 1e-5, 1.0, 3e3])[:, None]
  got = fp8.FP8Matrix(w)(x)
  assert np.isfinite(got).all()
  np.testing.assert_allclose(got, x, rtol=0.07, atol=0)


@pytest.mark.parametrize("fused", [False, True])
def test_add_fp8_mlps_keeps_the_weights_and_adds_transposed_copies(fused):
  model = init_random(CFG, dtype=jnp.float32, seed=1)
  mlp = model.layers[1].mlp
  gate, up, down = (p.kernel[...] for p in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
  if fused:
    fuse_projections(model)
  assert not fp8.has_fp8_mlps(model)
  assert fp8.add_fp8_mlps(model) is model and fp8.has_fp8_mlps(model)
  first = model.layers[1].mlp.fp8_gate_up
  fp8.add_fp8_mlps(model)                                            # idempotent
  assert model.layers[1].mlp.fp8_gate_up is first
  h, i = CFG.hidden_size, CFG.intermediate_size
  assert first.values.shape == (2 * i, h) and model.layers[1].mlp.fp8_down.values.shape == (h, i)
  # gate/up's input is the RMSNorm's output: bounded by max|weight| * sqrt(hidden) (ones here)
  assert float(first.input_scale[...]) == pytest.approx(np.sqrt(h) / 448)
  assert model.layers[1].mlp.fp8_down.input_scale is None
  dequant = first.values[...].astype(jnp.float32) * first.scale[...]
  np.testing.assert_allclose(dequant, jnp.concatenate([gate, up], -1).T,
                             atol=float(first.scale[...]) * 16)
  params = nnx.to_pure_dict(nnx.state(model))["layers"][1]["mlp"]
  assert ("gate_up_proj" in params) == fused and "down_proj" in params   # the model's own stay
  np.testing.assert_array_equal(model.layers[1].mlp.down_proj.kernel[...], down)


def test_the_norm_s_largest_output_does_not_clip():
  """A row with all its mass in one channel reaches the bound gate/up's fixed input scale is made
  from (|w_j| * sqrt(hidden)); quantized at that scale it is not clipped."""
  model = init_random(CFG, dtype=jnp.float32, seed=6)
  layer = model.layers[0]
  layer.post_attention_layernorm.weight[...] = 1 + jax.random.uniform(
      jax.random.PRNGKey(4), (CFG.hidden_size,))
  fp8.add_fp8_mlps(model)
  j = int(jnp.argmax(layer.post_attention_layernorm.weight[...]))
  h = layer.post_attention_layernorm(1e3 * jax.nn.one_hot(j, CFG.hidden_size)[None])
  scale = float(layer.mlp.fp8_gate_up.input_scale[...])
  assert float(jnp.abs(h).max()) == pytest.approx(scale * 448, rel=1e-5)
  want = h @ jnp.concatenate([layer.mlp.gate_proj.kernel[...], layer.mlp.up_proj.kernel[...]], -1)
  np.testing.assert_allclose(layer.mlp.fp8_gate_up(h), want, rtol=0.07, atol=1e-3)


def _forward(model, tokens, fp8_mlp):
  cache = KVCache.create(model.cfg, tokens.shape[0], 32, jnp.float32)
  hidden, _, _ = model(tokens, cache.chain_positions(tokens.shape[1]), cache, Dense(),
                       fp8_mlp=fp8_mlp)
  return hidden


def test_an_fp8_pass_is_close_to_the_model_s_and_needs_the_copies():
  model = init_random(CFG, dtype=jnp.float32, seed=4)
  tokens = jax.random.randint(jax.random.PRNGKey(0), (2, 12), 0, CFG.vocab_size)
  with pytest.raises(ValueError, match="add_fp8_mlps"):
    _forward(model, tokens, True)
  want = _forward(model, tokens, False)
  fp8.add_fp8_mlps(model)
  np.testing.assert_array_equal(_forward(model, tokens, False), want)   # the copies unused
  got = _forward(model, tokens, True)
  cos = jnp.sum(got * want, -1) / (jnp.linalg.norm(got, axis=-1) * jnp.linalg.norm(want, axis=-1))
  assert float(cos.min()) > 0.999 and not np.array_equal(got, want)


def test_an_fp8_mlp_on_the_kernel_is_the_reference_s():
  """mlp_forward with the SwiGLU kernel (interpret mode) against its pure-JAX form, and both
  against the MLP's own weights: the gate/up product unscaled into the kernel, down's input
  quantized per row."""
  model = init_random(CFG, dtype=jnp.float32, seed=7)
  fp8.add_fp8_mlps(model)
  mlp = model.layers[0].mlp
  x = model.layers[0].post_attention_layernorm(
      jax.random.normal(jax.random.PRNGKey(5), (3, 2, CFG.hidden_size)))
  want = fp8.mlp_forward(mlp.fp8_gate_up, mlp.fp8_down, x, "reference")
  got = fp8.mlp_forward(mlp.fp8_gate_up, mlp.fp8_down, x, "interpret")
  assert got.shape == x.shape and got.dtype == x.dtype
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  exact = mlp(x, None)
  assert float(jnp.linalg.norm(want - exact) / jnp.linalg.norm(exact)) < 0.08
  gate_only = fp8.FP8Matrix(mlp.gate_proj.kernel[...])    # no bound: mlp_forward refuses it
  with pytest.raises(ValueError, match="input bound"):
    fp8.mlp_forward(gate_only, mlp.fp8_down, x, "reference")


def _record_fp8_rows(monkeypatch):
  """The rows each traced FP8 MLP is called with ([..., T, hidden] -> T)."""
  seen = []
  forward = transformer.mlp_forward
  def recording(gate_up, down, x, backend):
    seen.append(x.shape[-2])
    return forward(gate_up, down, x, backend)
  monkeypatch.setattr(transformer, "mlp_forward", recording)
  return seen


@pytest.mark.parametrize("method", ["vegas", "draft"])
def test_fp8_drafts_decode_the_same_greedy_tokens(monkeypatch, method):
  """Only draft steps (one or two tokens a sequence) run the FP8 copies; verification (gamma + 1
  rows) and prefill keep the model's weights, so greedy output is vanilla's."""
  from test_speculative import sharpen
  model = sharpen(init_random(CFG, dtype=jnp.float32, seed=3))
  draft = (sharpen(init_random(dataclasses.replace(CFG, num_layers=1), dtype=jnp.float32, seed=5))
           if method == "draft" else None)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, CFG.vocab_size, n).tolist() for n in (9, 70, 33)]
  want, _ = generate(model, prompts, max_new_tokens=30, cache_dtype=jnp.float32)
  seen = _record_fp8_rows(monkeypatch)
  runner = Runner(model, method=method, gamma=3, sparsity=0.15, min_tokens=4,
                  cache_dtype=jnp.float32, draft_model=draft, fp8_drafts=True)
  drafting = draft if method == "draft" else model
  assert fp8.has_fp8_mlps(drafting)
  assert draft is None or not fp8.has_fp8_mlps(model)    # the target keeps its own only
  got, stats = runner.generate(prompts, max_new_tokens=30)
  assert got == want
  assert seen and max(seen) <= 2
  assert stats.extra["mean_accepted_tokens"] < 4          # some drafts were rejected


def test_fp8_drafts_need_a_speculative_run():
  model = init_random(CFG, dtype=jnp.float32, seed=1)
  with pytest.raises(ValueError, match="fp8_drafts needs a speculative"):
    Runner(model, fp8_drafts=True)
  with pytest.raises(ValueError, match="fp8_drafts needs a speculative"):
    RunConfig(capacity=64, fp8_drafts=True)
  assert not fp8.has_fp8_mlps(model)                       # nothing half-done
