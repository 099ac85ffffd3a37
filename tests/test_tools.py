"""The command-line tools' help texts and logging: help says what a tool does and how to run it,
and library logging (orbax's INFO line per array) stays quiet unless --verbosity asks for it."""
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from jaxspec import fetch
from subproc import run_module

BENCHMARKS = ["benchmarks.acceptance", "benchmarks.decode", "benchmarks.kernels",
              "benchmarks.plan_profile", "benchmarks.sweep", "benchmarks.throughput",
              "benchmarks.ssv", "benchmarks.prefill", "benchmarks.draft_quality",
              "benchmarks.repetition"]
INFO_LINE = re.compile(r"^I\d{4} ", re.M)   # absl's INFO prefix, e.g. 'I1123 14:02:11.5 ...'
README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def readme_section(title: str) -> str:
  return README.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_fetch_helpshort_lists_the_demo_models():
  res = run_module("jaxspec.fetch", "--helpshort")
  assert all(name in res.stdout for name in fetch.DEMOS), res.stdout


@pytest.mark.parametrize("module", BENCHMARKS)
def test_benchmark_help_says_how_to_run_it(module):
  text = run_module(module, "--helpshort").stdout
  assert f"python -m {module}" in text
  assert not re.search(r"\bissue \d", text) and "PYTHONPATH" not in text


def test_benchmarks_the_tests_import_share_one_process():
  """The tests import these benchmarks into one pytest worker: their flags must not collide (a
  benchmark whose flags share names with another's defines them only when run as a program)."""
  res = subprocess.run([sys.executable, "-c", "import benchmarks.sts, benchmarks.ssv, "
                        "benchmarks.plan_profile, benchmarks.peer_hf, benchmarks.throughput, "
                        "benchmarks.sparse_eval, benchmarks.workloads, benchmarks.prefill, "
                        "benchmarks.draft_quality"],
                       capture_output=True, text=True, timeout=300)
  assert res.returncode == 0, res.stderr[-2000:]


def test_acceptance_benchmark_logs_quietly(tiny_smollm2_ckpt, tmp_path):
  data = tmp_path / "problems.jsonl"
  data.write_text(json.dumps({"problem": "What is 2 + 3?", "answer": "5"}) + "\n")
  res = run_module("benchmarks.acceptance", f"--model={tiny_smollm2_ckpt}", f"--data={data}",
                   "--num_prompts=1", "--max_new_tokens=4", "--methods=vegas",
                   f"--out={tmp_path / 'out.json'}")
  assert res.returncode == 0, res.stderr[-2000:]
  assert not INFO_LINE.search(res.stderr), res.stderr[:2000]   # orbax logged every array read


def test_verbosity_brings_library_logging_back(tiny_smollm2_ckpt):
  res = run_module("jaxspec.generate", f"--model={tiny_smollm2_ckpt}", "--prompt=hi",
                   "--max_new_tokens=1", "--verbosity=0")
  assert res.returncode == 0, res.stderr[-2000:]
  assert INFO_LINE.search(res.stderr)


def test_quick_start_answers_sensibly(weights_smollm2_ckpt):
  # The README's first command, on the same default model (converted in a temp dir).
  cmd = re.search(r"python -m jaxspec\.generate (.*)", readme_section("Quick start"))[1]
  args = shlex.split(cmd)
  assert not any(a.startswith("--model") for a in args)   # the default model
  res = run_module("jaxspec.generate", *args, f"--model={weights_smollm2_ckpt}")
  assert res.returncode == 0, res.stderr[-2000:]
  assert "def is_palindrome(s):" in res.stdout and "s == s[::-1]" in res.stdout, res.stdout


def test_readme_python_example_stops_at_the_model_s_stop_tokens(weights_smollm2_ckpt):
  code = re.search(r"```python\n(.*?)```", readme_section("Using the decode loops from JAX code"),
                   re.S)[1]
  code = code.replace('load_model("smollm2-135m"', f'load_model("{weights_smollm2_ckpt}"')
  res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
  assert res.returncode == 0, res.stderr[-2000:]
  assert res.stdout.startswith("The capital of France is Paris. {")   # no <|im_end|><|im_start|>


def test_lossless_is_qualified_where_claimed():
  opening = README.split("## ", 1)[0]
  assert "float32" in opening and "bfloat16" in opening
  measured = readme_section("What lossless means here")
  assert re.search(r"\d+(\.\d+)?% of vanilla's tokens came before the first difference", measured)
  help_text = run_module("jaxspec.generate", "--helpshort").stdout
  assert "float32" in help_text and "bfloat16" in help_text


def test_kernels_only_runs_the_cases_it_names(tmp_path):
  """--only keeps a plan's verification cases whose name starts with a prefix it gives (on a CPU
  each timed case records its error row under its name, which is enough to see which ran)."""
  out = tmp_path / "k.json"
  res = run_module("benchmarks.kernels", "--plan=fold", "--shrink=48", "--nocheck",
                   "--only=verify qwen2.5-0.5b B128xL512 T9", f"--out={out}")
  assert res.returncode == 0, res.stderr[-2000:]
  cases = {r["case"] for r in json.loads(out.read_text())["results"]}
  assert cases == {"copy 2 GiB (read+write)", "verify qwen2.5-0.5b B128xL512 T9"}, cases


def test_kernels_layout_plan_reads_equal_rows_three_ways(tmp_path):
  """--plan=layout: per model, the same rows scattered, as aligned blocks of 8 and as 4 indices
  plus a dense tail (on a CPU each case records its error row under its name, and the summary
  names each in full); the blocked index lists are aligned runs of 8 distinct positions below
  the tail, and a count that does not split into blocks is an error."""
  out = tmp_path / "k.json"
  res = run_module("benchmarks.kernels", "--plan=layout", "--shrink=48", "--nocheck",
                   f"--out={out}")
  assert res.returncode == 0, res.stderr[-2000:]
  cases = {r["case"] for r in json.loads(out.read_text())["results"]} - {"copy 2 GiB (read+write)"}
  assert cases == {f"sparse qwen2.5-{m} B128xL512 {rows} T1{tag}" for m in ("0.5b", "1.5b")
                   for rows, tag in (("K40+64", ""), ("K40+64", " blocks of 8"), ("K4+100", ""))}
  table = res.stdout[res.stdout.index("== summary"):]
  assert all(case in table for case in cases), table  # the summary names each case in full
  check = ("import numpy as np; from benchmarks.kernels import sparse_inputs\n"
           "idx, cnt, start = sparse_inputs(3, 512, 2, 40, 64, False, True, block=8)\n"
           "idx = np.asarray(idx); start = int(start[0])\n"
           "assert idx.shape == (3, 40) and (np.asarray(cnt) == 40).all()\n"
           "blocks = idx.reshape(3, 5, 8)\n"
           "assert (blocks[..., 0] % 8 == 0).all() and (np.diff(blocks, axis=-1) == 1).all()\n"
           "assert all(len(set(r)) == 40 for r in idx.tolist()) and idx.max() < start\n"
           "try:\n  sparse_inputs(1, 512, 2, 42, 64, False, True, block=8)\n"
           "except ValueError as e:\n  print(e)\n")
  res = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=300,
                       cwd=Path(__file__).resolve().parents[1])
  assert res.returncode == 0, res.stderr[-2000:]
  assert res.stdout.strip() == "42 indices do not split into blocks of 8"
