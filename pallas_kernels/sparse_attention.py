"""Gathered sparse attention for drafting: selected prefix positions plus a dense recent tail.

Shapes (GQA, Hq = G * Hkv):
  q           [B, T, Hq, D]
  k, v        [B, S, Hkv, D]     the KV cache, the T new entries already written at lengths[b] + t
  indices     [B, K] int32       selected prefix positions, shared by all heads (token granularity),
              or [B, Hkv, K]     one list per KV head (per-head masks: STS, SparseSpec)
  counts      [B] or [B, Hkv]    how many of `indices` are valid; the rest is padding and ignored
  tail_start  [B] int32          every position from here on is attended densely (the tokens written
                                 since the selection was made); selected indices must be < tail_start
  lengths     [B] int32          entries in the cache before the T new tokens
  tree_bits   [T] or [B, T] int32    optional, a draft tree's ancestor bits (below)
Query row t sees {indices[b, :counts[b]]} U {j : tail_start[b] <= j <= lengths[b] + t}.
Indices must be distinct within a list and < tail_start (what `topk_select` returns); the kernel,
unlike the reference, would count a repeated index twice. A query row that sees nothing gets 0.
With `tree_bits` (`Tree.ancestor_bits`, as in `verify_attention`) the keys from lengths on follow
the tree instead of the causal rule: row t sees the selection, the tail up to lengths - 1, and key
lengths + i iff bit i of tree_bits[t] is set (i < 32; T may be smaller than the window the bits
address). The indices must then be < lengths too. Without tree_bits the traced code is unchanged.

Kernel (`sparse_attention`), flash-decoding over the index list. Like `verify_attention` it is
bound by the bytes it reads, here K/V rows scattered over the cache, so the tiling reads each
selected row once for all query rows of its KV head:
  * grid (Hkv, P_sel + P_tail) per sequence (batch vmapped; KV head fastest, so the Hkv programs
    that gather the same token rows run side by side and share DRAM pages). Programs p < P_sel each
    take one contiguous chunk of the index list, load block_k indices, and gather those rows of K
    and V with one pointer-per-row masked load (page size 1: each row is D*2 contiguous bytes);
    programs p >= P_sel split the dense tail [tail_start, lengths + T) and run it with the causal
    mask of the T new rows (with tree_bits: [min(tail_start, lengths), the last key a row's bits
    name), blocks from the one holding lengths on testing each row's bits). All G x T query rows
    of a KV head share each gathered tile.
  * shared indices [B, K] are read by every KV head's programs (from L2 after the first); per-head
    indices [B, Hkv, K] give each head its own list and count.
  * each program writes an unnormalised partial; the XLA combine `verify_attention` uses merges
    them (`online_softmax`: the query tile, the split count and the combine are shared).
  * defaults (measured on an H100, benchmarks/NOTES_kernels.md): block_k 32 rows per gather; about
    4 programs per SM for T*G <= 16 query rows and 8 above, where each gathered block carries more
    arithmetic (T = 8: 221 us with 8 splits against 271 with 5); at head_dim < 128 a 16-row tile
    runs with 2 warps and about 8 programs per SM (an H200, benchmarks/RESULTS.md).

Backend: Pallas's Triton lowering. Mosaic GPU cannot gather rows from global memory on Hopper (its
TMA copies are tiled boxes; a per-row gather is Blackwell-only), and a page size of 1 rules out
copying whole pages; Triton lowers a load with an integer-array index to a pointer per row, which
is exactly the gather.

Latest measured (H200, jax 0.11.2, benchmarks/RESULTS.md "Kernels", fourth session, run 3):
Qwen3-8B layer, B=16, 8192 of 131072 positions: 149.9 us at T = 1, 85.2% of the same run's device
copy (unsorted indices 150.9, per-KV-head lists 151.8); 179.1 us at T = 8, 71.4%. Inside a Vegas
round at Qwen2.5-0.5B shapes (B=64 x 24576; fifth session's trace): 0.59 ms per draft step (24
layers). How the kernel got here: benchmarks/NOTES_kernels.md.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import online_softmax
from pallas_kernels.online_softmax import (NEG_INF, PackedQueries, combine_splits, default_splits,
                                           pow2_rows)


def _check(q, k, v, indices, counts, tail_start, lengths):
  if k.ndim != 4:
    raise ValueError(f"k must be [B,S,Hkv,D], got {k.shape}")
  b, t, hq, d = online_softmax.query_shape(q, k.shape[2])
  if k.shape != v.shape or k.shape[0] != b or k.shape[3] != d or hq % k.shape[2]:
    raise ValueError(f"q {(b, t, hq, d)} does not match cache {k.shape}")
  per_head = indices.ndim == 3
  if indices.ndim not in (2, 3) or indices.shape[0] != b or (per_head and indices.shape[1] != k.shape[2]):
    raise ValueError(f"indices must be [B,K] or [B,Hkv,K]; got {indices.shape} for cache {k.shape}")
  if counts.shape != indices.shape[:-1]:
    raise ValueError(f"counts {counts.shape} must match indices {indices.shape[:-1]}")
  if tail_start.shape != (b,) or lengths.shape != (b,):
    raise ValueError("tail_start and lengths must be [B]")


@functools.partial(jax.jit, static_argnames=("sm_scale",))
def sparse_attention_reference(q, k, v, indices, counts, tail_start, lengths, *,
                               sm_scale: float | None = None,
                               tree_bits: jax.Array | None = None):
  """Pure-JAX reference: builds the visibility mask over the whole cache. Returns [B,T,Hq,D].

  tree_bits [T] or [B, T] int32: the keys from lengths on follow each row's ancestor bits instead
  of the causal rule (see the module docstring). Packed queries are unpacked first."""
  _check(q, k, v, indices, counts, tail_start, lengths)
  q = online_softmax.unpacked(q, k.shape[2])
  b, t, hq, d = q.shape
  s, hkv = k.shape[1], k.shape[2]
  g = hq // hkv
  scale = d ** -0.5 if sm_scale is None else sm_scale
  idx = indices if indices.ndim == 3 else jnp.broadcast_to(indices[:, None], (b, hkv, indices.shape[-1]))
  cnt = counts if counts.ndim == 2 else jnp.broadcast_to(counts[:, None], (b, hkv))
  valid = jnp.arange(idx.shape[-1]) < cnt[..., None]                          # [B,Hkv,K]
  selected = jnp.zeros((b, hkv, s), bool)
  selected = selected.at[jnp.arange(b)[:, None, None], jnp.arange(hkv)[None, :, None],
                         jnp.where(valid, idx, s)].set(True, mode="drop")       # [B,Hkv,S]
  if tree_bits is None:
    pos = lengths[:, None] + jnp.arange(t)[None]                              # [B,T]
    j = jnp.arange(s)
    tail = (j[None, None] >= tail_start[:, None, None]) & (j[None, None] <= pos[:, :, None])
  else:
    bits = online_softmax.batch_bits(tree_bits, b, t)
    j = jnp.arange(s)
    at = lengths[:, None, None]
    tail = (((j[None, None] >= tail_start[:, None, None]) & (j[None, None] < at))
            | online_softmax.window_visible(bits[:, :, None], j[None, None], at))  # [B,T,S]
  visible = selected[:, :, None] | tail[:, None]                               # [B,Hkv,T,S]
  qg = q.reshape(b, t, hkv, g, d).astype(jnp.float32)
  logits = jnp.einsum("bthgd,bshd->bhgts", qg, k.astype(jnp.float32)) * scale
  logits = jnp.where(visible[:, :, None], logits, -jnp.inf)
  probs = jax.nn.softmax(logits, axis=-1)
  # A row that sees nothing (no selected index and tail_start past it) attends to nothing: output 0,
  # where softmax over all -inf would give NaN.
  probs = jnp.where(visible[:, :, None].any(axis=-1, keepdims=True), probs, 0.)
  out = jnp.einsum("bhgts,bshd->bthgd", probs, v.astype(jnp.float32))
  return out.reshape(b, t, hq, d).astype(q.dtype)


# ----------------------------------------------------------------------------------------------
# Kernel

def _sparse_kernel(len_ref, tail_ref, cnt_ref, idx_ref, q_ref, k_ref, v_ref, *refs,
                   sm_scale: float, t: int, g: int, block_k: int, chunk: int, sel_splits: int,
                   tail_splits: int, tree: bool):
  # len_ref   []      int32  cache entries before the T new tokens
  # tail_ref  []      int32  first position of the dense tail
  # cnt_ref   []      int32  valid entries of this head's index list
  # idx_ref   [K]     int32  this head's selected positions (shared by all heads, or its own)
  # q_ref     [M, D]  bf16   this KV head's query rows, row r = t*G + g, zero rows past T*G
  # k_ref     [S, D]         this KV head's keys (head squeezed by the BlockSpec)
  # v_ref     [S, D]
  # with a tree (`online_softmax.tree_bounds`): full_ref [] int32, every row sees the keys before
  #   it; end_ref [] int32, no row sees a key from it on; bits_ref [M] int32, each packed row's
  #   ancestor bits over the keys from len_ref on
  # o_ref     [M, D]  f32    unnormalised partial output of this program
  # m_ref     [M]     f32    running max, base-2 logits
  # l_ref     [M]     f32    softmax denominator
  if tree:
    full_ref, end_ref, bits_ref, o_ref, m_ref, l_ref = refs
  else:
    o_ref, m_ref, l_ref = refs
  m_rows, d = q_ref.shape
  p = pl.program_id(1)
  length = len_ref[()]
  q = q_ref[...]
  qk_scale = sm_scale * online_softmax.LOG2E
  row_t = jnp.minimum(jnp.arange(m_rows) // g, t - 1)
  cols_d = jnp.arange(d)

  def update(carry, k, v, visible):
    s = online_softmax.dot_t(q, k) * qk_scale          # [M, bk]
    if visible is not None:
      s = jnp.where(visible, s, NEG_INF)
    return online_softmax.update(carry, s, v)

  def selected(carry):
    # Chunk [p*chunk, (p+1)*chunk) of the index list; every valid entry is seen by every row.
    base = p * chunk
    # The count clamped to the list here, not by the caller: a clamp there is one more kernel
    # per layer and draft step.
    live_n = jnp.clip(jnp.minimum(cnt_ref[()], idx_ref.shape[-1]) - base, 0, chunk)
    n_blocks = (live_n + block_k - 1) // block_k
    n_full = live_n // block_k

    def step(i, carry, masked):
      pos = base + i * block_k + jnp.arange(block_k)
      if masked:
        live = pos < base + live_n
        idx = plgpu.load(idx_ref.at[pl.ds(base + i * block_k, block_k)], mask=live, other=0)
        rows = (idx[:, None], cols_d[None, :])
        k = plgpu.load(k_ref.at[rows], mask=live[:, None], other=0.)
        v = plgpu.load(v_ref.at[rows], mask=live[:, None], other=0.)
        return update(carry, k, v, live[None, :])
      # Masked even here: the list may be shorter than one block (interpret mode checks shapes).
      idx = plgpu.load(idx_ref.at[pl.ds(base + i * block_k, block_k)], mask=pos < base + live_n,
                       other=0)
      rows = (idx[:, None], cols_d[None, :])
      return update(carry, k_ref[rows], v_ref[rows], None)

    carry = jax.lax.fori_loop(0, n_full, functools.partial(step, masked=False), carry)
    return jax.lax.fori_loop(n_full, n_blocks, functools.partial(step, masked=True), carry)

  def tail(carry):
    # Split (p - sel_splits) of the dense tail [tail_start, length + T), causal in the new rows.
    # A tree's keys from `length` on are seen by their bits even where tail_start is past length.
    def first():   # where the tail programs start (read where used: the chain's code unchanged)
      return jnp.minimum(tail_ref[()], length) if tree else tail_ref[()]

    if tree:
      kv_end = end_ref[()]
      bits = bits_ref[...][:, None]                    # [M, 1]
    else:
      kv_end = length + t
    tail_len = jnp.maximum(kv_end - first(), 0)
    per = (tail_len + tail_splits * block_k - 1) // (tail_splits * block_k) * block_k
    start = first() + (p - sel_splits) * per
    stop = jnp.minimum(start + per, kv_end)
    span = jnp.maximum(stop - start, 0)
    n_blocks = (span + block_k - 1) // block_k
    seen_by_all = full_ref[()] if tree else length + 1
    n_full = jnp.minimum(jnp.maximum(jnp.minimum(seen_by_all, stop) - start, 0) // block_k,
                         n_blocks)

    def step(i, carry, masked):
      j0 = start + i * block_k
      if not masked:
        return update(carry, k_ref[pl.ds(j0, block_k), :], v_ref[pl.ds(j0, block_k), :], None)
      cols = j0 + jnp.arange(block_k)
      live = cols < stop
      k = plgpu.load(k_ref.at[pl.ds(j0, block_k), :], mask=live[:, None], other=0.)
      v = plgpu.load(v_ref.at[pl.ds(j0, block_k), :], mask=live[:, None], other=0.)
      if tree:
        # The tail programs start at min(tail_start, length): cols < length is [tail_start, length).
        visible = live[None, :] & ((cols[None, :] < length)
                                   | online_softmax.window_visible(bits, cols[None, :], length))
      else:
        visible = live[None, :] & (cols[None, :] <= length + row_t[:, None])
      return update(carry, k, v, visible)

    if k_ref.shape[0] < block_k:   # a cache shorter than one block: masked blocks only
      n_full = 0
    carry = jax.lax.fori_loop(0, n_full, functools.partial(step, masked=False), carry)
    return jax.lax.fori_loop(n_full, n_blocks, functools.partial(step, masked=True), carry)

  carry = online_softmax.init(m_rows, d)
  acc, m_i, l_i = jax.lax.cond(p < sel_splits, selected, tail, carry)
  o_ref[...] = acc
  m_ref[...] = m_i
  l_ref[...] = l_i


# ----------------------------------------------------------------------------------------------
# Unbatched pallas_call wrapper (one sequence; the public function vmaps it over the batch)

def _sparse_unbatched(q, k, v, indices, counts, tail_start, length, tree=None, *, sm_scale, t, g,
                      block_k, num_splits, tail_splits, num_warps, num_stages, interpret):
  """q [Hkv,M,D], k/v [S,Hkv,D], indices [K] or [Hkv,K], counts [] or [Hkv], tail_start, length [],
  tree None or (full [], end [], bits [M]) (see _sparse_kernel)

  -> partials o [Hkv,P,M,D], m, l [Hkv,P,M] with P = P_sel + tail_splits.
  """
  hkv, m_rows, d = q.shape
  s = k.shape[0]
  kk = indices.shape[-1]
  chunk = pl.cdiv(pl.cdiv(kk, num_splits), block_k) * block_k
  sel_splits = pl.cdiv(kk, chunk)
  p = sel_splits + tail_splits
  per_head = indices.ndim == 2
  if per_head:
    idx_spec = pl.BlockSpec((None, kk), lambda h, i: (h, 0))
    cnt_spec = pl.BlockSpec((None,), lambda h, i: (h,))
  else:
    idx_spec = pl.BlockSpec((kk,), lambda h, i: (0,))
    cnt_spec = pl.BlockSpec((), lambda h, i: ())
  kernel = functools.partial(_sparse_kernel, sm_scale=sm_scale, t=t, g=g, block_k=block_k,
                             chunk=chunk, sel_splits=sel_splits, tail_splits=tail_splits,
                             tree=tree is not None)
  in_specs = [pl.BlockSpec((), lambda h, i: ()),
              pl.BlockSpec((), lambda h, i: ()),
              cnt_spec,
              idx_spec,
              pl.BlockSpec((None, m_rows, d), lambda h, i: (h, 0, 0)),
              pl.BlockSpec((s, None, d), lambda h, i: (0, h, 0)),
              pl.BlockSpec((s, None, d), lambda h, i: (0, h, 0))]
  args = [length, tail_start, counts, indices, q, k, v]
  if tree is not None:
    # The sequence's tree bounds and packed bits, shared by every program.
    in_specs += [pl.BlockSpec((), lambda h, i: ())] * 2 + [
        pl.BlockSpec((m_rows,), lambda h, i: (0,))]
    args += list(tree)
  return pl.pallas_call(
      kernel,
      grid=(hkv, p),
      in_specs=in_specs,
      out_specs=[pl.BlockSpec((None, None, m_rows, d), lambda h, i: (h, i, 0, 0)),
                 pl.BlockSpec((None, None, m_rows), lambda h, i: (h, i, 0)),
                 pl.BlockSpec((None, None, m_rows), lambda h, i: (h, i, 0))],
      out_shape=[jax.ShapeDtypeStruct((hkv, p, m_rows, d), jnp.float32),
                 jax.ShapeDtypeStruct((hkv, p, m_rows), jnp.float32),
                 jax.ShapeDtypeStruct((hkv, p, m_rows), jnp.float32)],
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name=(f"sparse_attention_t{t}_g{g}_d{d}" + ("_per_head" if per_head else "")
            + ("_tree" if tree is not None else "")),
  )(*args)


# ----------------------------------------------------------------------------------------------
# Public function

# Packed query rows (T * G) one tile holds; more are run in slices of rows (a chain's only).
MAX_ROWS = 128

@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "interpret", "block_k", "num_splits", "tail_splits", "num_warps", "num_stages"))
def sparse_attention(q: jax.Array | PackedQueries, k: jax.Array, v: jax.Array, indices: jax.Array,
                     counts: jax.Array, tail_start: jax.Array, lengths: jax.Array, *,
                     sm_scale: float | None = None, interpret: bool = False, block_k: int = 32,
                     num_splits: int | None = None, tail_splits: int = 2,
                     num_warps: int | None = None, num_stages: int = 3,
                     tree_bits: jax.Array | None = None) -> jax.Array:
  """Pallas gathered sparse attention; same contract as sparse_attention_reference, `tree_bits`
  included (None compiles the chain's kernel, unchanged). q may also come packed already
  (`PackedQueries`, from `rope_write`), holding at most MAX_ROWS rows per KV head.

  Returns [B,T,Hq,D] in q.dtype. A chain of more than MAX_ROWS // G rows (STS-PD's chunks) runs
  in slices of rows, each re-reading the selection. Knobs: `block_k` gathered rows per tile (power
  of two >= 16), `num_splits` chunks of the index list per (sequence, KV head) (default: ~4
  programs per SM for T*G <= 16 query rows per KV head at head_dim 128, ~8 otherwise),
  `tail_splits` programs per (sequence, KV head) for the dense tail, Triton's `num_warps`
  (default 2 for T*G <= 16 rows at head_dim < 128, else 4) and `num_stages`.
  """
  _check(q, k, v, indices, counts, tail_start, lengths)
  if block_k < 16 or block_k & (block_k - 1):
    raise ValueError(f"block_k must be a power of two >= 16, got {block_k}")
  if tail_splits < 1:
    raise ValueError(f"tail_splits must be >= 1, got {tail_splits}")
  b, t, hq, d = online_softmax.query_shape(q, k.shape[2])
  hkv = k.shape[2]
  if d < 16 or d & (d - 1):
    raise ValueError(f"head_dim must be a power of two >= 16 for tl.dot, got {d}")
  g = hq // hkv
  rows = max(1, MAX_ROWS // g)
  packed = isinstance(q, PackedQueries)
  if packed and t * g > MAX_ROWS:
    raise ValueError(f"packed queries hold {t * g} rows per KV head, more than one tile's "
                     f"{MAX_ROWS}: pass them unpacked")
  if tree_bits is None and t > rows:
    # A tile holds every query row of a KV head, and past MAX_ROWS packed rows it outgrows shared
    # memory (T = 64 rows of G = 6 at head_dim 128: 560 KB of 227). A chain's rows split exactly:
    # rows t0.. see the same selection and the tail up to lengths + t0 + j.
    knobs = dict(sm_scale=sm_scale, interpret=interpret, block_k=block_k,
                 num_splits=num_splits, tail_splits=tail_splits, num_warps=num_warps,
                 num_stages=num_stages)
    return jnp.concatenate(
        [sparse_attention(q[:, t0:t0 + rows], k, v, indices, counts, tail_start, lengths + t0,
                          **knobs) for t0 in range(0, t, rows)], axis=1)
  scale = d ** -0.5 if sm_scale is None else sm_scale
  kk = indices.shape[-1]
  counts = counts.astype(jnp.int32)    # the kernel clamps them to [0, K]
  indices = indices.astype(jnp.int32)
  if kk == 0:   # nothing selected: one padding entry that count 0 never reads
    indices = jnp.zeros(indices.shape[:-1] + (1,), jnp.int32)
    counts = jnp.zeros_like(counts)
  m_rows = pow2_rows(t * g)
  # Measured on an H100 (benchmarks/NOTES_kernels.md): with one 16-row tile (T=1) ~4 programs
  # per SM is best; with 32+ rows each gathered block costs more arithmetic and ~8 per SM is.
  # At head_dim 64 a 16-row tile is lighter still: on an H200, a Qwen2.5-0.5B draft step's layer
  # (B=64 x 24576, 7% selected, T=1) took 25.2 us with ~8 programs per SM and 2 warps against
  # 31.1 at ~4 and 4 warps (benchmarks/RESULTS.md, twenty-first session).
  small = m_rows <= 16 and d < 128
  programs = online_softmax.DEFAULT_PROGRAMS if m_rows <= 16 and not small else 1024
  num_warps = num_warps or (2 if small else 4)
  splits = num_splits or default_splits(b * hkv, pl.cdiv(indices.shape[-1], block_k), programs)
  qp = q.rows if packed else online_softmax.pack_queries(q, hkv, m_rows)   # row r = t*G + g
  tree = None
  if tree_bits is not None:
    bits = online_softmax.batch_bits(tree_bits, b, t)                     # [B,T]
    tree = (*online_softmax.tree_bounds(bits, lengths.astype(jnp.int32), k.shape[1]),
            online_softmax.pack_bits(bits, g, m_rows))
  parts = jax.vmap(functools.partial(
      _sparse_unbatched, sm_scale=scale, t=t, g=g, block_k=block_k, num_splits=splits,
      tail_splits=tail_splits, num_warps=num_warps, num_stages=num_stages, interpret=interpret))(
          qp, k, v, indices, counts, tail_start.astype(jnp.int32), lengths.astype(jnp.int32), tree)
  o, _ = combine_splits(*parts)                         # [B,Hkv,M,D]
  return online_softmax.unpack_queries(o, t, g).astype(qp.dtype)
