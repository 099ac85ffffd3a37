"""What the command-line entry points (generate, convert, fetch, the benchmarks) share.

- `fail(prog, message)`: exit 1 with one line on stderr.
- `run(main, prog)`: absl's `app.run`, but Ctrl-C (SIGINT) or SIGTERM ends the program with one
  line on stderr ("PROG: interrupted" / "PROG: terminated") and exit status 128 + the signal
  number (130 / 143) instead of a traceback. The signal unwinds the stack as a KeyboardInterrupt,
  so every `finally` and `except BaseException` cleanup runs on the way (a half-written
  checkpoint or download is removed), and what was printed to stdout stays.
- `signals_deferred()`: holds SIGINT/SIGTERM over a block that must not be cut in half (orbax's
  threaded checkpoint write) and delivers the signal when the block ends.
- `quiet_logging()`: library logging stays quiet unless `--verbosity` is given (orbax logs every
  array it reads or writes).
- `scoring(kind, pool, block, window)`: the vegas family's --score, --score_pool, --score_block
  and --score_window flags
  as one `jaxspec.drafting.policies.Scoring`, a bad value a one-line ValueError naming its flag.
- `interrupt_point(phase)`: a test hook; see its docstring.
"""
from __future__ import annotations

import contextlib
import logging as std_logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, NoReturn

from absl import app, flags, logging

if TYPE_CHECKING:
  from jaxspec.drafting.policies import Scoring

TEST_SIGNAL_ENV = "JAXSPEC_TEST_SIGNAL"
_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _exit_now(code: int) -> NoReturn:
  # os._exit, not sys.exit: the cleanups have run (an interrupt unwinds the stack first), and
  # interpreter shutdown would wait for library threads cut off mid-task and print their errors
  # after our one line (orbax's reads in flight when a corrupt checkpoint failed to load).
  with contextlib.suppress(Exception):
    sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)


def fail(prog: str, message: str) -> NoReturn:
  """Exit 1 with one line on stderr (absl's UsageError would bury it under the flag list)."""
  print(f"{prog}: error: {message}", file=sys.stderr)
  _exit_now(1)


def run(main: Callable[[list[str]], None], prog: str) -> None:
  """`app.run(main)`, exiting 128 + signum with one line on stderr on SIGINT or SIGTERM."""
  received = [signal.SIGINT]

  def on_term(signum, frame):
    received[0] = signum
    raise KeyboardInterrupt

  signal.signal(signal.SIGTERM, on_term)   # by default SIGTERM kills at once, skipping cleanup
  try:
    app.run(main)
  except KeyboardInterrupt:
    for s in _SIGNALS:   # a second Ctrl-C must not interrupt the exit
      signal.signal(s, signal.SIG_IGN)
    what = "interrupted" if received[0] == signal.SIGINT else "terminated"
    print(f"{prog}: {what}", file=sys.stderr)
    _exit_now(128 + received[0])


@contextlib.contextmanager
def signals_deferred(what: str = "this step") -> Iterator[None]:
  """Hold SIGINT and SIGTERM until the block ends, then deliver the first one that arrived.

  For work that other threads carry on after an interrupt unwinds ours: orbax writes a checkpoint
  from background threads, which kept writing into a temp dir after its cleanup had removed it.
  Only the main thread receives signals, so elsewhere this does nothing.
  """
  if threading.current_thread() is not threading.main_thread():
    yield
    return
  received: list[int] = []

  def hold(signum, frame):
    if not received:
      print(f"{signal.Signals(signum).name} received: finishing {what}, then stopping",
            file=sys.stderr, flush=True)
    received.append(signum)

  previous = {s: signal.signal(s, hold) for s in _SIGNALS}
  try:
    yield
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)
    if received:
      signal.raise_signal(received[0])   # to the handler restored above


def quiet_logging() -> None:
  """Unless the user passed --verbosity: Python logging at warnings, absl's logger at errors.

  absl raises its default verbosity to INFO once flags are parsed, and orbax logs every array it
  reads or writes at INFO; orbax's own warnings (e.g. before it reports a corrupt checkpoint)
  repeat what our error says, so the absl logger, which orbax uses, stops at errors.
  """
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
    std_logging.getLogger("absl").setLevel(std_logging.ERROR)


def scoring(kind: str, pool: int, block: int, window: int = 0) -> Scoring:
  """--score, --score_pool, --score_block and --score_window as one setting (a one-line
  ValueError)."""
  from jaxspec.drafting.policies import Scoring   # jax loads here, not for every CLI
  if pool < 1 or pool % 2 == 0:
    raise ValueError(f"--score_pool must be an odd integer >= 1, got {pool}")
  if block < 1:
    raise ValueError(f"--score_block must be an integer >= 1, got {block}")
  if window < 0:
    raise ValueError(f"--score_window must be an integer >= 0, got {window}")
  return Scoring(kind=kind, pool=pool, block=block, window=window)


def interrupt_point(phase: str) -> None:
  """Test hook: send this process the signal that $JAXSPEC_TEST_SIGNAL names for `phase`.

  JAXSPEC_TEST_SIGNAL=PHASE sends SIGINT, PHASE:TERM sends SIGTERM, when the program reaches
  `interrupt_point(PHASE)`; so the tests interrupt a subprocess at an exact point, not by timing.
  Unset, as in every normal run, it does nothing. Phases: "checkpoint-write" (orbax's threads are
  writing the params), "streamed" (generate has printed the first text).
  """
  want = os.environ.get(TEST_SIGNAL_ENV)
  if not want:
    return
  name, _, sig = want.partition(":")
  if name == phase:
    os.kill(os.getpid(), getattr(signal, f"SIG{sig or 'INT'}"))
