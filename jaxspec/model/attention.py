"""The one attention dispatch point of the model, and the plans that tell it what to compute.

Every attention layer calls `attend(q, k_new, v_new, k_cache, v_cache, lengths, plan, backend)`,
after writing the new K/V into the cache; where `writes_in_kernel` says so (decode, draft and
verification steps on the kernels) `rope_write` does the RoPE, that write and the query packing in
one kernel first.
The plan says *what* (one small type per mode, each field meaning one thing); the backend says
*how* (pure-JAX reference, Pallas kernels, or the Pallas kernels in interpret mode on the CPU).
This is the only place that chooses between the references and the kernels of `pallas_kernels/`.

The T new queries of a call sit in cache slots lengths .. lengths + T - 1 and query t sees every
key up to its own slot (a chain: plain decoding, drafting and verification all are), unless the
plan carries `tree_bits`.

Plans:
  Prefill      the cache is empty for these sequences: causal self-attention over right-padded
               prompts (`query_lens` real tokens each). Optional `scores`: one score row per
               prompt, its last real token against the whole prompt.
  Dense        T new queries against the whole cache (decoding T = 1, verification T = gamma + 1),
               optionally collecting criticality scores (`ScoreSpec`).
  Sparse       T new queries against selected cache positions plus a dense tail (self-drafting);
               the policies' selection *is* this plan.
  QuestPages   new queries against the Quest-selected pages plus the dense tail: the page scores
               are computed here from the current query rows and per-page key summaries (one
               new token a step when decoding; T rows share one choice).
  LayerMapped  per layer, Dense or one of a few shared `Sparse` selections (SpecAttn's
               verification: target layers reading the same draft layer share its selection;
               STS's: one selection per layer, one index list per KV head).
  NSA          Native Sparse Attention, the only plan of a model whose config has `nsa`
               (`jaxspec.model.nsa`): T new rows (prefill, decoding, a chain or a whole tree)
               with SSV's verification schedule (merged or shared-index groups, refresh/reuse
               layers). `as_nsa` turns Prefill and Dense plans into it, so the engine's vanilla
               and chain loops run NSA models unchanged. Backend 'reference' runs the pure-JAX
               reference, 'pallas' and 'interpret' SSV's kernels
               (`pallas_kernels/nsa_attention.py`; one device only); `attend` returns each row's
               selected blocks instead of scores.
  PerLayer     another plan already cut per layer (`per_layer`): a loop that runs one plan every
               iteration (a draft chain) cuts it once, outside the loop.
Dense and Sparse take an optional `tree_bits` [T] or [B, T] int32 (a draft tree's
`Tree.ancestor_bits`, shared by all layers): query t then sees what the plan shows it before
`lengths` and key lengths + i iff bit i of tree_bits[t] is set (i < 32), instead of the causal
rule. The T rows need not be the whole window the bits address (one level of a tree whose
shallower nodes are already in the cache); every key they name must be written.
Per-layer arrays carry a leading layer axis; `for_layer(i)` picks layer i.

Tensor parallelism (`jaxspec.model.sharding`): with a mesh, the head axes of q/k/v and of the KV
cache are split over its `tp` axis. The pure-JAX references run on them under GSPMD as they are
(XLA partitions them by head); the Pallas kernels, which XLA cannot partition, run under
`shard_map`, each device on its own query heads and the KV heads those read. Criticality scores are
a mean over every query head, so under `shard_map` each device returns its own heads' mean in
float32 and a psum over the devices (equal head counts: psum / tp) gives the mean over all of them,
rounded to bf16 once, as on one device; every device then holds the same scores and its top-k picks
the same positions.
"""
from __future__ import annotations

import dataclasses
from typing import Union

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import Mesh, PartitionSpec as P

from jaxspec.drafting import pages as _pages
from jaxspec.model import nsa as _nsa
from jaxspec.model.sharding import AXIS, HEADS
from pallas_kernels import nsa_attention as _nsa_kernels
from pallas_kernels import rope_write as _rope_write
from pallas_kernels import sparse_attention as _sparse
from pallas_kernels import verify_attention as _verify

BACKENDS = ("reference", "pallas", "interpret")
SCORE_KINDS = ("logits", "weights")
SCORE_HEADS = ("mean", "kv", "q")


def default_backend() -> str:
  """Pallas kernels on a GPU, the pure-JAX references elsewhere."""
  return "pallas" if jax.default_backend() == "gpu" else "reference"


def check_backend(backend: str) -> str:
  if backend not in BACKENDS:
    raise ValueError(f"attention backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
  return backend


@dataclasses.dataclass(frozen=True)
class ScoreSpec:
  """Which criticality scores a dense pass collects (see `pallas_kernels.verify_attention`).

  kind: 'logits' (pre-softmax q.k) or 'weights' (softmax weights); rows: the query rows summed
  into one score row per sequence ((0, -1) is Collect-2-Query, None every row); per_row: one score
  row per query instead ([B, T, S]); heads: 'mean' averages over every query head, 'kv' gives one
  row per KV head (the mean over its query group: [B, Hkv, S], per_row [B, T, Hkv, S]), 'q' one
  per query head ([B, Hq, S], per_row [B, T, Hq, S]; the pure-JAX reference only); layers: the
  layers that collect, ascending (None: every layer), so a pass returns [len(layers), B, ...]
  (scores cost: 'weights' at a draft step add ~25% to a layer's attention, stored logits read back
  after the combine, and a whole second K pass where more rows are collected; a consumer that
  reads a few layers names them).
  """
  kind: str = "logits"
  rows: tuple[int, ...] | None = (0, -1)
  per_row: bool = False
  heads: str = "mean"
  layers: tuple[int, ...] | None = None

  def __post_init__(self):
    if self.kind not in SCORE_KINDS:
      raise ValueError(f"score kind must be one of {', '.join(SCORE_KINDS)}, got {self.kind!r}")
    if self.heads not in SCORE_HEADS:
      raise ValueError(f"score heads must be one of {', '.join(SCORE_HEADS)}, got {self.heads!r}")
    if self.layers is not None and (
        not self.layers or list(self.layers) != sorted(set(self.layers))
        or min(self.layers) < 0):
      raise ValueError(f"score layers must be distinct non-negative layers, ascending, got "
                       f"{self.layers!r}")

  def collects(self, layer: int) -> bool:
    return self.layers is None or layer in self.layers


def _scores_at(scores: ScoreSpec | None, layer: int) -> ScoreSpec | None:
  return scores if scores is not None and scores.collects(layer) else None


@struct.dataclass
class Prefill:
  query_lens: jax.Array | None = None                    # [B] real prompt lengths (None: all T)
  scores: ScoreSpec | None = struct.field(pytree_node=False, default=None)

  def for_layer(self, i: int) -> "Prefill":
    return self.replace(scores=_scores_at(self.scores, i))


@struct.dataclass
class Dense:
  scores: ScoreSpec | None = struct.field(pytree_node=False, default=None)
  tree_bits: jax.Array | None = None                     # [T] or [B, T] int32; None: a chain
  tree_offset: int = struct.field(pytree_node=False, default=0)   # see `attend`

  def for_layer(self, i: int) -> "Dense":
    return self.replace(scores=_scores_at(self.scores, i))


@struct.dataclass
class Sparse:
  """Each layer's queries see indices[:counts] (positions before tail_start) and every position
  from tail_start on. indices [L, B, K] or per KV head [L, B, Hkv, K]; counts [L, B] or
  [L, B, Hkv] valid entries; tail_start [B]; tree_bits [T] or [B, T] int32 (not per layer): the
  positions from lengths on follow the tree's bits (the indices must then be < lengths)."""
  indices: jax.Array
  counts: jax.Array
  tail_start: jax.Array
  tree_bits: jax.Array | None = None
  tree_offset: int = struct.field(pytree_node=False, default=0)   # see `attend`

  def for_layer(self, i: int) -> "Sparse":
    return self.replace(indices=self.indices[i], counts=self.counts[i])


@struct.dataclass
class QuestPages:
  """Quest: per layer, `pages` [L, B] full pages to keep (of those before tail_start), chosen per
  KV head from the channel-wise key bounds page_min/page_max [L, B, P, Hkv, D]; max_pages is the
  static cap."""
  pages: jax.Array
  tail_start: jax.Array
  page_min: jax.Array
  page_max: jax.Array
  max_pages: int = struct.field(pytree_node=False, default=1)

  def for_layer(self, i: int) -> "QuestPages":
    return self.replace(pages=self.pages[i], page_min=self.page_min[i], page_max=self.page_max[i])


@struct.dataclass
class LayerMapped:
  """Layer i attends densely when slots[i] < 0, else as `Sparse` with selection slots[i]:
  indices[slots[i]][:, :counts] (positions before tail_start) plus every position from tail_start
  on. indices [U, B, K], counts [U, B] (U selections, each shared by the layers whose slot it is),
  or per KV head indices [U, B, Hkv, K], counts [U, B, Hkv] (STS); tail_start [B]; slots: one
  entry per layer, static."""
  indices: jax.Array
  counts: jax.Array
  tail_start: jax.Array
  slots: tuple[int, ...] = struct.field(pytree_node=False, default=())

  def for_layer(self, i: int) -> Union[Dense, Sparse]:
    u = self.slots[i]
    if u < 0:
      return Dense()
    return Sparse(indices=self.indices[u], counts=self.counts[u], tail_start=self.tail_start)


@struct.dataclass
class NSA:
  """NSA attention (`jaxspec.model.nsa`). tree_bits [T] or [B, T] int32: the T rows are a whole
  draft tree (`Tree.ancestor_bits`), None a chain. SSV's schedule, static: group, rows per group
  (1: each row alone); shared, each group's last row selects for the group (changes the output;
  without it grouping leaves the output bit for bit unchanged); refresh, one bool per layer
  (False: reuse the selection of the nearest earlier refresh layer, changes the output; None:
  every layer selects); collect, the forward pass returns every layer's selected blocks
  [L, B, T, Hkv, n] int32 where other plans return their scores. refresh_mask [L] bool: the
  refresh schedule as data instead (layer 0 refreshes whatever it holds), so that one compiled
  program serves every schedule (`jaxspec.ssv_calibrate` tries hundreds); every layer then also
  selects its own blocks, which the mask keeps or drops, so reuse layers save nothing. Give
  refresh or refresh_mask, not both."""
  tree_bits: jax.Array | None = None
  refresh_mask: jax.Array | None = None
  group: int = struct.field(pytree_node=False, default=1)
  shared: bool = struct.field(pytree_node=False, default=False)
  refresh: tuple[bool, ...] | None = struct.field(pytree_node=False, default=None)
  collect: bool = struct.field(pytree_node=False, default=False)

  def for_layer(self, i: int) -> "NSA":
    return self


@struct.dataclass
class PerLayer:
  """layers[i] is the plan layer i runs (`per_layer`)."""
  layers: tuple

  def for_layer(self, i: int) -> "Plan":
    return self.layers[i]


Plan = Union[Prefill, Dense, Sparse, QuestPages, LayerMapped, NSA, PerLayer]


def per_layer(plan: Plan, num_layers: int) -> Plan:
  """`plan` cut into its layers' plans, where it holds per-layer arrays (Sparse, QuestPages);
  others unchanged. A draft chain's steps all run one plan: cut inside its loop, XLA copies each
  layer's slice of the index lists again every step."""
  if not isinstance(plan, (Sparse, QuestPages)):
    return plan
  return PerLayer(tuple(plan.for_layer(i) for i in range(num_layers)))


def as_nsa(plan: Plan) -> NSA:
  """The NSA plan an NSA model runs for `plan`: Prefill and a score-free Dense (chain, or a whole
  tree) map onto it; the sparse plans and score collection have no NSA meaning."""
  if isinstance(plan, NSA):
    return plan
  if isinstance(plan, Prefill) and plan.scores is None:
    return NSA()
  if isinstance(plan, Dense) and plan.scores is None and plan.tree_offset == 0:
    return NSA(tree_bits=plan.tree_bits)
  raise ValueError(f"an NSA model runs NSA, Prefill or score-free Dense plans (a tree as one "
                   f"whole window), got {type(plan).__name__}")


# The most new tokens a call writes with `rope_write`, which unrolls its cache writes per token.
ROPE_WRITE_MAX_T = 16


def writes_in_kernel(plan: Plan, backend: str, mesh: Mesh | None, t: int, num_heads: int,
                     num_kv_heads: int, head_dim: int) -> bool:
  """Whether a call of T new tokens runs its RoPE, KV-cache write and query packing as one kernel
  (`rope_write`) rather than three XLA kernels: on a kernel backend and one device, a Sparse plan
  (draft steps) of up to one tile of query rows a KV head, or a Dense plan (decode steps,
  verification) whose kernel takes packed queries; T <= ROPE_WRITE_MAX_T."""
  if backend == "reference" or mesh is not None or t > ROPE_WRITE_MAX_T:
    return False
  if isinstance(plan, Sparse):
    return t * (num_heads // num_kv_heads) <= _sparse.MAX_ROWS
  if isinstance(plan, Dense):
    kind = None if plan.scores is None else plan.scores.kind
    return not _verify.runs_heads_as_columns(t, num_heads, num_kv_heads, head_dim, kind,
                                             plan.tree_bits is not None)
  return False


def rope_write(qkv: jax.Array, cos: jax.Array, sin: jax.Array, k_cache: jax.Array,
               v_cache: jax.Array, lengths: jax.Array, backend: str, *, num_heads: int,
               q_norm: jax.Array | None = None, k_norm: jax.Array | None = None,
               eps: float = 1e-6):
  """`pallas_kernels.rope_write` on `backend` ('pallas' or 'interpret'): the fused projection
  qkv [B, T, Hq + 2 Hkv, D] -> (packed queries for `attend`, k_cache, v_cache written at
  lengths + t). Where `writes_in_kernel` says so."""
  return _rope_write.rope_write(qkv, cos, sin, k_cache, v_cache, lengths, num_heads=num_heads,
                                q_norm=q_norm, k_norm=k_norm, eps=eps,
                                interpret=backend == "interpret")


def attend(q: jax.Array, k_new: jax.Array, v_new: jax.Array, k_cache: jax.Array,
           v_cache: jax.Array, lengths: jax.Array, plan: Plan, backend: str,
           mesh: Mesh | None = None, nsa: _nsa.NSAInputs | None = None
           ) -> tuple[jax.Array, jax.Array | None]:
  """q/k_new/v_new [B, T, H, D] (the new tokens; their K/V already written into the cache),
  lengths [B] the valid entries before them. Where `writes_in_kernel` holds, q may come packed
  (`rope_write`'s; k_new and v_new are then unused). Returns (out [B, T, Hq, D], scores or None):
  scores [B, S] bf16 for a `ScoreSpec` of summed rows, [B, T, S] with `per_row`. `mesh`: the
  tensor-parallel mesh the head axes are split over (`Transformer.mesh`; None: one device).

  With `tree_bits` the bits address a window that starts `plan.tree_offset` slots before the new
  rows (a tree level drafted after `tree_offset` shallower nodes), so the kernels take that
  window's start as their `lengths`.

  An `NSA` plan takes the layer's `nsa` inputs (gates, compressed cache, compression weights) and
  returns (out, the selected blocks [B, T, Hkv, n]): from the reference on backend 'reference',
  from the kernels on 'pallas' and 'interpret', which refuse a mesh (XLA cannot partition them
  and no `shard_map` wrapping is built for them)."""
  if isinstance(plan, NSA) or nsa is not None:
    if not isinstance(plan, NSA) or nsa is None:
      raise ValueError("NSA attention needs an NSA plan and the layer's NSA inputs together")
    kw = dict(tree_bits=plan.tree_bits, group=plan.group, shared=plan.shared)
    if backend == "reference":
      return _nsa.nsa_attention(q, k_cache, v_cache, lengths, nsa, **kw)
    if mesh is not None:
      raise ValueError("the NSA kernels are not built for tensor parallelism: run an NSA model "
                       "on several devices with backend 'reference'")
    return _nsa_kernels.nsa_attention(q, k_cache, v_cache, lengths, nsa,
                                      interpret=backend == "interpret", **kw)
  if isinstance(plan, (Dense, Sparse)) and plan.tree_bits is not None:
    lengths = lengths - plan.tree_offset
  if mesh is not None and getattr(plan, "scores", None) is not None and plan.scores.heads != "mean":
    raise ValueError("per-head scores are not built under tensor parallelism (the devices' means "
                     "are averaged over all heads)")
  if mesh is None or backend == "reference":
    return _attend(q, k_new, v_new, k_cache, v_cache, lengths, plan, backend)

  def per_device(q, k_new, v_new, k_cache, v_cache, lengths, plan):
    out, scores = _attend(q, k_new, v_new, k_cache, v_cache, lengths, plan, backend,
                          score_dtype=jnp.float32)
    if scores is not None:
      scores = (jax.lax.psum(scores, AXIS) / mesh.shape[AXIS]).astype(jnp.bfloat16)
    return out, scores

  # check_vma=False: pallas_call does not declare how its outputs vary over the mesh.
  return jax.shard_map(per_device, mesh=mesh, in_specs=(HEADS,) * 5 + (P(), _plan_specs(plan)),
                       out_specs=(HEADS, P()), check_vma=False)(
                           q, k_new, v_new, k_cache, v_cache, lengths, plan)


def _plan_specs(plan: Plan):
  """The plan's PartitionSpecs under shard_map: per-KV-head arrays split like the cache, the rest
  (a draft tree's bits included) replicated."""
  if isinstance(plan, Sparse) and plan.indices.ndim == 3:         # [B, Hkv, K], counts [B, Hkv]
    return plan.replace(indices=P(None, AXIS, None), counts=P(None, AXIS), tail_start=P(),
                        tree_bits=None if plan.tree_bits is None else P())
  if isinstance(plan, QuestPages):                               # page bounds [B, P, Hkv, D]
    return plan.replace(pages=P(), tail_start=P(), page_min=HEADS, page_max=HEADS)
  return jax.tree.map(lambda _: P(), plan)


def _attend(q, k_new, v_new, k_cache, v_cache, lengths, plan: Plan, backend: str,
            score_dtype=jnp.bfloat16):
  """`attend` on one device's arrays; scores in `score_dtype`."""
  kernel = backend != "reference"
  interpret = backend == "interpret"
  if isinstance(plan, Prefill):
    return _prefill(q, k_new, v_new, k_cache, v_cache, lengths, plan, backend, score_dtype)
  if isinstance(plan, Dense):
    spec = plan.scores
    kw = {} if spec is None else dict(score_kind=spec.kind, score_rows=spec.rows,
                                      per_row=spec.per_row, score_heads=spec.heads,
                                      score_dtype=score_dtype)
    if kernel:
      return _verify.verify_attention(q, k_cache, v_cache, lengths, interpret=interpret,
                                      tree_bits=plan.tree_bits, **kw)
    return _verify.verify_attention_reference(q, k_cache, v_cache, lengths,
                                              tree_bits=plan.tree_bits, **kw)
  if isinstance(plan, QuestPages):
    plan = _quest_pages(q, k_cache, plan)
  if not isinstance(plan, Sparse):
    raise TypeError(f"unknown attention plan {type(plan).__name__}")
  args = (q, k_cache, v_cache, plan.indices, plan.counts, plan.tail_start, lengths)
  if kernel:
    return _sparse.sparse_attention(*args, interpret=interpret, tree_bits=plan.tree_bits), None
  return _sparse.sparse_attention_reference(*args, tree_bits=plan.tree_bits), None


def _quest_pages(q: jax.Array, k_cache: jax.Array, plan: QuestPages) -> Sparse:
  """Quest, per KV head: the plan's number of pages with the largest q.k bound among the full
  pages before tail_start, as token positions [B, Hkv, max_pages * page_size] + counts [B, Hkv].
  One new token per step when decoding; T rows (a verification chunk) share one choice, a page
  scored by its largest bound over them (`pages.quest_select`)."""
  page_size = k_cache.shape[1] // plan.page_min.shape[1]
  indices, counts = _pages.quest_select(q, plan.page_min, plan.page_max, plan.tail_start,
                                        plan.pages, plan.max_pages, page_size)
  return Sparse(indices=indices, counts=counts, tail_start=plan.tail_start)


def _prefill(q, k_new, v_new, k_cache, v_cache, lengths, plan: Prefill, backend: str,
             score_dtype):
  b, t = q.shape[:2]
  query_lens = jnp.full((b,), t, jnp.int32) if plan.query_lens is None else plan.query_lens
  if backend == "reference":
    out, _ = _verify.verify_attention_reference(q, k_new, v_new, jnp.zeros((b,), jnp.int32))
  else:
    # cuDNN flash attention on a GPU; the cache is empty, so the prompt's own K/V is everything to
    # attend to. cuDNN takes 16-bit inputs only (and no CPU): float32 and the interpret backend
    # take XLA's (materialising) implementation of the same call.
    impl = "cudnn" if backend == "pallas" and q.dtype in (jnp.bfloat16, jnp.float16) else None
    out = jax.nn.dot_product_attention(q, k_new, v_new, is_causal=True,
                                       query_seq_lengths=query_lens,
                                       key_value_seq_lengths=query_lens, implementation=impl)
  scores = None
  if plan.scores is not None:
    # One score row per prompt: its last real token, against the whole prompt.
    last = jnp.take_along_axis(q, (query_lens - 1)[:, None, None, None], axis=1)
    _, scores = _verify.verify_attention_reference(
        last, k_cache, v_cache, lengths + query_lens - 1, score_kind=plan.scores.kind,
        score_rows=(0,), score_dtype=score_dtype)
  return out, scores
