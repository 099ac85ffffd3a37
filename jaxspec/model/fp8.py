"""FP8 (e4m3) copies of the MLP weights, for the passes that draft.

`add_fp8_mlps(model)` gives each layer's MLP an FP8 copy of its gate/up weights (one matrix, gate
then up) and of its down_proj weights, each stored [out, in] with one float32 scale, amax / 448,
beside the model's own weights; a pass called with `fp8_mlp=True` multiplies by the copies. On a
GPU XLA sends each product to cuBLASLt's FP8 GEMM (`__cublas$lt$matmul$f8`), which wants both
operands' contracted axis innermost: hence [out, in].

The inputs are quantized too, and how they are scaled decides whether FP8 pays. cuBLASLt takes
one scale per operand; a scale computed from the whole input costs a two-stage reduction and a
pass of its own, which ate the GEMMs' gain. So:
- gate/up's input is the post-attention RMSNorm's output, whose values are bounded ahead: a
  normalised row has RMS 1, so no entry exceeds sqrt(hidden), and the norm's weight scales it.
  Its scale is that bound over 448, fixed: nothing clips, and the quantizing fuses into the norm.
- down_proj's input (SiLU(gate) * up) has no such bound: each row gets its own scale, its amax
  over 448, applied to the product's row after the GEMM, where XLA fuses it into the residual
  add. On a kernel backend (`mlp_forward`) gate/up's unscaled product goes straight into
  `pallas_kernels.swiglu_quant`, one kernel that scales it, takes SwiGLU, finds each row's amax
  and quantizes, where XLA ran three: 3.7 us a layer-step against 7.2 at the 1.5B's shapes and a
  draft step's 128 rows (H200, RESULTS.md, fifty-third session).
With XLA's three kernels, a norm, MLP and residual at those shapes took 30.8 us on an H200
against 42.1 in bfloat16 (one scale per whole input: 45.0; per-row scales on both inputs: 35.4);
at the 0.5B's 19.5 against 22.0 (RESULTS.md, fiftieth session). q/k/v and o_proj gained nothing
in FP8 (forty-ninth), so they stay in the model's dtype.

Only drafts use the copies (`RunConfig.fp8_drafts`): verification and prefill keep the model's
weights, so speculative sampling's output is the model's own; FP8 can only change how many drafts
are accepted. On random normal weights and inputs at the 1.5B's MLP shapes a product is 3.7% off
the exact one in norm; teacher-forced on a CPU the real 1.5B's drafts accept about 0.5% fewer
tokens a round. What that nets on an H200 (RESULTS.md, fifty-fourth and fifty-fifth sessions, the
real 1.5B at B = 128, each against bf16 drafts in the same session): a round 3.0-5.8% shorter and
decode-only tokens/s 0.7-5.5% higher on workloads (a), (b) and (c); the 0.5B's random-weight round
at 128 x 24K 0.5% shorter. It stays opt-in: the copies take about half the MLP weights' memory
again, which the KV cache could use, and on a CPU FP8 drafts are slower.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels import swiglu_quant
from pallas_kernels.swiglu_quant import FP8, FP8_MAX, fp8_scale
from pallas_kernels.swiglu_quant import quantize as _quantize

if TYPE_CHECKING:   # transformer.py imports this module
  from jaxspec.model.transformer import Transformer


class FP8Matrix(nnx.Module):
  """A weight matrix in FP8: `values` [out, in] e4m3 and its float32 `scale`, amax / 448
  (W ~= values.T * scale).

  input_bound: the most any input entry can be, known ahead; the inputs' scale is then fixed at
  input_bound / 448. None: each input row is scaled by its own amax / 448.
  """

  def __init__(self, kernel: jax.Array, input_bound: float | None = None):
    """From an nnx.Linear kernel [in, out]."""
    kernel = jnp.asarray(kernel, jnp.float32).T
    scale = _scale(kernel)
    self.values = nnx.Param(_quantize(kernel, scale))
    self.scale = nnx.Param(scale)
    self.input_scale = (None if input_bound is None
                        else nnx.Param(jnp.asarray(input_bound / FP8_MAX, jnp.float32)))

  def __call__(self, x: jax.Array) -> jax.Array:
    """x [..., in] -> x @ W [..., out] in x's dtype, x quantized as the class says."""
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k)
    if self.input_scale is None:
      in_scale = _scale(rows, axis=-1)                                    # [M, 1]
    else:
      in_scale = self.input_scale[...]
    # The scales (a row's own, or the fixed one) go on the product, where XLA fuses them into
    # its consumer.
    out = self.product(_quantize(rows, in_scale), x.dtype)
    out = (out.astype(jnp.float32) * (in_scale * self.scale[...])).astype(x.dtype)
    return out.reshape(*lead, out.shape[-1])

  def product(self, q: jax.Array, dtype) -> jax.Array:
    """q [M, in] e4m3 -> the unscaled product q @ values.T [M, out] in `dtype`. The operands are
    widened to `dtype` and multiplied as one dot, which XLA's GPU GEMM rewriter turns into one
    FP8 GEMM."""
    return jax.lax.dot_general(q.astype(dtype), self.values[...].astype(dtype),
                               (((1,), (1,)), ((), ())), preferred_element_type=dtype)


def mlp_forward(gate_up: FP8Matrix, down: FP8Matrix, x: jax.Array, backend: str) -> jax.Array:
  """An MLP on FP8 copies: x [..., hidden] -> down(silu(gate) * up) [..., hidden] in x's dtype.

  x is quantized at gate_up's fixed input scale (XLA fuses that into the norm that made x); the
  unscaled gate/up product goes to `pallas_kernels.swiglu_quant` (its reference on backend
  'reference'), which scales it, takes SwiGLU and quantizes each row by its own amax; that
  row's scale goes on down's product, with the residual add after it in one XLA kernel."""
  if gate_up.input_scale is None:
    raise ValueError("an FP8 MLP's gate/up copy needs its input bound (add_fp8_mlps sets it)")
  lead, h = x.shape[:-1], x.shape[-1]
  in_scale = gate_up.input_scale[...]
  args = (gate_up.product(_quantize(x.reshape(-1, h), in_scale), x.dtype), in_scale,
          gate_up.scale[...])
  if backend == "reference":
    q, row_scale = swiglu_quant.swiglu_quantize_reference(*args)
  else:
    q, row_scale = swiglu_quant.swiglu_quantize(*args, interpret=backend == "interpret")
  out = down.product(q, x.dtype).astype(jnp.float32) * (row_scale[:, None] * down.scale[...])
  return out.astype(x.dtype).reshape(*lead, out.shape[-1])


def _scale(x: jax.Array, axis: int | None = None) -> jax.Array:
  return fp8_scale(jnp.max(jnp.abs(x.astype(jnp.float32)), axis=axis, keepdims=axis is not None))


def add_fp8_mlps(model: Transformer) -> Transformer:
  """Give every layer's MLP FP8 copies of its weights (`fp8_gate_up`, `fp8_down`), in place;
  returns the model. The model's own weights stay, for the passes that do not ask for FP8.
  Idempotent. One device only: a ValueError for a tensor-parallel model."""
  if model.mesh is not None:
    raise ValueError("add_fp8_mlps runs on a one-device model; a tensor-parallel model's MLP "
                     "weights are split across devices")
  root_hidden = math.sqrt(model.cfg.hidden_size)
  for layer in model.layers:
    mlp = layer.mlp
    if hasattr(mlp, "fp8_gate_up"):
      continue
    if hasattr(mlp, "gate_up_proj"):    # fuse_projections
      gate_up = mlp.gate_up_proj.kernel[...]
    else:
      gate_up = jnp.concatenate([mlp.gate_proj.kernel[...], mlp.up_proj.kernel[...]], axis=-1)
    # RMSNorm's output: |w_j * x_j / rms(x)| <= max|w| * sqrt(hidden).
    norm_weight = layer.post_attention_layernorm.weight[...]
    bound = float(jnp.max(jnp.abs(norm_weight.astype(jnp.float32)))) * root_hidden
    mlp.fp8_gate_up = FP8Matrix(gate_up, input_bound=bound)
    mlp.fp8_down = FP8Matrix(mlp.down_proj.kernel[...])
  return model


def has_fp8_mlps(model: Transformer) -> bool:
  """Whether every layer's MLP has its FP8 copies (`add_fp8_mlps`)."""
  return all(hasattr(layer.mlp, "fp8_gate_up") for layer in model.layers)
