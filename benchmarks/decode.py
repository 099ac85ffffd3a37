"""Vanilla decode step time and tokens/s against the HBM roofline.

  python -m benchmarks.decode --model=random:qwen2.5-coder-0.5b --batch_sizes=1,16,64 \
      --contexts=4096,16384,32768
  python -m benchmarks.decode --model=random:qwen3-8b --batch_sizes=4 --contexts=131072

The cache is filled with random K/V to the given context (no prefill: decode step time does not
depend on how the cache was filled) and `Runner.step` (the vanilla method's compiled chunk) runs `--steps` steps per timed call.
Roofline per step: (weight bytes + KV bytes read) / device-copy bandwidth measured in the same run.
"""
from __future__ import annotations

import sys

import jax
import numpy as np
from absl import app, flags
from flax import nnx

from benchmarks.common import (copy_ceiling, device_name, error_text, filled_state, git_commit,
                               load, time_fn, write_json)
from jaxspec import cli
from jaxspec.model.attention import default_backend
from jaxspec.engine.runner import VANILLA_CHUNK, Runner

_MODEL = flags.DEFINE_string("model", "random:qwen2.5-coder-0.5b",
                             "random:<shape> (see benchmarks/common.py SHAPES) or a jaxspec model spec")
_BATCH = flags.DEFINE_list("batch_sizes", ["1", "16", "64"], "batch sizes")
_CONTEXTS = flags.DEFINE_list("contexts", ["4096", "16384", "32768"], "tokens already in the cache")
_STEPS = flags.DEFINE_integer("steps", VANILLA_CHUNK, "decode steps per timed call (default: "
                              "jaxspec.generate's vanilla chunk)")
_REPS = flags.DEFINE_integer("reps", 5, "timed calls (median)")
_BACKEND = flags.DEFINE_string("backend", None, "attention backend (default: pallas on GPU)")
_OUT = flags.DEFINE_string("out", "benchmarks/out/decode.json", "JSON results")


def main(argv):
  del argv
  cli.quiet_logging()
  model, weights = load(_MODEL.value)
  cfg = model.cfg
  params = nnx.state(model)
  weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(params))
  backend = _BACKEND.value or default_backend()
  runner = Runner(model, backend=backend)
  bw, rates_gbps = copy_ceiling()
  print(f"{device_name()} | copy {bw / 1e9:.0f} GB/s | {_MODEL.value} ({weights}, "
        f"{weight_bytes / 1e9:.2f} GB) | backend {backend}", file=sys.stderr)
  rows = []
  for b in map(int, _BATCH.value):
    for ctx in map(int, _CONTEXTS.value):
      steps = _STEPS.value
      total = steps * (_REPS.value + 2)
      capacity = -(-(ctx + total + 1) // 128) * 128
      try:
        state = filled_state(cfg, b, ctx, capacity, total)
        holder = [state]

        def run():
          holder[0] = runner.step(holder[0], steps)[0]
          return holder[0].num_new

        t = time_fn(run, warmup=2, reps=_REPS.value) / steps
        mean_ctx = float(np.asarray(holder[0].cache.lengths).mean()) - steps / 2
        kv_bytes = b * mean_ctx * cfg.kv_bytes_per_token
        floor = (weight_bytes + kv_bytes) / bw
        row = dict(batch=b, context=ctx, step_ms=t * 1e3, tokens_per_s=b / t,
                   weight_gb=weight_bytes / 1e9, kv_gb=kv_bytes / 1e9,
                   achieved_gbps=(weight_bytes + kv_bytes) / t / 1e9, floor_ms=floor * 1e3,
                   step_over_floor=t / floor)
        state = holder = None  # free this case's cache before the next one
      except Exception as e:  # keep the other cases (e.g. out of memory at the largest)
        row = dict(batch=b, context=ctx, error=error_text(e))
      rows.append(row)
      print(row, file=sys.stderr)
  write_json(_OUT.value, dict(device=device_name(), commit=git_commit(), model=_MODEL.value,
                              weights=weights, backend=backend, copy_gbps=bw / 1e9,
                              copy_rates_gbps=rates_gbps, rows=rows))
  print(f"\n{'B':>4} {'ctx':>7} {'step ms':>9} {'tok/s':>9} {'GB/s':>7} {'floor ms':>9} {'x floor':>8}")
  for r in rows:
    if "error" in r:
      print(f"{r['batch']:>4} {r['context']:>7}  {r['error'][:60]}")
    else:
      print(f"{r['batch']:>4} {r['context']:>7} {r['step_ms']:>9.3f} {r['tokens_per_s']:>9.1f} "
            f"{r['achieved_gbps']:>7.0f} {r['floor_ms']:>9.3f} {r['step_over_floor']:>8.2f}")


if __name__ == "__main__":
  app.run(main)
