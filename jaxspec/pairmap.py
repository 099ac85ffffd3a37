"""What the draft-to-target attention maps share (`jaxspec.specattn_map`, `jaxspec.sts_map`):
the calibration text, the recording of attention rows, and the map file (a small JSON beside the
target's checkpoint, naming the pair it was made for).

A map file holds `target` and `draft` entries (`pair_entry`: the name given, a config hash, a hash
of a few weights, the layer count) beside the map's own fields; `read_checked` refuses a file made
for another pair with a one-line ValueError, so a map is never applied to models it does not
describe.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from jaxspec.io.data import data_path
from jaxspec.model.attention import Dense, Prefill, ScoreSpec
from jaxspec.model.kv_cache import KVCache
from jaxspec.model.transformer import Transformer

CALIBRATION_TEXT = "wikitext2_test.txt"


# ----------------------------------------------------------------------------------------------
# Calibration

def calibration_text() -> str:
  """WikiText-2's test split: `wikitext2_test.txt` in $JAXSPEC_DATA, else ../shared/data beside
  the repository."""
  return Path(data_path(CALIBRATION_TEXT)).read_text(encoding="utf-8")


def calibration_windows(tokens: Sequence[int], n: int, length: int) -> np.ndarray:
  """n windows of `length` tokens, evenly spaced over the text (fewer if it is short)."""
  tokens = np.asarray(tokens, np.int32)
  count = min(n, len(tokens) // length)
  if count < 1:
    raise ValueError(f"the calibration text has {len(tokens)} tokens, fewer than one window of "
                     f"{length}")
  starts = np.linspace(0, len(tokens) - length, count).astype(int)
  return np.stack([tokens[s:s + length] for s in starts])


def attention_rows(model: Transformer, windows: jax.Array, rows: int, heads: str = "mean"
                   ) -> jax.Array:
  """windows [B, W] tokens -> float32 attention weights of the last `rows` tokens over the window
  (zeros on the keys a row does not see): [L, B, rows, W] averaged over query heads (heads='mean'),
  [L, B, rows, Hkv, W] per KV head (the mean over its query group, 'kv') or [L, B, rows, Hq, W]
  per query head ('q'). The first W - rows tokens are prefilled; the last rows run as one dense
  step that collects each row's weights (the scores the engine's draft steps collect)."""
  b, w = windows.shape
  capacity = -(-w // 128) * 128
  cache = KVCache.create(model.cfg, b, capacity, jnp.float32)
  head = w - rows
  pos = jnp.broadcast_to(jnp.arange(w, dtype=jnp.int32), (b, w))
  _, cache, _ = model(windows[:, :head], pos[:, :head], cache, Prefill())
  cache = cache.replace(lengths=jnp.full((b,), head, jnp.int32))
  _, _, scores = model(windows[:, head:], pos[:, head:], cache,
                       Dense(scores=ScoreSpec("weights", per_row=True, heads=heads)))
  a = scores[..., :w].astype(jnp.float32)
  return jnp.where(jnp.isfinite(a) & (a > 0), a, 0.0)


# ----------------------------------------------------------------------------------------------
# The command-line tools

def pair_flags() -> dict:
  """The flags both map tools take (defined when a tool runs: other entry points import these
  modules and define flags of the same names, --dtype and --out)."""
  return dict(
      draft=flags.DEFINE_string("draft", None, "the draft model (any --model spec of "
                                "jaxspec.generate)"),
      target=flags.DEFINE_string("target", None, "the target model"),
      out=flags.DEFINE_string("out", None, "where to write the JSON (default: beside the target)"),
      dtype=flags.DEFINE_enum("dtype", "float32", ["bfloat16", "float32"],
                              "weights and activations"))


def check_pair_flags(v: dict) -> None:
  if v["draft"] is None or v["target"] is None:
    raise ValueError("give both --draft and --target")


def load_pair(v: dict, tokenizer: bool):
  """(target, draft) `LoadedModel`s of the flags' values, checked to share a tokenizer, the target
  to have one when `tokenizer` (calibration text is encoded with it); else a ValueError."""
  from jaxspec.io.loading import check_draft_pair, load_model
  dtype = jnp.float32 if v["dtype"] == "float32" else jnp.bfloat16
  target = load_model(v["target"], dtype=dtype)
  draft = load_model(v["draft"], dtype=dtype)
  check_draft_pair(target, draft, v["target"], v["draft"])
  if tokenizer and target.tokenizer is None:
    raise ValueError(f"{target.source} has no tokenizer: calibration text cannot be encoded")
  return target, draft


# ----------------------------------------------------------------------------------------------
# The map file

def fingerprint(model: Transformer) -> dict:
  """What identifies a model for a map: its config hash and a hash of a few weights (so that
  two checkpoints of one architecture, e.g. base and instruct, differ)."""
  cfg = json.dumps(dataclasses.asdict(model.cfg), sort_keys=True, default=str)
  emb = np.asarray(jax.device_get(model.embed_tokens.embedding[...][:8]), np.float32)
  norm = np.asarray(jax.device_get(model.norm.weight[...]), np.float32)
  return {"config": hashlib.sha256(cfg.encode()).hexdigest()[:16],
          "weights": hashlib.sha256(emb.tobytes() + norm.tobytes()).hexdigest()[:16],
          "layers": model.cfg.num_layers}


def pair_entry(model: Transformer, name: str) -> dict:
  """A map file's record of one model of the pair: its fingerprint and the name it was given."""
  return dict(fingerprint(model), name=str(name))


def default_path(target_source: str | Path, draft_name: str, kind: str) -> Path:
  """Beside the target: <checkpoint dir>/<kind>.<draft>.json, or <file>.<kind>.<draft>.json for a
  single-file target (a GGUF)."""
  src = Path(target_source)
  tag = Path(str(draft_name)).name.replace(".", "_") or "draft"
  if src.is_dir():
    return src / f"{kind}.{tag}.json"
  return src.with_name(f"{src.name}.{kind}.{tag}.json")


def save_json(obj: dict, path: str | Path) -> Path:
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_name(f".{path.name}.partial")
  tmp.write_text(json.dumps(obj, indent=1) + "\n")
  tmp.replace(path)   # atomic: a reader never sees half a map
  return path


def read_checked(path: str | Path, target: Transformer, draft: Transformer, what: str,
                 tool: str) -> dict:
  """The JSON at `path`, its `target` and `draft` entries checked against the pair; a one-line
  ValueError when it is not a readable map (`what` names it) or was made for another pair (`tool`
  is the command that makes one)."""
  try:
    raw = json.loads(Path(path).read_text())
    saved = {"target": dict(raw["target"]), "draft": dict(raw["draft"])}
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise ValueError(f"cannot read the {what} {path}: {e}") from None
  for role, model in (("target", target), ("draft", draft)):
    now = fingerprint(model)
    if any(saved[role].get(k) != now[k] for k in now):
      raise ValueError(f"the {what} {path} was made for another pair: its {role} "
                       f"({saved[role].get('name')}, {saved[role].get('layers')} layers) is not "
                       f"this one ({model.cfg.num_layers} layers); run python -m {tool}")
  return raw
