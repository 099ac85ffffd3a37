"""SpecAttn's layer map: which draft layer's attention each target layer reads.

  python -m jaxspec.specattn_map --draft=qwen2.5-coder-0.5b --target=qwen2.5-coder-1.5b
  python -m jaxspec.specattn_map --draft=... --target=... --map=proportional --out=map.json

`--map=kl` (the default, the paper's): both models read the same calibration windows of
WikiText-2 (`wikitext2_test.txt` in $JAXSPEC_DATA, else ../shared/data beside the repo); for each
window the last `--rows` tokens' attention weights over the window, averaged over query heads, are
recorded per layer (A_target_j, A_draft_i). The similarity is S[j, i] = -mean KL(A_target_j ||
A_draft_i) over those rows, and the map is the best non-decreasing one (`monotone_map`: V[j][i] =
S[j, i] + max over i' <= i of V[j-1][i'], then backtracking). `--map=proportional` is
f(j) = floor(j * Ld / Lt); `--map=argmax` the unconstrained argmax_i S[j, i] (the ablation's
two alternatives; neither needs calibration text, argmax does).

The map is saved as a small JSON beside the target's checkpoint (`default_map_path`), naming the
pair (names, config and weight fingerprints) and the method; `load_map` refuses a file made for
another pair with a one-line ValueError. Every target layer gets an entry; the engine keeps the
first two target layers dense and so never reads their entries.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from jaxspec import cli, pairmap
from jaxspec.model.transformer import Transformer
# Shared with jaxspec.sts_map; re-exported because the benchmarks and tests read them from here.
from jaxspec.pairmap import attention_rows, calibration_windows  # noqa: F401

MAP_KINDS = ("kl", "proportional", "argmax")
_EPS = 1e-9   # floors the draft's weights inside the log: a key it ignores is not an infinite KL


# ----------------------------------------------------------------------------------------------
# Maps from a similarity matrix (pure functions)

def monotone_map(sim: np.ndarray) -> tuple[int, ...]:
  """The non-decreasing map f (target layer j -> draft layer f(j)) maximising sum_j sim[j, f(j)].

  sim [Lt, Ld]. Dynamic programming: V[0] = sim[0]; V[j][i] = sim[j, i] + max_{i' <= i} V[j-1][i'];
  f(Lt-1) = argmax V[Lt-1], then f(j-1) = argmax_{i' <= f(j)} V[j-1][i']. Ties go to the lower
  draft layer. O(Lt * Ld)."""
  sim = np.asarray(sim, np.float64)
  if sim.ndim != 2 or 0 in sim.shape:
    raise ValueError(f"similarity must be a non-empty [target layers, draft layers] matrix, got "
                     f"shape {sim.shape}")
  v = np.empty_like(sim)
  v[0] = sim[0]
  for j in range(1, sim.shape[0]):
    v[j] = sim[j] + np.maximum.accumulate(v[j - 1])
  f = [int(np.argmax(v[-1]))]
  for j in range(sim.shape[0] - 1, 0, -1):
    f.append(int(np.argmax(v[j - 1][:f[-1] + 1])))
  return tuple(reversed(f))


def proportional_map(target_layers: int, draft_layers: int) -> tuple[int, ...]:
  """f(j) = floor(j * Ld / Lt): layers at the same relative depth."""
  return tuple(j * draft_layers // target_layers for j in range(target_layers))


def argmax_map(sim: np.ndarray) -> tuple[int, ...]:
  """The unconstrained map: each target layer's most similar draft layer (may go backwards)."""
  return tuple(int(i) for i in np.argmax(np.asarray(sim), axis=1))


# ----------------------------------------------------------------------------------------------
# Calibration

@jax.jit
def _kl_terms(a_t: jax.Array, a_d: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Sums over rows of sum_s a_t log a_t [Lt] and of sum_s a_t log a_d [Lt, Ld] (rows renormalised
  after the bf16 scores' rounding)."""
  a_t = a_t / jnp.maximum(a_t.sum(-1, keepdims=True), 1e-30)
  a_d = a_d / jnp.maximum(a_d.sum(-1, keepdims=True), 1e-30)
  ent = jnp.sum(jnp.where(a_t > 0, a_t * jnp.log(jnp.where(a_t > 0, a_t, 1.0)), 0.0),
                axis=(1, 2, 3))
  cross = jnp.einsum("jbrs,ibrs->ji", a_t, jnp.log(a_d + _EPS))
  return ent, cross


def kl_similarity(target: Transformer, draft: Transformer, windows: np.ndarray, *, rows: int,
                  batch: int, progress: bool = False) -> np.ndarray:
  """S[j, i] = -mean over calibration rows of KL(A_target_j || A_draft_i), [Lt, Ld]; windows
  [N, W] token ids read by both models, `batch` windows at a time."""
  from tqdm import tqdm
  windows = np.asarray(windows, np.int32)
  ent = np.zeros(target.cfg.num_layers)
  cross = np.zeros((target.cfg.num_layers, draft.cfg.num_layers))
  for s in tqdm(range(0, len(windows), batch), desc="calibration", unit="batch",
                disable=not progress):
    w = jnp.asarray(windows[s:s + batch])
    e, c = _kl_terms(attention_rows(target, w, rows), attention_rows(draft, w, rows))
    ent += np.asarray(e, np.float64)
    cross += np.asarray(c, np.float64)
  n = len(windows) * rows
  return -(ent[:, None] - cross) / n


# ----------------------------------------------------------------------------------------------
# The map file

@dataclasses.dataclass(frozen=True)
class LayerMap:
  """f: target layer j -> draft layer layers[j], and how it was made."""
  layers: tuple[int, ...]
  method: str
  target: dict
  draft: dict
  similarity: tuple[tuple[float, ...], ...] | None = None

  def to_json(self) -> dict:
    return dataclasses.asdict(self)


def make_map(kind: str, target: Transformer, draft: Transformer, target_name: str,
             draft_name: str, sim: np.ndarray | None = None) -> LayerMap:
  """The `kind` map ('kl' and 'argmax' need `sim`) for the pair, named and fingerprinted."""
  if kind not in MAP_KINDS:
    raise ValueError(f"map must be one of {', '.join(MAP_KINDS)}, got {kind!r}")
  lt, ld = target.cfg.num_layers, draft.cfg.num_layers
  if kind == "proportional":
    layers = proportional_map(lt, ld)
  elif sim is None:
    raise ValueError(f"the {kind} map needs a similarity matrix (calibration)")
  else:
    layers = monotone_map(sim) if kind == "kl" else argmax_map(sim)
  return LayerMap(layers=layers, method=kind, target=pairmap.pair_entry(target, target_name),
                  draft=pairmap.pair_entry(draft, draft_name),
                  similarity=None if sim is None else tuple(tuple(float(x) for x in r) for r in sim))


def default_map_path(target_source: str | Path, draft_name: str) -> Path:
  """Beside the target: <checkpoint dir>/specattn_map.<draft>.json (`pairmap.default_path`)."""
  return pairmap.default_path(target_source, draft_name, "specattn_map")


def save_map(layer_map: LayerMap, path: str | Path) -> Path:
  return pairmap.save_json(layer_map.to_json(), path)


def load_map(path: str | Path, target: Transformer, draft: Transformer) -> LayerMap:
  """The map at `path`, checked against the pair; a one-line ValueError when it was made for
  another pair (layer counts, configs or weights differ) or is not a map file."""
  raw = pairmap.read_checked(path, target, draft, "SpecAttn layer map", "jaxspec.specattn_map")
  try:
    m = LayerMap(layers=tuple(int(i) for i in raw["layers"]), method=str(raw["method"]),
                 target=dict(raw["target"]), draft=dict(raw["draft"]),
                 similarity=raw.get("similarity"))
  except (ValueError, KeyError, TypeError) as e:
    raise ValueError(f"cannot read the SpecAttn layer map {path}: {e}") from None
  check_layers(m.layers, target.cfg.num_layers, draft.cfg.num_layers)
  return m


def check_layers(layers: Sequence[int], target_layers: int, draft_layers: int) -> tuple[int, ...]:
  """A map as a tuple: one draft layer in [0, Ld) per target layer; else a one-line ValueError."""
  layers = tuple(layers)
  if len(layers) != target_layers or not all(
      isinstance(i, (int, np.integer)) and 0 <= i < draft_layers for i in layers):
    raise ValueError(f"a SpecAttn layer map needs one draft layer in [0, {draft_layers}) per target "
                     f"layer ({target_layers}), got {list(layers)}")
  return tuple(int(i) for i in layers)


# ----------------------------------------------------------------------------------------------
# CLI

def _define_flags() -> dict:
  """The CLI's flags, defined only when it runs: other entry points import this module's
  functions and define flags of the same names (--dtype, --out)."""
  return dict(
      pairmap.pair_flags(),
      map=flags.DEFINE_enum("map", "kl", list(MAP_KINDS), "kl: KL divergence + monotone DP (the "
                            "paper's); proportional: floor(j * Ld / Lt); argmax: unconstrained"),
      windows=flags.DEFINE_integer("windows", 32, "calibration windows"),
      window=flags.DEFINE_integer("window_tokens", 512, "tokens per calibration window"),
      rows=flags.DEFINE_integer("rows", 16, "the last rows of each window whose attention is "
                                "compared"),
      batch=flags.DEFINE_integer("batch", 4, "windows per forward pass"))


def fail(message: str):
  cli.fail("jaxspec.specattn_map", message)


def main(argv, f: dict):
  del argv
  cli.quiet_logging()
  from jaxspec import requests
  v = {k: flag.value for k, flag in f.items()}
  try:
    pairmap.check_pair_flags(v)
    for name in ("windows", "rows", "batch"):
      requests.check_count(f"--{name}", v[name])
    requests.check_count("--window_tokens", v["window"], v["rows"] + 1)
  except ValueError as e:
    fail(str(e))
  try:
    target, draft = pairmap.load_pair(v, tokenizer=v["map"] != "proportional")
    sim = None
    if v["map"] != "proportional":
      windows = calibration_windows(target.tokenizer.encode(pairmap.calibration_text()),
                                    v["windows"], v["window"])
      sim = kl_similarity(target.model, draft.model, windows, rows=v["rows"], batch=v["batch"],
                          progress=True)
    layer_map = make_map(v["map"], target.model, draft.model, v["target"], v["draft"], sim)
    out = save_map(layer_map, v["out"] or default_map_path(target.source, v["draft"]))
  except (OSError, ValueError) as e:
    fail(str(e))
  print(f"{v['map']} map {list(layer_map.layers)} -> {out}")


if __name__ == "__main__":
  _flags = _define_flags()
  cli.run(lambda argv: main(argv, _flags), "jaxspec.specattn_map")
