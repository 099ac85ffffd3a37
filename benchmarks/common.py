"""Shared benchmark plumbing: model shapes for random-weight runs, copy bandwidth, JSON output, and
what every real-weight run reports beside its speed: whether end-of-sequence tokens were honoured
(`eos_settings`, `eos_label`) and how repetitive the generated text is (`distinct_ngram_share`,
`repetition_summary`, `matched_repetition`, `paired_repetition`, `paired_rows`), so that
degenerate text shows next to acceptance."""
from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import tempfile
import statistics
import subprocess
import time
from typing import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import scipy.stats
from jax.sharding import NamedSharding

from jaxspec.model import nsa
from jaxspec.model.config import ModelConfig
from jaxspec.model.sharding import HEADS
from jaxspec.engine.state import DecodeState
from jaxspec.model.kv_cache import KVCache
from jaxspec.model.transformer import init_random

# Public model-card shapes, for random-weight runs (step time only: acceptance needs real weights).
SHAPES = {
    "qwen3-8b": ModelConfig(arch="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                            num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128,
                            rms_norm_eps=1e-6, rope_theta=1e6, qk_norm=True,
                            max_position_embeddings=131072),
    "qwen2.5-coder-0.5b": ModelConfig(arch="qwen2", vocab_size=151936, hidden_size=896,
                                      intermediate_size=4864, num_layers=24, num_heads=14,
                                      num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6, rope_theta=1e6,
                                      qkv_bias=True, tie_word_embeddings=True),
    "qwen2.5-coder-1.5b": ModelConfig(arch="qwen2", vocab_size=151936, hidden_size=1536,
                                      intermediate_size=8960, num_layers=28, num_heads=12,
                                      num_kv_heads=2, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6,
                                      qkv_bias=True, tie_word_embeddings=True),
}


def device_name() -> str:
  d = jax.devices()[0]
  return getattr(d, "device_kind", str(d))


def git_commit() -> str:
  """JAXSPEC_COMMIT if set (the GPU machine's copy of the tree may carry a stale .git), else HEAD."""
  if os.environ.get("JAXSPEC_COMMIT"):
    return os.environ["JAXSPEC_COMMIT"]
  try:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          check=True, cwd=os.path.dirname(__file__)).stdout.strip()
  except Exception:
    return "unknown"


def time_fn(fn: Callable[..., object], *, warmup: int = 2, reps: int = 10,
            setup: Callable[[], tuple] | None = None) -> float:
  """Median wall seconds of fn(*setup()) with the device synchronised around each call; setup
  (say, a fresh copy of a state fn donates) runs outside the timing."""
  setup = setup or tuple
  for _ in range(warmup):
    jax.block_until_ready(fn(*setup()))
  times = []
  for _ in range(reps):
    args = setup()
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def time_batched(fn: Callable[..., object], arg_sets: Sequence[tuple], *,
                 batch_seconds: float = 0.05, batches: int = 7) -> float:
  """Median seconds per call of fn(*args) over `batches` batches of back-to-back calls (rotating
  through arg_sets, so inputs that fit in L2 are not re-read from it), the device synchronised
  once per batch; each batch lasts about `batch_seconds`."""
  for a in arg_sets:
    jax.block_until_ready(fn(*a))
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*arg_sets[0]))
  once = max(time.perf_counter() - t0, 1e-6)
  n = int(min(max(batch_seconds / once, 3), 200))
  times = []
  for _ in range(batches):
    t0 = time.perf_counter()
    out = None
    for i in range(n):
      out = fn(*arg_sets[i % len(arg_sets)])
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t0) / n)
  return statistics.median(times)


def time_chain(fn: Callable[..., object], arg_sets: Sequence[tuple], n: int = 8,
               **batched) -> float:
  """Device seconds per call: n calls chained in one program (each one's first argument depends
  on the previous output, so none can be hoisted or overlapped), one dispatch for all of them;
  this removes the Python dispatch cost that wall-clock batches include for calls under ~50 us.
  Call i reads arg_sets[i % len(arg_sets)]: give several sets whose inputs together exceed the
  L2 cache, or a call finds what the call before it read still there. `batched`: time_batched's
  keywords."""
  def chain(sets):
    acc = jnp.zeros((), jnp.float32)
    for i in range(n):
      q, *rest = sets[i % len(sets)]
      out = fn(q + (acc * 0).astype(q.dtype), *rest)
      out = out[0] if isinstance(out, tuple) else out
      acc = acc + out.reshape(-1)[0].astype(jnp.float32)
    return acc
  return time_batched(jax.jit(chain), [(list(arg_sets),)], **batched) / n


def copy_rates(nbytes: int = 4 << 30, chain: int = 10) -> dict[str, float]:
  """Device copy rates in bytes/s (bytes read plus bytes written), by how the copy was made.

  'xla_negate': an XLA elementwise kernel (read + write every byte; a plain copy may be elided);
  'xla_copy': a jitted jnp.copy (a device-to-device memcpy where XLA emits one; dropped if XLA
  returned the input buffer); 'torch_copy': torch.Tensor.copy_ on the GPU where torch is
  installed. On an H200 the elementwise kernel reached 3258 GB/s and torch's copy 4245 GB/s, so
  the best of them, not the first, is the ceiling (`copy_ceiling`). `chain` back-to-back
  launches per timed call, so host dispatch (tens of microseconds) does not dilute ~1 ms copies.
  """
  if jax.default_backend() == "cpu":   # a smoke run: keep the buffers small (256 MB took 23 s)
    nbytes = min(nbytes, 16 << 20)
  x = jnp.ones((nbytes // 2,), jnp.bfloat16)
  rates = {}
  for name, f in (("xla_negate", jax.jit(lambda a: -a)), ("xla_copy", jax.jit(jnp.copy))):
    if name == "xla_copy" and f(x).unsafe_buffer_pointer() == x.unsafe_buffer_pointer():
      continue

    def launches(f=f):
      y = None
      for _ in range(chain):
        y = f(x)
      return y
    rates[name] = 2 * nbytes / (time_fn(launches, warmup=2, reps=5) / chain)
  del x
  if jax.default_backend() == "gpu":
    try:
      import torch
      if torch.cuda.is_available():
        src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
        dst = torch.empty_like(src)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(7):
          start.record()
          for _ in range(chain):
            dst.copy_(src)
          end.record()
          end.synchronize()
          times.append(start.elapsed_time(end) * 1e-3 / chain)
        rates["torch_copy"] = 2 * nbytes / statistics.median(times[2:])
        del src, dst
        torch.cuda.empty_cache()
    except ImportError:
      pass
  return rates


def matmul_ceiling(n: int = 8192, chain: int = 8) -> tuple[float, float]:
  """(the device's bf16 matmul rate in FLOP/s, seconds a product): `chain` products of random
  n x n bf16 matrices (bf16 out, as a model's GEMMs), each feeding the next, in one program; the
  median of five timed calls. The compute ceiling beside `copy_ceiling`'s byte ceiling."""
  keys = jax.random.split(jax.random.PRNGKey(0), 2)
  a = jax.random.normal(keys[0], (n, n), jnp.bfloat16)
  b = jax.random.normal(keys[1], (n, n), jnp.bfloat16) / n ** 0.5   # a @ b keeps unit variance

  @jax.jit
  def products(a, b):
    for _ in range(chain):
      a = a @ b
    return a
  seconds = time_fn(lambda: products(a, b), warmup=2, reps=5) / chain
  return 2 * n ** 3 / seconds, seconds


def copy_ceiling(nbytes: int = 4 << 30, chain: int = 10) -> tuple[float, dict[str, float]]:
  """(the device's copy ceiling in bytes/s: the best of `copy_rates`, every rate in GB/s)."""
  rates = copy_rates(nbytes, chain)
  return max(rates.values()), {k: v / 1e9 for k, v in rates.items()}


def kernel_table(fn: Callable[[], object], *, top: int = 25) -> dict:
  """Run fn() once under the JAX profiler; GPU time per kernel name, most expensive first.

  Returns {"device_us": total kernel time, "wall_us": fn's wall time, "kernels": [{name, us,
  calls}]}. Kernels overlap only across streams, so device_us can exceed wall_us slightly; a wall
  time well above device_us means launch / host overhead (the GPU idles between kernels).
  """
  jax.block_until_ready(fn())   # compiled and warm
  with tempfile.TemporaryDirectory() as log_dir:
    with jax.profiler.trace(log_dir, create_perfetto_trace=True):
      t0 = time.perf_counter()
      jax.block_until_ready(fn())
      wall = time.perf_counter() - t0
    path, = glob.glob(os.path.join(log_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    with gzip.open(path) as f:
      events = json.load(f)["traceEvents"]
  return dict(kernel_times(events, top), wall_us=wall * 1e6)


def kernel_times(events: list[dict], top: int = 25) -> dict:
  """Chrome/perfetto trace events -> kernel time per name on the GPU's stream lines."""
  gpu = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
         and e["args"]["name"].startswith("/device:GPU")}
  threads = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name" and e.get("pid") in gpu}
  # The device also has summary lines ("XLA Ops", "XLA Modules") that overlap the kernels: count
  # only the stream lines, which hold the kernels themselves.
  streams = {k for k, name in threads.items() if "Stream" in name}
  us, calls = collections.Counter(), collections.Counter()
  for e in events:
    if e.get("ph") == "X" and (e.get("pid"), e.get("tid")) in streams:
      us[e["name"]] += e.get("dur", 0.0)
      calls[e["name"]] += 1
  return dict(device_us=sum(us.values()), lines=sorted(set(threads.values())),
              kernels=[dict(name=n[:120], us=round(t, 1), calls=calls[n])
                       for n, t in us.most_common(top)])


# Families of GPU kernels in a decode step or a speculative round, by kernel name: our Pallas
# kernels carry their own names (dense attention: decoding and verification; sparse: the drafts');
# XLA's GEMMs are its Triton GEMM fusions and cuBLAS's kernels.
# First match wins; the rest is "other" (XLA's elementwise and reduction fusions, copies).
KERNEL_FAMILIES = (
    ("dense attention", ("verify_attention",)),
    ("sparse attention", ("sparse_attention",)),
    ("top-k selection", ("topk_select",)),
    # cuBLAS's own split-K reduction ("void cublasLt::splitKreduce_kernel<...>") is its GEMM's.
    ("GEMMs", ("gemm_fusion", "nvjet", "cutlass", "sm90_xmma", "cublas", "void cublasLt::")),
    ("sorts", ("sort",)),
)


def kernel_families(kernels: Sequence[Mapping]) -> dict[str, float]:
  """GPU microseconds per family of `KERNEL_FAMILIES` (plus "other") from a `kernel_times` list
  of {name, us, calls}; every listed kernel lands in exactly one family."""
  us = {name: 0.0 for name, _ in KERNEL_FAMILIES} | {"other": 0.0}
  for k in kernels:
    family = next((name for name, prefixes in KERNEL_FAMILIES
                   if k["name"].startswith(prefixes)), "other")
    us[family] += k["us"]
  return {name: round(t, 1) for name, t in us.items()}


def parse_tokens(text: str, name: str) -> int:
  """'16384' or '16K' (K = 1024) -> tokens; a one-line ValueError otherwise."""
  m = re.fullmatch(r"\s*(\d+)\s*([kK]?)\s*", str(text))
  if not m or int(m.group(1)) < 1:
    raise ValueError(f"{name} must be a positive token count such as 16384 or 16K, got {text!r}")
  return int(m.group(1)) * (1024 if m.group(2) else 1)


def write_json(path: str, payload: dict) -> None:
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(payload, f, indent=1)
  os.replace(tmp, path)


def load(spec: str, tp: int = 1):
  """(model, 'random weights' | 'real weights') for a jaxspec model spec or random:<shape>,
  sharded over `tp` devices."""
  if spec.startswith("random:"):
    shape = spec.split(":", 1)[1]
    if shape not in SHAPES:
      raise ValueError(f"unknown random-weight shape {shape!r}; known: {', '.join(SHAPES)}")
    return init_random(SHAPES[shape], dtype=jnp.bfloat16, tp=tp), "random weights"
  from jaxspec.io.loading import load_model
  return load_model(spec, dtype=jnp.bfloat16, tp=tp).model, "real weights"


def random_cache(cfg: ModelConfig, batch: int, context: int, capacity: int, seed: int = 0,
                 mesh=None, dtype=jnp.bfloat16) -> KVCache:
  """A cache of `capacity` slots holding `context` tokens of random K/V per sequence (and, for an
  NSA model, random compressed K/V); on a tensor-parallel `mesh` each device draws its own KV
  heads."""
  keys = jax.random.split(jax.random.PRNGKey(seed), 2 * cfg.num_layers)
  out = None if mesh is None else NamedSharding(mesh, HEADS)
  normal = jax.jit(lambda k, shape: jax.random.normal(k, shape, dtype), static_argnums=1,
                   out_shardings=out)
  shape = (batch, capacity, cfg.num_kv_heads, cfg.head_dim)
  cache = KVCache(k=tuple(normal(k, shape) for k in keys[:cfg.num_layers]),
                  v=tuple(normal(k, shape) for k in keys[cfg.num_layers:]),
                  lengths=jnp.full((batch,), context, jnp.int32))
  if cfg.nsa is None:
    return cache
  shape_c = (batch, nsa.num_compressed(capacity, cfg.nsa), cfg.num_kv_heads, cfg.head_dim)
  compressed = lambda ks: tuple(normal(jax.random.fold_in(k, 1), shape_c) for k in ks)
  return cache.replace(ck=compressed(keys[:cfg.num_layers]), cv=compressed(keys[cfg.num_layers:]))


def filled_state(cfg, batch: int, context: int, capacity: int, steps_total: int, seed: int = 0,
                 mesh=None):
  """A decode state whose cache holds `context` random tokens per sequence (`random_cache`)."""
  return DecodeState(cache=random_cache(cfg, batch, context, capacity, seed, mesh),
                     last_token=jnp.ones((batch,), jnp.int32),
                     tokens=jnp.full((batch, steps_total + 1), -1, jnp.int32),
                     num_new=jnp.zeros((batch,), jnp.int32),
                     max_new=jnp.full((batch,), steps_total + 1, jnp.int32),
                     done=jnp.zeros((batch,), bool), key=jax.random.PRNGKey(seed))


# -- honest-workload reporting ---------------------------------------------------------------------

IGNORE_EOS_TAG = "(ignore_eos)"


def error_text(e: BaseException, limit: int = 300) -> str:
  """A result row's error: 'Type: message' (the message cut at `limit`). An out-of-memory error
  starts with what to change, since JAX's default preallocation (75% of the GPU) is often what ran
  out at a KV-filling batch; a kernel whose tile outgrew an SM's shared memory (the same
  RESOURCE_EXHAUSTED status) says that instead, since no memory fraction helps it."""
  text = f"{type(e).__name__}: {str(e)[:limit]}"
  if "Shared memory size limit exceeded" in str(e):
    text = (f"a Pallas kernel's tile does not fit an SM's shared memory at these shapes (a "
            f"smaller block_k or num_stages would); {text}")
  elif "RESOURCE_EXHAUSTED" in str(e) or "Out of memory" in str(e):
    fraction = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "unset (JAX takes 0.75)")
    text = (f"out of GPU memory with XLA_PYTHON_CLIENT_MEM_FRACTION {fraction}: raise it "
            f"(benchmarks/run_gpu.sh sets 0.95) or lower --batch or the context; {text}")
  return text


def eos_label(label: str, ignore_eos: bool) -> str:
  """`label` marked ' (ignore_eos)' for a run that ignored end-of-sequence tokens: such a run is
  a stress mode (every request runs to max_new_tokens), and its labels, JSON and plot titles say
  so."""
  return f"{label} {IGNORE_EOS_TAG}" if ignore_eos else label


def eos_settings(ignore_eos: bool, stop_ids: Sequence[int]) -> dict:
  """The JSON fields that say how a run treated end-of-sequence tokens."""
  if ignore_eos:
    return dict(ignore_eos=True, stop_ids=[],
                eos="ignored (--ignore_eos stress mode: every request runs to max_new_tokens)")
  return dict(ignore_eos=False, stop_ids=[int(t) for t in stop_ids],
              eos="honoured (a request stops at its first stop id)")


def distinct_ngram_share(tokens: Sequence[int], n: int = 4) -> float | None:
  """Distinct n-grams / all n-grams of one output: 1.0 when no n-gram repeats, near 0 for text
  stuck in a loop (a 3-token cycle of length L: 3 / (L - 3)). None for an output shorter than n
  tokens, which has no n-gram (averages leave it out rather than count it as perfectly varied)."""
  if n < 1:
    raise ValueError(f"n must be at least 1, got {n}")
  tokens = [int(t) for t in tokens]
  total = len(tokens) - n + 1
  if total < 1:
    return None
  return len({tuple(tokens[i:i + n]) for i in range(total)}) / total


def repetition_summary(outputs: Mapping[int, Sequence[int]], stop_ids: Sequence[int] = (),
                       n: int = 4) -> dict:
  """Per-request and mean repetition of `outputs` (request index -> its new tokens).

  distinct_{n}gram_share_mean / _min: over the requests with at least n tokens
  (`distinct_ngram_share`); repetition_requests: how many those are; stopped_share: the share of
  outputs that end at a stop id (the rest ran to their token budget); mean_new_tokens; and
  per_request: [request, new tokens, share, stopped] for each, by request index. Empty outputs
  give None for the means."""
  key = f"distinct_{n}gram_share"
  stops = {int(t) for t in stop_ids}
  per_request, shares = [], []
  for req in sorted(outputs):
    toks = list(outputs[req])
    share = distinct_ngram_share(toks, n)
    stopped = bool(toks) and int(toks[-1]) in stops
    per_request.append([int(req), len(toks), None if share is None else round(share, 4), stopped])
    if share is not None:
      shares.append(share)
  count = len(per_request)
  return {f"{key}_mean": sum(shares) / len(shares) if shares else None,
          f"{key}_min": min(shares) if shares else None,
          "repetition_requests": len(shares),
          "stopped_share": sum(r[3] for r in per_request) / count if count else None,
          "mean_new_tokens": sum(r[1] for r in per_request) / count if count else None,
          "per_request": per_request}


def _shares_by_request(row: dict) -> dict[int, float]:
  """request -> its distinct-4-gram share, from a row's `per_request` (outputs too short for a
  4-gram left out)."""
  return {req: share for req, _, share, _ in row["per_request"] if share is not None}


def matched_repetition(rows: Sequence[dict], n: int = 4) -> int:
  """Adds `distinct_{n}gram_share_matched` to every row that has `per_request`: its mean share
  over the requests that all those rows finished (the same prompt and token budget in each), so
  that rows which finished different requests, and so outputs of different lengths, compare like
  for like (the share falls as an output grows). Returns how many requests that is; with none in
  common the field is None."""
  rows = [r for r in rows if r.get("per_request") is not None]
  shares = [_shares_by_request(r) for r in rows]
  common = set.intersection(*map(set, shares)) if shares else set()
  for row, by_req in zip(rows, shares):
    row[f"distinct_{n}gram_share_matched"] = (
        sum(by_req[q] for q in common) / len(common) if common else None)
  return len(common)


def paired_repetition(base: dict, row: dict) -> dict | None:
  """`row`'s distinct-4-gram shares (its `per_request`, from `repetition_summary`) against
  `base`'s (vanilla's), request by request, over the requests both finished (each pair shares its
  prompt and token budget): `requests`, the mean difference row - base (`mean_diff`), its
  standard error (`stderr`, None under two requests) and the two-sided Wilcoxon signed-rank p
  (`wilcoxon_p`; 1.0 when every difference is zero). A lossless method's difference is zero
  within noise. None when either row lacks `per_request` or they finished no request in common."""
  if base.get("per_request") is None or row.get("per_request") is None:
    return None
  shares = [_shares_by_request(r) for r in (base, row)]
  common = sorted(set(shares[0]) & set(shares[1]))
  if not common:
    return None
  diffs = [shares[1][q] - shares[0][q] for q in common]
  mean = sum(diffs) / len(diffs)
  stderr = statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else None
  p = (1.0 if all(d == 0 for d in diffs)
       else float(scipy.stats.wilcoxon(diffs, alternative="two-sided").pvalue))
  return {"requests": len(common), "mean_diff": mean, "stderr": stderr, "wilcoxon_p": p}


def read_throughput_json(path: str) -> dict:
  """A `benchmarks.throughput` JSON; OSError or a one-line ValueError when `path` is not one."""
  with open(path) as f:
    payload = json.load(f)   # json.JSONDecodeError is a ValueError
  if not isinstance(payload, dict) or not isinstance(payload.get("rows"), list):
    raise ValueError("not a throughput JSON: it has no list of 'rows'")
  return payload


def paired_rows(payload: dict, baseline: str = "none") -> list[dict]:
  """One entry per row of `payload` (a throughput JSON) other than the baseline's: its label and
  the `paired_repetition` fields against the baseline row (the label alone where either row lacks
  per-request figures)."""
  rows = payload["rows"]
  base = next((r for r in rows if r.get("method") == baseline), None)
  if base is None:
    raise ValueError(f"no row of method {baseline!r} to pair against")
  return [{"label": r.get("label", r.get("method")), **(paired_repetition(base, r) or {})}
          for r in rows if r is not base]
