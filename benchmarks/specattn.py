"""SpecAttn's perplexity against KV reduction (the paper's main table), and the layer-map ablation.

  python -m benchmarks.specattn --target=qwen2.5-coder-1.5b --draft=qwen2.5-coder-0.5b \
      --specattn_map=checkpoints/qwen2.5-coder-1.5b/specattn_map.qwen2_5-coder-0_5b.json
  python -m benchmarks.specattn --random_pair --window=256 --windows=1   # CPU smoke run

Teacher forcing over --windows windows of --window tokens of frankenstein.txt ($JAXSPEC_DATA,
else ../shared/data): the first --prefill_frac of a window is prefilled densely by both models,
the rest is read in chunks of gamma + 1 tokens (a trailing part shorter than a chunk is not
scored). For each chunk at positions n..n+gamma the draft model reads the chunk (one dense pass,
collecting every row's attention weights); its rows of positions n..n+gamma-1, the rows that
would have sampled the drafts, give SpecAttn's mask exactly as a decoding round makes it
(`jaxspec.drafting.specattn.kept_union`); the target reads the chunk under that mask and is scored
on the next tokens. Methods, all with the first two target layers dense:
  full          dense attention (the reference perplexity);
  specattn@p    for each p in --top_ps, with each map in --maps (kl: --specattn_map's file;
                proportional; argmax: needs the map file's similarity matrix);
  streaming@p   StreamingLLM: 4 sink tokens + the most recent keys, as many per chunk as
                specattn@p (kl map, or the first map given) kept on average over its sparse layers
                in that chunk (the same KV reduction).
Quest is not run: its page choice is per query token (`QuestPages` takes one new token a step),
which chunked teacher forcing does not give it.

KV reduction: 1 - (keys the target's attention reads) / (keys dense attention reads), summed over
all target layers and chunks, each chunk's own gamma + 1 keys counted in both (the dense layers
read everything). Perplexity: exp(mean NLL) over every scored token.
Output: JSON (--out) and a PNG (perplexity against KV reduction, one line per method).
"""
from __future__ import annotations

import datetime
import functools
import math
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from flax import nnx

from benchmarks.common import device_name, git_commit, write_json
from benchmarks.workloads import BOOK
from jaxspec.io.data import data_path
from jaxspec import cli
from jaxspec.drafting import specattn
from jaxspec.model.attention import Dense, LayerMapped, Prefill, ScoreSpec
from jaxspec.model.config import ModelConfig
from jaxspec.model.kv_cache import KVCache
from jaxspec.model.transformer import init_random

_TARGET = flags.DEFINE_string("target", None, "target model spec")
_DRAFT = flags.DEFINE_string("draft", None, "draft model spec (same tokenizer)")
_RANDOM_PAIR = flags.DEFINE_bool("random_pair", False, "a tiny random pair on the book's bytes "
                                 "(a smoke run: its numbers mean nothing)")
_MAP_FILE = flags.DEFINE_string("specattn_map", None, "layer map JSON (jaxspec.specattn_map); "
                                "needed by the kl and argmax maps")
_MAPS = flags.DEFINE_list("maps", ["kl", "proportional", "argmax"], "layer maps to compare")
_TOP_PS = flags.DEFINE_list("top_ps", ["0.95", "0.97", "0.99"], "SpecAttn's kept masses")
_WINDOW = flags.DEFINE_integer("window", 2048, "tokens per window")
_WINDOWS = flags.DEFINE_integer("windows", 8, "windows (evenly spaced over the book)")
_PREFILL = flags.DEFINE_float("prefill_frac", 0.1, "share of a window prefilled densely")
_GAMMA = flags.DEFINE_integer("gamma", 4, "chunks of gamma + 1 tokens")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "weights and cache")
_OUT = flags.DEFINE_string("out", "benchmarks/out/specattn.json", "JSON results (PNG beside)")

TINY = (ModelConfig(arch="qwen3", vocab_size=256, hidden_size=64, intermediate_size=128,
                    num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16),
        ModelConfig(arch="qwen3", vocab_size=256, hidden_size=64, intermediate_size=128,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16))


@functools.partial(jax.jit, static_argnames=("graphdefs", "mode", "spec", "gamma"))
def _chunk(graphdefs, params, tcache, dcache, tokens, labels, budget, *, mode, spec, gamma):
  """One chunk: tokens [B, gamma + 1] at positions tcache.lengths.., labels the tokens after them.
  Returns (caches with lengths moved on, NLL summed over the chunk [B], keys read per sparse
  layer [U, B] (-1: dense), and the kept count per draft layer in use)."""
  target = nnx.merge(graphdefs[0], params[0])
  draft = nnx.merge(graphdefs[1], params[1])
  n = tcache.lengths
  t = gamma + 1
  pos = n[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
  b = tokens.shape[0]
  u = len(spec.draft_layers)
  counts = jnp.zeros((u, b), jnp.int32)
  if mode == "full":
    plan = Dense()
  elif mode == "specattn":
    _, dcache, scores = draft(tokens, pos, dcache, Dense(scores=ScoreSpec("weights", per_row=True)))
    rows = jnp.moveaxis(scores[:, :, :gamma], 2, 0)[:, jnp.asarray(spec.draft_layers)]
    idx, counts = specattn.kept_union(rows, n, spec, spec.k_max(tcache.capacity))
    plan = LayerMapped(indices=idx, counts=counts, tail_start=n, slots=spec.slots)
  else:   # streaming: 4 sinks + the most recent (budget - 4) keys, one list for every sparse layer
    k = jnp.minimum(budget, n)
    sinks = jnp.minimum(4, k)
    idx = jnp.broadcast_to(jnp.arange(4, dtype=jnp.int32), (1, b, 4))
    plan = LayerMapped(indices=idx, counts=sinks[None], tail_start=jnp.maximum(n - (k - sinks), sinks),
                       slots=tuple(-1 if s < 0 else 0 for s in spec.slots))
    counts = jnp.broadcast_to(k, (u, b))
  hidden, tcache, _ = target(tokens, pos, tcache, plan)
  logp = jax.nn.log_softmax(target.logits(hidden), axis=-1)
  nll = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0].sum(-1)
  return tcache.replace(lengths=n + t), dcache.replace(lengths=n + t), nll, counts


def evaluate(target, draft, windows: np.ndarray, *, prefill: int, gamma: int, mode: str,
             spec: specattn.SpecAttnConfig, budgets: list[np.ndarray] | None = None,
             dtype=jnp.float32) -> dict:
  """Teacher-forced NLL and KV reads of `mode` ('full', 'specattn', 'streaming') over windows
  [B, W]; `budgets`: streaming's keys per chunk [B] (from a specattn run). Returns perplexity,
  kv_reduction, scored tokens and, for specattn, the per-chunk mean kept counts [B]."""
  b, w = windows.shape
  cap = -(-w // 128) * 128
  graphdefs, params = zip(nnx.split(target), nnx.split(draft))
  tok = jnp.asarray(windows, jnp.int32)
  tcache = KVCache.create(target.cfg, b, cap, dtype)
  dcache = KVCache.create(draft.cfg, b, cap, dtype)
  pos = jnp.broadcast_to(jnp.arange(prefill, dtype=jnp.int32), (b, prefill))
  _, tcache, _ = target(tok[:, :prefill], pos, tcache, Prefill())
  _, dcache, _ = draft(tok[:, :prefill], pos, dcache, Prefill())
  lengths = jnp.full((b,), prefill, jnp.int32)
  tcache, dcache = tcache.replace(lengths=lengths), dcache.replace(lengths=lengths)
  t = gamma + 1
  n_layers = target.cfg.num_layers
  sparse_layers = sum(s >= 0 for s in spec.slots)
  nll, scored, reads, dense_reads, kept = 0.0, 0, 0.0, 0.0, []
  for c, start in enumerate(range(prefill, w - t, t)):
    budget = jnp.asarray(budgets[c] if budgets is not None else np.zeros(b), jnp.int32)
    tcache, dcache, chunk_nll, counts = _chunk(
        graphdefs, params, tcache, dcache, tok[:, start:start + t], tok[:, start + 1:start + t + 1],
        budget, mode=mode, spec=spec, gamma=gamma)
    nll += float(chunk_nll.sum())
    scored += b * t
    full = (start + t) * b
    dense_reads += n_layers * full
    if mode == "full":
      reads += n_layers * full
      continue
    per_layer = np.asarray(counts)[[max(s, 0) for s in spec.slots]]        # [L, B]
    sparse = np.array([s >= 0 for s in spec.slots])
    reads += (n_layers - sparse_layers) * full + float((per_layer[sparse] + t).sum())
    kept.append(per_layer[sparse].mean(axis=0).round().astype(np.int32))
  out = dict(perplexity=math.exp(nll / scored), kv_reduction=1 - reads / dense_reads,
             scored_tokens=scored)
  return out, kept


def _maps(target, draft) -> dict[str, tuple[int, ...]]:
  from jaxspec import specattn_map as sm
  lt, ld = target.cfg.num_layers, draft.cfg.num_layers
  saved = sm.load_map(_MAP_FILE.value, target, draft) if _MAP_FILE.value else None
  out = {}
  for kind in _MAPS.value:
    if kind == "proportional":
      out[kind] = sm.proportional_map(lt, ld)
    elif saved is None or (kind == "argmax" and saved.similarity is None):
      print(f"[specattn] skipping the {kind} map: it needs --specattn_map", file=sys.stderr)
    elif kind == "kl":
      out[kind] = sm.monotone_map(np.asarray(saved.similarity)) if saved.similarity else saved.layers
    else:
      out[kind] = sm.argmax_map(np.asarray(saved.similarity))
  return out


def run(target, draft, windows: np.ndarray, *, top_ps, maps: dict, prefill: int, gamma: int,
        dtype=jnp.float32) -> list[dict]:
  """Every method's row: full, specattn@p per map, streaming@p at specattn's reduction."""
  any_map = next(iter(maps.values()))
  base = specattn.SpecAttnConfig(layers=any_map)
  full, _ = evaluate(target, draft, windows, prefill=prefill, gamma=gamma, mode="full", spec=base,
                     dtype=dtype)
  rows = [dict(method="full", **full)]
  for p in top_ps:
    for name, layers in maps.items():
      spec = specattn.SpecAttnConfig(layers=layers, top_p=p)
      res, kept = evaluate(target, draft, windows, prefill=prefill, gamma=gamma, mode="specattn",
                           spec=spec, dtype=dtype)
      rows.append(dict(method="specattn", top_p=p, map=name, **res))
      if name == next(iter(maps)):
        res, _ = evaluate(target, draft, windows, prefill=prefill, gamma=gamma, mode="streaming",
                          spec=spec, budgets=kept, dtype=dtype)
        rows.append(dict(method="streaming", top_p=p, map=name, **res))
  for r in rows:
    r["ppl_increase"] = r["perplexity"] / full["perplexity"] - 1
  return rows


def plot(rows: list[dict], path: str, title: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(6, 4))
  for key in sorted({(r["method"], r.get("map")) for r in rows if r["method"] != "full"}):
    pts = sorted((r["kv_reduction"], r["perplexity"]) for r in rows
                 if (r["method"], r.get("map")) == key)
    ax.plot(*zip(*pts), marker="o", label=f"{key[0]} ({key[1]} map)")
  full = next(r for r in rows if r["method"] == "full")
  ax.axhline(full["perplexity"], color="k", ls="--", label="full attention")
  ax.set_xlabel("KV reduction")
  ax.set_ylabel("perplexity")
  ax.set_yscale("log")
  ax.set_title(title, fontsize=8)
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv):
  del argv
  cli.quiet_logging()
  try:
    top_ps = [specattn.check_top_p(float(p)) for p in _TOP_PS.value]
    if _RANDOM_PAIR.value == (_TARGET.value is not None or _DRAFT.value is not None):
      raise ValueError("give --target and --draft, or --random_pair")
    if _GAMMA.value < 1 or not 0 < _PREFILL.value < 1:
      raise ValueError("--gamma must be >= 1 and --prefill_frac in (0, 1)")
    dtype = jnp.float32 if _DTYPE.value == "float32" else jnp.bfloat16
    with open(data_path(BOOK), encoding="utf-8-sig") as f:
      text = f.read()
    if _RANDOM_PAIR.value:
      target, draft = (init_random(c, dtype=dtype, seed=i) for i, c in enumerate(TINY))
      tokens = np.frombuffer(text.encode(), np.uint8).astype(np.int32)
      names = ("random tiny target", "random tiny draft")
    else:
      from jaxspec.io.loading import check_draft_pair, load_model
      t, d = load_model(_TARGET.value, dtype=dtype), load_model(_DRAFT.value, dtype=dtype)
      check_draft_pair(t, d, _TARGET.value, _DRAFT.value)
      target, draft = t.model, d.model
      tokens = np.asarray(t.tokenizer.encode(text), np.int32)
      names = (_TARGET.value, _DRAFT.value)
    from jaxspec.specattn_map import calibration_windows
    windows = calibration_windows(tokens, _WINDOWS.value, _WINDOW.value)
    maps = _maps(target, draft)
    if not maps:
      raise ValueError("no layer map to run (--maps)")
  except (OSError, ValueError) as e:
    cli.fail("benchmarks.specattn", str(e))
  prefill = max(1, int(_PREFILL.value * _WINDOW.value))
  rows = run(target, draft, windows, top_ps=top_ps, maps=maps, prefill=prefill,
             gamma=_GAMMA.value, dtype=dtype)
  settings = dict(target=names[0], draft=names[1], window=_WINDOW.value, windows=len(windows),
                  prefill=prefill, gamma=_GAMMA.value, dtype=_DTYPE.value, maps=maps,
                  device=device_name(), commit=git_commit(), date=datetime.date.today().isoformat())
  write_json(_OUT.value, {"settings": settings, "results": rows})
  plot(rows, os.path.splitext(_OUT.value)[0] + ".png",
       f"{names[1]} -> {names[0]}, {len(windows)} x {_WINDOW.value} tokens, gamma {_GAMMA.value}")
  for r in rows:
    print(f"{r['method']:10s} p={r.get('top_p', '-')!s:5s} map={r.get('map', '-'):12s} "
          f"ppl {r['perplexity']:.3f} ({r['ppl_increase']:+.2%}) KV reduction "
          f"{r['kv_reduction']:.1%}")


if __name__ == "__main__":
  cli.run(main, "benchmarks.specattn")
