"""Running a jaxspec CLI in a subprocess, optionally interrupted at a named phase."""
import contextlib
import json
import os
import signal
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
  with _signals_not_ignored() if signal_at else contextlib.nullcontext():
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@contextlib.contextmanager
def _signals_not_ignored():
  """A child inherits an ignored SIGINT (a test run started in the background by a
  non-interactive shell has one), and Python then leaves it ignored, so the signal a test sends
  would do nothing: un-ignore SIGINT and SIGTERM while the child runs."""
  ignored = [s for s in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(s) == signal.SIG_IGN]
  for s in ignored:
    signal.signal(s, signal.SIG_DFL)   # a caught handler would be reset at exec anyway
  try:
    yield
  finally:
    for s in ignored:
      signal.signal(s, signal.SIG_IGN)


def assert_clean_exit(res: subprocess.CompletedProcess, code: int, last_line: str) -> None:
  """Exit status `code`, no traceback, and `last_line` as the last line on stderr."""
  assert res.returncode == code, res.stderr[-3000:]
  assert "Traceback" not in res.stderr and "Error" not in res.stderr, res.stderr[-3000:]
  assert res.stderr.strip().splitlines()[-1] == last_line, res.stderr[-3000:]


def two_devices_env() -> dict[str, str]:
  """The environment of a process that sees two CPU devices: XLA reads the flag when jax is first
  imported, so a test process that has imported jax already runs such checks in a subprocess."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  return {"XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} "
                       "--xla_force_host_platform_device_count=2",
          "JAX_PLATFORMS": "cpu",
          "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}


def run_worker(script: str, out_dir: str, timeout: float = 900) -> dict:
  """`python script out_dir` on two CPU devices; the JSON report it writes to out_dir/report.json
  (the test fails with the worker's stderr if it fails)."""
  res = subprocess.run([sys.executable, script, str(out_dir)], capture_output=True, text=True,
                       timeout=timeout, env={**os.environ, **two_devices_env()})
  assert res.returncode == 0, res.stderr[-5000:]
  with open(os.path.join(out_dir, "report.json")) as f:
    return json.load(f)


_FORKED = r"""
import importlib, json, os, runpy, sys, tempfile
spec = json.load(sys.stdin)
for name in spec["preload"]:
  importlib.import_module(name)
results = []
for args in spec["cases"]:
  with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
      os.dup2(out.fileno(), 1); os.dup2(err.fileno(), 2)
      code = 0
      try:
        sys.argv = ["-m", *args]
        runpy.run_module(spec["module"], run_name="__main__", alter_sys=True)
      except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (e.code is not None)
        if not isinstance(e.code, (int, type(None))):
          print(e.code, file=sys.stderr)
      except BaseException:
        import traceback; traceback.print_exc(); code = 1
      sys.stdout.flush(); sys.stderr.flush()
      os._exit(code)
    _, status = os.waitpid(pid, 0)
    out.seek(0); err.seek(0)
    results.append([os.waitstatus_to_exitcode(status), out.read().decode(), err.read().decode()])
print(json.dumps(results))
"""


def run_module_cases(module: str, cases: list[list[str]], preload: tuple[str, ...],
                     timeout: float = 600) -> list[subprocess.CompletedProcess]:
  """`python -m module *args` for each args in `cases`, each in a process of its own, forked from
  one Python that has imported `preload` (the module's dependencies, not the module) first: a
  flag check costs a fork instead of a second of imports. Not for runs that need a clean
  process's stderr (import-time warnings go to the parent's) or start threads before forking."""
  res = subprocess.run([sys.executable, "-c", _FORKED], capture_output=True, text=True,
                       timeout=timeout, input=json.dumps(dict(module=module, cases=cases,
                                                              preload=preload)))
  assert res.returncode == 0, res.stderr[-5000:]
  return [subprocess.CompletedProcess([sys.executable, "-m", module, *args], code, out, err)
          for args, (code, out, err) in zip(cases, json.loads(res.stdout.splitlines()[-1]))]
