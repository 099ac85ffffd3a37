"""STS-PD, sparse prefill of an appended turn (`../shared/papers/sts.txt`: §3 motivates it for
multi-turn agents, §4.2 gives prefill its 2-D mask, §6.3.1 evaluates it): a session runs STS
decode -> sparse prefill of a new turn (a tool output, a user message) -> STS decode, and the
context is never re-read densely.

This CHANGES the target's output, as STS decoding does (`jaxspec.drafting.sts`): the turn's rows
of the target attend to a per-head selection of the context, so its K/V, and every token sampled
after it, are those of the masked target, not the dense target's. The full KV cache is kept (the
paper's STS-P setting also drops the unselected blocks from memory: not built).

A sequence's state at a round boundary (`jaxspec.engine.state.SpecState`): the target cache holds
[0, n), `last_token` (sampled, not in a cache) goes to n, the draft cache is trusted on [0, n - 1)
and `prev_token` is the token at n - 1. Appending a turn u_1..u_L feeds the R = L + 1 rows
[last_token, u_1..u_L] at positions n..n + L, in chunks of C rows (one `lax.scan` step each):
  draft    where the mask comes from. The draft model rewrites n - 1 (prev_token), then runs the
           chunk's rows densely and returns each row's attention weights per head (per KV head at
           granularity 'kv', per query head at 'q': `turn_scores`). The draft is small, so this
           dense pass is cheap; it runs the pure-JAX reference attention on every backend (the
           kernel collects per-row scores only as a mean over heads).
  mask     how rows are grouped: one selection per chunk and target (layer, KV head), from its
           mapped draft head (the `STSConfig` map, as in decoding): each real row's top-k keys
           (or k // P pages) among the context [0, n), united over the chunk's rows and capped at
           k by summed weight (`chunk_selection`: `sts.head_select`, `specattn.capped_union`).
           A row ranks the context only, not the turn before it: the turn is read densely, so the
           budget goes to the context. C = 1 is the exact per-row 2-D mask; a larger C shares one
           list per KV head among C rows (fewer selections, each row reading the union).
  target   one pass over the chunk's C rows, every layer through `sparse_attention` with its KV
           heads' lists (at most k context keys each) plus the turn's causal dense tail: the row
           at n + t sees [n, n + t]. Softmax over the visible keys only.
Then the target cache holds [0, n + R), the reply's first token is sampled from the last row, the
draft cache is trusted on [0, n + R - 1) and prev_token = u_L: decoding continues as after a
prefill. Rows past a turn's end (padding to the batch's longest turn and to whole chunks) are
computed and dropped: they sit after every real row, no real row sees them, and they are left out
of their chunk's selection.

Costs: per chunk, layer and KV head the target gathers at most k context rows plus the turn's
tail, against n + t for a dense prefill of the turn; the draft reads its whole cache once per
chunk; the scores held at a time are one chunk's ([Ld, B, C, H, S]). Measured (H200, 1.5B/0.5B
shapes, `benchmarks.sts_prefill`): 12-40x a dense prefill of the same turn at C = 256, the time in
the draft's per-head weights and the per-chunk selections rather than the target's attention; a
dense turn prefill costs 0.4-3.4 decoding rounds, too little for a sparse prefill kernel to save.

`Runner.extend(state, turns, max_new_tokens, chunk=C)` is the public entry (method 'sts');
`extend` is the pure function on a `SpecState`, `prefill_turn` the one on the two caches (it
returns every row's hidden state and the masks).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec import requests
from jaxspec.drafting.sts import STSConfig, head_select
from jaxspec.engine.config import RunConfig
from jaxspec.engine.sampling import sample
from jaxspec.engine.state import SpecState, append_tokens
from jaxspec.model.attention import Dense, LayerMapped, ScoreSpec
from jaxspec.model.kv_cache import KVCache
from jaxspec.model.transformer import Transformer


def turn_scores(spec: STSConfig) -> ScoreSpec:
  """The draft's turn pass collects, per row and head, its attention weights (in the draft layers
  the map reads)."""
  return ScoreSpec("weights", rows=None, per_row=True, heads=spec.granularity,
                   layers=spec.score_layers)


def check_chunk(chunk) -> int:
  """C, the turn rows sharing one selection, as an int >= 1; else a one-line ValueError."""
  return requests.check_count("the STS prefill chunk (turn rows sharing one selection)", chunk)


def chunk_selection(rows: jax.Array, real: jax.Array, context: jax.Array, spec: STSConfig,
                    capacity: int) -> tuple[jax.Array, jax.Array]:
  """rows [C, Ls, B, Hd, S]: the draft's rows of one chunk (`turn_scores`' layers), real [C, B]
  (padding rows: False), context [B] = n -> (indices [Lt, B, Hkv, K], counts [Lt, B, Hkv]): per
  target layer and KV head, each real row's top-k keys (pages) of its mapped draft head among
  [0, n), united, capped at k."""
  return head_select(rows, jnp.where(real, context[None], 0), context, spec, capacity)


def prefill_turn(target: Transformer, draft: Transformer, spec: STSConfig, chunk: int,
                 target_cache: KVCache, draft_cache: KVCache, prev_token: jax.Array,
                 feed: jax.Array, rows: jax.Array, backend: str
                 ) -> tuple[jax.Array, KVCache, KVCache, jax.Array, jax.Array]:
  """Append feed [B, T] (row 0: the token at n = target_cache.lengths, i.e. last_token; the first
  rows[b] are real) to both caches, the target's sparsely (module docstring).

  draft_cache: trusted on [0, n - 1); prev_token [B]: the token at n - 1. Returns (hidden [B, T, H]
  of the target's rows, the target cache with lengths n + rows, the draft cache with lengths
  n + rows - 1, indices [Nc, Lt, B, Hkv, K] and counts [Nc, Lt, B, Hkv]: chunk c's selection, for
  rows c * C .. c * C + C - 1, Nc = ceil(T / C)). The caches need n + Nc * C slots: writes past
  them are dropped, but the attention kernels want the chunk's rows inside the cache."""
  chunk = check_chunk(chunk)
  b, t = feed.shape
  if rows.shape != (b,) or prev_token.shape != (b,) or target_cache.lengths.shape != (b,):
    raise ValueError(f"feed [B, T] = {feed.shape} needs rows, prev_token and the caches' lengths "
                     f"of shape [{b}]")
  n = target_cache.lengths
  capacity = target_cache.capacity
  nc = -(-t // chunk)
  feed = jnp.pad(feed, ((0, 0), (0, nc * chunk - t)))
  # The draft rewrites position n - 1 (it may hold a rejected draft) before the turn's rows.
  _, draft_cache, _ = draft(prev_token[:, None], (n - 1)[:, None],
                            draft_cache.replace(lengths=n - 1), Dense(), backend)
  scored, slots = Dense(scores=turn_scores(spec)), spec.slots
  offsets = jnp.arange(chunk, dtype=jnp.int32)

  def one_chunk(caches, c):
    tcache, dcache = caches
    start = c * chunk
    tokens = jax.lax.dynamic_slice_in_dim(feed, start, chunk, axis=1)           # [B, C]
    positions = n[:, None] + start + offsets[None]
    _, dcache, scores = draft(tokens, positions, dcache.replace(lengths=n + start), scored,
                              "reference")                                     # [Ls, B, C, Hd, S]
    real = (start + offsets)[:, None] < rows[None]                              # [C, B]
    idx, cnt = chunk_selection(jnp.moveaxis(scores, 2, 0), real, n, spec, capacity)
    plan = LayerMapped(indices=idx, counts=cnt, tail_start=n, slots=slots)
    hidden, tcache, _ = target(tokens, positions, tcache.replace(lengths=n + start), plan, backend)
    return (tcache, dcache), (hidden, idx, cnt)

  (target_cache, draft_cache), (hidden, idx, cnt) = jax.lax.scan(
      one_chunk, (target_cache, draft_cache), jnp.arange(nc, dtype=jnp.int32))
  hidden = jnp.moveaxis(hidden, 0, 1).reshape(b, nc * chunk, -1)[:, :t]
  return (hidden, target_cache.replace(lengths=n + rows), draft_cache.replace(lengths=n + rows - 1),
          idx, cnt)


def extend(target: Transformer, draft: Transformer, state: SpecState, turns: jax.Array,
           turn_lens: jax.Array, max_new: jax.Array, config: RunConfig, chunk: int,
           max_new_buffer: int) -> SpecState:
  """An STS state at a round boundary, turns [B, L] right-padded (turn_lens [B] >= 1 real tokens
  each) -> the state that decodes each sequence's reply to its turn: the sequence so far (its
  last sampled token included) and the turn are in both caches (`prefill_turn`), the reply's
  first token is sampled from the turn's last row, and the output buffer restarts empty
  ([B, max_new_buffer], `max_new` [B] new tokens allowed, the first one included). The previous
  reply's tokens are dropped from the buffer: read them before. The acceptance statistics carry
  on. CHANGES the output as STS does."""
  ds, dm = state.decode, state.drafter
  spec = config.drafter.spec
  b = turns.shape[0]
  feed = jnp.concatenate([ds.last_token[:, None], turns.astype(jnp.int32)], axis=1)
  prev = jnp.take_along_axis(turns, (turn_lens - 1)[:, None], axis=1)[:, 0]   # the token at n + L
  hidden, tcache, dcache, _, _ = prefill_turn(target, draft, spec, chunk, ds.cache, dm.cache,
                                              dm.prev_token, feed, turn_lens + 1, config.backend)
  last = jnp.take_along_axis(hidden, turn_lens[:, None, None], axis=1)[:, 0]
  key, sub = jax.random.split(ds.key)
  first = sample(sub, target.logits(last), config.sampling)
  ds = ds.replace(cache=tcache, last_token=first,
                  tokens=jnp.full((b, max_new_buffer), -1, jnp.int32),
                  num_new=jnp.zeros((b,), jnp.int32), max_new=max_new, done=max_new <= 0, key=key)
  ds = append_tokens(ds, first[:, None], jnp.ones((b,), jnp.int32), config.stop_ids,
                     config.reserve)
  return state.replace(decode=ds, drafter=dm.replace(cache=dcache, prev_token=prev))
