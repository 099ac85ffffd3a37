"""Page-granular KV selection helpers (Quest, SpecExtend): the cache seen as pages of 16 tokens.

A page is a candidate only once it is full and lies before the selection point, so every selected
page contributes exactly `page_size` valid positions; the partial last page (and everything written
after the selection point) is attended densely as the tail (see `sparse_attention`'s `tail_start`).

  page_summaries  channel-wise min / max of the keys of every page (Quest's metadata)
  quest_scores    Quest's upper bound of q.k over a page, from those summaries
  top_pages       the best `n` of the first `n_valid` pages, as token positions
  quest_select    Quest's choice for T query rows: a page's score is its largest bound over them
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

PAGE_SIZE = 16


def page_summaries(k: jax.Array, page_size: int = PAGE_SIZE) -> tuple[jax.Array, jax.Array]:
  """k [..., S, Hkv, D] -> (min, max) [..., S // page_size, Hkv, D], per page and channel.

  Unfilled pages hold garbage; callers mask pages past their valid count.
  """
  *lead, s, hkv, d = k.shape
  if s % page_size:
    raise ValueError(f"cache capacity {s} is not a multiple of the page size {page_size}")
  pages = k.reshape(*lead, s // page_size, page_size, hkv, d)
  return jnp.min(pages, axis=-3), jnp.max(pages, axis=-3)


def quest_scores(q: jax.Array, page_min: jax.Array, page_max: jax.Array) -> jax.Array:
  """Quest's criticality bound. q [B, Hq, D], page_min/max [B, P, Hkv, D] -> [B, Hkv, P] f32.

  For one query head the bound is sum_c max(q_c * min_c, q_c * max_c) >= q.k for every key k of
  the page; that is relu(q).max + min(q, 0).min, two matmuls. With GQA the query heads of a group
  share the KV head, so a page's score for the KV head is the largest bound over its group.
  """
  b, hq, d = q.shape
  hkv = page_min.shape[2]
  qg = q.reshape(b, hkv, hq // hkv, d).astype(jnp.float32)
  bound = (jnp.einsum("bhgd,bphd->bhgp", jnp.maximum(qg, 0.), page_max.astype(jnp.float32)) +
           jnp.einsum("bhgd,bphd->bhgp", jnp.minimum(qg, 0.), page_min.astype(jnp.float32)))
  return jnp.max(bound, axis=2)


def top_pages(scores: jax.Array, n_valid: jax.Array, n_select: jax.Array, max_pages: int,
              page_size: int = PAGE_SIZE) -> tuple[jax.Array, jax.Array]:
  """Pick the `n_select` best of the first `n_valid` pages.

  scores [..., P]; n_valid, n_select broadcastable to scores.shape[:-1]; static max_pages.
  Returns (token positions [..., max_pages * page_size] int32, counts [...] int32): the first
  counts entries are the positions of the chosen pages, best page first; the rest is padding.
  """
  p = scores.shape[-1]
  max_pages = min(max_pages, p)
  s = scores.astype(jnp.float32)
  valid = jnp.arange(p) < jnp.asarray(n_valid)[..., None]
  key = jnp.where(valid & ~jnp.isnan(s), jnp.maximum(s, jnp.finfo(jnp.float32).min), -jnp.inf)
  _, page_ids = jax.lax.top_k(key, max_pages)
  count = jnp.minimum(jnp.minimum(n_select, n_valid), max_pages)
  count = jnp.broadcast_to(count, scores.shape[:-1]).astype(jnp.int32)
  tokens = page_ids[..., :, None] * page_size + jnp.arange(page_size)
  tokens = tokens.reshape(*page_ids.shape[:-1], max_pages * page_size)
  return tokens.astype(jnp.int32), count * page_size


def quest_select(q: jax.Array, page_min: jax.Array, page_max: jax.Array, tail_start: jax.Array,
                 n_select: jax.Array, max_pages: int, page_size: int = PAGE_SIZE
                 ) -> tuple[jax.Array, jax.Array]:
  """Quest's pages for T query rows sharing one selection. q [B, T, Hq, D], page_min/max
  [B, P, Hkv, D], tail_start [B] (the full pages before it are the candidates), n_select [B] ->
  (token positions [B, Hkv, max_pages * page_size], counts [B, Hkv]) as `top_pages`.

  A page's score is its largest `quest_scores` bound over the T rows (and a KV group's query
  heads): a bound of every row's q.k. With T = 1 (decoding) this is Quest itself; T = gamma + 1 is
  a verification chunk (`benchmarks.sts`)."""
  scores = jax.vmap(quest_scores, in_axes=(1, None, None))(q, page_min, page_max)   # [T, B, Hkv, P]
  n_full = (tail_start // page_size)[:, None]
  return top_pages(jnp.max(scores, axis=0), n_full, n_select[:, None], max_pages, page_size)


def pages_for_budget(budget_tokens: jax.Array, page_size: int = PAGE_SIZE) -> jax.Array:
  """Pages that hold a token budget: ceil(budget / page_size)."""
  return (budget_tokens + page_size - 1) // page_size
