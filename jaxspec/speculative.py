"""Self-speculative decoding with sparse-attention drafting (Vegas and the paper's baselines).

One round, for a batch of B sequences (each at its own cache length n_b, `last_token` sampled but
not yet in the cache):

  draft      gamma one-token steps of the same model with sparse attention (the policy's
             Selection), a `lax.scan` over the static gamma: feeds last_token, d_1..d_{gamma-1},
             samples d_1..d_gamma and keeps the distributions they were drawn from (q). Draft
             K/V are written at n..n+gamma-1.
  verify     ONE forward pass over [last_token, d_1..d_gamma] at positions n..n+gamma with full
             attention: it overwrites the drafts' approximate K/V with the exact ones, gives the
             target logits (p) and, for score-based policies, the criticality scores.
             `rejection.verify_drafts` accepts a_b drafts and picks the corrected or bonus token.
             cache.lengths += a_b + 1 (last_token and the accepted drafts; rejected entries are
             dropped by lengths, never copied), then `decode.append_tokens` handles stops, budgets
             and the gamma + 1 free slots the next round needs.
  select_kv  the policy turns the scores (or the cache) into the next round's Selection.

`speculative_chunk` runs up to `rounds` rounds in one compiled `lax.while_loop` with the state
(and so the cache) donated: no host round-trip per round. `speculative_generate` is the host
wrapper, calling it in chunks so text can stream between chunks, like `decode.generate`.

Statistics carried per sequence: a histogram of accepted counts per round, from which
mean accepted tokens per round (a + 1: the accepted drafts plus the corrected/bonus token) and the
acceptance probability by draft position (P(draft i accepted | drafts 1..i-1 accepted), the
paper's Fig. 4) follow. `profile_rounds` times the three phases separately.

On your own params and token arrays (prompts right-padded [B, T] int32; capacity >= longest prompt
+ max_new + gamma + 1 and a multiple of 16, the page size):

  policy = selection.make_policy("vegas", ratio=0.07, min_tokens=256,
                                 k_max=selection.static_k_max(capacity, 0.07, 256))
  config = SpecConfig(policy=policy, gamma=6, sampling=SamplingParams(), stop_ids=(eos,))
  graphdef, params = nnx.split(model)
  state = speculative_prefill(graphdef, params, prompts, prompt_lens, max_new, jax.random.key(0),
                              capacity=capacity, max_new_buffer=256, cache_dtype=jnp.bfloat16,
                              config=config)
  while not state.decode.done.all():
    state = speculative_chunk(graphdef, params, state, rounds=16, config=config)
  tokens, num_new = state.decode.tokens, state.decode.num_new    # [B, 256], [B]
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from jaxspec import decode, rejection, requests, selection
from jaxspec.attention import default_backend
from jaxspec.decode import DecodeState, GenerationStats
from jaxspec.model import Transformer
from jaxspec.sampling import SamplingParams, sample, sample_with_probs
from jaxspec.selection import METHODS, Selection, SelectionPolicy

__all__ = ["METHODS", "SpecConfig", "SpecState", "speculative_generate", "speculative_chunk",
           "speculative_prefill", "first_selection", "profile_rounds", "time_phases",
           "acceptance_summary"]


@dataclasses.dataclass(frozen=True)
class SpecConfig:
  """Everything static about a speculative run (hashable: a jit static argument)."""
  policy: SelectionPolicy
  gamma: int
  sampling: SamplingParams = SamplingParams()
  stop_ids: tuple[int, ...] = ()
  backend: str = dataclasses.field(default_factory=default_backend)

  def __post_init__(self):
    if not isinstance(self.gamma, int) or self.gamma < 1:
      raise ValueError(f"gamma (draft tokens per round) must be an integer >= 1, got {self.gamma!r}")


@struct.dataclass
class SpecState:
  decode: DecodeState       # cache, last_token, output buffer, budgets, done, PRNG key
  selection: Selection      # what the next round's drafts attend to
  accept_hist: jax.Array    # [B, gamma + 1] int32: rounds in which a drafts were accepted
  rounds: jax.Array         # [] int32: rounds run


# ----------------------------------------------------------------------------------------------
# The three phases of a round (pure functions; `speculative_round` composes them)

def draft(model: Transformer, state: SpecState, config: SpecConfig
          ) -> tuple[SpecState, jax.Array, jax.Array]:
  """gamma sparse-attention draft steps. Returns (state with draft K/V written and the key
  advanced, draft tokens [B, gamma], the distributions they were drawn from [B, gamma, V] or None
  when greedy)."""
  ds = state.decode
  # Active sequences always have gamma + 1 free slots (append_tokens' reserve); the clamp only
  # moves finished ones, whose cache no longer matters, so that every write and kernel stays in
  # bounds while they ride along.
  start = jnp.minimum(ds.cache.lengths, ds.cache.capacity - (config.gamma + 1))
  plan = config.policy.draft_plan(state.selection, config.backend)
  key, *step_keys = jax.random.split(ds.key, config.gamma + 1)

  def draft_step(carry, xs):
    cache, token = carry
    i, step_key = xs
    hidden, cache, _ = model(token[:, None], cache.replace(lengths=start + i), plan)
    logits = model.logits(hidden[:, 0])
    # Greedy verification needs only the draft tokens: skip the [gamma, B, V] buffer.
    if config.sampling.greedy:
      nxt, probs = sample(step_key, logits, config.sampling), None
    else:
      nxt, probs = sample_with_probs(step_key, logits, config.sampling)
    return (cache, nxt), (nxt, probs)

  (cache, _), (tokens, probs) = jax.lax.scan(
      draft_step, (ds.cache, ds.last_token),
      (jnp.arange(config.gamma, dtype=jnp.int32), jnp.stack(step_keys)))
  cache = cache.replace(lengths=start)
  state = state.replace(decode=ds.replace(cache=cache, key=key))
  return state, tokens.T, (None if probs is None else jnp.swapaxes(probs, 0, 1))


def verify(model: Transformer, state: SpecState, drafts: jax.Array,
           draft_probs: jax.Array | None, config: SpecConfig
           ) -> tuple[SpecState, jax.Array | None, jax.Array, jax.Array]:
  """Full-attention verification of [last_token, drafts] in one pass, accept/reject, append.

  Returns (state with lengths moved and tokens appended, scores for the policy, first_row [B]
  = the cache position of verification row 0, accepted [B]).
  """
  ds = state.decode
  start = ds.cache.lengths
  tokens = jnp.concatenate([ds.last_token[:, None], drafts], axis=1)          # [B, gamma + 1]
  hidden, cache, scores = model(tokens, ds.cache, config.policy.verify_plan(config.backend))
  target_logits = model.logits(hidden)                                        # [B, gamma + 1, V]
  key, sub = jax.random.split(ds.key)
  verdict = rejection.verify_drafts(sub, drafts, draft_probs, target_logits, config.sampling)
  active = ~ds.done
  emitted = verdict.accepted + 1
  cache = cache.replace(lengths=start + jnp.where(active, emitted, 0))
  # The emitted tokens: the accepted drafts, then the corrected/bonus token at index `accepted`.
  j = jnp.arange(config.gamma + 1)[None]
  new = jnp.where(j == verdict.accepted[:, None], verdict.next_token[:, None],
                  jnp.pad(drafts, ((0, 0), (0, 1))))
  ds = decode.append_tokens(ds.replace(cache=cache, key=key), new, emitted, config.stop_ids,
                            reserve=config.gamma + 1)
  hist = state.accept_hist + (jax.nn.one_hot(verdict.accepted, config.gamma + 1, dtype=jnp.int32)
                              * active[:, None].astype(jnp.int32))
  state = state.replace(decode=ds, accept_hist=hist, rounds=state.rounds + 1)
  return state, scores, start, verdict.accepted


def select_kv(state: SpecState, scores: jax.Array | None, first_row: jax.Array,
              accepted: jax.Array, config: SpecConfig) -> SpecState:
  """The policy's Selection for the next round."""
  sel = config.policy.select_kv(state.decode.cache, scores, first_row, accepted, config.backend)
  return state.replace(selection=sel)


def speculative_round(model: Transformer, state: SpecState, config: SpecConfig) -> SpecState:
  state, drafts, draft_probs = draft(model, state, config)
  state, scores, first_row, accepted = verify(model, state, drafts, draft_probs, config)
  return select_kv(state, scores, first_row, accepted, config)


# ----------------------------------------------------------------------------------------------
# Compiled entry points

@functools.partial(jax.jit, static_argnames=("graphdef", "capacity", "max_new_buffer", "sampling",
                                             "stop_ids", "backend", "cache_dtype", "reserve",
                                             "score_kind"))
def _prefill_with_scores(graphdef, params, prompts, prompt_lens, max_new, key, *, capacity,
                         max_new_buffer, sampling, stop_ids, backend, cache_dtype, reserve,
                         score_kind):
  # Static arguments are only what the prefill itself depends on, so methods that need the same
  # prefill (e.g. vegas / vegas-all / vegas-last at one gamma) share one compiled function.
  model = nnx.merge(graphdef, params)
  return decode.start_state(model, prompts, prompt_lens, max_new, capacity, max_new_buffer, key,
                            sampling, stop_ids, backend, cache_dtype, reserve=reserve,
                            score_kind=score_kind)


@functools.partial(jax.jit, static_argnames=("config",), donate_argnames=("ds",))
def first_selection(ds: DecodeState, scores, *, config: SpecConfig) -> SpecState:
  b = ds.last_token.shape[0]
  # The prefill's score row is each prompt's last token, at position prompt_len - 1: for the
  # policies it plays the part of the last accepted token's row (accepted = 0).
  sel = config.policy.select_kv(ds.cache, scores, ds.cache.lengths - 1,
                                jnp.zeros((b,), jnp.int32), config.backend)
  return SpecState(decode=ds, selection=sel,
                   accept_hist=jnp.zeros((b, config.gamma + 1), jnp.int32),
                   rounds=jnp.zeros((), jnp.int32))


def speculative_prefill(graphdef, params, prompts: jax.Array, prompt_lens: jax.Array,
                        max_new: jax.Array, key: jax.Array, *, capacity: int, max_new_buffer: int,
                        cache_dtype, config: SpecConfig) -> SpecState:
  """Prefill, first token, and the first round's Selection (from the prefill's last-token scores
  for score-based policies: see `jaxspec.selection`)."""
  ds, scores = _prefill_with_scores(graphdef, params, prompts, prompt_lens, max_new, key,
                                    **_prefill_static(capacity, max_new_buffer, config, cache_dtype))
  return first_selection(ds, scores, config=config)


@functools.partial(jax.jit, static_argnames=("graphdef", "rounds", "config"),
                   donate_argnames=("state",))
def speculative_chunk(graphdef, params, state: SpecState, *, rounds: int,
                      config: SpecConfig) -> SpecState:
  """Up to `rounds` draft-verify rounds in one compiled while_loop; stops early when all done."""
  model = nnx.merge(graphdef, params)

  def cond(carry):
    i, s = carry
    return (i < rounds) & ~jnp.all(s.decode.done)

  def body(carry):
    i, s = carry
    return i + 1, speculative_round(model, s, config)

  return jax.lax.while_loop(cond, body, (jnp.int32(0), state))[1]


# ----------------------------------------------------------------------------------------------
# Host side

def acceptance_summary(accept_hist: np.ndarray) -> dict:
  """From per-sequence histograms [B, gamma + 1] of accepted drafts per round: mean accepted tokens
  per round (including the corrected/bonus token) and P(draft i accepted | 1..i-1 accepted)."""
  hist = np.asarray(accept_hist).sum(axis=0).astype(np.float64)      # [gamma + 1]
  rounds = hist.sum()
  gamma = hist.shape[0] - 1
  at_least = hist[::-1].cumsum()[::-1]                               # at_least[i] = #(a >= i)
  by_pos = [float(at_least[i] / at_least[i - 1]) if at_least[i - 1] else float("nan")
            for i in range(1, gamma + 1)]
  mean = float((hist * np.arange(1, gamma + 2)).sum() / rounds) if rounds else float("nan")
  return {"mean_accepted_tokens": mean, "acceptance_by_position": by_pos,
          "verify_rounds": int(rounds)}


def _validate(method, gamma, sparsity, min_tokens, score_kind, chunk_rounds):
  selection.validate(method, ratio=sparsity, min_tokens=min_tokens, score_kind=score_kind)
  if not isinstance(gamma, (int, np.integer)) or isinstance(gamma, bool) or gamma < 1:
    raise ValueError(f"gamma (draft tokens per round) must be an integer >= 1, got {gamma!r}")
  if not isinstance(chunk_rounds, int) or chunk_rounds < 1:
    raise ValueError(f"chunk_rounds must be an integer >= 1, got {chunk_rounds!r}")


def _setup(model, prompts, *, method, gamma, sparsity, min_tokens, score_kind, max_new_tokens,
           sampling, stop_ids, max_len, backend, chunk_rounds=1):
  _validate(method, gamma, sparsity, min_tokens, score_kind, chunk_rounds)
  max_len = requests.check_request(model.cfg, prompts, max_new_tokens, max_len)
  backend = backend or default_backend()
  batch = decode.make_batch(prompts, max_new_tokens, max_len, spare=gamma + 1)
  k_max = selection.static_k_max(batch.capacity, sparsity, min_tokens)
  policy = selection.make_policy(method, ratio=sparsity, min_tokens=min_tokens, k_max=k_max,
                                 score_kind=score_kind)
  config = SpecConfig(policy=policy, gamma=int(gamma), sampling=sampling,
                      stop_ids=requests.check_stop_ids(stop_ids, model.cfg), backend=backend)
  return batch, config


def _prefill_static(capacity, max_new_buffer, config, cache_dtype) -> dict:
  """The static arguments of `_prefill_with_scores`."""
  return dict(capacity=capacity, max_new_buffer=max_new_buffer,
              sampling=config.sampling, stop_ids=config.stop_ids, backend=config.backend,
              cache_dtype=cache_dtype, reserve=config.gamma + 1,
              score_kind=config.policy.prefill_score_kind)


def _prefill(model, batch, config, seed, cache_dtype):
  graphdef, params = nnx.split(model)
  state = speculative_prefill(graphdef, params, jnp.asarray(batch.prompts),
                              jnp.asarray(batch.prompt_lens), jnp.asarray(batch.max_new),
                              jax.random.PRNGKey(seed), capacity=batch.capacity,
                              max_new_buffer=batch.max_new_buffer, cache_dtype=cache_dtype,
                              config=config)
  return graphdef, params, state


def speculative_generate(model: Transformer, prompts: list[list[int]], *, method: str, gamma: int,
                         sparsity: float, min_tokens: int = 256, score_kind: str = "logits",
                         max_new_tokens: int | Sequence[int] = 128,
                         sampling: SamplingParams = SamplingParams(),
                         stop_ids: Sequence[int] | None = None, seed: int = 0,
                         max_len: int | None = None, chunk_rounds: int = 16,
                         cache_dtype=jnp.bfloat16, backend: str | None = None,
                         on_chunk: Callable[[np.ndarray, np.ndarray, np.ndarray], None] | None = None
                         ) -> tuple[list[list[int]], GenerationStats]:
  """Self-speculative decoding of a batch of token-id prompts. Returns (new tokens, stats).

  method: one of METHODS ('none' = vanilla `decode.generate`); gamma: drafts per round (static);
  sparsity: the ratio of the prefix drafts attend to, in (0, 1]; min_tokens: the budget floor;
  score_kind: 'logits' | 'weights' for the vegas family. Lossless: sampled output follows vanilla
  sampling's distribution, and greedy output equals vanilla greedy exactly in float32; in bfloat16
  the (gamma + 1)-token verification pass and the one-token step round differently, so the texts
  can part at a near-tie (README, "What lossless means here"). stop_ids: as in
  `decode.generate` (None = the model's end-of-sequence ids). `on_chunk(tokens [B, N],
  num_new [B], done [B])` runs on the host after prefill and after every `chunk_rounds` rounds.
  stats.extra: method, gamma, mean_accepted_tokens (per round, incl. the corrected/bonus token),
  acceptance_by_position (list of gamma floats), verify_rounds (sequence-rounds counted).
  """
  if method == "none":   # every other method is validated by _setup
    _validate(method, gamma, sparsity, min_tokens, score_kind, chunk_rounds)
    return decode.generate(model, prompts, max_new_tokens=max_new_tokens, sampling=sampling,
                           stop_ids=stop_ids, seed=seed, max_len=max_len, chunk=chunk_rounds,
                           cache_dtype=cache_dtype, backend=backend, on_chunk=on_chunk)
  requests.check_dtype("cache_dtype", cache_dtype)
  batch, config = _setup(model, prompts, method=method, gamma=gamma, sparsity=sparsity,
                         min_tokens=min_tokens, score_kind=score_kind,
                         max_new_tokens=max_new_tokens, sampling=sampling, stop_ids=stop_ids,
                         max_len=max_len, backend=backend, chunk_rounds=chunk_rounds)
  graphdef, params = nnx.split(model)
  stats = GenerationStats(prompt_tokens=int(batch.prompt_lens.sum()))
  # Everything is compiled ahead of time (and cached) so that prefill_s and decode_s exclude it.
  prefill_args = (params, jnp.asarray(batch.prompts), jnp.asarray(batch.prompt_lens),
                  jnp.asarray(batch.max_new), jax.random.PRNGKey(seed))
  run_prefill, stats.compile_s = decode.compile_timed(
      _prefill_with_scores, graphdef, *prefill_args,
      **_prefill_static(batch.capacity, batch.max_new_buffer, config, cache_dtype))
  t0 = time.perf_counter()
  ds, scores = jax.block_until_ready(run_prefill(*prefill_args))
  stats.prefill_s = time.perf_counter() - t0
  run_first, seconds = decode.compile_timed(first_selection, ds, scores, config=config)
  stats.compile_s += seconds
  t0 = time.perf_counter()
  state = jax.block_until_ready(run_first(ds, scores))
  stats.prefill_s += time.perf_counter() - t0     # the first round's selection belongs to prefill

  def report(s):
    if on_chunk:
      on_chunk(*jax.device_get((s.decode.tokens, s.decode.num_new, s.decode.done)))

  report(state)
  first_new = int(np.asarray(state.decode.num_new).sum())
  if not bool(np.asarray(state.decode.done).all()):
    run_chunk, seconds = decode.compile_timed(speculative_chunk, graphdef, params, state,
                                              rounds=chunk_rounds, config=config)
    stats.compile_s += seconds
  t0 = time.perf_counter()
  while not bool(np.asarray(state.decode.done).all()):
    state = run_chunk(params, state)
    report(state)
  jax.block_until_ready(state)
  stats.decode_s = time.perf_counter() - t0
  tokens, num_new, hist, rounds = jax.device_get(
      (state.decode.tokens, state.decode.num_new, state.accept_hist, state.rounds))
  stats.new_tokens = int(num_new.sum())
  stats.decode_tokens = stats.new_tokens - first_new
  stats.rounds = int(rounds)
  acc = acceptance_summary(hist)
  stats.extra = {"method": method, "gamma": int(gamma),
                 "mean_accepted_tokens": round(acc["mean_accepted_tokens"], 4),
                 "acceptance_by_position": [round(p, 4) for p in acc["acceptance_by_position"]],
                 "verify_rounds": acc["verify_rounds"]}
  return [tokens[i, :num_new[i]].tolist() for i in range(len(prompts))], stats


# ----------------------------------------------------------------------------------------------
# Phase timing

@functools.lru_cache(maxsize=8)
def _phase_fns(graphdef, config: SpecConfig):
  """The three phases, each jitted with the model structure and config closed over: passing the
  GraphDef as a static argument would hash it on every call (1.5 ms for the 0.5B model, on the
  host while the device waits), which a phase timer would count as phase time. Cached, so a
  second `time_phases` on the same model and config does not compile again."""
  draft_fn = jax.jit(lambda params, state: draft(nnx.merge(graphdef, params), state, config),
                     donate_argnums=1)
  verify_fn = jax.jit(lambda params, state, drafts, draft_probs: verify(
      nnx.merge(graphdef, params), state, drafts, draft_probs, config), donate_argnums=1)
  select_fn = jax.jit(lambda state, *rest: select_kv(state, *rest, config), donate_argnums=0)
  return draft_fn, verify_fn, select_fn


def profile_rounds(model: Transformer, prompts: list[list[int]], *, method: str, gamma: int,
                   sparsity: float, min_tokens: int = 256, score_kind: str = "logits",
                   rounds: int = 8, warmup: int = 2, max_new_tokens: int | None = None,
                   sampling: SamplingParams = SamplingParams(), stop_ids: Sequence[int] = (),
                   seed: int = 0, max_len: int | None = None, cache_dtype=jnp.bfloat16,
                   backend: str | None = None) -> dict:
  """Time shares of drafting / verification / selection over `rounds` rounds.

  Each phase is its own jitted function (`draft`, `verify`, `select_kv`, the same pure functions
  the fused loop composes), called on the host one after the other with the device synchronised
  around each, after `warmup` untimed rounds (compilation). What each phase contains:
    draft    gamma sparse draft steps incl. sampling (for quest also its per-step page scoring,
             which is fused into the draft attention);
    verify   the full-attention pass incl. score collection, the LM head, accept/reject, append;
    select   the policy's KV selection (top-k, page aggregation, quest's page summaries).
  Separate calls add dispatch and lose cross-phase fusion, so the sum exceeds a fused round: on
  an H200 by 1.3-2.5x (benchmarks/RESULTS.md, Throughput), partly host time hashing the model
  structure that the phases now close over instead; read the shares as rough, and take
  throughput from `speculative_generate` or the serving benchmark. Sequences that
  finish keep riding along, so keep max_new_tokens above (warmup + rounds) * (gamma + 1).
  Returns seconds per round for each phase, their shares, and the acceptance over the timed rounds.
  """
  if method == "none":
    raise ValueError("profile_rounds times speculative phases; method 'none' has none")
  requests.check_count("rounds", rounds)
  requests.check_count("warmup", warmup, minimum=0)
  if max_new_tokens is None:
    max_new_tokens = (warmup + rounds + 1) * (gamma + 1)
  batch, config = _setup(model, prompts, method=method, gamma=gamma, sparsity=sparsity,
                         min_tokens=min_tokens, score_kind=score_kind,
                         max_new_tokens=max_new_tokens, sampling=sampling, stop_ids=stop_ids,
                         max_len=max_len, backend=backend)
  graphdef, params, state = _prefill(model, batch, config, seed, cache_dtype)
  _, out = time_phases(graphdef, params, state, config, rounds=rounds, warmup=warmup)
  return dict(out, method=method, batch=len(prompts))


def time_phases(graphdef, params, state: SpecState, config: SpecConfig, *, rounds: int = 8,
                warmup: int = 2) -> tuple[SpecState, dict]:
  """`profile_rounds` from a given state (e.g. a benchmark's filled cache): (state, timings).

  The state is donated round by round; use the returned one.
  """
  draft_fn, verify_fn, select_fn = _phase_fns(graphdef, config)
  times = {"draft": 0.0, "verify": 0.0, "select": 0.0}
  hist0 = None
  for r in range(warmup + rounds):
    if r == warmup:
      hist0 = np.asarray(state.accept_hist)
    t0 = time.perf_counter()
    state, drafts, draft_probs = jax.block_until_ready(draft_fn(params, state))
    t1 = time.perf_counter()
    state, scores, first_row, accepted = jax.block_until_ready(
        verify_fn(params, state, drafts, draft_probs))
    t2 = time.perf_counter()
    state = jax.block_until_ready(select_fn(state, scores, first_row, accepted))
    t3 = time.perf_counter()
    if r >= warmup:
      times["draft"] += t1 - t0
      times["verify"] += t2 - t1
      times["select"] += t3 - t2
  total = sum(times.values())
  out = {f"{k}_s_per_round": v / rounds for k, v in times.items()}
  out.update({f"{k}_share": v / total for k, v in times.items()})
  out.update({"gamma": config.gamma, "rounds": rounds,
              **acceptance_summary(np.asarray(state.accept_hist) - hist0)})
  return state, out
