"""benchmarks.ssv: the overlap metrics on hand-built selections, the flags' one-line errors, and
one smoke run on the tiny random NSA model (its numbers mean nothing)."""
import json
import re
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import ssv as bench
from jaxspec.model.config import NSAConfig

CFG = NSAConfig(compress_block=4, compress_stride=4, select_block=4, num_selected=4, window=8)


def test_overlap_metrics_on_hand_built_selections():
  """Rows at positions 40-43 (local blocks 9 and 10 for all): two layers, one KV head."""
  layer0 = [[0, 3, 9, 10], [0, 3, 9, 10], [0, 5, 9, 10], [0, 6, 9, 10]]
  layer1 = [[0, 3, 9, 10], [0, 4, 9, 10], [0, 5, 9, 10], [0, 7, 9, 10]]
  indices = np.asarray([layer0, layer1])[:, :, None, :]           # [L=2, T=4, Hkv=1, n=4]
  stats = bench.overlap_stats(indices, np.arange(40, 44), CFG, (2, 4))
  np.testing.assert_allclose(stats["adjacent"], [(4 + 3 + 3) / 12, 3 / 4])
  np.testing.assert_allclose(stats["scored"], [1 / 3, 0.0])      # block 3 kept once, in layer 0
  np.testing.assert_allclose(stats["union_2"], [(4 + 5) / 2 / 4, (5 + 5) / 2 / 4])
  np.testing.assert_allclose(stats["union_4"], [6 / 4, 7 / 4])
  assert np.isnan(stats["layers"][0])
  np.testing.assert_allclose(stats["layers"][1], (4 + 3 + 4 + 3) / 16)


def test_padding_counts_as_no_block():
  member = bench.block_sets(np.asarray([[0, 2, -1, -1]]))
  np.testing.assert_array_equal(member, [[True, False, True]])


def test_synthetic_selections_share_exactly_the_asked_overlap():
  cfg = bench.KERNEL_NSA
  positions = np.arange(4090, 4106)                                # crosses a block boundary
  for overlap in (3, 9, 15):
    idx = bench.synthetic_indices(np.random.default_rng(overlap), positions, 2, overlap, cfg)
    assert idx.shape == (16, 2, cfg.num_selected)
    for h in range(2):
      for t, p in enumerate(positions):
        row = idx[t, h]
        cur = p // cfg.select_block
        assert (np.diff(row) > 0).all() and row[-1] == cur and {0, cur - 1} <= set(row)
        if t:
          assert len(set(row) & set(idx[t - 1, h])) == overlap


def test_read_bytes_count_shared_blocks_once():
  cfg = bench.KERNEL_NSA
  idx = bench.synthetic_indices(np.random.default_rng(0), np.arange(4096, 4104), 1, 15, cfg)
  args = ((4, 1, 16), cfg, 2)
  alone, merged = bench.read_bytes(idx, 1, False, *args), bench.read_bytes(idx, 4, False, *args)
  block = 2 * cfg.select_block * 16 * 2                            # one block's K and V
  assert alone - merged == (8 * 16 - 2 * 19) * block + (8 * 512 - 2 * 515) * 2 * 16 * 2
  assert bench.read_bytes(idx, 4, True, *args) < merged


FLAGS = dict(evals=["overlap"], contexts=["1K"], passages=1, rows=16, groups=["2", "4"],
             kernel_rows=["8"], kernel_overlaps=["3"], kernel_context="4K", kernel_shape="4/2/16",
             kernel_batch=1, kernel_splits=["auto"], copy_bytes=1 << 20,
             verify_contexts=["16K"], verify_rows=["8"], verify_group=4, verify_batch=1,
             verify_acceptance=["0.8"], verify_reps=5, verify_profile=False)


@pytest.mark.parametrize("change, message", [
    (dict(evals=["speed"]), "--evals"), (dict(contexts=["8Q"]), "--contexts"),
    (dict(contexts=["16"]), "exceed --rows"), (dict(rows=1), "--rows"),
    (dict(groups=["32"]), "--groups"), (dict(passages=0), "--passages"),
    (dict(kernel_overlaps=["16"]), "--kernel_overlaps"), (dict(kernel_rows=["1"]), "--kernel_rows"),
    (dict(kernel_shape="6/4/16"), "--kernel_shape"), (dict(kernel_context="1K"), "at least 2304"),
    (dict(copy_bytes=10), "--copy_bytes"), (dict(kernel_batch=0), "--kernel_batch"),
    (dict(kernel_splits=["0"]), "--kernel_splits"), (dict(kernel_splits=[]), "--kernel_splits"),
    (dict(verify_rows=["1"]), "--verify_rows"), (dict(verify_contexts=["x"]), "--verify_contexts"),
    (dict(verify_group=16), "--verify_group"), (dict(verify_group=1), "--verify_group"),
    (dict(verify_batch=0), "--verify_batch"), (dict(verify_acceptance=["1"]), "--verify_acceptance"),
    (dict(verify_acceptance=["high"]), "--verify_acceptance")])
def test_bad_flags_are_one_line_errors(change, message):
  with pytest.raises(ValueError, match=re.escape(message)) as e:
    bench.parse_flags(dict(FLAGS, **change))
  assert "\n" not in str(e.value)


def test_smoke_run_writes_json_and_pngs(tmp_path):
  out = tmp_path / "ssv.json"
  res = subprocess.run([sys.executable, "-m", "benchmarks.ssv", "--random", "--evals=overlap",
                        "--contexts=256", "--passages=1", "--rows=8", "--groups=2,4",
                        "--dtype=float32", f"--out={out}"], capture_output=True, text=True,
                       timeout=600)
  assert res.returncode == 0, res.stderr[-2000:]
  data = json.loads(out.read_text())
  (row,) = data["overlap"]
  assert row["context"] == 256 and row["rows"] == 8
  assert set(row["per_layer"]) == {"adjacent", "scored", "union_2", "union_4", "layers"}
  assert len(row["per_layer"]["adjacent"]) == bench.TINY.num_layers
  assert all(0 <= x <= 1 for x in row["per_layer"]["adjacent"])
  assert all(1 <= x <= 4 for x in row["per_layer"]["union_4"])   # n <= union <= G * n
  assert data["settings"]["model"] == "random tiny NSA model"
  assert all((tmp_path / p.split("/")[-1]).is_file() for p in data["pngs"])


def test_kernel_smoke_run(tmp_path):
  """The kernel evaluation in interpret mode (the times mean nothing), two sequences: every
  schedule's row."""
  out = tmp_path / "k.json"
  res = subprocess.run([sys.executable, "-m", "benchmarks.ssv", "--evals=kernel",
                        "--kernel_rows=4", "--kernel_overlaps=3,14", "--kernel_context=2304",
                        "--kernel_shape=4/2/16", "--kernel_batch=2", "--groups=2,4",
                        "--kernel_splits=auto,2",
                        "--copy_bytes=1048576", "--dtype=float32", f"--out={out}"],
                       capture_output=True, text=True, timeout=600)
  assert res.returncode == 0, res.stderr[-2000:]
  data = json.loads(out.read_text())["kernel"]
  assert data["interpret"] and data["batch"] == 2
  assert [(r["overlap"], r["splits"]) for r in data["rows"]] == [(3, "auto"), (3, 2), (14, "auto"),
                                                                 (14, 2)]
  row = data["rows"][2]
  assert {"per_query", "merged_2", "shared_2", "merged_4", "shared_4", "routing",
          "routing_one_launch", "routing_without_importance", "top_n"} <= set(row)
  assert row["merged_4"]["bytes"] < row["merged_2"]["bytes"] < row["per_query"]["bytes"]
  # auto: about DEFAULT_PROGRAMS programs (2 sequences x 2 KV heads x groups x 2 branches), at
  # most n = 16 shares; the explicit setting as given.
  assert [row[k]["splits"] for k in ("per_query", "merged_2", "merged_4")] == [16, 16, 16]
  assert data["rows"][3]["merged_4"]["splits"] == 2
  assert (tmp_path / "k_kernel.png").is_file()


def test_accepted_per_round_is_the_expected_tokens_of_a_chain():
  """1 + a + ... + a^(T-1): simulated rounds of T rows (T - 1 drafts, each accepted with
  probability a until the first rejection, plus the verifier's token) agree."""
  rng = np.random.default_rng(0)
  for a, t in ((0.6, 2), (0.8, 8), (0.9, 16)):
    accepted = (rng.random((200_000, t - 1)) < a).cumprod(axis=1).sum(axis=1) + 1
    assert bench.accepted_per_round(a, t) == pytest.approx(sum(a ** i for i in range(t)))
    assert accepted.mean() == pytest.approx(bench.accepted_per_round(a, t), rel=0.01)


def test_verify_smoke_run(tmp_path):
  """The verification stage on the tiny random NSA model through the reference attention (times
  mean nothing): every schedule's row, and the speedups follow from the times as documented."""
  out = tmp_path / "v.json"
  res = subprocess.run([sys.executable, "-m", "benchmarks.ssv", "--random", "--evals=verify",
                        "--verify_contexts=300", "--verify_rows=4", "--verify_group=2",
                        "--verify_acceptance=0.5,0.9", "--verify_reps=1", "--dtype=float32",
                        f"--out={out}"], capture_output=True, text=True, timeout=600)
  assert res.returncode == 0, res.stderr[-2000:]
  whole = json.loads(out.read_text())
  assert "partial" not in whole          # the last write is the whole run's
  data = whole["verify"]
  assert data["backend"] == "reference" and data["model"]["num_layers"] == bench.TINY.num_layers
  (row,) = data["rows"]
  assert (row["context"], row["rows"], row["batch"]) == (300, 4, 1)
  names = [n for n, _, _ in bench.verify_schedules(4, 2, bench.TINY.num_layers)]
  assert names == ["per_query", "merged_2", "shared_2", "reuse", "shared_2_reuse"]
  assert [row[n]["lossless"] for n in names] == [True, True, False, False, False]
  assert row["per_query"]["over_per_query"] == 1.0
  for n in names:
    x = row[n]
    for a in ("0.5", "0.9"):
      e = bench.accepted_per_round(float(a), 4)
      assert x["speedup_over_ar"][a] == pytest.approx(e * row["ar_us"] / x["us"], rel=0.01)
      budget = max(0.0, e * row["ar_us"] - x["us"]) / 3
      assert x["draft_budget_us"][a] == pytest.approx(budget, rel=0.01, abs=0.2)
  assert 0 <= row["overlap"]["adjacent"] <= 1 and 1 <= row["overlap"]["union_2"] <= 2
  assert (tmp_path / "v_verify.png").is_file()


def test_verify_hands_each_row_over_as_it_is_measured(monkeypatch):
  """on_row gets the result so far after every row (what the program writes as a partial JSON),
  each time one row longer, the last equal to the returned result. One schedule, to compile
  little."""
  from jaxspec.model.attention import NSA
  from jaxspec.model.transformer import init_random
  monkeypatch.setattr(bench, "verify_schedules", lambda t, g, n: [("per_query", NSA(), True)])
  v = bench.parse_flags(dict(FLAGS, evals=["verify"], verify_contexts=["200", "300"],
                             verify_rows=["4"], verify_group=2, verify_reps=1))
  seen = []
  result = bench.verify_eval(v, init_random(bench.TINY, dtype=jnp.float32), jnp.float32,
                             "reference", on_row=seen.append)
  assert [len(x["rows"]) for x in seen] == [1, 2]
  assert [r["context"] for r in seen[-1]["rows"]] == [200, 300]
  assert seen[-1] == result


def test_a_missing_model_is_a_one_line_error(tmp_path):
  res = subprocess.run([sys.executable, "-m", "benchmarks.ssv", "--model=/nonexistent",
                        f"--out={tmp_path / 'x.json'}"], capture_output=True, text=True,
                       timeout=300)
  assert res.returncode == 1 and res.stderr.strip().count("\n") == 0, res.stderr
  assert res.stderr.startswith("benchmarks.ssv: error: /nonexistent")
  assert not (tmp_path / "x.json").exists()


def test_time_chain_traces_n_calls_into_one_program_rotating_the_inputs():
  """`benchmarks.common.time_chain`, the kernel evaluation's timer on a GPU: the n calls are
  traced into one jitted program (one dispatch for all of them), call i reads arg set
  i % len(sets) (so inputs that fit in L2 are not timed from it), and it reports seconds per
  call."""
  from benchmarks.common import time_chain
  traced = []

  def fn(q, scale):
    traced.append(q.shape)
    return q * scale

  sets = [(jnp.ones(4), 2.0), (jnp.ones(5), 3.0)]
  seconds = time_chain(fn, sets, n=3, batch_seconds=1e-3, batches=1)
  assert traced == [(4,), (5,), (4,)]
  assert 0 < seconds < 1
