r"""SSV's evaluation: how much the blocks that NSA selects for adjacent verification rows and for
adjacent layers overlap (the overlap that SSV's schedules turn into saved loads), SSV's kernels
on synthetic selections of controlled overlap, and the verification stage of a whole random-weight
NSA model. The last example is a smoke run.

  python -m benchmarks.ssv --model=nsa:qwen2.5-coder-1.5b --contexts=8K,16K --passages=4
  python -m benchmarks.ssv --evals=verify --verify_contexts=16K,32K --verify_profile
  python -m benchmarks.ssv --random --evals=overlap --contexts=512 --passages=1 --rows=16

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
  kernel    the paper's kernel benchmark (its Section 7.3) on synthetic selections: --kernel_rows
            rows T verified at --kernel_context, each row's n = 16 blocks sharing --kernel_overlaps
            of them with the row before (3: only the initial and 2 local blocks, which NSA always
            selects; 15: all but one), at --kernel_shape (Hq/Hkv/D), for --kernel_batch
            sequences with their own selections (1: the latency case). The selected + window
            kernel (`nsa_select_window`) per query (groups of 1), under the exact merged schedule
            and under the shared index for each --groups G <= T, at each --kernel_splits (the
            programs a branch of each group: `auto` is the kernel's default, the number it chose
            in the JSON; a row per setting, speedups against per-query execution at the same
            setting); the routing launch with and without the block importance (what a reuse
            layer skips), the routing in one launch (`splits=(1, 1)`, against the default
            two-launch form at small batch) and the top-n. Each time against its floor, the
            bytes it must read over the device's copy rate measured in the same run
            (`benchmarks.common.copy_ceiling`): achieved GB/s and time / floor; and each
            schedule's speedup over per-query execution. Timed on a GPU, 8 calls chained in
            one program (`benchmarks.common.time_chain`: no per-call dispatch), rotating through
            4 copies of the caches so that no call finds the blocks the call before it read in
            L2; on a CPU the kernels run in interpret mode and the times mean nothing.
  verify    the verification stage (the paper's Section 7.2) on a whole random-weight NSA model:
            Llama-3.2-1B's shape (16 layers, 32 query heads, 8 KV heads of 64: the paper's NSA
            setup) with NSA's defaults, --verify_batch sequences whose caches hold
            --verify_contexts tokens of random K/V (raw and compressed). Per --verify_rows T, one
            verification pass (the layers, the LM head, the cache written; jitted, the cache
            donated) per schedule: per-query (vanilla NSA), the exact merged schedule in groups
            of --verify_group (strict SSV, lossless), the shared index (approx), the alternating
            refresh/reuse schedule (reuse: the paper's), and shared + reuse; and the
            autoregressive step (T = 1). Timed as 8 passes in one program (a loop, as the
            engine's rounds run), --verify_reps times, median. With a per-token acceptance rate
            a (--verify_acceptance, labels: random weights make real acceptance meaningless) a
            chain of T rows yields E = (1 - a^T) / (1 - a) tokens a round, so the verification
            side's speedup over autoregressive NSA decoding is E * t_AR / t_verify: drafting is
            NOT counted, and `draft_budget_us` is the drafting time a round may take before
            speculation stops paying ((E * t_AR - t_verify) / (T - 1) per draft token). In random
            caches adjacent rows share little beyond the 3 blocks NSA always selects (the
            measured overlap is in the JSON), the worst case for grouping: the kernel
            evaluation gives the gain at controlled overlap. --verify_profile adds, on a GPU,
            the GPU time per kernel of one autoregressive step and of one pass under each
            schedule at each T.

There are no trained NSA weights here: `nsa:SPEC` is SPEC's dense model NSA-ified training-free
(`jaxspec.model.nsaify`: mean-pooled compression, fixed gates), a degraded model whose selections
stand in for a trained one's. --random is a tiny random NSA model on bytes: its numbers mean
nothing. JSON to --out, PNGs beside it; the JSON is rewritten after each evaluation and each
verify row with "partial": true, so that a run cut short keeps what it measured, and once more
without it at the end.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import sys
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx
from tqdm import tqdm

from benchmarks import sparse_eval as se
from benchmarks.common import (device_name, git_commit, kernel_table, parse_tokens, random_cache,
                               time_fn, write_json)
from jaxspec import cli
from jaxspec.model.attention import NSA, Prefill
from jaxspec.model.config import ModelConfig, NSAConfig
from jaxspec.model.kv_cache import KVCache
from jaxspec.model.transformer import Transformer, init_random
from jaxspec.pairmap import calibration_windows

PROG = "benchmarks.ssv"
EVALS = ("overlap", "kernel", "verify")
# The smoke model: NSA at a scale a few hundred bytes exercise (blocks of 16, 4 chosen, window 32).
KERNEL_NSA = NSAConfig()   # the paper's NSA constants: n = 16 blocks of 64, a window of 512
KV_COPIES = 4              # caches the chained kernel timings rotate through (kernel_eval)
PASSES = 8                 # verification passes per timed program (verify_eval)
# The verification stage's model (--evals=verify): Llama-3.2-1B's shape, the paper's NSA heads.
VERIFY_MODEL = ModelConfig(arch="llama", vocab_size=128256, hidden_size=2048,
                           intermediate_size=8192, num_layers=16, num_heads=32, num_kv_heads=8,
                           head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0,
                           tie_word_embeddings=True, max_position_embeddings=131072,
                           nsa=NSAConfig())
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
  flags.DEFINE_bool("random", False, "a tiny random NSA model on bytes instead of --model, and "
                    "as the verify model (a "
                    "smoke run: its numbers mean nothing)", **f)
  flags.DEFINE_list("evals", list(EVALS), "evaluations: " + ", ".join(EVALS), **f)
  flags.DEFINE_list("contexts", ["8K", "16K"], "tokens per passage; K = 1024", **f)
  flags.DEFINE_integer("passages", 4, "passages per context (evenly spaced over the book)", **f)
  flags.DEFINE_integer("rows", 32, "verification rows at the end of each passage (one chain)", **f)
  flags.DEFINE_list("groups", ["2", "4", "8"], "group sizes G for the merged schedule's union", **f)
  flags.DEFINE_list("kernel_rows", ["8", "16", "32", "64"], "kernel: verification rows T", **f)
  flags.DEFINE_list("kernel_overlaps", ["3", "7", "11", "15"], "kernel: blocks a row shares with "
                    "the row before, of n = 16", **f)
  flags.DEFINE_string("kernel_context", "32K", "kernel: tokens in the cache before the rows", **f)
  flags.DEFINE_string("kernel_shape", "64/4/128", "kernel: query heads/KV heads/head dim", **f)
  flags.DEFINE_integer("kernel_batch", 1, "kernel: sequences verified together, each with its "
                       "own selections (1 is the latency case: one program per KV head and row "
                       "group; a serving batch fills the GPU)", **f)
  flags.DEFINE_list("kernel_splits", ["auto"], "kernel: programs a branch of each row group "
                    "and KV head (`nsa_select_window`'s splits), auto or a positive integer", **f)
  flags.DEFINE_list("verify_contexts", ["16K", "32K"], "verify: tokens in each cache", **f)
  flags.DEFINE_list("verify_rows", ["8", "16"], "verify: verification rows T (gamma + 1)", **f)
  flags.DEFINE_integer("verify_group", 4, "verify: rows per group of the merged and shared "
                       "schedules", **f)
  flags.DEFINE_integer("verify_batch", 1, "verify: sequences verified together", **f)
  flags.DEFINE_list("verify_acceptance", ["0.6", "0.7", "0.8", "0.9"], "verify: per-token "
                    "acceptance rates the speedups are given at (labels, not measurements)", **f)
  flags.DEFINE_integer("verify_reps", 5, "verify: timed repetitions of 8 passes (median)", **f)
  flags.DEFINE_bool("verify_profile", False, "verify, on a GPU: also the GPU time per kernel of "
                    "one autoregressive step and one pass under each schedule at each T "
                    "(benchmarks.common.kernel_table)", **f)
  flags.DEFINE_integer("copy_bytes", 4 << 30, "kernel: bytes of the copy that measures the "
                       "device's copy rate", **f)
  flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "weights and cache", **f)
  flags.DEFINE_string("out", "benchmarks/out/ssv.json", "JSON results (PNGs beside)", **f)


FLAG_NAMES = ("evals", "contexts", "passages", "rows", "groups", "kernel_rows", "kernel_overlaps",
              "kernel_context", "kernel_shape", "kernel_batch", "kernel_splits", "copy_bytes",
              "verify_contexts", "verify_rows", "verify_group", "verify_batch",
              "verify_acceptance", "verify_reps", "verify_profile")


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
  n = KERNEL_NSA.num_selected
  overlaps = [_int_entry(o, "--kernel_overlaps", 3, n - 1) for o in v["kernel_overlaps"]]
  kernel_rows = [_int_entry(r, "--kernel_rows", 2, 256) for r in v["kernel_rows"]]
  shape = str(v["kernel_shape"]).split("/")
  if len(shape) != 3 or not all(x.isdigit() and int(x) > 0 for x in shape) \
      or int(shape[0]) % int(shape[1]):
    raise ValueError(f"--kernel_shape is query heads/KV heads/head dim with KV heads dividing "
                     f"the query heads, e.g. 64/4/128, got {v['kernel_shape']!r}")
  kernel_context = parse_tokens(v["kernel_context"], "--kernel_context")
  least = (2 * n + 4) * KERNEL_NSA.select_block
  if kernel_context < least:
    raise ValueError(f"--kernel_context must be at least {least} tokens ({2 * n + 4} selection "
                     f"blocks: room for rows that share few blocks), got {v['kernel_context']}")
  if v["copy_bytes"] < 1 << 20:
    raise ValueError(f"--copy_bytes must be at least 1 MiB, got {v['copy_bytes']}")
  if v["kernel_batch"] < 1:
    raise ValueError(f"--kernel_batch must be >= 1, got {v['kernel_batch']}")
  splits = [None if str(x).strip() == "auto" else _int_entry(x, "--kernel_splits", 1, 1024)
            for x in v["kernel_splits"]]
  if not splits:
    raise ValueError("--kernel_splits needs at least one entry (auto or an integer)")
  verify_rows = [_int_entry(r, "--verify_rows", 2, 256) for r in v["verify_rows"]]
  verify_contexts = [parse_tokens(c, "--verify_contexts") for c in v["verify_contexts"]]
  if not verify_rows or not verify_contexts:
    raise ValueError("--verify_rows and --verify_contexts need at least one entry each")
  if not 2 <= v["verify_group"] <= min(verify_rows):
    raise ValueError(f"--verify_group must be in [2, the fewest --verify_rows="
                     f"{min(verify_rows)}], got {v['verify_group']}")
  if v["verify_batch"] < 1 or v["verify_reps"] < 1:
    raise ValueError(f"--verify_batch and --verify_reps must be >= 1, got {v['verify_batch']} "
                     f"and {v['verify_reps']}")
  try:
    acceptance = [float(a) for a in v["verify_acceptance"]]
  except ValueError:
    acceptance = []
  if not acceptance or not all(0 < a < 1 for a in acceptance):
    raise ValueError(f"--verify_acceptance entries are rates in (0, 1), got "
                     f"{','.join(map(str, v['verify_acceptance'])) or 'nothing'}")
  return dict(evals=evals, contexts=contexts, passages=v["passages"], rows=v["rows"],
              groups=groups, kernel_rows=kernel_rows, kernel_overlaps=overlaps,
              kernel_context=kernel_context, kernel_shape=tuple(int(x) for x in shape),
              kernel_batch=v["kernel_batch"], kernel_splits=splits, copy_bytes=v["copy_bytes"],
              verify_contexts=verify_contexts, verify_rows=verify_rows,
              verify_group=v["verify_group"], verify_batch=v["verify_batch"],
              verify_acceptance=acceptance, verify_reps=v["verify_reps"],
              verify_profile=bool(v["verify_profile"]))


def _int_entry(text, name: str, low: int, high: int) -> int:
  if not str(text).strip().isdigit() or not low <= int(text) <= high:
    extra = " or auto" if name == "--kernel_splits" else ""
    raise ValueError(f"{name} entries are integers in [{low}, {high}]{extra}, got {text!r}")
  return int(text)


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
# Kernels on synthetic selections

def synthetic_indices(rng: np.random.Generator, positions: np.ndarray, hkv: int, overlap: int,
                      cfg: NSAConfig) -> np.ndarray:
  """Selected blocks [T, Hkv, n] int32, ascending, for rows at `positions` (one chain): each row
  has block 0 and its 2 local blocks, and shares exactly `overlap` of its n blocks with the row
  before (the forced ones among them when they are the same blocks); the rest are drawn at random
  from the blocks before the local ones that no earlier row selected (while there are enough),
  so that G adjacent rows select n + (G - 1) * (n - overlap) distinct blocks."""
  n, t = cfg.num_selected, len(positions)
  out = np.zeros((t, hkv, n), np.int32)
  for h in range(hkv):
    prev, seen = None, set()
    for i, p in enumerate(positions):
      cur = int(p) // cfg.select_block
      forced = {0, cur - 1, cur}
      pool = np.arange(1, cur - 1)
      if prev is None:
        picked = set(rng.choice(pool, n - 3, replace=False).tolist())
      else:
        kept_forced = forced & prev
        others = sorted(prev - forced)
        keep = overlap - len(kept_forced)
        picked = set(rng.choice(others, keep, replace=False).tolist()) if keep > 0 else set()
        need = n - 3 - len(picked)
        fresh = np.setdiff1d(pool, np.asarray(sorted(seen), np.int64))
        if len(fresh) < need:   # a long chain has used up the context: avoid the row before only
          fresh = np.setdiff1d(pool, np.asarray(sorted(prev | picked), np.int64))
        picked |= set(rng.choice(fresh, need, replace=False).tolist())
      row = forced | picked
      out[i, h] = sorted(row)
      prev = row
      seen |= row
  return out


def read_bytes(indices: np.ndarray, group: int, shared: bool, shape: tuple[int, int, int],
               cfg: NSAConfig, itemsize: int) -> int:
  """Bytes `nsa_select_window` must read at least for indices [T, Hkv, n]: each program's
  selected blocks (its rows' union, or one list when shared) and window keys, K and V, once; the
  queries, the compressed branch's output and the gates; the output written."""
  hq, hkv, d = shape
  t, n = indices.shape[0], cfg.num_selected
  blocks = 0
  for start in range(0, t, group):
    rows = indices[start:start + group]
    blocks += n * hkv if shared else sum(len(np.unique(rows[:, h])) for h in range(hkv))
  window_keys = -(-t // group) * (cfg.window + group - 1) * hkv
  kv = 2 * (blocks * cfg.select_block + window_keys) * d * itemsize
  rows = t * hq * d * (2 * itemsize + 4) + t * hq * 3 * 4   # q, out; cmp and gates in f32
  return kv + rows


def kernel_eval(v: dict, dtype, interpret: bool) -> dict:
  """The kernel rows of the JSON (module docstring), on --kernel_batch sequences."""
  from benchmarks.common import copy_ceiling, time_chain, time_fn
  from jaxspec.model import nsa
  from pallas_kernels import nsa_attention as kernels
  cfg = KERNEL_NSA
  hq, hkv, d = v["kernel_shape"]
  context, batch = v["kernel_context"], v["kernel_batch"]
  itemsize = jnp.dtype(dtype).itemsize
  rate, rates = copy_ceiling(v["copy_bytes"])
  rng = np.random.default_rng(0)
  keys = jax.random.split(jax.random.PRNGKey(0), 6)
  longest = max(v["kernel_rows"])
  capacity = se.capacity_for(context + longest)
  # Chained calls rotate through copies of the caches: one sequence's selected blocks (up to
  # ~26 MB at the paper's shapes) fit in a Hopper L2 (50 MB), so calls over one copy would time
  # the L2.
  copies = 1 if interpret else KV_COPIES
  c = nsa.num_compressed(capacity, cfg)
  caches = [tuple(jax.random.normal(kk, shape, dtype) for kk, shape in zip(
      jax.random.split(jax.random.fold_in(keys[0], i), 4),
      [(batch, capacity, hkv, d)] * 2 + [(batch, c, hkv, d)] * 2)) for i in range(copies)]
  lengths = jnp.full((batch,), context, jnp.int32)
  select = jax.jit(nsa.select_blocks, static_argnums=2)
  rows = []
  bar = tqdm(total=len(v["kernel_rows"]) * len(v["kernel_overlaps"]) * len(v["kernel_splits"]),
             desc="kernels",
             unit="setting", file=sys.stderr)

  def timed(fn, arg_sets, nbytes=None):
    # On a GPU, 8 calls chained in one program: a lone call's dispatch and sync (tens of us)
    # would otherwise dwarf kernels whose floors are a few us.
    seconds = (time_fn(lambda: fn(*arg_sets[0]), warmup=1, reps=1) if interpret
               else time_chain(fn, arg_sets))
    row = dict(us=round(seconds * 1e6, 2))
    if nbytes is not None:
      floor = nbytes / rate
      row.update(bytes=int(nbytes), floor_us=round(floor * 1e6, 2),
                 gb_s=round(nbytes / seconds / 1e9, 1), time_over_floor=round(seconds / floor, 2))
    return row

  with bar:
    for t in v["kernel_rows"]:
      q = jax.random.normal(keys[4], (batch, t, hq, d), dtype)
      cmp = jax.random.normal(keys[5], (batch, t, hq, d), jnp.float32)
      gates = jnp.full((batch, t, hq, 3), 0.5, jnp.float32)
      positions = np.arange(context, context + t)
      pos = jnp.asarray(np.broadcast_to(positions, (batch, t)), jnp.int32)
      num_blocks = nsa.num_select_blocks(capacity, cfg)
      compressed = functools.partial(kernels.nsa_compressed, cfg=cfg, num_blocks=num_blocks,
                                     interpret=interpret)
      routing_args = [(q, ck, cv, lengths, pos) for _, _, ck, cv in caches]
      routing = timed(compressed, routing_args)
      routing_one_launch = timed(functools.partial(compressed, splits=(1, 1)), routing_args)
      reuse = timed(functools.partial(compressed, importance=False), routing_args)
      importance = compressed(*routing_args[0])[1]
      top_n = timed(lambda imp: select(imp, pos, cfg), [(importance,)])
      for overlap in v["kernel_overlaps"]:
        idx = np.stack([synthetic_indices(rng, positions, hkv, overlap, cfg)
                        for _ in range(batch)])
        indices = jnp.asarray(idx)

        def nbytes(ind, group, shared):
          return sum(read_bytes(np.asarray(x), group, shared, (hq, hkv, d), cfg, itemsize)
                     for x in ind)

        def fused(group, shared, splits, ind=indices):
          return (functools.partial(kernels.nsa_select_window, cfg=cfg, group=group,
                                    shared=shared, splits=splits, interpret=interpret),
                  [(q, k, vv, lengths, pos, ind, gates, cmp) for k, vv, _, _ in caches])

        def chosen(group, splits):
          return splits or kernels.default_select_splits(batch, hkv, -(-t // group),
                                                         cfg.num_selected)
        for splits in v["kernel_splits"]:
          per_query = dict(timed(*fused(1, False, splits), nbytes(idx, 1, False)),
                           splits=chosen(1, splits))
          row = dict(rows=t, overlap=overlap, splits=splits or "auto", per_query=per_query,
                     routing=routing, routing_one_launch=routing_one_launch,
                     routing_without_importance=reuse, top_n=top_n)
          for g in [g for g in v["groups"] if g <= t]:
            merged = dict(timed(*fused(g, False, splits), nbytes(idx, g, False)),
                          splits=chosen(g, splits))
            shared_idx = nsa.shared_indices(indices, g)
            shared = dict(timed(*fused(g, True, splits, shared_idx), nbytes(shared_idx, g, True)),
                          splits=chosen(g, splits))
            merged["speedup"] = round(per_query["us"] / merged["us"], 2)
            shared["speedup"] = round(per_query["us"] / shared["us"], 2)
            row[f"merged_{g}"], row[f"shared_{g}"] = merged, shared
          rows.append(row)
          bar.update(1)
  return dict(shape=dict(heads=hq, kv_heads=hkv, head_dim=d), context=context, batch=batch,
              splits=[x or "auto" for x in v["kernel_splits"]], nsa=dataclasses.asdict(cfg),
              copy_gb_s=rates, interpret=interpret, rows=rows)


def plot_kernel(result: dict, out: str, title: str) -> str:
  """Speedup over per-query execution against overlap, one line per (schedule, G, T), at the
  first --kernel_splits setting."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(8, 4.5))
  first = result["splits"][0]
  rows = [r for r in result["rows"] if r["splits"] == first]
  title += f", splits {first}"
  for t in sorted({r["rows"] for r in rows}):
    mine = [r for r in rows if r["rows"] == t]
    for key in [k for k in mine[0] if k.startswith(("merged_", "shared_"))]:
      ax.plot([r["overlap"] for r in mine], [r[key]["speedup"] for r in mine], marker=".",
              linestyle="-" if key.startswith("merged") else "--", label=f"T={t} {key}")
  ax.axhline(1.0, color="gray", linewidth=0.8)
  ax.set_xlabel(f"blocks shared with the row before (of {KERNEL_NSA.num_selected})")
  ax.set_ylabel("speedup over per-query execution")
  ax.set_title(title, fontsize=9)
  ax.legend(fontsize=6, ncol=2)
  path = f"{os.path.splitext(out)[0]}_kernel.png"
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


# ----------------------------------------------------------------------------------------------
# The verification stage

def verify_schedules(t: int, group: int, num_layers: int) -> list[tuple[str, NSA, bool]]:
  """(name, plan, lossless) of each schedule a T-row verification pass is timed under; the reuse
  schedule alternates refresh and reuse layers, as the paper's Section 7.2 does."""
  alternating = tuple(i % 2 == 0 for i in range(num_layers))
  return [("per_query", NSA(), True),
          (f"merged_{group}", NSA(group=group), True),
          (f"shared_{group}", NSA(group=group, shared=True), False),
          ("reuse", NSA(refresh=alternating), False),
          (f"shared_{group}_reuse", NSA(group=group, shared=True, refresh=alternating), False)]


def accepted_per_round(rate: float, t: int) -> float:
  """Tokens a chain round of t rows yields when each draft is accepted with probability `rate`
  independently: 1 + a + ... + a^(t-1) (the accepted drafts and the verifier's own token)."""
  return (1 - rate ** t) / (1 - rate)


def _verify_pass(graphdef, state, tokens, cache, plan, backend):
  """One verification pass as the engine runs it: the layers under `plan`, the new rows' K/V
  (and completed compression blocks) written, the LM head; the cache's lengths do not move, so
  passes repeat over the same slots."""
  model = nnx.merge(graphdef, state)
  hidden, cache, used = model(tokens, cache.chain_positions(tokens.shape[1]), cache, plan,
                              backend)
  return cache, jnp.argmax(model.logits(hidden), -1), used


@functools.partial(jax.jit, static_argnums=(0, 5, 6), donate_argnums=3)
def _verify_passes(graphdef, state, tokens, cache, plan, backend, n):
  """n passes in one program (a loop, as the engine's rounds run: no host time between them);
  returns the cache, the last pass's argmax tokens and selections."""
  def body(_, carry):
    return _verify_pass(graphdef, state, tokens, carry[0], plan, backend)
  # The carry starts from zeros of the pass's outputs: one copy of the model in the program.
  shapes = jax.eval_shape(lambda *a: _verify_pass(graphdef, *a, backend), state, tokens, cache,
                          plan)
  zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes[1:])
  return jax.lax.fori_loop(0, n, body, (cache, *zeros))


def verify_eval(v: dict, model: Transformer, dtype, backend: str,
                on_row: Callable[[dict], None] | None = None) -> dict:
  """The verify evaluation (module docstring): per context and T, each schedule's pass time, its
  verification-side speedup over the autoregressive step at each acceptance label, and the
  adjacent-row overlap of the per-query selections. on_row: called with the result so far after
  each row (the caller writes it, so that a run cut short keeps its rows)."""
  cfg = model.cfg
  graphdef, state = nnx.split(model)
  group, batch, reps = v["verify_group"], v["verify_batch"], v["verify_reps"]
  rng = np.random.default_rng(0)
  rows = []

  box = {}    # the cache, donated from pass to pass, and the last pass's selections

  def passes(tokens, plan, n):
    """A thunk running n passes in one program; it returns their last argmax tokens."""
    def run():
      box["cache"], out, box["used"] = _verify_passes(graphdef, state, tokens, box["cache"],
                                                      plan, backend, n)
      return out
    return run

  def timed(tokens, plan):
    """Median seconds a pass: `reps` programs of PASSES passes each."""
    return time_fn(passes(tokens, plan, PASSES), warmup=1, reps=reps) / PASSES

  def summary():
    return dict(model=dataclasses.asdict(cfg), backend=backend, group=group, batch=batch,
                acceptance=v["verify_acceptance"], rows=list(rows))

  cases = [(c, t) for c in v["verify_contexts"] for t in [1] + v["verify_rows"]]
  bar = tqdm(total=sum(1 if t == 1 else len(verify_schedules(t, group, cfg.num_layers))
                       for _, t in cases), desc="verify passes", unit="schedule", file=sys.stderr)
  for context in v["verify_contexts"]:
    box["cache"] = random_cache(cfg, batch, context,
                                se.capacity_for(context + max(v["verify_rows"])), dtype=dtype)
    token_sets = {t: jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, t)), jnp.int32)
                  for t in [1] + v["verify_rows"]}
    t_ar = timed(token_sets[1], NSA())
    bar.update()
    for t in v["verify_rows"]:
      row = dict(context=context, rows=t, batch=batch, ar_us=round(t_ar * 1e6, 1))
      for name, plan, lossless in verify_schedules(t, group, cfg.num_layers):
        collect = name == "per_query"
        plan = dataclasses.replace(plan, collect=collect)
        sec = timed(token_sets[t], plan)
        entry = dict(us=round(sec * 1e6, 1), lossless=lossless,
                     over_per_query=None, speedup_over_ar={}, draft_budget_us={})
        for a in v["verify_acceptance"]:
          e = accepted_per_round(a, t)
          entry["speedup_over_ar"][str(a)] = round(e * t_ar / sec, 3)
          entry["draft_budget_us"][str(a)] = round(max(0.0, e * t_ar - sec) / (t - 1) * 1e6, 1)
        if collect:
          positions = np.arange(context, context + t)
          stats = overlap_stats(np.asarray(box["used"][:, 0]), positions, cfg.nsa, (group,))
          row["overlap"] = {k: round(float(np.nanmean(x)), 4) for k, x in stats.items()}
        row[name] = entry
        bar.update()
      for name, *_ in verify_schedules(t, group, cfg.num_layers):
        row[name]["over_per_query"] = round(row["per_query"]["us"] / row[name]["us"], 3)
      if v["verify_profile"] and backend == "pallas":
        row["profile"] = {}
        for name, rows_, plan in [("ar", 1, NSA())] + [
            (name, t, plan) for name, plan, _ in verify_schedules(t, group, cfg.num_layers)]:
          row["profile"][name] = kernel_table(passes(token_sets[rows_], plan, 1), top=14)
      rows.append(row)
      if on_row is not None:
        on_row(summary())
    box.clear()
  bar.close()
  return summary()


def plot_verify(result: dict, out: str, title: str) -> str:
  """Verification-side speedup over autoregressive NSA decoding against the acceptance label,
  one panel per (context, T), one line per schedule."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  rows = result["rows"]
  fig, axes = plt.subplots(1, len(rows), figsize=(4 * len(rows), 3.6), squeeze=False)
  acc = result["acceptance"]
  for ax, row in zip(axes[0], rows):
    for name in [k for k in row if isinstance(row[k], dict) and "speedup_over_ar" in row[k]]:
      ax.plot(acc, [row[name]["speedup_over_ar"][str(a)] for a in acc], marker=".",
              linestyle="-" if row[name]["lossless"] else "--", label=name)
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_title(f"{row['context']} tokens, T = {row['rows']}", fontsize=9)
    ax.set_xlabel("per-token acceptance (label)")
  axes[0][0].set_ylabel("verification side x AR NSA (drafting not counted)")
  axes[0][0].legend(fontsize=6)
  fig.suptitle(title, fontsize=9)
  path = f"{os.path.splitext(out)[0]}_verify.png"
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


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


def evaluate(model: Transformer | None, tokenizer, name: str | None, v: dict, out: str,
             dtype, tiny: bool = False) -> dict:
  """Run the evaluations `v` asks for and write the JSON (PNGs beside it). The model is needed
  for overlap only; verify builds its own random one (`tiny`: the smoke run's TINY shape instead
  of VERIFY_MODEL)."""
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  settings = dict(dtype=jnp.dtype(dtype).name, device=device_name(), commit=git_commit(),
                  date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                  **{k: v[k] for k in ("evals", "groups")})
  result = dict(settings=settings, pngs=[])
  if "overlap" in v["evals"]:
    tokens = se.book_tokens(tokenizer)
    longest = max(v["contexts"])
    if longest > len(tokens):
      raise ValueError(f"--contexts {longest} exceeds the book's {len(tokens)} tokens")
    settings.update(model=name, nsa=dataclasses.asdict(model.cfg.nsa),
                    **{k: v[k] for k in ("contexts", "passages", "rows")})
    result["overlap"] = overlap(model, tokens, v, dtype)
    result["pngs"] += plot_overlap(result["overlap"], out, name)
    write_json(out, dict(result, partial=True))     # kept if a later evaluation is cut short
  if "kernel" in v["evals"]:
    interpret = jax.default_backend() != "gpu"
    result["kernel"] = kernel_eval(v, dtype, interpret)
    label = "interpret mode: times mean nothing" if interpret else device_name()
    result["pngs"].append(plot_kernel(result["kernel"], out, f"SSV kernels ({label})"))
    write_json(out, dict(result, partial=True))
  if "verify" in v["evals"]:
    backend = "pallas" if jax.default_backend() == "gpu" else "reference"
    vm = init_random(TINY if tiny else VERIFY_MODEL, dtype=dtype)
    settings.update({k: v[k] for k in ("verify_contexts", "verify_rows", "verify_group",
                                       "verify_batch", "verify_acceptance", "verify_reps",
                                       "verify_profile")})
    result["verify"] = verify_eval(
        v, vm, dtype, backend,
        on_row=lambda rows: write_json(out, dict(result, verify=rows, partial=True)))
    label = device_name() if backend == "pallas" else "reference on the CPU: times mean nothing"
    result["pngs"].append(plot_verify(result["verify"], out, "SSV verification stage, random "
                                      f"weights, acceptance as labelled ({label})"))
    del vm
  write_json(out, result)
  for r in result.get("overlap", []):
    print(f"{r['context']:>6} tokens: " + "  ".join(f"{k} {x:.3f}" for k, x in r["mean"].items()))
  for r in result.get("kernel", {}).get("rows", []):
    best = {k: x["speedup"] for k, x in r.items() if isinstance(x, dict) and "speedup" in x}
    print(f"T={r['rows']:>3} overlap {r['overlap']:>2}/{KERNEL_NSA.num_selected} splits "
          f"{r['splits']}: per-query "
          f"{r['per_query']['us']:.1f} us ({r['per_query'].get('time_over_floor')}x floor); "
          + ", ".join(f"{k} {x:.2f}x" for k, x in best.items()))
  for r in result.get("verify", {}).get("rows", []):
    a = str(result["verify"]["acceptance"][-1])
    print(f"{r['context']:>6} tokens T={r['rows']:>3}: AR {r['ar_us']:.0f} us; " + ", ".join(
        f"{k} {x['us']:.0f} us ({x['over_per_query']:.2f}x, {x['speedup_over_ar'][a]:.2f}x AR "
        f"at a={a})" for k, x in r.items() if isinstance(x, dict) and "us" in x)
        + f"; adjacent overlap {r['overlap']['adjacent']:.2f}")
  print(f"wrote {out}")
  return result


def main(argv):
  del argv
  FLAGS = flags.FLAGS
  cli.quiet_logging()
  dtype = jnp.float32 if FLAGS.dtype == "float32" else jnp.bfloat16
  try:
    v = parse_flags({k: getattr(FLAGS, k) for k in FLAG_NAMES})
    model = tokenizer = name = None
    if "overlap" in v["evals"]:
      model, tokenizer, name = load(None if FLAGS.random else FLAGS.model, FLAGS.random, dtype)
  except (OSError, ValueError) as e:
    cli.fail(PROG, str(e))
  try:
    evaluate(model, tokenizer, name, v, FLAGS.out, dtype, tiny=FLAGS.random)
  except (OSError, ValueError) as e:
    cli.fail(PROG, str(e))


if __name__ == "__main__":
  define_flags()
  cli.run(main, PROG)
