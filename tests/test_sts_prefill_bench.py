"""benchmarks.sts_prefill on the tiny random pair (a smoke run: the numbers mean nothing)."""
import json
import subprocess
import sys


def test_sts_prefill_benchmark_smoke(tmp_path):
  out = tmp_path / "sts_prefill.json"
  res = subprocess.run([sys.executable, "-m", "benchmarks.sts_prefill", "--tiny",
                        "--contexts=96", "--turns=16", "--batches=2", "--chunks=1,4", "--reps=1",
                        "--rounds=2", f"--out={out}"], capture_output=True, text=True, timeout=600)
  assert res.returncode == 0, res.stderr[-2000:]
  written = json.loads(out.read_text())
  assert written["complete"] is True
  rows = written["results"]
  assert [(r["context"], r["turn"], r["batch"], r["chunk"]) for r in rows] == [
      (96, 16, 2, 1), (96, 16, 2, 4)]
  for r in rows:
    assert r["budget"] == 9 and min(r["extend_ms"], r["round_ms"], r["full_prefill_ms"]) > 0
    assert abs(r["extend_rounds"] - r["extend_ms"] / r["round_ms"]) < 1e-9
    assert abs(r["dense_turn_ms"] - (r["full_prefill_ms"] - r["context_prefill_ms"])) < 1e-9


def test_bad_budget_is_a_one_line_error(tmp_path):
  res = subprocess.run([sys.executable, "-m", "benchmarks.sts_prefill", "--tiny", "--budget=2",
                        f"--out={tmp_path / 'x.json'}"], capture_output=True, text=True,
                       timeout=300)
  assert res.returncode != 0 and "--budget is a share of the context" in res.stderr
  assert not (tmp_path / "x.json").exists()
