"""An FP8 MLP's middle: SwiGLU of the gate/up product, quantized to e4m3 per row for down_proj.

Shapes:
  gate_up       [M, 2F]   the gate/up product as the FP8 GEMM returns it (gate columns, then
                          up), before its scale
  input_scale   []        float32, the scale of the GEMM's quantized input
  weight_scale  []        float32, the scale of its FP8 weights
Returns (q, row_scale):
  q          [M, F] float8_e4m3fn  a = silu(gate * scale) * (up * scale), scale = input_scale *
                                   weight_scale, divided by its row's scale and rounded to e4m3
                                   (nearest even)
  row_scale  [M] float32           each row's max |a| / 448 (at least float32's tiny), so that
                                   a ~= q * row_scale and nothing clips

Why a kernel: XLA ran the same as three kernels a layer-step (SiLU x up with the scale, the row
amax, the quantizing convert), each reading the activations again: 7.2 us a layer-step in a
draft step of the 1.5B at B = 128 (H200, RESULTS.md, fifty-third session). Here one program a
row loads its gate and up columns once, in chunks of at most `block` columns unrolled at trace
time (the rest in falling powers of two, so no load needs a mask), keeps the activations in
registers for the row's amax, and stores them quantized.

`swiglu_quantize` is the kernel (Pallas Triton; `interpret=True` on the CPU),
`swiglu_quantize_reference` the same computation in plain JAX. Both compute in float32 with
silu(g) = g / (1 + exp(-g)); exp and the division may round differently on a GPU, so their e4m3
values could differ by one step where a value falls on a rounding boundary (on an H200 they
were equal at the 1.5B's and 0.5B's shapes).

Latest measured (H200, jax 0.11.2, benchmarks/RESULTS.md, fifty-third session): 3.8 us for 128
rows of the 1.5B's 8960 columns (16 warps, chunks of 8192), 2.9 us for the 0.5B's 4864, with
the input in L2 as it is after its GEMM.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0     # e4m3's largest finite value; a convert past it gives NaN, not infinity


def _check(gate_up, input_scale, weight_scale):
  if gate_up.ndim != 2 or gate_up.shape[1] % 2:
    raise ValueError(f"gate_up must be [M, 2F], got {gate_up.shape}")
  if jnp.shape(input_scale) != () or jnp.shape(weight_scale) != ():
    raise ValueError(f"the scales must be scalars, got shapes {jnp.shape(input_scale)} and "
                     f"{jnp.shape(weight_scale)}")


def _swiglu(g, u, scale):
  """silu(g * scale) * (u * scale), float32."""
  g = g.astype(jnp.float32) * scale
  return g / (1.0 + jnp.exp(-g)) * (u.astype(jnp.float32) * scale)


def fp8_scale(amax: jax.Array) -> jax.Array:
  """The e4m3 scale of values whose largest magnitude is amax: amax / 448, at least float32's
  tiny (clamped after the division: tiny / 448 is subnormal, which XLA flushes to 0, and 0 / 0
  is NaN)."""
  return jnp.maximum(amax / FP8_MAX, jnp.finfo(jnp.float32).tiny)


def quantize(x: jax.Array, scale: jax.Array) -> jax.Array:
  """x / scale in e4m3, rounded to nearest even, clipped to +-448 (a convert past it is NaN)."""
  return jnp.clip(x.astype(jnp.float32) / scale, -FP8_MAX, FP8_MAX).astype(FP8)


def swiglu_quantize_reference(gate_up: jax.Array, input_scale: jax.Array,
                              weight_scale: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Plain JAX: SwiGLU in float32, each row's amax, the quantized row."""
  _check(gate_up, input_scale, weight_scale)
  f = gate_up.shape[1] // 2
  scale = jnp.asarray(input_scale, jnp.float32) * jnp.asarray(weight_scale, jnp.float32)
  a = _swiglu(gate_up[:, :f], gate_up[:, f:], scale)
  row_scale = fp8_scale(jnp.max(jnp.abs(a), axis=-1))
  return quantize(a, row_scale[:, None]), row_scale


def _chunks(f: int, block: int) -> list[tuple[int, int]]:
  """(start, width) pieces covering [0, f): `block` wide, then the rest in falling powers of two,
  so that every load and store is in bounds and needs no mask."""
  pieces, c = [], 0
  while c < f:
    width = min(block, 1 << ((f - c).bit_length() - 1))
    pieces.append((c, width))
    c += width
  return pieces


def _swiglu_quant_kernel(in_scale_ref, w_scale_ref, gu_ref, q_ref, s_ref, *, f: int, block: int):
  # in_scale_ref, w_scale_ref []  float32  the product's two scales
  # gu_ref    [2F]                         this row's gate columns, then its up columns
  # q_ref     [F]    e4m3                  this row's quantized activations
  # s_ref     []     float32               this row's scale
  scale = in_scale_ref[()] * w_scale_ref[()]
  chunks = _chunks(f, block)   # static: unrolled, every chunk's loads in flight together
  acts = [_swiglu(gu_ref[pl.ds(c, w)], gu_ref[pl.ds(f + c, w)], scale) for c, w in chunks]
  amax = jnp.zeros((), jnp.float32)
  for a in acts:
    amax = jnp.maximum(amax, jnp.max(jnp.abs(a)))
  row_scale = fp8_scale(amax)
  for (c, w), a in zip(chunks, acts):
    q_ref[pl.ds(c, w)] = quantize(a, row_scale)
  s_ref[()] = row_scale


@functools.partial(jax.jit, static_argnames=("block", "num_warps", "interpret"))
def swiglu_quantize(gate_up: jax.Array, input_scale: jax.Array, weight_scale: jax.Array, *,
                    block: int = 8192, num_warps: int = 16, interpret: bool = False
                    ) -> tuple[jax.Array, jax.Array]:
  """The kernel; same contract as `swiglu_quantize_reference`. Grid (M,): one program a row.
  `block`: the widest chunk of columns a load takes (a power of two). The defaults were the
  fastest of 4-32 warps and chunks of 1024-8192 at both shapes above."""
  _check(gate_up, input_scale, weight_scale)
  if block < 16 or block & (block - 1):
    raise ValueError(f"block must be a power of two >= 16, got {block}")
  m, f = gate_up.shape[0], gate_up.shape[1] // 2
  kernel = functools.partial(_swiglu_quant_kernel, f=f, block=block)
  scalar = pl.BlockSpec((), lambda i: ())
  return pl.pallas_call(
      kernel,
      grid=(m,),
      in_specs=[scalar, scalar, pl.BlockSpec((None, 2 * f), lambda i: (i, 0))],
      out_specs=[pl.BlockSpec((None, f), lambda i: (i, 0)), pl.BlockSpec((None,), lambda i: (i,))],
      out_shape=[jax.ShapeDtypeStruct((m, f), FP8), jax.ShapeDtypeStruct((m,), jnp.float32)],
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret,
      name=f"swiglu_quantize_f{f}",
  )(jnp.asarray(input_scale, jnp.float32), jnp.asarray(weight_scale, jnp.float32), gate_up)
