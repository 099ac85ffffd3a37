"""The state every decode loop carries, and the host-side batch that fixes its static sizes.

Shapes are static (batch, prompt bucket, cache capacity, output buffer); counts are traced
(`cache.lengths`, `num_new`, per-sequence `max_new`), so a new prompt length only recompiles when it
crosses a bucket (`prompt_bucket`: eight padded lengths per power of two).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxspec import requests
from jaxspec.model.kv_cache import KVCache


@struct.dataclass
class DecodeState:
  """What vanilla decoding carries. `last_token` is sampled but not yet in the cache."""
  cache: KVCache
  last_token: jax.Array   # [B] int32
  tokens: jax.Array       # [B, N] int32 generated tokens (the output buffer; -1 = none)
  num_new: jax.Array      # [B] int32 tokens generated so far
  max_new: jax.Array      # [B] int32 per-sequence budget
  done: jax.Array         # [B] bool
  key: jax.Array


@struct.dataclass
class SpecState:
  """What speculative decoding carries: the decode state plus the drafter's own state."""
  decode: DecodeState     # the target's cache, last_token, output buffer, budgets, done, PRNG key
  drafter: Any            # self-drafting: the next round's draft attention plan; a draft model:
                          # its cache and the token before last_token
  accept_hist: jax.Array  # [B, gamma + 1] int32: rounds in which a drafts were accepted
  rounds: jax.Array       # [] int32: rounds run


def decode_state(state: DecodeState | SpecState) -> DecodeState:
  return state.decode if isinstance(state, SpecState) else state


def bucket(n: int, minimum: int = 16) -> int:
  """Next power of two >= n (sizes padded to these to bound recompiles)."""
  return max(minimum, 1 << (max(n, 1) - 1).bit_length())


# Prompts are padded to one of this many lengths per power of two: a prefill computes the padded
# rows too (a 16K-token prompt of the 1.5B prefilled 1.9x slower padded to 32K than to 18K on an
# H200). Eight lengths an octave waste at most 1/8 of the rows, for at most eight prefill compiles
# where a power of two had one.
PROMPT_BUCKETS = 8
_MIN_PROMPT_STEP = 128   # below 1K tokens the waste is cheap and compiles are not


def check_prompt_buckets(per_octave: int) -> int:
  """per_octave, if it is a power of two >= 1 (padded prompt lengths per power of two); else a
  one-line ValueError."""
  if per_octave < 1 or per_octave & (per_octave - 1):
    raise ValueError(f"prompt_buckets must be a power of two >= 1 (lengths per octave), got "
                     f"{per_octave}")
  return per_octave


def prompt_bucket(n: int, per_octave: int = PROMPT_BUCKETS) -> int:
  """The padded length of an n-token prompt: the smallest multiple of max(128, 2^(k-1) /
  per_octave) that holds it, where 2^k is the next power of two >= n (so per_octave lengths from
  2^(k-1) to 2^k), and never more than 2^k (per_octave 1: 2^k itself). At least 16."""
  check_prompt_buckets(per_octave)
  top = bucket(n)
  step = max(top // (2 * per_octave), _MIN_PROMPT_STEP)
  return min(top, -(-n // step) * step)


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


@dataclasses.dataclass(frozen=True)
class Batch:
  """Right-padded prompts ready for the device, with the sizes that fix compiled shapes."""
  prompts: np.ndarray       # [B, T_bucket] int32
  prompt_lens: np.ndarray   # [B] int32
  max_new: np.ndarray       # [B] int32
  capacity: int             # cache slots per sequence
  max_new_buffer: int       # output buffer width


def capacity_for(max_len: int, spare: int) -> int:
  """Cache slots for sequences of up to max_len tokens plus `spare` for verification, rounded up
  to a multiple of 128 (the kernels' tiles and the 16-token pages divide it)."""
  return -(-(max_len + spare) // 128) * 128


def make_batch(prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int],
               max_len: int | None = None, spare: int = 1,
               max_new_buffer: int | None = None,
               prompt_buckets: int = PROMPT_BUCKETS) -> Batch:
  """Pad token lists into a Batch. `max_len` (prompt + generated, per sequence) sizes the cache;
  `spare` extra slots are reserved for speculative verification; `max_new_buffer` fixes the
  output buffer's width (default: the largest budget, bucketed); prompts are padded to
  `prompt_bucket(longest, prompt_buckets)`. Raises ValueError on bad input."""
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
  t = min(prompt_bucket(longest, prompt_buckets), prompt_bucket(max_len, prompt_buckets))
  padded = np.zeros((n, t), np.int32)
  for i, p in enumerate(prompts):
    padded[i, :len(p)] = p
  buffer = bucket(int(max_new.max()), 1) if max_new_buffer is None else max_new_buffer
  return Batch(padded, lens, max_new, capacity_for(max_len, spare), buffer)
