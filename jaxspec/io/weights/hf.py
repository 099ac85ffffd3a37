"""HF safetensors directory (config.json + *.safetensors, sharded or not) -> config and params.

Llama, Qwen2/2.5 and Qwen3 checkpoints under transformers' names; NSA checkpoints (config.json
model_type "nsa") under fla-org/native-sparse-attention's (`NSAForCausalLM`: `model.embeddings`,
`attn_norm`, `attn.{q,k,v,o,g}_proj`, `mlp_norm`, `mlp.{gate,up,down}_proj`). Such a checkpoint
loads with its weights; the attention rules are jaxspec's (`jaxspec.model.nsa`: which blocks a row
sees and selects), not checked against fla's Triton kernels."""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from safetensors import safe_open
from tqdm import tqdm

from jaxspec.model import sharding
from jaxspec.model.config import ModelConfig
from jaxspec.model.nsaify import fla_nsa_defaults
from jaxspec.model.transformer import Transformer
from jaxspec.io.weights import ParamDict, WeightsError, build_model, load_saved_tokenizer

if TYPE_CHECKING:
  from transformers import PreTrainedTokenizerBase

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
INDEX_FILE = "model.safetensors.index.json"


def _same(x: np.ndarray) -> np.ndarray:
  return x


def _transpose(x: np.ndarray) -> np.ndarray:
  return x.T   # HF Linear weight is [out, in]; nnx.Linear kernel is [in, out]


# The mapping table: HF tensor name -> (our param path, transform). `{i}` is the layer index.
_GLOBAL: dict[str, tuple[str, Callable]] = {
    "model.embed_tokens.weight": ("embed_tokens/embedding", _same),
    "model.norm.weight": ("norm/weight", _same),
    "lm_head.weight": ("lm_head/kernel", _transpose),
}
_PER_LAYER: dict[str, tuple[str, Callable]] = {
    "input_layernorm.weight": ("input_layernorm/weight", _same),
    "post_attention_layernorm.weight": ("post_attention_layernorm/weight", _same),
    "self_attn.q_proj.weight": ("self_attn/q_proj/kernel", _transpose),
    "self_attn.k_proj.weight": ("self_attn/k_proj/kernel", _transpose),
    "self_attn.v_proj.weight": ("self_attn/v_proj/kernel", _transpose),
    "self_attn.o_proj.weight": ("self_attn/o_proj/kernel", _transpose),
    "self_attn.q_proj.bias": ("self_attn/q_proj/bias", _same),
    "self_attn.k_proj.bias": ("self_attn/k_proj/bias", _same),
    "self_attn.v_proj.bias": ("self_attn/v_proj/bias", _same),
    "self_attn.q_norm.weight": ("self_attn/q_norm/weight", _same),
    "self_attn.k_norm.weight": ("self_attn/k_norm/weight", _same),
    "mlp.gate_proj.weight": ("mlp/gate_proj/kernel", _transpose),
    "mlp.up_proj.weight": ("mlp/up_proj/kernel", _transpose),
    "mlp.down_proj.weight": ("mlp/down_proj/kernel", _transpose),
}


# fla-org/native-sparse-attention's NSAForCausalLM (config.json model_type "nsa"): the same decoder
# under other names, plus the gate projection g_proj (no bias; mean-pooling compression).
_FLA_NSA_GLOBAL: dict[str, tuple[str, Callable]] = {
    "model.embeddings.weight": ("embed_tokens/embedding", _same),
    "model.norm.weight": ("norm/weight", _same),
    "lm_head.weight": ("lm_head/kernel", _transpose),
}
_FLA_NSA_PER_LAYER: dict[str, tuple[str, Callable]] = {
    "attn_norm.weight": ("input_layernorm/weight", _same),
    "mlp_norm.weight": ("post_attention_layernorm/weight", _same),
    **{f"attn.{p}_proj.weight": (f"self_attn/{p}_proj/kernel", _transpose)
       for p in ("q", "k", "v", "o", "g")},
    **{f"attn.{p}_proj.bias": (f"self_attn/{p}_proj/bias", _same) for p in ("q", "k", "v")},
    **{f"mlp.{p}_proj.weight": (f"mlp/{p}_proj/kernel", _transpose)
       for p in ("gate", "up", "down")},
}


def key_map(cfg: ModelConfig) -> dict[str, tuple[str, Callable]]:
  """HF tensor name -> (param path, transform) for every tensor a checkpoint at `cfg` may hold
  (an NSA config: fla-org/native-sparse-attention's names)."""
  fla = cfg.nsa is not None
  table = dict(_FLA_NSA_GLOBAL if fla else _GLOBAL)
  prefix = "model.layers.{i}."
  for i in range(cfg.num_layers):
    for hf_key, (path, fn) in (_FLA_NSA_PER_LAYER if fla else _PER_LAYER).items():
      table[prefix.format(i=i) + hf_key] = (f"layers/{i}/{path}", fn)
  return table


def _ignored(name: str, cfg: ModelConfig) -> bool:
  # Old checkpoints carry RoPE buffers; tied checkpoints may still hold a copy of the embedding.
  return name.endswith("rotary_emb.inv_freq") or (cfg.tie_word_embeddings and name == "lm_head.weight")


def read_config(path: str | Path) -> ModelConfig:
  """ModelConfig from config.json, with generation_config.json's EOS ids added (HF generate uses both)."""
  path = Path(path)
  try:
    hf = json.loads((path / "config.json").read_text())
  except FileNotFoundError:
    raise WeightsError(f"{path}: no config.json") from None
  except json.JSONDecodeError as e:
    raise WeightsError(f"{path / 'config.json'} is not valid JSON: {e}") from None
  cfg = ModelConfig.from_hf(hf)
  gen = path / "generation_config.json"
  if gen.is_file():
    eos = json.loads(gen.read_text()).get("eos_token_id")
    eos = [] if eos is None else eos if isinstance(eos, list) else [eos]
    merged = tuple(dict.fromkeys([*cfg.eos_token_ids, *eos]))
    cfg = dataclasses.replace(cfg, eos_token_ids=merged)
  return cfg


def _shards(path: Path) -> list[Path]:
  index = path / INDEX_FILE
  if index.is_file():
    weight_map = json.loads(index.read_text())["weight_map"]
    files = sorted({path / f for f in weight_map.values()})
    absent = [f.name for f in files if not f.is_file()]
    if absent:
      raise WeightsError(f"{index} names shards that are not there: {', '.join(absent)}")
    return files
  files = sorted(path.glob("*.safetensors"))
  if not files:
    raise WeightsError(f"{path} has config.json but no *.safetensors weight files")
  return files


def read_params(path: str | Path, cfg: ModelConfig, *, dtype=jnp.bfloat16,
                progress: bool = False) -> ParamDict:
  """Every tensor of the safetensors files, mapped to param paths, as numpy arrays of `dtype`.

  Unknown tensors raise; missing ones are reported by `build_model`/`check_params`.
  """
  path = Path(path)
  table = key_map(cfg)
  np_dtype = jnp.dtype(dtype)
  files = _shards(path)
  names: dict[Path, list[str]] = {}
  for f in files:
    with safe_open(f, framework="flax") as st:
      names[f] = list(st.keys())
  unknown = [n for ns in names.values() for n in ns if n not in table and not _ignored(n, cfg)]
  if unknown:
    raise WeightsError(f"{path}: tensors with no place in the {cfg.arch} model: "
                       f"{', '.join(sorted(unknown)[:8])}" + (" ..." if len(unknown) > 8 else ""))
  params: ParamDict = {}
  bar = tqdm(total=sum(map(len, names.values())), desc=f"reading {path.name}", unit="tensor",
             disable=not progress)
  # safetensors' numpy reader has no bfloat16; its jax reader does. Keep it on the host.
  with bar, jax.default_device(jax.devices("cpu")[0]):
    for f, ns in names.items():
      with safe_open(f, framework="flax") as st:
        for n in ns:
          bar.update(1)
          if _ignored(n, cfg):
            continue
          target, fn = table[n]
          params[target] = np.ascontiguousarray(fn(np.asarray(st.get_tensor(n)))).astype(np_dtype)
  if cfg.nsa is not None:
    params.update({k: v.astype(np_dtype) for k, v in fla_nsa_defaults(cfg).items()})
  return params


def has_tokenizer(path: str | Path) -> bool:
  return any((Path(path) / f).is_file() for f in TOKENIZER_FILES)


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase | None:
  """The HF tokenizer saved beside the weights, or None when the directory has none."""
  if not has_tokenizer(path):
    return None
  return load_saved_tokenizer(path)


def load(path: str | Path, *, dtype=jnp.bfloat16, progress: bool = False,
         mesh: Mesh | None = None) -> tuple[ModelConfig, Transformer]:
  """(config, filled model) from a HF safetensors directory, on `mesh` if given (host arrays
  sent straight into their shards)."""
  cfg = read_config(path)
  sharding.check_divides(cfg, mesh, str(path))   # before reading the weights
  params = read_params(path, cfg, dtype=dtype, progress=progress)
  return cfg, build_model(cfg, params, dtype=dtype, source=str(path), mesh=mesh)
