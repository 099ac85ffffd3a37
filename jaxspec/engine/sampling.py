"""Sampling settings and the logits transforms shared by plain and speculative decoding.

The target's distribution p is `probabilities` of its logits, in plain decoding and in
verification alike: that is the distribution the output follows. Speculative sampling is lossless
for any draft distribution q, provided verification is given the q each draft was drawn from; a
q close to p accepts more. Draft steps draw through `sample_draft`: from `sample_top_k` (the same
transforms over the top-k logits only, kept as k (id, probability) pairs) when top-k is on and
small, otherwise from `sample_with_probs` (the whole row, exactly `probabilities`).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """temperature 0 = greedy. top_k 0 = off; top_p 1 = off; min_p 0 = off. Hashable (static)."""
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  min_p: float = 0.0

  def __post_init__(self):
    if not (self.temperature >= 0):
      raise ValueError(f"temperature must be >= 0, got {self.temperature}")
    if not (isinstance(self.top_k, int) and self.top_k >= 0):
      raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k}")
    if not (0 < self.top_p <= 1):
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
    if not (0 <= self.min_p < 1):
      raise ValueError(f"min_p must be in [0, 1), got {self.min_p}")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0 or self.top_k == 1


def top_k_entries(x: jax.Array, k: int, block: int = 128) -> tuple[jax.Array, jax.Array]:
  """The k largest values along the last axis in descending order, and an index of each
  ([..., k], [..., k] int32). The values are exact; where values tie across the k-th, which of
  the tied indices are returned is unspecified.

  `lax.top_k` over a 152K vocabulary is a full segmented sort on the GPU (about 1 ms at 64 rows,
  as much as a whole decode step of a 0.5B model). The k largest values lie in the k blocks with
  the largest maxima, so: one pass for the block maxima, then two small top-k's.
  """
  v = x.shape[-1]
  n_blocks = -(-v // block)
  if k > block or k >= n_blocks:
    values, idx = jax.lax.top_k(x, k)
    return values, idx.astype(jnp.int32)
  pad = [(0, 0)] * (x.ndim - 1) + [(0, n_blocks * block - v)]
  blocks = jnp.pad(x, pad, constant_values=-jnp.inf).reshape(*x.shape[:-1], n_blocks, block)
  _, best = jax.lax.top_k(jnp.max(blocks, axis=-1), k)                     # [..., k] block ids
  cand = jnp.take_along_axis(blocks, best[..., None], axis=-2)              # [..., k, block]
  values, j = jax.lax.top_k(cand.reshape(*x.shape[:-1], k * block), k)
  idx = jnp.take_along_axis(best, j // block, axis=-1) * block + j % block
  # A padding entry (-inf) is chosen only in a row with fewer than k finite values; keep its index
  # in the vocabulary (its probability is 0 wherever it is used).
  return values, jnp.minimum(idx, v - 1).astype(jnp.int32)


def top_k_values(x: jax.Array, k: int, block: int = 128) -> jax.Array:
  """The k largest values along the last axis, in descending order (exact, ties included)."""
  return top_k_entries(x, k, block)[0]


def keep_threshold(x: jax.Array, sp: SamplingParams) -> jax.Array:
  """The smallest value top-k and top-p keep in each row of temperature-scaled logits x [..., V]
  (HF's order: top-k, then top-p over what it kept): [..., 1] f32, -inf where both are off. Both
  filters keep exactly the entries at or above it."""
  return kept_mass(x, sp)[0]


def kept_mass(x: jax.Array, sp: SamplingParams) -> tuple[jax.Array, jax.Array, jax.Array]:
  """`keep_threshold`'s threshold of each row of temperature-scaled logits x [..., V], the row's
  max m and the mass it keeps, sum(exp(x - m)) over the entries at or above the threshold:
  [..., 1] f32 each, so p = exp(x - m) / mass at or above the threshold and 0 below it.

  With top-k on, x is read twice: for its block maxima (the k largest values, the first of them
  m) and for the mass top-k keeps, ties with the k-th value included. A top-p cut above the k-th
  value keeps only entries among those k, so the mass after it is summed over the k values."""
  top = None
  thr = jnp.full(x.shape[:-1] + (1,), -jnp.inf, jnp.float32)
  if sp.top_k > 0 and sp.top_k < x.shape[-1]:
    top = top_k_values(x, sp.top_k)                           # [..., k], descending
    thr, m = top[..., -1:], top[..., :1]
  else:
    m = jnp.max(x, axis=-1, keepdims=True)
  mass = jnp.sum(jnp.where(x < thr, 0.0, jnp.exp(x - m)), axis=-1, keepdims=True)
  if sp.top_p < 1.0:
    # Keep the smallest set of top tokens whose mass reaches top_p (at least one token). After
    # top-k only the k values (plus ties with the k-th) survive: the cut is found among them
    # instead of sorting the whole vocabulary, which dominated sampled draft steps.
    srt = jnp.sort(x, axis=-1)[..., ::-1] if top is None else top
    weights = jnp.exp(srt - m)
    probs = weights / mass
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    cut = jnp.maximum(thr, jnp.min(jnp.where(mass_before < sp.top_p, srt, jnp.inf), axis=-1,
                                   keepdims=True))
    mass = jnp.where(cut > thr, jnp.sum(jnp.where(srt < cut, 0.0, weights), axis=-1,
                                        keepdims=True), mass)
    thr = cut
  return thr, m, mass


def scaled(logits: jax.Array, sp: SamplingParams) -> jax.Array:
  """Logits over the temperature, in f32: what every filter compares."""
  return logits.astype(jnp.float32) / max(sp.temperature, 1e-6)


def filter_logits(logits: jax.Array, sp: SamplingParams) -> jax.Array:
  """Temperature, then top-k, top-p, min-p (HF's order). Removed entries become -inf. [..., V] f32."""
  x = scaled(logits, sp)
  if (sp.top_k > 0 and sp.top_k < x.shape[-1]) or sp.top_p < 1.0:
    x = jnp.where(x < keep_threshold(x, sp), -jnp.inf, x)
  if sp.min_p > 0.0:
    probs = jax.nn.softmax(x, axis=-1)
    cut = sp.min_p * jnp.max(probs, axis=-1, keepdims=True)
    x = jnp.where(probs < cut, -jnp.inf, x)
  return x


def probabilities(logits: jax.Array, sp: SamplingParams) -> jax.Array:
  """The distribution tokens are drawn from: one-hot argmax when greedy, else softmax(filtered)."""
  if sp.greedy:
    return jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
  return jax.nn.softmax(filter_logits(logits, sp), axis=-1)


DRAW_BLOCK = 128   # vocabulary entries per block in `draw`'s two-level search


def draw(key: jax.Array, probs: jax.Array) -> jax.Array:
  """One index per row of probs [..., V] (non-negative, not all zero; need not sum to one),
  index i with probability probs[i] / sum(probs): int32 [...].

  Inverse transform sampling with one uniform per row, searched in two levels: the masses of
  blocks of DRAW_BLOCK entries and their running sum pick the block, the running sum inside it
  the entry. `jax.random.categorical` draws a Gumbel variate for every entry instead: at 128 rows
  of a 152K vocabulary that is 19M threefry draws, about 140 us on an H200, where this reads the
  row once. A zero-probability entry is never returned, rounding included: the search takes the
  first block, and the first entry, with positive mass whose running sum passes the target, and
  the last positive one if rounding leaves the target past them all."""
  lead, v = probs.shape[:-1], probs.shape[-1]
  p = probs.reshape(-1, v).astype(jnp.float32)
  n_blocks = -(-v // DRAW_BLOCK)
  p = jnp.pad(p, ((0, 0), (0, n_blocks * DRAW_BLOCK - v))).reshape(-1, n_blocks, DRAW_BLOCK)
  mass = jnp.sum(p, axis=-1)                                                 # [R, n_blocks]
  cum = jnp.cumsum(mass, axis=-1)
  target = jax.random.uniform(key, cum.shape[:1], jnp.float32) * cum[:, -1]

  def first_past(running, weights, t):
    """The first position with positive weight whose running sum exceeds t, else the last
    position with positive weight."""
    hit = (running > t[:, None]) & (weights > 0)
    last = weights.shape[-1] - 1 - jnp.argmax((weights > 0)[:, ::-1], axis=-1)
    return jnp.where(jnp.any(hit, axis=-1), jnp.argmax(hit, axis=-1), last)

  blk = first_past(cum, mass, target)
  inner = jnp.take_along_axis(p, blk[:, None, None], axis=1)[:, 0]          # [R, DRAW_BLOCK]
  before = jnp.take_along_axis(cum - mass, blk[:, None], axis=1)[:, 0]
  idx = blk * DRAW_BLOCK + first_past(jnp.cumsum(inner, axis=-1), inner, target - before)
  # A row with no positive entry (all zero, or NaN) would land in the padding: keep it a token.
  return jnp.minimum(idx, v - 1).astype(jnp.int32).reshape(lead)


def sample(key: jax.Array, logits: jax.Array, sp: SamplingParams) -> jax.Array:
  """Draw one token per row of logits [..., V] -> int32 [...]."""
  if sp.greedy:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  return sample_with_probs(key, logits, sp)[0]


def sample_with_probs(key: jax.Array, logits: jax.Array, sp: SamplingParams
                      ) -> tuple[jax.Array, jax.Array]:
  """`sample` (not greedy) plus the distribution it drew from, `probabilities(logits, sp)`: the
  draft step keeps it for verification, so its logits are filtered once, not twice."""
  probs = jax.nn.softmax(filter_logits(logits, sp), axis=-1)
  return draw(key, probs), probs


@struct.dataclass
class TopK:
  """A distribution over at most k tokens: probability probs[..., j] on token ids[..., j]
  (f32 and int32, [..., k]); entries a filter removed have probability 0."""
  ids: jax.Array
  probs: jax.Array

  def prob_of(self, tokens: jax.Array) -> jax.Array:
    """The probability of tokens [...] (0 off the support)."""
    return jnp.sum(jnp.where(self.ids == tokens[..., None], self.probs, 0.0), axis=-1)

  def dense(self, vocab: int) -> jax.Array:
    """The same distribution over the whole vocabulary, [..., vocab] f32."""
    # k compares an entry in one fused pass: a scatter into zeros cost verification 100-200 us
    # more a round (H100, B = 64-128).
    v = jnp.arange(vocab, dtype=jnp.int32)[:, None]
    return jnp.sum(jnp.where(self.ids[..., None, :] == v, self.probs[..., None, :], 0.0), axis=-1)


# Up to this top-k, `sample_top_k` keeps the draft distribution as (id, probability) pairs:
# the candidates' k blocks of 128 logits stay small next to a row of the vocabulary.
TOP_K_SPARSE_MAX = 64


def top_k_drafts(sp: SamplingParams, vocab: int) -> bool:
  """Whether drafts under `sp` over a vocabulary of `vocab` draw from `sample_top_k`:
  sampled, with 0 < top_k <= 64 and below the vocabulary (top-k is off at or above it)."""
  return not sp.greedy and 0 < sp.top_k <= TOP_K_SPARSE_MAX and sp.top_k < vocab


def sample_draft(key: jax.Array, logits: jax.Array, sp: SamplingParams
                 ) -> tuple[jax.Array, jax.Array | TopK]:
  """A draft step's draw of one token per row of logits [..., V] (not greedy) and the distribution
  verification reads: `sample_top_k` when `top_k_drafts(sp, V)`, else `sample_with_probs`."""
  if top_k_drafts(sp, logits.shape[-1]):
    return sample_top_k(key, logits, sp)
  return sample_with_probs(key, logits, sp)


def sample_top_k(key: jax.Array, logits: jax.Array, sp: SamplingParams
                 ) -> tuple[jax.Array, TopK]:
  """Draw one token per row of logits [..., V] from `probabilities`' transforms applied to the
  row's top_k logits only, and return that distribution as a TopK [..., top_k].

  It is `probabilities(logits, sp)` except where logits tie across the k-th largest: there the
  whole-row filter keeps every tied entry and this keeps exactly k of them (and normalises
  top-p's mass over those k). A speculative draft needs only a distribution it really drew from,
  so this q stays lossless; it saves the draft step the sampler's passes over [B, V] f32 rows
  and the [B, gamma, V] buffer verification read q from. Needs `top_k_drafts(sp, V)`.
  """
  values, ids = top_k_entries(logits, sp.top_k)
  x = scaled(values, sp)                                                    # [..., k] descending
  if sp.top_p < 1.0:
    probs = jax.nn.softmax(x, axis=-1)
    keep = jnp.cumsum(probs, axis=-1) - probs < sp.top_p                    # at least the first
    x = jnp.where(x < jnp.min(jnp.where(keep, x, jnp.inf), axis=-1, keepdims=True), -jnp.inf, x)
  probs = jax.nn.softmax(x, axis=-1)
  if sp.min_p > 0.0:
    cut = sp.min_p * jnp.max(probs, axis=-1, keepdims=True)
    probs = jax.nn.softmax(jnp.where(probs < cut, -jnp.inf, x), axis=-1)
  j = draw(key, probs)
  return jnp.take_along_axis(ids, j[..., None], axis=-1)[..., 0], TopK(ids=ids, probs=probs)
