"""SpecAttn's perplexity against KV reduction (the paper's main table), and the layer-map ablation.
SpecAttn CHANGES the target's output (the target verifies under a sparse mask); this measures how
much.

  python -m benchmarks.specattn --target=qwen2.5-coder-1.5b --draft=qwen2.5-coder-0.5b \
      --specattn_map=checkpoints/qwen2.5-coder-1.5b/specattn_map.qwen2_5-coder-0_5b.json
  python -m benchmarks.specattn --random_pair --window=256 --windows=1   # CPU smoke run

Teacher forcing over --windows windows of --window tokens of frankenstein.txt ($JAXSPEC_DATA,
else ../shared/data): the first --prefill_frac of a window is prefilled densely by both models,
the rest is read in chunks of gamma + 1 tokens (a trailing part shorter than a chunk is not
scored; `benchmarks.sparse_eval.teacher_forced`). For each chunk at positions n..n+gamma the draft
model reads the chunk (one dense pass, collecting every row's attention weights); its rows of
positions n..n+gamma-1, the rows that would have sampled the drafts, give SpecAttn's mask exactly
as a decoding round makes it (`jaxspec.drafting.specattn.kept_union`); the target reads the chunk
under that mask and is scored on the next tokens. Methods, all with the first two target layers
dense:
  full          dense attention (the reference perplexity);
  specattn@p    for each p in --top_ps, with each map in --maps (kl: --specattn_map's file;
                proportional; argmax: needs the map file's similarity matrix);
  streaming@p   StreamingLLM: 4 sink tokens + the most recent keys, as many per chunk as
                specattn@p (kl map, or the first map given) kept on average over its sparse layers
                in that chunk (the same KV reduction);
  quest@p       Quest at the same per-chunk budget: 16-token pages per KV head, scored by the
                chunk's query rows (a page's largest q.k bound over them, per layer from its own
                queries), the partial last page read densely and counted in the budget
                (`benchmarks.sparse_eval.Quest`).

KV reduction: 1 - (keys the target's attention reads) / (keys dense attention reads), summed over
all target layers and chunks, each chunk's own gamma + 1 keys counted in both (the dense layers
read everything). Perplexity: exp(mean NLL) over every scored token.
Output: JSON (--out; rewritten after every row, `complete` false until the last) and a PNG
(perplexity against KV reduction, one line per method).
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import sys
from typing import Callable

import jax.numpy as jnp
import numpy as np
from absl import flags

from benchmarks import sparse_eval as se
from benchmarks.common import device_name, git_commit, write_json
from jaxspec import cli
from jaxspec.drafting import specattn
from jaxspec.model.attention import LayerMapped, default_backend
from jaxspec.pairmap import calibration_windows

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


@dataclasses.dataclass(frozen=True)
class SpecAttn(se.Method):
  """The draft reads the chunk; its rows' top-p sets, united, are the sparse layers' lists."""
  uses_draft = True
  spec: specattn.SpecAttnConfig | None = None

  def plan(self, target, draft, tcache, dcache, tokens, pos, budget, backend):
    dcache, rows = se.draft_rows(draft, dcache, tokens, pos, "mean")   # [gamma, Ld, B, S]
    rows = rows[:, jnp.asarray(self.spec.draft_layers)]
    n = pos[:, 0]
    idx, counts = specattn.kept_union(rows, n, self.spec, self.spec.k_max(tcache.capacity),
                                      interpret=backend != "pallas")
    return LayerMapped(indices=idx, counts=counts, tail_start=n, slots=self.spec.slots), dcache


def evaluate(target, draft, windows: np.ndarray, *, prefill: int, gamma: int, method: se.Method,
             budgets: list[np.ndarray] | None = None, dtype=jnp.float32, desc: str | None = None
             ) -> tuple[dict, list[np.ndarray]]:
  """Teacher-forced perplexity and KV reduction of `method` over windows [B, W] (`budgets`: per
  chunk the prefix keys [B] streaming and Quest may read). Returns (perplexity, kv_reduction,
  scored tokens; per chunk the prefix keys each layer read [L, B])."""
  return se.teacher_forced(target, draft, windows, prefill_len=prefill, gamma=gamma, method=method,
                           budgets=None if budgets is None else budgets.__getitem__, dtype=dtype,
                           backend=default_backend(), desc=desc)


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
        dtype=jnp.float32, on_row: Callable[[list[dict]], None] | None = None) -> list[dict]:
  """Every method's row: full, specattn@p per map, streaming@p and quest@p at specattn's budget.
  on_row(rows so far), after each row (a 16K window takes minutes per method)."""
  first = next(iter(maps))
  dense = specattn.DENSE_LAYERS
  capacity = se.capacity_for(windows.shape[1])
  kw = dict(prefill=prefill, gamma=gamma, dtype=dtype)
  full, _ = evaluate(target, draft, windows, method=se.Method(), desc="full", **kw)
  rows = []

  def add(row):
    rows.append(dict(row, ppl_increase=row["perplexity"] / full["perplexity"] - 1))
    if on_row is not None:
      on_row(rows)

  add(dict(method="full", **full))
  for p in top_ps:
    for name, layers in maps.items():
      spec = specattn.SpecAttnConfig(layers=layers, top_p=p)
      res, kept = evaluate(target, draft, windows, method=SpecAttn(spec=spec),
                           desc=f"specattn@{p} {name}", **kw)
      add(dict(method="specattn", top_p=p, map=name, **res))
      if name != first:
        continue
      sparse = np.asarray(spec.slots) >= 0
      budgets = [k[sparse].mean(axis=0).round().astype(np.int32) for k in kept]
      for method, label in ((se.Streaming(dense_layers=dense), "streaming"),
                            (se.Quest(dense_layers=dense, max_pages=capacity // se.PAGE), "quest")):
        res, _ = evaluate(target, draft, windows, method=method, budgets=budgets,
                          desc=f"{label}@{p}", **kw)
        add(dict(method=label, top_p=p, map=name, **res))
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
    if _GAMMA.value < 1 or not 0 < _PREFILL.value < 1:
      raise ValueError("--gamma must be >= 1 and --prefill_frac in (0, 1)")
    dtype = jnp.float32 if _DTYPE.value == "float32" else jnp.bfloat16
    pair = se.load_pair(_TARGET.value, _DRAFT.value, _RANDOM_PAIR.value, dtype,
                        random_flag="--random_pair")
    target, draft, names = pair.target, pair.draft, pair.names
    windows = calibration_windows(se.book_tokens(pair.tokenizer), _WINDOWS.value, _WINDOW.value)
    maps = _maps(target, draft)
    if not maps:
      raise ValueError("no layer map to run (--maps)")
  except (OSError, ValueError) as e:
    cli.fail("benchmarks.specattn", str(e))
  prefill = max(1, int(_PREFILL.value * _WINDOW.value))
  settings = dict(target=names[0], draft=names[1], window=_WINDOW.value, windows=len(windows),
                  prefill=prefill, gamma=_GAMMA.value, dtype=_DTYPE.value, maps=maps,
                  device=device_name(), commit=git_commit(), date=datetime.date.today().isoformat())
  # Written after every row, marked incomplete until the last: a run cut short keeps its rows.
  rows = run(target, draft, windows, top_ps=top_ps, maps=maps, prefill=prefill,
             gamma=_GAMMA.value, dtype=dtype,
             on_row=lambda rows: write_json(_OUT.value, {"settings": settings, "results": rows,
                                                         "complete": False}))
  write_json(_OUT.value, {"settings": settings, "results": rows, "complete": True})
  plot(rows, os.path.splitext(_OUT.value)[0] + ".png",
       f"{names[1]} -> {names[0]}, {len(windows)} x {_WINDOW.value} tokens, gamma {_GAMMA.value}")
  for r in rows:
    print(f"{r['method']:10s} p={r.get('top_p', '-')!s:5s} map={r.get('map', '-'):12s} "
          f"ppl {r['perplexity']:.3f} ({r['ppl_increase']:+.2%}) KV reduction "
          f"{r['kv_reduction']:.1%}")


if __name__ == "__main__":
  cli.run(main, "benchmarks.specattn")
