"""Running a jaxspec CLI in a subprocess, optionally interrupted at a named phase."""
import os
import subprocess
import sys

from jaxspec.cli import TEST_SIGNAL_ENV


def run_module(module: str, *args: str, signal_at: str | None = None,
               env: dict[str, str] | None = None,
               timeout: float = 600) -> subprocess.CompletedProcess:
  """`python -m module args...`; signal_at="PHASE[:TERM]" makes it signal itself at that phase
  (`jaxspec.cli.interrupt_point`)."""
  env = {**os.environ, **(env or {})}
  if signal_at:
    env[TEST_SIGNAL_ENV] = signal_at
  return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                        timeout=timeout, env=env)


def assert_clean_exit(res: subprocess.CompletedProcess, code: int, last_line: str) -> None:
  """Exit status `code`, no traceback, and `last_line` as the last line on stderr."""
  assert res.returncode == code, res.stderr[-3000:]
  assert "Traceback" not in res.stderr and "Error" not in res.stderr, res.stderr[-3000:]
  assert res.stderr.strip().splitlines()[-1] == last_line, res.stderr[-3000:]
