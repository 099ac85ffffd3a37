"""benchmarks.sts and benchmarks.sparse_eval on a tiny random pair (the numbers mean nothing;
the properties hold for any weights): the captured-mass metric against numpy, the oracle's mass at
least every method's at the same budget, everything captured (and dense perplexity) at a budget
that holds the whole context, the forward pass with queries against the model, Quest over several
query rows, the passkey prompt and scorer, the JSON and PNGs, and one-line errors for bad
flags."""
import json
import re
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import sparse_eval as se
from benchmarks import sts as bench
from jaxspec import pairmap, sts_map
from jaxspec.drafting import pages
from jaxspec.drafting import sts as sts_drafting
from jaxspec.model.attention import Dense, QuestPages, ScoreSpec, attend
from jaxspec.model.kv_cache import KVCache
from jaxspec.model.transformer import init_random
from pallas_kernels.sparse_attention import sparse_attention_reference

GAMMA, K = 4, 16
# The tests run at capacity 128, batch 2, prefills of 5 tokens, chunks of 5 and budget 16, so
# they share compiled pieces (STS's selection alone takes ~13 s of CPU to compile).


@pytest.fixture(scope="module")
def pair():
  t, d = (init_random(c, dtype=jnp.float32, seed=i) for i, c in enumerate(se.TINY))
  return se.Pair(t, d, se.ByteTokenizer(), ("t", "d"), 32768)


@pytest.fixture(scope="module")
def book(pair):
  return se.book_tokens(pair.tokenizer)


def _rows(rng, b, t, h, s, start):
  """Softmax rows: row t at position start + t sees keys [0, start + t]."""
  x = rng.normal(size=(b, t, h, s)) * 2
  seen = np.arange(s) <= (np.asarray(start)[:, None] + np.arange(t))[:, :, None, None]
  w = np.where(seen, np.exp(x), 0.0)
  return (w / w.sum(-1, keepdims=True)).astype(np.float32)


def _mass_reference(w, idx, cnt, tail, start):
  b, t, h, s = w.shape
  out = np.zeros((b, t, h))
  for i in range(b):
    for r in range(t):
      for e in range(h):
        ii, cc = (idx[i, e], cnt[i, e]) if idx.ndim == 3 else (idx[i], cnt[i])
        keys = set(ii[:cc].tolist()) | set(range(tail[i], start[i] + r + 1))
        row = w[i, r, e]
        out[i, r, e] = sum(row[j] for j in keys if j < s) / row.sum()
  return out


@pytest.mark.parametrize("per_head", [True, False])
def test_captured_mass_equals_numpy(per_head):
  rng = np.random.default_rng(0)
  b, t, h, s = 2, 3, 2, 40
  start = np.array([30, 17])
  w = _rows(rng, b, t, h, s, start)
  shape = (b, h, 6) if per_head else (b, 6)
  idx = rng.integers(0, 17, size=shape).astype(np.int32)
  cnt = rng.integers(0, 7, size=shape[:-1]).astype(np.int32)
  tail = np.array([25, 17])
  got = se.captured_mass(jnp.asarray(w), jnp.asarray(idx), jnp.asarray(cnt), jnp.asarray(tail),
                         jnp.asarray(start))
  np.testing.assert_allclose(got, _mass_reference(w, idx, cnt, tail, start), rtol=1e-5)


def test_oracle_captures_at_least_every_method(pair, book):
  """96-token passages, the last 91 read in chunks of 5: at 16 keys the oracle's mass per
  layer is at least every other method's (each reads at most 16 prefix keys per KV head). The
  learned map given here is the proportional one, so sts-map selects what sts selects."""
  windows = pairmap.calibration_windows(book, 2, 96)
  heads = sts_drafting.proportional_heads(4, 2, 2, 2)
  learned = sts_map.HeadMap(heads=heads, budget=K, granularity="kv",
                            target=pairmap.pair_entry(pair.target, "t"),
                            draft=pairmap.pair_entry(pair.draft, "d"))
  mass, ppl = bench.mass_and_perplexity(
      pair, windows, verify_tokens=91, gamma=GAMMA, budgets=[(str(K), K)], names=bench.METHODS,
      maps={K: learned}, evals=("mass",))
  assert ppl == []
  got = {r["method"]: np.asarray(r["per_layer"]) for r in mass}
  assert set(got) == set(bench.METHODS) and all(r["budget"] == K for r in mass)
  for method, per_layer in got.items():
    assert per_layer.shape == (4,) and ((0 < per_layer) & (per_layer < 1)).all(), method
    assert (got["oracle"] >= per_layer - 1e-5).all(), method
  np.testing.assert_array_equal(got["sts"], got["sts-map"])


def test_a_budget_holding_the_context_is_dense(pair, book):
  """25-token passages, the last 20 read in chunks of 5 (starts 5, 10, 15): 16 keys hold every
  prefix, so every method captures all the mass and its perplexity is dense's."""
  windows = pairmap.calibration_windows(book, 2, 25)
  mass, ppl = bench.mass_and_perplexity(
      pair, windows, verify_tokens=20, gamma=GAMMA, budgets=[(str(K), K)],
      names=("oracle", "quest", "streaming", "sts"), maps={}, evals=("mass", "ppl"))
  for r in mass:
    np.testing.assert_allclose(r["per_layer"], 1.0, rtol=1e-5, err_msg=r["method"])
  dense = ppl[0]
  assert [r["method"] for r in ppl] == ["dense", "oracle", "quest", "streaming", "sts"]
  assert dense["kv_reduction"] == 0 and dense["scored_tokens"] == 2 * 3 * (GAMMA + 1)
  for r in ppl[1:]:
    assert r["scored_tokens"] == dense["scored_tokens"]
    assert r["perplexity"] == pytest.approx(dense["perplexity"], rel=1e-5), r["method"]
    assert abs(r["kv_reduction"]) < 1e-9 and abs(r["ppl_increase"]) < 1e-5


def test_forward_with_queries_matches_the_model(pair, book):
  model = pair.target
  cfg = model.cfg
  tok = jnp.asarray(book[None, :8])
  cache = KVCache.create(cfg, 1, 16, jnp.float32)
  pos = jnp.arange(8)[None]
  plan = Dense(scores=ScoreSpec("logits", per_row=True, heads="q"))
  hidden, cache_ref, logits = model(tok, pos, cache, plan)
  h2, cache2, logits2, q = se.forward_with_queries(model, tok, pos, cache, plan, "reference")
  np.testing.assert_allclose(h2, hidden, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(cache2.k[-1], cache_ref.k[-1], rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(logits2, logits, rtol=1e-6, atol=1e-6)
  assert q.shape == (cfg.num_layers, 1, 8, cfg.num_heads, cfg.head_dim)
  g = cfg.num_heads // cfg.num_kv_heads
  for layer in range(cfg.num_layers):   # q.k is the model's logit of each query head
    k = jnp.repeat(cache2.k[layer][:, :8], g, axis=2)
    mine = jnp.einsum("bthd,bshd->bths", q[layer], k)
    causal = jnp.arange(8)[None, :, None, None] >= jnp.arange(8)
    np.testing.assert_allclose(jnp.where(causal, mine, 0),
                               jnp.where(causal, logits[layer][..., :8].astype(jnp.float32), 0),
                               rtol=2e-2, atol=2e-2)


def test_quest_over_several_rows():
  rng = np.random.default_rng(3)
  k = jnp.asarray(rng.normal(size=(1, 64, 2, 8)), jnp.float32)
  v = jnp.asarray(rng.normal(size=k.shape), jnp.float32)
  lo, hi = pages.page_summaries(k)
  q1 = jnp.asarray(rng.normal(size=(1, 1, 4, 8)), jnp.float32)
  tail, want = jnp.asarray([48]), jnp.asarray([2])
  # One row: Quest as it was (quest_scores of the row, then top_pages).
  idx1, cnt1 = pages.quest_select(q1, lo, hi, tail, want, 2)
  ref_idx, ref_cnt = pages.top_pages(pages.quest_scores(q1[:, 0], lo, hi), jnp.asarray([[3]]),
                                     want[:, None], 2)
  np.testing.assert_array_equal(idx1, ref_idx)
  np.testing.assert_array_equal(cnt1, ref_cnt)
  # Two rows share one choice: a page's score is its largest bound over the rows.
  q2 = jnp.asarray(rng.normal(size=(1, 2, 4, 8)), jnp.float32)
  idx2, cnt2 = pages.quest_select(q2, lo, hi, tail, want, 2)
  best = jnp.maximum(pages.quest_scores(q2[:, 0], lo, hi), pages.quest_scores(q2[:, 1], lo, hi))
  ref_idx, _ = pages.top_pages(best, jnp.asarray([[3]]), want[:, None], 2)
  np.testing.assert_array_equal(idx2, ref_idx)
  plan = QuestPages(pages=want, tail_start=tail, page_min=lo, page_max=hi, max_pages=2)
  lengths = jnp.asarray([54])
  out, _ = attend(q2, None, None, k, v, lengths, plan, "reference")
  ref = sparse_attention_reference(q2, k, v, idx2, cnt2, tail, lengths)
  np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("depth", [0.0, 0.37, 0.5, 1.0])
def test_passkey_prompt_hides_the_key_at_the_depth(depth):
  tok = se.ByteTokenizer()
  hay = bench.haystack_tokens(tok, 3000)
  p = bench.passkey_prompt(tok, hay, 2000, depth, 48213)
  assert len(p.tokens) == 2000 and p.key == 48213
  needle = tok.encode(bench.NEEDLE.format(key=48213))
  assert p.tokens[p.needle_at:p.needle_at + p.needle_len] == needle
  assert abs(p.needle_depth - depth) <= 32 / p.haystack
  text = tok.decode(p.tokens)
  assert text.count("48213") == 2 and text.endswith("The pass key is")
  # At a sentence's start within 32 tokens before the depth, else at the depth itself.
  before = tok.decode(p.tokens[:p.needle_at]).rstrip(" ")
  assert (p.needle_at in (p.head, p.head + round(depth * p.haystack))
          or before.endswith((".", "!", "?", "\n")))
  with pytest.raises(ValueError, match="no room"):
    bench.passkey_prompt(tok, hay, 100, depth, 48213)


def test_passkey_scorer():
  assert bench.parse_passkey(" 48213. Remember it.") == 48213
  assert bench.parse_passkey("The key: 482 13") == 482
  assert bench.parse_passkey("no digits") is None
  assert bench.passkey_correct(" 48213", 48213)
  assert not bench.passkey_correct(" 4821", 48213)
  assert not bench.passkey_correct("", 48213)


FLAGS = dict(methods=["sts"], evals=["mass", "ppl"], budgets=["32"], context="1K",
             passkey_contexts=["2K"], gamma=4, passages=1, verify_tokens=64, answer_tokens=8,
             passkey_depths=["0.5"], seed=0)


@pytest.mark.parametrize("change, message", [
    (dict(budgets=["8"]), "integer >= 16"), (dict(budgets=["1%"]), "less than one Quest page"),
    (dict(budgets=["abc"]), "key counts"), (dict(methods=["h2o"]), "unknown --methods h2o"),
    (dict(evals=["speed"]), "--evals"), (dict(context="16Q"), "--context"),
    (dict(verify_tokens=5), "--verify_tokens"), (dict(passkey_depths=["1.5"]), "[0, 1]"),
    (dict(gamma=0), "--gamma")])
def test_bad_flags_are_one_line_errors(change, message):
  with pytest.raises(ValueError, match=re.escape(message)) as e:
    bench.parse_flags(dict(FLAGS, **change))
  assert "\n" not in str(e.value)


def test_default_flags_parse():
  from absl import flags
  fv = flags.FlagValues()
  bench.define_flags(fv)
  v = bench.parse_flags({k: fv[k].default for k in bench.FLAG_NAMES})
  assert v["context"] == 16384 and v["passkey_contexts"] == [10240, 28672]
  assert [k for _, k in bench.distinct_budgets(v["budgets"], v["context"])] == [256, 512, 1638]


def test_bad_flag_on_the_command_line_is_one_line():
  bad = subprocess.run([sys.executable, "-m", "benchmarks.sts", "--random", "--budgets=8"],
                       capture_output=True, text=True, timeout=120)
  assert bad.returncode == 1 and bad.stderr.strip().count("\n") == 0, bad.stderr
  assert bad.stderr.startswith("benchmarks.sts: error: a --budgets count")


def test_results_json_and_pngs(pair, tmp_path):
  v = bench.parse_flags(dict(FLAGS, methods=["streaming"], evals=list(bench.EVALS),
                             budgets=[str(K)], context="96", verify_tokens=91, passages=2,
                             passkey_contexts=["320"], answer_tokens=2))
  out = tmp_path / "sts.json"
  bench.evaluate(pair, v, ["streaming"], {}, str(out))
  data = json.loads(out.read_text())
  assert set(data) == {"settings", "mass", "perplexity", "passkey"}
  assert {"target", "draft", "budgets", "context", "gamma", "commit", "device",
          "passkey_contexts"} <= set(data["settings"])
  assert [(r["method"], r["budget"]) for r in data["mass"]] == [("streaming", K)]
  assert set(data["mass"][0]) == {"method", "budget", "budget_spec", "per_layer", "mean"}
  assert [r["method"] for r in data["perplexity"]] == ["dense", "streaming"]
  assert {"perplexity", "ppl_increase", "kv_reduction", "scored_tokens"} <= set(
      data["perplexity"][1])
  assert [(r["method"], r["context"]) for r in data["passkey"]] == [("dense", 320),
                                                                   ("streaming", 320)]
  assert set(data["passkey"][0]["answers"][0]) == {"depth", "needle_depth", "passkey", "answer",
                                                   "correct"}
  for suffix in ("mass", "ppl", "passkey"):
    assert (tmp_path / f"sts_{suffix}.png").stat().st_size > 0
