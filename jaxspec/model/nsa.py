"""Native Sparse Attention (NSA, Yuan et al., 2025) for T new queries against a KV cache: the
pure-JAX reference, with SSV's verification schedules. The Pallas kernels that match it are in
`pallas_kernels/nsa_attention.py` (the attention dispatch runs them on backends 'pallas' and
'interpret', this reference on 'reference').

Each query row mixes three attention branches with learned gates, out = sum_b gate_b * branch_b
(gates sigmoid(linear(hidden)) per query head and branch, computed by the layer):
  compressed  attention over compressed blocks: block c summarises the l tokens c*d .. c*d + l - 1
              (l = `compress_block`, d = `compress_stride`) into one key and one value, by
              `compress`: their mean plus a learned linear over the block's tokens (per KV head,
              one D x D matrix per position in the block, so it also encodes where in the block a
              token sits; NSA uses an MLP with an intra-block position encoding). A row at
              position p sees the blocks whose last token is at or before p;
  selected    attention over the raw tokens of n = `num_selected` selection blocks of l' =
              `select_block` tokens (block j: tokens j*l' .. (j+1)*l' - 1), causally. The block
              importance is the compressed branch's attention probabilities mapped onto selection
              blocks (a selection block scores the plain sum of the probabilities of the
              compression blocks it overlaps; NSA's Eq. 9 weights each by a count of strides),
              summed over the query heads of a KV head, so one selection per (row, KV head). The top
              n always include block 0 (initial) and the 2 local blocks (the one holding the row
              and the one before it); ties go to the lower block; blocks after the row's own never;
  window      attention over the w = `window` tokens ending at the row.
The branches share the layer's K/V (NSA gives each branch its own; one cache here), compressed
from the cached keys, RoPE already applied. Scores are scaled by 1/sqrt(head_dim).

The caches: the raw [B, S, Hkv, D] K/V (`kv_cache`) and beside it compressed K/V [B, C, Hkv, D]
per layer, C = `num_compressed(S)`, entry c holding block c once its last token is written.
`extend_compressed` writes the blocks whose last token a call writes, so a verification pass of
T chain rows writes the blocks its drafts complete. Such a block is visible only to the rows at or
after its last token; the rows before it never see it, and when drafts are rejected the block lies
past the cache length, unseen, until a later call writes its last slot again and recompresses it.

Rows (`layout`): the T new rows sit in slots lengths .. lengths + T - 1. A chain (tree_bits None):
row t at position lengths + t sees the new keys up to its own. A tree: tree_bits [T] or [B, T]
int32, `Tree.ancestor_bits` of the T rows (the rows are the whole tree: node i in slot
lengths + i): row t sees new key i iff bit i is set, and a node sits at position lengths + its
depth (its bit count - 1). Every branch then works on the row's own path, exactly as if that
path had been decoded one token at a time: window and selected blocks by the path's positions,
and the compressed blocks that end in the new window computed from the path's tokens (a tree
call writes no compressed blocks: which tokens a block holds depends on the path; after the
accepted path is compacted, `extend_compressed` over its slots, `Transformer.recompress`, writes
them).

SSV's schedules (Sections 4-5 of ../shared/papers/ssv.txt), the references its kernels are to
match (Strict SSV is `group` alone; Reuse-only adds `refresh`, Approx-only `shared`):
  group    the selected branch runs `group` adjacent rows together: the union of their selected
           blocks, sorted and deduplicated, each loaded once, every row's logits -inf on the blocks
           outside its own set. The blocks are folded in by an online softmax in ascending order,
           where a fully masked block changes nothing, and the arithmetic has the same shapes
           whatever the group, so the output is bit for bit that of each row alone (group=1), in
           the model's jitted forward pass too: the exact merged schedule, lossless;
  shared   the approximate shared-index schedule: the last row of each group (for a chain the
           one with the longest prefix) selects for the whole group; each row still masks the
           shared blocks by its own position and tree, and its compressed and window branches are
           its own. Changes the output;
  refresh  per layer: refresh layers select their own blocks, reuse layers take the indices of
           the nearest earlier refresh layer (`run_schedule`; layer 0 always refreshes). Changes
           the output.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxspec.model.config import NSAConfig

NEG_INF = float("-inf")
BRANCHES = ("compressed", "selected", "window")   # the order of the gates' last axis


def num_compressed(capacity: int, cfg: NSAConfig) -> int:
  """C: compressed blocks a cache of `capacity` slots holds (blocks c with c*d + l <= capacity;
  at least 1, a block that no row sees when the cache is shorter than one block)."""
  return max(1, (capacity - cfg.compress_block) // cfg.compress_stride + 1)


def num_select_blocks(capacity: int, cfg: NSAConfig) -> int:
  """Selection blocks covering `capacity` slots (the last one may be partial)."""
  return -(-capacity // cfg.select_block)


@struct.dataclass
class NSAInputs:
  """What one NSA layer hands `attention.attend` besides q and the raw cache.

  gates [B, T, Hq, 3] f32 in [0, 1] (`BRANCHES` order); ck, cv [B, C, Hkv, D] the layer's
  compressed cache (with the blocks this call completes written, for a chain); wk, wv
  [Hkv, l, D, D] the compression weights; indices [B, T, Hkv, n] int32 or None: the selected
  blocks to use instead of selecting (a reuse layer)."""
  gates: jax.Array
  ck: jax.Array
  cv: jax.Array
  wk: jax.Array
  wv: jax.Array
  indices: jax.Array | None = None
  cfg: NSAConfig = struct.field(pytree_node=False, default=NSAConfig())


@struct.dataclass
class Layout:
  """pos [B, T] int32: the position of new row t, which is also new key t (slot lengths + t);
  sees [B, T, T] bool: row t sees new key i."""
  pos: jax.Array
  sees: jax.Array


def layout(lengths: jax.Array, t: int, tree_bits: jax.Array | None = None) -> Layout:
  """The T new rows' positions and what each sees among the new keys (module docstring)."""
  b = lengths.shape[0]
  i = jnp.arange(t, dtype=jnp.int32)
  if tree_bits is None:
    return Layout(pos=lengths[:, None] + i[None],
                  sees=jnp.broadcast_to(i[None, :] <= i[:, None], (b, t, t)))
  if t > 32:
    raise ValueError(f"an int32 ancestor bitmask holds at most 32 tree nodes, got T={t}")
  bits = jnp.broadcast_to(jnp.asarray(tree_bits, jnp.int32).reshape(-1, t), (b, t))
  sees = (jnp.right_shift(bits[:, :, None], i[None, None, :]) & 1).astype(bool)
  depth = jax.lax.population_count(bits) - 1
  return Layout(pos=lengths[:, None] + depth, sees=sees)


def compress(x: jax.Array, w: jax.Array) -> jax.Array:
  """One compressed key (or value) per block: x [..., l, Hkv, D] a block's tokens, w [Hkv, l, D, D]
  -> [..., Hkv, D] f32, the tokens' mean plus sum_j x_j @ w[:, j]."""
  xf = x.astype(jnp.float32)
  return xf.mean(axis=-3) + jnp.einsum("...lhd,hlde->...he", xf, w.astype(jnp.float32))


def extend_compressed(ck: jax.Array, cv: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                      wk: jax.Array, wv: jax.Array, start: jax.Array, count: int,
                      cfg: NSAConfig) -> tuple[jax.Array, jax.Array]:
  """Write the compressed blocks whose last token is in slots start .. start + count - 1
  (start [B] int32), computed from the raw cache as it is: the blocks a chain call of `count` new
  tokens completes, or those of an accepted path after compaction. Slots are positions here."""
  b, s = k_cache.shape[:2]
  l, d = cfg.compress_block, cfg.compress_stride
  first = jnp.maximum(0, -((l - 1 - start) // d))                      # first block ending >= start
  blocks = first[:, None] + jnp.arange(-(-count // d), dtype=jnp.int32)[None]    # [B, E]
  ends = blocks * d + l - 1
  done = (ends < start[:, None] + count) & (ends < s)
  slots = jnp.clip(blocks[..., None] * d + jnp.arange(l)[None, None], 0, s - 1)   # [B, E, l]
  rows = jnp.arange(b)[:, None]
  dst = jnp.where(done, blocks, ck.shape[1])                            # past the end: dropped
  ck = ck.at[rows, dst].set(compress(k_cache[rows[..., None], slots], wk).astype(ck.dtype),
                            mode="drop")
  cv = cv.at[rows, dst].set(compress(v_cache[rows[..., None], slots], wv).astype(cv.dtype),
                            mode="drop")
  return ck, cv


# ----------------------------------------------------------------------------------------------
# The branches

def _group_heads(q: jax.Array, hkv: int) -> jax.Array:
  b, t, hq, d = q.shape
  return q.astype(jnp.float32).reshape(b, t, hkv, hq // hkv, d)


def _softmax_attend(logits: jax.Array, visible: jax.Array, values: jax.Array, spec: str
                    ) -> tuple[jax.Array, jax.Array]:
  """Masked softmax over the last axis, then `spec` (an einsum) with values. A row that sees
  nothing gets zero probabilities and a zero output."""
  masked = jnp.where(visible, logits, NEG_INF)
  m = jnp.max(masked, axis=-1, keepdims=True)
  p = jnp.exp(masked - jnp.where(jnp.isfinite(m), m, 0.0))
  total = p.sum(axis=-1, keepdims=True)
  p = p / jnp.where(total > 0, total, 1.0)
  return p, jnp.einsum(spec, p, values)


def path_blocks(k_cache: jax.Array, v_cache: jax.Array, wk: jax.Array, wv: jax.Array,
                lengths: jax.Array, lay: Layout, cfg: NSAConfig
                ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """For a tree: the compressed blocks that end in the new window, per row, from the row's path.
  Returns (keys, values [B, T, E, Hkv, D] f32, block indices [B, E], ends [B, E]); E =
  ceil(T / compress_stride)."""
  b, t = lay.pos.shape
  l, d = cfg.compress_block, cfg.compress_stride
  first = jnp.maximum(0, -((l - 1 - lengths) // d))
  blocks = first[:, None] + jnp.arange(-(-t // d), dtype=jnp.int32)[None]   # [B, E]
  depth = lay.pos - lengths[:, None]                                      # [B, T] of the new keys
  k = jnp.arange(t)
  # anc[b, row, k]: the new key at depth k on row's path (meaningful for k <= the row's depth).
  anc = jnp.argmax(lay.sees[:, :, None, :] & (depth[:, None, None, :] == k[None, None, :, None]),
                   axis=-1)
  pos = blocks[:, None, :, None] * d + jnp.arange(l)[None, None, None]    # [B, 1, E, l]
  rel = jnp.clip(pos - lengths[:, None, None, None], 0, t - 1)
  path_slot = lengths[:, None, None, None] + jnp.take_along_axis(
      anc, jnp.broadcast_to(rel, (b, t) + rel.shape[2:]).reshape(b, t, -1), axis=2
  ).reshape(b, t, *rel.shape[2:])
  slots = jnp.where(pos < lengths[:, None, None, None], pos, path_slot)   # [B, T, E, l]
  rows = jnp.arange(b)[:, None, None, None]
  return (compress(k_cache[rows, slots], wk), compress(v_cache[rows, slots], wv), blocks,
          blocks * d + l - 1)


def _block_importance(p: jax.Array, starts: jax.Array, num_blocks: int, cfg: NSAConfig
                      ) -> jax.Array:
  """p [B, T, Hkv, K] probabilities of compressed blocks starting at `starts` (broadcastable to
  [B, T, K]) -> [B, T, Hkv, NB]: each selection block the sum over the blocks it overlaps."""
  l, ls = cfg.compress_block, cfg.select_block
  b, t, h, kk = p.shape
  starts = jnp.broadcast_to(starts, (b, t, kk))[:, :, None].repeat(h, axis=2).reshape(-1, kk)
  flat = p.reshape(-1, kk)
  rows = jnp.arange(flat.shape[0])[:, None]
  out = jnp.zeros((flat.shape[0], num_blocks), jnp.float32)
  for o in range((l + ls - 2) // ls + 1):           # the most selection blocks one block overlaps
    j = starts // ls + o
    j = jnp.where(j * ls < starts + l, j, num_blocks)
    out = out.at[rows, j].add(flat, mode="drop")
  return out.reshape(b, t, h, num_blocks)


def compressed_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                         inputs: NSAInputs, lengths: jax.Array, lay: Layout, tree: bool
                         ) -> tuple[jax.Array, jax.Array]:
  """The compressed branch: (out [B, T, Hq, D] f32, selection-block importance [B, T, Hkv, NB])."""
  cfg = inputs.cfg
  b, t, hq, dd = q.shape
  c, hkv = inputs.ck.shape[1], inputs.ck.shape[2]
  l, d = cfg.compress_block, cfg.compress_stride
  qg = _group_heads(q, hkv) * dd ** -0.5
  blocks = jnp.arange(c, dtype=jnp.int32)
  ends = blocks * d + l - 1
  logits = jnp.einsum("bthgd,bchd->bthgc", qg, inputs.ck.astype(jnp.float32))
  if not tree:
    visible = (ends[None, None] <= lay.pos[:, :, None])[:, :, None, None]
    p, out = _softmax_attend(logits, visible, inputs.cv.astype(jnp.float32),
                             "bthgc,bchd->bthgd")
    starts = (blocks * d)[None, None]
  else:
    pk, pv, pblocks, pends = path_blocks(k_cache, v_cache, inputs.wk, inputs.wv, lengths, lay, cfg)
    logits = jnp.concatenate([logits, jnp.einsum("bthgd,btehd->bthge", qg, pk)], axis=-1)
    committed = jnp.broadcast_to(ends[None, None] < lengths[:, None, None], (b, t, c))
    on_path = pends[:, None, :] <= lay.pos[:, :, None]                        # [B, T, E]
    visible = jnp.concatenate([committed, on_path], axis=-1)[:, :, None, None]
    values = jnp.concatenate(
        [jnp.broadcast_to(inputs.cv.astype(jnp.float32)[:, None], (b, t) + inputs.cv.shape[1:]),
         pv], axis=2)
    p, out = _softmax_attend(logits, visible, values, "bthgc,btchd->bthgd")
    starts = jnp.concatenate([jnp.broadcast_to(blocks * d, (b, c)), pblocks * d], axis=1)[:, None]
  importance = _block_importance(p.sum(axis=3), starts, num_select_blocks(k_cache.shape[1], cfg),
                                 cfg)
  return out.reshape(b, t, hq, dd), importance


def select_blocks(importance: jax.Array, pos: jax.Array, cfg: NSAConfig) -> jax.Array:
  """importance [B, T, Hkv, NB], row positions pos [B, T] -> the selected blocks [B, T, Hkv, n]
  int32, ascending, -1 after the last when fewer than n blocks exist yet. Blocks after the row's
  own are never selected; block 0 and the 2 local blocks always are; the rest by importance, ties
  to the lower block."""
  nb, n = importance.shape[-1], cfg.num_selected
  cur = (pos // cfg.select_block)[:, :, None, None]
  j = jnp.arange(nb, dtype=jnp.int32)
  forced = (j == 0) | (j == cur) | (j == cur - 1)
  score = jnp.where(j > cur, NEG_INF, jnp.where(forced, jnp.inf, importance))
  vals, idx = jax.lax.top_k(score, min(n, nb))
  idx = jnp.sort(jnp.where(vals == NEG_INF, nb, idx), axis=-1)
  idx = jnp.where(idx == nb, -1, idx).astype(jnp.int32)
  if n > nb:
    idx = jnp.concatenate([idx, jnp.full(idx.shape[:-1] + (n - nb,), -1, jnp.int32)], axis=-1)
  return idx


def _fold(state, s, v, spec):
  """Online softmax: fold logits s [..., K] (-inf where masked) and values v in; `spec` (an
  einsum) takes the probabilities [..., K] and v to [..., D]. A block masked for a row leaves its
  state bit for bit as it was."""
  acc, m, l = state
  m_new = jnp.maximum(m, jnp.max(s, axis=-1))
  alpha = jnp.exp(m - m_new)
  p = jnp.exp(s - m_new[..., None])
  return (acc * alpha[..., None] + jnp.einsum(spec, p, v), m_new, l * alpha + p.sum(axis=-1))


def selected_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, lengths: jax.Array,
                       lay: Layout, indices: jax.Array, cfg: NSAConfig, group: int = 1
                       ) -> jax.Array:
  """The selected branch, [B, T, Hq, D] f32: each row over the raw tokens of its selected blocks
  (indices [B, T, Hkv, n], -1 unused) that it sees. Rows go in groups of `group` adjacent rows
  (the exact merged schedule, module docstring): the group's union of blocks, sorted, each
  gathered from the cache once (the cached slots < lengths) and read by every row of the group,
  folded in one block at a time; then the T new keys as one last tile. Each row masks what is not
  its own. The arithmetic has the same [B, T, ...] shapes whatever the group, so that a masked
  block is the only difference a group makes. A row that sees none of its blocks' keys gets 0."""
  b, t, hq, dd = q.shape
  s, hkv = k_cache.shape[1], k_cache.shape[2]
  ls, n = cfg.select_block, indices.shape[-1]
  ng = -(-t // group)
  scale = dd ** -0.5
  qg = _group_heads(q, hkv) * scale                                      # [B, T, Hkv, G, D]
  idx = jnp.pad(indices, ((0, 0), (0, ng * group - t), (0, 0), (0, 0)), constant_values=-1)
  idx = idx.reshape(b, ng, group, hkv, n)
  # The group's union, ascending, each block once (duplicates and unused entries -1, last).
  union = jnp.sort(jnp.where(idx < 0, s, idx).transpose(0, 1, 3, 2, 4).reshape(b, ng, hkv, -1),
                   axis=-1)
  dup = jnp.concatenate([jnp.zeros_like(union[..., :1], bool), union[..., 1:] == union[..., :-1]],
                        axis=-1)
  union = jnp.sort(jnp.where(dup, s, union), axis=-1)
  union = jnp.where(union == s, -1, union)                               # [B, NG, Hkv, U]
  own = (idx[..., :, None] == union[:, :, None, :, None, :]).any(axis=-2) & (
      union[:, :, None] >= 0)                                            # [B, NG, R, Hkv, U]
  own = own.reshape(b, ng * group, hkv, -1)[:, :t]                       # [B, T, Hkv, U]
  row_group = jnp.arange(t) // group
  bi = jnp.arange(b)[:, None, None, None]
  hi = jnp.arange(hkv)[None, None, :, None]
  state = (jnp.zeros(qg.shape, jnp.float32), jnp.full(qg.shape[:-1], -1e30, jnp.float32),
           jnp.zeros(qg.shape[:-1], jnp.float32))

  def block(state, xs):
    blk, mine = xs                                                       # [B,NG,Hkv], [B,T,Hkv]
    slots = blk[..., None] * ls + jnp.arange(ls)                         # [B, NG, Hkv, l']
    kb = k_cache[bi, jnp.clip(slots, 0, s - 1), hi].astype(jnp.float32)  # [B, NG, Hkv, l', D]
    vb = v_cache[bi, jnp.clip(slots, 0, s - 1), hi].astype(jnp.float32)
    cached = (slots < lengths[:, None, None, None]) & (blk[..., None] >= 0)
    # Each row reads its group's copy.
    kb, vb, cached = kb[:, row_group], vb[:, row_group], cached[:, row_group]
    mask = (mine[..., None] & cached)[:, :, :, None]                     # [B, T, Hkv, 1, l']
    logits = jnp.einsum("bthgd,bthkd->bthgk", qg, kb)                    # [B, T, Hkv, G, l']
    return _fold(state, jnp.where(mask, logits, NEG_INF), vb, "bthgk,bthkd->bthgd"), None

  state, _ = jax.lax.scan(block, state, (jnp.moveaxis(union, -1, 0), jnp.moveaxis(own, -1, 0)))
  # The new keys, one tile for every row: seen, and in one of the row's blocks by position.
  new = lengths[:, None] + jnp.arange(t)
  kn = k_cache[jnp.arange(b)[:, None], new].astype(jnp.float32)          # [B, T, Hkv, D]
  vn = v_cache[jnp.arange(b)[:, None], new].astype(jnp.float32)
  in_sel = (indices[..., None] == (lay.pos // ls)[:, None, None, None, :]).any(axis=-2)
  mask = (in_sel & lay.sees[:, :, None])[:, :, :, None]                  # [B, T, Hkv, 1, T]
  logits = jnp.einsum("bthgd,bkhd->bthgk", qg, kn)                       # [B, T, Hkv, G, T]
  acc, _, l = _fold(state, jnp.where(mask, logits, NEG_INF), vn, "bthgk,bkhd->bthgd")
  out = acc / jnp.where(l > 0, l, 1.0)[..., None]
  return out.reshape(b, t, hq, dd)


def window_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, lengths: jax.Array,
                     lay: Layout, cfg: NSAConfig) -> jax.Array:
  """The window branch, [B, T, Hq, D] f32: each row over the keys it sees whose positions are
  within `window` of its own (its own key included)."""
  b, t, hq, dd = q.shape
  s, hkv = k_cache.shape[1], k_cache.shape[2]
  j = jnp.arange(s)[None]
  rel = jnp.clip(j - lengths[:, None], 0, t - 1)
  cached = j < lengths[:, None]
  new = (j >= lengths[:, None]) & (j < lengths[:, None] + t)
  key_pos = jnp.where(cached, j, jnp.take_along_axis(lay.pos, rel, axis=1))     # [B, S]
  sees = cached[:, None] | (new[:, None] & jnp.take_along_axis(
      lay.sees, jnp.broadcast_to(rel[:, None], (b, t, s)), axis=2))             # [B, T, S]
  visible = sees & (key_pos[:, None] > lay.pos[:, :, None] - cfg.window)
  qg = _group_heads(q, hkv) * dd ** -0.5
  logits = jnp.einsum("bthgd,bshd->bthgs", qg, k_cache.astype(jnp.float32))
  _, out = _softmax_attend(logits, visible[:, :, None, None], v_cache.astype(jnp.float32),
                           "bthgs,bshd->bthgd")
  return out.reshape(b, t, hq, dd)


# ----------------------------------------------------------------------------------------------
# The whole layer, and SSV's schedules around it

def shared_indices(indices: jax.Array, group: int) -> jax.Array:
  """The approximate shared-index schedule: every row takes the selection of the last row of its
  group of `group` adjacent rows (the last group may be shorter). indices [B, T, Hkv, n]."""
  t = indices.shape[1]
  rep = np.minimum(np.arange(t) // group * group + group - 1, t - 1)
  return indices[:, rep]


@functools.partial(jax.jit, static_argnames=("group", "shared"))
def nsa_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, lengths: jax.Array,
                  inputs: NSAInputs, *, tree_bits: jax.Array | None = None, group: int = 1,
                  shared: bool = False) -> tuple[jax.Array, jax.Array]:
  """NSA for the T new rows q [B, T, Hq, D] (their K/V already in the raw cache at lengths + t;
  for a chain, the compressed blocks they complete already in inputs.ck/cv). Returns (out
  [B, T, Hq, D] in q.dtype, the selected blocks [B, T, Hkv, n] int32 each row used).

  inputs.indices given (a reuse layer): those blocks, no selection. group: rows per group of the
  merged schedule (the output does not depend on it); shared: the shared-index schedule over
  groups of `group` rows (changes the output). tree_bits: module docstring."""
  if group < 1:
    raise ValueError(f"NSA group must be a positive number of rows, got {group}")
  cfg = inputs.cfg
  t = q.shape[1]
  lay = layout(lengths, t, tree_bits)
  cmp, importance = compressed_attention(q, k_cache, v_cache, inputs, lengths, lay,
                                         tree=tree_bits is not None)
  indices = inputs.indices
  if indices is None:
    indices = select_blocks(importance, lay.pos, cfg)
    if shared:
      indices = shared_indices(indices, group)
  sel = selected_attention(q, k_cache, v_cache, lengths, lay, indices, cfg, group)
  win = window_attention(q, k_cache, v_cache, lengths, lay, cfg)
  gates = inputs.gates.astype(jnp.float32)
  out = gates[..., 0:1] * cmp + gates[..., 1:2] * sel + gates[..., 2:3] * win
  return out.astype(q.dtype), indices


def check_refresh(refresh: Sequence[bool] | None, num_layers: int) -> tuple[bool, ...]:
  """A refresh/reuse schedule, one bool per layer (True: the layer selects its own blocks); None
  is every layer refreshing. Layer 0 must refresh."""
  if refresh is None:
    return (True,) * num_layers
  refresh = tuple(refresh)
  if len(refresh) != num_layers or any(not isinstance(r, (bool, np.bool_)) for r in refresh):
    raise ValueError(f"the refresh schedule needs one bool per layer ({num_layers}), got {refresh}")
  if not refresh[0]:
    raise ValueError("layer 0 must be a refresh layer: reuse layers take the selection of an "
                     "earlier refresh layer")
  return tuple(bool(r) for r in refresh)


def run_schedule(refresh: Sequence[bool], layer: Callable[[int, jax.Array | None],
                                                          tuple[Any, jax.Array]]
                 ) -> tuple[list[Any], list[jax.Array]]:
  """Run layers 0 .. L-1 in order under a refresh/reuse schedule (`check_refresh`):
  layer(i, None) on a refresh layer, which selects and returns (output, its selected blocks);
  layer(i, indices) on a reuse layer, with the blocks of the nearest earlier refresh layer.
  Returns (the outputs, the blocks each layer used)."""
  refresh = check_refresh(refresh, len(refresh))
  outs, used, latest = [], [], None
  for i, fresh in enumerate(refresh):
    out, indices = layer(i, None if fresh else latest)
    latest = indices if fresh else latest
    outs.append(out)
    used.append(indices if fresh else latest)
  return outs, used
