"""A decode step's new tokens into the attention kernels: RoPE, the KV-cache write and the query
packing in one kernel.

Shapes (GQA, Hq = G * Hkv):
  qkv       [B, T, Hq + 2 * Hkv, D]  the fused q/k/v projection (bias added): Hq query heads, then
                                     Hkv key heads, then Hkv value heads
  cos, sin  [B, T, D] float32        the new tokens' RoPE tables (rotate-half layout)
  k_cache, v_cache [B, S, Hkv, D]    token t's K/V go into slot lengths[b] + t; slots >= S are
                                     dropped (as `jaxspec.model.kv_cache.write` drops them)
  lengths   [B] int32
  q_norm, k_norm [D] or None         per-head RMSNorm weights applied before RoPE (Qwen3's qk_norm)
Returns (q, k_cache, v_cache): q as `online_softmax.PackedQueries`, rows [B, Hkv, M, D] in qkv's
dtype with RoPE applied, packed as `pack_queries` packs them (row r = t * G + g, zero rows up to
M = `pow2_rows(T * G)`), which `sparse_attention` and `verify_attention` take as they are.

Why a kernel: in a draft step of the 1.5B at B = 128 the same work took three XLA kernels a layer
(the query's RoPE and padding, then one scatter each for K and V with the key's RoPE fused in),
about 7 us of launch-bound work each layer-step for some 200 KB of data (H200; the
thirty-sixth session's trace in benchmarks/RESULTS.md). Here one program per (sequence, KV head)
loads its G * T query rows and T key and value rows once, rotates them (the rotated half comes
from a second load of the same row with permuted columns: Triton has no register shuffle) and
stores them; the caches are aliased to the outputs, so only the new rows are written.

`rope_write` is the kernel (Pallas Triton; `interpret=True` on the CPU), `rope_write_reference`
the same computation in plain JAX. Both round as the model's XLA path does: the norm's output in
qkv's dtype, RoPE in float32, the result in qkv's dtype. On an H200 the kernel's outputs equal
the XLA path's bit for bit at the 1.5B's and 0.5B's shapes (T 1 and 9); with q/k norms the rsqrt
may round one bf16 ulp apart.

Latest measured (H200, jax 0.11.2, benchmarks/RESULTS.md, thirty-seventh session): 2.7 us a
layer-step in a draft step of the 1.5B at B = 128, where the three XLA kernels took 7.1; a vegas
round 1.6% shorter, 504 kernels a round fewer.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.online_softmax import PackedQueries, pack_queries, pow2_rows


def _check(qkv, cos, sin, k_cache, v_cache, lengths, num_heads, q_norm, k_norm):
  if qkv.ndim != 4:
    raise ValueError(f"qkv must be [B, T, Hq + 2*Hkv, D], got {qkv.shape}")
  b, t, nh, d = qkv.shape
  if k_cache.ndim != 4 or k_cache.shape != v_cache.shape or k_cache.shape[0] != b:
    raise ValueError(f"caches {k_cache.shape}, {v_cache.shape} do not match qkv {qkv.shape}")
  hkv = k_cache.shape[2]
  if k_cache.shape[3] != d or nh != num_heads + 2 * hkv or num_heads % hkv:
    raise ValueError(f"qkv {qkv.shape} is not {num_heads} query heads and 2 x {hkv} KV heads of "
                     f"the cache {k_cache.shape}")
  if cos.shape != (b, t, d) or sin.shape != (b, t, d):
    raise ValueError(f"cos/sin must be [B, T, D] = {(b, t, d)}, got {cos.shape}, {sin.shape}")
  if lengths.shape != (b,):
    raise ValueError(f"lengths must be [B] = ({b},), got {lengths.shape}")
  if (q_norm is None) != (k_norm is None) or (q_norm is not None and (
      q_norm.shape != (d,) or k_norm.shape != (d,))):
    raise ValueError("q_norm and k_norm must both be None or both [D] weights")
  if d % 2:
    raise ValueError(f"RoPE needs an even head_dim, got {d}")


def _inv_rms(x, eps):
  """1 / RMS of each float32 row of x [N, D], as [N, 1]."""
  return jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


def _rms(x, w, inv, dtype):
  """RMSNorm of float32 rows x [N, D] with weights w [D] and inverse RMS `inv` [N, 1], rounded
  to `dtype`, as float32."""
  return (w * (x * inv)).astype(dtype).astype(jnp.float32)


def _rotate(x, xr, c, s, sign):
  """RoPE of rows x with their rotated halves xr (float32): x * cos + rotate_half(x) * sin."""
  return x * c + sign * xr * s


def rope_write_reference(qkv: jax.Array, cos: jax.Array, sin: jax.Array, k_cache: jax.Array,
                         v_cache: jax.Array, lengths: jax.Array, *, num_heads: int,
                         q_norm: jax.Array | None = None, k_norm: jax.Array | None = None,
                         eps: float = 1e-6) -> tuple[PackedQueries, jax.Array, jax.Array]:
  """Plain JAX: split, norm, RoPE, scatter into the caches, pack the queries."""
  _check(qkv, cos, sin, k_cache, v_cache, lengths, num_heads, q_norm, k_norm)
  b, t, _, d = qkv.shape
  hkv = k_cache.shape[2]
  q, k, v = jnp.split(qkv, [num_heads, num_heads + hkv], axis=2)
  if q_norm is not None:
    def norm(x, w):
      xf = x.astype(jnp.float32)
      return _rms(xf, w.astype(jnp.float32), _inv_rms(xf, eps), x.dtype).astype(x.dtype)
    q, k = norm(q, q_norm), norm(k, k_norm)

  def rope(x):
    xf = x.astype(jnp.float32)
    xr = jnp.concatenate([xf[..., d // 2:], xf[..., :d // 2]], axis=-1)
    sign = jnp.where(jnp.arange(d) < d // 2, -1.0, 1.0)
    return _rotate(xf, xr, cos[:, :, None], sin[:, :, None], sign).astype(x.dtype)

  q, k = rope(q), rope(k)
  slots = lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
  seq = jnp.arange(b)[:, None]
  k_cache = k_cache.at[seq, slots].set(k.astype(k_cache.dtype), mode="drop")
  v_cache = v_cache.at[seq, slots].set(v.astype(v_cache.dtype), mode="drop")
  rows = pack_queries(q, hkv, pow2_rows(t * (num_heads // hkv)))
  return PackedQueries(rows, t, num_heads), k_cache, v_cache


def _rope_write_kernel(len_ref, qkv_ref, cos_ref, sin_ref, *refs, t: int, g: int, hq: int,
                       hkv: int, capacity: int, eps: float, norm: bool):
  # len_ref  []          int32  entries before the new tokens
  # qkv_ref  [T*NH, D]          this sequence's projections, row t*NH + head (NH = Hq + 2*Hkv)
  # cos_ref, sin_ref [T, D] f32
  # with norm: qn_ref, kn_ref [D]
  # kc_ref, vc_ref [S*Hkv, D]   this sequence's cache (input; aliased to the outputs, unread)
  # q_ref    [M, D]             this KV head's packed query rows
  # ko_ref, vo_ref [S*Hkv, D]   the cache outputs: row slot*Hkv + h
  if norm:
    qn_ref, kn_ref, _, _, q_ref, ko_ref, vo_ref = refs
  else:
    _, _, q_ref, ko_ref, vo_ref = refs
  m_rows, d = q_ref.shape
  nh = hq + 2 * hkv
  h = pl.program_id(1)
  length = len_ref[()]
  cols = jnp.arange(d)
  rot = (cols + d // 2) % d
  sign = jnp.where(cols < d // 2, -1.0, 1.0)
  dtype = q_ref.dtype

  def rotated(src, tok, live, norm_ref):
    """Rows `src` of qkv with RoPE at their tokens' positions `tok` (float32, 0 where not live)."""
    x = plgpu.load(qkv_ref.at[src[:, None], cols[None, :]], mask=live[:, None],
                   other=0.).astype(jnp.float32)
    xr = plgpu.load(qkv_ref.at[src[:, None], rot[None, :]], mask=live[:, None],
                    other=0.).astype(jnp.float32)
    if norm_ref is not None:
      # The rotated copy takes the row's own scale: summed again in its permuted order, it can
      # round differently and move a bf16 output by one step.
      inv = _inv_rms(x, eps)
      x = _rms(x, norm_ref[...].astype(jnp.float32), inv, dtype)
      xr = _rms(xr, plgpu.load(norm_ref.at[rot]).astype(jnp.float32), inv, dtype)
    c = plgpu.load(cos_ref.at[tok[:, None], cols[None, :]], mask=live[:, None], other=0.)
    s = plgpu.load(sin_ref.at[tok[:, None], cols[None, :]], mask=live[:, None], other=0.)
    return _rotate(x, xr, c, s, sign)

  # The query rows of KV head h: packed row r = t*G + g is query head h*G + g of token t.
  r = jnp.arange(m_rows)
  live_q = r < t * g
  tok_q = jnp.where(live_q, r // g, 0)
  src_q = jnp.where(live_q, tok_q * nh + h * g + r % g, 0)
  q_ref[...] = rotated(src_q, tok_q, live_q, qn_ref if norm else None).astype(dtype)

  # Its key and value rows into slots length + t, a token at a time. One row a store: a masked
  # scatter of several rows may, in interpret mode, write a dead row's old value over a live one.
  # A slot past the cache is dropped: its masked store lands on the last slot, unchanged.
  one = jnp.zeros((1,), jnp.int32)
  for tt in range(t):
    slot = length + tt
    dst = jnp.minimum(slot, capacity - 1) * hkv + h
    keep = jnp.broadcast_to(slot < capacity, (1, d))
    k = rotated(one + tt * nh + hq + h, one + tt, one == 0, kn_ref if norm else None)
    plgpu.store(ko_ref.at[pl.ds(dst, 1), :], k.astype(ko_ref.dtype), mask=keep)
    v = qkv_ref[pl.ds(tt * nh + hq + hkv + h, 1), :]
    plgpu.store(vo_ref.at[pl.ds(dst, 1), :], v.astype(vo_ref.dtype), mask=keep)


@functools.partial(jax.jit, static_argnames=("num_heads", "eps", "interpret"))
def rope_write(qkv: jax.Array, cos: jax.Array, sin: jax.Array, k_cache: jax.Array,
               v_cache: jax.Array, lengths: jax.Array, *, num_heads: int,
               q_norm: jax.Array | None = None, k_norm: jax.Array | None = None,
               eps: float = 1e-6, interpret: bool = False
               ) -> tuple[PackedQueries, jax.Array, jax.Array]:
  """The kernel; same contract as `rope_write_reference`. The caches are aliased to the outputs:
  inside a jitted loop that donates them (the engine's), only the new slots are written."""
  _check(qkv, cos, sin, k_cache, v_cache, lengths, num_heads, q_norm, k_norm)
  b, t, nh, d = qkv.shape
  _, s, hkv, _ = k_cache.shape
  g = num_heads // hkv
  m_rows = pow2_rows(t * g)
  norm = q_norm is not None
  kernel = functools.partial(_rope_write_kernel, t=t, g=g, hq=num_heads, hkv=hkv, capacity=s,
                             eps=eps, norm=norm)
  whole = lambda rows: pl.BlockSpec((None, rows, d), lambda i, h: (i, 0, 0))
  in_specs = [pl.BlockSpec((None,), lambda i, h: (i,)), whole(t * nh), whole(t), whole(t)]
  args = [lengths.astype(jnp.int32), qkv.reshape(b, t * nh, d), cos.astype(jnp.float32),
          sin.astype(jnp.float32)]
  if norm:
    in_specs += [pl.BlockSpec((d,), lambda i, h: (0,))] * 2
    args += [q_norm, k_norm]
  in_specs += [whole(s * hkv)] * 2
  args += [k_cache.reshape(b, s * hkv, d), v_cache.reshape(b, s * hkv, d)]
  q, k_out, v_out = pl.pallas_call(
      kernel,
      grid=(b, hkv),
      in_specs=in_specs,
      out_specs=[pl.BlockSpec((None, None, m_rows, d), lambda i, h: (i, h, 0, 0)),
                 whole(s * hkv), whole(s * hkv)],
      out_shape=[jax.ShapeDtypeStruct((b, hkv, m_rows, d), qkv.dtype),
                 jax.ShapeDtypeStruct((b, s * hkv, d), k_cache.dtype),
                 jax.ShapeDtypeStruct((b, s * hkv, d), v_cache.dtype)],
      input_output_aliases={len(args) - 2: 1, len(args) - 1: 2},
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
      interpret=interpret,
      name=f"rope_write_t{t}_g{g}_d{d}",
  )(*args)
  return (PackedQueries(q, t, num_heads), k_out.reshape(k_cache.shape),
          v_out.reshape(v_cache.shape))
