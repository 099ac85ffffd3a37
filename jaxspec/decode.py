"""Plain (vanilla) batched decoding: the baseline every speedup is measured against.

prefill -> `lax.while_loop` of one-token steps, with the KV cache donated and no host round-trip per
token. A host wrapper (`generate`) runs the loop in chunks of steps so text can be streamed between
chunks; each chunk is one compiled call.

Shapes are static (batch, prompt bucket, cache capacity, output buffer); counts are traced
(`cache.lengths`, `num_new`, per-sequence `max_new`), so a new prompt length only recompiles when it
crosses a bucket.
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

from jaxspec import requests
from jaxspec.attention import AttentionPlan, default_backend
from jaxspec.kv_cache import KVCache
from jaxspec.model import Transformer
from jaxspec.sampling import SamplingParams, sample


@struct.dataclass
class DecodeState:
  """Everything the decode loop carries. `last_token` is sampled but not yet in the cache."""
  cache: KVCache
  last_token: jax.Array   # [B] int32
  tokens: jax.Array       # [B, N] int32 generated tokens (the output buffer; -1 = none)
  num_new: jax.Array      # [B] int32 tokens generated so far
  max_new: jax.Array      # [B] int32 per-sequence budget
  done: jax.Array         # [B] bool
  key: jax.Array


def bucket(n: int, minimum: int = 16) -> int:
  """Next power of two >= n (prompt lengths are padded to these to bound recompiles)."""
  return max(minimum, 1 << (max(n, 1) - 1).bit_length())


def is_stop(tokens: jax.Array, stop_ids: tuple[int, ...]) -> jax.Array:
  if not stop_ids:
    return jnp.zeros(tokens.shape, bool)
  return jnp.isin(tokens, jnp.asarray(stop_ids, jnp.int32))


def append_tokens(state: DecodeState, new: jax.Array, count: jax.Array, stop_ids: tuple[int, ...],
                  reserve: int = 1) -> DecodeState:
  """Append the first count[b] of new [B, M] tokens per sequence, honouring stops and budgets.

  A sequence stops at its first stop token (kept in the output), at max_new, or when fewer than
  `reserve` free cache slots remain. Done sequences append nothing. Call it after updating
  `cache.lengths`; it updates `num_new`, `tokens`, `done` and `last_token`.
  """
  b, m = new.shape
  j = jnp.arange(m)[None]
  count = jnp.where(state.done, 0, count)
  # Cut at the first stop token (inclusive) and at the budget.
  stop_at = jnp.min(jnp.where(is_stop(new, stop_ids) & (j < count[:, None]), j, m), axis=1)
  count = jnp.minimum(jnp.minimum(count, stop_at + 1), state.max_new - state.num_new)
  pos = state.num_new[:, None] + j
  rows = jnp.arange(b)[:, None]
  tokens = state.tokens.at[rows, jnp.where(j < count[:, None], pos, state.tokens.shape[1])].set(
      new, mode="drop")
  num_new = state.num_new + count
  last = jnp.take_along_axis(new, jnp.maximum(count - 1, 0)[:, None], axis=1)[:, 0]
  # The cache must hold `reserve` more entries for the next step (1, or gamma + 1 to verify).
  full = state.cache.lengths + reserve > state.cache.capacity
  done = state.done | (num_new >= state.max_new) | (stop_at < count) | full
  return state.replace(tokens=tokens, num_new=num_new, done=done,
                       last_token=jnp.where(count > 0, last, state.last_token))


def prefill(model: Transformer, prompts: jax.Array, prompt_lens: jax.Array, cache: KVCache,
            plan: AttentionPlan) -> tuple[jax.Array, KVCache, jax.Array | None]:
  """Run right-padded prompts [B, T] through an empty cache.

  Returns (logits of each prompt's last token [B, V], cache with lengths = prompt_lens, scores).
  """
  hidden, cache, scores = model(prompts, cache, plan.replace(query_lens=prompt_lens))
  last = jnp.take_along_axis(hidden, (prompt_lens - 1)[:, None, None], axis=1)[:, 0]
  return model.logits(last), cache.replace(lengths=prompt_lens), scores


def start_state(model: Transformer, prompts: jax.Array, prompt_lens: jax.Array, max_new: jax.Array,
                capacity: int, max_new_buffer: int, key: jax.Array, sampling: SamplingParams,
                stop_ids: tuple[int, ...], backend: str, cache_dtype, reserve: int = 1,
                score_kind: str | None = None) -> tuple[DecodeState, jax.Array | None]:
  """Prefill and sample the first new token. With `score_kind` set (a speculative caller, see
  `jaxspec.speculative`) also returns the prefill's criticality scores [L, B, S]: each prompt's
  last token's row; else None."""
  b = prompts.shape[0]
  cache = KVCache.create(model.cfg, b, capacity, cache_dtype)
  plan = AttentionPlan(mode="prefill", backend=backend, score_kind=score_kind)
  logits, cache, scores = prefill(model, prompts, prompt_lens, cache, plan)
  key, sub = jax.random.split(key)
  first = sample(sub, logits, sampling)
  state = DecodeState(cache=cache, last_token=first,
                      tokens=jnp.full((b, max_new_buffer), -1, jnp.int32),
                      num_new=jnp.zeros((b,), jnp.int32), max_new=max_new,
                      done=max_new <= 0, key=key)
  return append_tokens(state, first[:, None], jnp.ones((b,), jnp.int32), stop_ids, reserve), scores


def decode_step(model: Transformer, state: DecodeState, sampling: SamplingParams,
                stop_ids: tuple[int, ...], backend: str) -> DecodeState:
  """Feed last_token, sample the next one. Finished sequences ride along and change nothing."""
  hidden, cache, _ = model(state.last_token[:, None], state.cache,
                           AttentionPlan(mode="dense", backend=backend))
  key, sub = jax.random.split(state.key)
  nxt = sample(sub, model.logits(hidden[:, 0]), sampling)
  active = ~state.done
  cache = cache.replace(lengths=cache.lengths + active.astype(jnp.int32))
  state = state.replace(cache=cache, key=key)
  return append_tokens(state, nxt[:, None], active.astype(jnp.int32), stop_ids)


@functools.partial(jax.jit, static_argnames=("graphdef", "steps", "sampling", "stop_ids", "backend"),
                   donate_argnames=("state",))
def decode_chunk(graphdef, params, state: DecodeState, *, steps: int, sampling: SamplingParams,
                 stop_ids: tuple[int, ...], backend: str) -> DecodeState:
  """Up to `steps` decode steps in one compiled while_loop; stops early when every sequence is done."""
  model = nnx.merge(graphdef, params)

  def cond(carry):
    i, s = carry
    return (i < steps) & ~jnp.all(s.done)

  def body(carry):
    i, s = carry
    return i + 1, decode_step(model, s, sampling, stop_ids, backend)

  return jax.lax.while_loop(cond, body, (jnp.int32(0), state))[1]


@functools.partial(jax.jit, static_argnames=("graphdef", "capacity", "max_new_buffer", "sampling",
                                             "stop_ids", "backend", "cache_dtype", "reserve"))
def prefill_state(graphdef, params, prompts, prompt_lens, max_new, key, *, capacity: int,
                  max_new_buffer: int, sampling: SamplingParams, stop_ids: tuple[int, ...],
                  backend: str, cache_dtype, reserve: int = 1) -> DecodeState:
  model = nnx.merge(graphdef, params)
  state, _ = start_state(model, prompts, prompt_lens, max_new, capacity, max_new_buffer, key,
                         sampling, stop_ids, backend, cache_dtype, reserve)
  return state


_COMPILED: dict = {}


def compile_timed(jitted, *args, **static):
  """Compile `jitted` for these arguments ahead of time: (callable on the non-static args, seconds).

  Keeps compilation out of the prefill and decode timings. Executables are cached by function,
  static arguments and argument shapes, so repeated calls with the same shapes compile once.
  """
  leaves, treedef = jax.tree_util.tree_flatten(args)
  key = (jitted, treedef, tuple(sorted(static.items(), key=lambda kv: kv[0])),
         tuple((getattr(x, "shape", None), str(getattr(x, "dtype", type(x)))) for x in leaves))
  if key in _COMPILED:
    return _COMPILED[key], 0.0
  t0 = time.perf_counter()
  compiled = _COMPILED[key] = jitted.lower(*args, **static).compile()
  return compiled, time.perf_counter() - t0


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
    s = (f"prompt tokens {self.prompt_tokens} | new tokens {self.new_tokens} | "
         f"prefill {self.prefill_s:.3f} s | decode {self.decode_tokens_per_s:.1f} tok/s | "
         f"compile {self.compile_s:.1f} s")
    return s + "".join(f" | {k} {v}" for k, v in self.extra.items())


@dataclasses.dataclass(frozen=True)
class Batch:
  """Right-padded prompts ready for the device, with the sizes that fix compiled shapes."""
  prompts: np.ndarray       # [B, T_bucket] int32
  prompt_lens: np.ndarray   # [B] int32
  max_new: np.ndarray       # [B] int32
  capacity: int             # cache slots per sequence
  max_new_buffer: int       # output buffer width


def make_batch(prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int],
               max_len: int | None = None, spare: int = 1) -> Batch:
  """Pad token lists into a Batch. `max_len` (prompt + generated, per sequence) sizes the cache;
  `spare` extra slots are reserved for speculative verification. Raises ValueError on bad input."""
  requests.check_prompts(prompts)
  requests.check_max_new_tokens(max_new_tokens, len(prompts))
  n = len(prompts)
  max_new = np.broadcast_to(np.asarray(max_new_tokens, np.int32), (n,)).copy()
  lens = np.asarray([len(p) for p in prompts], np.int32)
  longest = int(lens.max())
  if max_len is None:
    max_len = longest + int(max_new.max())
  if longest >= max_len:
    raise ValueError(f"prompt of {longest} tokens does not fit max_len={max_len} "
                     "(prompt + at least one new token); raise --max_len or shorten the prompt")
  max_new = np.minimum(max_new, max_len - lens)   # max_len bounds prompt + new tokens
  t = min(bucket(longest), bucket(max_len))
  padded = np.zeros((n, t), np.int32)
  for i, p in enumerate(prompts):
    padded[i, :len(p)] = p
  capacity = -(-(max_len + spare) // 128) * 128
  return Batch(padded, lens, max_new, capacity, bucket(int(max_new.max()), 1))


def generate(model: Transformer, prompts: Sequence[Sequence[int]], *,
             max_new_tokens: int | Sequence[int] = 128, sampling: SamplingParams = SamplingParams(),
             stop_ids: Sequence[int] | None = None, seed: int = 0, max_len: int | None = None,
             chunk: int = 64, cache_dtype=jnp.bfloat16, backend: str | None = None,
             on_chunk: Callable[[np.ndarray, np.ndarray, np.ndarray], None] | None = None
             ) -> tuple[list[list[int]], GenerationStats]:
  """Vanilla decoding of a batch of token-id prompts. Returns (new tokens per prompt, stats).

  A sequence stops at its first stop id (kept in the output); `stop_ids=None` means the model's
  end-of-sequence ids (`cfg.eos_token_ids`), `()` none. `on_chunk(tokens [B, N], num_new [B],
  done [B])` is called on the host after prefill and after every chunk of `chunk` steps (for
  streaming). Bad arguments raise ValueError (`jaxspec.requests`).
  """
  backend = backend or default_backend()
  max_len = requests.check_request(model.cfg, prompts, max_new_tokens, max_len)
  requests.check_count("chunk", chunk)
  requests.check_dtype("cache_dtype", cache_dtype)
  batch = make_batch(prompts, max_new_tokens, max_len)
  graphdef, params = nnx.split(model)
  stop_ids = requests.check_stop_ids(stop_ids, model.cfg)
  stats = GenerationStats(prompt_tokens=int(batch.prompt_lens.sum()))
  prefill_args = (params, jnp.asarray(batch.prompts), jnp.asarray(batch.prompt_lens),
                  jnp.asarray(batch.max_new), jax.random.PRNGKey(seed))
  run_prefill, stats.compile_s = compile_timed(
      prefill_state, graphdef, *prefill_args, capacity=batch.capacity,
      max_new_buffer=batch.max_new_buffer, sampling=sampling, stop_ids=stop_ids, backend=backend,
      cache_dtype=cache_dtype)
  t0 = time.perf_counter()
  state = jax.block_until_ready(run_prefill(*prefill_args))
  stats.prefill_s = time.perf_counter() - t0
  if on_chunk:
    on_chunk(*jax.device_get((state.tokens, state.num_new, state.done)))
  run_chunk, seconds = compile_timed(decode_chunk, graphdef, params, state, steps=chunk,
                                     sampling=sampling, stop_ids=stop_ids, backend=backend)
  stats.compile_s += seconds
  first_new = int(np.asarray(state.num_new).sum())
  t0 = time.perf_counter()
  while not bool(np.asarray(state.done).all()):
    state = run_chunk(params, state)
    stats.rounds += chunk
    if on_chunk:
      on_chunk(*jax.device_get((state.tokens, state.num_new, state.done)))
  jax.block_until_ready(state)
  stats.decode_s = time.perf_counter() - t0
  tokens, num_new = np.asarray(state.tokens), np.asarray(state.num_new)
  stats.new_tokens = int(num_new.sum())
  stats.decode_tokens = stats.new_tokens - first_new
  return [tokens[i, :num_new[i]].tolist() for i in range(len(prompts))], stats
