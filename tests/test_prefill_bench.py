"""benchmarks.prefill: its FLOP count, the smoke run's rows (the numbers of a CPU run mean
nothing), and its one-line errors; benchmarks.throughput's --prompt_buckets, --score_pool and
--score_block checked alike."""
import json
import subprocess
import sys

import pytest

from benchmarks.prefill import prefill_flops
from benchmarks.common import SHAPES


def test_flops_count_the_layers_causal_attention_and_one_lm_head_row():
  cfg = SHAPES["qwen2.5-coder-1.5b"]
  # Per layer and token: q 1536x1536, k and v 1536x256, o 1536x1536, gate/up/down 3 x 1536x8960.
  per_token = 28 * 2 * (1536 * 1536 * 2 + 1536 * 256 * 2 + 3 * 1536 * 8960)
  pairs = 1000 * 1001 / 2
  assert prefill_flops(cfg, 1000) == (per_token * 1000 + 4 * 128 * 12 * 28 * pairs
                                      + 2 * 1536 * 151936)


def _run(*args, timeout=900):
  return subprocess.run([sys.executable, "-m", "benchmarks.prefill", *args],
                        capture_output=True, text=True, timeout=timeout)


def test_prefill_smoke(tiny_smollm2_ckpt, tmp_path):
  out = tmp_path / "prefill.json"
  res = _run(f"--model={tiny_smollm2_ckpt}", "--prompt_lens=100,300", "--prompt_buckets=1,8",
             "--matmul_n=128", "--reps=1", f"--out={out}")
  assert res.returncode == 0, res.stderr[-2000:]
  payload = json.loads(out.read_text())
  rows = {(r["prompt_buckets"], r["prompt_len"]): r for r in payload["rows"]}
  assert {k: r["padded_len"] for k, r in rows.items()} == {
      (1, 100): 128, (1, 300): 512, (8, 100): 128, (8, 300): 384}
  assert payload["max_len"] == 300 + 1024 and payload["matmul_tflops"] > 0
  for r in rows.values():
    assert "error" not in r and r["ms"] > 0 and r["x_floor"] > 0
    assert r["padded_tflop"] >= r["useful_tflop"] > 0


def test_bad_flags_are_a_one_line_error(tmp_path):
  out = tmp_path / "x.json"
  for args, message in ((["--prompt_buckets=3"], "prompt_buckets must be a power of two"),
                        (["--prompt_lens=0"], "--prompt_lens must be positive"),
                        (["--prompt_lens=100", "--max_len=50"], "--max_len=50 leaves no room")):
    res = _run("--model=random:qwen2.5-coder-0.5b", *args, f"--out={out}", timeout=300)
    assert res.returncode != 0 and message in res.stderr, res.stderr[-1000:]
    assert len(res.stderr.strip().splitlines()) == 1
  assert not out.exists()


@pytest.mark.parametrize("flag, message", [
    ("--prompt_buckets=6",
     "prompt_buckets must be a power of two >= 1 (lengths per octave), got 6"),
    ("--score_pool=0", "--score_pool must be an odd integer >= 1, got 0"),
    ("--score_block=-2", "--score_block must be an integer >= 1, got -2"),
    ("--score_window=-1", "--score_window must be an integer >= 0, got -1"),
])
def test_throughput_refuses_bad_run_settings_before_loading(tmp_path, flag, message):
  out = tmp_path / "x.json"
  res = subprocess.run([sys.executable, "-m", "benchmarks.throughput", flag,
                        "--workload=short", f"--out={out}"], capture_output=True, text=True,
                       timeout=300)
  assert res.returncode != 0 and "Traceback" not in res.stderr, res.stderr[-1000:]
  assert res.stderr.strip().splitlines()[-1] == f"benchmarks.throughput: error: {message}"
  assert not out.exists()
