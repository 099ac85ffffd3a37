"""What the sparse-verification quality benchmarks share (`benchmarks.specattn`, `benchmarks.sts`):
the pair (real weights, or a tiny random pair on bytes), teacher-forced chunked scoring, greedy
decoding under a method, the baselines' selections and the captured-mass metric.

A method (`Method`, static under jit) decides which prefix keys the target's attention reads while
it verifies a chunk of gamma + 1 tokens at positions n..n+gamma (the keys from n on, the chunk's
own, are always read: the dense tail). Its `select` makes that choice from a dense `View` of the
chunk (the target's attention rows and queries, the draft's rows): the captured mass reads it,
and so does the sparse pass of a method that needs the view (the oracle, STS); the others build
their plan inside the target's pass (`plan`: Quest scores pages with each layer's own queries,
SpecAttn runs the draft). Budgets are prefix keys per layer and KV head, traced ([B] per chunk),
static where a shape needs them.

  Dense      full attention
  Oracle     the target's own top-k keys per layer and KV head: the k prefix keys holding the most
             of its dense attention over the chunk's rows (summed over rows and the KV head's query
             group; the target's dense pass of the chunk runs first). No selection of k keys per
             KV head captures more of that attention.
  Quest      16-token pages per KV head, each scored by its largest q.k bound over the chunk's query
             rows (`jaxspec.drafting.pages.quest_select`, inside the attention, so every layer
             scores with its own current queries); the partial last page is in the dense tail, as
             in the engine's Quest, and counts against the budget: (budget - n mod 16) // 16 full
             pages, so Quest reads about 8 keys fewer than the budget on average (its KV
             reduction shows it).
  Streaming  StreamingLLM: 4 sink tokens + the most recent (budget - 4) prefix keys.
`dense_layers`: the first layers read everything (SpecAttn keeps two dense; STS none).

Captured mass (`captured_mass`): for one layer, the share of each query row's softmax weight that
falls on the keys a selection lets it read, i.e. `sparse_attention`'s visible set: indices[:counts]
plus every key from tail_start up to the row's own position. Rows are normalised to sum to 1 first
(`row_weights`; the attention returns bf16 weights), so reading every key captures exactly 1.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from tqdm import tqdm

from benchmarks.workloads import BOOK
from jaxspec import requests
from jaxspec.drafting import pages
from jaxspec.drafting.policies import NUM_SINKS
from jaxspec.io.data import data_path
from jaxspec.model.attention import Dense, LayerMapped, Prefill, QuestPages, ScoreSpec
from jaxspec.model.config import ModelConfig
from jaxspec.model.kv_cache import KVCache
from jaxspec.model.rope import rope_tables
from jaxspec.model.transformer import Transformer, init_random

PAGE = pages.PAGE_SIZE
# Per-row attention weights per KV head (the mean over its query group): what the oracle and the
# captured mass read. Only the pure-JAX reference collects per-row rows per head.
KV_ROWS = ScoreSpec("weights", per_row=True, heads="kv")
SCORING = "reference"

TINY = (ModelConfig(arch="qwen3", vocab_size=256, hidden_size=64, intermediate_size=128,
                    num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16),
        ModelConfig(arch="qwen3", vocab_size=256, hidden_size=64, intermediate_size=128,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16))


def capacity_for(tokens: int) -> int:
  """Cache slots for `tokens` tokens: a multiple of 128 (and so of Quest's pages)."""
  return -(-tokens // 128) * 128


# ----------------------------------------------------------------------------------------------
# The pair

class ByteTokenizer:
  """The random pair's tokenizer: one token per UTF-8 byte (a vocabulary of 256)."""

  def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
    del add_special_tokens
    return list(text.encode())

  def decode(self, ids) -> str:
    return bytes(int(i) % 256 for i in ids).decode(errors="replace")


@dataclasses.dataclass
class Pair:
  target: Transformer
  draft: Transformer
  tokenizer: object            # encode(text) / decode(ids): the target's, or `ByteTokenizer`
  names: tuple[str, str]       # (target, draft)
  context: int                 # the longest sequence both models take


def load_pair(target: str | None, draft: str | None, random: bool, dtype,
              random_flag: str = "--random") -> Pair:
  """The pair named by the flags, or (`random`) the tiny random pair; one-line ValueErrors."""
  if random == (target is not None or draft is not None):
    raise ValueError(f"give --target and --draft, or {random_flag}")
  if random:
    t, d = (init_random(c, dtype=dtype, seed=i) for i, c in enumerate(TINY))
    return Pair(t, d, ByteTokenizer(), ("random tiny target", "random tiny draft"),
                min(requests.context_limit(c) for c in TINY))
  from jaxspec.io.loading import check_draft_pair, load_model
  t, d = load_model(target, dtype=dtype), load_model(draft, dtype=dtype)
  check_draft_pair(t, d, target, draft)
  if t.tokenizer is None:
    raise ValueError(f"{t.source} has no tokenizer: the benchmark's text cannot be encoded")
  return Pair(t.model, d.model, t.tokenizer, (target, draft),
              min(requests.context_limit(t.cfg), requests.context_limit(d.cfg)))


def book_tokens(tokenizer) -> np.ndarray:
  """Frankenstein (`BOOK` in $JAXSPEC_DATA, else ../shared/data) as token ids."""
  with open(data_path(BOOK), encoding="utf-8-sig") as f:
    return np.asarray(tokenizer.encode(f.read()), np.int32)


# ----------------------------------------------------------------------------------------------
# A forward pass that also returns the queries (Quest scores pages with them)

def forward_with_queries(model: Transformer, tokens: jax.Array, positions: jax.Array,
                         cache: KVCache, plan, backend: str):
  """`Transformer.__call__` that also returns every layer's queries after RoPE [L, B, T, Hq, D].
  The same layers in the same order; the queries are projected once more beside the layer
  (`Attention.qkv`; tests/test_sts_bench.py checks both against the model)."""
  cfg = model.cfg
  b, t = tokens.shape
  slots = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
  cos, sin = rope_tables(cfg, positions)
  x = model.embed_tokens(tokens)
  ks, vs, scores, qs = [], [], [], []
  for i, layer in enumerate(model.layers):
    qs.append(layer.self_attn.qkv(layer.input_layernorm(x), cos, sin, model.mesh)[0])
    x, k, v, s = layer(x, cos, sin, slots, cache.k[i], cache.v[i], cache.lengths,
                       plan.for_layer(i), backend, model.mesh)
    ks.append(k)
    vs.append(v)
    scores.append(s)
  cache = cache.replace(k=tuple(ks), v=tuple(vs))
  return (model.norm(x), cache, jnp.stack(scores) if scores[0] is not None else None,
          jnp.stack(qs))


# ----------------------------------------------------------------------------------------------
# The metric

def row_weights(w: jax.Array) -> jax.Array:
  """Attention rows [..., S] as float32, unseen keys (non-finite or <= 0) zero, each row summing
  to 1."""
  w = w.astype(jnp.float32)
  w = jnp.where(jnp.isfinite(w) & (w > 0), w, 0.0)
  return w / jnp.maximum(w.sum(-1, keepdims=True), jnp.finfo(jnp.float32).tiny)


def visible(indices: jax.Array, counts: jax.Array, tail_start: jax.Array, start: jax.Array,
            rows: int, size: int) -> jax.Array:
  """What `sparse_attention` lets each row read: indices [B, K] or per head [B, H, K], counts [B]
  or [B, H], tail_start [B], row t at position start + t -> [B, T, H, S] bool (H = 1 for shared
  lists): indices[:counts] plus every key from tail_start up to the row's position."""
  if indices.ndim == 2:
    indices, counts = indices[:, None], counts[:, None]
  b, h, k = indices.shape
  valid = jnp.arange(k) < counts[..., None]
  sel = jnp.zeros((b, h, size + 1), bool).at[
      jnp.arange(b)[:, None, None], jnp.arange(h)[None, :, None],
      jnp.where(valid, indices, size)].set(True)[..., :size]                     # [B, H, S]
  pos = start[:, None] + jnp.arange(rows)                                       # [B, T]
  j = jnp.arange(size)
  tail = (j >= tail_start[:, None, None]) & (j <= pos[..., None])               # [B, T, S]
  return sel[:, None] | tail[:, :, None]


def captured_mass(weights: jax.Array, indices: jax.Array, counts: jax.Array,
                  tail_start: jax.Array, start: jax.Array) -> jax.Array:
  """weights [B, T, H, S]: the attention of the rows at positions start + t (per KV head); the
  selection as `visible` -> [B, T, H]: the share of each row's weight on the keys it reads."""
  b, t, h, s = weights.shape
  vis = visible(indices, counts, tail_start, start, t, s)
  return jnp.where(vis, row_weights(weights), 0.0).sum(-1)


def layer_mass(weights: jax.Array, plan: LayerMapped, start: jax.Array) -> jax.Array:
  """weights [L, B, T, H, S], a per-layer selection -> captured mass [L, B, T, H] (1 for the
  dense layers)."""
  out = []
  for i, slot in enumerate(plan.slots):
    if slot < 0:
      out.append(jnp.ones(weights.shape[1:4], jnp.float32))
    else:
      out.append(captured_mass(weights[i], plan.indices[slot], plan.counts[slot],
                               plan.tail_start, start))
  return jnp.stack(out)


def prefix_reads(plan, start: jax.Array, num_layers: int) -> jax.Array:
  """[L, B] float32: the prefix keys (positions < start) each layer reads under `plan`, the mean
  over KV heads for per-head lists."""
  n = start.astype(jnp.float32)
  if isinstance(plan, Dense):
    return jnp.broadcast_to(n, (num_layers,) + n.shape)
  before_tail = (start - plan.tail_start).astype(jnp.float32)
  if isinstance(plan, QuestPages):
    n_full = plan.tail_start // PAGE
    return jnp.minimum(plan.pages, n_full).astype(jnp.float32) * PAGE + before_tail
  rows = []
  for slot in plan.slots:
    if slot < 0:
      rows.append(n)
    else:
      c = plan.counts[slot].astype(jnp.float32)
      rows.append((c.mean(-1) if c.ndim == 2 else c) + before_tail)
  return jnp.stack(rows)


# ----------------------------------------------------------------------------------------------
# Selections

def layer_slots(num_layers: int, dense_layers: int) -> tuple[int, ...]:
  """One shared selection (slot 0) for every layer but the first `dense_layers` (-1: dense)."""
  return tuple(-1 if j < dense_layers else 0 for j in range(num_layers))


def oracle_select(weights: jax.Array, start: jax.Array, k: int) -> LayerMapped:
  """weights [L, B, T, Hkv, S] (the target's dense rows of the chunk) -> per layer and KV head
  the k prefix keys with the largest weight summed over the rows (rows normalised first)."""
  w = row_weights(weights).sum(2)                                              # [L, B, Hkv, S]
  s = w.shape[-1]
  w = jnp.where(jnp.arange(s) < start[None, :, None, None], w, -jnp.inf)
  _, idx = jax.lax.top_k(w, min(k, s))
  counts = jnp.broadcast_to(jnp.minimum(k, start)[None, :, None], w.shape[:3]).astype(jnp.int32)
  return LayerMapped(indices=idx.astype(jnp.int32), counts=counts, tail_start=start,
                     slots=tuple(range(w.shape[0])))


def quest_pages(start: jax.Array, budget: jax.Array) -> jax.Array:
  """Quest's full pages within a budget, the partial last page (start mod 16 keys) counted in."""
  return jnp.maximum(budget - start % PAGE, 0) // PAGE


def page_bounds(cache: KVCache) -> tuple[jax.Array, jax.Array]:
  """Quest's per-page channel min / max of every layer's keys: [L, B, P, Hkv, D] each."""
  bounds = [pages.page_summaries(k, PAGE) for k in cache.k]
  return jnp.stack([lo for lo, _ in bounds]), jnp.stack([hi for _, hi in bounds])


def quest_layer_pages(start: jax.Array, budget: jax.Array, num_layers: int,
                      dense_layers: int) -> jax.Array:
  """[L, B] pages per layer: every full page in the dense layers, the budget's in the rest."""
  want = quest_pages(start, budget)
  return jnp.stack([start // PAGE if j < dense_layers else want for j in range(num_layers)])


def quest_select(queries: jax.Array, page_min: jax.Array, page_max: jax.Array, start: jax.Array,
                 budget: jax.Array, max_pages: int, dense_layers: int = 0) -> LayerMapped:
  """queries [L, B, T, Hq, D] of the chunk's rows, the page bounds -> Quest's pages per layer and
  KV head as token positions, the partial last page in the tail: what `QuestPages` picks inside
  the attention from the same queries."""
  tail = start // PAGE * PAGE
  want = quest_layer_pages(start, budget, queries.shape[0], dense_layers)
  idx, cnt = jax.vmap(
      lambda q, lo, hi, n: pages.quest_select(q, lo, hi, tail, n, max_pages, PAGE))(
          queries, page_min, page_max, want)
  return LayerMapped(indices=idx, counts=cnt, tail_start=tail,
                     slots=tuple(range(queries.shape[0])))


def streaming_select(start: jax.Array, budget: jax.Array, slots: tuple[int, ...]) -> LayerMapped:
  """StreamingLLM: 4 sinks as indices, the most recent (budget - 4) prefix keys as the tail."""
  b = start.shape[0]
  k = jnp.minimum(budget, start)
  sinks = jnp.minimum(NUM_SINKS, k)
  idx = jnp.broadcast_to(jnp.arange(NUM_SINKS, dtype=jnp.int32), (1, b, NUM_SINKS))
  return LayerMapped(indices=idx, counts=sinks[None],
                     tail_start=jnp.maximum(start - (k - sinks), sinks), slots=slots)


# ----------------------------------------------------------------------------------------------
# Methods

@dataclasses.dataclass(frozen=True)
class Probe:
  """What a dense `View` of a chunk holds besides the target's rows: the draft's rows at these
  granularities ('mean', 'kv', 'q'; none: the draft is not run). Static under jit."""
  granularities: tuple[str, ...] = ()


@struct.dataclass
class View:
  """A chunk read densely, on the caches as they stand: start [B]; weights [L, B, T, Hkv, S] the
  target's rows per KV head; queries [L, B, T, Hq, D]; page_min / page_max [L, B, P, Hkv, D];
  draft_rows: per granularity the draft's rows [T - 1, Ld, B, (H,) S], those of positions
  n..n+T-2, which would have sampled the chunk's drafts."""
  start: jax.Array
  weights: jax.Array
  queries: jax.Array
  page_min: jax.Array
  page_max: jax.Array
  draft_rows: dict


@dataclasses.dataclass(frozen=True)
class Method:
  """Full attention; the base of every method (static under jit).

  A method whose selection comes from the chunk's dense `View` (`needs_view`: the oracle, STS)
  defines only `select(view, budget) -> LayerMapped`; the others build their plan inside the
  target's pass, `plan(target, draft, tcache, dcache, tokens, pos, budget, backend) -> (plan,
  draft cache)` (Quest scores pages with each layer's own queries there; SpecAttn runs the draft),
  and may define `select` too, the same choice from a view (for the captured mass)."""
  needs_view: ClassVar[bool] = False
  uses_draft: ClassVar[bool] = False
  dense_layers: int = 0

  def plan(self, target, draft, tcache, dcache, tokens, pos, budget, backend):
    return Dense(), dcache

  def select(self, view: View, budget: jax.Array) -> LayerMapped:
    raise NotImplementedError(f"{type(self).__name__} selects nothing")


@dataclasses.dataclass(frozen=True)
class Oracle(Method):
  """The target's own top-k per layer and KV head (static k), from its dense pass of the chunk."""
  needs_view = True
  k: int = 1

  def select(self, view, budget):
    return oracle_select(view.weights, view.start, self.k)


@dataclasses.dataclass(frozen=True)
class Quest(Method):
  """Quest's pages, scored inside the attention by the layer's own query rows; max_pages: the
  static list length (budget // 16, or the cache's pages when some layers are dense)."""
  max_pages: int = 1

  def select(self, view, budget):
    return quest_select(view.queries, view.page_min, view.page_max, view.start, budget,
                        self.max_pages, self.dense_layers)

  def plan(self, target, draft, tcache, dcache, tokens, pos, budget, backend):
    start = pos[:, 0]
    lo, hi = page_bounds(tcache)
    want = quest_layer_pages(start, budget, target.cfg.num_layers, self.dense_layers)
    return QuestPages(pages=want, tail_start=start // PAGE * PAGE, page_min=lo, page_max=hi,
                      max_pages=self.max_pages), dcache


@dataclasses.dataclass(frozen=True)
class Streaming(Method):
  def select(self, view, budget):
    return streaming_select(view.start, budget, layer_slots(view.weights.shape[0],
                                                            self.dense_layers))

  def plan(self, target, draft, tcache, dcache, tokens, pos, budget, backend):
    return streaming_select(pos[:, 0], budget, layer_slots(target.cfg.num_layers,
                                                           self.dense_layers)), dcache


def draft_rows(draft: Transformer, dcache: KVCache, tokens, pos, heads: str):
  """The draft reads the chunk densely: (its cache, its rows [T - 1, Ld, B, S] ('mean') or
  [T - 1, Ld, B, H, S] per head: the rows of positions n..n+T-2, which would have sampled the
  chunk's drafts, as a round's draft steps collect them)."""
  spec = ScoreSpec("weights", per_row=True, heads=heads)
  _, dcache, scores = draft(tokens, pos, dcache, Dense(scores=spec), SCORING)
  return dcache, jnp.moveaxis(scores[:, :, :tokens.shape[1] - 1], 2, 0)


# ----------------------------------------------------------------------------------------------
# The compiled pieces. A view method's selection is compiled apart (`_select`), so the captured
# mass and the sparse passes share one compilation of it (STS's costs seconds on a CPU).

@functools.partial(jax.jit, static_argnames=("graphdefs", "backend"))
def _prefill(graphdefs, params, tokens, tcache, dcache, *, backend):
  """Both models (the draft when graphdefs[1]) prefill tokens [B, P] densely; the target's greedy
  next token [B]."""
  b, p = tokens.shape
  pos = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
  lengths = jnp.full((b,), p, jnp.int32)
  target = nnx.merge(graphdefs[0], params[0])
  hidden, tcache, _ = target(tokens, pos, tcache, Prefill(), backend)
  first = jnp.argmax(target.logits(hidden[:, -1]), axis=-1).astype(jnp.int32)
  if graphdefs[1] is not None:
    draft = nnx.merge(graphdefs[1], params[1])
    _, dcache, _ = draft(tokens, pos, dcache, Prefill(), backend)
    dcache = dcache.replace(lengths=lengths)
  return tcache.replace(lengths=lengths), dcache, first


def _positions(cache: KVCache, t: int) -> jax.Array:
  return cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None]


@functools.partial(jax.jit, static_argnames=("graphdefs", "probe"))
def _view(graphdefs, params, tcache, dcache, tokens, *, probe):
  """The chunk tokens [B, T] read densely at tcache.lengths..: (the draft cache moved on by T when
  the draft ran, else as given; the `View`). The target's cache is left as it was."""
  target = nnx.merge(graphdefs[0], params[0])
  t = tokens.shape[1]
  pos = _positions(tcache, t)
  rows = {}
  if probe.granularities:
    draft = nnx.merge(graphdefs[1], params[1])
    for g in probe.granularities:
      new, rows[g] = draft_rows(draft, dcache, tokens, pos, g)
    dcache = new.replace(lengths=dcache.lengths + t)
  lo, hi = page_bounds(tcache)
  _, _, w, q = forward_with_queries(target, tokens, pos, tcache, Dense(scores=KV_ROWS), SCORING)
  return dcache, View(start=pos[:, 0], weights=w, queries=q, page_min=lo, page_max=hi,
                      draft_rows=rows)


@functools.partial(jax.jit, static_argnames=("method",))
def _select(view: View, budget: jax.Array, *, method: Method) -> LayerMapped:
  return method.select(view, budget)


@jax.jit
def _mass(weights: jax.Array, plan: LayerMapped, start: jax.Array) -> jax.Array:
  """[L]: a chunk's captured mass summed over the batch, rows and KV heads."""
  return layer_mass(weights, plan, start).sum((1, 2, 3))


def mass_sums(view: View, budget: jax.Array, method: Method) -> np.ndarray:
  """[L] float64: `method`'s captured mass on `view`, summed over batch, rows and KV heads."""
  return np.asarray(_mass(view.weights, _select(view, budget, method=method), view.start),
                    np.float64)


@functools.partial(jax.jit, static_argnames=("graphdefs", "method", "backend"))
def _step(graphdefs, params, tcache, dcache, tokens, labels, budget, plan, *, method, backend):
  """One chunk tokens [B, T] at positions tcache.lengths.. under `plan` (None: `method.plan`);
  labels: the tokens after them. Returns (the caches moved on by T (the draft's when the method
  ran it), NLL [B] summed over the chunk, greedy tokens [B, T], prefix keys read [L, B])."""
  target = nnx.merge(graphdefs[0], params[0])
  draft = nnx.merge(graphdefs[1], params[1]) if graphdefs[1] is not None else None
  n = tcache.lengths
  t = tokens.shape[1]
  pos = _positions(tcache, t)
  if plan is None:
    plan, dcache = method.plan(target, draft, tcache, dcache, tokens, pos, budget, backend)
    if dcache is not None:
      dcache = dcache.replace(lengths=n + t)
  hidden, tcache, _ = target(tokens, pos, tcache, plan, backend)
  logp = jax.nn.log_softmax(target.logits(hidden), axis=-1)
  nll = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0].sum(-1)
  return (tcache.replace(lengths=n + t), dcache, nll, jnp.argmax(logp, -1).astype(jnp.int32),
          prefix_reads(plan, n, target.cfg.num_layers))


def _split(target, draft):
  gt, pt = nnx.split(target)
  if draft is None:
    return (gt, None), (pt, None)
  gd, pd = nnx.split(draft)
  return (gt, gd), (pt, pd)


# ----------------------------------------------------------------------------------------------
# Teacher forcing and greedy decoding

class _Run:
  """One sequence batch through `method` from a dense prefill: `chunk` reads the next tokens."""

  def __init__(self, target, draft, tokens: np.ndarray, capacity: int, *, method: Method,
               probe: Probe | None, dtype, backend: str):
    probe = probe or Probe()
    if method.needs_view and method.uses_draft and not probe.granularities:
      raise ValueError(f"{type(method).__name__} needs the draft's rows: give a Probe with them")
    if method.uses_draft and not method.needs_view and probe.granularities:
      raise ValueError(f"{type(method).__name__} runs the draft itself: a Probe must not")
    use_draft = bool(probe.granularities) or method.uses_draft
    self.method, self.probe, self.backend = method, probe, backend
    self.graphdefs, self.params = _split(target, draft if use_draft else None)
    # The draft's graph is needed by the view alone: the step runs without it then.
    self.step_graphdefs = self.graphdefs if method.uses_draft and not method.needs_view else (
        self.graphdefs[0], None)
    self.step_params = self.params if self.step_graphdefs[1] is not None else (self.params[0], None)
    b = tokens.shape[0]
    tcache = KVCache.create(target.cfg, b, capacity, dtype)
    dcache = KVCache.create(draft.cfg, b, capacity, dtype) if use_draft else None
    self.tcache, self.dcache, self.first = _prefill(
        self.graphdefs, self.params, jnp.asarray(tokens, jnp.int32), tcache, dcache,
        backend=backend)

  def with_method(self, method: Method) -> "_Run":
    """This run's state under another method; neither may read the draft."""
    if method.uses_draft or self.method.uses_draft or self.probe.granularities:
      raise ValueError("a run forks to another method only without the draft")
    run = object.__new__(_Run)
    run.__dict__.update(self.__dict__, method=method)
    return run

  def chunk(self, tokens: jax.Array, labels: jax.Array, budget: jax.Array, want_view: bool):
    """(NLL [B], greedy tokens [B, T], prefix keys read [L, B], the dense view or None)."""
    view, plan = None, None
    if want_view or self.method.needs_view:
      self.dcache, view = _view(self.graphdefs, self.params, self.tcache, self.dcache, tokens,
                                probe=self.probe)
    if self.method.needs_view:
      plan = _select(view, budget, method=self.method)
    dcache = self.dcache if self.step_graphdefs[1] is not None else None
    self.tcache, dcache, nll, greedy_tokens, reads = _step(
        self.step_graphdefs, self.step_params, self.tcache, dcache, tokens, labels, budget, plan,
        method=None if plan is not None else self.method, backend=self.backend)
    if self.step_graphdefs[1] is not None:
      self.dcache = dcache
    return nll, greedy_tokens, reads, view


def teacher_forced(target, draft, windows: np.ndarray, *, prefill_len: int, gamma: int,
                   method: Method, probe: Probe | None = None,
                   budgets: Callable[[int], np.ndarray] | None = None, dtype=jnp.float32,
                   backend: str = "reference", on_view: Callable[[View], None] | None = None,
                   desc: str | None = None) -> tuple[dict, list[np.ndarray]]:
  """windows [B, W]: the first `prefill_len` tokens prefilled densely, the rest read in chunks
  of gamma + 1 under `method` (a trailing part shorter than a chunk, its last label included, is
  not scored). `probe`: what a view holds (the draft's rows a view method needs); budgets(c) ->
  [B]: the method's prefix-key budget for chunk c (None: zeros); on_view(view): each chunk's dense
  view, read before the chunk is verified. Returns ({perplexity, kv_reduction, scored_tokens}, per
  chunk the prefix keys read [L, B]). KV reduction: 1 - (keys the target's attention reads) /
  (keys dense attention reads), over every layer and chunk, each chunk's own gamma + 1 keys
  counted in both."""
  b, w = windows.shape
  t = gamma + 1
  tok = jnp.asarray(windows, jnp.int32)
  run = _Run(target, draft, windows[:, :prefill_len], capacity_for(w), method=method,
             probe=probe, dtype=dtype, backend=backend)
  n_layers = target.cfg.num_layers
  starts = range(prefill_len, w - t, t)
  if not starts:
    raise ValueError(f"no chunk of {t} tokens to score after a prefill of {prefill_len} of {w}")
  # Per-chunk results stay on the device until the end: no host sync inside the loop, so the
  # chunks' dispatch overlaps their execution.
  nlls, kept = [], []
  for c, start in enumerate(tqdm(starts, desc=desc, unit="chunk", leave=False,
                                 disable=desc is None)):
    budget = jnp.asarray(np.zeros(b) if budgets is None else budgets(c), jnp.int32)
    chunk_nll, _, chunk_reads, view = run.chunk(tok[:, start:start + t],
                                                tok[:, start + 1:start + t + 1], budget,
                                                on_view is not None)
    if on_view is not None:
      on_view(view)
    nlls.append(chunk_nll)
    kept.append(chunk_reads)
  kept = [np.asarray(k, np.float64) for k in kept]
  nll = float(np.sum([np.asarray(x, np.float64).sum() for x in nlls]))
  scored = len(starts) * b * t
  reads = float(sum((k + t).sum() for k in kept))
  dense_reads = float(sum(n_layers * b * (start + t) for start in starts))
  return dict(perplexity=math.exp(nll / scored), kv_reduction=1 - reads / dense_reads,
              scored_tokens=scored), kept


def greedy(target, prompts: np.ndarray, new_tokens: int, methods: dict[str, tuple[Method, int]],
           *, dtype=jnp.float32, backend: str = "reference", desc: str | None = None
           ) -> dict[str, np.ndarray]:
  """Greedy decoding of prompts [B, P] (one length) under each method of `methods` (label ->
  (method, budget); no method that reads the draft), one token a step after one dense prefill
  shared by the methods: the first new token comes from that prefill (as in the engine, whose
  verification is sparse only after the prompt), the rest each from a step under the method.
  Returns label -> new tokens [B, new_tokens]."""
  b = prompts.shape[0]
  zeros = jnp.zeros((b, 1), jnp.int32)
  out = {}
  prefilled = _Run(target, None, prompts, capacity_for(prompts.shape[1] + new_tokens),
                   method=Method(), probe=None, dtype=dtype, backend=backend)
  for label, (method, budget) in tqdm(methods.items(), desc=desc, unit="method", leave=False,
                                      disable=desc is None):
    run = prefilled.with_method(method)
    last, toks = run.first, [run.first]
    for _ in range(new_tokens - 1):
      _, nxt, _, _ = run.chunk(last[:, None], zeros, jnp.full((b,), budget, jnp.int32), False)
      last = nxt[:, 0]
      toks.append(last)
    out[label] = np.asarray(jnp.stack(toks, axis=1))
  return out
