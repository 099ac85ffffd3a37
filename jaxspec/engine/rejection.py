"""Lossless speculative sampling (Leviathan et al., 2023) as pure, vectorized functions.

Given gamma draft tokens x_1..x_gamma drawn from the draft distributions q_1..q_gamma and the target
distributions p_1..p_{gamma+1} computed in one verification pass:
  * draft i is accepted with probability min(1, p_i(x_i) / q_i(x_i)), in order, up to the first
    rejection;
  * at the first rejected position i the corrected token is drawn from norm(max(0, p_i - q_i));
  * if all gamma drafts are accepted, the bonus token is drawn from p_{gamma+1}.
The emitted tokens are then distributed exactly as gamma + 1 tokens sampled from p one at a time.

p is `sampling.probabilities` of the target's logits (temperature, top-k, top-p, min-p): the output
follows the *transformed* target distribution, as plain sampling does. q is whatever each draft was
drawn from (the same transforms, over the whole row or over the top-k logits only: `sampling`);
any q keeps the rule exact, a q nearer p accepts more. With greedy settings p and q are one-hot
argmaxes and the rule reduces to argmax agreement; `verify_greedy` takes that path directly (no
random numbers, no [B, gamma, V] tensors). Sampled verification (`verify_sampled_logits`) does not
build p at every position either: it needs p only at the drafted tokens and in the one row each
sequence draws its next token from.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxspec.engine.sampling import (SamplingParams, TopK, draw, kept_mass, probabilities,
                                     scaled)


@struct.dataclass
class Verdict:
  accepted: jax.Array     # [B] int32 in [0, gamma]: leading drafts accepted
  next_token: jax.Array   # [B] int32: the corrected token (accepted < gamma) or the bonus token


def leading_true(ok: jax.Array) -> jax.Array:
  """ok [B, gamma] bool -> [B] int32: length of the all-True prefix of each row."""
  return jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)


def residual_distribution(p: jax.Array, q: jax.Array) -> jax.Array:
  """norm(max(0, p - q)) over the last axis. Where p <= q everywhere (a rejection there has
  probability 0, but floating point may still land on it) fall back to p."""
  r = jnp.maximum(p - q, 0.0)
  total = jnp.sum(r, axis=-1, keepdims=True)
  return jnp.where(total > 0, r / jnp.where(total > 0, total, 1.0), p)


def verify_greedy(draft_tokens: jax.Array, target_logits: jax.Array) -> Verdict:
  """Greedy verification: accept drafts while they equal the target argmax; the next token is the
  target argmax at the first mismatch (the correction) or after the last draft (the bonus).

  draft_tokens [B, gamma], target_logits [B, gamma + 1, V].
  """
  target = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)            # [B, gamma + 1]
  accepted = leading_true(draft_tokens == target[:, :-1])
  next_token = jnp.take_along_axis(target, accepted[:, None], axis=1)[:, 0]
  return Verdict(accepted=accepted, next_token=next_token)


def _verdict(key: jax.Array, px: jax.Array, draft_probs: jax.Array | TopK,
             draft_tokens: jax.Array, p_row) -> Verdict:
  """The accept/resample rule from px [B, gamma] (p at the drafted tokens), the drafts'
  distributions (dense or TopK) and p_row(at [B] int32 in [0, gamma]) -> p at position `at` of
  each sequence [B, V]."""
  gamma = px.shape[1]
  qx = _q_of(draft_probs, draft_tokens)
  k_accept, k_resample = jax.random.split(key)
  u = jax.random.uniform(k_accept, px.shape, jnp.float32)
  # u < p/q written without the division: q(x) > 0 for a token drawn from q.
  accepted = leading_true(u * qx < px)
  # The distribution of the next token: the residual at the first rejection, else the bonus p.
  p_at = p_row(accepted)
  q_at = _at(draft_probs, jnp.minimum(accepted, gamma - 1))
  if isinstance(q_at, TopK):
    q_at = q_at.dense(p_at.shape[-1])
  dist = jnp.where((accepted == gamma)[:, None], p_at, residual_distribution(p_at, q_at))
  return Verdict(accepted=accepted, next_token=draw(k_resample, dist))


def _q_of(q: jax.Array | TopK, tokens: jax.Array) -> jax.Array:
  """q [B, gamma, V] or TopK [B, gamma, k] at tokens [B, gamma] -> [B, gamma]."""
  if isinstance(q, TopK):
    return q.prob_of(tokens)
  return jnp.take_along_axis(q, tokens[..., None], axis=-1)[..., 0]


def _at(a, at: jax.Array):
  """a [B, P, ...] (or a pytree of such arrays) at position at[b] of each sequence -> [B, ...]."""
  return jax.tree.map(
      lambda a: jnp.take_along_axis(a, at.reshape((-1,) + (1,) * (a.ndim - 1)), axis=1)[:, 0], a)


def verify_sampled(key: jax.Array, draft_tokens: jax.Array, draft_probs: jax.Array | TopK,
                   target_probs: jax.Array) -> Verdict:
  """Speculative sampling from probabilities: draft_tokens [B, gamma] drawn from draft_probs
  q (dense [B, gamma, V], or a TopK [B, gamma, k]); target_probs p [B, gamma + 1, V]."""
  gamma = draft_tokens.shape[1]
  px = jnp.take_along_axis(target_probs[:, :gamma], draft_tokens[..., None], axis=-1)[..., 0]
  return _verdict(key, px, draft_probs, draft_tokens, lambda at: _at(target_probs, at))


def verify_sampled_logits(key: jax.Array, draft_tokens: jax.Array, draft_probs: jax.Array | TopK,
                          target_logits: jax.Array, sampling: SamplingParams) -> Verdict:
  """`verify_sampled` of `probabilities(target_logits, sampling)` without building p for every
  position: temperature, top-k and top-p are thresholds on the scaled logits, so each position
  needs only its threshold, max and kept mass (reductions over its logits), p at the drafted
  tokens (a gather), and one whole row of p per sequence, where the next token is drawn. The
  softmax is written as `jax.nn.softmax` writes it, and the random draws are verify_sampled's.
  Not for min-p (a cut on probabilities; `verify_drafts` sends it to the dense path)."""
  gamma = draft_tokens.shape[1]
  x = scaled(target_logits, sampling)                                     # [B, gamma + 1, V]
  thr, m, total = kept_mass(x, sampling)                                  # [B, gamma + 1, 1] each

  def prob(xv, thr, m, total):
    return jnp.where(xv < thr, 0.0, jnp.exp(xv - m)) / total

  xd = jnp.take_along_axis(x[:, :gamma], draft_tokens[..., None], axis=-1)
  px = prob(xd, thr[:, :gamma], m[:, :gamma], total[:, :gamma])[..., 0]
  return _verdict(key, px, draft_probs, draft_tokens,
                  lambda at: prob(*(_at(a, at) for a in (x, thr, m, total))))


def verify_drafts(key: jax.Array, draft_tokens: jax.Array, draft_probs: jax.Array | TopK | None,
                  target_logits: jax.Array, sampling: SamplingParams) -> Verdict:
  """Accept/reject gamma drafts against the verification logits under `sampling`.

  draft_probs: the distribution each draft was drawn from, [B, gamma, V]
  (`sampling.sample_with_probs`) or a TopK [B, gamma, k] (`sampling.sample_top_k`); unused, may
  be None, when greedy. target_logits [B, gamma + 1, V] go through `sampling.probabilities`'s
  transforms here (`verify_sampled_logits`; with min-p, `verify_sampled` of the whole p).
  """
  if sampling.greedy:
    return verify_greedy(draft_tokens, target_logits)
  if sampling.min_p > 0.0:
    return verify_sampled(key, draft_tokens, draft_probs, probabilities(target_logits, sampling))
  return verify_sampled_logits(key, draft_tokens, draft_probs, target_logits, sampling)
