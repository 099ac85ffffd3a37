"""The flash-decoding pieces `verify_attention` and `sparse_attention` share.

Both kernels put all G x T query rows of one KV head in one [M, D] tile (`pack_queries`, M =
`pow2_rows(T * G)`), split the keys of each (sequence, KV head) over several programs
(`default_splits`), and run the same inner loop in each program: it keeps, for its M query rows,
an unnormalised accumulator acc [M, D] f32, the running max m [M] f32 of the base-2 logits seen so
far and the softmax denominator l [M] f32. The caller computes one block of logits s [M, bk]
(scaled by sm_scale * LOG2E, masked entries -inf) and `update` folds it and its V block in. The
kernels store (acc, m, l) unnormalised; `combine_splits` merges and normalises the split partials
in XLA, and `unpack_queries` puts the rows back in [B, T, Hq, D]. Both kernels also take rows
packed already (`PackedQueries`, what `rope_write` returns), so a decode, draft or verification
step packs them in the kernel that applies RoPE rather than in a kernel of its own.

Draft trees (both kernels, both references): `tree_bits` [T] or [B, T] int32, one per query row,
replaces the causal rule on the keys from `lengths` on: key lengths + i is visible to row t iff
bit i of tree_bits[t] is set (i < 32), whatever T is (rows of one tree level address the window
of every node written so far). `window_visible` is that test, in a kernel tile and in XLA alike;
`tree_bounds` gives the keys every row sees and the end of those any row sees (the kernels mask
only the blocks between), `pack_bits` lays the bits out as the query tile.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

LOG2E = 1.4426950408889634
NEG_INF = float("-inf")
# Finite start for running maxima: a block whose keys are all masked for a row then gives
# exp2(-inf - (-1e30)) = 0 instead of exp2(-inf + inf) = NaN.
MAX_INIT = -1e30

State = tuple[jax.Array, jax.Array, jax.Array]   # (acc [M, D], m [M], l [M]), all f32
SMS = 132                # streaming multiprocessors of an H100 or H200
DEFAULT_PROGRAMS = 4 * SMS   # ~4 programs per SM
# `combine_splits` merges up to this many splits term by term: elementwise, which XLA emits as one
# fusion (as reductions over the split axis, two kernels a call). Longer split axes, as a small
# batch's decode has (69 at B = 1 over 8K keys, up to 528), are reduced: unrolled, their terms
# made fusions of ~1000 instructions, and XLA's fusion passes spent most of the 37-44 s it took to
# compile a 1.5B decode loop at B = 1 in them (3 s reduced, with no slower step: H200, RESULTS.md,
# thirty-eighth session).
UNROLLED_SPLITS = 16


def dot(a: jax.Array, b: jax.Array) -> jax.Array:
  """a [M, K] @ b [K, N] with f32 accumulation (pl.dot is removed in jax 0.12)."""
  return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def dot_t(a: jax.Array, b: jax.Array) -> jax.Array:
  """a [M, K] @ b [N, K]^T with f32 accumulation."""
  return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def init(m_rows: int, d: int) -> State:
  """The state before any block: acc = 0, m = MAX_INIT, l = 0."""
  return (jnp.zeros((m_rows, d), jnp.float32), jnp.full((m_rows,), MAX_INIT, jnp.float32),
          jnp.zeros((m_rows,), jnp.float32))


def update(state: State, s: jax.Array, v: jax.Array) -> State:
  """Fold one block in: s [M, bk] f32 base-2 logits (-inf where masked), v [bk, D] its values."""
  return update_blocks(state, ((s, v),))


def update_blocks(state: State, blocks: tuple[tuple[jax.Array, jax.Array], ...]) -> State:
  """Fold several (s, v) blocks in (as `update`) under one rescale of the accumulator."""
  acc, m_i, l_i = state
  m_new = m_i
  for s, _ in blocks:
    m_new = jnp.maximum(m_new, jnp.max(s, axis=1))
  alpha = jnp.exp2(m_i - m_new)
  l_new, acc = l_i * alpha, acc * alpha[:, None]
  for s, v in blocks:
    p = jnp.exp2(s - m_new[:, None])
    l_new = l_new + jnp.sum(p, axis=1)
    # p in V's dtype (bf16) so the p.V product runs on the tensor cores, accumulating in f32.
    acc = acc + dot(p.astype(v.dtype), v)
  return acc, m_new, l_new


def window_visible(bits: jax.Array, cols: jax.Array, length: jax.Array) -> jax.Array:
  """bool, broadcast of bits (int32 ancestor bits per row) and cols (key positions): the key is
  in the tree window [length, length + 32) and its bit is set. The shift is clamped into [0, 31]
  because a shift by a negative or >= 32 amount is undefined in Triton (and LLVM)."""
  rel = cols - length
  bit = jnp.right_shift(bits, jnp.clip(rel, 0, 31)) & 1
  return (rel >= 0) & (rel < 32) & (bit != 0)


# ----------------------------------------------------------------------------------------------
# Around the kernels (XLA): the query tile, the grid, the merge of the splits

def pow2_rows(n: int) -> int:
  """Rows of a query tile holding n rows: a power of two, at least 16 (what tl.dot takes)."""
  return max(16, 1 << (n - 1).bit_length())


def pack_queries(q: jax.Array, hkv: int, m_rows: int) -> jax.Array:
  """q [B, T, Hq, D] -> [B, Hkv, M, D]: each KV head's T*G query rows, row r = t*G + g, zero rows
  up to M = m_rows."""
  b, t, hq, d = q.shape
  g = hq // hkv
  qp = q.reshape(b, t, hkv, g, d).transpose(0, 2, 1, 3, 4).reshape(b, hkv, t * g, d)
  return jnp.pad(qp, ((0, 0), (0, 0), (0, m_rows - t * g), (0, 0)))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedQueries:
  """Query rows packed as `pack_queries` packs them: rows [B, Hkv, M, D] holding `t` tokens of
  `num_heads` query heads (row r = t * G + g, zero rows past T * G)."""
  rows: jax.Array
  t: int = dataclasses.field(metadata=dict(static=True))
  num_heads: int = dataclasses.field(metadata=dict(static=True))


def query_shape(q: "jax.Array | PackedQueries", hkv: int) -> tuple[int, int, int, int]:
  """(B, T, Hq, D) of q, [B, T, Hq, D] or `PackedQueries` over `hkv` KV heads (checked)."""
  if not isinstance(q, PackedQueries):
    if q.ndim != 4:
      raise ValueError(f"q must be [B,T,Hq,D], got {q.shape}")
    return q.shape
  rows = q.rows.shape
  if (len(rows) != 4 or q.num_heads % hkv or rows[1] != hkv
      or rows[2] != pow2_rows(q.t * (q.num_heads // hkv))):
    raise ValueError(f"packed queries {rows} do not hold {q.t} tokens of {q.num_heads} heads "
                     f"over {hkv} KV heads")
  return rows[0], q.t, q.num_heads, rows[3]


def unpacked(q: "jax.Array | PackedQueries", hkv: int) -> jax.Array:
  """q as [B, T, Hq, D], unpacking `PackedQueries` (what the references take)."""
  if not isinstance(q, PackedQueries):
    return q
  return unpack_queries(q.rows, q.t, q.num_heads // hkv)


def unpack_queries(o: jax.Array, t: int, g: int) -> jax.Array:
  """[B, Hkv, M, D] rows packed as `pack_queries` does -> [B, T, Hq, D], padding rows dropped."""
  b, hkv, _, d = o.shape
  return o[:, :, :t * g].reshape(b, hkv, t, g, d).transpose(0, 2, 1, 3, 4).reshape(b, t, hkv * g, d)


def default_splits(batch_heads: int, blocks: int, programs: int = DEFAULT_PROGRAMS, *,
                   at_most: bool = False) -> int:
  """Splits per (sequence, KV head) so that the grid holds about `programs` programs.

  at_most: never more than `programs`. The dense kernel at head_dim 128 and block_k 128 holds one
  program per SM (232 registers a thread, 213 KB of shared memory: ncu on an H200), so a few
  programs past whole waves cost a whole extra wave: on an H200, Qwen3-8B B=4 (32 sequence-head
  pairs), 17 splits (544 programs) took 540.9 us and 16 splits 498.5 us.
  """
  n = programs // batch_heads if at_most else pl.cdiv(programs, batch_heads)
  return max(1, min(n, blocks))


def combine_splits(o, m, l):
  """Merge flash-decoding partials. o [...,P,M,D], m/l [...,P,M] -> (out [...,M,D], lse2 [...,M]).

  lse2 is the base-2 log-sum-exp of the scaled logits. Rows with nothing visible get out = 0.
  """
  if m.shape[-2] > UNROLLED_SPLITS:
    m_max = jnp.max(m, axis=-2)
    w = jnp.exp2(m - m_max[..., None, :])
    l_sum = jnp.sum(w * l, axis=-2)
    acc = jnp.sum(w[..., None] * o, axis=-3)
    return acc / jnp.maximum(l_sum, 1e-30)[..., None], m_max + jnp.log2(l_sum)
  ms = [m[..., i, :] for i in range(m.shape[-2])]
  m_max = functools.reduce(jnp.maximum, ms)
  l_sum = acc = 0.0
  for i, m_i in enumerate(ms):
    w = jnp.exp2(m_i - m_max)
    l_sum = l_sum + w * l[..., i, :]
    acc = acc + w[..., None] * o[..., i, :, :]
  out = acc / jnp.maximum(l_sum, 1e-30)[..., None]
  return out, m_max + jnp.log2(l_sum)


def batch_bits(tree_bits: jax.Array, b: int, t: int) -> jax.Array:
  """Check tree bits [T] or [B, T] int32 and broadcast them to [B, T]."""
  if tree_bits.shape not in ((t,), (b, t)):
    raise ValueError(f"tree_bits must be [T]={t} or [B, T]={(b, t)} int32, got {tree_bits.shape}")
  if tree_bits.dtype != jnp.int32:
    raise ValueError(f"tree_bits must be int32 (bit 31 is the sign bit), got {tree_bits.dtype}")
  return jnp.broadcast_to(tree_bits, (b, t))


def pack_bits(bits: jax.Array, g: int, m_rows: int) -> jax.Array:
  """[B, T] bits -> [B, M], packed as `pack_queries` packs rows (row r = t*G + g); the padding
  rows repeat the last row's bits, as the kernels' causal rule clamps them to the last row."""
  t = bits.shape[1]
  return bits[:, jnp.minimum(jnp.arange(m_rows) // g, t - 1)]


def tree_bounds(bits: jax.Array, lengths: jax.Array, s: int) -> tuple[jax.Array, jax.Array]:
  """bits [B, R] int32, lengths [B] -> (full, end), each [B] int32 and at most the cache size S:
  every one of the R rows sees the keys before `full` (the prefix and the window keys at the
  bottom of all rows' bits: the root, for a tree's nodes; a chain's full is lengths + 1, as its
  causal rule has it), none sees a key from `end` on (lengths + the bit length of the rows' OR)."""
  union = jax.lax.reduce(bits, np.int32(0), jax.lax.bitwise_or, (1,))
  common = jax.lax.reduce(bits, np.int32(-1), jax.lax.bitwise_and, (1,))
  end = jnp.minimum(lengths + 32 - jax.lax.clz(union), s)
  # The lowest bit missing from `common` (~c & (c + 1)), as an index: the shared run's length.
  missing = ~common
  run = jnp.where(missing == 0, 32, 31 - jax.lax.clz(missing & (common + 1)))
  return jnp.minimum(lengths + run, end), end
