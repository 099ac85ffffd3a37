"""Weight import: HF safetensors (`hf`), GGUF (`gguf`) and our orbax checkpoints (`checkpoint`).

Every source format is read into one flat dict `{param path: numpy array}` whose paths are the
model's own (`layers/3/self_attn/q_proj/kernel`), through one mapping table per format. This module
holds what the formats share: telling them apart, and filling the abstract model from such a dict
while checking that every parameter is there with the right shape and nothing else is.
"""
from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax.sharding import Mesh

from jaxspec.model import sharding
from jaxspec.model.config import ModelConfig
from jaxspec.model.transformer import Transformer, abstract_model

if TYPE_CHECKING:
  from transformers import PreTrainedTokenizerBase

CONFIG_FILE = "jaxspec_config.json"   # marks an orbax checkpoint written by jaxspec.convert
PARAMS_DIR = "params"                 # the orbax item inside such a checkpoint
GGUF_MAGIC = b"GGUF"


class WeightsError(ValueError):
  """A weight source that cannot be read: missing, corrupt, or not matching the model."""


ParamDict = dict[str, np.ndarray]


def source_kind(path: str | Path) -> str:
  """'orbax', 'hf' or 'gguf' for a checkpoint dir, a HF model dir or a GGUF file."""
  p = Path(path)
  if not p.exists():
    raise WeightsError(f"{p}: no such file or directory")
  if p.is_file():
    with open(p, "rb") as f:
      if f.read(4) == GGUF_MAGIC:
        return "gguf"
    raise WeightsError(f"{p} is a file but not a GGUF file (no GGUF magic bytes)")
  if (p / CONFIG_FILE).is_file():
    return "orbax"
  if (p / PARAMS_DIR).is_dir():
    raise WeightsError(f"corrupt checkpoint {p}: it has {PARAMS_DIR}/ but {CONFIG_FILE} is missing")
  if (p / "config.json").is_file():
    return "hf"
  raise WeightsError(f"{p} is neither a jaxspec checkpoint ({CONFIG_FILE}) nor a HF model "
                     f"directory (config.json); it holds: {_listing(p)}")


def _listing(p: Path, limit: int = 10) -> str:
  names = sorted(x.name for x in p.iterdir())
  if not names:
    return "nothing"
  return ", ".join(names[:limit]) + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def _names(keys, limit: int = 8) -> str:
  keys = sorted(keys)
  more = f", ... ({len(keys)} in all)" if len(keys) > limit else ""
  return ", ".join(keys[:limit]) + more


def _flatten(tree: Mapping[Any, Any], prefix: tuple = ()) -> dict[tuple, Any]:
  out = {}
  for k, v in tree.items():
    if isinstance(v, Mapping):
      out.update(_flatten(v, prefix + (k,)))
    else:
      out[prefix + (k,)] = v
  return out


def _unflatten(flat: Mapping[tuple, Any]) -> dict[Any, Any]:
  out: dict[Any, Any] = {}
  for path, v in flat.items():
    node = out
    for k in path[:-1]:
      node = node.setdefault(k, {})
    node[path[-1]] = v
  return out


def path_str(path: tuple) -> str:
  return "/".join(str(k) for k in path)


@functools.lru_cache(maxsize=4)
def _abstract_split(cfg: ModelConfig, dtype) -> tuple[Any, Any]:
  # Tracing the model's construction costs seconds (hundreds of modules), so do it once per config.
  return nnx.split(abstract_model(cfg, dtype=dtype))


def abstract_params(cfg: ModelConfig, dtype=jnp.bfloat16) -> dict[str, jax.ShapeDtypeStruct]:
  """{param path: ShapeDtypeStruct} of the model at `cfg`: the set every loader must fill."""
  _, state = _abstract_split(cfg, jnp.dtype(dtype))
  return {path_str(p): v for p, v in _flatten(nnx.to_pure_dict(state)).items()}


def check_params(cfg: ModelConfig, params: Mapping[str, Any], source: str,
                 dtype=jnp.bfloat16) -> None:
  """Raise WeightsError naming every missing, unexpected or wrongly shaped parameter. `dtype`
  does not change the check; passing the model's saves tracing its structure a second time."""
  expected = abstract_params(cfg, dtype)
  missing = expected.keys() - params.keys()
  unexpected = params.keys() - expected.keys()
  bad_shape = [f"{k} {tuple(params[k].shape)} (model wants {tuple(expected[k].shape)})"
               for k in expected.keys() & params.keys()
               if tuple(params[k].shape) != tuple(expected[k].shape)]
  problems = []
  if missing:
    problems.append(f"missing parameters: {_names(missing)}")
  if unexpected:
    problems.append(f"unexpected parameters: {_names(unexpected)}")
  if bad_shape:
    problems.append(f"shape mismatch: {_names(bad_shape)}")
  if problems:
    raise WeightsError(f"{source} does not match the {cfg.arch} model config: " + "; ".join(problems))


def nested(params: Mapping[str, Any]) -> dict[str, Any]:
  """Flat {path: array} -> nested dict with string keys (orbax's tree layout)."""
  return _unflatten({tuple(k.split("/")): v for k, v in params.items()})


def flat(tree: Mapping[str, Any]) -> dict[str, Any]:
  """Nested dict -> flat {path: leaf}; inverse of `nested`."""
  return {path_str(p): v for p, v in _flatten(tree).items()}


def load_saved_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
  """The tokenizer saved in folder `path` (`save_pretrained`'s files, or a HF model's), built by
  the class its tokenizer_config.json names, as AutoTokenizer would choose. AutoTokenizer itself
  imports transformers' model configuration code and with it torch, about 6 s of a process's
  start on a 2-core machine (transformers 5.24; in 5.17 the tokenizer classes import torch
  too); it stays the fallback when the class is not named or not found."""
  import transformers
  try:
    name = json.loads((Path(path) / "tokenizer_config.json").read_text()).get("tokenizer_class")
    tokenizer_class = getattr(transformers, name)
  except Exception:   # no config, no class named, or one this transformers lacks
    tokenizer_class = transformers.AutoTokenizer
  return tokenizer_class.from_pretrained(str(path))


def build_model(cfg: ModelConfig, params: Mapping[str, Any], *, dtype=jnp.bfloat16,
                source: str = "weights", mesh: Mesh | None = None) -> Transformer:
  """Fill the abstract model at `cfg` with `params` (any array type), cast to `dtype`.

  With a tensor-parallel `mesh` each parameter goes straight from the host into its shards
  (`jaxspec.model.sharding.place`; arrays already on the mesh stay where they are) and the model
  records the mesh. Asserts that every parameter was filled: a model with a leftover abstract leaf
  never escapes.
  """
  check_params(cfg, params, source, dtype)
  sharding.check_divides(cfg, mesh, source)
  graphdef, abstract_state = _abstract_split(cfg, jnp.dtype(dtype))
  state = jax.tree.map(lambda x: x, abstract_state)   # a fresh copy: the cached one stays abstract
  pure = nnx.to_pure_dict(state)
  if mesh is None:
    filled = {p: jnp.asarray(params[path_str(p)], dtype=dtype) for p in _flatten(pure)}
  else:
    filled = {p: sharding.place(params[path_str(p)], dtype,
                                sharding.param_sharding(path_str(p), mesh))
              for p in _flatten(pure)}
  nnx.replace_by_pure_dict(state, _unflatten(filled))
  model = nnx.merge(graphdef, state)
  model.mesh = mesh
  leftover = [path_str(p) for p, v in _flatten(nnx.to_pure_dict(nnx.state(model))).items()
              if not isinstance(v, jax.Array)]
  assert not leftover, f"parameters left unfilled: {leftover}"
  return model
