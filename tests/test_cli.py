"""`python -m jaxspec.generate` end to end on the real SmolLM2 GGUF, and its error messages."""
import subprocess
import sys

import pytest


def run_cli(*args, timeout=600):
  return subprocess.run([sys.executable, "-m", "jaxspec.generate", *args], capture_output=True,
                        text=True, timeout=timeout)


def test_greedy_generation_prints_text_and_stats(weights_smollm2_gguf):
  res = run_cli(f"--model={weights_smollm2_gguf}", "--chat", "--dtype=float32",
                "--max_new_tokens=12", "--prompt=What is the capital of France?")
  assert res.returncode == 0, res.stderr[-2000:]
  assert "Paris" in res.stdout
  stats = [line for line in res.stderr.splitlines() if line.startswith("[jaxspec]")]
  assert len(stats) == 1 and "new tokens" in stats[0] and "tok/s" in stats[0]


def test_batch_from_prompt_file(weights_smollm2_gguf, tmp_path):
  prompts = tmp_path / "prompts.txt"
  prompts.write_text("The capital of France is\n\nOne, two, three,\n")
  res = run_cli(f"--model={weights_smollm2_gguf}", f"--prompt_file={prompts}",
                "--max_new_tokens=6", "--temperature=0.7", "--top_k=20", "--seed=3")
  assert res.returncode == 0, res.stderr[-2000:]
  assert res.stdout.count("=== [") == 2   # blank lines are skipped: two prompts, two completions


@pytest.mark.parametrize("args, message", [
    (["--prompt=hi", "--max_len=1"], "does not fit max_len=1"),
    (["--prompt=hi", "--top_p=0"], "top_p must be in (0, 1]"),
    (["--prompt=hi", "--temperature=-1"], "temperature must be >= 0"),
    (["--prompt=hi", "--method=vegas", "--gamma=0"], "gamma"),
    (["--prompt=hi", "--method=vegas", "--sparsity=1.5"], "sparsity ratio must be in (0, 1]"),
    (["--max_new_tokens=3"], "give exactly one of --prompt or --prompt_file"),
])
def test_bad_input_gives_a_one_line_error(weights_smollm2_gguf, args, message):
  res = run_cli(f"--model={weights_smollm2_gguf}", *args)
  assert res.returncode != 0
  assert message in res.stderr.strip().splitlines()[-1]


def test_missing_model_is_named(tmp_path):
  res = run_cli(f"--model={tmp_path / 'nope'}", "--prompt=hi")
  assert res.returncode != 0
  assert "nope" in res.stderr and "no such checkpoint" in res.stderr


@pytest.mark.parametrize("args, message", [
    (["--method=draft"], "--method=draft needs --draft_model"),
    (["--method=vegas", "--draft_model=smollm2-135m"], "--draft_model is only for --method=draft"),
])
def test_draft_model_flags_go_together(tmp_path, args, message):
  res = run_cli(f"--model={tmp_path / 'never-loaded'}", "--prompt=hi", *args)
  assert res.returncode != 0
  assert message in res.stderr.strip().splitlines()[-1]
