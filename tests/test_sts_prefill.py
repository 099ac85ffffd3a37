"""STS-PD (`jaxspec.drafting.sts_prefill`): a turn appended sparsely to an STS session that has
decoded a first reply, selecting pages of 4 tokens in chunks of 2 rows. A budget holding the
context gives the dense extension (logits, both caches); with a real budget the masks equal a numpy
selection over the draft's rows (collected one row at a time, padding rows left out), the turn's
logits equal the target run one row at a time under them, and `Runner.extend` continues the
session with the greedy reply of the masked target, decoded one token per step with numpy masks;
bad input.

Every compile that selects keys costs ~15 s of CPU (`topk_select`), so the file compiles three:
the runner's round, `Runner.extend`, and `prefill_turn` (`run_turn`), shared by every test."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxspec.drafting import sts, sts_prefill
from jaxspec.engine.runner import Runner
from jaxspec.model.attention import Dense, LayerMapped, ScoreSpec
from jaxspec.model.transformer import init_random
from test_specattn import PROMPTS, cfg
from test_speculative import sharpen
from test_sts import _capped, _clean, _top, as_dict, block_reference, head_map

# Target and draft: 2 layers of 2 KV heads (4 query heads); each target KV head's draft head.
HEADS = (((1, 0), (0, 1)), ((0, 0), (1, 1)))
BUDGET, BLOCK, CHUNK, GAMMA, MAX_LEN, REPLY = 24, 4, 2, 3, 160, 8
TURNS = [np.random.default_rng(2).integers(0, 96, 9).tolist(),    # 10 rows: 5 chunks of 2
         np.random.default_rng(3).integers(0, 96, 4).tolist()]    # 5 rows: the third chunk padded
SHORT = [PROMPTS[0][:17], PROMPTS[1][:9]]                          # contexts within the budget
ROW_SCORES = ScoreSpec("weights", rows=(-1,), heads="kv")         # one row's weights per KV head


def spec_of(budget, block=1):
  return sts.STSConfig(heads=HEADS, draft_heads=2, target_kv_heads=2, budget=budget, block=block)


@pytest.fixture(scope="module")
def pair():
  return (sharpen(init_random(cfg(2), dtype=jnp.float32, seed=3)),
          sharpen(init_random(cfg(2), dtype=jnp.float32, seed=4)))


@pytest.fixture(scope="module")
def runner(pair):
  target, draft = pair
  return Runner(target, method="sts", draft_model=draft, gamma=GAMMA, sts_budget=BUDGET,
                sts_block=BLOCK, head_map=head_map(HEADS, BUDGET), cache_dtype=jnp.float32,
                stop_ids=())


@functools.partial(jax.jit, static_argnums=0)
def forward(graphdef, params, tokens, positions, cache, plan):
  """Every row's logits, the cache with the rows' K/V written, the scores."""
  model = nnx.merge(graphdef, params)
  hidden, cache, scores = model(tokens, positions, cache, plan)
  return model.logits(hidden), cache, scores


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def run_turn(graphdefs, spec, chunk, params, tcache, dcache, prev, feed, rows):
  target, draft = (nnx.merge(g, p) for g, p in zip(graphdefs, params))
  hidden, tcache, dcache, idx, cnt = sts_prefill.prefill_turn(
      target, draft, spec, chunk, tcache, dcache, prev, feed, rows, "reference")
  return target.logits(hidden), tcache, dcache, idx, cnt


def session(pair, runner, prompts, first_reply):
  """The runner's state (on the host) once a first reply is decoded to its end, `prefill_turn`'s
  outputs for TURNS on it, and what they need."""
  state, _, _ = runner.start(prompts, first_reply, max_len=MAX_LEN, max_new_buffer=16)
  while not np.asarray(state.decode.done).all():
    state, _ = runner.step(state, 2)
  host = jax.tree.map(np.array, jax.device_get(state))   # copies: the CPU may alias buffers
  ds = host.decode
  seqs = [list(p) + ds.tokens[b, :ds.num_new[b]].tolist() for b, p in enumerate(prompts)]
  n = ds.cache.lengths
  assert n.tolist() == [len(s) - 1 for s in seqs]   # last_token is not in the cache yet
  rows = np.asarray([len(t) + 1 for t in TURNS], np.int32)
  feed = np.zeros((2, rows.max()), np.int32)
  for b, t in enumerate(TURNS):
    feed[b, :rows[b]] = [ds.last_token[b], *t]
  models = (nnx.split(pair[0]), nnx.split(pair[1]))
  s = dict(host=host, seqs=seqs, n=n, rows=rows, feed=feed,
           graphdefs=tuple(m[0] for m in models), params=tuple(m[1] for m in models))
  s["turn"] = jax.device_get(run_turn(s["graphdefs"], runner.sts, CHUNK, s["params"], ds.cache,
                                      host.drafter.cache, host.drafter.prev_token, feed, rows))
  return s


@pytest.fixture(scope="module")
def long_session(pair, runner):
  return session(pair, runner, PROMPTS, [12, 3])   # the second finishes first and rides along


def turn_reference(rows, n, real, spec, chunk):
  """rows [T, Ld, Hd, S] of one sequence (positions n..n+T-1), the first `real` real -> per chunk
  {(layer, kv head): positions}: each real row's top-k pages of the mapped draft head over the
  context's weights (keys < n), united over the chunk, the k // P largest summed weights."""
  t_all, s = rows.shape[0], rows.shape[-1]
  p, kp = spec.block, spec.pages(s)
  out = []
  for c in range(-(-t_all // chunk)):
    masks = {}
    for j, layer in enumerate(spec.heads):
      for kv in range(spec.target_kv_heads):
        ws, sets = [], []
        for t in range(c * chunk, min(c * chunk + chunk, real)):
          i, e = layer[kv]
          w = _clean(rows[t, i, e])
          w[n:] = 0
          pages = np.array([np.float32(w[q * p:(q + 1) * p].sum(dtype=np.float32))
                            for q in range(-(-s // p))])
          ws.append(pages)
          sets.append(_top(pages, -(-n // p), kp))
        kept = _capped(sets, ws, -(-n // p), kp)
        masks[j, kv] = [x for q in kept for x in range(q * p, (q + 1) * p) if x < n]
    out.append(masks)
  return out


def test_a_budget_holding_the_context_is_the_dense_extension(pair, runner):
  s = session(pair, runner, SHORT, 4)
  ds, dm = s["host"].decode, s["host"].drafter
  n, rows, feed = s["n"], s["rows"], s["feed"]
  assert n.max() <= BUDGET
  logits, tcache, dcache, idx, cnt = s["turn"]
  assert cnt.shape == (5, 2, 2, 2)   # [chunks, target layers, B, KV heads]
  for b in range(2):   # each chunk with real rows reads every context key, in every head
    real = -(-rows[b] // CHUNK)
    assert (cnt[:real, :, b] == n[b]).all() and (cnt[real:, :, b] == 0).all()
    assert (idx[:real, :, b, :, :n[b]] == np.arange(n[b])).all()
  t = feed.shape[1]
  ref, tref, _ = forward(s["graphdefs"][0], s["params"][0], feed, n[:, None] + np.arange(t),
                         ds.cache, Dense())
  # The draft: position n - 1 rewritten, then the turn's rows.
  _, dref, _ = forward(s["graphdefs"][1], s["params"][1],
                       np.concatenate([dm.prev_token[:, None], feed], 1),
                       (n - 1)[:, None] + np.arange(t + 1), dm.cache.replace(lengths=n - 1),
                       Dense())
  assert tcache.lengths.tolist() == (n + rows).tolist()
  assert dcache.lengths.tolist() == (n + rows - 1).tolist()
  for b in range(2):
    end = n[b] + rows[b]
    np.testing.assert_allclose(logits[b, :rows[b]], ref[b, :rows[b]], rtol=1e-5, atol=1e-5)
    for got, want in [(tcache.k, tref.k), (tcache.v, tref.v), (dcache.k, dref.k),
                      (dcache.v, dref.v)]:
      for layer in range(2):
        np.testing.assert_allclose(got[layer][b, :end], want[layer][b, :end], rtol=1e-5,
                                   atol=1e-5)


@pytest.fixture(scope="module")
def draft_rows(long_session):
  """The draft's rows of the turn's positions [T, Ld, B, Hkv, S], one dense step per row, after
  rewriting position n - 1 with the sequence's own token there."""
  s = long_session
  g, p = s["graphdefs"][1], s["params"][1]
  n = jnp.asarray(s["n"])
  prev = jnp.asarray([seq[m - 1] for seq, m in zip(s["seqs"], s["n"])])
  cache = s["host"].drafter.cache
  _, cache, _ = forward(g, p, prev[:, None], (n - 1)[:, None], cache.replace(lengths=n - 1),
                        Dense())
  out = []
  for t in range(s["feed"].shape[1]):
    _, cache, sc = forward(g, p, jnp.asarray(s["feed"][:, t:t + 1]), (n + t)[:, None],
                           cache.replace(lengths=n + t), Dense(scores=ROW_SCORES))
    out.append(np.asarray(sc.astype(jnp.float32)))
  return np.stack(out)


def test_masks_equal_the_numpy_selection(runner, long_session, draft_rows):
  s = long_session
  n, rows = s["n"], s["rows"]
  _, _, _, idx, cnt = s["turn"]
  for b in range(2):
    ref = turn_reference(draft_rows[:, :, b], n[b], rows[b], runner.sts, CHUNK)
    assert [as_dict(idx[c], cnt[c], b) for c in range(5)] == ref
  # The padding row of sequence 1's third chunk is left out: with it that chunk's lists differ.
  padded = turn_reference(draft_rows[:, :, 1], n[1], rows[1] + 1, runner.sts, CHUNK)
  assert as_dict(idx[2], cnt[2], 1) != padded[2]
  # Sparse (at most k of n > k keys per KV head, and k in some), and the chunks' lists differ.
  assert n.min() > BUDGET and (cnt <= BUDGET).all() and (cnt == BUDGET).any()
  assert any(as_dict(idx[c], cnt[c], 0) != as_dict(idx[0], cnt[0], 0) for c in range(1, 5))


def numpy_plan(rows, n, spec, capacity):
  """The round's plan of one sequence from its draft rows [gamma, Ld, Hd, S], through the numpy
  selection of test_sts (`block_reference`), for a batch of two copies of it."""
  masks = block_reference(rows, n, spec)
  k = spec.k_max(capacity)
  idx = np.zeros((len(spec.heads), 2, spec.target_kv_heads, k), np.int32)
  cnt = np.zeros(idx.shape[:-1], np.int32)
  for (j, kv), positions in masks.items():
    idx[j, :, kv, :len(positions)] = positions
    cnt[j, :, kv] = len(positions)
  return LayerMapped(indices=idx, counts=cnt, tail_start=np.full(2, n, np.int32), slots=spec.slots)


def continue_greedy(pair, tcache, dcache, seq, max_new, spec):
  """Greedy decoding of the STS-masked target from caches holding seq[:-1] (the draft's trusted up
  to position len(seq) - 2), one target token per step (as test_specattn.masked_greedy): each
  round the draft drafts GAMMA tokens one step at a time, its rows give the round's masks
  (`numpy_plan`), the target emits tokens under them while it agrees with the drafts. The caches
  hold two copies of the sequence: the shapes the other references compiled."""
  (tg, tp), (dg, dp) = nnx.split(pair[0]), nnx.split(pair[1])

  def run(g, p, cache, token, pos, plan):
    logits, cache, sc = forward(g, p, np.full((2, 1), token, np.int32),
                                np.full((2, 1), pos, np.int32),
                                cache.replace(lengths=np.full(2, pos, np.int32)), plan)
    return int(jnp.argmax(logits[0, -1])), cache, sc

  seq, out, dlen = list(seq), [seq[-1]], len(seq) - 2
  while len(out) < max_new:
    n = len(seq) - 1
    for m in range(dlen, n):   # the draft cache catches up with the accepted tokens
      _, dcache, _ = run(dg, dp, dcache, seq[m], m, Dense())
    token, drafts, rows = seq[n], [], []
    for i in range(GAMMA):
      token, dcache, sc = run(dg, dp, dcache, token, n + i, Dense(scores=ROW_SCORES))
      drafts.append(token)
      rows.append(np.asarray(sc[:, 0].astype(jnp.float32)))
    dlen = n + 1
    plan = numpy_plan(np.stack(rows), n, spec, tcache.capacity)
    for i in range(GAMMA + 1):
      y, tcache, _ = run(tg, tp, tcache, seq[n] if i == 0 else drafts[i - 1], n + i, plan)
      seq.append(y)
      out.append(y)
      if i == GAMMA or y != drafts[i]:
        break
  return out[:max_new]


def test_a_session_decodes_takes_a_sparse_turn_and_decodes_again(pair, runner, long_session):
  s = long_session
  host, n, rows, feed = s["host"], s["n"], s["rows"], s["feed"]
  spec = runner.sts
  # The sequence that finished first rode along: its prev_token is still the token at n - 1.
  assert host.rounds > 2 and host.decode.num_new.tolist() == [12, 3]
  assert host.drafter.prev_token.tolist() == [seq[m - 1] for seq, m in zip(s["seqs"], n)]
  # The turn's logits: the target one row at a time, row t under its chunk's masks (those of
  # test_masks_equal_the_numpy_selection) and the dense tail [n, n + t].
  logits, tcache, dcache, idx, cnt = s["turn"]
  g, p = s["graphdefs"][0], s["params"][0]
  cache, ref = host.decode.cache, []
  for t in range(feed.shape[1]):
    plan = LayerMapped(indices=idx[t // CHUNK], counts=cnt[t // CHUNK], tail_start=n,
                       slots=spec.slots)
    lg, cache, _ = forward(g, p, feed[:, t:t + 1], (n + t)[:, None],
                           cache.replace(lengths=n + t), plan)
    ref.append(np.asarray(lg[:, 0]))
  ref = np.stack(ref, 1)
  dense, _, _ = forward(g, p, feed, n[:, None] + np.arange(feed.shape[1]), host.decode.cache,
                        Dense())
  for b in range(2):
    np.testing.assert_allclose(logits[b, :rows[b]], ref[b, :rows[b]], rtol=1e-5, atol=1e-5)
    assert np.abs(logits[b, :rows[b]] - dense[b, :rows[b]]).max() > 1e-2   # the masks matter
  # Runner.extend on the same state: the same caches, the reply's first token from the last row.
  state, _ = runner.extend(jax.tree.map(jnp.array, host), TURNS, REPLY, chunk=CHUNK)
  ds = jax.tree.map(np.array, jax.device_get(state.decode))
  dm = jax.tree.map(np.array, jax.device_get(state.drafter))
  first = [int(np.argmax(logits[b, rows[b] - 1])) for b in range(2)]
  assert ds.cache.lengths.tolist() == (n + rows).tolist()
  assert ds.num_new.tolist() == [1, 1] and ds.tokens[:, 0].tolist() == first
  assert dm.prev_token.tolist() == [t[-1] for t in TURNS]
  for b in range(2):
    end = n[b] + rows[b]
    for got, want in [(ds.cache.k, tcache.k), (ds.cache.v, tcache.v), (dm.cache.k, dcache.k),
                      (dm.cache.v, dcache.v)]:
      for layer in range(2):
        np.testing.assert_allclose(got[layer][b, :end], want[layer][b, :end], rtol=1e-5,
                                   atol=1e-5)
  # Decoding again: the greedy reply is the masked target's, decoded one token per step.
  while not np.asarray(state.decode.done).all():
    state, _ = runner.step(state, 2)
  reply = jax.device_get(state.decode)
  assert reply.num_new.tolist() == [REPLY, REPLY]
  for b in range(2):
    def twice(c):
      return jax.tree.map(lambda x: x[[b, b]], c)
    want = continue_greedy(pair, twice(ds.cache), twice(dm.cache),
                           s["seqs"][b] + TURNS[b] + [first[b]], REPLY, spec)
    assert reply.tokens[b, :REPLY].tolist() == want


@pytest.mark.parametrize("turns, kw, message", [
    (TURNS, dict(chunk=0), "the STS prefill chunk (turn rows sharing one selection) must be an "
     "integer >= 1, got 0"),
    (TURNS, dict(chunk=2.0), "must be an integer >= 1, got 2.0"),
    (TURNS[:1], {}, "1 turns for a session of 2 sequences: give one per sequence"),
    ([[1], []], {}, "turns[1] must be a non-empty list of token ids"),
    ([[1], [96]], {}, "turns[1][0] = 96 is not a token id of this model"),
    (TURNS, dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1, got 0"),
    ([[1] * 200, [1]], {}, "cache slots and the session has 256: start it with a larger max_len"),
    ([[1] * 150, [1]], dict(chunk=100),
     "the turns' rows padded to chunks of 100 run past the cache"),
])
def test_bad_input_is_a_one_line_error(runner, long_session, turns, kw, message):
  with pytest.raises(ValueError) as e:
    runner.extend(long_session["host"], turns, **{"max_new_tokens": 4, **kw})
  assert message in str(e.value) and "\n" not in str(e.value)


def test_bad_settings_are_one_line_errors(pair, long_session):
  target, draft = pair
  host, feed = long_session["host"], long_session["feed"]
  cases = [
      (lambda: Runner(target, method="draft", draft_model=draft).extend(host, TURNS, 4),
       "method 'draft' has no sparse prefill"),
      (lambda: Runner(target, method="sts", draft_model=draft, sts_budget=0),
       "the STS budget (keys each target head reads per round, besides the new tokens) must be "
       "an integer >= 1, got 0"),
      (lambda: sts_prefill.prefill_turn(target, draft, spec_of(4), 0, None, None, None, None, None,
                                        "reference"), "chunk (turn rows sharing one selection)"),
      (lambda: sts_prefill.prefill_turn(target, draft, spec_of(4), 1, host.decode.cache,
                                        host.drafter.cache, host.drafter.prev_token, feed,
                                        np.ones(3, np.int32), "reference"),
       "needs rows, prev_token and the caches' lengths of shape [2]"),
  ]
  for call, message in cases:
    with pytest.raises(ValueError) as e:
      call()
    assert message in str(e.value) and "\n" not in str(e.value)
