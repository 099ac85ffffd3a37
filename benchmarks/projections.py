"""The decoder's weight GEMMs at decode and verification row counts: separate, XLA-merged, fused.

  python -m benchmarks.projections --shape=qwen2.5-coder-0.5b --rows=64,128,448
  python -m benchmarks.projections --shape=tiny --rows=8 --steps=2   # CPU smoke run

Issue 14's lever "fewer, larger GEMMs per layer" measured alone, before it touches the model: a
stack of the shape's layers in which attention is replaced by an elementwise stand-in, so that
only the seven projections (q, k, v, o, gate, up, down), the residual adds and the SiLU remain,
run `--steps` times in one jitted `fori_loop` (the engine's loop: weights are arguments, read
every step). Variants, each compiled separately:
  separate         seven dots per layer, as the model writes them; XLA's DotMerger may merge the
                   dots that share an operand (q/k/v, gate/up) when they are under
                   --xla_gpu_dot_merger_threshold_mb (GPU only);
  separate-nomerge the same with the merger off (GPU only);
  fused            the weights concatenated once outside the loop: one QKV and one gate-up dot;
  cublas           separate, with XLA's Triton GEMMs off (GPU only).
Reported per variant: microseconds per forward (median of --reps), the weights' bytes over that
time, the ratio to the floor (weight bytes over the copy bandwidth measured in the same run), and
what XLA compiled: dots, cuBLAS calls and concatenates in the loop's optimised HLO (a merged dot
whose weights are concatenated inside the loop re-reads them every step).
"""
from __future__ import annotations

import dataclasses
import datetime
import re
import sys

import jax
import jax.numpy as jnp
from absl import flags

from benchmarks.common import SHAPES, copy_ceiling, device_name, git_commit, time_fn, write_json
from jaxspec import cli
from jaxspec.model.config import ModelConfig

TINY = ModelConfig(arch="qwen2", vocab_size=256, hidden_size=64, intermediate_size=128,
                   num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6,
                   rope_theta=1e6)
VARIANTS = ("separate", "separate-nomerge", "fused", "cublas")
GPU_ONLY = {"separate-nomerge": {"xla_gpu_dot_merger_threshold_mb": 0},
            "cublas": {"xla_gpu_enable_triton_gemm": False}}


def define_flags() -> None:
  """The flags, defined only when run as a program: importing the module (the tests do) must not
  collide with another benchmark's flags of the same names."""
  flags.DEFINE_string("shape", "qwen2.5-coder-0.5b", "a benchmarks/common.py SHAPES name, or tiny")
  flags.DEFINE_list("rows", ["64", "128", "448"], "rows per GEMM (B, or B x (gamma + 1))")
  flags.DEFINE_list("variants", list(VARIANTS), "of: " + ", ".join(VARIANTS))
  flags.DEFINE_integer("steps", 16, "forwards per timed call (one fori_loop)")
  flags.DEFINE_integer("reps", 7, "timed calls (median)")
  flags.DEFINE_string("out", "benchmarks/out/projections.json", "JSON results")


def shape_config(name: str) -> ModelConfig:
  if name == "tiny":
    return TINY
  if name not in SHAPES:
    raise ValueError(f"unknown shape {name!r}; known: tiny, {', '.join(SHAPES)}")
  return SHAPES[name]


def random_weights(cfg: ModelConfig, seed: int = 0) -> list[dict[str, jax.Array]]:
  """Per layer, name -> kernel [in, out] bfloat16: one array each, as the model holds them (a
  slice of stacked weights would add a copy per layer)."""
  h, i, q, kv = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim,
                 cfg.num_kv_heads * cfg.head_dim)
  shapes = dict(q=(h, q), k=(h, kv), v=(h, kv), o=(q, h), gate=(h, i), up=(h, i), down=(i, h))
  keys = jax.random.split(jax.random.PRNGKey(seed), cfg.num_layers * len(shapes)).reshape(
      cfg.num_layers, len(shapes), -1)
  return [{n: 0.02 * jax.random.normal(k, s, jnp.bfloat16) for (n, s), k in zip(shapes.items(), ks)}
          for ks in keys]


def fuse(w: list[dict[str, jax.Array]]) -> list[dict[str, jax.Array]]:
  """Per layer, q/k/v and gate/up concatenated along their outputs (once, outside the loop)."""
  return [dict(qkv=jnp.concatenate([l["q"], l["k"], l["v"]], -1), o=l["o"],
               gate_up=jnp.concatenate([l["gate"], l["up"]], -1), down=l["down"]) for l in w]


def _mix(q, k, v, heads: int, kv_heads: int):
  """Attention's stand-in: q scaled by its KV head's k and v (elementwise, so only the GEMMs and
  the small ops around them cost anything)."""
  m = q.shape[0]
  qh = q.reshape(m, kv_heads, heads // kv_heads, -1)
  kh, vh = k.reshape(m, kv_heads, 1, -1), v.reshape(m, kv_heads, 1, -1)
  return (qh * jax.nn.sigmoid(kh) + vh).reshape(m, -1)


def forward(w: list[dict[str, jax.Array]], x: jax.Array, cfg: ModelConfig) -> jax.Array:
  """One pass of the stack, x [M, H] -> [M, H]; `w` separate or fused (`fuse`)."""
  q_out, kv_out = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
  for layer in w:
    if "qkv" in layer:
      q, k, v = jnp.split(x @ layer["qkv"], [q_out, q_out + kv_out], -1)
    else:
      q, k, v = (x @ layer[n] for n in ("q", "k", "v"))
    x = x + _mix(q, k, v, cfg.num_heads, cfg.num_kv_heads) @ layer["o"]
    if "gate_up" in layer:
      g, u = jnp.split(x @ layer["gate_up"], 2, -1)
    else:
      g, u = x @ layer["gate"], x @ layer["up"]
    x = x + (jax.nn.silu(g) * u) @ layer["down"]
  return x


def compiled_loop(cfg: ModelConfig, w, x, steps: int, options: dict | None):
  def loop(w, x):
    return jax.lax.fori_loop(0, steps, lambda _, y: forward(w, y, cfg) * 0.5, x)
  return jax.jit(loop).lower(w, x).compile(compiler_options=options or None)


def hlo_counts(text: str) -> dict[str, int]:
  """Dots, cuBLAS GEMM calls and concatenates in the optimised HLO of the loop's program (the
  fused variant's weights are concatenated in another program, once)."""
  return dict(dots=len(re.findall(r"\bdot\(", text)),
              gemm_calls=len(re.findall(r"__cublas\$gemm|__cublas\$lt\$matmul", text)),
              concatenates=len(re.findall(r"\bconcatenate\(", text)))


def main(argv):
  del argv
  fv = flags.FLAGS
  cli.quiet_logging()
  try:
    cfg = shape_config(fv.shape)
    rows = [int(r) for r in fv.rows]
    unknown = set(fv.variants) - set(VARIANTS)
    if unknown or any(r < 1 for r in rows) or fv.steps < 1 or fv.reps < 1:
      raise ValueError(f"--variants of {', '.join(VARIANTS)} (got {sorted(unknown)}); --rows, "
                       f"--steps and --reps >= 1")
  except ValueError as e:
    cli.fail("benchmarks.projections", str(e))
  gpu = jax.default_backend() == "gpu"
  variants = [v for v in fv.variants if gpu or v not in GPU_ONLY]
  w = random_weights(cfg)
  fused = jax.jit(fuse)(w)
  weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(w))
  bw, rates = copy_ceiling()
  floor_us = weight_bytes / bw * 1e6
  print(f"{device_name()} | copy {bw / 1e9:.0f} GB/s | {fv.shape}: {weight_bytes / 1e6:.1f} MB "
        f"of projections, floor {floor_us:.1f} us a forward", file=sys.stderr)
  results = []
  for m in rows:
    x = jax.random.normal(jax.random.PRNGKey(1), (m, cfg.hidden_size), jnp.bfloat16)
    for variant in variants:
      weights = fused if variant == "fused" else w
      exe = compiled_loop(cfg, weights, x, fv.steps, GPU_ONLY.get(variant))
      seconds = time_fn(lambda: exe(weights, x), warmup=2, reps=fv.reps) / fv.steps
      us = seconds * 1e6
      row = dict(rows=m, variant=variant, us_per_forward=us, gbps=weight_bytes / seconds / 1e9,
                 x_floor=us / floor_us, **hlo_counts(exe.as_text()))
      results.append(row)
      print(f"M={m:5d} {variant:17s} {us:9.1f} us  {row['gbps']:7.0f} GB/s  "
            f"{row['x_floor']:5.2f}x floor  dots {row['dots']}  gemm calls {row['gemm_calls']}  "
            f"concatenates {row['concatenates']}", file=sys.stderr)
  settings = dict(shape=fv.shape, config=dataclasses.asdict(cfg), steps=fv.steps, reps=fv.reps,
                  weight_bytes=weight_bytes, copy_gbps=bw / 1e9,
                  copy_rates_gbps=rates, floor_us=floor_us, device=device_name(),
                  commit=git_commit(), date=datetime.date.today().isoformat(),
                  jax=jax.__version__)
  write_json(fv.out, {"settings": settings, "results": results})


if __name__ == "__main__":
  define_flags()
  cli.run(main, "benchmarks.projections")
