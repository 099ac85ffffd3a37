"""STS: greedy speculative output equals greedy decoding of the STS-masked target, built
independently (one target token per step, numpy masks); the mask builder against per-head
references (tokens, pages; pages of one token are tokens); per-head scores of the kernel; bad
input."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import sts_map
from jaxspec.drafting import sts
from jaxspec.engine.runner import Runner
from jaxspec.model.attention import LayerMapped, ScoreSpec
from jaxspec.model.config import ModelConfig
from jaxspec.model.transformer import init_random
from pallas_kernels import verify_attention as va
from test_specattn import GAMMA, MAX_NEW, PROMPTS, masked_greedy, pair  # noqa: F401

# Target: 4 layers of 2 KV heads (4 query heads); draft: 2 layers, the same heads.
HEADS = (((1, 0), (0, 1)), ((0, 0), (0, 0)), ((1, 1), (1, 0)), ((0, 1), (1, 1)))


def spec_of(budget, block=1, heads=HEADS, granularity="kv", draft_heads=2):
  return sts.STSConfig(heads=heads, draft_heads=draft_heads, target_kv_heads=2, budget=budget,
                       block=block, granularity=granularity)


def _clean(w):
  w = np.asarray(jnp.asarray(w).astype(jnp.float32))
  return np.where(np.isfinite(w) & (w > 0), w, 0.0).astype(np.float32)


def _capped(sets, weights, limit, cap):
  """The union of `sets` (one per row) below `limit`, the `cap` largest summed weights (ties to
  the lower unit)."""
  union = sorted({x for st in sets for x in st if x < limit})
  total = {x: np.float32(sum(np.float32(w[x]) for w in weights)) for x in union}
  return sorted(sorted(union, key=lambda x: (-total[x], x))[:cap])


def _top(w, length, k):
  return set(sorted(range(length), key=lambda x: (-w[x], x))[:k])


def token_reference(rows, n, spec):
  """rows [gamma, Ld, Hd, S] of one sequence -> {(layer, kv head): sorted positions}: per row the
  top-k positions of the mapped draft head(s), united, below n, the k largest summed weights."""
  g = rows.shape[0]
  out = {}
  for j, layer in enumerate(spec.heads):
    for kv in range(spec.target_kv_heads):
      mapped = layer[kv * spec.group:(kv + 1) * spec.group]
      ws = [_clean(rows[s, i, e]) for s in range(g) for i, e in mapped]
      sets = [_top(_clean(rows[s, i, e]), n + s + 1, spec.budget) for s in range(g)
              for i, e in mapped]
      out[j, kv] = _capped(sets, ws, n, spec.budget)
  return out


def block_reference(rows, n, spec):
  """As `token_reference` over pages of P tokens (a page's weight: its tokens' sum; k // P pages),
  then the kept pages' positions below n."""
  g, p = rows.shape[0], spec.block
  kp = spec.budget // p
  out = {}
  for j, layer in enumerate(spec.heads):
    for kv in range(spec.target_kv_heads):
      mapped = layer[kv * spec.group:(kv + 1) * spec.group]
      ws, sets = [], []
      for s in range(g):
        for i, e in mapped:
          w = _clean(rows[s, i, e])
          pages = np.array([np.float32(w[q * p:(q + 1) * p].sum(dtype=np.float32))
                            for q in range(-(-len(w) // p))])
          ws.append(pages)
          sets.append(_top(pages, -(-(n + s + 1) // p), kp))
      kept = _capped(sets, ws, -(-n // p), kp)
      out[j, kv] = [x for q in kept for x in range(q * p, (q + 1) * p) if x < n]
  return out


def as_dict(idx, cnt, b):
  idx, cnt = np.asarray(idx), np.asarray(cnt)
  return {(j, kv): idx[j, b, kv, :cnt[j, b, kv]].tolist()
          for j in range(idx.shape[0]) for kv in range(idx.shape[2])}


def random_rows(seed, g, ld, b, hd, s, starts):
  """Draft-like rows: bf16 softmax weights, row s of sequence b seeing keys [0, starts[b] + s]."""
  x = np.random.default_rng(seed).normal(size=(g, ld, b, hd, s)) * 3
  seen = np.arange(s)[None, None, None, None, :] <= (np.asarray(starts)[None, None, :, None, None]
                                                    + np.arange(g)[:, None, None, None, None])
  w = jax.nn.softmax(jnp.where(seen, x, -jnp.inf), axis=-1)
  return jnp.where(seen, w, -jnp.inf).astype(jnp.bfloat16)


@pytest.mark.parametrize("budget, block, granularity", [(6, 1, "kv"), (40, 1, "kv"), (9, 4, "kv"),
                                                         (6, 1, "q"), (8, 3, "q")])
def test_head_union_equals_reference(budget, block, granularity):
  starts, cap = [37, 12], 64
  if granularity == "q":   # 4 query heads per target layer, 4 draft query heads
    heads = tuple(tuple((j % 2, (j + h) % 4) for h in range(4)) for j in range(4))
    spec, hd = spec_of(budget, block, heads, "q", draft_heads=4), 4
  else:
    spec, hd = spec_of(budget, block), 2
  rows = random_rows(budget + block, 3, 2, 2, hd, cap, starts)
  mapped = rows[:, jnp.asarray(spec.score_layers)]
  idx, cnt = sts.head_union(mapped, jnp.asarray(starts), spec, cap)
  assert idx.shape == (4, 2, 2, spec.k_max(cap)) and cnt.shape == (4, 2, 2)
  ref = token_reference if block == 1 else block_reference
  for b, n in enumerate(starts):
    got = as_dict(idx, cnt, b)
    assert got == ref(np.asarray(rows[:, :, b].astype(jnp.float32)), n, spec)
    assert all(len(v) <= budget for v in got.values())
  if budget == 40:   # the union outgrows nothing for the short sequence: every position < n kept
    assert all(v == list(range(12)) for v in as_dict(idx, cnt, 1).values())


def test_head_union_with_the_pallas_top_k_is_the_reference():
  """topk_method 'pallas' (interpret mode) ranks the bf16 rows as they are: the reference's lists
  (HEADS maps several target heads to one draft head: each such list is united once)."""
  starts, cap = [37, 12], 64
  spec = dataclasses.replace(spec_of(6), topk_method="pallas")
  rows = random_rows(6, 3, 2, 2, 2, cap, starts)
  idx, cnt = sts.head_union(rows[:, jnp.asarray(spec.score_layers)], jnp.asarray(starts), spec,
                            cap, interpret=True)
  for b, n in enumerate(starts):
    assert as_dict(idx, cnt, b) == token_reference(np.asarray(rows[:, :, b].astype(jnp.float32)),
                                                   n, spec)


@pytest.mark.parametrize("kw, message", [
    (dict(topk_method="sort"), "the STS top-k method must be one of auto, threshold, pallas"),
    (dict(topk_method="pallas", block=4), "'pallas' ranks bf16 token scores: block must be 1"),
])
def test_bad_selection_settings_are_one_line_errors(kw, message):
  with pytest.raises(ValueError) as e:
    sts.STSConfig(heads=HEADS, draft_heads=2, target_kv_heads=2, budget=8, **kw)
  assert message in str(e.value) and "\n" not in str(e.value)


def test_only_the_mapped_draft_layers_are_collected():
  """A map reading draft layer 1 only: the draft steps collect that layer, and the selection from
  its rows alone is the reference's from every layer's."""
  heads = (((1, 0), (1, 1)), ((1, 1), (1, 0)), ((1, 0), (1, 0)), ((1, 1), (1, 1)))
  spec, starts, cap = spec_of(6, 1, heads), [37, 12], 64
  assert spec.score_layers == (1,) and spec.draft_scores.layers == (1,)
  rows = random_rows(3, 3, 2, 2, 2, cap, starts)
  idx, cnt = sts.head_union(rows[:, 1:], jnp.asarray(starts), spec, cap)
  for b, n in enumerate(starts):
    assert as_dict(idx, cnt, b) == token_reference(np.asarray(rows[:, :, b].astype(jnp.float32)),
                                                   n, spec)


def test_pages_of_one_token_are_tokens():
  rows = np.asarray(random_rows(5, 3, 2, 1, 2, 48, [30])[:, :, 0].astype(jnp.float32))
  for budget in (1, 5, 17):
    assert (block_reference(rows, 30, spec_of(budget, 1))
            == token_reference(rows, 30, spec_of(budget, 1)))


def all_layer_weights(spec):
  """The rows the references read: every draft layer's (the engine collects the mapped ones)."""
  return ScoreSpec("weights", rows=(-1,), heads=spec.granularity)


def sts_plan(spec):
  """A round's plan from every draft layer's rows [gamma, Ld, Hd, S] (`all_layer_weights`): the
  engine's selection over the mapped layers' rows, checked against the numpy reference."""
  # One program for the selection: run op by op it compiled some 60-170 small programs a test.
  @functools.partial(jax.jit, static_argnums=2)
  def select(rows, n, cap):
    return sts.head_union(rows[:, jnp.asarray(spec.score_layers)][:, :, None], n, spec, cap)

  def plan(rows, n, cap):
    idx, cnt = select(rows, jnp.asarray([n]), cap)
    ref = (token_reference if spec.block == 1 else block_reference)(np.asarray(rows), n, spec)
    assert as_dict(idx, cnt, 0) == ref   # the plan below is the reference's
    return LayerMapped(indices=idx, counts=cnt, tail_start=jnp.asarray([n]),
                       slots=tuple(range(len(spec.heads))))
  return plan


# A draft model of another vocabulary (so another tokenizer).
OTHER_TOKENIZER = init_random(ModelConfig(arch="qwen3", vocab_size=50, hidden_size=32,
                                          intermediate_size=64, num_layers=2, num_heads=2,
                                          num_kv_heads=1, head_dim=16), dtype=jnp.float32)


def head_map(heads, budget, granularity="kv"):
  return sts_map.HeadMap(heads=heads, budget=budget, granularity=granularity, target={}, draft={})


# Query-head granularity: 4 query heads per target layer, each mapped to a draft query head.
HEADS_Q = tuple(tuple(((j + h) % 2, (3 * j + h) % 4) for h in range(4)) for j in range(4))


@pytest.mark.parametrize("budget, block, granularity", [(8, 1, "kv"), (12, 4, "kv"), (8, 1, "q")])
def test_greedy_sts_equals_greedy_masked_target(pair, budget, block, granularity):
  target, draft = pair
  heads = HEADS if granularity == "kv" else HEADS_Q
  runner = Runner(target, method="sts", draft_model=draft, gamma=GAMMA, sts_budget=budget,
                  sts_block=block, head_map=head_map(heads, budget, granularity),
                  cache_dtype=jnp.float32, stop_ids=())
  out, _ = runner.generate(PROMPTS, max_new_tokens=MAX_NEW)
  spec = runner.sts
  assert spec == spec_of(budget, block, heads, granularity, draft_heads=2 if granularity == "kv"
                         else 4)
  for prompt, got in zip(PROMPTS, out):
    assert got == masked_greedy(target, draft, prompt, GAMMA, MAX_NEW, all_layer_weights(spec),
                                sts_plan(spec))
  # The mask matters: dense speculative decoding (the dense target's) differs.
  dense, _ = Runner(target, method="draft", draft_model=draft, gamma=GAMMA,
                    cache_dtype=jnp.float32, stop_ids=()).generate(PROMPTS, max_new_tokens=MAX_NEW)
  assert dense != out


def test_sampled_sts_with_the_proportional_map(pair):
  from jaxspec.engine.sampling import SamplingParams
  target, draft = pair
  runner = Runner(target, method="sts", draft_model=draft, gamma=GAMMA, sts_budget=8,
                  cache_dtype=jnp.float32, stop_ids=(), sampling=SamplingParams(temperature=1.0))
  assert runner.sts.heads == sts.proportional_heads(4, 2, 2, 2)
  out, stats = runner.generate(PROMPTS, max_new_tokens=12, seed=1)
  assert [len(o) for o in out] == [12, 12] and all(0 <= t < 96 for o in out for t in o)
  assert stats.extra["method"] == "sts" and 1 <= stats.extra["mean_accepted_tokens"] <= 4
  assert 0 < stats.extra["kv_kept_share"] < 1   # at most 8 of the prefix keys per KV head


def test_kernel_kv_scores_equal_the_reference():
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.normal(size=(2, 2, 4, 16)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(2, 64, 2, 16)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(2, 64, 2, 16)), jnp.float32)
  lengths = jnp.asarray([30, 50])
  for kind in ("weights", "logits"):
    kw = dict(score_kind=kind, score_rows=(-1,), score_heads="kv", score_dtype=jnp.float32)
    _, ref = va.verify_attention_reference(q, k, v, lengths, **kw)
    _, got = va.verify_attention(q, k, v, lengths, interpret=True, **kw)
    assert ref.shape == (2, 2, 64)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-4, atol=1e-4)
  with pytest.raises(ValueError, match="the kernel collects score_heads 'mean', or 'kv'"):
    va.verify_attention(q, k, v, lengths, interpret=True, score_kind="weights", score_heads="q")


@pytest.mark.parametrize("kw, message", [
    (dict(), "the STS budget (keys each target head reads per round, besides the new tokens) must "
     "be an integer >= 1, got None"),
    (dict(sts_budget=0), "must be an integer >= 1, got 0"),
    (dict(sts_budget=4, sts_block=0), "the STS block (tokens per page) must be an integer >= 1"),
    (dict(sts_budget=4, sts_block=8), "must hold at least one page of 8 tokens"),
    (dict(sts_budget=4, head_map=head_map(HEADS, 8)), "made for budget 8, not 4"),
    (dict(sts_budget=4, head_map=head_map(HEADS[:3], 4)), "an STS head map needs 4 target layers"),
    (dict(sts_budget=4, head_map=head_map(((0, 0),) * 4 * 4, 4, "q")),
     "an STS head map needs 4 target layers of 4"),
    (dict(sts_budget=4, head_map=head_map(tuple(((0, 0),) * 4 for _ in range(4)), 4, "q"),
          backend="interpret"), "only the reference backend collects"),
    (dict(sts_budget=4, tree=(2, 1)), "method 'sts' builds its attention mask from a chain"),
    (dict(sts_budget=4, draft_model=None), "method 'sts' needs a draft model"),
    (dict(sts_budget=4, draft_model=OTHER_TOKENIZER), "they must share a tokenizer"),
])
def test_bad_input_is_a_one_line_error(pair, kw, message):
  target, draft = pair
  with pytest.raises(ValueError) as e:
    Runner(target, **{"method": "sts", "draft_model": draft, **kw})
  assert message in str(e.value) and "\n" not in str(e.value)


def test_served_sts_requests_equal_their_own_runs(pair):
  """Continuous batching refills STS slots (its per-KV-head plan has the batch on axis 1): each
  request's greedy text equals the same runner's text for it alone."""
  target, draft = pair
  runner = Runner(target, method="sts", draft_model=draft, gamma=2, sts_budget=8,
                  cache_dtype=jnp.float32, stop_ids=())
  prompts = [*PROMPTS, PROMPTS[0][:20]]
  max_len, got = 80, {}
  runner.serve(prompts, 2, 10, max_len=max_len, chunk=2, warmup_s=0.0, measure_s=1e9,
               on_finish=lambda req, tokens: got.setdefault(req, tokens.tolist()))
  assert sorted(got) == [0, 1, 2]
  for i, p in enumerate(prompts):
    assert got[i] == runner.generate([p], max_new_tokens=10, max_len=max_len)[0][0]
