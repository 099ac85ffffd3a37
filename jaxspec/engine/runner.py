"""The runner: one model (and optionally a draft model), one method, compiled loops, on the host.

`Runner(model, method=..., ...)` binds the static settings once and compiles, per set of shapes, a
prefill and a chunk of the decode loop (vanilla one-token steps, or speculative rounds with the
state, so both caches, donated). Compiled executables are cached on the instance: reuse a Runner to
avoid compiling again.

  generate(prompts, ...)   a batch of token-id prompts, streamed per chunk through `on_chunk`
  serve(prompts, ...)      continuous batching over a request stream: finished slots are refilled
                           with freshly prefilled requests (`batching.insert_slot`); with
                           `disaggregate`, prefilled ahead on a second device while decoding goes on
  time_phases(state, ...)  draft / verify / update timed separately (speculative methods)
  start / step / extend    one session by hand: prefill, decode chunks, and (method 'sts') a new
                           turn appended with a sparse prefill (`jaxspec.drafting.sts_prefill`)

Methods (`METHODS`): 'none' is vanilla decoding, its compiled step the plain one-token step (the
baseline every speedup is measured against); 'draft' drafts with a separate draft model;
'specattn' drafts with a draft model and verifies with sparse attention picked by the draft's
attention (`jaxspec.drafting.specattn`): it CHANGES the output (approximate verification, exact
with respect to the masked target); 'sts' likewise, each target head reading the top-k keys of its
mapped draft head (`jaxspec.drafting.sts`), and it CHANGES the output the same way; 'ssv'
verifies a Native Sparse Attention model under SSV's schedule (`jaxspec.ssv`), drafted by a
separate draft model or by the NSA model itself: its 'strict' class is lossless, 'reuse',
'approx' and 'approx_reuse' CHANGE the output; the rest are self-drafting policies
(`jaxspec.drafting.policies`).

NSA models (`ModelConfig.nsa`) run methods 'none', 'draft' and 'ssv', chains and draft trees (an
NSA draft model drafts chains only); the self-drafting policies, 'specattn' and 'sts' select KV by
attention scores, which NSA has no meaning for, and are refused.

Tensor parallelism: `Runner(model, tp=N)` places the model (and the draft model) on a `tp` mesh of
N devices (`jaxspec.model.sharding`); the loops are the same code, partitioned by XLA, with the
attention kernels under `shard_map`. A model loaded with `load_model(..., tp=N)` is already placed.

Adaptive speculation: `Runner(model, planner=Planner.load(profile))` lets a planner
(`jaxspec.engine.planner`) choose among self-drafting strategies (method, gamma, sparsity, tree), or
among SSV strategies (gamma or tree, class, group) of one precision class, and switch the state
between them at chunk boundaries in `generate` and `serve`.

KV offload: `Runner(..., method="sts", kv_offload="prefetch")` (or "on_demand") keeps the target's
KV cache in host memory and copies each round's selected rows to the device
(`jaxspec.engine.offload`); `generate` and `time_phases` run so, `serve` does not.

Greedy speculative output equals vanilla greedy output exactly in float32 ('specattn', 'sts' and
the non-strict 'ssv' classes excepted: their output is the approximate verifier's). In bfloat16 the
verification pass (gamma + 1 rows) and the one-token step round differently, so texts can part
at near-ties. Sampled output follows the same distribution as vanilla sampling.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import sys
import time
import warnings
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from jaxspec import requests
from jaxspec import ssv as ssv_lib
from jaxspec.drafting import policies
from jaxspec.drafting import specattn, sts, sts_prefill
from jaxspec.drafting.draft_model import DraftModelDrafter
from jaxspec.drafting.self_drafting import SelfDrafter
from jaxspec.drafting.trees import Tree
from jaxspec.engine.batching import insert_slot
from jaxspec.engine.config import RunConfig
from jaxspec.engine.offload import OffloadConfig
from jaxspec.engine.planner import Planner, Strategy, Tally, accepted_per_round, switch_state
from jaxspec.engine.prefill import prefill
from jaxspec.engine.sampling import SamplingParams
from jaxspec.engine.speculative import acceptance_summary, speculative_chunk, verify
from jaxspec.engine.state import (PROMPT_BUCKETS, SpecState, bucket, capacity_for,
                                  check_prompt_buckets, decode_state, make_batch)
from jaxspec.engine.vanilla import decode_chunk
from jaxspec.model import fp8, sharding
from jaxspec.model.attention import check_backend, default_backend
from jaxspec.model.transformer import Transformer

METHODS = ("none", "draft", "specattn", "sts", "ssv", *policies.SELF_DRAFTING)
DRAFT_MODEL_METHODS = ("draft", "specattn", "sts")
# What an NSA model (ModelConfig.nsa) runs: the others select or mask KV by attention scores,
# which NSA does not collect.
NSA_METHODS = ("none", "draft", "ssv")
DEFAULT_GAMMA = 6
# Disaggregated serving: prefills kept in flight on the prefill device beyond the free slots, so
# that slots finishing at the next chunk boundary find theirs ready (each holds a batch-1 cache
# of max_len slots on that device). A guess: not tuned on GPUs yet.
_AHEAD = 2


@dataclasses.dataclass
class GenerationStats:
  prompt_tokens: int = 0
  new_tokens: int = 0        # every generated token, the one sampled at prefill included
  decode_tokens: int = 0     # those the decode loop produced (new_tokens less one per sequence)
  compile_s: float = 0.0     # kept apart from prefill_s and decode_s
  prefill_s: float = 0.0
  decode_s: float = 0.0
  rounds: int = 0            # decode steps, or draft-verify rounds for speculative methods
  extra: dict = dataclasses.field(default_factory=dict)

  @property
  def decode_tokens_per_s(self) -> float:
    return self.decode_tokens / self.decode_s if self.decode_s > 0 else float("nan")

  def line(self) -> str:
    """One line: counts, prefill time, decode rate (tokens after the first), compile time, and
    the method's own figures."""
    s = (f"prompt tokens {self.prompt_tokens} | new tokens {self.new_tokens} | "
         f"prefill {self.prefill_s:.3f} s | decode {self.decode_tokens_per_s:.1f} tok/s | "
         f"compile {self.compile_s:.1f} s")
    return s + "".join(f" | {k} {v}" for k, v in self.extra.items())


def _merge(graphdefs, params):
  target = nnx.merge(graphdefs[0], params[0])
  draft = None if graphdefs[1] is None else nnx.merge(graphdefs[1], params[1])
  return target, draft


@functools.partial(jax.jit, static_argnames=("graphdefs", "config", "max_new_buffer"))
def _prefill(graphdefs, params, prompts, prompt_lens, max_new, key, *, config, max_new_buffer):
  target, draft = _merge(graphdefs, params)
  return prefill(target, draft, prompts, prompt_lens, max_new, key, config, max_new_buffer)


# The XLA options the decode loop and the phase timers compile with (`loop_compiler_options`; pass
# them to a loop jitted by hand as well).
# - No rematerialization: XLA's memory estimate for a decode loop over a large cache exceeds the
#   device's limit (85.8 GB against 59.6 at the 1.5B's B = 64 x 24K on an H100, a program that runs
#   without it), and rematerialization then recomputes GEMMs and moves loop-invariant slices of the
#   selection back into the draft loop: 3% of a vegas round (RESULTS.md, twenty-eighth session).
# - cuBLAS GEMMs, not XLA's Triton GEMMs, above SMALL_BATCH sequences: the autotuner times each
#   GEMM alone and picks split-K Triton GEMMs for a draft step's small projections, whose f32
#   partials the next fusions then reduce; cuBLAS adds the bias and the residual itself. 2% off a
#   vegas round at the 1.5B's B = 128 on an H200 (RESULTS.md, thirty-sixth session). Up to
#   SMALL_BATCH sequences XLA's Triton GEMMs are the faster: on an H200 (the 1.5B's and the
#   0.5B's shapes, 8K contexts) 1-10% a vanilla step and 1.5-17% a vegas round at batches 1-16,
#   while at 32 vegas's rounds were 0.4-1.9% faster on cuBLAS (thirty-ninth session). Ignored off
#   the GPU.
LOOP_COMPILER_OPTIONS = {"xla_disable_hlo_passes": "rematerialization",
                         "xla_gpu_enable_triton_gemm": False}
SMALL_BATCH = 16
SMALL_BATCH_LOOP_COMPILER_OPTIONS = {k: v for k, v in LOOP_COMPILER_OPTIONS.items()
                                     if k != "xla_gpu_enable_triton_gemm"}


# `generate`'s steps (vanilla) or rounds (speculative) per compiled call. A call costs 2.5-3.7 ms
# on an H200 besides its steps (the 0.5B at B = 64; at the 1.5B's shapes half of a call's cost
# went with XLA's command buffers), 0.04-0.06 ms a step at 64 steps a call
# (RESULTS.md, forty-second session). Longer calls would space out the streaming callback
# (`on_chunk`) further; a call ends early once every sequence is done.
VANILLA_CHUNK = 64
SPECULATIVE_CHUNK = 16


def loop_compiler_options(batch: int) -> dict:
  """The XLA options of a decode loop over `batch` sequences."""
  return SMALL_BATCH_LOOP_COMPILER_OPTIONS if batch <= SMALL_BATCH else LOOP_COMPILER_OPTIONS


def _chunk(graphdefs, params, state, *, steps, config):
  target, draft = _merge(graphdefs, params)
  if config.speculative:
    return speculative_chunk(target, draft, state, steps, config)
  return decode_chunk(target, state, steps, config)


@functools.cache
def _jitted_chunk(options: tuple) -> Callable:
  return jax.jit(_chunk, static_argnames=("graphdefs", "config", "steps"),
                 donate_argnames=("state",), compiler_options=dict(options))


def chunk_fn(state) -> Callable:
  """The jitted chunk of decode steps (vanilla) or rounds for `state`'s batch, compiled with
  `loop_compiler_options`: (graphdefs, params, state, *, steps, config) -> state."""
  options = loop_compiler_options(decode_state(state).cache.lengths.shape[0])
  return _jitted_chunk(tuple(sorted(options.items())))


@functools.partial(jax.jit, static_argnames=("graphdefs", "config"), donate_argnames=("state",))
def _switch(graphdefs, state, *, config):
  return switch_state(state, config)


@functools.partial(jax.jit, static_argnames=("graphdefs", "config", "chunk", "max_new_buffer"),
                   donate_argnames=("state",))
def _extend(graphdefs, params, state, turns, turn_lens, max_new, *, config, chunk, max_new_buffer):
  target, draft = _merge(graphdefs, params)
  return sts_prefill.extend(target, draft, state, turns, turn_lens, max_new, config, chunk,
                            max_new_buffer)


def _arrays_key(tree) -> tuple:
  """What a compiled executable fixes about `tree`: its structure and each leaf's shape, dtype and
  sharding (an executable refuses arguments placed otherwise than it was compiled for). Arrays
  and `jax.ShapeDtypeStruct`s of the same shape, dtype and sharding describe alike."""
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  return treedef, tuple((getattr(x, "shape", None), getattr(x, "dtype", type(x)),
                         getattr(x, "sharding", None)) for x in leaves)


class Runner:
  """Compiled decoding of one model with one method (see the module docstring).

  method: one of METHODS; gamma: drafts per round (static); sparsity: the fraction of the prefix
  self-drafts attend to, in (0, 1]; min_tokens: the budget floor; scoring: how the vegas family
  scores and ranks keys (`jaxspec.drafting.policies.Scoring`: the score kind, its pooling width
  and selection block; the default is the paper's rule); draft_model:
  the drafter for methods 'draft', 'specattn' and 'sts' (same vocabulary as the target);
  top_p_attn, layer_map, attn_cap: method 'specattn''s kept attention mass in (0, 1], its map f
  (one draft layer per target layer, from `jaxspec.specattn_map`; None: the proportional map
  floor(j * Ld / Lt)) and its index-list cap K_max (None: the cache
  capacity), see `jaxspec.drafting.specattn.SpecAttnConfig`; sts_budget, sts_block, head_map:
  method 'sts''s k (prefix keys per target KV head and round, required), its page size P (1: token
  granularity) and its head map (`jaxspec.sts_map.load_map`, made for this pair and budget; None:
  the proportional map), see `jaxspec.drafting.sts.STSConfig`; kv_offload: where method 'sts'
  keeps the target's KV cache: 'device', or host memory with each round's selected rows copied to
  the device once the draft has picked them, verification waiting for every layer's rows
  ('on_demand') or each layer for its own ('prefetch'); same output, no GPU timing yet (see
  `jaxspec.engine.offload`); stop_ids: a sequence stops at its first stop id (kept in the
  output), None = the model's end-of-sequence ids, () = none; backend: 'reference', 'pallas' or
  'interpret' (default: pallas on a GPU); tree: draft a tree instead of a chain, given as widths
  per depth ((2, 2, 1, 1): the root's 2 children, 2 each for them, then 1 and 1) or a
  `drafting.trees.Tree`, verified in one pass in `tree_order` ('bfs' or 'dfs'); gamma is then the
  tree's depth (default 6 for a chain); tp: tensor-parallel devices (both models are placed on a
  mesh of the first tp devices; None: wherever the model already is, the draft model joining it);
  ssv_class, ssv_group, refresh: method 'ssv''s class ('strict' by default, lossless; 'reuse',
  'approx', 'approx_reuse' change the output), rows per merged group (default 1) and, for the
  reuse classes, the refresh/reuse schedule (one bool per layer, `jaxspec.ssv.load_schedule`),
  see `jaxspec.ssv.SSVConfig`; method 'ssv' without a draft model drafts with the NSA model itself.
  planner: a `jaxspec.engine.planner.Planner` whose strategies (self-drafting method, gamma,
  sparsity, tree; or SSV's gamma or tree, class and group, with `draft_model` and, for the reuse
  classes, `refresh` given here) `generate` and `serve` switch among at chunk boundaries: leave
  method, gamma, sparsity, tree, ssv_class and ssv_group unset then (one cache, sized for the
  largest strategy, serves them all). prompt_buckets: how many padded prompt lengths per power of
  two (`jaxspec.engine.state.prompt_bucket`; 1: the powers of two): more lengths pad less and
  compile more prefills. fp8_drafts: the draft steps' MLPs multiply by FP8 copies of their
  weights, which the runner adds to the drafting model (the draft model, else the target) in
  place (`jaxspec.model.fp8.add_fp8_mlps`; one device only); verification keeps the target's
  weights, so the output distribution is unchanged.
  Bad arguments raise a one-line ValueError (`jaxspec.requests`, `jaxspec.model.sharding`).
  """

  def __init__(self, model: Transformer, *, method: str = "none", gamma: int | None = None,
               sparsity: float = 0.07, min_tokens: int = 256,
               scoring: policies.Scoring = policies.Scoring(),
               draft_model: Transformer | None = None,
               sampling: SamplingParams = SamplingParams(),
               stop_ids: Sequence[int] | None = None, cache_dtype=jnp.bfloat16,
               backend: str | None = None, tree: Sequence[int] | Tree | None = None,
               tree_order: str = "bfs", tp: int | None = None,
               top_p_attn: float = specattn.DEFAULT_TOP_P, layer_map: Sequence[int] | None = None,
               attn_cap: int | None = None, sts_budget: int | None = None, sts_block: int = 1,
               head_map: "sts_map.HeadMap | None" = None, kv_offload: str = "device",
               planner: Planner | None = None, ssv_class: str | None = None,
               ssv_group: int | None = None, refresh: Sequence[bool] | None = None,
               prompt_buckets: int = PROMPT_BUCKETS, fp8_drafts: bool = False):
    self.prompt_buckets = check_prompt_buckets(prompt_buckets)
    self.planner = planner
    if planner is not None:
      if (method != "none" or gamma is not None or tree is not None or sparsity != 0.07
          or ssv_class is not None or ssv_group is not None):
        raise ValueError("with a planner its strategies set method, gamma, sparsity, tree and "
                         "SSV class and group: leave them unset")
      if len({s.method == "ssv" for s in planner.strategies}) > 1:
        raise ValueError("a planner's strategies either all draft for themselves or all verify "
                         "with SSV (an NSA target and a draft model), not both")
      first = planner.strategies[0]    # what the runner's own settings describe (time_phases)
      method, sparsity, tree, tree_order = (first.method, first.sparsity, first.tree,
                                            first.tree_order)
      gamma = None if tree is not None else first.gamma
      if method == "ssv":
        ssv_class, ssv_group = first.ssv_class, first.group
    if method not in METHODS:
      raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    if method in DRAFT_MODEL_METHODS and draft_model is None:
      raise ValueError(f"method {method!r} needs a draft model (--draft_model)")
    if method not in (*DRAFT_MODEL_METHODS, "ssv") and draft_model is not None:
      raise ValueError(f"a draft model was given, but method {method!r} does not use one "
                       "(use method 'draft', 'specattn', 'sts' or 'ssv')")
    if draft_model is not None and draft_model.cfg.vocab_size != model.cfg.vocab_size:
      raise ValueError(f"the draft model's vocabulary ({draft_model.cfg.vocab_size} tokens) is not "
                       f"the target's ({model.cfg.vocab_size}): they must share a tokenizer")
    if method in policies.SELF_DRAFTING:
      policies.validate(method, ratio=sparsity, min_tokens=min_tokens)
    self.scoring = policies.check_scoring(scoring)
    self.specattn = None
    if method == "specattn":
      from jaxspec.specattn_map import check_layers, proportional_map
      lt, ld = model.cfg.num_layers, draft_model.cfg.num_layers
      layers = proportional_map(lt, ld) if layer_map is None else check_layers(layer_map, lt, ld)
      if tp not in (None, 1) or model.mesh is not None:
        raise ValueError("method 'specattn' runs on one device (no tensor parallelism yet)")
      self.specattn = specattn.SpecAttnConfig(layers=layers, top_p=top_p_attn, cap=attn_cap)
    self.sts = None
    if method == "sts":
      self.sts = sts_config(model, draft_model, sts_budget, sts_block, head_map, tp)
    self.ssv = None
    if method == "ssv":
      self.ssv = ssv_lib.make_config(model, ssv_class, ssv_group, refresh)
      if draft_model is None:   # self-drafting: the NSA model's own plain decoding drafts
        draft_model = model
    elif (ssv_class, ssv_group, refresh) != (None, None, None):
      raise ValueError(f"ssv_class, ssv_group and refresh are settings of method 'ssv', not "
                       f"{method!r}")
    self.offload = OffloadConfig(mode=kv_offload)
    if self.offload.on_host and method != "sts":
      raise ValueError(f"kv_offload={kv_offload!r} is built for method 'sts' (its verification "
                       f"reads only the rows its draft picked), not {method!r}")
    self.method = method
    self.tree = requests.check_tree(tree, tree_order, method, gamma)
    if any(m is not None and m.cfg.nsa is not None for m in (model, draft_model)):
      if method not in NSA_METHODS:
        raise ValueError(f"NSA models run method 'none', 'draft' or 'ssv': {method!r} picks KV "
                         "by attention scores, which Native Sparse Attention does not collect")
      trees = self.tree is not None or (planner is not None and any(
          st.tree is not None for st in planner.strategies))
      if draft_model is not None and draft_model.cfg.nsa is not None and trees:
        raise ValueError("an NSA draft model drafts chains only (a tree level attends over part "
                         "of the tree's window); use a dense draft model for a draft tree")
    if method == "none":
      self.gamma = 0
    elif self.tree is not None:
      self.gamma = self.tree.depth
    else:
      self.gamma = requests.check_count("gamma (draft tokens per round)",
                                        DEFAULT_GAMMA if gamma is None else gamma)
    self.sparsity, self.min_tokens = sparsity, min_tokens
    self.sampling = sampling
    self.stop_ids = requests.check_stop_ids(stop_ids, model.cfg)
    self.cache_dtype = requests.check_dtype("cache_dtype", cache_dtype).name
    self.backend = check_backend(backend or default_backend())
    if self.sts is not None and self.sts.granularity == "q" and self.backend != "reference":
      raise ValueError("a query-head STS map needs per-query-head draft scores, which only the "
                       "reference backend collects (map with --granularity=kv)")
    self.mesh = model.mesh if tp is None else sharding.make_mesh(tp)
    if draft_model is not None:
      sharding.check_divides(draft_model.cfg, self.mesh, "the draft model")
      draft_model = sharding.shard_model(draft_model, self.mesh)
    model = sharding.shard_model(model, self.mesh)
    self.fp8_drafts = bool(fp8_drafts)
    if self.fp8_drafts:
      if method == "none":
        raise ValueError("fp8_drafts needs a speculative method: vanilla decoding drafts nothing")
      fp8.add_fp8_mlps(model if draft_model is None else draft_model)
    self.model, self.draft_model = model, draft_model
    target_gd, target_params = nnx.split(model)
    draft_gd, draft_params = nnx.split(draft_model) if draft_model is not None else (None, None)
    self._graphdefs = (target_gd, draft_gd)
    self._params = (target_params, draft_params)
    self._params_key = _arrays_key(self._params)   # described once: see _compile
    self._compiled: dict = {}

  @property
  def speculative(self) -> bool:
    return self.method != "none"

  @property
  def spare(self) -> int:
    """Cache slots past max_len that a step needs (the verification's rows; with a planner, its
    largest strategy's)."""
    if self.planner is not None:
      return self.planner.spare
    return self.gamma + 1 if self.tree is None else self.tree.size

  def config(self, capacity: int, strategy: Strategy | None = None) -> RunConfig:
    """The static run configuration for a cache of `capacity` slots per sequence (`strategy`: a
    planner's strategy instead of the runner's own method, gamma, sparsity and tree)."""
    drafter = None
    if self.method in ("draft", "ssv"):
      drafter = DraftModelDrafter()
    elif self.method == "specattn":
      drafter = specattn.SpecAttnDrafter(spec=self.specattn)
    elif self.method == "sts":
      drafter = sts.STSDrafter(spec=self.sts)
    elif self.speculative:
      drafter = SelfDrafter(policies.make_policy(
          self.method, ratio=self.sparsity, min_tokens=self.min_tokens,
          k_max=policies.static_k_max(capacity, self.sparsity, self.min_tokens),
          scoring=self.scoring, backend=self.backend, mesh=self.mesh))
    config = RunConfig(capacity=capacity, sampling=self.sampling, stop_ids=self.stop_ids,
                       backend=self.backend, cache_dtype=self.cache_dtype, gamma=self.gamma,
                       drafter=drafter, tree=self.tree, offload=self.offload, ssv=self.ssv,
                       fp8_drafts=self.fp8_drafts)
    if strategy is None:
      return config
    return strategy.run_config(config, min_tokens=self.min_tokens, scoring=self.scoring,
                               mesh=self.mesh)

  def _check_context(self, max_len: int) -> None:
    """The target's context is checked by `requests.check_request`; the draft model's here."""
    if self.draft_model is None:
      return
    limit = requests.context_limit(self.draft_model.cfg)
    if max_len > limit:
      raise ValueError(f"{max_len} tokens per sequence exceed the draft model's context "
                       f"({limit} positions)")

  # -- compiled pieces ---------------------------------------------------------------------------

  def _compile(self, jitted, *args, **static):
    """(compiled callable on the non-static args, seconds spent compiling: 0 when cached)."""
    # The key is built before every chunk while the GPU waits (a chunk returns when its loop
    # ends), so the runner's own parameters, which never change, are described once (230 leaves
    # at 24 layers: 1.4 ms a chunk on a CPU core, 0.2-0.4 ms without them).
    key = (jitted, tuple(sorted(static.items(), key=lambda kv: kv[0])),
           tuple(self._params_key if a is self._params else _arrays_key(a) for a in args))
    if key in self._compiled:
      return self._compiled[key], 0.0
    t0 = time.perf_counter()
    compiled = jitted.lower(self._graphdefs, *args, **static).compile()
    self._compiled[key] = compiled
    return compiled, time.perf_counter() - t0

  def start(self, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int], *,
            max_len: int | None = None, seed: int = 0, max_new_buffer: int | None = None,
            params=None, strategy: Strategy | None = None):
    """Prefill: (the state the loops start from, seconds spent compiling, the Batch). max_len
    (prompt + new tokens per sequence) defaults to the longest prompt + max_new_tokens, capped at
    the model's context. `params`: a copy of the models' parameters to prefill with, and so the
    device to prefill on (default: the runner's own). `strategy`: the planner's strategy to
    start with."""
    max_len = requests.check_request(self.model.cfg, prompts, max_new_tokens, max_len)
    batch = make_batch(prompts, max_new_tokens, max_len, spare=self.spare,
                       max_new_buffer=max_new_buffer, prompt_buckets=self.prompt_buckets)
    self._check_context(max_len)
    args = (self._params if params is None else params, jnp.asarray(batch.prompts),
            jnp.asarray(batch.prompt_lens), jnp.asarray(batch.max_new), jax.random.PRNGKey(seed))
    run, seconds = self._compile(_prefill, *args, config=self.config(batch.capacity, strategy),
                                 max_new_buffer=batch.max_new_buffer)
    return run(*args), seconds, batch

  def step(self, state, steps: int, strategy: Strategy | None = None):
    """Up to `steps` decode steps (vanilla) or rounds (speculative) on `state` (donated):
    (the new state, seconds spent compiling). `strategy`: a planner's strategy to run them with."""
    capacity = decode_state(state).cache.capacity
    run, seconds = self._compile(chunk_fn(state), self._params, state, steps=steps,
                                 config=self.config(capacity, strategy))
    return run(self._params, state), seconds

  def _follow_plan(self, state: SpecState, control, strategy: Strategy, tally: Tally):
    """At a chunk boundary: tell the planner's controller what the chunk did and switch the state
    to the strategy it returns. (state, strategy, seconds spent compiling)."""
    ds = state.decode
    hist, rounds, lengths, done = jax.device_get((state.accept_hist, state.rounds,
                                                  ds.cache.lengths, ds.done))
    rounds, accepted = tally.chunk(hist, rounds)
    active = lengths[~done]
    nxt = control.observe(rounds, accepted, int(active.max() if active.size else lengths.max()))
    if nxt == strategy:
      return state, strategy, 0.0
    tally.close(strategy.key, hist)
    state, seconds = self.switch(state, nxt)
    return state, nxt, seconds

  def precompile(self, state: SpecState, strategy: Strategy, steps: int) -> float:
    """Compiles every variant the planner can switch `state` (running `strategy`) to, so that no
    switch waits on a compile: each strategy's chunk of `steps` rounds, and the switch between
    every ordered pair of strategies, on abstract states of the batch's shapes (nothing runs).
    Returns the seconds spent compiling. A refill's switch (a batch-1 state, `serve`) is left to
    its first use: it is a small program."""
    if self.planner is None:
      raise ValueError("precompile needs a runner with a planner")
    capacity = state.decode.cache.capacity
    seconds = 0.0
    with warnings.catch_warnings():
      warnings.filterwarnings("ignore", "Some donated buffers were not usable")
      # The batch state each strategy runs on: the real one for `strategy`, abstract otherwise.
      shapes = {strategy: state}
      for s in self.planner.strategies:
        if s not in shapes:
          compiled, t = self._compile(_switch, state, config=self.config(capacity, s))
          seconds += t
          shapes[s] = jax.tree.map(
              lambda info: jax.ShapeDtypeStruct(info.shape, info.dtype, sharding=info.sharding),
              compiled.out_info)
      for a, state_a in shapes.items():
        seconds += self._compile(chunk_fn(state_a), self._params, state_a, steps=steps,
                                 config=self.config(capacity, a))[1]
        for b in shapes:   # from `strategy` these are cached already: no time
          if b != a:
            seconds += self._compile(_switch, state_a, config=self.config(capacity, b))[1]
    return seconds

  def switch(self, state: SpecState, strategy: Strategy) -> tuple[SpecState, float]:
    """`state` (donated) made ready for the planner's `strategy` (`planner.switch_state`): (the
    state, seconds spent compiling). Its acceptance histogram restarts: read it first."""
    with warnings.catch_warnings():
      # The plan's index buffer and the histogram change shape, so XLA cannot reuse their donated
      # buffers (it says so); the caches, which are the point of donating, it reuses.
      warnings.filterwarnings("ignore", "Some donated buffers were not usable")
      run, seconds = self._compile(_switch, state,
                                   config=self.config(state.decode.cache.capacity, strategy))
    return run(state), seconds

  def extend(self, state: SpecState, turns: Sequence[Sequence[int]],
             max_new_tokens: int | Sequence[int], *, chunk: int = 1) -> tuple[SpecState, float]:
    """STS-PD, method 'sts' only: append one turn per sequence (a tool output, a user message)
    to a session's state (from `start` or `step`; donated) with a sparse prefill of the target
    (`jaxspec.drafting.sts_prefill`), and return (the state that decodes the reply to it, seconds
    spent compiling). Each sequence so far, its last sampled token included, stays in the caches
    as it is; the reply's first token is sampled from the turn's last row and the output buffer
    restarts empty, `max_new_tokens` (one, or one per sequence) allowed: read the previous reply
    from the state first. `chunk`: C, the turn rows sharing one per-head selection (1: each row its
    own). Like STS decoding it CHANGES the output (the masked target's). The cache does not grow:
    `start` with a max_len that holds the whole session."""
    if self.method != "sts":
      raise ValueError(f"extend prefills a turn sparsely for method 'sts'; method {self.method!r} "
                       "has no sparse prefill")
    chunk = sts_prefill.check_chunk(chunk)
    ds = state.decode
    b, capacity = ds.cache.batch, ds.cache.capacity
    requests.check_prompts(turns, self.model.cfg.vocab_size, name="turns")
    if len(turns) != b:
      raise ValueError(f"{len(turns)} turns for a session of {b} sequences: give one per sequence")
    requests.check_max_new_tokens(max_new_tokens, b)
    lens = np.asarray([len(t) for t in turns], np.int32)
    n = np.asarray(jax.device_get(ds.cache.lengths))
    need = int((n + lens + 1).max()) + self.spare     # the turn, last_token, a round's rows
    if need > capacity:
      raise ValueError(f"the turns need {need} cache slots and the session has {capacity}: start "
                       "it with a larger max_len")
    # Rows: last_token + the turn, in whole chunks, their count bucketed (fewer compiles); the
    # padded rows must lie inside the cache too.
    steps = -(-(int(lens.max()) + 1) // chunk)
    if int(n.max()) + bucket(steps, 1) * chunk <= capacity:
      steps = bucket(steps, 1)
    if int(n.max()) + steps * chunk > capacity:
      raise ValueError(f"the turns' rows padded to chunks of {chunk} run past the cache "
                       f"({capacity} slots): use a smaller chunk or a larger max_len")
    width = steps * chunk - 1
    padded = np.zeros((b, width), np.int32)
    for i, t in enumerate(turns):
      padded[i, :len(t)] = t
    max_new = np.broadcast_to(np.asarray(max_new_tokens, np.int32), (b,))
    buffer = ds.tokens.shape[1]
    if int(max_new.max()) > buffer:
      buffer = bucket(int(max_new.max()), 1)
    args = (self._params, state, jnp.asarray(padded), jnp.asarray(lens), jnp.asarray(max_new))
    run, seconds = self._compile(_extend, *args, config=self.config(capacity), chunk=chunk,
                                 max_new_buffer=buffer)
    return run(*args), seconds

  # -- a batch -----------------------------------------------------------------------------------

  def generate(self, prompts: Sequence[Sequence[int]], *,
               max_new_tokens: int | Sequence[int] = 128, max_len: int | None = None,
               seed: int = 0, chunk: int | None = None,
               on_chunk: Callable[[np.ndarray, np.ndarray, np.ndarray], None] | None = None
               ) -> tuple[list[list[int]], GenerationStats]:
    """Decode a batch of token-id prompts. Returns (new tokens per prompt, stats).

    `chunk`: steps (vanilla, default 64) or rounds (speculative, default 16) per compiled call;
    `on_chunk(tokens [B, N], num_new [B], done [B])` runs on the host after prefill and after
    every chunk (for streaming). stats.extra for speculative methods: method, gamma,
    mean_accepted_tokens (per round, incl. the corrected/bonus token), acceptance_by_position
    (gamma floats), verify_rounds (sequence-rounds counted); for 'specattn' and 'sts' also
    kv_kept_share (the share of prefix keys its sparse layers read, `SpecAttnDrafter.kept_share`);
    for 'ssv' ssv_class and ssv_group; with fp8_drafts, drafts 'fp8'.
    With a planner: method 'plan', strategy (the last one's key), mean_accepted_tokens and
    verify_rounds over all of them, plan_strategies (the same per strategy) and plan_switches (the
    controller's log: round, context, from, to, reason, ema, expected) instead of gamma and
    acceptance_by_position; the whole batch runs one strategy at a time (the compiled chunk is
    shared), switched between chunks.
    """
    if chunk is None:
      chunk = SPECULATIVE_CHUNK if self.speculative else VANILLA_CHUNK
    chunk = requests.check_count("chunk", chunk)
    stats = GenerationStats()
    control = strategy = None
    if self.planner is not None:
      control = self.planner.controller(max(map(len, prompts), default=0), len(prompts))
      strategy, tally = control.strategy, Tally()
    state, stats.compile_s, batch = self.start(prompts, max_new_tokens, max_len=max_len, seed=seed,
                                               strategy=strategy)
    stats.prompt_tokens = int(batch.prompt_lens.sum())
    t0 = time.perf_counter()
    state = jax.block_until_ready(state)
    stats.prefill_s = time.perf_counter() - t0

    def report(s):
      ds = decode_state(s)
      if on_chunk:
        on_chunk(*jax.device_get((ds.tokens, ds.num_new, ds.done)))
      return bool(np.asarray(ds.done).all())

    done = report(state)
    first = int(np.asarray(decode_state(state).num_new).sum())
    if not done:   # compile the chunk (with a planner, every strategy's) before the clock starts
      stats.compile_s += (self.precompile(state, strategy, chunk) if control is not None else
                          self._compile(chunk_fn(state), self._params, state, steps=chunk,
                                        config=self.config(batch.capacity, strategy))[1])
    t0 = time.perf_counter()
    compiling = 0.0   # anything still compiled inside the loop: not decode time
    while not done:
      state, seconds = self.step(state, chunk, strategy)
      compiling += seconds
      stats.rounds += 0 if self.speculative else chunk
      done = report(state)
      if control is not None and not done:
        state, strategy, seconds = self._follow_plan(state, control, strategy, tally)
        compiling += seconds
    jax.block_until_ready(state)
    stats.decode_s = time.perf_counter() - t0 - compiling
    stats.compile_s += compiling
    ds = decode_state(state)
    tokens, num_new = jax.device_get((ds.tokens, ds.num_new))
    stats.new_tokens = int(num_new.sum())
    stats.decode_tokens = stats.new_tokens - first
    stats.extra = {"method": self.method}
    if self.speculative:
      hist, rounds = jax.device_get((state.accept_hist, state.rounds))
      stats.rounds = int(rounds)
      acc = acceptance_summary(hist)
      stats.extra.update(
          gamma=self.gamma, mean_accepted_tokens=round(acc["mean_accepted_tokens"], 4),
          acceptance_by_position=[round(p, 4) for p in acc["acceptance_by_position"]],
          verify_rounds=acc["verify_rounds"])
    if self.ssv is not None:
      stats.extra.update(ssv_class=self.ssv.ssv_class, ssv_group=self.ssv.group)
    if self.fp8_drafts:
      stats.extra["drafts"] = "fp8"
    if control is not None:   # acceptance per strategy: their histograms differ in width
      tally.close(strategy.key, hist)
      plan = tally.summary()
      for k in ("gamma", "acceptance_by_position"):
        stats.extra.pop(k)
      total = plan.pop("all")
      stats.extra.update(method="plan", strategy=strategy.key,
                         mean_accepted_tokens=total["mean_accepted_tokens"],
                         verify_rounds=total["verify_rounds"], plan_strategies=plan,
                         plan_switches=control.log)
    if self.method in ("specattn", "sts"):
      stats.extra["kv_kept_share"] = round(specattn.SpecAttnDrafter.kept_share(state.drafter), 4)
    return [tokens[i, :num_new[i]].tolist() for i in range(len(prompts))], stats

  # -- continuous batching -----------------------------------------------------------------------

  def _prefill_one(self, prompt, max_new: int, max_len: int, seed: int, budget: int | None = None,
                   params=None, strategy: Strategy | None = None):
    """(a batch-1 prefilled state, seconds spent compiling)."""
    state, seconds, _ = self.start([prompt], budget or max_new, max_len=max_len, seed=seed,
                                   max_new_buffer=max_new, params=params, strategy=strategy)
    return state, seconds

  def _prefill_placement(self):
    """(the parameters copied onto a prefill device of their own, the decode device), copied once
    per runner."""
    if self.mesh is not None:
      raise ValueError(f"disaggregated serving runs on one device for decoding and one for "
                       f"prefill; with tp={sharding.tp_size(self.mesh)} it is not built yet")
    if not hasattr(self, "_prefill_copy"):
      decode = next(iter(jax.tree.leaves(self._params)[0].devices()))
      others = [d for d in jax.devices() if d != decode]
      if not others:
        raise ValueError(f"disaggregated serving needs a second device to prefill on; only "
                         f"{decode} is available")
      self._prefill_copy = (jax.device_put(self._params, others[0]), decode)
    return self._prefill_copy

  def serve(self, prompts: list[list[int]], batch: int, max_new: int, *, max_len: int,
            chunk: int, warmup_s: float, measure_s: float, seed: int = 0, stagger: bool = False,
            on_finish: Callable[[int, np.ndarray], None] | None = None,
            disaggregate: bool = False) -> tuple[dict, object]:
    """Continuous batching over the request stream, B = `batch` slots of `max_len` tokens each.

    Every `chunk` steps (or rounds) finished slots are refilled with the next request, prefilled
    on its own and inserted into the slot. stagger: the first B requests may generate
    max_new * (i + 1) / B tokens (slot i), every later one max_new. Requests of one length that
    start together also finish together, so the window would see waves of B refills and little
    decoding between them; staggered, the slots finish evenly spread over one request's lifetime,
    as in a server that has been running for a while.
    disaggregate: prefill on a second device (a copy of the weights there), ahead of the finishes:
    up to `_AHEAD` prefills beyond the free slots are kept in flight there while the decode device
    goes on decoding; at each chunk boundary the finished prefills are moved device to device and
    inserted into free slots, and a free slot whose prefill is not finished yet waits (idle) for a
    later boundary instead of stalling the batch. `idle_slot_share` says how much of the window
    slots spent waiting so.
    With a planner the batch is one request group: one strategy decodes all slots, chosen at each
    chunk boundary from the longest active context and the batch's acceptance. Every strategy's
    chunk and switch is compiled before serving starts (`precompile`); refills are prefilled
    with the planner's first strategy and switched to the one then running, so prefills compile
    once per prompt length, not once per strategy. What still compiles inside the window (a
    refill's first switch to a strategy, a new prompt length) is left out of the window's seconds
    (`plan_compile_s`): the window closes after measure_s seconds of serving, compiles not
    counted. The result adds `plan_switches` and `plan_strategies`, and the acceptance figures
    are over all strategies.
    Returns (the measured window's numbers, the final state: a steady-state batch to profile).
    The numbers include tokens/s with refills and decoding only, `refill_share` (the window's
    time spent refilling), `refills` (slots refilled in the window) and `ms_per_refill`.
    `on_finish(request index, its new tokens)` runs for every request that finishes, warm-up
    included (not for those still running when the window closes). The chunks where some finish
    fetch the token buffer once for all of them (lengths are on the host already), before the
    refills, and count that time with the refills.
    """
    if self.offload.on_host:
      raise ValueError(f"serve refills slots of a device cache; kv_offload={self.offload.mode!r} "
                       "is built for generate only")
    if self.planner is not None and disaggregate:
      raise ValueError("a planner switches the refills' strategy at chunk boundaries; "
                       "disaggregated serving prefills ahead of them (not combined yet)")
    control = strategy = None
    if self.planner is not None:
      control = self.planner.controller(max(map(len, prompts[:batch]), default=0), batch)
      strategy, tally = control.strategy, Tally()
    first = strategy
    compiling = [0.0]
    queue = collections.deque(range(len(prompts)))
    prefill_params, decode_device = self._prefill_placement() if disaggregate else (None, None)
    ahead = collections.deque()    # disaggregated: (request, its state on the prefill device)

    def prefill(req, budget=None):
      fresh, seconds = self._prefill_one(prompts[req], max_new, max_len, seed + req, budget,
                                         prefill_params, first)
      if strategy != first:
        fresh, switching = self.switch(fresh, strategy)
        seconds += switching
      compiling[0] += seconds
      return fresh

    def moved(fresh):
      return fresh if decode_device is None else jax.device_put(fresh, decode_device)

    def next_request():
      """(request, its prefilled state on the decode device) for a free slot, or None: the queue
      is empty or (disaggregated) the oldest prefill launched ahead is not finished yet."""
      if not disaggregate:
        if not queue:
          return None
        req = queue.popleft()
        return req, prefill(req)
      if ahead and all(x.is_ready() for x in jax.tree.leaves(ahead[0][1])):
        req, fresh = ahead.popleft()
        return req, moved(fresh)
      return None

    def launch_ahead(free: int):
      while disaggregate and queue and len(ahead) < free + _AHEAD:
        req = queue.popleft()
        ahead.append((req, prefill(req)))

    # The first B requests go in one by one, like every later refill: a batched prefill of B long
    # prompts needs activation memory for B x 32K tokens at once (it ran out of memory on an H200
    # at B=64). The placeholder one-token batch only fixes the state's static sizes.
    t_setup = time.perf_counter()
    state, _, _ = self.start([[0]] * batch, max_new, max_len=max_len, seed=seed,
                             max_new_buffer=max_new, strategy=strategy)
    slot_req = [queue.popleft() for _ in range(batch)]
    reported = np.zeros(batch, bool)

    def put(state, fresh, slot):
      return fresh if batch == 1 else insert_slot(state, fresh, jnp.int32(slot))

    for slot, req in enumerate(slot_req):
      budget = max(1, max_new * (slot + 1) // batch) if stagger else max_new
      state = put(state, moved(prefill(req, budget)), slot)
    launch_ahead(0)

    def progress(state):
      ds = decode_state(state)
      hist = state.accept_hist.sum(0) if self.speculative else None
      return jax.device_get((ds.num_new, ds.done, hist))

    def finish(slots, num_new):
      """Report the newly finished `slots` (host lengths `num_new`) before they are refilled."""
      slots = [int(s) for s in slots if not reported[s]]
      reported[slots] = True
      if on_finish is None or not slots:
        return
      # One transfer of the whole buffer, not a gather per slot: fixed shape, so nothing compiles
      # mid-window. Rows are copied: on the CPU the fetched array can alias the buffer that the
      # next chunk reuses (the state is donated).
      tokens = np.asarray(jax.device_get(decode_state(state).tokens))
      for slot in slots:
        on_finish(slot_req[slot], tokens[slot, :num_new[slot]].copy())

    if self.planner is not None:
      self.precompile(state, strategy, chunk)
    state, _ = self.step(state, chunk, strategy)  # compiles the chunk
    num_new, done, hist = progress(state)
    plan_hists: dict = {}   # with a planner: the window's histogram per strategy
    compiling[0] = 0.0
    t_setup = time.perf_counter() - t_setup
    counted = dict(tokens=0, seconds=0.0, refill_s=0.0, rounds=0, finished=0, idle_slots=0,
                   compile_s=0.0, refills=0)
    hist_window = None
    t_start = time.perf_counter()
    measuring = False
    bar = tqdm(total=warmup_s + measure_s, desc=self.method, unit="s", file=sys.stderr,
               bar_format="{desc}: {n:.0f}/{total:.0f} s {postfix}",
               disable=not sys.stderr.isatty())
    while True:
      t0 = time.perf_counter()
      state, step_compile = self.step(state, chunk, strategy)
      compiling[0] += step_compile
      new_num, done, new_hist = progress(state)   # waits for the chunk
      t1 = time.perf_counter()
      produced = int((new_num - num_new).sum())
      delta_hist = None if new_hist is None else new_hist - hist
      refilled = False
      run_key = None if strategy is None else strategy.key   # the strategy of this chunk
      finished = np.flatnonzero(done & ~reported)
      counted["finished"] += measuring * len(finished)
      finish(finished, new_num)
      free = [slot for slot in np.flatnonzero(done) if reported[slot]]
      for slot in free:
        got = next_request()
        if got is None:
          break
        slot_req[slot], fresh = got
        reported[slot] = False
        state = put(state, fresh, slot)
        refilled = True
        counted["refills"] += measuring
      idle = int(sum(reported[slot] for slot in free))   # free slots left waiting
      launch_ahead(idle)
      if control is not None and not done.all():
        lengths = np.asarray(jax.device_get(decode_state(state).cache.lengths))
        _, accepted = accepted_per_round(delta_hist[None])
        nxt = control.observe(chunk, accepted, int(lengths[~done].max()))
        if nxt != strategy:
          state, seconds = self.switch(state, nxt)
          compiling[0] += seconds
          strategy, refilled = nxt, True
      if refilled:   # refilled slots restart their token counts and acceptance histograms
        new_num, done, new_hist = progress(state)   # waits for the refills
      elif ahead and done.all():
        # Nothing to decode until a prefill finishes: wait for it rather than spin.
        jax.block_until_ready(ahead[0][1])
      t2 = time.perf_counter()
      if measuring:
        counted["tokens"] += produced
        counted["seconds"] += t2 - t0 - compiling[0]
        counted["refill_s"] += t2 - t1 - (compiling[0] - step_compile)
        counted["rounds"] += chunk
        counted["idle_slots"] += idle
        counted["compile_s"] += compiling[0]
        if control is not None:   # widths differ between strategies: one histogram each
          plan_hists[run_key] = plan_hists.get(run_key, 0) + delta_hist
        elif delta_hist is not None:
          hist_window = delta_hist if hist_window is None else hist_window + delta_hist
      compiling[0] = 0.0
      num_new, hist = new_num, new_hist
      elapsed = t2 - t_start
      bar.n = min(elapsed, bar.total)
      bar.set_postfix_str(f"{counted['tokens'] / max(counted['seconds'], 1e-9):.0f} tok/s"
                          if measuring else "warming up")
      bar.refresh()
      if not measuring and elapsed >= warmup_s:
        measuring = True
      if measuring and counted["seconds"] >= measure_s:   # compiles in the window not counted
        break
      if not queue and not ahead and done.all():
        break
    bar.close()
    finish(np.flatnonzero(done), num_new)   # a refill that was done at its prefill (budget 1)
    seconds, refill_s = counted["seconds"], counted["refill_s"]
    chunks = counted["rounds"] // chunk
    out = dict(method=self.method, gamma=self.gamma, setup_s=t_setup, measured_s=seconds,
               tokens=counted["tokens"],
               tokens_per_s=counted["tokens"] / seconds if seconds else None,
               decode_only_tokens_per_s=(counted["tokens"] / (seconds - refill_s)
                                         if seconds > refill_s else None),
               refill_share=refill_s / seconds if seconds else None,
               refills=counted["refills"],
               ms_per_refill=(refill_s / counted["refills"] * 1e3 if counted["refills"]
                              else None),
               requests_finished=counted["finished"], disaggregate=disaggregate,
               idle_slot_share=counted["idle_slots"] / (chunks * batch) if chunks else None)
    if control is not None:
      for key, h in plan_hists.items():
        tally.close(key, h[None])
      plan = tally.summary()
      total = plan.pop("all")
      out.update(method="plan", gamma=None, mean_accepted_tokens=total["mean_accepted_tokens"],
                 verify_rounds=total["verify_rounds"], plan_strategies=plan,
                 plan_switches=control.log, plan_compile_s=counted["compile_s"])
    elif hist_window is not None:
      out.update(acceptance_summary(hist_window[None]))
    return out, state

  # -- phase timing ------------------------------------------------------------------------------

  @functools.cached_property
  def _phase_fns(self):
    """draft / verify / update, each jitted with the model structure and config closed over:
    passing the GraphDef as a static argument would hash it on every call (1.5 ms for the 0.5B
    model, on the host while the device waits), which a phase timer would count as phase time."""
    graphdefs = self._graphdefs

    def fns(config, batch):
      def draft(params, state):
        target, draft_model = _merge(graphdefs, params)
        return config.drafter.draft(target, draft_model, state, config)

      def check(params, state, drafts, probs):
        return verify(_merge(graphdefs, params)[0], state, drafts, probs, config)

      # Compiled as the loop is, so each phase runs the loop's GEMMs.
      jit = functools.partial(jax.jit, compiler_options=loop_compiler_options(batch))
      return (jit(draft, donate_argnums=1), jit(check, donate_argnums=1),
              jit(functools.partial(config.drafter.update, config=config), donate_argnums=0))
    return functools.lru_cache(maxsize=4)(fns)

  def time_phases(self, state: SpecState, *, rounds: int = 8, warmup: int = 2
                  ) -> tuple[SpecState, dict]:
    """Time shares of drafting / verification / update over `rounds` rounds from `state`
    (donated round by round; use the returned one), after `warmup` untimed rounds.

    Each phase is its own jitted function (the same pure functions the fused loop composes),
    called on the host one after the other with the device synchronised around each:
      draft    gamma draft steps incl. sampling (for quest also its per-step page scoring);
      verify   the full-attention pass incl. score collection, the LM head, accept/reject, append;
      update   the drafter's update (the policy's KV selection: top-k, pages, quest's summaries).
    Separate calls add dispatch and lose cross-phase fusion, so the sum exceeds a fused round
    (on an H200 by 1.3-2.5x, benchmarks/RESULTS.md): read the shares as rough, and take
    throughput from `generate` or `serve`. Sequences that finish keep riding along.
    """
    if not self.speculative:
      raise ValueError("time_phases times speculative phases; method 'none' has none")
    requests.check_count("rounds", rounds)
    requests.check_count("warmup", warmup, 0)
    draft_fn, verify_fn, update_fn = self._phase_fns(self.config(state.decode.cache.capacity),
                                                     state.decode.cache.lengths.shape[0])
    times = {"draft": 0.0, "verify": 0.0, "select": 0.0}
    hist0 = None
    for r in range(warmup + rounds):
      if r == warmup:
        hist0 = np.asarray(state.accept_hist)
      t0 = time.perf_counter()
      state, drafts, probs = jax.block_until_ready(draft_fn(self._params, state))
      t1 = time.perf_counter()
      state, *verdict = jax.block_until_ready(verify_fn(self._params, state, drafts, probs))
      t2 = time.perf_counter()
      state = jax.block_until_ready(update_fn(state, *verdict))
      t3 = time.perf_counter()
      if r >= warmup:
        times["draft"] += t1 - t0
        times["verify"] += t2 - t1
        times["select"] += t3 - t2
    total = sum(times.values())
    out = {f"{k}_s_per_round": v / rounds for k, v in times.items()}
    out.update({f"{k}_share": v / total for k, v in times.items()})
    out.update({"gamma": self.gamma, "rounds": rounds,
                **acceptance_summary(np.asarray(state.accept_hist) - hist0)})
    return state, out

  def profile_rounds(self, prompts: list[list[int]], *, rounds: int = 8, warmup: int = 2,
                     max_new_tokens: int | None = None, seed: int = 0,
                     max_len: int | None = None) -> dict:
    """`time_phases` from a fresh prefill of `prompts`; keep max_new_tokens above
    (warmup + rounds) * (gamma + 1) (the default) so that sequences do not finish early."""
    if not self.speculative:
      raise ValueError("profile_rounds times speculative phases; method 'none' has none")
    requests.check_count("rounds", rounds)
    requests.check_count("warmup", warmup, 0)
    if max_new_tokens is None:
      max_new_tokens = (warmup + rounds + 1) * self.spare
    state, _, _ = self.start(prompts, max_new_tokens, max_len=max_len, seed=seed)
    _, out = self.time_phases(state, rounds=rounds, warmup=warmup)
    return dict(out, method=self.method, batch=len(prompts))


def sts_config(model: Transformer, draft: Transformer, budget, block, head_map, tp
               ) -> sts.STSConfig:
  """Method 'sts''s static settings for the pair, checked (one-line ValueErrors)."""
  from jaxspec import sts_map
  budget = sts_map.check_budget(budget)
  if tp not in (None, 1) or model.mesh is not None:
    raise ValueError("method 'sts' runs on one device (no tensor parallelism yet)")
  if head_map is None:
    granularity = "kv"
    heads = sts.proportional_heads(model.cfg.num_layers, model.cfg.num_kv_heads,
                                   draft.cfg.num_layers, draft.cfg.num_kv_heads)
  else:
    if head_map.budget != budget:
      raise ValueError(f"the STS head map was made for budget {head_map.budget}, not {budget}")
    granularity = head_map.granularity
    heads = sts_map.check_heads(head_map.heads, model, draft, granularity)
  return sts.STSConfig(heads=heads, draft_heads=sts_map.heads_of(draft, granularity),
                       target_kv_heads=model.cfg.num_kv_heads, budget=budget, block=block,
                       granularity=granularity)


def generate(model: Transformer, prompts: Sequence[Sequence[int]], *, method: str = "none",
             max_new_tokens: int | Sequence[int] = 128, max_len: int | None = None,
             seed: int = 0, chunk: int | None = None,
             on_chunk: Callable[[np.ndarray, np.ndarray, np.ndarray], None] | None = None,
             **settings) -> tuple[list[list[int]], GenerationStats]:
  """`Runner(model, method=method, **settings).generate(prompts, ...)`: one batch, compiled anew
  (build a Runner to reuse compiled loops across calls)."""
  return Runner(model, method=method, **settings).generate(
      prompts, max_new_tokens=max_new_tokens, max_len=max_len, seed=seed, chunk=chunk,
      on_chunk=on_chunk)
