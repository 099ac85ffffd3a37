"""Speculative decoding: draft, verify, update, for any drafter.

One round, for a batch of B sequences (each at its own cache length n_b, `last_token` sampled but
not yet in the cache):

  draft      the drafter proposes gamma tokens d_1..d_gamma and the distributions they were drawn
             from (q): self-drafting runs the target itself with sparse attention
             (`jaxspec.drafting.self_drafting`), a draft model its own dense steps over its own
             cache (`jaxspec.drafting.draft_model`).
  verify     ONE target forward pass over [last_token, d_1..d_gamma] at positions n..n+gamma with
             full attention (SpecAttn and STS: sparse attention chosen from the draft model's
             attention, an approximate verification; `jaxspec.drafting.specattn`, `.sts`): it
             writes their exact K/V, gives the target logits (p) and, for score-based policies,
             the criticality scores. `rejection.verify_drafts` accepts a_b
             drafts and picks the corrected or bonus token. cache.lengths += a_b + 1 (last_token
             and the accepted drafts; rejected entries are dropped by lengths, never copied), then
             `state.append_tokens` handles stops, budgets and the gamma + 1 free slots the next
             round needs. With the target's cache in host memory (`RunConfig.offload`, STS) the
             pass runs over the plan's rows copied to the device, and the kept rows' K/V are
             written back after acceptance (`jaxspec.engine.offload`).
  update     the drafter brings its state in line with what was accepted (the next round's KV
             selection; the draft model's cache).

With a draft tree (`RunConfig.tree`) the drafter proposes the tree's nodes (one batched step per
depth), verification feeds all of them under the tree's attention mask, acceptance walks the tree
(`tree_acceptance`), and the accepted path's K/V move to the slots after the root, so the cache
and the drafter see a chain's layout again (an NSA target's compression blocks ending in those
slots are then compressed from the accepted path).

Method 'ssv' (`RunConfig.ssv`, `jaxspec.ssv`): an NSA target verifies under SSV's schedule
instead of plain NSA; its strict class is exact, its reuse and approx classes change the output.

`speculative_chunk` runs up to `rounds` rounds in one `lax.while_loop`; the runner compiles it with
the state (and so both caches) donated: no host round-trip per round.

Statistics carried per sequence: a histogram of accepted counts per round, from which mean accepted
tokens per round (a + 1: the accepted drafts plus the corrected/bonus token) and the acceptance
probability by draft position (P(draft i accepted | drafts 1..i-1 accepted)) follow.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.drafting import trees
from jaxspec.drafting.tree_draft import SIBLINGS
from jaxspec.engine import offload, rejection, tree_acceptance
from jaxspec.engine.config import RunConfig
from jaxspec.engine.state import SpecState, append_tokens
from jaxspec.model.attention import Dense, ScoreSpec
from jaxspec.model.transformer import Transformer


def verify(target: Transformer, state: SpecState, drafts: jax.Array,
           draft_probs: jax.Array | None, config: RunConfig
           ) -> tuple[SpecState, jax.Array, jax.Array | None, jax.Array, jax.Array, jax.Array]:
  """Verification of [last_token, drafts] in one pass, accept/reject, append. The drafter's
  `verify_plan(state)` is the target's attention: full attention for every drafter but SpecAttn's
  and STS's, whose sparse plans make the target an approximation (`jaxspec.drafting.specattn`,
  `jaxspec.drafting.sts`); with `config.ssv` (method 'ssv') it is SSV's NSA schedule instead.

  Returns (state with lengths moved and tokens appended, the verified tokens along the accepted
  path [B, gamma + 1] (root first; the chain's tokens are that path), the scores the drafter asked
  for, first_row [B] = the cache position of verification row 0, accepted [B], last_node [B] =
  the deepest accepted node's index in the verified order (= accepted for a chain)).
  """
  if config.tree is not None:
    return verify_tree(target, state, drafts, draft_probs, config)
  ds = state.decode
  start = ds.cache.lengths
  tokens = jnp.concatenate([ds.last_token[:, None], drafts], axis=1)          # [B, gamma + 1]
  positions = start[:, None] + jnp.arange(config.gamma + 1, dtype=jnp.int32)[None]
  plan = config.drafter.verify_plan(state) if config.ssv is None else config.ssv.plan()
  if config.offload.on_host:   # the plan's rows copied from host memory (`offload`)
    hidden, new_kv = offload.verify_pass(target, tokens, positions, ds.cache, plan, config.offload,
                                         config.backend)
    cache, scores = ds.cache, None
  else:
    hidden, cache, scores = target(tokens, positions, ds.cache, plan, config.backend)
  target_logits = target.logits(hidden)                                      # [B, gamma + 1, V]
  key, sub = jax.random.split(ds.key)
  verdict = rejection.verify_drafts(sub, drafts, draft_probs, target_logits, config.sampling)
  if config.offload.on_host:   # the root and the accepted drafts of the active sequences
    cache = offload.write_back(cache, new_kv, start, jnp.where(ds.done, 0, verdict.accepted + 1))
  # The emitted tokens: the accepted drafts, then the corrected/bonus token at index `accepted`.
  j = jnp.arange(config.gamma + 1)[None]
  new = jnp.where(j == verdict.accepted[:, None], verdict.next_token[:, None],
                  jnp.pad(drafts, ((0, 0), (0, 1))))
  state = _advance(state, cache, key, start, new, verdict.accepted, config)
  return state, tokens, scores, start, verdict.accepted, verdict.accepted


def _advance(state: SpecState, cache, key: jax.Array, start: jax.Array, new: jax.Array,
             accepted: jax.Array, config: RunConfig) -> SpecState:
  """After acceptance: lengths move past the root and the accepted drafts (active sequences),
  the emitted tokens `new` [B, gamma + 1] (accepted + 1 of them) are appended, and the
  acceptance histogram and round count advance."""
  ds = state.decode
  active = ~ds.done
  emitted = accepted + 1
  cache = cache.replace(lengths=start + jnp.where(active, emitted, 0))
  ds = append_tokens(ds.replace(cache=cache, key=key), new, emitted, config.stop_ids,
                     reserve=config.reserve)
  hist = state.accept_hist + (jax.nn.one_hot(accepted, config.gamma + 1, dtype=jnp.int32)
                              * active[:, None].astype(jnp.int32))
  return state.replace(decode=ds, accept_hist=hist, rounds=state.rounds + 1)


def tree_score_spec(spec: ScoreSpec | None, tree: trees.Tree) -> ScoreSpec | None:
  """The verification scores of a tree round. Summed rows are counted along the main path (the
  first child at every depth: the drafter's likeliest continuation, the chain a width-1 tree
  would be), so Collect-2's (0, -1) collects the root (the chain's row 0, the last emitted token)
  and the main path's leaf (the chain's last draft, whose row gives the bonus token). Per-row
  scores stay per node."""
  if spec is None or spec.rows is None or spec.per_row:
    return spec
  main = [0]
  while tree.children[main[-1]]:
    main.append(tree.children[main[-1]][0])
  return ScoreSpec(spec.kind, rows=tuple(sorted({main[r] for r in spec.rows})), per_row=False)


def verify_tree(target: Transformer, state: SpecState, drafts: jax.Array,
                draft_probs: jax.Array | None, config: RunConfig):
  """`verify` for a draft tree: the root and drafts [B, T - 1] (in the tree's order) at positions
  lengths + depth under the tree mask, `tree_acceptance.verify_tree`, then the accepted path's
  K/V compacted to the slots after the root (`trees.compact_layers`; for an NSA target the
  compression blocks ending there are then written, `Transformer.recompress`), verified under
  `config.ssv`'s schedule when it is set (method 'ssv'). Per-row scores come back
  as the last accepted node's row [L, B, S], compacted the same way."""
  tree = config.tree
  ds = state.decode
  start = ds.cache.lengths
  tokens = jnp.concatenate([ds.last_token[:, None], drafts], axis=1)          # [B, T]
  positions = start[:, None] + jnp.asarray(tree.depths)[None]
  bits = jnp.asarray(tree.ancestor_bits)
  if config.ssv is not None:
    plan = config.ssv.plan(tree_bits=bits)
  else:
    plan = Dense(scores=tree_score_spec(config.drafter.verify_scores, tree), tree_bits=bits)
  hidden, cache, scores = target(tokens, positions, ds.cache, plan, config.backend)
  target_logits = target.logits(hidden)                                      # [B, T, V]
  key, sub = jax.random.split(ds.key)
  verdict = tree_acceptance.verify_tree(sub, tree, tokens, draft_probs, target_logits,
                                        config.sampling, SIBLINGS)
  last = verdict.last_node
  cache = cache.replace(k=trees.compact_layers(cache.k, start, tree, last),
                        v=trees.compact_layers(cache.v, start, tree, last))
  if target.cfg.nsa is not None:
    # A tree pass writes no compression blocks (which tokens a block holds depends on the path):
    # those ending in the compacted slots are compressed from the accepted path now.
    cache = target.recompress(cache, start, tree.depth + 1)
  new = tree_acceptance.emitted_tokens(tree, tokens, verdict, pad=0)        # [B, depth + 1]
  state = _advance(state, cache, key, start, new, verdict.accepted, config)
  path = jnp.maximum(trees.accepted_path(tree, last), 0)                    # [B, depth + 1]
  verified = jnp.take_along_axis(tokens, path, axis=1)
  if scores is not None and scores.ndim == 4:                                # per row [L,B,T,S]
    row = jnp.take_along_axis(scores, last[None, :, None, None], axis=2)[:, :, 0]
    row = trees.compact_layer(jnp.moveaxis(row, 0, -1), start, tree, last)   # [B, S, L]
    scores = jnp.moveaxis(row, -1, 0)
  return state, verified, scores, start, verdict.accepted, last


def speculative_round(target: Transformer, draft: Transformer | None, state: SpecState,
                      config: RunConfig) -> SpecState:
  drafter = config.drafter
  state, drafts, draft_probs = drafter.draft(target, draft, state, config)
  state, verified, scores, first_row, accepted, last_node = verify(target, state, drafts,
                                                                   draft_probs, config)
  return drafter.update(state, verified, scores, first_row, accepted, last_node, config)


def speculative_chunk(target: Transformer, draft: Transformer | None, state: SpecState,
                      rounds: int, config: RunConfig) -> SpecState:
  """Up to `rounds` draft-verify rounds in one while_loop; stops early when all are done."""
  def cond(carry):
    i, s = carry
    return (i < rounds) & ~jnp.all(s.decode.done)

  def body(carry):
    i, s = carry
    return i + 1, speculative_round(target, draft, s, config)

  return jax.lax.while_loop(cond, body, (jnp.int32(0), state))[1]


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
