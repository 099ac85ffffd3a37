"""KV selection policies: each picks what its definition says, on reference scores and hand-made
caches; and how a draft chain takes their selection, cut per layer once."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.drafting import pages, policies as selection
from jaxspec.drafting.chain import draft_chain
from jaxspec.engine.sampling import SamplingParams
from jaxspec.model.attention import Dense, QuestPages, ScoreSpec, Sparse, attend, per_layer
from jaxspec.model.config import ModelConfig
from jaxspec.model.kv_cache import KVCache
from jaxspec.model.transformer import init_random
from pallas_kernels.sparse_attention import sparse_attention_reference
from pallas_kernels.topk_select import topk_select_reference
from pallas_kernels.verify_attention import verify_attention_reference

L, B, S, HKV, HQ, D, T = 2, 3, 128, 2, 4, 16, 4
LENGTHS = np.array([40, 90, 17], np.int32)
CFG = ModelConfig(arch="llama", vocab_size=16, hidden_size=HQ * D, intermediate_size=8,
                  num_layers=L, num_heads=HQ, num_kv_heads=HKV, head_dim=D)


def random_cache(seed=0):
  rng = np.random.default_rng(seed)
  k = rng.normal(size=(L, B, S, HKV, D)).astype(np.float32)
  v = rng.normal(size=(L, B, S, HKV, D)).astype(np.float32)
  q = rng.normal(size=(L, B, T, HQ, D)).astype(np.float32) * 2
  cache = KVCache(k=tuple(jnp.asarray(x) for x in k), v=tuple(jnp.asarray(x) for x in v),
                  lengths=jnp.asarray(LENGTHS))
  return cache, q


def visible_sets(sel, lengths, layer=0):
  """The positions before `lengths` a draft step sees: selected indices plus the dense tail."""
  out = []
  for b in range(len(lengths)):
    idx = np.asarray(sel.indices[layer, b])[: int(sel.counts[layer, b])]
    tail = range(int(sel.tail_start[b]), int(lengths[b]))
    out.append(set(idx.tolist()) | set(tail))
  return out


def assert_top_k(scores, chosen, prefix, k):
  """chosen holds k positions of [0, prefix) and none scores below an unchosen one there."""
  chosen = np.asarray(chosen)
  assert len(chosen) == k == len(set(chosen.tolist()))
  assert (chosen < prefix).all()
  rest = np.setdiff1d(np.arange(prefix), chosen)
  if len(rest):
    assert scores[chosen].min() >= scores[rest].max()


@pytest.mark.parametrize("score_kind", ["logits", "weights"])
@pytest.mark.parametrize("policy_cls, rows", [(selection.Vegas, (0, -1)), (selection.VegasAll, None)])
def test_vegas_selects_the_top_k_of_the_reference_scores(policy_cls, rows, score_kind):
  cache, q = random_cache()
  ratio, min_tokens = 0.2, 3
  k_max = selection.static_k_max(S, ratio, min_tokens)
  policy = policy_cls(ratio=ratio, min_tokens=min_tokens, k_max=k_max,
                      scoring=selection.Scoring(kind=score_kind, block=1))
  spec = policy.verify_scores
  assert (spec.kind, spec.rows) == (score_kind, rows)
  scores = jnp.stack([verify_attention_reference(jnp.asarray(q[l]), cache.k[l], cache.v[l],
                                                 cache.lengths, score_kind=score_kind,
                                                 score_rows=rows)[1] for l in range(L)])
  sel = policy.select_kv(cache, scores, cache.lengths, jnp.zeros((B,), jnp.int32))
  prefix = LENGTHS + 1                       # keys every collected row saw: [0, first_row]
  np.testing.assert_array_equal(sel.tail_start, prefix)
  s = np.asarray(scores.astype(jnp.float32))
  for l in range(L):
    for b in range(B):
      k = int(np.clip(np.ceil(ratio * prefix[b]), min_tokens, prefix[b]))
      assert int(sel.counts[l, b]) == k
      assert_top_k(s[l, b], np.asarray(sel.indices[l, b])[:k], prefix[b], k)


def pooled_reference(scores, prefix, width):
  """Each position's max over the positions within width // 2 of it that lie before prefix."""
  out = np.full_like(scores, -np.inf)
  r = width // 2
  for b in range(scores.shape[1]):
    for i in range(scores.shape[2]):
      lo, hi = max(0, i - r), min(int(prefix[b]), i + r + 1)
      if lo < hi:
        out[:, b, i] = scores[:, b, lo:hi].max(-1)
  return out


@pytest.mark.parametrize("width", [1, 3, 9])
def test_pooled_scores_are_each_windows_max_before_the_prefix(width):
  rng = np.random.default_rng(3)
  scores = rng.normal(size=(L, B, S)).astype(np.float32)
  scores[:, :, 60:] = 50.0     # past every prefix but the middle one's: must lend nothing
  prefix = np.array([40, 90, 17], np.int32)
  got = np.asarray(selection.pool_scores(jnp.asarray(scores), jnp.asarray(prefix), width))
  want = pooled_reference(scores, prefix, width)
  for b in range(B):
    n = int(prefix[b])
    np.testing.assert_array_equal(got[:, b, :n], want[:, b, :n])


@pytest.mark.parametrize("policy_cls", [selection.Vegas, selection.VegasLast])
def test_pooled_vegas_selects_the_top_k_of_the_pooled_scores(policy_cls):
  """With a pooling width the top-k ranks each position by its neighbourhood's best score, so a
  high-scoring key brings its neighbours in."""
  rng = np.random.default_rng(4)
  ratio, min_tokens, width = 0.2, 3, 5
  k_max = selection.static_k_max(S, ratio, min_tokens)
  policy = policy_cls(ratio=ratio, min_tokens=min_tokens, k_max=k_max,
                      scoring=selection.Scoring(pool=width, block=1))
  cache, _ = random_cache()
  accepted = jnp.zeros((B,), jnp.int32)
  scores = rng.normal(size=(L, B, S)).astype(np.float32)
  sel = policy.select_kv(cache, jnp.asarray(scores), cache.lengths, accepted)
  prefix = LENGTHS + 1
  pooled = pooled_reference(scores, prefix, width)
  for l in range(L):
    for b in range(B):
      k = int(np.clip(np.ceil(ratio * prefix[b]), min_tokens, prefix[b]))
      assert int(sel.counts[l, b]) == k
      assert_top_k(pooled[l, b], np.asarray(sel.indices[l, b])[:k], prefix[b], k)
  plain = policy_cls(ratio=ratio, min_tokens=min_tokens, k_max=k_max,
                     scoring=selection.Scoring(block=1)).select_kv(
      cache, jnp.asarray(scores), cache.lengths, accepted)
  assert not np.array_equal(np.asarray(plain.indices), np.asarray(sel.indices))


def block_reference(scores, prefix, block, k):
  """The `k // block` best whole blocks of [0, prefix) by their largest score (ties: the lower
  block), as the sorted positions they hold."""
  n_full = prefix // block
  best = scores[: n_full * block].reshape(n_full, block).max(-1)
  order = np.lexsort((np.arange(n_full), -best))[: k // block]
  return np.sort((order[:, None] * block + np.arange(block)).ravel())


@pytest.mark.parametrize("backend", ["reference", "interpret"])
@pytest.mark.parametrize("policy_cls, block", [(selection.Vegas, 8), (selection.Vegas, 5),
                                               (selection.VegasLast, 16)])
def test_block_vegas_keeps_whole_blocks_at_the_token_budget(policy_cls, block, backend):
  """With a selection block the top-k ranks the prefix's whole aligned blocks by their best
  score and keeps k // block of them whole; the partial last block is the dense tail's."""
  rng = np.random.default_rng(6)
  ratio, min_tokens = 0.2, 3
  k_max = selection.static_k_max(S, ratio, min_tokens)
  policy = policy_cls(ratio=ratio, min_tokens=min_tokens, k_max=k_max,
                      scoring=selection.Scoring(block=block), backend=backend)
  cache, _ = random_cache()
  accepted = jnp.zeros((B,), jnp.int32)
  scores = jnp.asarray(rng.normal(size=(L, B, S)), jnp.bfloat16)
  sel = policy.select_kv(cache, scores, cache.lengths, accepted)
  prefix = LENGTHS + 1
  np.testing.assert_array_equal(sel.tail_start, prefix // block * block)
  assert sel.indices.shape[-1] == k_max // block * block
  for l in range(L):
    for b in range(B):
      k = int(np.clip(np.ceil(np.float32(ratio) * prefix[b]), min_tokens, prefix[b]))
      c = int(sel.counts[l, b])
      assert c == k // block * block
      want = block_reference(np.asarray(scores[l, b], np.float32), prefix[b], block, k)
      np.testing.assert_array_equal(np.sort(np.asarray(sel.indices[l, b])[:c]), want)
  plain = policy_cls(ratio=ratio, min_tokens=min_tokens, k_max=k_max,
                     scoring=selection.Scoring(block=1), backend=backend).select_kv(
      cache, scores, cache.lengths, accepted)
  assert visible_sets(plain, prefix, 1) != visible_sets(sel, prefix, 1)


@pytest.mark.parametrize("backend", ["reference", "interpret"])
@pytest.mark.parametrize("block, window", [(1, 5), (1, 1000), (8, 12)])
def test_windowed_vegas_keeps_the_newest_positions_and_ranks_the_rest(block, window, backend):
  """With a recent window the prefix's newest min(window, k) positions are the dense tail's and
  the top-k ranks only the positions before them, for the rest of the same budget (blocks as
  without a window, over the ranked positions)."""
  rng = np.random.default_rng(7)
  ratio, min_tokens = 0.2, 3
  k_max = selection.static_k_max(S, ratio, min_tokens)
  policy = selection.Vegas(ratio=ratio, min_tokens=min_tokens, k_max=k_max,
                           scoring=selection.Scoring(block=block, window=window), backend=backend)
  cache, _ = random_cache()
  scores = jnp.asarray(rng.normal(size=(L, B, S)), jnp.bfloat16)
  sel = policy.select_kv(cache, scores, cache.lengths, jnp.zeros((B,), jnp.int32))
  prefix = LENGTHS + 1
  k = np.clip(np.ceil(np.float32(ratio) * prefix), min_tokens, prefix).astype(int)
  recent = np.minimum(window, k)
  ranked = prefix - recent
  np.testing.assert_array_equal(sel.tail_start, ranked // block * block)
  for l in range(L):
    for b in range(B):
      c = int(sel.counts[l, b])
      assert c == (k[b] - recent[b]) // block * block
      want = block_reference(np.asarray(scores[l, b], np.float32), ranked[b], block,
                             k[b] - recent[b])
      np.testing.assert_array_equal(np.sort(np.asarray(sel.indices[l, b])[:c]), want)
  seen = visible_sets(sel, prefix, 1)
  if window >= k.max():      # the window holds the whole budget: the newest k positions
    np.testing.assert_array_equal(sel.counts, 0)
    assert seen == [set(range(p - n, p)) for p, n in zip(prefix.tolist(), k.tolist())]
  plain = selection.Vegas(ratio=ratio, min_tokens=min_tokens, k_max=k_max,
                          scoring=selection.Scoring(block=block), backend=backend).select_kv(
      cache, scores, cache.lengths, jnp.zeros((B,), jnp.int32))
  assert seen != visible_sets(plain, prefix, 1)


def test_per_row_score_dump_matches_the_reference_row_by_row():
  cache, q = random_cache(1)
  plan = Dense(scores=ScoreSpec("weights", per_row=True))
  out, per_row = attend(jnp.asarray(q[0]), None, None, cache.k[0], cache.v[0], cache.lengths, plan,
                        "reference")
  assert per_row.shape == (B, T, S)
  ref_out, _ = verify_attention_reference(jnp.asarray(q[0]), cache.k[0], cache.v[0], cache.lengths)
  np.testing.assert_allclose(out, ref_out, rtol=1e-6, atol=1e-6)
  for t in range(T):
    _, row = verify_attention_reference(jnp.asarray(q[0]), cache.k[0], cache.v[0], cache.lengths,
                                        score_kind="weights", score_rows=(t,))
    np.testing.assert_array_equal(np.asarray(per_row[:, t], np.float32), np.asarray(row, np.float32))


def test_vegas_last_uses_each_sequences_last_accepted_row():
  cache, q = random_cache(2)
  policy = selection.VegasLast(ratio=0.1, min_tokens=2, k_max=selection.static_k_max(S, 0.1, 2),
                               scoring=selection.Scoring(block=1))
  plan = Dense(scores=policy.verify_scores)
  dump = jnp.stack([attend(jnp.asarray(q[l]), None, None, cache.k[l], cache.v[l], cache.lengths,
                           plan, "reference")[1] for l in range(L)])       # [L, B, T, S]
  accepted = jnp.asarray([0, 3, 2], jnp.int32)
  sel = policy.select_kv(cache, dump, cache.lengths, accepted)
  prefix = LENGTHS + np.asarray(accepted) + 1   # the row at n + a saw the whole accepted prefix
  np.testing.assert_array_equal(sel.tail_start, prefix)
  for l in range(L):
    for b in range(B):
      row = np.asarray(dump[l, b, int(accepted[b])].astype(jnp.float32))
      k = int(np.clip(np.ceil(0.1 * prefix[b]), 2, prefix[b]))
      assert_top_k(row, np.asarray(sel.indices[l, b])[:k], prefix[b], k)


def test_streaming_keeps_sinks_and_the_recent_window():
  cache = KVCache.create(CFG, 3, S, jnp.float32).replace(lengths=jnp.asarray([100, 10, 50]))
  policy = selection.Streaming(ratio=0.1, min_tokens=0, k_max=selection.static_k_max(S, 0.1, 0))
  sel = policy.select_kv(cache, None, None, None)
  got = visible_sets(sel, [100, 10, 50])
  assert got[0] == {0, 1, 2, 3} | set(range(94, 100))   # k = 10: 4 sinks + 6 recent
  assert got[1] == {0}                                   # k = 1: one sink, no window
  assert got[2] == {0, 1, 2, 3, 49}                      # k = 5
  # the window moves with the cache: drafts also see everything from tail_start on
  np.testing.assert_array_equal(sel.tail_start, [94, 10, 49])


def quest_case():
  """One sequence, one KV head of 4 channels, 4 pages of 16; 56 tokens: pages 0-2 full."""
  k = np.zeros((1, 64, 1, 4), np.float32)
  k[0, 0:16, 0, 1] = 1.0           # page 0: a broad mild match on channel 1
  k[0, 20, 0, 0] = 10.0            # page 1: one strong key on channel 0
  k[0, 40, 0, 0] = -8.0            # page 2: one strongly negative key on channel 0
  k[0, 50, 0, 0] = 100.0           # page 3 is partial (56 tokens): never a candidate
  return jnp.asarray(k)


@pytest.mark.parametrize("q0, q1, best", [(1.0, 0.0, 1), (-1.0, 0.0, 2), (0.0, 1.0, 0)])
def test_quest_picks_the_page_with_the_largest_bound(q0, q1, best):
  k = quest_case()
  page_min, page_max = pages.page_summaries(k)
  q = jnp.asarray([[[q0, q1, 0.0, 0.0]]])                     # [B=1, Hq=1, D]
  scores = pages.quest_scores(q, page_min, page_max)          # [1, 1, 4]
  tokens, counts = pages.top_pages(scores, jnp.asarray([[3]]), jnp.asarray([[1]]), max_pages=2)
  assert int(counts[0, 0]) == 16
  np.testing.assert_array_equal(tokens[0, 0, :16], np.arange(16) + 16 * best)


def test_quest_bound_is_an_upper_bound_of_every_key():
  rng = np.random.default_rng(0)
  k = jnp.asarray(rng.normal(size=(2, 64, 2, 8)), jnp.float32)
  q = jnp.asarray(rng.normal(size=(2, 4, 8)), jnp.float32)    # 2 query heads per KV head
  bound = np.asarray(pages.quest_scores(q, *pages.page_summaries(k)))   # [B, Hkv, P]
  qk = np.einsum("bhgd,bshd->bhgs", np.asarray(q).reshape(2, 2, 2, 8), np.asarray(k))
  true_max = qk.reshape(2, 2, 2, 4, 16).max(axis=(2, 4))
  assert (bound >= true_max - 1e-5).all()


def test_quest_attention_mode_equals_sparse_attention_on_the_chosen_pages():
  k = jnp.concatenate([quest_case()] * 2, axis=2) + 0.01      # 2 KV heads, same pages
  v = jnp.asarray(np.random.default_rng(1).normal(size=k.shape), jnp.float32)
  q = jnp.asarray([[[[1.0, 0, 0, 0], [1.0, 0, 0, 0], [0, 1.0, 0, 0], [0, 1.0, 0, 0]]]])  # [1,1,4,4]
  page_min, page_max = pages.page_summaries(k)
  lengths = jnp.asarray([56])
  plan = QuestPages(pages=jnp.asarray([1]), tail_start=jnp.asarray([48]), page_min=page_min,
                    page_max=page_max, max_pages=2)
  out, _ = attend(q, None, None, k, v, lengths, plan, "reference")
  # KV head 0 (query heads 0, 1) wants page 1, KV head 1 (query heads 2, 3) page 0.
  idx = jnp.asarray([[np.arange(16, 32), np.arange(0, 16)]], jnp.int32)
  ref = sparse_attention_reference(q, k, v, idx, jnp.asarray([[16, 16]]), jnp.asarray([48]), lengths)
  np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6)


def test_quest_policy_budget_and_tail():
  cache = KVCache.create(CFG, 3, S, jnp.float32).replace(lengths=jnp.asarray([100, 10, 50]))
  policy = selection.Quest(ratio=0.2, min_tokens=0, k_max=selection.static_k_max(S, 0.2, 0))
  sel = policy.select_kv(cache, None, None, None)
  np.testing.assert_array_equal(sel.tail_start, [96, 0, 48])       # the partial page is dense
  np.testing.assert_array_equal(sel.pages[0], [2, 0, 1])            # ceil(k / 16), k = 20, 2, 10
  assert sel.page_min.shape == (L, 3, S // 16, HKV, D)
  assert sel.max_pages == pages.pages_for_budget(policy.k_max)


def test_specextend_picks_pages_by_attention_mass():
  w = np.zeros((1, 1, 64), np.float32)       # one layer, one sequence, weights row of 50 tokens
  w[0, 0, 3] = 0.30                          # the single heaviest token sits in page 0 ...
  w[0, 0, 16:32] = 0.04                      # ... but page 1 carries more mass (0.64)
  w[0, 0, 50:] = -np.inf                     # not visible to the row
  cache = KVCache.create(CFG.__class__(**{**CFG.__dict__, "num_layers": 1}), 1, 64,
                         jnp.float32).replace(lengths=jnp.asarray([50]))
  policy = selection.SpecExtend(ratio=0.3, min_tokens=0, k_max=32)
  assert policy.verify_scores.per_row
  sel = policy.select_kv(cache, jnp.asarray(w), jnp.asarray([49]), jnp.asarray([0]))
  assert int(sel.counts[0, 0]) == 16 and int(sel.tail_start[0]) == 48   # ceil(15 / 16) = 1 page
  np.testing.assert_array_equal(sel.indices[0, 0, :16], np.arange(16, 32))


def test_selection_topk_picks_the_reference_set():
  """`selection.per_layer_topk` (the threshold select's XLA form off the GPU) selects lax.top_k's
  set in every layer."""
  rng = np.random.default_rng(5)
  scores = jnp.asarray(rng.normal(size=(2, 6, 128)), jnp.bfloat16)     # [L, B, S]
  prefix = jnp.asarray([128, 100, 64, 17, 5, 90])
  args = dict(ratio=0.1, min_tokens=3, k_max=13)
  idx, cnt, tail_start = selection.per_layer_topk(scores, prefix, **args)
  np.testing.assert_array_equal(tail_start, prefix)
  p = np.asarray(prefix)
  want = np.ceil(np.float32(0.1) * p.astype(np.float32))           # the budget rule, in f32
  want = np.minimum(np.minimum(np.maximum(want, 3), p), 13)
  for layer in range(2):
    ref_idx = topk_select_reference(scores[layer], prefix, jnp.asarray(want, jnp.int32), k_max=13)
    np.testing.assert_array_equal(cnt[layer], want)
    for b in range(6):
      c = int(cnt[layer, b])
      assert set(np.asarray(idx[layer, b, :c]).tolist()) == set(np.asarray(ref_idx[b, :c]).tolist())


def test_budget_rule_is_in_float32():
  """k = clamp(ceil(ratio * len), min_tokens, len), at most k_max, with ratio * len in f32."""
  lengths = np.arange(701, dtype=np.int32)            # 0, 1, ..., and every length up to 700
  want = np.ceil(np.float32(0.07) * lengths.astype(np.float32))
  np.testing.assert_array_equal(selection.budget(jnp.asarray(lengths), 0.07, 8, 60),
                                np.minimum(np.minimum(np.maximum(want, 8), lengths), 60))


def test_static_k_max_covers_every_budget():
  for cap, ratio, mt in [(256, 0.07, 16), (128, 1.0, 0), (512, 0.01, 256), (128, 0.5, 1000)]:
    k_max = selection.static_k_max(cap, ratio, mt)
    lengths = jnp.arange(1, cap + 1)
    want = np.minimum(np.maximum(np.ceil(ratio * np.arange(1, cap + 1)), mt), np.arange(1, cap + 1))
    np.testing.assert_array_equal(selection.budget(lengths, ratio, mt, k_max), want)


@pytest.mark.parametrize("kwargs, match", [
    (dict(method="magic"), "unknown method"),
    (dict(ratio=0.0), "sparsity ratio"),
    (dict(ratio=1.5), "sparsity ratio"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(scoring="logits"), "scoring must be a jaxspec.drafting.policies.Scoring, got 'logits'"),
])
def test_bad_settings_raise(kwargs, match):
  args = dict(method="vegas", ratio=0.1, min_tokens=4, k_max=8)
  args.update(kwargs)
  with pytest.raises(ValueError, match=match):
    selection.make_policy(args.pop("method"), **args)


@pytest.mark.parametrize("kwargs, match", [
    (dict(kind="softmax"), "score mode"),
    (dict(pool=0), "score pool must be an odd positive integer"),
    (dict(pool=4), "score pool must be an odd positive integer"),
    (dict(pool=True), "score pool must be an odd positive integer"),
    (dict(block=0), "score block must be a positive integer"),
    (dict(block=2.0), "score block must be a positive integer"),
    (dict(window=-1), "score window must be a non-negative integer"),
    (dict(window=1.5), "score window must be a non-negative integer"),
])
def test_bad_scoring_raises(kwargs, match):
  with pytest.raises(ValueError, match=match):
    selection.Scoring(**kwargs)


def test_per_layer_cuts_layer_arrays_and_leaves_other_plans_alone():
  rng = np.random.default_rng(5)
  plan = Sparse(indices=jnp.asarray(rng.integers(0, S, (L, B, 8)), jnp.int32),
                counts=jnp.asarray(rng.integers(0, 9, (L, B)), jnp.int32),
                tail_start=jnp.asarray(LENGTHS - 4))
  cut = per_layer(plan, L)
  for i in range(L):
    np.testing.assert_array_equal(cut.for_layer(i).indices, plan.indices[i])
    np.testing.assert_array_equal(cut.for_layer(i).counts, plan.counts[i])
    np.testing.assert_array_equal(cut.for_layer(i).tail_start, plan.tail_start)
  dense = Dense(scores=ScoreSpec(layers=(1,)))
  assert per_layer(dense, L) is dense


def test_a_draft_chain_reads_each_layers_selection_from_outside_its_loop():
  """The chain's scan body takes the per-layer index lists as inputs: no [L, B, K] list inside it
  for XLA to slice (and copy) again every step."""
  cfg = ModelConfig(arch="llama", vocab_size=32, hidden_size=HQ * D, intermediate_size=16,
                    num_layers=L, num_heads=HQ, num_kv_heads=HKV, head_dim=D)
  model = init_random(cfg, dtype=jnp.float32, seed=1)
  cache = KVCache.create(cfg, B, S, jnp.float32).replace(lengths=jnp.asarray(LENGTHS))
  kk = 8
  plan = Sparse(indices=jnp.zeros((L, B, kk), jnp.int32), counts=jnp.full((L, B), kk, jnp.int32),
                tail_start=jnp.asarray(LENGTHS - 4))
  first = jnp.zeros((B, 1), jnp.int32)
  jaxpr = jax.make_jaxpr(lambda cache, plan, key: draft_chain(
      model, cache, first, plan, "reference", 3, key, SamplingParams()))(
          cache, plan, jax.random.key(0))
  scans = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
  assert len(scans) == 1
  shapes = [v.aval.shape for v in scans[0].params["jaxpr"].jaxpr.invars]
  assert (B, kk) in shapes                      # each layer's list, cut outside
  assert (L, B, kk) not in shapes and (L, B) not in shapes
