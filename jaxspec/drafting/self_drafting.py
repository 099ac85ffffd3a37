"""Self-drafting: the target drafts for itself with sparse attention chosen by a `SelectionPolicy`.

The drafter's state is the attention plan of the next round's draft steps (a `Sparse` selection,
Quest's `QuestPages`, or `Dense`), made by the policy from the last verification's scores.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec.drafting.chain import draft_chain
from jaxspec.drafting.policies import SelectionPolicy
from jaxspec.drafting.tree_draft import draft_tree
from jaxspec.engine.config import RunConfig
from jaxspec.engine.state import DecodeState, SpecState
from jaxspec.model.attention import Dense, Plan, ScoreSpec
from jaxspec.model.transformer import Transformer


@dataclasses.dataclass(frozen=True)
class SelfDrafter:
  policy: SelectionPolicy

  @property
  def name(self) -> str:
    return self.policy.name

  @property
  def prefill_scores(self) -> ScoreSpec | None:
    return self.policy.prefill_scores

  @property
  def verify_scores(self) -> ScoreSpec | None:
    return self.policy.verify_scores

  def start(self, draft: None, prompts: jax.Array, prompt_lens: jax.Array, state: DecodeState,
            scores: jax.Array | None, config: RunConfig) -> Plan:
    # The prefill's score row is each prompt's last token, at position prompt_len - 1: for the
    # policies it plays the part of the last accepted token's row (accepted = 0).
    lengths = state.cache.lengths
    return self.policy.select_kv(state.cache, scores, lengths - 1, jnp.zeros_like(lengths))

  def draft(self, target: Transformer, draft: None, state: SpecState, config: RunConfig
            ) -> tuple[SpecState, jax.Array, jax.Array | None]:
    """gamma draft steps of the target over the selection (or the levels of `config.tree`).
    Returns (state with the draft K/V written and the key advanced, drafts [B, gamma] (or
    [B, T - 1] in the tree's order), their distributions or None)."""
    ds = state.decode
    # Active sequences always have gamma + 1 free slots (append_tokens' reserve); the clamp only
    # moves finished ones, whose cache no longer matters, so that every write and kernel stays in
    # bounds while they ride along.
    start = jnp.minimum(ds.cache.lengths, ds.cache.capacity - config.reserve)
    key, sub = jax.random.split(ds.key)
    cache = ds.cache.replace(lengths=start)
    if config.tree is None:
      cache, drafts, probs, _ = draft_chain(target, cache, ds.last_token[:, None], state.drafter,
                                            config.backend, config.gamma, sub, config.sampling,
                                            config.fp8_drafts)
    else:
      cache, drafts, probs = draft_tree(target, cache, ds.last_token[:, None], state.drafter,
                                        config.backend, config.tree, sub, config.sampling,
                                        config.fp8_drafts)
    return state.replace(decode=ds.replace(cache=cache, key=key)), drafts, probs

  def verify_plan(self, state: SpecState) -> Dense:
    """The target verifies with full attention, collecting the scores the policy selects from."""
    return Dense(scores=self.verify_scores)

  def update(self, state: SpecState, verified: jax.Array, scores: jax.Array | None,
             first_row: jax.Array, accepted: jax.Array, last_node: jax.Array,
             config: RunConfig) -> SpecState:
    """The policy's selection for the next round (the verification already compacted a tree's
    accepted path, so the policies see a chain's layout)."""
    return state.replace(drafter=self.policy.select_kv(state.decode.cache, scores, first_row,
                                                       accepted))
