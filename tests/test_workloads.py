"""Honest benchmark workloads (`benchmarks.workloads`, `benchmarks.common`,
`benchmarks.throughput`): the repetition measure, plain-text continuation prompts, clear errors
for passages that do not fit their book, and --ignore_eos marked in labels, JSON and plot titles
while EOS is honoured by default (an end-to-end throughput run on a tiny random model with the
real Qwen3 tokenizer)."""
import json
from pathlib import Path

import jax.numpy as jnp
import pytest

from benchmarks import workloads
from benchmarks.common import (distinct_ngram_share, eos_label, eos_settings, error_text,
                               matched_repetition, paired_repetition, paired_rows,
                               repetition_summary)

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
QWEN3_DIR = SHARED / "models" / "qwen3-0.6b-tokenizer"
CHAT_MARKERS = ("<|im_start|>", "<|im_end|>", "user\n", "assistant")


@pytest.fixture(scope="module")
def tokenizer():
  from jaxspec.io.weights import hf as hf_weights
  return hf_weights.load_tokenizer(QWEN3_DIR)


@pytest.fixture(scope="module")
def book(tokenizer):
  text = (SHARED / "data" / "frankenstein.txt").read_text(encoding="utf-8-sig")
  return text, len(tokenizer.encode(text, add_special_tokens=False))


# -- the repetition measure ----------------------------------------------------------------------

def test_distinct_ngram_share_values():
  assert distinct_ngram_share(list(range(10))) == 1.0               # 7 4-grams, all different
  assert distinct_ngram_share([5, 5, 5, 5, 5, 5, 5]) == 1 / 4       # 4 4-grams, one distinct
  # A 3-token loop of length L has 3 distinct 4-grams among L - 3: degenerate text scores low.
  loop = [1, 2, 3] * 20
  assert distinct_ngram_share(loop) == pytest.approx(3 / 57)
  # One repeated 4-gram among 5: [1 2 3 4] occurs at 0 and 4.
  assert distinct_ngram_share([1, 2, 3, 4, 1, 2, 3, 4]) == pytest.approx(4 / 5)
  assert distinct_ngram_share([1, 2, 1, 2], n=2) == pytest.approx(2 / 3)
  assert distinct_ngram_share((7, 8, 9, 10)) == 1.0                 # exactly n tokens: one n-gram


def test_distinct_ngram_share_short_outputs_have_none():
  """Fewer than n tokens: no n-gram, so None (averages skip it), never a perfect 1.0."""
  assert distinct_ngram_share([]) is None
  assert distinct_ngram_share([3, 3, 3]) is None
  assert distinct_ngram_share([3, 3], n=2) == 1.0
  with pytest.raises(ValueError, match="n must be at least 1"):
    distinct_ngram_share([1, 2, 3], n=0)


def test_repetition_summary():
  outputs = {2: [1, 2, 3] * 4 + [99], 0: list(range(8)), 1: [4, 99]}
  s = repetition_summary(outputs, stop_ids=(99,))
  loop = distinct_ngram_share([1, 2, 3] * 4 + [99])
  assert loop == pytest.approx(4 / 10)
  assert s["distinct_4gram_share_mean"] == pytest.approx((1.0 + loop) / 2)   # request 1 too short
  assert s["distinct_4gram_share_min"] == pytest.approx(loop)
  assert s["repetition_requests"] == 2
  assert s["stopped_share"] == pytest.approx(2 / 3)
  assert s["mean_new_tokens"] == pytest.approx((13 + 8 + 2) / 3)
  assert s["per_request"] == [[0, 8, 1.0, False], [1, 2, None, True], [2, 13, 0.4, True]]
  empty = repetition_summary({})
  assert empty["distinct_4gram_share_mean"] is None and empty["per_request"] == []


def test_matched_repetition_compares_the_requests_every_row_finished():
  """A row that finished more (and longer, more repetitive) requests is compared with the others
  on the requests all rows finished; outputs too short for a 4-gram and rows without per-request
  figures (a failed method) are left out."""
  slow = repetition_summary({0: list(range(8)), 1: [5, 6, 7, 8, 9], 2: [1, 2]})
  fast = repetition_summary({0: [1, 2, 3, 4] * 2, 1: list(range(6)), 2: list(range(9)),
                             3: [7, 7, 7, 7, 7, 7, 7]})
  failed = {"method": "x", "error": "boom"}
  assert matched_repetition([slow, failed, fast]) == 2                # requests 0 and 1
  assert slow["distinct_4gram_share_matched"] == pytest.approx(1.0)
  assert fast["distinct_4gram_share_matched"] == pytest.approx((4 / 5 + 1.0) / 2)
  assert fast["distinct_4gram_share_mean"] < fast["distinct_4gram_share_matched"]   # request 3
  assert "distinct_4gram_share_matched" not in failed
  apart = [repetition_summary({0: list(range(5))}), repetition_summary({1: list(range(5))})]
  assert matched_repetition(apart) == 0
  assert apart[0]["distinct_4gram_share_matched"] is None


def _row(method: str, shares: dict) -> dict:
  return {"method": method, "label": method,
          "per_request": [[q, 20, s, False] for q, s in sorted(shares.items())]}


def test_paired_repetition_pairs_request_by_request():
  """Differences over the requests both rows finished with a share; the standard error of their
  mean; the exact two-sided Wilcoxon p (six differences of one sign and distinct sizes: 2 / 2**6);
  identical rows give p 1; no overlap or no per-request figures give None."""
  base = _row("none", {0: 0.90, 1: 0.80, 2: 0.70, 3: 0.60, 4: 0.50, 5: 0.40, 6: 0.95})
  faster = _row("vegas:8", {0: 0.91, 1: 0.82, 2: 0.73, 3: 0.64, 4: 0.55, 5: 0.46, 7: 0.2})
  faster["per_request"].append([8, 2, None, True])                 # too short for a 4-gram
  got = paired_repetition(base, faster)
  diffs = [0.01, 0.02, 0.03, 0.04, 0.05, 0.06]
  assert got["requests"] == 6
  assert got["mean_diff"] == pytest.approx(0.035)
  sd = (sum((d - 0.035) ** 2 for d in diffs) / 5) ** 0.5
  assert got["stderr"] == pytest.approx(sd / 6 ** 0.5)
  assert got["wilcoxon_p"] == pytest.approx(2 / 2 ** 6)
  same = paired_repetition(base, _row("vegas:8", {0: 0.90, 1: 0.80}))
  assert same == {"requests": 2, "mean_diff": 0.0, "stderr": 0.0, "wilcoxon_p": 1.0}
  assert paired_repetition(base, _row("x", {9: 0.5})) is None
  assert paired_repetition(base, {"method": "x", "error": "boom"}) is None


def test_repetition_cli_pairs_the_rows_of_a_json(tmp_path):
  """benchmarks.repetition: every row but vanilla's, paired with it; a row without per-request
  figures says so; a file that is not a throughput JSON, or lacks the baseline, is a one-line
  error, as it is for benchmarks.throughput --plot_only (which then draws nothing)."""
  import subprocess
  import sys
  base = _row("none", {0: 0.9, 1: 0.8, 2: 0.7})
  rows = [base, _row("vegas:8", {0: 0.8, 1: 0.9, 2: 0.75}), {"method": "quest", "error": "oom"}]
  got = paired_rows({"rows": rows})
  assert [e["label"] for e in got] == ["vegas:8", "quest"]
  assert got[0]["requests"] == 3 and got[0]["mean_diff"] == pytest.approx(0.05 / 3)
  assert "requests" not in got[1]
  with pytest.raises(ValueError, match="no row of method 'none'"):
    paired_rows({"rows": rows[1:]})
  path = tmp_path / "run.json"
  path.write_text(json.dumps({"rows": rows}))
  out = tmp_path / "paired.json"
  root = Path(__file__).resolve().parents[1]
  res = subprocess.run([sys.executable, "-m", "benchmarks.repetition", str(path), f"--out={out}"],
                       cwd=root, capture_output=True, text=True)
  assert res.returncode == 0, res.stderr
  assert "vegas:8" in res.stdout and "3 requests" in res.stdout and "Wilcoxon p" in res.stdout
  assert "quest" in res.stdout and "no per-request figures" in res.stdout
  assert json.loads(out.read_text())[str(path)][0]["requests"] == 3
  bad = tmp_path / "bad.json"
  bad.write_text(json.dumps({"device": "x"}))
  res = subprocess.run([sys.executable, "-m", "benchmarks.repetition", str(bad)], cwd=root,
                       capture_output=True, text=True)
  assert res.returncode == 1
  assert res.stderr.strip() == \
      f"benchmarks.repetition: error: {bad}: not a throughput JSON: it has no list of 'rows'"
  res = subprocess.run([sys.executable, "-m", "benchmarks.throughput", f"--plot_only={bad}"],
                       cwd=root, capture_output=True, text=True)
  assert res.returncode == 1 and res.stderr.strip() == (
      f"benchmarks.throughput: error: --plot_only={bad}: not a throughput JSON: it has no list "
      "of 'rows'")
  assert not (tmp_path / "bad.png").exists()


def test_summary_table_shows_the_paired_test():
  from benchmarks.throughput import summary_table
  rows = [dict(method="none", label="none", tokens_per_s=100.0, decode_only_tokens_per_s=200.0),
          dict(method="vegas:8", label="vegas:8", gamma=8, tokens_per_s=150.0,
               decode_only_tokens_per_s=500.0, mean_accepted_tokens=6.4,
               distinct_4gram_share_paired=dict(requests=40, mean_diff=0.021, stderr=0.02,
                                                wilcoxon_p=0.5))]
  header, vanilla, vegas = summary_table(rows, ignore_eos=False).splitlines()
  assert header.split()[12:14] == ["paired4", "p"]   # "x none" and "decode tok/s" are two words
  assert vegas.split()[9:11] == ["+0.021", "0.50"] and vanilla.split()[9:11] == ["-", "-"]


# -- prompts ---------------------------------------------------------------------------------------

def test_continuation_prompts_are_plain_book_text(tokenizer, book):
  text, _ = book
  prompts = workloads.continuation_prompts(tokenizer, 6, 40, 90, seed=3)
  assert len(prompts) == 6
  assert all(40 <= len(p) <= 90 for p in prompts)
  assert len({len(p) for p in prompts}) > 1                          # lengths drawn, not fixed
  for p in prompts:
    decoded = tokenizer.decode(p)
    assert not any(m in decoded for m in CHAT_MARKERS)
    # The prompt is a verbatim span of the book, opening at a paragraph.
    start = text.find(decoded)
    assert start >= 0, decoded[:80]
    assert start == 0 or text[start - 2:start] == "\n\n", repr(text[start - 20:start + 20])
  # Same seed, same prompts; another seed, others.
  assert workloads.continuation_prompts(tokenizer, 6, 40, 90, seed=3) == prompts
  assert workloads.continuation_prompts(tokenizer, 6, 40, 90, seed=4) != prompts


def test_long_prompts_ask_a_question_in_the_chat_template(tokenizer):
  prompts = workloads.long_prompts(tokenizer, 2, 100, 140)
  for i, p in enumerate(prompts):
    decoded = tokenizer.decode(p)
    assert decoded.startswith("<|im_start|>user\n")
    assert workloads.LONG_QUESTIONS[i] in decoded


@pytest.mark.parametrize("build", [workloads.long_prompts, workloads.continuation_prompts])
def test_passages_that_do_not_fit_the_book_are_a_clear_error(tokenizer, book, build):
  _, book_tokens = book
  with pytest.raises(ValueError, match=rf"frankenstein.txt holds {book_tokens} tokens .* no room"):
    build(tokenizer, 2, 1000, book_tokens + 100)
  with pytest.raises(ValueError, match="min <= max tokens, got min 300 and max 200"):
    build(tokenizer, 2, 300, 200)
  # The largest passage that fits is accepted (one token of the book left out).
  room = workloads.LONG_ROOM if build is workloads.long_prompts else 0
  assert len(build(tokenizer, 1, book_tokens - 1 + room, book_tokens - 1 + room)) == 1


def test_check_prompt_range():
  workloads.check_prompt_range(1, 1)
  with pytest.raises(ValueError, match="64 < min"):
    workloads.check_prompt_range(64, 100, room=64)
  with pytest.raises(ValueError, match="got min 0 and max 5"):
    workloads.check_prompt_range(0, 5)


# -- EOS: honoured by default, --ignore_eos marked everywhere -------------------------------------

def test_the_longest_prompt_fits_the_model_s_context():
  # Qwen2.5-Coder: 32768 positions, so a 32K passage and 1024 new tokens do not fit.
  assert workloads.prompt_max_tokens(None, 32768, 1024) == 31744
  assert workloads.prompt_max_tokens(None, 131072, 1024) == workloads.PASSAGE_MAX
  assert workloads.prompt_max_tokens(20000, 32768, 1024) == 20000
  with pytest.raises(ValueError, match="32768 plus 1024 new tokens exceed the model's context of "
                                       "32768 tokens \\(at most 31744\\)"):
    workloads.prompt_max_tokens(32768, 32768, 1024)


def test_eos_label_and_settings():
  assert eos_label("vegas:6", True) == "vegas:6 (ignore_eos)"
  assert eos_label("vegas:6", False) == "vegas:6"
  assert eos_settings(True, (2, 7))["ignore_eos"] is True
  assert eos_settings(True, (2, 7))["stop_ids"] == []
  honoured = eos_settings(False, (7, 2))
  assert honoured["ignore_eos"] is False and honoured["stop_ids"] == [7, 2]
  assert honoured["eos"].startswith("honoured")


def test_error_text_says_what_to_change_when_the_gpu_ran_out(monkeypatch):
  plain = error_text(ValueError("bad shape " + "x" * 400))
  assert plain.startswith("ValueError: bad shape") and len(plain) == len("ValueError: ") + 300
  monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
  oom = RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 2.02GiB")
  text = error_text(oom, 500)
  assert text.startswith("out of GPU memory with XLA_PYTHON_CLIENT_MEM_FRACTION unset")
  assert text.endswith("RuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying to allocate "
                       "2.02GiB")
  monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.8")
  assert "XLA_PYTHON_CLIENT_MEM_FRACTION 0.8: raise it" in error_text(oom)
  smem = RuntimeError("RESOURCE_EXHAUSTED: Shared memory size limit exceeded: requested 234496, "
                      "available: 232448")
  assert error_text(smem).startswith("a Pallas kernel's tile does not fit an SM's shared memory")
  assert "MEM_FRACTION" not in error_text(smem)


def test_results_written_before_the_field_read_ignore_eos_from_argv():
  from benchmarks import throughput
  old = dict(workload="long", batch=128, device="NVIDIA H200",
             argv="benchmarks/throughput.py --workload=long --ignore_eos --num_requests=512")
  assert throughput.ignored_eos(old)
  assert "long, B=128, NVIDIA H200 (ignore_eos)" in throughput.plot_title(old)
  assert throughput.row_label(dict(method="vegas:6"), throughput.ignored_eos(old)) == \
      "vegas:6 (ignore_eos)"
  assert not throughput.ignored_eos(dict(old, argv="throughput.py --workload=long"))
  assert not throughput.ignored_eos(dict(old, ignore_eos=False))
  assert "(ignore_eos)" not in throughput.plot_title(dict(old, ignore_eos=False))
  assert throughput.plot_title(old).count("\n") == 1          # no model or draft settings recorded
  new = dict(old, ignore_eos=False, model="/tmp/ckpt/qwen2.5-coder-1.5b/", fp8_drafts=True,
             score_pool=1, score_block=8)
  assert throughput.plot_title(new).split("\n")[1] == \
      "qwen2.5-coder-1.5b, FP8 drafts, score blocks of 8"
  assert throughput.plot_title(dict(new, score="weights")).split("\n")[1] == \
      "qwen2.5-coder-1.5b, FP8 drafts, Collect-2 weights, score blocks of 8"


@pytest.fixture(scope="module")
def tiny_loaded(tokenizer):
  """A tiny random Qwen3 model with the real tokenizer's vocabulary, as `load_model` returns it."""
  from jaxspec.io.loading import LoadedModel
  from jaxspec.model.config import ModelConfig
  from jaxspec.model.transformer import init_random
  cfg = ModelConfig(arch="qwen3", vocab_size=151936, hidden_size=32, intermediate_size=64,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=1000.0,
                    eos_token_ids=(151645,))
  return LoadedModel(cfg=cfg, model=init_random(cfg, dtype=jnp.float32, seed=3),
                     tokenizer=tokenizer, source=Path("tiny"))


MIN_TOKENS, MAX_TOKENS, MAX_NEW, REQUESTS = 40, 56, 12, 3


def run_throughput(tmp_path, monkeypatch, capsys, loaded, **flag_values):
  """benchmarks.throughput's main on the continuation workload, greedy, every request served to
  the end; returns (the JSON, the plot titles it would draw, stdout and stderr)."""
  from absl import flags
  from absl.testing import flagsaver
  from benchmarks import throughput
  from jaxspec.io import loading
  monkeypatch.setattr(loading, "load_model", lambda spec, dtype=None, tp=None: loaded)
  titles = []   # matplotlib is no test dependency: record what the plot would say
  monkeypatch.setattr(throughput, "plot", lambda payload, path: titles.append(
      throughput.plot_title(payload)))
  flags.FLAGS.mark_as_parsed()
  out = tmp_path / "throughput.json"
  settings = dict(workload="continuation", prompt_min_tokens=MIN_TOKENS,
                  prompt_max_tokens=MAX_TOKENS, batch=2, max_new_tokens=MAX_NEW,
                  num_requests=REQUESTS, methods=["none"], gammas=["default=2"], sparsity=0.2,
                  min_tokens=8, warmup_s=0.0, measure_s=1e9, chunk_rounds=["2"], profile=False,
                  stagger=False, temperature=0.0, out=str(out))
  with flagsaver.flagsaver(**{**settings, **flag_values}):
    throughput.main([])
  return json.loads(out.read_text()), titles, capsys.readouterr()


def test_throughput_honours_eos_by_default_and_reports_repetition(tmp_path, monkeypatch, capsys,
                                                                 tokenizer, tiny_loaded):
  import dataclasses
  from jaxspec.engine.runner import Runner
  # Make the 5th greedy token of request 0 an end-of-sequence id: with EOS honoured the request
  # must stop there.
  prompts = workloads.continuation_prompts(tokenizer, REQUESTS, MIN_TOKENS, MAX_TOKENS, seed=0)
  capacity_len = max(map(len, prompts)) + MAX_NEW
  alone, _ = Runner(tiny_loaded.model, stop_ids=()).generate(
      prompts[:1], max_new_tokens=MAX_NEW, max_len=capacity_len)
  stop = alone[0][4]
  cfg = dataclasses.replace(tiny_loaded.cfg, eos_token_ids=(stop,))
  loaded = dataclasses.replace(tiny_loaded, cfg=cfg)
  # Method 'none' only: the rows are built alike for every method, and a speculative method
  # would add ~25 s of compiling on the CPU.
  payload, titles, captured = run_throughput(tmp_path, monkeypatch, capsys, loaded)
  stdout = captured.out
  assert payload["ignore_eos"] is False and payload["eos"].startswith("honoured")
  assert payload["stop_ids"] == sorted({stop, 151645})
  assert payload["sampling"] == dict(temperature=0.0, top_p=0.95, top_k=20, seed=0)
  assert payload["workload"] == "continuation" and payload["max_new_tokens"] == MAX_NEW
  assert MIN_TOKENS <= payload["prompt_tokens"]["min"] <= payload["prompt_tokens"]["max"] \
      <= MAX_TOKENS
  row, = payload["rows"]
  assert "error" not in row, row.get("error")
  assert row["label"] == "none" and "(ignore_eos)" not in titles[0]
  assert [r[0] for r in row["per_request"]] == list(range(REQUESTS))   # every request finished
  first = alone[0].index(stop) + 1
  assert row["per_request"][0][1] == first and row["per_request"][0][3] is True
  assert row["stopped_share"] >= 1 / REQUESTS
  shares = [r[2] for r in row["per_request"] if r[2] is not None]
  assert row["repetition_requests"] == len(shares) == sum(r[1] >= 4 for r in row["per_request"])
  assert shares, row["per_request"]
  assert row["distinct_4gram_share_mean"] == pytest.approx(sum(shares) / len(shares), abs=1e-4)
  assert 0 < row["distinct_4gram_share_min"] <= row["distinct_4gram_share_mean"] <= 1
  # One row: it is matched with itself.
  assert payload["repetition_matched_requests"] == len(shares)
  assert row["distinct_4gram_share_matched"] == pytest.approx(row["distinct_4gram_share_mean"])
  header = next(line for line in stdout.splitlines() if line.startswith("method"))
  assert "acc/round" in header and "distinct4" in header and "matched4" in header
  assert "paired4" in header and "distinct_4gram_share_paired" not in row   # no vanilla to pair
  assert "eos" in header and "ms/refill" in header
  # Two slots, three requests: at most one refill in the window; the run's padding recorded.
  assert payload["prompt_buckets"] == 8 and row["refills"] <= 1
  assert (row["ms_per_refill"] > 0) if row["refills"] else row["ms_per_refill"] is None


def test_throughput_ignore_eos_is_marked(tmp_path, monkeypatch, capsys, tiny_loaded):
  payload, titles, captured = run_throughput(tmp_path, monkeypatch, capsys, tiny_loaded,
                                             ignore_eos=True)
  stdout = captured.out
  assert payload["ignore_eos"] is True and payload["stop_ids"] == []
  assert payload["eos"].startswith("ignored")
  row, = payload["rows"]
  assert row["label"] == "none (ignore_eos)"
  assert [r[1] for r in row["per_request"]] == [MAX_NEW] * REQUESTS     # all ran to the budget
  assert "(ignore_eos)" in titles[0]
  assert any(line.startswith("none (ignore_eos)") for line in stdout.splitlines())
  # Three requests in two slots: the last one decodes beside an empty slot, and the harness says
  # the stream ran out (it biases a row against the methods that finish sooner).
  assert row["idle_slot_share"] > 0.01
  assert "none: the request stream ran out" in captured.err and "--num_requests" in captured.err
