"""The command-line tools' help texts and logging: help says what a tool does and how to run it,
and library logging (orbax's INFO line per array) stays quiet unless --verbosity asks for it."""
import json
import re

import pytest

from jaxspec import fetch
from subproc import run_module

BENCHMARKS = ["benchmarks.acceptance", "benchmarks.decode", "benchmarks.kernels",
              "benchmarks.sweep", "benchmarks.throughput"]
INFO_LINE = re.compile(r"^I\d{4} ", re.M)   # absl's INFO prefix, e.g. 'I1123 14:02:11.5 ...'


def test_fetch_helpshort_lists_the_demo_models():
  res = run_module("jaxspec.fetch", "--helpshort")
  assert all(name in res.stdout for name in fetch.DEMOS), res.stdout


@pytest.mark.parametrize("module", BENCHMARKS)
def test_benchmark_help_says_how_to_run_it(module):
  text = run_module(module, "--helpshort").stdout
  assert f"python -m {module}" in text
  assert not re.search(r"\bissue \d", text) and "PYTHONPATH" not in text


def test_acceptance_benchmark_logs_quietly(weights_smollm2_ckpt, tmp_path):
  data = tmp_path / "problems.jsonl"
  data.write_text(json.dumps({"problem": "What is 2 + 3?", "answer": "5"}) + "\n")
  res = run_module("benchmarks.acceptance", f"--model={weights_smollm2_ckpt}", f"--data={data}",
                   "--num_prompts=1", "--max_new_tokens=4", "--methods=vegas",
                   f"--out={tmp_path / 'out.json'}")
  assert res.returncode == 0, res.stderr[-2000:]
  assert not INFO_LINE.search(res.stderr), res.stderr[:2000]   # orbax logged every array read


def test_verbosity_brings_library_logging_back(weights_smollm2_ckpt):
  res = run_module("jaxspec.generate", f"--model={weights_smollm2_ckpt}", "--prompt=hi",
                   "--max_new_tokens=1", "--verbosity=0")
  assert res.returncode == 0, res.stderr[-2000:]
  assert INFO_LINE.search(res.stderr)
