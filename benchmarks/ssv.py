r"""SSV's evaluation: how much the blocks that NSA selects for adjacent verification rows and for
adjacent layers overlap, the overlap that SSV's schedules turn into saved loads.

  python -m benchmarks.ssv --model=nsa:qwen2.5-coder-1.5b --contexts=8K,16K --passages=4
  python -m benchmarks.ssv --random --contexts=512 --passages=1 --rows=16   # a smoke run

Evaluations (--evals):
  overlap   each passage (--passages of --contexts tokens, evenly spaced over Frankenstein;
            $JAXSPEC_DATA, else ../shared/data) is prefilled but for its last --rows tokens, which
            are then verified as one chain: the blocks every row selects, per layer and KV head
            (`NSA(collect=True)`), give
              adjacent   |S_t & S_t-1| / n: the share of a row's n selected blocks that the row
                         before it selected too (the paper reports 50-90% at 8K);
              scored     the same over the blocks chosen by score alone (without block 0 and
                         the 2 local blocks, which NSA always selects);
              union_G    for groups of G adjacent rows: the distinct blocks the group selects,
                         over n; the exact merged schedule loads them once each, so G / union_G
                         is its saving in selected-block loads over running each row alone;
              layers     |S_l & S_l-1| / n for the same row and KV head: cross-layer stability,
                         what reuse layers count on.
            Per layer in the JSON (rows, KV heads and passages averaged), and one PNG per context.

There are no trained NSA weights here: `nsa:SPEC` is SPEC's dense model NSA-ified training-free
(`jaxspec.model.nsaify`: mean-pooled compression, fixed gates), a degraded model whose selections
stand in for a trained one's. --random is a tiny random NSA model on bytes: its numbers mean
nothing. JSON to --out, PNGs beside it.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx
from tqdm import tqdm

from benchmarks import sparse_eval as se
from benchmarks.common import device_name, git_commit, write_json
from jaxspec import cli
from jaxspec.model.attention import NSA, Prefill
from jaxspec.model.config import ModelConfig, NSAConfig
from jaxspec.model.kv_cache import KVCache
from jaxspec.model.transformer import Transformer, init_random
from jaxspec.pairmap import calibration_windows

PROG = "benchmarks.ssv"
EVALS = ("overlap",)
# The smoke model: NSA at a scale a few hundred bytes exercise (blocks of 16, 4 selected, window 32).
TINY = ModelConfig(arch="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                   num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                   nsa=NSAConfig(compress_block=16, compress_stride=8, select_block=16,
                                 num_selected=4, window=32))


# ----------------------------------------------------------------------------------------------
# Flags

def define_flags(fv: flags.FlagValues = flags.FLAGS) -> None:
  """The flags, into `fv`. Defined only when run as a program, so that importing the module (the
  tests do) does not collide with another benchmark's flags of the same names."""
  f = dict(flag_values=fv)
  flags.DEFINE_string("model", "nsa:qwen2.5-coder-1.5b", "an NSA model spec (nsa:SPEC NSA-ifies "
                      "a dense one)", **f)
  flags.DEFINE_bool("random", False, "a tiny random NSA model on bytes instead of --model (a "
                    "smoke run: its numbers mean nothing)", **f)
  flags.DEFINE_list("evals", list(EVALS), "evaluations: " + ", ".join(EVALS), **f)
  flags.DEFINE_list("contexts", ["8K", "16K"], "tokens per passage; K = 1024", **f)
  flags.DEFINE_integer("passages", 4, "passages per context (evenly spaced over the book)", **f)
  flags.DEFINE_integer("rows", 32, "verification rows at the end of each passage (one chain)", **f)
  flags.DEFINE_list("groups", ["2", "4", "8"], "group sizes G for the merged schedule's union", **f)
  flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "weights and cache", **f)
  flags.DEFINE_string("out", "benchmarks/out/ssv.json", "JSON results (PNGs beside)", **f)


FLAG_NAMES = ("evals", "contexts", "passages", "rows", "groups")


def parse_tokens(text: str, name: str) -> int:
  """'8192' or '8K' (K = 1024) -> tokens; a one-line ValueError otherwise."""
  s = str(text).strip()
  scale = 1024 if s[-1:] in ("k", "K") else 1
  digits = s[:-1] if scale > 1 else s
  if not digits.isdigit() or int(digits) < 1:
    raise ValueError(f"{name} entries are token counts such as 8192 or 8K, got {text!r}")
  return int(digits) * scale


def parse_flags(v: dict) -> dict:
  """The flag values checked and parsed; one-line ValueErrors naming the flag."""
  evals = list(v["evals"])
  unknown = [e for e in evals if e not in EVALS]
  if unknown or not evals:
    raise ValueError(f"--evals takes {', '.join(EVALS)}, got {','.join(evals) or 'nothing'}")
  if v["passages"] < 1:
    raise ValueError(f"--passages must be >= 1, got {v['passages']}")
  if v["rows"] < 2:
    raise ValueError(f"--rows must be >= 2 (adjacent rows), got {v['rows']}")
  groups = []
  for g in v["groups"]:
    if not str(g).strip().isdigit() or int(g) < 2 or int(g) > v["rows"]:
      raise ValueError(f"--groups entries are integers in [2, --rows={v['rows']}], got {g!r}")
    groups.append(int(g))
  contexts = [parse_tokens(c, "--contexts") for c in v["contexts"]]
  short = [c for c in contexts if c <= v["rows"]]
  if short or not contexts:
    raise ValueError(f"--contexts must exceed --rows={v['rows']}, got {v['contexts']}")
  return dict(evals=evals, contexts=contexts, passages=v["passages"], rows=v["rows"],
              groups=groups)


# ----------------------------------------------------------------------------------------------
# Overlap of selected blocks

def block_sets(indices: np.ndarray) -> np.ndarray:
  """Selected blocks [..., n] int (ascending, -1 padded) -> membership [..., NB] bool."""
  nb = int(indices.max()) + 1
  member = np.zeros(indices.shape[:-1] + (nb + 1,), bool)
  np.put_along_axis(member, np.where(indices < 0, nb, indices), True, axis=-1)
  return member[..., :nb]


def forced_blocks(positions: np.ndarray, select_block: int, nb: int) -> np.ndarray:
  """positions [T] -> [T, NB] bool: the blocks NSA selects for a row whatever their score (block
  0 and the 2 local blocks)."""
  cur = positions[:, None] // select_block
  j = np.arange(nb)[None]
  return (j == 0) | (j == cur) | (j == cur - 1)


def overlap_stats(indices: np.ndarray, positions: np.ndarray, cfg: NSAConfig,
                  groups: tuple[int, ...]) -> dict[str, np.ndarray]:
  """indices [L, T, Hkv, n] (one sequence's chain rows, -1 padded), positions [T] -> per-layer
  means [L] of the overlap metrics in the module docstring (n = cfg.num_selected)."""
  n = cfg.num_selected
  member = block_sets(indices)                                        # [L, T, Hkv, NB]
  nb = member.shape[-1]
  scored = member & ~forced_blocks(positions, cfg.select_block, nb)[None, :, None]
  both = (member[:, 1:] & member[:, :-1]).sum(-1)                     # [L, T-1, Hkv]
  out = {"adjacent": both.mean((1, 2)) / n}
  s_both = (scored[:, 1:] & scored[:, :-1]).sum(-1)
  s_size = np.maximum(scored[:, 1:].sum(-1), 1)
  out["scored"] = (s_both / s_size).mean((1, 2))
  t = member.shape[1]
  for g in groups:
    whole = t // g * g
    union = member[:, :whole].reshape(member.shape[0], whole // g, g, *member.shape[2:]).any(2)
    out[f"union_{g}"] = union.sum(-1).mean((1, 2)) / n
  layers = (member[1:] & member[:-1]).sum(-1).mean((1, 2)) / n       # [L-1]
  out["layers"] = np.concatenate([[np.nan], layers])                  # layer 0 has no layer before
  return out


@functools.partial(jax.jit, static_argnums=0, donate_argnums=3)
def _prefill(graphdef, state, tokens, cache):
  model = nnx.merge(graphdef, state)
  _, cache, _ = model(tokens, cache.chain_positions(tokens.shape[1]), cache, Prefill())
  return cache.replace(lengths=cache.lengths + tokens.shape[1])


@functools.partial(jax.jit, static_argnums=0, donate_argnums=3)
def _verify_blocks(graphdef, state, tokens, cache):
  model = nnx.merge(graphdef, state)
  return model(tokens, cache.chain_positions(tokens.shape[1]), cache, NSA(collect=True))[2]


def selected_blocks(model: Transformer, window: np.ndarray, rows: int, dtype) -> np.ndarray:
  """window [W] tokens: prefill all but the last `rows`, verify those as a chain -> the blocks
  each row selects [L, rows, Hkv, n]."""
  graphdef, state = nnx.split(model)
  cache = KVCache.create(model.cfg, 1, se.capacity_for(len(window)), dtype)
  head = jnp.asarray(window[None, :-rows], jnp.int32)
  cache = _prefill(graphdef, state, head, cache)
  used = _verify_blocks(graphdef, state, jnp.asarray(window[None, -rows:], jnp.int32), cache)
  return np.asarray(used[:, 0])


def overlap(model: Transformer, tokens: np.ndarray, v: dict, dtype) -> list[dict]:
  """The overlap rows of the JSON: one per context, per-layer means over its passages."""
  cfg = model.cfg.nsa
  out = []
  for context in v["contexts"]:
    windows = calibration_windows(tokens, v["passages"], context)
    stats = []
    for w in tqdm(windows, desc=f"overlap at {context} tokens", unit="passage", file=sys.stderr):
      positions = np.arange(context - v["rows"], context)
      stats.append(overlap_stats(selected_blocks(model, w, v["rows"], dtype), positions, cfg,
                                 tuple(v["groups"])))
    per_layer = {k: np.mean([s[k] for s in stats], axis=0) for k in stats[0]}
    out.append(dict(context=context, passages=len(windows), rows=v["rows"],
                    per_layer={k: [None if np.isnan(x) else round(float(x), 4) for x in val]
                               for k, val in per_layer.items()},
                    mean={k: round(float(np.nanmean(val)), 4) for k, val in per_layer.items()}))
  return out


def plot_overlap(rows: list[dict], out: str, title: str) -> list[str]:
  """One PNG per context: the metrics per layer."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  paths = []
  for r in rows:
    fig, ax = plt.subplots(figsize=(7, 4))
    for k, val in r["per_layer"].items():
      ax.plot([np.nan if x is None else x for x in val], marker=".", label=k)
    ax.set_xlabel("layer")
    ax.set_ylabel("share of n selected blocks")
    ax.set_title(f"{title}: {r['context']} tokens, {r['rows']} rows", fontsize=9)
    ax.legend(fontsize=7)
    path = f"{os.path.splitext(out)[0]}_overlap_{r['context']}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    paths.append(path)
  return paths


# ----------------------------------------------------------------------------------------------
# The program

def load(spec: str | None, random: bool, dtype) -> tuple[Transformer, object, str]:
  """(the NSA model, its tokenizer, its name); one-line ValueErrors."""
  if random:
    return init_random(TINY, dtype=dtype), se.ByteTokenizer(), "random tiny NSA model"
  from jaxspec.io.loading import load_model
  loaded = load_model(spec, dtype=dtype, progress=True)
  if loaded.cfg.nsa is None:
    raise ValueError(f"--model={spec} is a dense model: name an NSA one, or nsa:{spec} to "
                     "NSA-ify it")
  if loaded.tokenizer is None:
    raise ValueError(f"{loaded.source} has no tokenizer: the benchmark's text cannot be encoded")
  return loaded.model, loaded.tokenizer, spec


def evaluate(model: Transformer, tokenizer, name: str, v: dict, out: str, dtype) -> dict:
  tokens = se.book_tokens(tokenizer)
  longest = max(v["contexts"])
  if longest > len(tokens):
    raise ValueError(f"--contexts {longest} exceeds the book's {len(tokens)} tokens")
  settings = dict(model=name, nsa=dataclasses.asdict(model.cfg.nsa), dtype=jnp.dtype(dtype).name,
                  device=device_name(),
                  commit=git_commit(), **{k: v[k] for k in ("contexts", "passages", "rows",
                                                            "groups")})
  result = dict(settings=settings)
  if "overlap" in v["evals"]:
    result["overlap"] = overlap(model, tokens, v, dtype)
    result["pngs"] = plot_overlap(result["overlap"], out, name)
  write_json(out, result)
  for r in result.get("overlap", []):
    print(f"{r['context']:>6} tokens: " + "  ".join(f"{k} {x:.3f}" for k, x in r["mean"].items()))
  print(f"wrote {out}")
  return result


def main(argv):
  del argv
  FLAGS = flags.FLAGS
  cli.quiet_logging()
  dtype = jnp.float32 if FLAGS.dtype == "float32" else jnp.bfloat16
  try:
    v = parse_flags({k: getattr(FLAGS, k) for k in FLAG_NAMES})
    model, tokenizer, name = load(None if FLAGS.random else FLAGS.model, FLAGS.random, dtype)
  except (OSError, ValueError) as e:
    cli.fail(PROG, str(e))
  try:
    evaluate(model, tokenizer, name, v, FLAGS.out, dtype)
  except (OSError, ValueError) as e:
    cli.fail(PROG, str(e))


if __name__ == "__main__":
  define_flags()
  cli.run(main, PROG)
