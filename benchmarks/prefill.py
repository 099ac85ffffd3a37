"""A one-prompt prefill (what every serving refill runs) against its compute floor.

  python -m benchmarks.prefill --model=random:qwen2.5-coder-1.5b \
      --prompt_lens=16385,20480,24577,28672,31737 --prompt_buckets=1,8
  python -m benchmarks.prefill --model=<a jaxspec checkpoint> --prompt_lens=100,300 \
      --matmul_n=256 --reps=1                                     # CPU smoke run

For each --prompt_buckets setting (padded prompt lengths per power of two,
`jaxspec.engine.state.prompt_bucket`) and each prompt length, `Runner.start` prefills one prompt of
random tokens into a cache of --max_len slots (default: the longest prompt + 1024, as a serving run
sizes it), compiled first, median of --reps calls. --method=vegas adds what a vegas refill adds
(the last prompt row's Collect-2 scores and the first selection).

The floor is the arithmetic the prompt's real tokens need over the bf16 matmul rate measured in
the same process (`benchmarks.common.matmul_ceiling`): 2 x the layers' weight parameters a token,
4 x head_dim a (query head, key) pair of causal attention, n (n + 1) / 2 pairs a head and layer,
and the last row's LM head. Reported per row: the padded length, ms, real tokens/s, the real
tokens' TFLOP/s, x floor, and the same count for the padded rows (what the prefill computes if
nothing skips the padding). --trace adds the GPU time per kernel of one prefill of the first
length at each setting.
"""
from __future__ import annotations

import datetime
import sys

import jax
import numpy as np
from absl import app, flags

from benchmarks.common import (device_name, error_text, git_commit, kernel_table, load,
                               matmul_ceiling, time_fn, write_json)
from jaxspec import cli
from jaxspec.engine.runner import Runner
from jaxspec.engine.state import PROMPT_BUCKETS, check_prompt_buckets, prompt_bucket
from jaxspec.model.attention import default_backend
from jaxspec.model.config import ModelConfig
from jaxspec.model.transformer import fuse_projections


def define_flags() -> None:
  """The flags, defined only when run as a program: the tests import `prefill_flops`, and another
  benchmark's flags of the same names must not collide with these."""
  flags.DEFINE_string("model", "random:qwen2.5-coder-1.5b",
                      "random:<shape> (benchmarks/common.py SHAPES) or a jaxspec model spec")
  flags.DEFINE_list("prompt_lens", ["16385", "20480", "24577", "28672", "31737"],
                    "prompt lengths in tokens")
  flags.DEFINE_list("prompt_buckets", ["1", str(PROMPT_BUCKETS)],
                    "padded prompt lengths per power of two, one row set each")
  flags.DEFINE_enum("method", "none", ["none", "vegas"], "whose prefill")
  flags.DEFINE_integer("max_len", None, "cache slots per sequence (default: the longest prompt + "
                       "1024)")
  flags.DEFINE_integer("reps", 5, "timed calls per row (median)")
  flags.DEFINE_integer("matmul_n", 8192, "the ceiling's square bf16 matmul size")
  flags.DEFINE_bool("fuse_projections", True, "q/k/v and gate/up as one GEMM each")
  flags.DEFINE_bool("trace", False, "GPU time per kernel of one prefill per setting")
  flags.DEFINE_string("out", "benchmarks/out/prefill.json", "JSON results")


def prefill_flops(cfg: ModelConfig, n: int) -> float:
  """Floating-point operations of an n-token prefill: the layers' GEMMs for every token, causal
  attention's score and value products, and the LM head for the last row only."""
  h, d = cfg.hidden_size, cfg.head_dim
  per_layer = (h * (cfg.num_heads + 2 * cfg.num_kv_heads) * d + cfg.num_heads * d * h
               + 3 * h * cfg.intermediate_size)
  linear = 2 * per_layer * cfg.num_layers * n
  attention = 4 * d * cfg.num_heads * cfg.num_layers * n * (n + 1) / 2
  return linear + attention + 2 * h * cfg.vocab_size


def main(argv):
  del argv
  cli.quiet_logging()
  fv = flags.FLAGS
  prog = "benchmarks.prefill"
  try:
    lens = [int(x) for x in fv.prompt_lens]
    settings = [check_prompt_buckets(int(x)) for x in fv.prompt_buckets]
    if not lens or min(lens) < 1:
      raise ValueError(f"--prompt_lens must be positive token counts, got {fv.prompt_lens}")
  except ValueError as e:
    cli.fail(prog, str(e))
  max_len = fv.max_len or max(lens) + 1024
  if max_len <= max(lens):
    cli.fail(prog, f"--max_len={max_len} leaves no room after the longest prompt ({max(lens)})")
  model, weights = load(fv.model)
  if fv.fuse_projections:
    fuse_projections(model)
  cfg = model.cfg
  rate, matmul_s = matmul_ceiling(fv.matmul_n)
  backend = default_backend()
  print(f"{device_name()} | bf16 matmul {rate / 1e12:.0f} TFLOP/s | {fv.model} ({weights}) "
        f"| backend {backend} | method {fv.method}", file=sys.stderr)
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, max(lens))
  rows, traces = [], {}
  for per_octave in settings:
    runner = Runner(model, method=fv.method, backend=backend, prompt_buckets=per_octave)
    for n in lens:
      prompt = tokens[:n].tolist()
      padded = prompt_bucket(n, per_octave)
      row = dict(prompt_buckets=per_octave, prompt_len=n, padded_len=padded)
      try:
        run = lambda: runner.start([prompt], 1, max_len=max_len)[0]
        seconds = time_fn(run, warmup=1, reps=fv.reps)
        if fv.trace and per_octave not in traces:
          traces[per_octave] = dict(prompt_len=n, **kernel_table(run, top=20))
      except Exception as e:   # one row's failure (memory, say) must not lose the others
        row["error"] = error_text(e)
        rows.append(row)
        print(f"buckets {per_octave} | {n:6d} tokens | failed: {row['error']}", file=sys.stderr)
        continue
      useful, computed = prefill_flops(cfg, n), prefill_flops(cfg, padded)
      row.update(ms=seconds * 1e3, tokens_per_s=n / seconds, tflops=useful / seconds / 1e12,
                 floor_ms=useful / rate * 1e3, x_floor=seconds * rate / useful,
                 padded_tflop=computed / 1e12, useful_tflop=useful / 1e12)
      rows.append(row)
      print(f"buckets {per_octave} | {n:6d} tokens (padded {padded:6d}) | {row['ms']:8.2f} ms | "
            f"{row['tokens_per_s']:9.0f} tok/s | {row['tflops']:6.1f} TFLOP/s | "
            f"{row['x_floor']:.2f}x floor", file=sys.stderr)
  write_json(fv.out, dict(
      device=device_name(), commit=git_commit(), date=datetime.date.today().isoformat(),
      model=fv.model, weights=weights, method=fv.method, backend=backend,
      fuse_projections=fv.fuse_projections, max_len=max_len, matmul_tflops=rate / 1e12,
      matmul_n=fv.matmul_n, matmul_ms=matmul_s * 1e3, argv=" ".join(sys.argv),
      jax=jax.__version__, rows=rows, traces=traces))


if __name__ == "__main__":
  define_flags()
  app.run(main)
