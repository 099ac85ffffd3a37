"""Ctrl-C and SIGTERM during fetch and generate: exit 128 + signal, one line, no traceback, nothing
half-written left behind (convert's own interrupt tests are in test_weights.py, on a tiny model).

The signal is sent by the program itself at a named phase (`jaxspec.cli.interrupt_point`, driven by
$JAXSPEC_TEST_SIGNAL), so each test hits its phase exactly instead of by timing.
"""
from subproc import assert_clean_exit, run_module


def test_fetch_terminated_while_converting_leaves_nothing(weights_smollm2_gguf, tmp_path):
  res = run_module("jaxspec.fetch", "smollm2-135m", f"--out_dir={tmp_path / 'ckpts'}",
                   signal_at="checkpoint-write:TERM",
                   env={"JAXSPEC_CACHE": str(weights_smollm2_gguf.parent)})
  assert_clean_exit(res, 143, "jaxspec.fetch: terminated")
  assert list((tmp_path / "ckpts").iterdir()) == []
  assert weights_smollm2_gguf.is_file()   # the verified download stays cached


def test_generate_interrupted_keeps_the_text_printed_so_far(weights_smollm2_ckpt):
  res = run_module("jaxspec.generate", f"--model={weights_smollm2_ckpt}", "--chat",
                   "--prompt=What is the capital of France?", "--max_new_tokens=32",
                   signal_at="streamed")
  assert_clean_exit(res, 130, "jaxspec.generate: interrupted")
  assert res.stdout.strip() and res.stdout.endswith("\n")   # the streamed line, closed
  assert "[jaxspec]" not in res.stderr                       # no stats for an interrupted run
