"""Plain (vanilla) decoding: the baseline every speedup is measured against.

One-token steps in a `lax.while_loop`, with the state (and so the KV cache) donated and no host
round-trip per token; `decode_chunk` runs up to `steps` of them as one compiled call.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.engine.config import RunConfig
from jaxspec.engine.sampling import sample
from jaxspec.engine.state import DecodeState, append_tokens
from jaxspec.model.attention import Dense
from jaxspec.model.transformer import Transformer


def decode_step(model: Transformer, state: DecodeState, config: RunConfig) -> DecodeState:
  """Feed last_token, sample the next one. Finished sequences ride along and change nothing."""
  cache = state.cache
  hidden, cache, _ = model(state.last_token[:, None], cache.lengths[:, None], cache, Dense(),
                           config.backend)
  key, sub = jax.random.split(state.key)
  nxt = sample(sub, model.logits(hidden[:, 0]), config.sampling)
  active = ~state.done
  cache = cache.replace(lengths=cache.lengths + active.astype(jnp.int32))
  state = state.replace(cache=cache, key=key)
  return append_tokens(state, nxt[:, None], active.astype(jnp.int32), config.stop_ids)


def decode_chunk(model: Transformer, state: DecodeState, steps: int,
                 config: RunConfig) -> DecodeState:
  """Up to `steps` decode steps in one while_loop; stops early when every sequence is done."""
  def cond(carry):
    i, s = carry
    return (i < steps) & ~jnp.all(s.done)

  def body(carry):
    i, s = carry
    return i + 1, decode_step(model, s, config)

  return jax.lax.while_loop(cond, body, (jnp.int32(0), state))[1]
