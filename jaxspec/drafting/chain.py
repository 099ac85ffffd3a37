"""A chain of gamma autoregressive draft steps of one model over its own cache."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.engine.sampling import SamplingParams, sample, sample_draft
from jaxspec.model.attention import Plan, per_layer
from jaxspec.model.kv_cache import KVCache
from jaxspec.model.transformer import Transformer


def draft_chain(model: Transformer, cache: KVCache, first: jax.Array, plan: Plan, backend: str,
                gamma: int, key: jax.Array, sampling: SamplingParams, fp8_mlp: bool = False
                ) -> tuple[KVCache, jax.Array, jax.Array | None, jax.Array | None]:
  """Feed `first` [B, T0] at cache slots (and positions) cache.lengths.., sample d_1 from its last
  row, then feed d_1..d_{gamma-1} one at a time (a `lax.scan`), sampling d_2..d_gamma.

  Returns (the cache with the fed tokens' K/V written, lengths unchanged; drafts [B, gamma]; the
  distributions they were drawn from: a `TopK` [B, gamma, top_k] when
  `top_k_drafts(sampling, V)`, else [B, gamma, V], or None when greedy, whose verification needs
  only the tokens; the scores `plan` asks for, one entry per step [gamma, L, B, ...] (step i's
  rows are those that sampled d_{i+1}), or None). Step i uses the i-th of gamma keys split from
  `key`. `fp8_mlp`: the steps' MLPs multiply by their FP8 copies (`jaxspec.model.fp8`).
  """
  start = cache.lengths
  step_keys = jax.random.split(key, gamma)
  plan = per_layer(plan, model.cfg.num_layers)

  def step(cache, tokens, offset, step_key):
    positions = start[:, None] + offset + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
    hidden, cache, scores = model(tokens, positions, cache.replace(lengths=start + offset), plan,
                                  backend, fp8_mlp)
    # In the model's dtype: the sampler converts only the values it reads, and a float32 copy of
    # the rows would be a pass of its own (28 us a draft step at B = 128 and a 152K vocabulary).
    logits = model.logits(hidden[:, -1], dtype=None)
    if sampling.greedy:
      return cache, sample(step_key, logits, sampling), None, scores
    # The logits are written once: where XLA picks a fusible GEMM for the LM head it otherwise
    # fused it into several of the sampler's passes over them, reading the head's weights three
    # times a step (1.6 ms of a vegas round at the 1.5B's shapes, B = 64 x 24K, H100).
    logits = jax.lax.optimization_barrier(logits)
    return (cache, *sample_draft(step_key, logits, sampling), scores)

  t0 = first.shape[1]
  cache, d1, p1, s1 = step(cache, first, 0, step_keys[0])
  # The distributions go into [B, gamma, ...] buffers that each step writes in place (a dense
  # one is 78 MB a step at B = 128 and a 152K vocabulary), in the layout verification reads.
  def put(buffer, p, i):
    return jax.lax.dynamic_update_index_in_dim(buffer, p, i, axis=1)
  probs = None if p1 is None else jax.tree.map(
      lambda p: put(jnp.zeros((p.shape[0], gamma) + p.shape[1:], p.dtype), p, 0), p1)

  def body(carry, xs):
    cache, token, probs = carry
    i, step_key = xs
    cache, nxt, p, scores = step(cache, token[:, None], t0 - 1 + i, step_key)
    if probs is not None:
      probs = jax.tree.map(lambda buffer, p: put(buffer, p, i), probs, p)
    return (cache, nxt, probs), (nxt, scores)

  (cache, _, probs), (rest, rest_scores) = jax.lax.scan(
      body, (cache, d1, probs), (jnp.arange(1, gamma, dtype=jnp.int32), step_keys[1:]))
  drafts = jnp.concatenate([d1[:, None], rest.T], axis=1)
  scores = None if s1 is None else jnp.concatenate([s1[None], rest_scores], axis=0)
  return cache.replace(lengths=start), drafts, probs, scores
