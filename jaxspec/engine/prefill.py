"""One prefill for every method: the prompts through an empty cache, the first token sampled, and
for a speculative run the drafter's starting state."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.engine import offload
from jaxspec.engine.config import RunConfig
from jaxspec.engine.sampling import sample
from jaxspec.engine.state import DecodeState, SpecState, append_tokens
from jaxspec.model.attention import Prefill
from jaxspec.model.kv_cache import KVCache
from jaxspec.model.transformer import Transformer


def prefill(target: Transformer, draft: Transformer | None, prompts: jax.Array,
            prompt_lens: jax.Array, max_new: jax.Array, key: jax.Array, config: RunConfig,
            max_new_buffer: int) -> DecodeState | SpecState:
  """Right-padded prompts [B, T] (prompt_lens real tokens each) -> the state the loops start from.

  The first new token is sampled from each prompt's last position. A speculative run asks the
  prefill for the scores its drafter wants (`drafter.prefill_scores`: the last prompt token's row,
  for the score-based self-drafting policies) and hands them to `drafter.start`.
  """
  b, t = prompts.shape
  cache = KVCache.create(target.cfg, b, config.capacity, config.cache_dtype, target.mesh)
  drafter = config.drafter
  plan = Prefill(query_lens=prompt_lens, scores=drafter.prefill_scores if drafter else None)
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  hidden, cache, scores = target(prompts, positions, cache, plan, config.backend)
  last = jnp.take_along_axis(hidden, (prompt_lens - 1)[:, None, None], axis=1)[:, 0]
  key, sub = jax.random.split(key)
  first = sample(sub, target.logits(last), config.sampling)
  cache = cache.replace(lengths=prompt_lens)
  if config.offload.on_host:   # built on the device, then moved (`jaxspec.engine.offload`)
    cache = offload.to_host(cache)
  state = DecodeState(cache=cache, last_token=first,
                      tokens=jnp.full((b, max_new_buffer), -1, jnp.int32),
                      num_new=jnp.zeros((b,), jnp.int32), max_new=max_new,
                      done=max_new <= 0, key=key)
  state = append_tokens(state, first[:, None], jnp.ones((b,), jnp.int32), config.stop_ids,
                        config.reserve)
  if drafter is None:
    return state
  return SpecState(decode=state, drafter=drafter.start(draft, prompts, prompt_lens, state, scores,
                                                       config),
                   accept_hist=jnp.zeros((b, config.gamma + 1), jnp.int32),
                   rounds=jnp.zeros((), jnp.int32))
