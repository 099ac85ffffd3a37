"""STS's head map: which draft head's attention picks the keys of each target head (arXiv STS §4.1,
Algorithm 1), one map per budget k.

  python -m jaxspec.sts_map --draft=qwen2.5-coder-0.5b --target=qwen2.5-coder-1.5b --budget=256
  python -m jaxspec.sts_map --draft=... --target=... --budget=256 --granularity=q --out=map.json

Calibration: the first `--samples` WikiText-2 articles (`wikitext2_test.txt` in $JAXSPEC_DATA, else
../shared/data beside the repo; an article runs from one " = Title = " line to the next), each cut
to `--max_tokens` tokens, are prefilled through both models, and the attention weights of each
sample's last `--rows` tokens over the sample are recorded per head (`pairmap.attention_rows`).
For every row and head the top-k keys (k = the budget, `lax.top_k`: ties to the lower position)
form a mask; for each target head the map picks the draft head, of any layer, whose masks
intersect the target head's own most, summed over every recorded row (ties to the lower draft
layer, then head).

Granularity: 'kv' (the default) maps each target KV head, its attention the mean over its query
group, to a draft KV head (the draft's group mean); a target layer then reads one index list of
k keys per KV head, the unit that GQA shares and `sparse_attention` gathers (k rows of K and V per
KV head). 'q' maps each target query head to a draft query head; at run time the lists of a KV
group's G query heads are united and capped at k per KV head, so the gathers stay k rows per KV
head, but the draft must emit one row per query head and its collection runs in the pure-JAX
reference only.

The map is saved as a small JSON beside the target's checkpoint (`default_map_path`): the pair
(`pairmap.pair_entry`), the budget, the granularity, per target layer the [draft layer, draft head]
of each target head and the mean overlap (the share of the target head's top-k its draft head's
top-k found). `load_map` refuses a file made for another pair or budget with a one-line
ValueError.
"""
from __future__ import annotations

import dataclasses
import functools
import re
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from jaxspec import cli, pairmap
from jaxspec.model.transformer import Transformer

GRANULARITIES = ("kv", "q")
WHAT = "STS head map"
TOOL = "jaxspec.sts_map"


def check_budget(budget) -> int:
  """The budget as an int when it is an integer >= 1; else a one-line ValueError."""
  if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)) or budget < 1:
    raise ValueError(f"the STS budget (keys each target head reads per round, besides the new "
                     f"tokens) must be an integer >= 1, got {budget!r}")
  return int(budget)


def heads_of(model: Transformer, granularity: str) -> int:
  """Heads per layer at a granularity: KV heads ('kv') or query heads ('q')."""
  if granularity not in GRANULARITIES:
    raise ValueError(f"granularity must be one of {', '.join(GRANULARITIES)}, got "
                     f"{granularity!r}")
  return model.cfg.num_kv_heads if granularity == "kv" else model.cfg.num_heads


# ----------------------------------------------------------------------------------------------
# The search (pure functions)

@functools.partial(jax.jit, static_argnames=("budget",))
def _topk_masks(rows: jax.Array, budget: int) -> jax.Array:
  """rows [L, B, R, H, S] weights -> [L*H, B*R, S] float32 0/1: each row's top-`budget` keys."""
  l, b, r, h, s = rows.shape
  x = rows.transpose(0, 3, 1, 2, 4).reshape(l * h, b * r, s)
  _, idx = jax.lax.top_k(x, budget)
  return jnp.zeros(x.shape, jnp.float32).at[
      jnp.arange(l * h)[:, None, None], jnp.arange(b * r)[None, :, None], idx].set(1.0)


@jax.jit
def _overlap(target_masks: jax.Array, draft_masks: jax.Array) -> jax.Array:
  """[Nt, R, S], [Nd, R, S] masks -> [Nt, Nd]: the keys each pair of heads both kept, summed over
  the rows."""
  return jnp.einsum("jrs,irs->ji", target_masks, draft_masks)


def overlap_counts(target_rows: jax.Array, draft_rows: jax.Array, budget: int) -> np.ndarray:
  """target_rows [Lt, B, R, Ht, S], draft_rows [Ld, B, R, Hd, S] (the same rows of both models)
  -> [Lt*Ht, Ld*Hd] int64: per (target head, draft head), sum over rows of |top-k(t) ∩ top-k(d)|.
  Heads are flattened layer-major (layer * H + head)."""
  out = _overlap(_topk_masks(target_rows, budget), _topk_masks(draft_rows, budget))
  return np.asarray(jnp.round(out), np.int64)


def best_heads(overlap: np.ndarray, draft_heads: int) -> tuple[tuple[int, int], ...]:
  """overlap [Lt*Ht, Ld*Hd] -> per target head (flat, layer-major) its (draft layer, draft head):
  the largest overlap, ties to the lower flat draft index."""
  best = np.argmax(np.asarray(overlap), axis=1)
  return tuple((int(i) // draft_heads, int(i) % draft_heads) for i in best)


def calibrate(target: Transformer, draft: Transformer, samples: Sequence[np.ndarray], *,
              budget: int, rows: int, granularity: str = "kv", progress: bool = False
              ) -> np.ndarray:
  """Overlap counts [Lt*Ht, Ld*Hd] summed over `samples` (token arrays, each longer than `rows`,
  whose last `rows` tokens all see at least `budget` keys), one sample per forward pass."""
  from tqdm import tqdm
  check_budget(budget)
  ht, hd = heads_of(target, granularity), heads_of(draft, granularity)
  total = np.zeros((target.cfg.num_layers * ht, draft.cfg.num_layers * hd), np.int64)
  for tokens in tqdm(samples, desc="calibration", unit="sample", disable=not progress):
    tokens = np.asarray(tokens, np.int32)
    if len(tokens) - rows + 1 < budget or len(tokens) <= rows:
      raise ValueError(f"a calibration sample of {len(tokens)} tokens is too short for {rows} rows "
                       f"that each see {budget} keys")
    w = jnp.asarray(tokens)[None]
    total += overlap_counts(pairmap.attention_rows(target, w, rows, granularity),
                            pairmap.attention_rows(draft, w, rows, granularity), budget)
  return total


def wikitext_samples(text: str, n: int) -> list[str]:
  """The first n articles of WikiText-2's raw text (an article starts at a ' = Title = ' line;
  ' = = Section = = ' lines stay inside it)."""
  starts = [m.start() for m in re.finditer(r"^ = [^=].* = $", text, flags=re.M)]
  if not starts:
    return [text][:n]
  bounds = starts + [len(text)]
  return [text[a:b] for a, b in zip(bounds, bounds[1:])][:n]


# ----------------------------------------------------------------------------------------------
# The map file

@dataclasses.dataclass(frozen=True)
class HeadMap:
  """heads[j][h]: the (draft layer, draft head) whose top-k picks target layer j's head h (KV head
  or query head per `granularity`) at `budget`; overlap[j][h]: the share of the target head's
  top-k that its draft head's top-k found on the calibration rows."""
  heads: tuple[tuple[tuple[int, int], ...], ...]
  budget: int
  granularity: str
  target: dict
  draft: dict
  overlap: tuple[tuple[float, ...], ...] | None = None

  def to_json(self) -> dict:
    return dataclasses.asdict(self)


def make_map(overlap: np.ndarray, rows: int, target: Transformer, draft: Transformer,
             target_name: str, draft_name: str, budget: int, granularity: str = "kv") -> HeadMap:
  """The head map from overlap counts over `rows` recorded rows, named and fingerprinted."""
  ht, hd = heads_of(target, granularity), heads_of(draft, granularity)
  pairs = best_heads(overlap, hd)
  best = np.max(np.asarray(overlap), axis=1) / (rows * budget)
  lt = target.cfg.num_layers
  return HeadMap(heads=tuple(tuple(pairs[j * ht:(j + 1) * ht]) for j in range(lt)),
                 budget=check_budget(budget), granularity=granularity,
                 target=pairmap.pair_entry(target, target_name),
                 draft=pairmap.pair_entry(draft, draft_name),
                 overlap=tuple(tuple(round(float(x), 4) for x in best[j * ht:(j + 1) * ht])
                               for j in range(lt)))


def default_map_path(target_source: str | Path, draft_name: str, budget: int) -> Path:
  """Beside the target: <checkpoint dir>/sts_map_k<budget>.<draft>.json (one file per budget)."""
  return pairmap.default_path(target_source, draft_name, f"sts_map_k{budget}")


def save_map(head_map: HeadMap, path: str | Path) -> Path:
  return pairmap.save_json(head_map.to_json(), path)


def check_heads(heads, target: Transformer, draft: Transformer, granularity: str
                ) -> tuple[tuple[tuple[int, int], ...], ...]:
  """heads as nested tuples: per target layer, per target head, a (draft layer, draft head) in
  range; else a one-line ValueError."""
  lt, ld = target.cfg.num_layers, draft.cfg.num_layers
  ht, hd = heads_of(target, granularity), heads_of(draft, granularity)
  try:
    out = tuple(tuple((int(i), int(e)) for i, e in layer) for layer in heads)
  except (TypeError, ValueError):
    out = None
  if (out is None or len(out) != lt or any(len(layer) != ht for layer in out)
      or any(not (0 <= i < ld and 0 <= e < hd) for layer in out for i, e in layer)):
    raise ValueError(f"an STS head map needs {lt} target layers of {ht} (draft layer < {ld}, draft "
                     f"head < {hd}) pairs ({granularity} granularity)")
  return out


def load_map(path: str | Path, target: Transformer, draft: Transformer, budget: int) -> HeadMap:
  """The map at `path`, checked against the pair and the budget; a one-line ValueError when it
  was made for another pair or budget, or is not a map file."""
  raw = pairmap.read_checked(path, target, draft, WHAT, TOOL)
  try:
    m = HeadMap(heads=raw["heads"], budget=int(raw["budget"]),
                granularity=str(raw["granularity"]), target=dict(raw["target"]),
                draft=dict(raw["draft"]),
                overlap=None if raw.get("overlap") is None else
                tuple(tuple(float(x) for x in layer) for layer in raw["overlap"]))
  except (ValueError, KeyError, TypeError) as e:
    raise ValueError(f"cannot read the {WHAT} {path}: {e}") from None
  if m.budget != check_budget(budget):
    raise ValueError(f"the {WHAT} {path} was made for budget {m.budget}, not {budget}; run "
                     f"python -m {TOOL} --budget={budget}")
  return dataclasses.replace(m, heads=check_heads(m.heads, target, draft, m.granularity))


# ----------------------------------------------------------------------------------------------
# CLI

def _define_flags() -> dict:
  """The CLI's flags, defined only when it runs (other entry points import this module)."""
  return dict(
      pairmap.pair_flags(),
      budget=flags.DEFINE_integer("budget", None, "k: the keys each target head reads per round"),
      granularity=flags.DEFINE_enum("granularity", "kv", list(GRANULARITIES),
                                    "kv: map KV heads (group means; the default); q: query heads"),
      samples=flags.DEFINE_integer("samples", 100, "the first N WikiText-2 articles (the "
                                   "paper's 100)"),
      max_tokens=flags.DEFINE_integer("max_tokens", 1024, "tokens per sample, at most"),
      rows=flags.DEFINE_integer("rows", 64, "the last rows of each sample whose attention is "
                                "compared"))


def fail(message: str):
  cli.fail(TOOL, message)


def main(argv, f: dict):
  del argv
  cli.quiet_logging()
  from jaxspec import requests
  v = {k: flag.value for k, flag in f.items()}
  try:
    pairmap.check_pair_flags(v)
    if v["budget"] is None:
      raise ValueError("give --budget (the keys each target head reads per round)")
    check_budget(v["budget"])
    for name in ("samples", "rows"):
      requests.check_count(f"--{name}", v[name])
    requests.check_count("--max_tokens", v["max_tokens"], v["rows"] + v["budget"])
  except ValueError as e:
    fail(str(e))
  try:
    target, draft = pairmap.load_pair(v, tokenizer=True)
    samples = [t for t in (target.tokenizer.encode(a)[:v["max_tokens"]]
                           for a in wikitext_samples(pairmap.calibration_text(), v["samples"]))
               if len(t) >= v["rows"] + v["budget"]]
    if not samples:
      raise ValueError(f"no calibration sample has {v['rows'] + v['budget']} tokens")
    counts = calibrate(target.model, draft.model, samples, budget=v["budget"], rows=v["rows"],
                       granularity=v["granularity"], progress=True)
    head_map = make_map(counts, len(samples) * v["rows"], target.model, draft.model, v["target"],
                        v["draft"], v["budget"], v["granularity"])
    out = save_map(head_map, v["out"] or default_map_path(target.source, v["draft"], v["budget"]))
  except (OSError, ValueError) as e:
    fail(str(e))
  mean = float(np.mean(head_map.overlap))
  print(f"STS head map, budget {v['budget']}, {v['granularity']} heads, {len(samples)} samples: "
        f"mean top-k overlap {mean:.3f} -> {out}")


if __name__ == "__main__":
  _flags = _define_flags()
  cli.run(lambda argv: main(argv, _flags), TOOL)
