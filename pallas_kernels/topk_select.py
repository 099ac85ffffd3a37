"""Top-k selection of KV positions from criticality scores, k chosen per row by the caller.

  scores   [B, L]  (any float dtype; positions >= lengths[b] are ignored)
  lengths  [B]     prefix length to select from
  k        [B]     int32, positions to keep, 0 <= k[b] <= min(lengths[b], k_max), already clamped
                   by the caller (the selection policies' token budget; no policy lives here)
  k_max    static size of the output
Returns indices [B, k_max] int32: the first k[b] entries are the selected positions; the rest are
padding (value 0). NaN scores count as -inf.
Ties: both keep the lower position (lax.top_k's rule), so both return the same *set*.
Order: the reference lists the selection in descending score order; `topk_select`'s threshold method
lists it in ascending position order (what a gather over the cache wants anyway).

`topk_select` (method='threshold', the default) is a sorting-free exact select in plain XLA:
  1. map each score to an order-preserving unsigned key (16 bits for bf16/f16 scores, 32 for f32;
     out-of-prefix positions get key 0, below every real score, -inf included);
  2. find the k-th largest key per row 4 bits at a time: each pass counts, in one fused read of
     the row, the keys at or above 15 candidate thresholds (4 passes for 16-bit keys, 8 for 32);
  3. keep every key above it and the first (k - #above) keys equal to it, in position order, and
     compact with a running count and a binary search per output slot (no scatter).
method='pallas' runs the same search as a Pallas (Triton) kernel, bf16 only, grid (B,): one program
per row, which walks its row in tiles of `block` positions. Each digit pass counts, among the keys
that share the threshold's bits found so far, how many have each of the 2^digit values of the
next digit: a lane counts its keys in 4-bit fields, eight values to an int32 (a compare, a select
and an add per key and word, with no reduction per tile), and every 15 tiles the fields are summed
over the lanes into the row's totals. Suffix sums of that histogram give the count at each
candidate threshold and the number of keys above the threshold. The emitting pass writes the
kept positions in order by a running count (a block-wise cumsum) with a scatter store. Each pass
re-reads the row. The kernel is bound by its integer work per key, not by its bytes (below); with
one program a row it needs many rows to fill the GPU, so the per-layer selection
(`jaxspec.drafting.policies.per_layer_topk`) runs the kernel from 256 rows and the XLA form
below. method='top_k' is lax.top_k, which sorts every row (the reference itself).

Latest measured (H200, jax 0.11.2, benchmarks/RESULTS.md, forty-fifth session), bf16 scores, ratio
0.07, block 1024, 4 warps: 3584 x 25088 (28 layers x 128 sequences, the 1.5B's per-round
selection) 768 us, 1536 x 33792 460 us; 257-267 GB/s against the run's 4105 GB/s copy (one read
of the scores, one write of the indices), 15-16x that floor. Probe variants of its form with
masked tiles (795 us) split the time: the four digit passes' loads and key mapping about 270 us,
their histograms about 300, the emitting pass about 220. In a vegas round of the random-weight 1.5B at
B = 128 x 24K it is 0.81 ms, 1.3% of the round's GPU time. How the kernel got here:
benchmarks/NOTES_kernels.md.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def _check(scores, lengths, k, k_max):
  if scores.ndim != 2 or lengths.shape != scores.shape[:1] or k.shape != scores.shape[:1]:
    raise ValueError("expected scores [B, L], lengths [B] and k [B]; "
                     f"got {scores.shape}, {lengths.shape}, {k.shape}")
  if not 0 < k_max <= scores.shape[1]:
    raise ValueError(f"k_max={k_max} must be in [1, L={scores.shape[1]}]")


@functools.partial(jax.jit, static_argnames=("k_max",))
def topk_select_reference(scores, lengths, k, *, k_max: int):
  """lax.top_k over the prefix: indices [B, k_max], the first k[b] in descending score order."""
  _check(scores, lengths, k, k_max)
  s = scores.astype(jnp.float32)
  s = jnp.where(jnp.isnan(s), -jnp.inf, s)
  # Out-of-prefix positions must lose against every real score, -inf included.
  in_prefix = jnp.arange(scores.shape[1])[None] < lengths[:, None]
  key = jnp.where(in_prefix, jnp.maximum(s, jnp.finfo(jnp.float32).min), -jnp.inf)
  _, idx = jax.lax.top_k(key, k_max)
  idx = jnp.where(jnp.arange(k_max)[None] < k[:, None], idx, 0)
  return idx.astype(jnp.int32)


def _flip16(bits):
  """16-bit float bit patterns (NaN already gone) -> unsigned keys in the same order as the floats:
  negatives reversed below 0x8000, non-negatives above it."""
  return jnp.where(bits >= 0x8000, 0xFFFF - bits, bits | 0x8000)


def _ordered_key(scores: jax.Array, in_prefix: jax.Array) -> tuple[jax.Array, int]:
  """Order-preserving unsigned keys; out-of-prefix positions get 0. Returns (keys, key bits)."""
  if jnp.dtype(scores.dtype).itemsize == 2:
    x = scores.astype(jnp.bfloat16) if scores.dtype != jnp.float16 else scores
    x = jnp.where(jnp.isnan(x), -jnp.inf, x)
    key = _flip16(jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32))
    nbits = 16
  else:
    x = scores.astype(jnp.float32)
    # The reference clamps -inf to the lowest finite float: the two tie, as there.
    x = jnp.maximum(jnp.where(jnp.isnan(x), -jnp.inf, x), jnp.finfo(jnp.float32).min)
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    sign = jnp.uint32(0x80000000)
    key = jnp.where(bits >= sign, ~bits, bits | sign)
    nbits = 32
  # -inf maps to 0x007F / 0x007FFFFF and NaN is gone, so 0 is free for out-of-prefix positions.
  return jnp.where(in_prefix, key, 0).astype(jnp.uint32), nbits


_DIGIT = 4   # bits decided per pass of the threshold search: 15 candidate counts per pass


def _kth_key(key: jax.Array, nbits: int, k: jax.Array) -> jax.Array:
  """The k-th largest key per row (keys [B, L] uint32 of nbits bits, k [B]; any value if k = 0).

  Builds the largest t with #(key >= t) >= k, _DIGIT bits at a time: each pass counts the keys at
  or above the 15 candidates t | j << shift (one fused reduction over the row, no histogram
  buffer, no scatter) and keeps the largest candidate that still has k keys at or above it.
  """
  t = jnp.zeros(key.shape[:1], jnp.uint32)
  steps = jnp.arange(1, 1 << _DIGIT, dtype=jnp.uint32)
  for shift in range(nbits - _DIGIT, -1, -_DIGIT):
    cand = t[:, None] | (steps[None] << jnp.uint32(shift))                      # [B, 15]
    # 15 sibling row reductions over the same keys: XLA fuses them into one pass.
    at_least = jnp.stack([jnp.sum(key >= cand[:, j:j + 1], axis=1, dtype=jnp.int32)
                          for j in range(cand.shape[1])], axis=1)
    digit = jnp.sum(at_least >= k[:, None], axis=1).astype(jnp.uint32)           # counts shrink in j
    t = t | (digit << jnp.uint32(shift))
  return t


def compact_positions(keep: jax.Array, k_max: int) -> jax.Array:
  """keep [B, L] bool -> the kept positions in ascending order [B, k_max], padded with 0 (also
  used by topp_select).

  The j-th kept position is the first p with cumsum(keep)[p] > j: a binary search per output
  slot over the running count, so no scatter over all L positions.
  """
  rank = jnp.cumsum(keep, axis=1, dtype=jnp.int32)
  slots = jnp.arange(1, k_max + 1, dtype=jnp.int32)
  idx = jax.vmap(lambda r: jnp.searchsorted(r, slots, side="left", method="scan_unrolled"))(rank)
  return jnp.where(slots[None] <= rank[:, -1:], idx, 0).astype(jnp.int32)


_GROUP = 15   # tiles a lane counts in 4-bit fields before they are widened (a field holds 15)


def _select_kernel(len_ref, k_ref, bits_ref, idx_ref, *, block: int, digit: int):
  # len_ref  []       int32   prefix length of this row
  # k_ref    []       int32   k, the positions to keep
  # bits_ref [L]      uint16  the row's 16-bit scores, bit patterns
  # idx_ref  [k_max]  int32   out: the kept positions ascending, then zeros
  # Every pass below re-reads the row; HBM or L2 serves it (a row is 2 bytes a position).
  length, k = len_ref[()], k_ref[()]
  n_full, n_blocks = length // block, (length + block - 1) // block
  bins = 1 << digit

  def keys(i, masked=True):
    pos = i * block + jnp.arange(block, dtype=jnp.int32)
    ref = bits_ref.at[pl.ds(i * block, block)]
    live = pos < length
    bits = (plgpu.load(ref, mask=live, other=0) if masked else plgpu.load(ref)).astype(jnp.int32)
    key = _flip16(jnp.where((bits & 0x7FFF) > 0x7F80, 0xFF80, bits))    # NaN -> -inf
    return pos, (jnp.where(live, key, 0) if masked else key)            # as _ordered_key

  def histogram(t, shift):
    """[bins] scalars: how many keys share t's bits above shift + digit, by their digit at
    shift. A lane counts its keys in 4-bit fields, eight bins an int32 (a compare, a select and
    an add per key and word, no reduction per tile), for up to _GROUP tiles; then the fields are
    summed over the lanes into the [bins] totals."""
    top = shift + digit
    words = max(1, bins // 8)

    def tile(masked):
      def body(i, acc):
        key = keys(i, masked)[1]
        code = jnp.where((key >> top) == (t >> top), (key >> shift) & (bins - 1), 16)
        inc = jnp.left_shift(1, (code & 7) << 2)                        # code 16: no word
        return tuple(a + jnp.where(code >> 3 == w, inc, 0) for w, a in enumerate(acc))
      return body

    def widen(acc, total):
      return tuple(x + jnp.sum((acc[j >> 3] >> ((j & 7) * 4)) & 15) for j, x in enumerate(total))

    zero = (jnp.zeros((block,), jnp.int32),) * words

    def group(g, total):
      end = jnp.minimum(g * _GROUP + _GROUP, n_full)
      return widen(jax.lax.fori_loop(g * _GROUP, end, tile(False), zero), total)
    total = jax.lax.fori_loop(0, (n_full + _GROUP - 1) // _GROUP, group, (jnp.int32(0),) * bins)
    return widen(jax.lax.fori_loop(n_full, n_blocks, tile(True), zero), total)  # the ragged tile

  # The k-th largest key t, `digit` bits a pass (as _kth_key). `above` is #(key > t's prefix so
  # far), i.e. the keys already known to rank above the threshold; after the last pass it is
  # #(key > t), which the emitting pass needs for ties.
  t, above = jnp.int32(0), jnp.int32(0)
  for shift in range(16 - digit, -1, -digit):
    hist = histogram(t, shift)
    at_least = [above] * (bins + 1)                     # at_least[j] = #(key >= t | j << shift)
    for j in range(bins - 1, -1, -1):
      at_least[j] = at_least[j + 1] + hist[j]
    d = sum((at_least[j] >= k).astype(jnp.int32) for j in range(1, bins))  # at_least shrinks in j
    above = sum(jnp.where(d + 1 == j, at_least[j], 0) for j in range(1, bins + 1))
    t = t | (d << shift)
  emit_kept(idx_ref, keys, n_blocks, t, k - above, k, block)            # ties: lowest first


def emit_kept(idx_ref, keys, n_blocks, t, take_eq, kept, block: int) -> None:
  """Inside a one-row select kernel: write the positions whose key is above `t`, plus the first
  `take_eq` whose key equals it, ascending into idx_ref [k_max], then zeros after the `kept`
  written. `keys(i)` gives block i's (positions, keys). Shared with `topp_select`'s kernel."""
  k_max = idx_ref.shape[0]

  def emit(i, carry):
    written, eq_seen = carry
    pos, key = keys(i)
    eq = (key == t).astype(jnp.int32)
    keep = (key > t) | ((eq == 1) & (jnp.cumsum(eq) + eq_seen <= take_eq))
    keep_i = keep.astype(jnp.int32)
    slot = jnp.where(keep, jnp.cumsum(keep_i) - 1 + written, k_max)     # k_max: off the end
    plgpu.store(idx_ref.at[slot], pos, mask=keep)
    return written + jnp.sum(keep_i), eq_seen + jnp.sum(eq)
  jax.lax.fori_loop(0, n_blocks, emit, (jnp.int32(0), jnp.int32(0)))

  def pad(i, _):
    slot = i * block + jnp.arange(block, dtype=jnp.int32)
    plgpu.store(idx_ref.at[pl.ds(i * block, block)], jnp.zeros((block,), jnp.int32),
                mask=(slot >= kept) & (slot < k_max))
    return _
  jax.lax.fori_loop(kept // block, (k_max + block - 1) // block, pad, 0)


def _topk_pallas(scores, lengths, k, k_max, *, block, digit, num_warps, interpret):
  n, l = scores.shape
  bits = jax.lax.bitcast_convert_type(scores, jnp.uint16)    # no copy: a view of the same bytes
  return pl.pallas_call(
      functools.partial(_select_kernel, block=block, digit=digit),
      grid=(n,),
      in_specs=[pl.BlockSpec((None,), lambda i: (i,)),
                pl.BlockSpec((None,), lambda i: (i,)),
                pl.BlockSpec((None, l), lambda i: (i, 0))],
      out_specs=pl.BlockSpec((None, k_max), lambda i: (i, 0)),
      out_shape=jax.ShapeDtypeStruct((n, k_max), jnp.int32),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret,
      name=f"topk_select_d{digit}",
  )(lengths, k, bits)


@functools.partial(jax.jit, static_argnames=("k_max", "method", "interpret", "block", "digit",
                                             "num_warps"))
def topk_select(scores: jax.Array, lengths: jax.Array, k: jax.Array, *, k_max: int,
                method: str = "threshold", interpret: bool = False, block: int = 1024,
                digit: int = 4, num_warps: int = 4) -> jax.Array:
  """Exact top-k positions per row; same contract as topk_select_reference (see module doc).

  Returns indices [B, k_max] int32, the first k[b] of row b selected, the rest 0.
  method: 'threshold' (sorting-free XLA, positions in ascending order), 'pallas' (the same
  search in one Pallas program per row; bf16 scores only; `interpret`, `block` positions
  per tile, `digit` bits decided per pass and `num_warps` apply to it) or 'top_k' (lax.top_k,
  descending score order, i.e. the reference itself).
  """
  _check(scores, lengths, k, k_max)
  k = k.astype(jnp.int32)
  if method == "top_k":
    return topk_select_reference(scores, lengths, k, k_max=k_max)
  if method not in ("threshold", "pallas"):
    raise ValueError(f"method must be 'threshold', 'pallas' or 'top_k', got {method!r}")
  b, l = scores.shape
  if method == "pallas":
    if scores.dtype != jnp.bfloat16:
      raise ValueError(f"method='pallas' takes bf16 scores, got {scores.dtype}")
    if digit not in (1, 2, 4) or block < 16 or block & (block - 1):
      raise ValueError("digit must be 1, 2 or 4 and block a power of two >= 16; "
                       f"got {digit}, {block}")
    return _topk_pallas(scores, lengths.astype(jnp.int32), k, k_max, block=block, digit=digit,
                        num_warps=num_warps, interpret=interpret)
  in_prefix = jnp.arange(l)[None] < lengths[:, None]
  key, nbits = _ordered_key(scores, in_prefix)
  thresh = _kth_key(key, nbits, k)
  gt = key > thresh[:, None]
  eq = key == thresh[:, None]
  take_eq = k - jnp.sum(gt, axis=1, dtype=jnp.int32)               # ties: lowest positions first
  keep = gt | (eq & (jnp.cumsum(eq, axis=1, dtype=jnp.int32) <= take_eq[:, None]))
  return compact_positions(keep, k_max)
