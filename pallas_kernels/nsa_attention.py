"""Native Sparse Attention for verification (SSV's kernels): the compressed branch with the block
importance, and the selected and window branches fused with the gates, over groups of rows.

The contract is `jaxspec.model.nsa.nsa_attention`'s, the pure-JAX reference these kernels match
(its module docstring defines the branches, the caches, the chain and tree layouts and SSV's
schedules). Shapes (GQA, Hq = G * Hkv; per layer):
  q            [B, T, Hq, D]      the T new rows (a chain, or a whole tree flattened BFS or DFS)
  k, v         [B, S, Hkv, D]     the raw cache, the new rows' K/V already at lengths + t
  ck, cv       [B, C, Hkv, D]     the compressed cache (a chain's completed blocks written)
  lengths      [B] int32          entries before the new rows
  tree_bits    [T] or [B, T] int32, or None (a chain)

Two launches per layer, as SSV's refresh layers run (Section 5.1 of ../shared/papers/ssv.txt):
  `nsa_compressed`   the routing launch: each program takes `block_rows` adjacent rows x G query
                     heads of one KV head in one [M, D] tile (`online_softmax.pack_queries`'s
                     row order within the program), streams the compressed keys it sees with an
                     online softmax (a row sees block c once c*d + l - 1 <= its position: a block
                     completed by a draft mid-verification only from its last token on; a tree's
                     rows see the committed blocks and their own path's blocks, computed in XLA by
                     `nsa.path_blocks` and folded in one per-row column at a time), writes the
                     normalised branch output, then re-reads the compressed keys once more to turn
                     the final probabilities into selection-block importance: a tile of
                     `select_tile` selection blocks takes the compressed blocks overlapping it and
                     one product p [M, bc] @ overlap [bc, select_tile] (0/1, exact in float32);
                     the tiles past every row's own block are written as zeros without a read.
                     The G heads of a row are summed in XLA (a [T, G, NB] sum). One program per
                     (sequence, KV head, row tile) is 8 programs for one sequence of a model with
                     8 KV heads, far from filling 132 SMs; so while those programs do not fill
                     the SMs a chain runs this launch as two (`compressed_splits`): the key tiles
                     split in shares over programs, each writing its unnormalised online-softmax
                     state, merged in XLA as flash-decoding's splits are
                     (`online_softmax.combine_splits`); then the importance tiles split in
                     shares, each program reading the merged log-sum-exp.
  top-n              `nsa.select_blocks`, the reference's own lax.top_k over [B, T, Hkv, NB]
                     in XLA: NB = S / l' blocks a row (2048 at 128K and l' = 64), little next to
                     the attention's reads, and `topk_select` does not fit (a per-row k of token
                     positions over long rows, with no forced initial and local blocks and no
                     causal bound); selecting with the reference's code keeps the kernels' choice
                     the reference's for the same importance.
  `nsa_select_window` the downstream kernel: grid (Hkv, groups, 2 x splits) per sequence; a
                     program holds `group` adjacent rows x G heads ([M, D], M =
                     `pow2_rows(group * G)`) and folds one branch, selected or window, over one
                     share of that branch's key tiles, keeping one online-softmax state and
                     writing it unnormalised, as flash-decoding's splits do. XLA merges the
                     shares of each branch (`merge_shares`) and applies the three gates to the
                     selected and window outputs and the compressed branch's output. One state a
                     program, not one per branch: at G = 16 heads a merged group of 8 rows is a
                     [128, D] tile, and at D = 128 two f32 accumulators of that size are 128 KB,
                     all of a 4-warp program's registers (255 a thread); the splits also give a
                     short chain at batch 1 enough programs for the GPU (Hkv x T / group alone
                     is 16 programs at Hkv = 4, T = 32, group 8, on 132 SMs).
                       selected: the exact merged schedule loops over the group's union of
                       selected blocks (ascending, each once; sorted and deduplicated in XLA,
                       because Pallas's Triton lowering has no sort), loads each block's l' keys
                       once for all rows, and masks a row's logits to -inf on a block outside its
                       own list (`idx == block` over its n entries). Share s takes the blocks b
                       with b % splits == s (`split_schedule`). A fully masked block leaves a
                       row's state unchanged bit for bit (alpha = exp2(0) = 1, p = 0), so a row's
                       result is the same whatever the group: run alone it folds the same blocks
                       into the same shares in the same order. `shared=True` is the shared-index
                       schedule: the rows of a group carry one list (`nsa.shared_indices`, the
                       group's last row), which is the schedule itself: no union, no ownership
                       test.
                       window: the keys within `window` of each row, in tiles of the selection
                       block's key tile aligned to its multiples in the cache, tile i in share
                       i % splits, so that a row meets the same tiles in the same shares in any
                       group (the extra tiles of a group are fully masked for it).
                     Chain rows mask keys by position (key j <= the row's position). A tree's rows
                     see the cached keys by position and the new keys by their ancestor bits
                     (`online_softmax.window_visible`), in one last tile of the T new keys whose
                     positions (lengths + depth) decide the window and the selection block.
Reuse layers (`NSAInputs.indices` given) skip the importance pass; the fully fused single-launch
kernel of SSV's reuse layers (compressed branch inside the fused kernel) is not built.

Exactness: in float32 `nsa_select_window` with any group equals itself with group 1 and the same
`splits` bit for bit in interpret mode (tests/test_nsa_kernels.py), as the reference's merged
schedule does, and to float32 rounding when compiled for a GPU (a larger query tile sums in
another order); the kernels match the reference to float32 rounding, not bit for bit (base-2
exponentials, other sum orders). The default `splits` depends on the number of groups, so
compare groups at a given `splits`. On a GPU float32 products are TF32 unless the matmul
precision is 'highest'.

Backend: Pallas's Triton lowering, as `sparse_attention` (its docstring says why). Sizes the
Triton lowering needs are padded: the query tile to `pow2_rows`, the selection block's key tile
to a power of two >= 16 (keys past l' masked), the tree's new keys to `pow2_rows(T)`. Compiled
and timed on an H100 (benchmarks/RESULTS.md, sections on SSV's kernels).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxspec.model import nsa as _nsa
from jaxspec.model.config import NSAConfig
from pallas_kernels import online_softmax
from pallas_kernels.online_softmax import LOG2E, NEG_INF, pow2_rows

_BIG = np.iinfo(np.int32).max     # sorts after every block index


def _check(q, k, v, lengths):
  if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape:
    raise ValueError(f"expected q [B,T,Hq,D] and k, v [B,S,Hkv,D]; got {q.shape}, {k.shape}, "
                     f"{v.shape}")
  b, _, hq, d = q.shape
  if k.shape[0] != b or k.shape[3] != d or hq % k.shape[2]:
    raise ValueError(f"q {q.shape} does not match cache {k.shape} (batch, head_dim, GQA grouping)")
  if lengths.shape != (b,):
    raise ValueError(f"lengths must be [B]={b}, got {lengths.shape}")
  if d < 16 or d & (d - 1):
    raise ValueError(f"head_dim must be a power of two >= 16 for tl.dot, got {d}")


def _pow2(n: int) -> int:
  return max(16, 1 << (n - 1).bit_length())


# ----------------------------------------------------------------------------------------------
# Rows in programs: program p holds rows p*rows .. p*rows + rows - 1, packed row r = (t - p*rows)
# * G + g; the rows past T and past rows * G repeat the program's last real row (its position and
# bits keep every mask sensible; their outputs are dropped).

def _row_table(t: int, g: int, rows: int) -> tuple[np.ndarray, np.ndarray, int]:
  """(src_t, src_g [NP, M] int: the row and head each packed row copies, M)."""
  m_rows = pow2_rows(rows * g)
  n_prog = -(-t // rows)
  r = np.minimum(np.arange(m_rows), rows * g - 1)
  src_t = np.minimum(np.arange(n_prog)[:, None] * rows + r[None] // g, t - 1)
  return src_t, np.broadcast_to(r % g, src_t.shape), m_rows


def _pack_heads(x: jax.Array, hkv: int, src_t: np.ndarray, src_g: np.ndarray) -> jax.Array:
  """x [B, T, Hq, ...] -> [B, Hkv, NP, M, ...]."""
  b, t, hq = x.shape[:3]
  x = x.reshape(b, t, hkv, hq // hkv, *x.shape[3:])
  return jnp.moveaxis(x, 2, 1)[:, :, src_t, src_g]


def _unpack(o: jax.Array, t: int, g: int, rows: int) -> jax.Array:
  """[B, Hkv, NP, M, ...] -> [B, T, Hq, ...]: the real packed rows back in place."""
  b, hkv = o.shape[:2]
  tt, gg = np.meshgrid(np.arange(t), np.arange(g), indexing="ij")
  x = o[:, :, tt // rows, (tt % rows) * g + gg]                # [B, Hkv, T, G, ...]
  return jnp.moveaxis(x, 1, 2).reshape(b, t, hkv * g, *o.shape[4:])


# ----------------------------------------------------------------------------------------------
# The compressed branch and the block importance

def _fold_column(state, s, v):
  """Fold one key per row in: s [M] base-2 logits (-inf where masked), v [M, D] each row's value
  (a tree row's own path block: a different key per row, so no tile product)."""
  acc, m_i, l_i = state
  m_new = jnp.maximum(m_i, s)
  alpha = jnp.exp2(m_i - m_new)
  p = jnp.exp2(s - m_new)
  return acc * alpha[:, None] + p[:, None] * v, m_new, l_i * alpha + p


def _compressed_end(pos, length, c_total: int, cfg: NSAConfig, num_path: int):
  """The end of the compressed blocks a program reads: for a chain those ending at or before its
  last row, for a tree (num_path > 0) the committed ones, ending before the new rows (the rest
  come from each row's path)."""
  l, d = cfg.compress_block, cfg.compress_stride
  if num_path:
    c_end = jnp.maximum(length - l + d, 0) // d
  else:
    c_end = jnp.maximum(jnp.max(pos) - l + 1 + d, 0) // d
  return jnp.minimum(c_end, c_total)


def _logits(q, ck_ref, pos, c_end, c0, size: int, qk_scale: float, cfg: NSAConfig,
            num_path: int):
  """(the block indices c0 .. c0 + size - 1, their base-2 logits [M, size], -inf where a row does
  not see the block)."""
  l, d = cfg.compress_block, cfg.compress_stride
  cols = c0 + jnp.arange(size)
  k = plgpu.load(ck_ref.at[pl.ds(c0, size), :], mask=(cols < c_end)[:, None], other=0.)
  s = online_softmax.dot_t(q, k) * qk_scale
  live = (cols < c_end)[None, :]
  if num_path:
    visible = live & (cols < ck_ref.shape[0])[None, :]
  else:
    visible = live & ((cols * d + l - 1)[None, :] <= pos[:, None])
  return cols, jnp.where(visible, s, NEG_INF)


def _importance_tiles(imp_ref, logits, pos, m_i, inv, lo, hi, *, cfg: NSAConfig,
                      select_tile: int, block_i: int, path=None):
  """Importance tiles lo .. hi - 1 (select_tile selection blocks each) of imp_ref [M, NB]: each
  row's probability mass per selection block from its final max m_i and 1 / sum inv. A tile takes
  the compressed blocks overlapping it (c*d + l > j0*l' and c*d < (j0 + select_tile)*l') and one
  product p [M, bc] @ overlap [bc, select_tile] (0/1, exact in float32); tiles past every row's
  own block are written as zeros without a read. path: (pblk_ref, the path columns' logits)."""
  l, d, ls = cfg.compress_block, cfg.compress_stride, cfg.select_block
  m_rows, nb = imp_ref.shape

  def chunk(ci, _):
    j0 = ci * select_tile
    js = j0 + jnp.arange(select_tile)
    c_lo = jnp.maximum(j0 * ls - l + d, 0) // d
    cols, s = logits(c_lo, block_i)
    p = jnp.exp2(s - m_i[:, None]) * inv[:, None]
    start = (cols * d)[:, None]
    overlap = ((start < ((js + 1) * ls)[None, :]) & (start + l > (js * ls)[None, :]))
    imp = jax.lax.dot_general(p, overlap.astype(jnp.float32), (((1,), (0,)), ((), ())),
                              precision=jax.lax.Precision.HIGHEST,
                              preferred_element_type=jnp.float32)
    if path is not None:
      pblk_ref, path_s = path
      for e, ps in enumerate(path_s):
        first = pblk_ref[e] * d
        over = ((first < (js + 1) * ls) & (first + l > js * ls)).astype(jnp.float32)
        imp = imp + (jnp.exp2(ps - m_i) * inv)[:, None] * over[None, :]
    plgpu.store(imp_ref.at[:, pl.ds(j0, select_tile)], imp, mask=(js < nb)[None, :])
    return _

  def zeros(ci, _):
    js = ci * select_tile + jnp.arange(select_tile)
    plgpu.store(imp_ref.at[:, pl.ds(ci * select_tile, select_tile)],
                jnp.zeros((m_rows, select_tile), jnp.float32), mask=(js < nb)[None, :])
    return _

  n_live = jnp.minimum(pl.cdiv(jnp.max(pos) // ls + 1, select_tile), pl.cdiv(nb, select_tile))
  jax.lax.fori_loop(lo, jnp.minimum(hi, n_live), chunk, 0)
  jax.lax.fori_loop(jnp.maximum(lo, n_live), hi, zeros, 0)


def _compressed_kernel(len_ref, pos_ref, q_ref, ck_ref, cv_ref, *refs, sm_scale: float,
                       cfg: NSAConfig, block_c: int, select_tile: int, block_i: int,
                       num_path: int, importance: bool):
  # len_ref   []        int32  cache entries before the new rows
  # pos_ref   [M]       int32  each packed row's position
  # q_ref     [M, D]           this program's rows of this KV head
  # ck_ref    [C, D]           this KV head's compressed keys (cv_ref: values)
  # with a tree (num_path > 0): pblk_ref [E] int32 the path blocks' indices, pk_ref, pv_ref
  #   [E, M, D] f32 each packed row's path blocks (keys, values)
  # o_ref     [M, D]    f32    the branch output, normalised
  # imp_ref   [M, NB]   f32    (importance) each packed row's probability mass per selection block
  if num_path:
    pblk_ref, pk_ref, pv_ref, *refs = refs
  o_ref, *refs = refs
  imp_ref = refs[0] if importance else None
  l, d = cfg.compress_block, cfg.compress_stride
  m_rows = q_ref.shape[0]
  pos = pos_ref[...]
  q = q_ref[...]
  qk_scale = sm_scale * LOG2E
  c_end = _compressed_end(pos, len_ref[()], ck_ref.shape[0], cfg, num_path)
  logits = functools.partial(_logits, q, ck_ref, pos, c_end, qk_scale=qk_scale, cfg=cfg,
                             num_path=num_path)

  def step(i, state):
    c0 = i * block_c
    cols, s = logits(c0, block_c)
    v = plgpu.load(cv_ref.at[pl.ds(c0, block_c), :], mask=(cols < c_end)[:, None], other=0.)
    return online_softmax.update(state, s, v)

  state = jax.lax.fori_loop(0, pl.cdiv(c_end, block_c), step,
                            online_softmax.init(m_rows, q.shape[1]))
  path_s = []
  for e in range(num_path):
    end = pblk_ref[e] * d + l - 1
    s = jnp.sum(q.astype(jnp.float32) * pk_ref[e], axis=1) * qk_scale
    s = jnp.where(end <= pos, s, NEG_INF)
    path_s.append(s)
    state = _fold_column(state, s, pv_ref[e])
  acc, m_i, l_i = state
  inv = 1.0 / jnp.where(l_i > 0, l_i, 1.0)
  o_ref[...] = acc * inv[:, None]
  if importance:
    _importance_tiles(imp_ref, logits, pos, m_i, inv, 0, pl.cdiv(imp_ref.shape[1], select_tile),
                      cfg=cfg, select_tile=select_tile, block_i=block_i,
                      path=(pblk_ref, path_s) if num_path else None)


def _compressed_split_kernel(pos_ref, q_ref, ck_ref, cv_ref, o_ref, m_ref, l_ref, *,
                             sm_scale: float, cfg: NSAConfig, block_c: int, num_splits: int):
  # A chain's compressed branch, share s = program_id(2) of the key tiles: the unnormalised
  # online-softmax state (acc [M, D], m [M], l [M]) of those tiles, merged in XLA as
  # flash-decoding's splits are.
  pos = pos_ref[...]
  q = q_ref[...]
  c_end = _compressed_end(pos, None, ck_ref.shape[0], cfg, 0)
  n_tiles = pl.cdiv(c_end, block_c)
  per = pl.cdiv(n_tiles, num_splits)
  lo = pl.program_id(2) * per

  def step(i, state):
    c0 = i * block_c
    cols, s = _logits(q, ck_ref, pos, c_end, c0, block_c, sm_scale * LOG2E, cfg, 0)
    v = plgpu.load(cv_ref.at[pl.ds(c0, block_c), :], mask=(cols < c_end)[:, None], other=0.)
    return online_softmax.update(state, s, v)

  acc, m_i, l_i = jax.lax.fori_loop(lo, jnp.minimum(lo + per, n_tiles), step,
                                    online_softmax.init(q.shape[0], q.shape[1]))
  o_ref[...] = acc
  m_ref[...] = m_i
  l_ref[...] = l_i


def _importance_split_kernel(pos_ref, q_ref, ck_ref, lse_ref, imp_ref, *, sm_scale: float,
                             cfg: NSAConfig, select_tile: int, block_i: int, num_splits: int):
  # A chain's importance, share s = program_id(2) of the tiles, from the merged base-2
  # log-sum-exp lse_ref [M] (the probabilities are exp2(s - lse), so 1 / sum is 1).
  pos = pos_ref[...]
  q = q_ref[...]
  c_end = _compressed_end(pos, None, ck_ref.shape[0], cfg, 0)
  logits = functools.partial(_logits, q, ck_ref, pos, c_end, qk_scale=sm_scale * LOG2E, cfg=cfg,
                             num_path=0)
  n_chunks = pl.cdiv(imp_ref.shape[1], select_tile)
  per = pl.cdiv(n_chunks, num_splits)
  lo = pl.program_id(2) * per
  lse = lse_ref[...]
  _importance_tiles(imp_ref, logits, pos, lse, jnp.ones_like(lse), lo,
                    jnp.minimum(lo + per, n_chunks), cfg=cfg, select_tile=select_tile,
                    block_i=block_i)


def _compressed_unbatched(length, pos, q, ck, cv, path=None, *, sm_scale, cfg, num_blocks,
                          block_c, select_tile, importance, num_warps, num_stages, interpret):
  """length [], pos [NP, M], q [Hkv, NP, M, D], ck/cv [C, Hkv, D], path None or (pblk [E],
  pk/pv [Hkv, NP, E, M, D]) -> o [Hkv, NP, M, D] f32 (and importance [Hkv, NP, M, NB] f32)."""
  hkv, n_prog, m_rows, d = q.shape
  c = ck.shape[0]
  num_path = 0 if path is None else path[0].shape[0]
  l, st, ls = cfg.compress_block, cfg.compress_stride, cfg.select_block
  # Compressed blocks overlapping select_tile selection blocks: starts in an interval of
  # select_tile * l' + l - 1 positions, one every d.
  block_i = _pow2((select_tile * ls + l - 2) // st + 1)
  kernel = functools.partial(_compressed_kernel, sm_scale=sm_scale, cfg=cfg, block_c=block_c,
                             select_tile=select_tile, block_i=block_i, num_path=num_path,
                             importance=importance)
  in_specs = [pl.BlockSpec((), lambda h, i: ()),
              pl.BlockSpec((None, m_rows), lambda h, i: (i, 0)),
              pl.BlockSpec((None, None, m_rows, d), lambda h, i: (h, i, 0, 0)),
              pl.BlockSpec((c, None, d), lambda h, i: (0, h, 0)),
              pl.BlockSpec((c, None, d), lambda h, i: (0, h, 0))]
  args = [length, pos, q, ck, cv]
  if path is not None:
    in_specs += [pl.BlockSpec((num_path,), lambda h, i: (0,))] + [
        pl.BlockSpec((None, None, num_path, m_rows, d), lambda h, i: (h, i, 0, 0, 0))] * 2
    args += list(path)
  out_specs = [pl.BlockSpec((None, None, m_rows, d), lambda h, i: (h, i, 0, 0))]
  out_shape = [jax.ShapeDtypeStruct((hkv, n_prog, m_rows, d), jnp.float32)]
  if importance:
    out_specs.append(pl.BlockSpec((None, None, m_rows, num_blocks), lambda h, i: (h, i, 0, 0)))
    out_shape.append(jax.ShapeDtypeStruct((hkv, n_prog, m_rows, num_blocks), jnp.float32))
  return pl.pallas_call(
      kernel,
      grid=(hkv, n_prog),
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name=(f"nsa_compressed_m{m_rows}_d{d}" + ("_tree" if path is not None else "")
            + ("_importance" if importance else "")),
  )(*args)


def _compressed_split_unbatched(pos, q, ck, cv, *, sm_scale, cfg, num_blocks, block_c,
                                select_tile, importance, splits, num_warps, num_stages,
                                interpret):
  """The chain's compressed branch as two launches, each over `splits` = (key-tile shares,
  importance-tile shares) programs per (KV head, row tile): pos [NP, M], q [Hkv, NP, M, D], ck/cv
  [C, Hkv, D] -> o [Hkv, NP, M, D] f32 (and importance [Hkv, NP, M, NB] f32)."""
  hkv, n_prog, m_rows, d = q.shape
  c = ck.shape[0]
  l, st, ls = cfg.compress_block, cfg.compress_stride, cfg.select_block
  block_i = _pow2((select_tile * ls + l - 2) // st + 1)
  params = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
  pos_spec = pl.BlockSpec((None, m_rows), lambda h, i, s: (i, 0))
  q_spec = pl.BlockSpec((None, None, m_rows, d), lambda h, i, s: (h, i, 0, 0))
  kv_spec = pl.BlockSpec((c, None, d), lambda h, i, s: (0, h, 0))
  row_spec = pl.BlockSpec((None, None, None, m_rows), lambda h, i, s: (h, i, s, 0))
  share_kernel = functools.partial(_compressed_split_kernel, sm_scale=sm_scale, cfg=cfg,
                                   block_c=block_c, num_splits=splits[0])
  o, m, l_sum = pl.pallas_call(
      share_kernel, grid=(hkv, n_prog, splits[0]),
      in_specs=[pos_spec, q_spec, kv_spec, kv_spec],
      out_specs=[pl.BlockSpec((None, None, None, m_rows, d), lambda h, i, s: (h, i, s, 0, 0)),
                 row_spec, row_spec],
      out_shape=[jax.ShapeDtypeStruct((hkv, n_prog, splits[0], m_rows, d), jnp.float32),
                 jax.ShapeDtypeStruct((hkv, n_prog, splits[0], m_rows), jnp.float32),
                 jax.ShapeDtypeStruct((hkv, n_prog, splits[0], m_rows), jnp.float32)],
      compiler_params=params, interpret=interpret,
      name=f"nsa_compressed_m{m_rows}_d{d}_shares")(pos, q, ck, cv)
  out, lse2 = online_softmax.combine_splits(o, m, l_sum)
  if not importance:
    return (out,)
  # p = exp2(s - lse2): a row with nothing visible has lse2 = -inf, clamped to the finite start
  # of a running max so that its masked logits give 0, as in the one-launch kernel.
  lse2 = jnp.maximum(lse2, online_softmax.MAX_INIT)
  stat_spec = pl.BlockSpec((None, None, m_rows), lambda h, i, s: (h, i, 0))
  imp_kernel = functools.partial(_importance_split_kernel, sm_scale=sm_scale, cfg=cfg,
                                 select_tile=select_tile, block_i=block_i, num_splits=splits[1])
  # Every share writes its own tiles of the row tile's [M, NB] block.
  imp = pl.pallas_call(
      imp_kernel, grid=(hkv, n_prog, splits[1]),
      in_specs=[pos_spec, q_spec, kv_spec, stat_spec],
      out_specs=pl.BlockSpec((None, None, m_rows, num_blocks), lambda h, i, s: (h, i, 0, 0)),
      out_shape=jax.ShapeDtypeStruct((hkv, n_prog, m_rows, num_blocks), jnp.float32),
      compiler_params=params, interpret=interpret,
      name=f"nsa_importance_m{m_rows}_d{d}_shares")(pos, q, ck, lse2)
  return out, imp


def compressed_splits(pairs: int, c: int, num_blocks: int, block_c: int, select_tile: int
                      ) -> tuple[int, int]:
  """(key-tile shares, importance-tile shares) per (sequence, KV head, row tile) for `pairs` of
  them: one each (the one-launch kernel) once the pairs alone fill the GPU's SMs, else enough for
  about `online_softmax.DEFAULT_PROGRAMS` programs, at most one a tile."""
  if pairs >= online_softmax.SMS:
    return 1, 1
  return (online_softmax.default_splits(pairs, pl.cdiv(c, block_c)),
          online_softmax.default_splits(pairs, pl.cdiv(num_blocks, select_tile)))


@functools.partial(jax.jit, static_argnames=(
    "cfg", "num_blocks", "importance", "interpret", "block_rows", "block_c", "select_tile",
    "splits", "num_warps", "num_stages"))
def nsa_compressed(q: jax.Array, ck: jax.Array, cv: jax.Array, lengths: jax.Array,
                   pos: jax.Array, path: tuple[jax.Array, jax.Array, jax.Array] | None = None, *,
                   cfg: NSAConfig, num_blocks: int, importance: bool = True,
                   interpret: bool = False, block_rows: int | None = None, block_c: int = 64,
                   select_tile: int = 16, splits: tuple[int, int] | None = None,
                   num_warps: int = 4, num_stages: int = 2
                   ) -> tuple[jax.Array, jax.Array | None]:
  """The compressed branch (`nsa.compressed_attention`'s contract): q [B, T, Hq, D], the
  compressed cache ck/cv [B, C, Hkv, D], lengths [B], the rows' positions pos [B, T]
  (`nsa.layout`), and for a tree `path` = (keys, values [B, T, E, Hkv, D] f32, block indices
  [B, E]) from `nsa.path_blocks` (None: a chain). Returns (out [B, T, Hq, D] f32, importance
  [B, T, Hkv, num_blocks] f32, or None with importance=False).

  Knobs: `block_rows` rows per program (default: as many as fill 16 packed rows, at most T),
  `block_c` compressed blocks per tile, `select_tile` selection blocks per importance tile (powers
  of two >= 16), `splits` (key-tile shares, importance-tile shares) per program of a chain
  (default `compressed_splits`: (1, 1), the one-launch kernel, once the (sequence, KV head, row
  tile) programs fill the SMs; a tree always runs the one-launch kernel), Triton's `num_warps`
  and `num_stages`."""
  _check(q, ck, cv, lengths)
  for name, value in (("block_c", block_c), ("select_tile", select_tile)):
    if value < 16 or value & (value - 1):
      raise ValueError(f"{name} must be a power of two >= 16, got {value}")
  b, t, hq, d = q.shape
  hkv = ck.shape[2]
  g = hq // hkv
  if pos.shape != (b, t):
    raise ValueError(f"pos must be [B, T]={(b, t)}, got {pos.shape}")
  rows = block_rows or max(1, min(t, 16 // g))
  src_t, src_g, _ = _row_table(t, g, rows)
  qp = _pack_heads(q, hkv, src_t, src_g)                           # [B, Hkv, NP, M, D]
  posp = pos.astype(jnp.int32)[:, src_t]                          # [B, NP, M]
  packed_path = None
  if path is not None:
    pk, pv, pblk = path
    # [B, T, E, Hkv, D] -> [B, Hkv, NP, E, M, D]: a row's path blocks for each of its G heads.
    pack = lambda x: jnp.moveaxis(jnp.moveaxis(x, 3, 1)[:, :, src_t], 4, 3)
    packed_path = (pblk.astype(jnp.int32), pack(pk), pack(pv))
  if splits is None:
    splits = compressed_splits(b * hkv * qp.shape[2], ck.shape[1], num_blocks, block_c,
                               select_tile)
  if len(splits) != 2 or min(splits) < 1:
    raise ValueError(f"splits must be two positive counts (key tiles, importance tiles), got "
                     f"{splits}")
  if path is None and splits != (1, 1):
    outs = jax.vmap(functools.partial(
        _compressed_split_unbatched, sm_scale=d ** -0.5, cfg=cfg, num_blocks=num_blocks,
        block_c=block_c, select_tile=select_tile, importance=importance, splits=tuple(splits),
        num_warps=num_warps, num_stages=num_stages, interpret=interpret))(posp, qp, ck, cv)
  else:
    outs = jax.vmap(functools.partial(
        _compressed_unbatched, sm_scale=d ** -0.5, cfg=cfg, num_blocks=num_blocks,
        block_c=block_c, select_tile=select_tile, importance=importance, num_warps=num_warps,
        num_stages=num_stages, interpret=interpret))(
            lengths.astype(jnp.int32), posp, qp, ck, cv, packed_path)
  out = _unpack(outs[0], t, g, rows)
  if not importance:
    return out, None
  imp = _unpack(outs[1], t, g, rows)                              # [B, T, Hq, NB]
  return out, imp.reshape(b, t, hkv, g, num_blocks).sum(axis=3)


# ----------------------------------------------------------------------------------------------
# The selected and window branches, fused with the gates

def _fused_kernel(len_ref, cnt_ref, sched_ref, idx_ref, pos_ref, q_ref, k_ref, v_ref, *refs,
                  sm_scale: float, cfg: NSAConfig, t: int, splits: int, tree: bool,
                  shared: bool):
  # grid (Hkv, NG, 2 * splits): program j folds one branch, the selected one (j < splits) or the
  # window, and of that branch's key tiles the share j % splits (`nsa_select_window` says which).
  # len_ref   []       int32  cache entries before the new rows
  # cnt_ref   []       int32  blocks in this share of the group's selected schedule
  # sched_ref [U]      int32  this share of the schedule: selected blocks, ascending, each once
  # idx_ref   [n, M]   int32  each packed row's own selected blocks (-1 unused)
  # pos_ref   [M]      int32  each packed row's position
  # q_ref     [M, D]          this group's rows of this KV head
  # k_ref     [S, D]          this KV head's keys (v_ref: values)
  # with a tree: bits_ref [M] int32 each packed row's ancestor bits; kpos_ref [TN] int32 the new
  #   keys' positions
  # o_ref     [M, D]   f32    the branch's unnormalised partial (m_ref, l_ref [M]: its max and
  #                           denominator), merged over the shares by `combine_splits` in XLA
  if tree:
    bits_ref, kpos_ref, o_ref, m_ref, l_ref = refs
  else:
    o_ref, m_ref, l_ref = refs
  s_total = k_ref.shape[0]
  m_rows, d = q_ref.shape
  ls, w, n = cfg.select_block, cfg.window, idx_ref.shape[0]
  tile = _pow2(ls)            # keys a tile, in both branches
  job = pl.program_id(2)
  selected = job < splits
  split = job % splits
  length = len_ref[()]
  pos = pos_ref[...]
  q = q_ref[...]
  qk_scale = sm_scale * LOG2E
  # The last cached key any row of the group reads by position: a chain's rows read up to their
  # own position, a tree's the prefix (its new keys come in the last tile, by their bits).
  last = length - 1 if tree else jnp.max(pos)

  def fold(state, k0, live, visible):
    cols = k0 + jnp.arange(tile)
    live = live & (cols <= last) & (cols < s_total)
    k = plgpu.load(k_ref.at[pl.ds(k0, tile), :], mask=live[:, None], other=0.)
    v = plgpu.load(v_ref.at[pl.ds(k0, tile), :], mask=live[:, None], other=0.)
    s = online_softmax.dot_t(q, k) * qk_scale
    return online_softmax.update(state, jnp.where(live[None, :] & visible, s, NEG_INF), v)

  def by_position(cols):
    return cols[None, :] <= pos[:, None]      # the tree's cached keys: all < length <= pos

  # Selected branch: this share of the schedule in ascending order, each block loaded once for
  # all rows. One state a program: the two branches' loops run one after the other on it, and
  # the other branch's loop runs no step.
  def sel_step(u, state):
    blk = sched_ref[u]
    k0 = blk * ls
    visible = by_position(k0 + jnp.arange(tile))
    if not shared:
      own = idx_ref[0, :] == blk
      for j in range(1, n):
        own = own | (idx_ref[j, :] == blk)
      visible = visible & own[:, None]
    return fold(state, k0, jnp.arange(tile) < ls, visible)

  state = jax.lax.fori_loop(0, jnp.where(selected, cnt_ref[()], 0), sel_step,
                            online_softmax.init(m_rows, d))

  # Window branch: the tiles (multiples of `tile` in the cache) from the group's earliest window
  # key to `last`, tile i in share i % splits.
  first = jnp.maximum(jnp.min(pos) - w + 1, 0) // tile
  start = first + (split - first % splits + splits) % splits
  n_win = jnp.where(selected, 0, jnp.maximum(last // tile - start + splits, 0) // splits)

  def win_step(i, state):
    k0 = (start + i * splits) * tile
    cols = k0 + jnp.arange(tile)
    visible = by_position(cols) & (cols[None, :] > pos[:, None] - w)
    return fold(state, k0, cols >= 0, visible)

  state = jax.lax.fori_loop(0, n_win, win_step, state)

  if tree:
    # The T new keys, one tile, in each branch's last share: seen by the rows whose bits name
    # them, placed by their positions.
    tn = kpos_ref.shape[0]
    cols = length + jnp.arange(tn)
    live = (jnp.arange(tn) < t) & (cols < s_total) & (split == splits - 1)
    k = plgpu.load(k_ref.at[pl.ds(length, tn), :], mask=live[:, None], other=0.)
    v = plgpu.load(v_ref.at[pl.ds(length, tn), :], mask=live[:, None], other=0.)
    s = online_softmax.dot_t(q, k) * qk_scale
    kpos = kpos_ref[...]
    seen = live[None, :] & online_softmax.window_visible(bits_ref[...][:, None], cols[None, :],
                                                         length)
    kblk = (kpos // ls)[None, :]
    in_sel = idx_ref[0, :][:, None] == kblk
    for j in range(1, n):
      in_sel = in_sel | (idx_ref[j, :][:, None] == kblk)
    mask = jnp.where(selected, seen & in_sel, seen & (kpos[None, :] > pos[:, None] - w))
    state = online_softmax.update(state, jnp.where(mask, s, NEG_INF), v)

  o_ref[...], m_ref[...], l_ref[...] = state


def _fused_unbatched(length, counts, sched, idx, pos, q, k, v, tree=None, *, sm_scale, cfg, t,
                     splits, shared, num_warps, num_stages, interpret):
  """length [], counts [Hkv, NG, splits], sched [Hkv, NG, splits, U], idx [Hkv, NG, n, M],
  pos [NG, M], q [Hkv, NG, M, D], k/v [S, Hkv, D], tree None or (bits [NG, M], kpos [TN]) ->
  the partials (o [Hkv, NG, 2 * splits, M, D], m and l [Hkv, NG, 2 * splits, M]) f32."""
  hkv, ng, m_rows, d = q.shape
  s = k.shape[0]
  u, n = sched.shape[-1], idx.shape[2]
  kernel = functools.partial(_fused_kernel, sm_scale=sm_scale, cfg=cfg, t=t, splits=splits,
                             tree=tree is not None, shared=shared)
  tile = lambda *shape: pl.BlockSpec((None, None) + shape,
                                     lambda h, i, j: (h, i) + (0,) * len(shape))
  share = lambda *shape: pl.BlockSpec((None, None, None) + shape,
                                      lambda h, i, j: (h, i, j % splits) + (0,) * len(shape))
  job = lambda *shape: pl.BlockSpec((None, None, None) + shape,
                                    lambda h, i, j: (h, i, j) + (0,) * len(shape))
  in_specs = [pl.BlockSpec((), lambda h, i, j: ()), share(), share(u), tile(n, m_rows),
              pl.BlockSpec((None, m_rows), lambda h, i, j: (i, 0)), tile(m_rows, d),
              pl.BlockSpec((s, None, d), lambda h, i, j: (0, h, 0)),
              pl.BlockSpec((s, None, d), lambda h, i, j: (0, h, 0))]
  args = [length, counts, sched, idx, pos, q, k, v]
  if tree is not None:
    in_specs += [pl.BlockSpec((None, m_rows), lambda h, i, j: (i, 0)),
                 pl.BlockSpec((tree[1].shape[0],), lambda h, i, j: (0,))]
    args += list(tree)
  parts = (hkv, ng, 2 * splits, m_rows)
  return pl.pallas_call(
      kernel,
      grid=(hkv, ng, 2 * splits),
      in_specs=in_specs,
      out_specs=[job(m_rows, d), job(m_rows), job(m_rows)],
      out_shape=[jax.ShapeDtypeStruct(parts + (d,), jnp.float32),
                 jax.ShapeDtypeStruct(parts, jnp.float32),
                 jax.ShapeDtypeStruct(parts, jnp.float32)],
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name=(f"nsa_select_window_m{m_rows}_d{d}" + ("_tree" if tree is not None else "")
            + ("_shared" if shared else "_merged")),
  )(*args)


def merged_schedule(indices: jax.Array, group: int) -> tuple[jax.Array, jax.Array]:
  """The exact merged schedule: indices [B, T, Hkv, n] (-1 unused) -> (union [B, NG, Hkv, U]
  int32, each group of `group` adjacent rows' selected blocks ascending and each once, 0 past the
  count; counts [B, NG, Hkv] int32), NG = ceil(T / group), U = group * n."""
  b, t, hkv, n = indices.shape
  ng = -(-t // group)
  idx = jnp.pad(indices, ((0, 0), (0, ng * group - t), (0, 0), (0, 0)), constant_values=-1)
  flat = jnp.where(idx < 0, _BIG, idx).reshape(b, ng, group, hkv, n).transpose(0, 1, 3, 2, 4)
  flat = jnp.sort(flat.reshape(b, ng, hkv, group * n), axis=-1)
  dup = jnp.concatenate([jnp.zeros_like(flat[..., :1], bool), flat[..., 1:] == flat[..., :-1]],
                        axis=-1)
  flat = jnp.sort(jnp.where(dup, _BIG, flat), axis=-1)
  return jnp.where(flat == _BIG, 0, flat).astype(jnp.int32), (flat != _BIG).sum(-1).astype(
      jnp.int32)


def shared_schedule(indices: jax.Array, group: int) -> tuple[jax.Array, jax.Array]:
  """The shared-index schedule: each group's last row's list as the group's (indices already
  `nsa.shared_indices(indices, group)`) -> (union [B, NG, Hkv, n], counts [B, NG, Hkv])."""
  t = indices.shape[1]
  rep = np.minimum(np.arange(-(-t // group)) * group + group - 1, t - 1)
  own = indices[:, rep]                                  # ascending, -1 after the last
  return jnp.maximum(own, 0).astype(jnp.int32), (own >= 0).sum(-1).astype(jnp.int32)


def split_schedule(union: jax.Array, counts: jax.Array, splits: int
                   ) -> tuple[jax.Array, jax.Array]:
  """A schedule (union [..., U] ascending, counts [...]) -> its shares (sched [..., splits, U]
  int32, share s the blocks b with b % splits == s, ascending, 0 past its count; counts
  [..., splits] int32). Shares by block index, not by place in the union, so a row's blocks fall
  in the same shares, in the same order, whatever group it is in."""
  valid = jnp.arange(union.shape[-1]) < counts[..., None]
  mine = valid[..., None, :] & (union[..., None, :] % splits
                                == jnp.arange(splits)[:, None])        # [..., splits, U]
  sched = jnp.sort(jnp.where(mine, union[..., None, :], _BIG), axis=-1)
  return jnp.where(sched == _BIG, 0, sched).astype(jnp.int32), mine.sum(-1).astype(jnp.int32)


def default_select_splits(batch: int, hkv: int, groups: int, n: int) -> int:
  """Shares per branch so that the grid, B x Hkv x NG x 2 branches x shares, holds about
  `online_softmax.DEFAULT_PROGRAMS` programs; at most n (a row's selected blocks)."""
  return online_softmax.default_splits(batch * hkv * groups * 2, n)


def merge_shares(o: jax.Array, m: jax.Array, l: jax.Array) -> jax.Array:
  """The shares' partials o [..., P, M, D], m and l [..., P, M] -> the normalised branch
  [..., M, D] (0 for a row with nothing visible). `combine_splits`'s arithmetic with the sums
  written out share by share, so that their order is fixed: a reduction's order is XLA's to
  choose and may change with the shape, and the merged schedule's output must not change with
  the group."""
  p = o.shape[-3]
  m_max = jnp.max(m, axis=-2)
  w = [jnp.exp2(m[..., i, :] - m_max) for i in range(p)]
  l_sum, acc = w[0] * l[..., 0, :], w[0][..., None] * o[..., 0, :, :]
  for i in range(1, p):
    l_sum = l_sum + w[i] * l[..., i, :]
    acc = acc + w[i][..., None] * o[..., i, :, :]
  return acc / jnp.maximum(l_sum, 1e-30)[..., None]


@functools.partial(jax.jit, static_argnames=(
    "cfg", "group", "shared", "splits", "interpret", "num_warps", "num_stages"))
def nsa_select_window(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array,
                      pos: jax.Array, indices: jax.Array, gates: jax.Array, cmp: jax.Array, *,
                      cfg: NSAConfig, tree_bits: jax.Array | None = None, group: int = 1,
                      shared: bool = False, splits: int | None = None, interpret: bool = False,
                      num_warps: int | None = None, num_stages: int = 3) -> jax.Array:
  """The selected and window branches and the gated sum: q [B, T, Hq, D], the raw cache k/v
  [B, S, Hkv, D], lengths [B], the rows' positions pos [B, T] (`nsa.layout`), the selected blocks
  indices [B, T, Hkv, n] int32 (-1 unused), gates [B, T, Hq, 3], the compressed branch's output
  cmp [B, T, Hq, D]. Returns out [B, T, Hq, D] in q.dtype: what `nsa.nsa_attention` mixes,
  gates[..., 0] * cmp + gates[..., 1] * selected + gates[..., 2] * window.

  group: rows per program. shared=False runs the exact merged schedule over each group (the
  output does not depend on group); shared=True the shared-index schedule: the rows of a group
  must carry one list (`nsa.shared_indices(indices, group)`). splits: programs per (group, KV
  head, branch), each folding a share of the branch's key tiles (flash-decoding's split, by block
  index: `split_schedule`), merged in XLA; None for `default_select_splits`. Triton's
  `num_warps` (None: 4 for query tiles up to 64 rows, 8 above) and `num_stages` (the defaults
  were the fastest on an H100 at 32K, T = 32, B = 1 and 16: benchmarks/RESULTS.md)."""
  _check(q, k, v, lengths)
  if group < 1:
    raise ValueError(f"NSA group must be a positive number of rows, got {group}")
  if splits is not None and splits < 1:
    raise ValueError(f"splits must be a positive number of programs, got {splits}")
  b, t, hq, d = q.shape
  hkv = k.shape[2]
  g = hq // hkv
  n = indices.shape[-1]
  if indices.shape[:3] != (b, t, hkv) or pos.shape != (b, t) or gates.shape != (b, t, hq, 3) \
      or cmp.shape != q.shape:
    raise ValueError(f"indices {indices.shape}, pos {pos.shape}, gates {gates.shape} and cmp "
                     f"{cmp.shape} must be [B, T, Hkv, n], [B, T], [B, T, Hq, 3] and [B, T, Hq, D]")
  indices = indices.astype(jnp.int32)
  union, counts = (shared_schedule if shared else merged_schedule)(indices, group)
  src_t, src_g, m_rows = _row_table(t, g, group)
  ng = src_t.shape[0]
  splits = splits or default_select_splits(b, hkv, ng, n)
  sched, counts = split_schedule(union, counts, splits)
  moved = lambda x: jnp.moveaxis(x, 2, 1)                          # [B, NG, Hkv, ...] -> Hkv first
  idxp = jnp.moveaxis(jnp.moveaxis(indices, 2, 1)[:, :, src_t], 4, 3)   # [B, Hkv, NG, n, M]
  tree = None
  if tree_bits is not None:
    bits = online_softmax.batch_bits(tree_bits, b, t)
    tn = pow2_rows(t)
    kpos = jnp.pad(pos.astype(jnp.int32), ((0, 0), (0, tn - t)))
    tree = (bits[:, src_t], kpos)
  o, m, l = jax.vmap(functools.partial(
      _fused_unbatched, sm_scale=d ** -0.5, cfg=cfg, t=t, splits=splits, shared=shared,
      num_warps=num_warps or (4 if m_rows <= 64 else 8), num_stages=num_stages,
      interpret=interpret))(
          lengths.astype(jnp.int32), moved(counts), moved(sched), idxp,
          pos.astype(jnp.int32)[:, src_t], _pack_heads(q, hkv, src_t, src_g), k, v, tree)
  parts = (b, hkv, ng, 2, splits, m_rows)
  branches = merge_shares(o.reshape(parts + (d,)), m.reshape(parts), l.reshape(parts))
  sel, win = (_unpack(branches[:, :, :, i], t, g, group) for i in range(2))
  gates = gates.astype(jnp.float32)
  out = (gates[..., 0:1] * cmp.astype(jnp.float32) + gates[..., 1:2] * sel
         + gates[..., 2:3] * win)
  return out.astype(q.dtype)


# ----------------------------------------------------------------------------------------------
# The layer

@functools.partial(jax.jit, static_argnames=("t", "cfg"))
def route(k_cache: jax.Array, v_cache: jax.Array, lengths: jax.Array, wk: jax.Array, wv: jax.Array,
          tree_bits: jax.Array | None, *, t: int, cfg: NSAConfig
          ) -> tuple[_nsa.Layout, tuple[jax.Array, jax.Array, jax.Array] | None]:
  """The T rows' layout (`nsa.layout`), and for a tree (tree_bits given) each row's path blocks
  as `nsa_compressed` takes them (keys, values, block indices; `nsa.path_blocks`), else None."""
  lay = _nsa.layout(lengths, t, tree_bits)
  if tree_bits is None:
    return lay, None
  pk, pv, pblk, _ = _nsa.path_blocks(k_cache, v_cache, wk, wv, lengths, lay, cfg)
  return lay, (pk, pv, pblk)


@functools.partial(jax.jit, static_argnames=("cfg", "group", "shared"))
def _select(importance, pos, *, cfg, group, shared):
  indices = _nsa.select_blocks(importance, pos, cfg)
  return _nsa.shared_indices(indices, group) if shared else indices


def nsa_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, lengths: jax.Array,
                  inputs: _nsa.NSAInputs, *, tree_bits: jax.Array | None = None, group: int = 1,
                  shared: bool = False, splits: int | None = None, interpret: bool = False
                  ) -> tuple[jax.Array, jax.Array]:
  """`nsa.nsa_attention` with the kernels: the same arguments and results (out [B, T, Hq, D] in
  q.dtype, the selected blocks [B, T, Hkv, n] int32 each row used). The compressed branch and
  importance (`nsa_compressed`; no importance for a reuse layer, inputs.indices given), the top-n
  (`nsa.select_blocks`), then the fused selected and window branches with the gates
  (`nsa_select_window`, its `splits`) under the merged or the shared-index schedule. Not jitted as a whole (a
  model's forward pass traces it inside its own jit): called alone, its pieces are compiled apart
  and reused across schedules."""
  if group < 1:
    raise ValueError(f"NSA group must be a positive number of rows, got {group}")
  cfg = inputs.cfg
  t = q.shape[1]
  lay, path = route(k_cache, v_cache, lengths, inputs.wk, inputs.wv, tree_bits, t=t, cfg=cfg)
  reuse = inputs.indices is not None
  cmp, importance = nsa_compressed(q, inputs.ck, inputs.cv, lengths, lay.pos, path, cfg=cfg,
                                   num_blocks=_nsa.num_select_blocks(k_cache.shape[1], cfg),
                                   importance=not reuse, interpret=interpret)
  indices = inputs.indices
  if not reuse:
    indices = _select(importance, lay.pos, cfg=cfg, group=group if shared else 1, shared=shared)
  out = nsa_select_window(q, k_cache, v_cache, lengths, lay.pos, indices, inputs.gates, cmp,
                          cfg=cfg, tree_bits=tree_bits, group=group, shared=shared and not reuse,
                          splits=splits, interpret=interpret)
  return out, indices
