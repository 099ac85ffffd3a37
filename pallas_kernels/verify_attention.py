"""Verification attention: T new queries per sequence against the whole KV cache.

Shapes (GQA, Hq = G * Hkv):
  q        [B, T, Hq, D]   the T = gamma + 1 new tokens (T = 1 is plain decoding)
  k, v     [B, S, Hkv, D]  the KV cache, the T new entries already written at lengths[b] + t
  lengths  [B] int32       entries in the cache *before* the new tokens (0 <= lengths[b] <= S - T)
Query row t of sequence b sits at position lengths[b] + t and sees keys j <= lengths[b] + t.
A draft tree (`jaxspec.drafting.trees`) passes `tree_bits` [T] or [B, T] int32 instead, one per
query row (`Tree.ancestor_bits`): row t sees every key j < lengths[b] and key lengths[b] + i iff
bit i of tree_bits[t] is set (i < 32). The rows need not be the whole window the bits address: the
nodes of one tree level, drafted after the shallower ones were written, pass their rows of
ancestor_bits (T smaller than the window), all window keys' K/V already in the cache. Without
tree_bits the traced code is the chain's, unchanged.

Optional criticality scores [B, S] (bf16): for each key j visible to every collected row, the mean
over collected rows and all Hq query heads of either the raw logit q.k (`score_kind='logits'`,
after masking, before softmax and before the 1/sqrt(D) scale) or the softmax weight
exp(scale * q.k - lse) (`score_kind='weights'`). Keys not visible to every collected row get -inf.
`score_rows` picks the rows (negative indices count from T): (0, -1) is Vegas's Collect-2-Query
(first draft + bonus), None is every row. `per_row=True` gives [B, T, S] instead, each query row's
own scores (for the policies keyed on the last accepted token). `score_heads='kv'` keeps one score
row per KV head, the mean over its G query heads ([B, Hkv, S], per_row [B, T, Hkv, S]: STS's
per-head masks); 'q' one per query head ([B, Hq, S], per_row [B, T, Hq, S]; the reference only).
`score_dtype=jnp.float32` returns them before the bf16 rounding (tensor parallelism averages the
devices' float32 means first).

Kernel (`verify_attention`), flash-decoding. Decoding and verification are bound by the bytes of
the cache, so the tiling reads every K/V byte from HBM once, however many query rows there are:
  * grid (Hkv, P) per sequence (the batch is vmapped, so the launch grid is (Hkv, P, B) with the
    KV head fastest: the Hkv programs that read the same cache rows run side by side). Each program
    streams one contiguous split of S / P keys of one KV head and keeps all G x T query rows of
    that head in one [M, D] tile (M = G*T rounded up to a power of two >= 16, as tl.dot needs).
  * the blocks of a split that every row sees run without a mask; only the last one or two blocks
    (the causal triangle of the T new rows, and the end of the cache) pay for masking. With
    tree_bits the masked blocks are those from the one holding lengths to the last key a row's
    bits name (`online_softmax.tree_bounds`); each tile tests (bits >> (j - lengths)) & 1 per row,
    the bits packed like the query rows.
  * each split writes an unnormalised partial (acc, running max, denominator); a small XLA combine
    merges the P splits (1-2% of the cache bytes at the default split count). The query tile, the
    split count and the combine are the ones `sparse_attention` uses (`online_softmax`).
  * 'logits' scores: q.k is linear in q, so the collected rows' summed logits are the logits of
    their summed query (summed in f32 by XLA). Where a tile of at most 64 rows has a padding row
    (M > G*T), or rows that fill a tile of at most 32 can take one of twice the rows (Qwen3-8B's
    T = 8: 32 rows in 64), that query, in the queries' dtype, rides in the tile's last row, and
    the kernel stores that row of the main product's [M, block_k] logits, in K's dtype: no
    product of its own (`logits_store`); at head_dim < 128 (64-key blocks) its blocks that every
    row sees run two an iteration, under one rescale of the accumulator. At Qwen3-8B's T = 8 the
    doubled tile cost +4.8-5.7% over scores off against the product's +7.4-8.7% (an H200,
    benchmarks/RESULTS.md, fiftieth session). Otherwise it is a second product
    k [block_k, D] @ qsum^T [D, 16] of the K tile already staged (the sum as a bf16 high + low
    pair: exact to about 2^-16), keys on the rows, so the per-key sum stays inside a warp
    (summing rows of the logit tile would cross every warp of the MMA layout), stored in f32. Either
    way the scores go straight to HBM as [B, Hkv, S], 1/D-2/D extra traffic, and XLA sums the Hkv
    partials, applies the -inf rule and casts to bf16. The all-rows mode costs the same as
    Collect-2. Per-row 'logits' use each row's head-summed query in one [block_k, R] product (R = T
    rounded up to 16), stored key-major [B, Hkv, S, R] f32.
  * 'weights' scores need the final log-sum-exp, known only after the combine. Where few packed
    rows are collected (a draft step: T = 1, G heads; Collect-2: 2 G), the main pass stores their
    scaled logits ([Hkv, R, S], the R collected packed rows only; from a 16-bit cache in float16,
    about 2^-11 of each logit, where bfloat16's 2^-8 would move a weight by up to 9% at logits
    near 50) and XLA applies the lse after the combine: 2 bytes per collected row and key
    written and read back instead of re-reading K.
    Otherwise a second pass (`_weights_kernel`, per row `_row_weights_kernel`) re-reads K (not V)
    for the collected rows only; per row, each row's G heads are summed by an MMA with a 0/1
    grouping matrix. `weights_store` picks between the two.
  * scores off compiles the kernel without any score code: it costs nothing extra.
  * a decode whose rows all fit one 16-row tile (T * Hq <= 16; head_dim < 128; Hkv a power of two,
    Hkv * D <= 128; no scores, no tree) runs its KV heads as one head of head_dim Hkv * D: the
    cache viewed as [B, S, 1, Hkv * D] (a bitcast), each query head zero outside its own head's
    columns, each head's output read from its own columns. One program then reads whole
    Hkv * D-wide rows instead of D-wide slices (Qwen2.5-0.5B decode: 128 bytes a row become 256;
    6% faster on an H100). Verification rows outgrow the tile, where it is slower.
  * default block_k 128 (64 with 'logits' scores at head_dim < 128, and for a 128-row query tile
    at head_dim 128, whose scored kernel would not fit shared memory at 128); 8 warps for a
    128-row scored tile at head_dim < 128, else 4; default splits: at most ~4 programs per SM (at
    head_dim 128 one program fills an SM, so a partial last wave costs a whole one), ~6 for
    the product's 'logits' scores with a 64-row query tile (never splits of exactly 64 blocks at
    head_dim 128), ~8 for a decode-sized tile (16 rows) without scores at head_dim < 128
    (`tiling`, with the measurements).

Backend: Pallas's Triton lowering: the kernel streams at the copy rate (below), so Mosaic GPU has
little left to win here and has no row gather on Hopper for `sparse_attention`. Deprecated from
jax 0.11, still shipped in 0.12; if it goes, this dense kernel is the one to port to Mosaic GPU.

Latest measured (H200, jax 0.11.2, benchmarks/RESULTS.md "Kernels", fourth session; % of the same
run's device copy), Qwen3-8B layer shapes:
  decode T=1, B=4 x 131072: 501.7 us, 100.9% (torch SDPA 491.0);
  Collect-2 'logits' T=8: B=4 546.6 us (93.5%), B=16 x 32768 538.6 us (94.9%); T=12: B=16 559.8 us
  (91.3%), B=4 602.5 us (84.8%; 565-576 us at the current default, 24 splits, in the scores runs);
  score collection over scores off: +7.7% to +18.1% (Qwen2.5-0.5B, T=5 and 8: +33%); in the
  twenty-first session's run +8.3% (Qwen3-8B, T=12) and +21.5-22.6% (0.5B), the score's product,
  sum and store lengthening each key block's step in a latency-bound loop (Nsight Compute);
  per-row scores, B=4 T=8: logits 870.4 us, weights 907.6, scores off 496.0.
At Qwen2.5-0.5B shapes inside a Vegas round (B=64 x 24576, T=5; fifth session's trace): 235.5 us
per layer with scores, 197.0 without. Collect-2 over scores off, 8 chained calls (H200, forty-sixth
session), from the padding row against the product: the 1.5B at B=128 x 24576, T=9, +3.8% against
+8.0% (B=64: +5.5% against +9.5%); Qwen3-8B, B=4 x 131072, T=12, +5.1% against +8.1%; the 0.5B at
B=128 x 24576, T=9, +16.7% against +24.6% (B=64, T=7: +11.6% against +20.2%). With the plain
kernel's split count and, at head_dim 64, paired blocks (forty-ninth session, two calls): the 1.5B
+3.3-4.1%, Qwen3-8B T=12 +2.4-2.6%, the 0.5B +6.8-11.4%.
How the kernel got here: benchmarks/NOTES_kernels.md.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import online_softmax
from pallas_kernels.online_softmax import (NEG_INF, PackedQueries, combine_splits, default_splits,
                                           pow2_rows)

_SCORED_PROGRAMS = 792    # ~6 per SM: 'logits' scores with 64 query rows (see verify_attention)
_SMALL_TILE_PROGRAMS = 8 * online_softmax.SMS   # a decode-sized tile at head_dim < 128 (the same)


def _check_shapes(q, k, v, lengths):
  if k.ndim != 4 or k.shape != v.shape:
    raise ValueError(f"expected k, v [B,S,Hkv,D]; got {k.shape}, {v.shape}")
  b, t, hq, d = online_softmax.query_shape(q, k.shape[2])
  if k.shape[0] != b or k.shape[3] != d or hq % k.shape[2]:
    raise ValueError(f"q {(b, t, hq, d)} does not match cache {k.shape} (batch, head_dim, GQA "
                     "grouping)")
  if lengths.shape != (b,):
    raise ValueError(f"lengths must be [B]={b}, got {lengths.shape}")


def normalize_rows(score_rows: tuple[int, ...] | None, t: int) -> tuple[int, ...]:
  rows = tuple(range(t)) if score_rows is None else tuple(r % t for r in score_rows)
  if not rows or any(not 0 <= r < t for r in rows):
    raise ValueError(f"score_rows {score_rows} out of range for T={t}")
  return tuple(sorted(set(rows)))


def _tree_visible(lengths: jax.Array, bits: jax.Array, s: int) -> jax.Array:
  """lengths [B], bits [B, R] -> [B, R, S] bool: each row sees the prefix and its window bits."""
  j = jnp.arange(s)[None, None, :]
  at = lengths[:, None, None]
  return (j < at) | online_softmax.window_visible(bits[:, :, None], j, at)


@functools.partial(jax.jit, static_argnames=("score_kind", "score_rows", "sm_scale", "per_row",
                                             "score_heads", "score_dtype"))
def verify_attention_reference(q, k, v, lengths, *, score_kind: str | None = None,
                               score_rows: tuple[int, ...] | None = (0, -1),
                               sm_scale: float | None = None, per_row: bool = False,
                               tree_bits: jax.Array | None = None, score_heads: str = "mean",
                               score_dtype=jnp.bfloat16):
  """Pure-JAX reference. Returns (out [B,T,Hq,D] in q.dtype, scores [B,S] in `score_dtype`
  (bf16) or None).

  per_row: scores [B,T,S] instead, one row per query row t (mean over the Hq heads of that row's
  logits or weights; -inf on the keys it does not see); `score_rows` is then unused.
  tree_bits [T] or [B, T] int32 (a draft tree, `jaxspec.drafting.trees.Tree.ancestor_bits`): row t
  sees the prefix j < lengths and key lengths + i iff bit i of tree_bits[t] is set, instead of the
  causal rule. None is the chain. Scores follow the same visibility.
  score_heads: 'mean' (over all Hq heads), 'kv' (per KV head) or 'q' (per query head): see the
  module docstring for the shapes.
  """
  _check_shapes(q, k, v, lengths)
  q = online_softmax.unpacked(q, k.shape[2])
  b, t, hq, d = q.shape
  s, hkv = k.shape[1], k.shape[2]
  g = hq // hkv
  scale = d ** -0.5 if sm_scale is None else sm_scale
  qg = q.reshape(b, t, hkv, g, d).astype(jnp.float32)
  logits = jnp.einsum("bthgd,bshd->bhgts", qg, k.astype(jnp.float32))   # [B,Hkv,G,T,S]
  if tree_bits is None:
    pos = lengths[:, None] + jnp.arange(t)[None]                         # [B,T]
    visible = jnp.arange(s)[None, None, :] <= pos[:, :, None]            # [B,T,S]
  else:
    visible = _tree_visible(lengths, online_softmax.batch_bits(tree_bits, b, t), s)
  masked = jnp.where(visible[:, None, None], logits * scale, NEG_INF)
  lse = jax.nn.logsumexp(masked, axis=-1, keepdims=True)
  probs = jnp.exp(masked - lse)
  out = jnp.einsum("bhgts,bshd->bthgd", probs, v.astype(jnp.float32)).reshape(b, t, hq, d)
  scores = None
  if score_kind is not None:
    if score_kind not in ("logits", "weights"):
      raise ValueError(f"score_kind must be 'logits' or 'weights', got {score_kind!r}")
    per = logits if score_kind == "logits" else probs                    # [B,Hkv,G,T,S]
    # One head axis H: 1 (the mean), Hkv or Hq.
    if score_heads == "mean":
      per = per.mean(axis=(1, 2))[:, None]                               # [B,1,T,S]
    elif score_heads == "kv":
      per = per.mean(axis=2)                                             # [B,Hkv,T,S]
    elif score_heads == "q":
      per = per.reshape(b, hq, t, s)                                     # [B,Hq,T,S]
    else:
      raise ValueError(f"score_heads must be 'mean', 'kv' or 'q', got {score_heads!r}")
    if per_row:
      scores = jnp.where(visible[:, :, None], per.transpose(0, 2, 1, 3), NEG_INF)   # [B,T,H,S]
      scores = scores[:, :, 0] if score_heads == "mean" else scores
    else:
      rows = jnp.asarray(normalize_rows(score_rows, t))
      mean = per[:, :, rows].mean(axis=2)                                # [B,H,S]
      seen_by_all = visible[:, rows].all(axis=1)                         # [B,S]
      scores = jnp.where(seen_by_all[:, None], mean, NEG_INF)
      scores = scores[:, 0] if score_heads == "mean" else scores
    scores = scores.astype(score_dtype)
  return out.astype(q.dtype), scores


# ----------------------------------------------------------------------------------------------
# Kernels

def _hi_lo(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
  """f32 x as a high and a low part in `dtype`: products with both, summed in f32, keep x's
  product to about 2^-16 (bf16) where x rounded to bf16 alone would keep 2^-8."""
  hi = x.astype(dtype)
  return hi, (x - hi.astype(jnp.float32)).astype(dtype)


def _verify_kernel(len_ref, q_ref, k_ref, v_ref, *refs, sm_scale: float, t: int, g: int,
                   block_k: int, split_len: int, score_mode: str | None, tree: bool,
                   stored: tuple[int, ...] = (), fold: int = 1):
  # len_ref  []       int32  cache entries before the T new tokens
  # q_ref    [M, D]   bf16   this KV head's query rows, row r = t*G + g, zero rows past T*G
  # k_ref    [S, D]          this KV head's keys (the BlockSpec squeezes the head; row stride Hkv*D)
  # v_ref    [S, D]
  # refs, with 'sum' or 'rows' scores: qsum_ref, summed queries split into bf16 high and low parts:
  #   'sum'  [16, D]  the collected rows' sum: high part in row 0, low part in row 1, zeros after
  #   'rows' [2R, D]  each query row's sum over its G heads: high parts in rows 0..R-1, low after
  # with a tree (`online_softmax.tree_bounds`): full_ref [] int32, every row sees the keys before
  #   it; end_ref [] int32, no row sees a key from it on; bits_ref [M] int32, each packed row's
  #   ancestor bits over the keys from len_ref on
  # then the outputs
  # o_ref    [M, D]   f32    unnormalised partial output of split p
  # m_ref    [M]      f32    running max of this split, base-2 logits
  # l_ref    [M]      f32    softmax denominator of this split
  # and with scores: score_ref, raw logits q.k of this KV head's heads, summed:
  #   'sum'  [S] f32 over the collected rows;  'rows' [S, R] f32 per query row (column t)
  #   or 'store' [R * S] f16/f32: the packed rows of the query rows `stored` (R = G * len(stored)),
  #   each its own scaled base-2 logits (what the softmax uses; -inf where masked), slot i * G + h
  #   for head h of stored[i], at slot * S + key, written only for the keys below kv_end
  #   or 'pad' [S] in K's dtype: the scaled base-2 logits of the tile's last row, a padding row
  #   that holds the collected rows' summed query
  # fold: the blocks every row sees run `fold` an iteration, under one rescale of the accumulator
  refs = list(refs)
  qsum_ref = None if score_mode in (None, "store", "pad") else refs.pop(0)
  if tree:
    full_ref, end_ref, bits_ref = refs.pop(0), refs.pop(0), refs.pop(0)
  if score_mode is None:
    o_ref, m_ref, l_ref = refs
  else:
    o_ref, m_ref, l_ref, score_ref = refs
  m_rows, d = q_ref.shape
  length = len_ref[()]
  start = pl.program_id(1) * split_len
  if tree:
    kv_end = end_ref[()]                                # exclusive: the last key a row's bits name
    bits = bits_ref[...][:, None]                       # [M, 1]
  else:
    kv_end = length + t                                 # exclusive: what the last row sees
  span = jnp.clip(kv_end - start, 0, split_len)
  n_blocks = (span + block_k - 1) // block_k
  # Blocks that end at or before `length` are seen by every row: no mask needed. (A tree's rows
  # all see its root at `length` too; bits shared further up move the bound with them.)
  seen_by_all = full_ref[()] if tree else length + 1
  n_full = jnp.minimum(jnp.maximum(seen_by_all - start, 0) // block_k, n_blocks)

  q = q_ref[...]
  if score_mode == "rows":
    r_rows = qsum_ref.shape[0] // 2
    q_hi, q_lo = qsum_ref[pl.ds(0, r_rows), :], qsum_ref[pl.ds(r_rows, r_rows), :]
  elif score_mode == "sum":
    qsum = qsum_ref[...]
  row_t = jnp.minimum(jnp.arange(m_rows) // g, t - 1)
  qk_scale = sm_scale * online_softmax.LOG2E
  if score_mode == "store":
    # Packed row r = t * G + h holds slot i * G + h where t = stored[i]; unstored rows get none.
    slot_of_t = jnp.full((m_rows,), -1, jnp.int32)
    packed_t = jnp.arange(m_rows) // g
    for i, row in enumerate(stored):
      slot_of_t = jnp.where(packed_t == row, i, slot_of_t)
    store_row = (slot_of_t >= 0)[:, None]                                   # [M, 1]
    slot = slot_of_t * g + jnp.arange(m_rows) % g
    store_offsets = jnp.where(store_row[:, 0], slot * k_ref.shape[0],
                              len(stored) * g * k_ref.shape[0])[:, None]
  if score_mode == "pad":
    # The last row's logits go to score_ref[j], every other row's past its end (masked off).
    pad_row = (jnp.arange(m_rows) == m_rows - 1)[:, None]                  # [M, 1]
    pad_offsets = jnp.where(pad_row, 0, k_ref.shape[0])

  def block(i, masked):
    # Block i's logits s [M, bk] (masked where a row does not see a key) and values, its scores
    # stored.
    j0 = start + i * block_k
    cols = j0 + jnp.arange(block_k)
    if masked:
      live = cols < kv_end
      k = plgpu.load(k_ref.at[pl.ds(j0, block_k), :], mask=live[:, None], other=0.)
      v = plgpu.load(v_ref.at[pl.ds(j0, block_k), :], mask=live[:, None], other=0.)
    else:
      k = k_ref[pl.ds(j0, block_k), :]
      v = v_ref[pl.ds(j0, block_k), :]
    if score_mode == "sum":
      # k [bk, D] @ qsum^T: keys on the rows of the product, so the hi + lo sum stays inside a
      # warp; summing the collected rows of q.k^T instead spans all warps (2-3x dearer, H200).
      partial = jnp.sum(online_softmax.dot_t(k, qsum), axis=1)           # [bk]
      if masked:
        plgpu.store(score_ref.at[pl.ds(j0, block_k)], partial, mask=live)
      else:
        score_ref[pl.ds(j0, block_k)] = partial
    elif score_mode == "rows":
      # [bk, R], keys on the rows, as for 'sum'
      partial = online_softmax.dot_t(k, q_hi) + online_softmax.dot_t(k, q_lo)
      if masked:
        plgpu.store(score_ref.at[pl.ds(j0, block_k), :], partial, mask=live[:, None])
      else:
        score_ref[pl.ds(j0, block_k), :] = partial
    s = online_softmax.dot_t(q, k) * qk_scale                            # [M, bk] f32
    if masked and tree:
      visible = ((cols[None, :] < length)
                 | online_softmax.window_visible(bits, cols[None, :], length))
      s = jnp.where(visible, s, NEG_INF)
    elif masked:
      s = jnp.where(cols[None, :] <= length + row_t[:, None], s, NEG_INF)
    if score_mode == "store":
      # The softmax's own logits, so the 'weights' need no second pass over K: XLA applies the
      # final lse to them after the combine. Only the collected rows get addresses in the buffer;
      # the others point past its end, masked off (as the padding row's store).
      plgpu.store(score_ref.at[store_offsets + cols[None, :]], s.astype(score_ref.dtype),
                  mask=(store_row & live[None, :]) if masked else store_row)
    elif score_mode == "pad":
      # The summed query's row of the logit tile, each thread storing the entries it holds: a
      # store takes a value shaped like its destination, so every row gets an address, the other
      # rows' past the end of score_ref (masked off; an interpret-mode scatter drops them). In
      # K's dtype: from a bf16 cache an f32 row outgrows shared memory at head_dim 128 with
      # 128-key blocks (the store seems to convert the tile's layout there).
      plgpu.store(score_ref.at[pad_offsets + cols[None, :]], s.astype(score_ref.dtype),
                  mask=(pad_row & live[None, :]) if masked else pad_row)
    return s, v

  def step(i, carry, masked):
    return online_softmax.update(carry, *block(i, masked))

  def folded(i, carry):
    # Unmasked blocks fold*i ... fold*i + fold - 1 under one rescale, with its row reductions. At
    # head_dim 64 the padding row's kernel ran +7% over scores off two blocks an iteration, +15%
    # one (the 0.5B's shapes; benchmarks/RESULTS.md, forty-ninth session).
    return online_softmax.update_blocks(
        carry, tuple(block(fold * i + j, False) for j in range(fold)))

  carry = online_softmax.init(m_rows, d)
  if k_ref.shape[0] < block_k:     # a cache shorter than one block: masked blocks only
    n_full = 0
  first_single = 0
  if fold > 1:
    carry = jax.lax.fori_loop(0, n_full // fold, folded, carry)
    first_single = fold * (n_full // fold)
  carry = jax.lax.fori_loop(first_single, n_full, functools.partial(step, masked=False), carry)
  carry = jax.lax.fori_loop(n_full, n_blocks, functools.partial(step, masked=True), carry)
  acc, m_i, l_i = carry
  o_ref[...] = acc
  m_ref[...] = m_i
  l_ref[...] = l_i


def _weights_kernel(len_ref, q_ref, lse_ref, k_ref, w_ref, *, sm_scale: float,
                    first_row: int | None, block_k: int, split_len: int):
  # len_ref  []       int32  lengths; with first_row None (a tree) the exclusive end of the keys
  #                          to weigh, from the collected rows' common bits (XLA masks the rest)
  # q_ref    [Mc, D]  the collected rows of this KV head, row i*G + g, zero rows past R*G
  # lse_ref  [Mc]     f32 final base-2 log-sum-exp of each row (+inf on padding rows)
  # k_ref    [S, D]
  # w_ref    [S]      f32 sum over collected rows of exp(scale*q.k - lse), for this KV head
  length = len_ref[()]
  start = pl.program_id(1) * split_len
  # keys seen by every collected row
  end = length if first_row is None else length + first_row + 1
  span = jnp.clip(end - start, 0, split_len)
  n_blocks = (span + block_k - 1) // block_k
  q = q_ref[...]
  lse = lse_ref[...]
  qk_scale = sm_scale * online_softmax.LOG2E

  def step(i, _):
    j0 = start + i * block_k
    live = j0 + jnp.arange(block_k) < end
    k = plgpu.load(k_ref.at[pl.ds(j0, block_k), :], mask=live[:, None], other=0.)
    qk = online_softmax.dot_t(q, k)
    w = jnp.sum(jnp.exp2(qk * qk_scale - lse[:, None]), axis=0)
    plgpu.store(w_ref.at[pl.ds(j0, block_k)], w, mask=live)
    return _

  jax.lax.fori_loop(0, n_blocks, step, 0)


def _row_weights_kernel(len_ref, q_ref, lse_ref, k_ref, *refs, sm_scale: float, t: int, g: int,
                        block_k: int, split_len: int, tree: bool):
  # len_ref  []      int32
  # q_ref    [M, D]  this KV head's query rows, row r = t*G + g (as in _verify_kernel)
  # lse_ref  [M]     f32 final base-2 log-sum-exp of each row (+inf on padding rows)
  # k_ref    [S, D]
  # with a tree: end_ref [] and bits_ref [M] int32 (as in _verify_kernel)
  # w_ref    [S, R]  f32 per query row t (column t): sum over its G heads of exp(scale*q.k - lse)
  if tree:
    end_ref, bits_ref, w_ref = refs
  else:
    (w_ref,) = refs
  m_rows, _ = q_ref.shape
  r_rows = w_ref.shape[1]
  length = len_ref[()]
  start = pl.program_id(1) * split_len
  if tree:
    end = end_ref[()]
    bits = bits_ref[...][None, :]           # [1, M]
  else:
    end = length + t                        # the last row sees keys < length + T
  span = jnp.clip(end - start, 0, split_len)
  n_blocks = (span + block_k - 1) // block_k
  q = q_ref[...]
  lse = lse_ref[...]
  qk_scale = sm_scale * online_softmax.LOG2E
  row_t = jnp.arange(m_rows) // g
  # [M, R] 0/1: packed row r belongs to query row t. The G-head sum per row is then an MMA over
  # the key-major weight tile, which keeps keys on the rows (no reduction across warps).
  group = (row_t[:, None] == jnp.arange(r_rows)[None, :]).astype(q.dtype)

  def step(i, _):
    j0 = start + i * block_k
    cols = j0 + jnp.arange(block_k)
    live = cols < end
    k = plgpu.load(k_ref.at[pl.ds(j0, block_k), :], mask=live[:, None], other=0.)
    s = online_softmax.dot_t(k, q) * qk_scale - lse[None, :]             # [bk, M]
    # Zero the keys a row does not see: the -inf they get is applied later, but their exp is
    # unbounded, and an inf times another row's 0 in the group product below would be NaN.
    if tree:
      visible = ((cols[:, None] < length)
                 | online_softmax.window_visible(bits, cols[:, None], length))
    else:
      visible = cols[:, None] <= length + row_t[None, :]
    p = jnp.where(visible, jnp.exp2(s), 0.)
    p_hi, p_lo = _hi_lo(p, q.dtype)
    w = online_softmax.dot(p_hi, group) + online_softmax.dot(p_lo, group)  # [bk, R]
    plgpu.store(w_ref.at[pl.ds(j0, block_k), :], w, mask=live[:, None])
    return _

  jax.lax.fori_loop(0, n_blocks, step, 0)


# ----------------------------------------------------------------------------------------------
# Unbatched pallas_call wrappers (one sequence; the public function vmaps them over the batch)

def _verify_unbatched(q, k, v, length, qsum=None, tree=None, *, sm_scale, t, g, block_k,
                      num_splits, score_mode, num_warps, num_stages, interpret, stored=(),
                      store_dtype=jnp.float16, fold=1):
  """q [Hkv, M, D], k/v [S, Hkv, D], length [], qsum [Hkv, 16 or 2R, D] or None, tree None or
  (full [], end [], bits [M]) (see _verify_kernel)

  -> partials o [Hkv,P,M,D], m, l [Hkv,P,M], and with scores the per-head logit sums:
  [Hkv, S] ('sum') or [Hkv, S, R] ('rows'), or the stored rows' logits [Hkv, G * R * S]
  ('store', R = len(stored)).
  """
  hkv, m_rows, d = q.shape
  s = k.shape[0]
  split_len = pl.cdiv(pl.cdiv(s, num_splits), block_k) * block_k
  p = pl.cdiv(s, split_len)
  kernel = functools.partial(_verify_kernel, sm_scale=sm_scale, t=t, g=g, block_k=block_k,
                             split_len=split_len, score_mode=score_mode, tree=tree is not None,
                             stored=stored, fold=fold)
  in_specs = [pl.BlockSpec((), lambda h, i: ()),
              pl.BlockSpec((None, m_rows, d), lambda h, i: (h, 0, 0)),
              pl.BlockSpec((s, None, d), lambda h, i: (0, h, 0)),
              pl.BlockSpec((s, None, d), lambda h, i: (0, h, 0))]
  out_shape = [jax.ShapeDtypeStruct((hkv, p, m_rows, d), jnp.float32),
               jax.ShapeDtypeStruct((hkv, p, m_rows), jnp.float32),
               jax.ShapeDtypeStruct((hkv, p, m_rows), jnp.float32)]
  out_specs = [pl.BlockSpec((None, None, m_rows, d), lambda h, i: (h, i, 0, 0)),
               pl.BlockSpec((None, None, m_rows), lambda h, i: (h, i, 0)),
               pl.BlockSpec((None, None, m_rows), lambda h, i: (h, i, 0))]
  args = [length, q, k, v]
  if score_mode in ("sum", "rows"):
    in_specs.append(pl.BlockSpec((None, qsum.shape[1], d), lambda h, i: (h, 0, 0)))
    args.append(qsum)
  if tree is not None:
    in_specs += _tree_specs(tree, m_rows)
    args += list(tree)
  if score_mode is not None:
    if score_mode == "sum":
      out_shape.append(jax.ShapeDtypeStruct((hkv, s), jnp.float32))
      out_specs.append(pl.BlockSpec((None, s), lambda h, i: (h, 0)))
    elif score_mode == "store":
      out_shape.append(jax.ShapeDtypeStruct((hkv, len(stored) * g * s), store_dtype))
      out_specs.append(pl.BlockSpec((None, len(stored) * g * s), lambda h, i: (h, 0)))
    elif score_mode == "pad":
      out_shape.append(jax.ShapeDtypeStruct((hkv, s), k.dtype))
      out_specs.append(pl.BlockSpec((None, s), lambda h, i: (h, 0)))
    else:
      r_rows = qsum.shape[1] // 2
      out_shape.append(jax.ShapeDtypeStruct((hkv, s, r_rows), jnp.float32))
      out_specs.append(pl.BlockSpec((None, s, r_rows), lambda h, i: (h, 0, 0)))
  return pl.pallas_call(
      kernel,
      grid=(hkv, p),
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name=(f"verify_attention_t{t}_g{g}_d{d}" + (f"_scores_{score_mode}" if score_mode else "")
            + ("_tree" if tree is not None else "")),
  )(*args)


def _tree_specs(tree: tuple[jax.Array, ...], m_rows: int) -> list[pl.BlockSpec]:
  """The tree inputs of a sequence, shared by its programs: scalar bounds, then the packed bits."""
  return [pl.BlockSpec((), lambda h, i: ())] * (len(tree) - 1) + [
      pl.BlockSpec((m_rows,), lambda h, i: (0,))]


def _weights_unbatched(q, lse, k, length, tree=None, *, kernel, name, r_rows, block_k,
                       num_splits, num_warps, num_stages, interpret):
  """The second pass over K for 'weights' scores, `kernel` being `_weights_kernel` (summed over
  the collected rows, r_rows None) or `_row_weights_kernel` (per row) with its static arguments.

  q [Hkv, M, D], lse [Hkv, M], k [S, Hkv, D], length [], tree None or (end [], bits [M]) (per row
  only) -> [Hkv, S] or [Hkv, S, R] f32.
  """
  hkv, m_rows, d = q.shape
  s = k.shape[0]
  split_len = pl.cdiv(pl.cdiv(s, num_splits), block_k) * block_k
  p = pl.cdiv(s, split_len)
  if r_rows is None:
    out_block, out_index = (None, s), lambda h, i: (h, 0)
  else:
    out_block, out_index = (None, s, r_rows), lambda h, i: (h, 0, 0)
  in_specs = [pl.BlockSpec((), lambda h, i: ()),
              pl.BlockSpec((None, m_rows, d), lambda h, i: (h, 0, 0)),
              pl.BlockSpec((None, m_rows), lambda h, i: (h, 0)),
              pl.BlockSpec((s, None, d), lambda h, i: (0, h, 0))]
  args = [length, q, lse, k]
  if tree is not None:
    in_specs += _tree_specs(tree, m_rows)
    args += list(tree)
  return pl.pallas_call(
      functools.partial(kernel, block_k=block_k, split_len=split_len),
      grid=(hkv, p),
      in_specs=in_specs,
      out_specs=pl.BlockSpec(out_block, out_index),
      out_shape=jax.ShapeDtypeStruct((hkv,) + out_block[1:], jnp.float32),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name=f"{name}_d{d}" + ("_tree" if tree is not None else ""),
  )(*args)


# ----------------------------------------------------------------------------------------------
# Public function

_QSUM_ROWS = 16   # the smallest row count tl.dot takes


def _collected_sum(qp: jax.Array, row_idx: list[int]) -> jax.Array:
  """[B, Hkv, M, D] packed queries -> [B, Hkv, D] f32: the sum of the collected packed rows (q.k
  is linear in q: the sum's logits are the rows' summed logits)."""
  return jnp.sum(qp[:, :, jnp.asarray(row_idx)].astype(jnp.float32), axis=2)


def _summed_query(qp: jax.Array, row_idx: list[int], dtype) -> jax.Array:
  """[B, Hkv, M, D] packed queries -> [B, Hkv, 16, D]: the collected rows' sum in f32, its high
  part in row 0 and low part in row 1."""
  parts = jnp.stack(_hi_lo(_collected_sum(qp, row_idx), dtype), axis=2)          # [B, Hkv, 2, D]
  return jnp.pad(parts, ((0, 0), (0, 0), (0, _QSUM_ROWS - 2), (0, 0)))


def _with_summed_query(qp: jax.Array, row_idx: list[int]) -> jax.Array:
  """[B, Hkv, M, D] packed queries -> the same with the collected rows' sum, summed in f32 and
  rounded to qp's dtype, in the last row, which is padding."""
  return qp.at[:, :, -1].set(_collected_sum(qp, row_idx).astype(qp.dtype))


def _row_queries(qp: jax.Array, t: int, g: int, r_rows: int, dtype) -> jax.Array:
  """[B, Hkv, M, D] packed queries -> [B, Hkv, 2R, D]: each query row's sum over its G heads,
  high parts in rows 0..R-1 and low parts in rows R..2R-1 (zero past T)."""
  b, hkv, _, d = qp.shape
  rows = qp[:, :, :t * g].reshape(b, hkv, t, g, d).astype(jnp.float32).sum(axis=3)   # [B,Hkv,T,D]
  pad = ((0, 0), (0, 0), (0, r_rows - t), (0, 0))
  return jnp.concatenate([jnp.pad(x, pad) for x in _hi_lo(rows, dtype)], axis=2)


def _heads_as_columns(q: jax.Array, hkv: int) -> jax.Array:
  """q [B, T, Hq, D] -> [B, T, Hq, Hkv*D]: query head i (of KV head i // G) in columns
  (i // G)*D .. + D, zero elsewhere, so that against K viewed as [B, S, 1, Hkv*D] its logits are
  its own head's."""
  b, t, hq, d = q.shape
  own = jnp.arange(hq)[:, None] // (hq // hkv) == jnp.arange(hkv)[None]        # [Hq, Hkv]
  wide = jnp.where(own[None, None, :, :, None], q[:, :, :, None, :], jnp.zeros((), q.dtype))
  return wide.reshape(b, t, hq, hkv * d)


def _own_columns(o: jax.Array, hkv: int) -> jax.Array:
  """The inverse of `_heads_as_columns` on the output: [B, T, Hq, Hkv*D] -> [B, T, Hq, D], each
  head's own columns (the others weigh the other heads' V)."""
  b, t, hq, wide = o.shape
  d = wide // hkv
  head = jnp.arange(hq) // (hq // hkv)                                         # [Hq]
  return jnp.take_along_axis(o.reshape(b, t, hq, hkv, d), head[None, None, :, None, None],
                             axis=3)[:, :, :, 0]


def tiling(b: int, t: int, hq: int, hkv: int, d: int, s: int, score_kind: str | None,
           block_k: int | None = None, num_warps: int | None = None,
           num_splits: int | None = None,
           logits_store: bool = False) -> tuple[int, int, int]:
  """`verify_attention`'s (block_k, num_warps, num_splits) for these shapes: the given ones, and
  the defaults for those left None. `logits_store`: 'logits' scores from the padding row."""
  m_rows = pow2_rows(t * (hq // hkv))
  if block_k is None:
    # Measured (benchmarks/NOTES_kernels.md): 128 is fastest with scores off (T=1, 8, 12; H100 and
    # H200); with fused logit scores 64 is faster at head_dim 64 (H200, T=5 and 7). A 128-row
    # tile at head_dim 128 takes 64 (an H200, 8 chained calls, benchmarks/RESULTS.md, thirty-first
    # session): with Collect-2's scores 128 asks for 229 KB of shared memory (227 KB exist),
    # without them the 1.5B at B=128 x 24576, T=13, takes 1113 us against 1811.
    block_k = 64 if (score_kind == "logits" and d < 128) or (m_rows >= 128 and d >= 128) else 128
    block_k = min(block_k, max(16, 1 << (s.bit_length() - 1)))   # a short cache: one tile or more
  if block_k < 16 or block_k & (block_k - 1):
    raise ValueError(f"block_k must be a power of two >= 16, got {block_k}")
  if num_warps is None:
    # A 128-row scored tile at head_dim 64 holds its accumulators in two warpgroups' registers:
    # the 0.5B at B=128 x 24576, T=11, 755 us with 8 warps against 947 with 4 (same run).
    num_warps = 8 if m_rows >= 128 and d < 128 and score_kind is not None else 4
  if num_splits:
    return block_k, num_warps, num_splits
  # The padding row's store (`logits_store`) runs best at the plain kernel's count (an H200, 8
  # chained calls, over scores off: the 1.5B at B=64 x 24576, T=9, 4 splits +4.2% against 6's
  # +6.2%; Qwen3-8B at B=4 x 131072, T=12, 16 splits +4.1% against 24's +5.7%; the 0.5B's,
  # paired, 2 and 4 splits the best of 2-6 and 3-12; benchmarks/RESULTS.md, forty-ninth session).
  scored = score_kind == "logits" and m_rows >= 64 and not logits_store
  if scored:
    # Measured on an H200 (kernels.py --plan=scores, two runs): the scored kernel with a 64-row
    # tile wants more programs than the plain one, rounded down: Qwen3-8B B=4 x 131072, T=12:
    # 16 splits 736 us, 24 565-576, 25 615, 32 581; B=16 x 32768: 4 splits 750, 5 564-568, 7 575,
    # 8 578-580; Qwen2.5-0.5B B=64 x 16384, T=5: 4 splits 240, 5 206-210, 7 215, 8 197-198.
    programs = _SCORED_PROGRAMS
  elif score_kind is None and m_rows <= 16 and d < 128:
    # A 16-row tile at head_dim 64 leaves room for more programs per SM than head_dim 128's one
    # (an H200, Qwen2.5-0.5B decode B=64 x 24576, T=1: 4 splits 231.9 us, 81.5% of copy; 8 splits
    # 208.9, 90.5%; 16 splits 208.1; 32 splits 212.3).
    programs = _SMALL_TILE_PROGRAMS
  else:
    programs = online_softmax.DEFAULT_PROGRAMS
  blocks = pl.cdiv(s, block_k)
  splits = default_splits(b * hkv, blocks, programs, at_most=True)
  per_split = pl.cdiv(blocks, splits)
  if scored and d >= 128 and splits > 1 and per_split >= 64 and per_split & (per_split - 1) == 0:
    # Splits of exactly 64 key blocks ran the scored kernel 26-47% slower on an H200 at head_dim
    # 128, in each of four shapes, where one split more or fewer did not: the 1.5B at B=128 x
    # 24576, T=9 (3 splits 1087 us, 2 splits 788, 6 819; 8 chained calls, benchmarks/RESULTS.md,
    # thirty-first session), at B=64 (3 splits 545 us, 6 432) and the two Qwen3-8B shapes above
    # (16 and 4 splits). One split fewer, longer. (An H100 ran the 1.5B's 3 splits at B=128
    # within 5% of scores off.)
    splits -= 1
  return block_k, num_warps, splits


def runs_heads_as_columns(t: int, hq: int, hkv: int, d: int, score_kind: str | None,
                          tree: bool) -> bool:
  """Whether `verify_attention` runs every KV head as one wide head (its queries in their own
  layout, not packed): a decode whose query rows all fit one 16-row tile, at head_dim < 128."""
  return (score_kind is None and not tree and t * hq <= 16 and d < 128 and hkv in (2, 4, 8)
          and hkv * d <= 128)


@functools.partial(jax.jit, static_argnames=(
    "score_kind", "score_rows", "sm_scale", "per_row", "interpret", "block_k", "num_splits",
    "num_warps", "num_stages", "score_heads", "score_dtype", "weights_store",
    "weights_store_dtype", "logits_store",
    "blocks_per_rescale"))
def verify_attention(q: jax.Array | PackedQueries, k: jax.Array, v: jax.Array,
                     lengths: jax.Array, *,
                     score_kind: str | None = None,
                     score_rows: tuple[int, ...] | None = (0, -1),
                     sm_scale: float | None = None, per_row: bool = False,
                     interpret: bool = False, block_k: int | None = None,
                     num_splits: int | None = None, num_warps: int | None = None,
                     num_stages: int = 3, tree_bits: jax.Array | None = None,
                     score_heads: str = "mean", score_dtype=jnp.bfloat16,
                     weights_store: bool | None = None,
                     weights_store_dtype=None,
                     logits_store: bool | None = None,
                     blocks_per_rescale: int | None = None) -> tuple[jax.Array, jax.Array | None]:
  """Pallas flash-decoding verification attention; same contract as verify_attention_reference,
  `tree_bits` included (None compiles the chain's kernels, unchanged).

  Returns (out [B,T,Hq,D] in q.dtype, scores [B,S] in `score_dtype` (bf16), [B,T,S] with
  `per_row`, or None). score_heads 'kv' (collected rows, not per_row: [B,Hkv,S]) keeps the
  kernel's per-KV-head partials apart instead of summing them; 'q' and per-row 'kv' are the
  reference's only (a ValueError here).
  Per-row 'logits' come from the main pass (each row's head-summed query, as for Collect-2);
  per-row 'weights' from a second pass over K, like the collected 'weights'. Knobs: `block_k` keys per
  tile (power of two >= 16), `num_splits` splits of the sequence per (sequence, KV head),
  Triton's `num_warps` and `num_stages`; None takes the defaults of `tiling` (a decode that runs
  its KV heads as one wide head, see the module docstring, takes the knobs, and their defaults,
  of that head_dim). `blocks_per_rescale`: the key blocks every row sees, folded into the
  accumulator under one rescale (None: 2 for the padding row's store at head_dim < 128, else 1).
  q may come packed already (`PackedQueries`, from `rope_write`) wherever
  `runs_heads_as_columns` is False.
  `weights_store`: collected 'weights' (not per row, no tree) from the main pass's stored logits
  rather than a second pass over K; None (the default) stores where that moves fewer bytes: the
  collected packed rows, written and read back in `weights_store_dtype` (None: float16 from a
  16-bit cache, float32 from a float32 one), against one read of K (2 * itemsize * rows <= D *
  K's itemsize: from a bf16 cache a draft step's T = 1 and Collect-2's 2 G rows at G <= 16,
  head_dim 64).
  `logits_store`: collected 'logits' (not per row, no tree) from the main product: the summed
  query, rounded to the queries' dtype (bf16: about 2^-9 of each entry; the product keeps it to
  about 2^-16), rides in the query tile's last row, a padding row, and the kernel stores that row
  of the logit tile in K's dtype (from a bf16 cache each KV head's partial is rounded before XLA
  sums them: scores about a bf16 ulp from the product's). False takes a separate k @ qsum
  product. None (the default) stores wherever a padding row is free in a tile of at most 64 rows
  (the shapes measured) at head_dim <= 128, doubling a tile of at most 32 rows that the rows fill.
  """
  _check_shapes(q, k, v, lengths)
  if score_kind not in (None, "logits", "weights"):
    raise ValueError(f"score_kind must be None, 'logits' or 'weights', got {score_kind!r}")
  if score_kind is not None and score_heads != "mean" and (score_heads != "kv" or per_row):
    raise ValueError(f"the kernel collects score_heads 'mean', or 'kv' without per_row; got "
                     f"{score_heads!r}{' per row' if per_row else ''} (the reference has them all)")
  b, t, hq, d = online_softmax.query_shape(q, k.shape[2])
  s, hkv = k.shape[1], k.shape[2]
  if d < 16 or d & (d - 1):
    raise ValueError(f"head_dim must be a power of two >= 16 for tl.dot, got {d}")
  packed = isinstance(q, PackedQueries)
  if runs_heads_as_columns(t, hq, hkv, d, score_kind, tree_bits is not None):
    if packed:
      raise ValueError("this decode runs its KV heads as one wide head: pass its queries unpacked")
    # Every query row of every KV head fits one 16-row tile: run the heads as one KV head of
    # head_dim Hkv*D (a bitcast of the cache), each head's query zero outside its own D columns,
    # so a program reads whole Hkv*D-wide rows. Qwen2.5-0.5B decode (B=64 x 24576, H100): 279 us
    # against 297 (1.05x the copy floor against 1.12x).
    wide = hkv * d
    out, _ = verify_attention(
        _heads_as_columns(q, hkv), k.reshape(b, s, 1, wide), v.reshape(b, s, 1, wide), lengths,
        sm_scale=d ** -0.5 if sm_scale is None else sm_scale, interpret=interpret,
        block_k=block_k, num_splits=num_splits, num_warps=num_warps, num_stages=num_stages,
        blocks_per_rescale=blocks_per_rescale)
    return _own_columns(out, hkv), None
  if t > s:
    raise ValueError(f"T={t} new tokens do not fit a cache of {s}")
  g = hq // hkv
  m_rows = pow2_rows(t * g)
  pad_free = m_rows > t * g
  # A tile the rows fill takes twice the rows for the store, where that stays within 64.
  pad_tile = m_rows if pad_free else 2 * m_rows
  collected = score_kind == "logits" and not per_row and tree_bits is None
  if logits_store is None:
    logits_store = collected and pad_tile <= 64 and d <= 128
  elif logits_store and not (collected and (pad_free or pad_tile <= 64)):
    raise ValueError("logits_store needs collected 'logits' scores, not per row, without a tree, "
                     f"and a padding row in the {m_rows}-row query tile ({t} x {g} rows used), "
                     "or a full tile of at most 32 rows")
  if logits_store:
    m_rows = pad_tile
  block_k, num_warps, splits = tiling(b, t, hq, hkv, d, s, score_kind, block_k, num_warps,
                                      num_splits, logits_store)
  scale = d ** -0.5 if sm_scale is None else sm_scale
  rows = None if score_kind is None else normalize_rows(score_rows, t)

  qp = q.rows if packed else online_softmax.pack_queries(q, hkv, m_rows)   # row r = t*G + g
  if qp.shape[2] < m_rows:                                                  # a widened tile
    qp = jnp.pad(qp, ((0, 0), (0, 0), (0, m_rows - qp.shape[2]), (0, 0)))
  lengths = lengths.astype(jnp.int32)
  tree = None
  if tree_bits is not None:
    bits = online_softmax.batch_bits(tree_bits, b, t)                     # [B,T]
    tree = (*online_softmax.tree_bounds(bits, lengths, s),
            online_softmax.pack_bits(bits, g, m_rows))
  common = dict(block_k=block_k, num_splits=splits, num_warps=num_warps,
                num_stages=num_stages, interpret=interpret)
  row_idx = [] if rows is None else [r * g + i for r in rows for i in range(g)]   # packed rows
  r_rows = pow2_rows(t)                                  # score columns in per-row mode
  score_mode, qsum = None, None
  if weights_store_dtype is None:
    weights_store_dtype = jnp.float16 if k.dtype.itemsize <= 2 else jnp.float32
  if weights_store is None:
    weights_store = (score_kind == "weights" and not per_row and tree is None
                     and 2 * jnp.dtype(weights_store_dtype).itemsize * len(row_idx)
                     <= d * k.dtype.itemsize)
  elif weights_store and (score_kind != "weights" or per_row or tree is not None):
    raise ValueError("weights_store needs collected 'weights' scores, not per row, without a tree")
  if weights_store:
    score_mode = "store"
  elif logits_store:
    score_mode, qp = "pad", _with_summed_query(qp, row_idx)
  elif score_kind == "logits" and per_row:
    score_mode, qsum = "rows", _row_queries(qp, t, g, r_rows, k.dtype)
  elif score_kind == "logits":
    score_mode, qsum = "sum", _summed_query(qp, row_idx, k.dtype)
  # Two key blocks an iteration where the padding row's store runs at head_dim < 128 (64-key
  # blocks); at head_dim 128 (128-key blocks) a pair of 64-key blocks was 29-33% slower. At the
  # 0.5B's shapes over scores off (H200, RESULTS.md, fifty-sixth session): two +9-11%, one or three
  # +23-26%, four +98-103%, eight warps +123% or more; scores off itself ran 4-7% slower paired.
  if blocks_per_rescale is None:
    blocks_per_rescale = 2 if score_mode == "pad" and d < 128 else 1
  elif blocks_per_rescale < 1:
    raise ValueError(f"blocks_per_rescale must be a positive integer, got {blocks_per_rescale}")
  outs = jax.vmap(functools.partial(_verify_unbatched, sm_scale=scale, t=t, g=g,
                                    score_mode=score_mode,
                                    stored=rows if score_mode == "store" else (),
                                    store_dtype=weights_store_dtype,
                                    fold=blocks_per_rescale,
                                    **common))(
                                        qp, k, v, lengths, qsum, tree)
  o, lse2 = combine_splits(*outs[:3])                   # [B,Hkv,M,D], [B,Hkv,M]
  out = online_softmax.unpack_queries(o, t, g).astype(qp.dtype)
  if score_kind is None:
    return out, None

  if per_row:
    if score_kind == "logits":
      per_head = outs[3]                                # [B,Hkv,S,R]
    else:
      # Every row's weights need its final lse; padding rows get +inf, so they weigh 0.
      lse_rows = jnp.where(jnp.arange(m_rows) < t * g, lse2, jnp.inf)
      kernel = functools.partial(_row_weights_kernel, sm_scale=scale, t=t, g=g,
                                 tree=tree is not None)
      per_head = jax.vmap(functools.partial(
          _weights_unbatched, kernel=kernel, name=f"verify_attention_row_weights_t{t}_g{g}",
          r_rows=r_rows, **common))(qp, lse_rows, k, lengths,
                                    None if tree is None else tree[1:])   # (end, bits)
    mean = jnp.sum(per_head, axis=1)[:, :, :t].transpose(0, 2, 1) * (1.0 / hq)   # [B,T,S]
    if tree is None:
      visible = jnp.arange(s)[None, None] <= (lengths[:, None] + jnp.arange(t))[:, :, None]
    else:
      visible = _tree_visible(lengths, bits, s)
    return out, jnp.where(visible, mean, NEG_INF).astype(score_dtype)

  weights_bound, first_row = lengths, rows[0]
  if tree is not None:
    # A key is seen by every collected row where it is in the prefix or set in all their bits;
    # the weights pass then reads up to the last such key.
    common_bits = jax.lax.reduce(bits[:, jnp.asarray(rows)], np.int32(-1), jax.lax.bitwise_and,
                                 (1,))                                    # [B]
    weights_bound = online_softmax.tree_bounds(common_bits[:, None], lengths, s)[1]
    first_row = None
  r_idx = jnp.asarray(row_idx)                          # the collected packed rows
  if logits_store:
    # The stored base-2 scaled logits, back to q.k.
    per_head = outs[3].astype(jnp.float32) * (1.0 / (scale * online_softmax.LOG2E))
  elif score_kind == "logits":
    per_head = outs[3]                                  # [B,Hkv,S]
  elif weights_store:
    logits = outs[3].reshape(b, hkv, len(row_idx), s).astype(jnp.float32)   # base 2, scaled
    # Past what every collected row sees the buffer was not written: the -inf rule below drops it.
    per_head = jnp.sum(jnp.exp2(logits - lse2[:, :, r_idx, None]), axis=2)
  else:
    # Rematerialise: the collected rows' weights need the final lse, known only now.
    mc = pow2_rows(len(row_idx))
    qc = jnp.pad(qp[:, :, r_idx], ((0, 0), (0, 0), (0, mc - len(rows) * g), (0, 0)))
    lc = jnp.pad(lse2[:, :, r_idx], ((0, 0), (0, 0), (0, mc - len(rows) * g)),
                 constant_values=jnp.inf)
    kernel = functools.partial(_weights_kernel, sm_scale=scale, first_row=first_row)
    per_head = jax.vmap(functools.partial(
        _weights_unbatched, kernel=kernel, name=f"verify_attention_weights_g{g}", r_rows=None,
        **common))(qc, lc, k, weights_bound)
  if tree is None:
    seen_by_all = jnp.arange(s)[None] <= (lengths + rows[0])[:, None]
  else:
    seen_by_all = _tree_visible(lengths, common_bits[:, None], s)[:, 0]   # [B,S]
  if score_heads == "kv":
    mean, seen_by_all = per_head * (1.0 / (len(rows) * g)), seen_by_all[:, None]   # [B,Hkv,S]
  else:
    mean = jnp.sum(per_head, axis=1) * (1.0 / (len(rows) * hq))
  scores = jnp.where(seen_by_all, mean, NEG_INF).astype(score_dtype)
  return out, scores
