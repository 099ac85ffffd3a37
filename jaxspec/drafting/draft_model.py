"""Draft-model drafting: a separate, smaller model with its own KV cache drafts for the target
(classic speculative decoding; Leviathan et al. 2023, Chen et al. 2023).

The draft model attends densely over its own cache, which holds the same tokens as the target's.
Keeping the two in line without copies or host round-trips:

  * At the start of a round the target's cache holds positions [0, n) and `last_token` goes to n.
    The draft cache is trusted only on [0, n - 1): its first draft step feeds two tokens, the token
    at n - 1 (`prev_token`) and `last_token`, rewriting position n - 1 and writing n. Then it feeds
    d_1..d_{gamma-1} at n + 1..n + gamma - 1, sampling d_2..d_gamma.
  * Verification accepts a drafts; the target keeps [0, n + a + 1). The draft cache holds correct
    entries on [0, n + a) (last_token, d_1..d_{a-1} were fed), so the next round's invariant
    holds with prev_token = [last_token, d_1..d_gamma][a], the token now at n + a.
  * When every draft is accepted (a = gamma), d_gamma was never fed to the draft model: it is the
    next round's prev_token, so the draft model sees the last draft and the bonus token in that
    round's first step, at the price of one extra row in that step (T = 2 instead of 1), not one
    extra step per round as re-running the draft model on d_gamma would cost.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from jaxspec.drafting import trees
from jaxspec.drafting.chain import draft_chain
from jaxspec.drafting.tree_draft import draft_tree
from jaxspec.engine.config import RunConfig
from jaxspec.engine.state import DecodeState, SpecState
from jaxspec.model.attention import Dense, Prefill, ScoreSpec
from jaxspec.model.kv_cache import KVCache
from jaxspec.model.transformer import Transformer


@struct.dataclass
class DraftModelState:
  cache: KVCache          # the draft model's cache; trusted on [0, target lengths - 1)
  prev_token: jax.Array   # [B] int32: the token at target position lengths - 1


@dataclasses.dataclass(frozen=True)
class DraftModelDrafter:
  """Drafts with a separate model, handed to every hook beside the target (its params travel
  beside the target's, see `jaxspec.engine.runner`)."""
  name: str = "draft"
  prefill_scores: ScoreSpec | None = None
  verify_scores: ScoreSpec | None = None

  def start(self, draft: Transformer, prompts: jax.Array, prompt_lens: jax.Array,
            state: DecodeState, scores: None, config: RunConfig) -> DraftModelState:
    """Prefill the draft model on the same prompts."""
    b, t = prompts.shape
    cache = KVCache.create(draft.cfg, b, config.capacity, config.cache_dtype, draft.mesh)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    _, cache, _ = draft(prompts, positions, cache, Prefill(query_lens=prompt_lens), config.backend)
    prev = jnp.take_along_axis(prompts, (prompt_lens - 1)[:, None], axis=1)[:, 0]
    return DraftModelState(cache=cache.replace(lengths=prompt_lens), prev_token=prev)

  def draft(self, target: Transformer, draft: Transformer, state: SpecState, config: RunConfig
            ) -> tuple[SpecState, jax.Array, jax.Array | None]:
    state, drafts, probs, _ = self.run_draft(draft, state, config, Dense())
    return state, drafts, probs

  def run_draft(self, draft: Transformer, state: SpecState, config: RunConfig, plan: Dense
                ) -> tuple[SpecState, jax.Array, jax.Array | None, jax.Array | None]:
    """The round's draft steps over the draft cache with `plan` (Dense, collecting the scores it
    asks for: SpecAttn's attention rows). Returns (state, drafts, their distributions or None,
    per-step scores [gamma, L, B, ...] for a chain, else None)."""
    ds, dm = state.decode, state.drafter
    # Finished sequences ride along; the clamp keeps their writes in bounds (see self-drafting).
    start = jnp.minimum(ds.cache.lengths, ds.cache.capacity - config.reserve)
    key, sub = jax.random.split(ds.key)
    first = jnp.stack([dm.prev_token, ds.last_token], axis=1)
    cache = dm.cache.replace(lengths=start - 1)
    scores = None
    if config.tree is None:
      cache, drafts, probs, scores = draft_chain(draft, cache, first, plan, config.backend,
                                                 config.gamma, sub, config.sampling,
                                                 config.fp8_drafts)
    else:
      cache, drafts, probs = draft_tree(draft, cache, first, plan, config.backend, config.tree,
                                        sub, config.sampling, config.fp8_drafts)
    state = state.replace(decode=ds.replace(key=key), drafter=dm.replace(cache=cache))
    return state, drafts, probs, scores

  def verify_plan(self, state: SpecState) -> Dense:
    """Full attention: the target verifies exactly."""
    return Dense(scores=self.verify_scores)

  def update(self, state: SpecState, verified: jax.Array, scores: None, first_row: jax.Array,
             accepted: jax.Array, last_node: jax.Array, config: RunConfig) -> SpecState:
    prev = jnp.take_along_axis(verified, accepted[:, None], axis=1)[:, 0]
    # A finished sequence rides along without moving: its prev_token stays the token at n - 1
    # (an appended turn, `jaxspec.drafting.sts_prefill`, continues from it).
    moved = state.decode.cache.lengths != first_row
    dm = state.drafter.replace(prev_token=jnp.where(moved, prev, state.drafter.prev_token))
    tree = config.tree
    if tree is not None:   # the draft cache holds the tree breadth-first: compact that layout
      bfs, last = tree.flatten("bfs"), jnp.asarray(tree.bfs_index)[last_node]
      dm = dm.replace(cache=dm.cache.replace(
          k=trees.compact_layers(dm.cache.k, first_row, bfs, last),
          v=trees.compact_layers(dm.cache.v, first_row, bfs, last)))
    return state.replace(drafter=dm)
