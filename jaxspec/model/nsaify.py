"""NSA parameters that need no training: a dense model turned into an NSA model, and the
parameters an NSA checkpoint in fla-org/native-sparse-attention's layout leaves out.

`nsaify(model)` is SSV's NSA-ified dense model: the dense checkpoint's weights unchanged, every
attention layer made NSA (`jaxspec.model.nsa`) with
  compression  the block's plain mean (the learned linear is zero): mean pooling;
  gates        fixed, the same for every token and head: `gates` = (compressed, selected, window),
               each in [0, 1] (g_proj's kernel is zero, its bias the gate's logit; 0 and 1 are
               the logits -1e4 and 1e4, which the sigmoid rounds to exactly 0 and 1).
The default gates (0, 1/2, 1/2) drop the compressed branch (mean-pooled keys of a model never
trained for them score blocks usefully but attend poorly) and average the other two, so a row whose
whole prefix fits both the window and the selected blocks (position < `window` and < `num_selected`
* `select_block`) gets exactly the dense model's attention, up to rounding. Past that the model is
a degraded one: it exists to measure what SSV depends on (overlap between adjacent queries'
blocks, cross-layer index stability, acceptance with a real draft), never as a model to use.

`fla_nsa_defaults(cfg)` fills what an fla-org/native-sparse-attention checkpoint (`NSAForCausalLM`,
mean-pooling compression, g_proj without a bias) does not hold: zero compression linears and zero
gate biases (`jaxspec.io.weights.hf` loads the rest).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import numpy as np
from flax import nnx

from jaxspec.model.config import ModelConfig, NSAConfig
from jaxspec.model.nsa import BRANCHES
from jaxspec.model.transformer import Transformer

DEFAULT_GATES = (0.0, 0.5, 0.5)   # (compressed, selected, window)
_SATURATED = 1e4                    # a logit the sigmoid rounds to exactly 0 or 1


def check_gates(gates: Sequence[float]) -> tuple[float, ...]:
  """`gates` as a tuple of three floats in [0, 1]; a one-line ValueError otherwise."""
  try:
    values = tuple(float(g) for g in gates)
  except (TypeError, ValueError):
    raise ValueError(f"NSA gates must be numbers, got {gates!r}") from None
  if len(values) != len(BRANCHES) or not all(0.0 <= g <= 1.0 for g in values):
    raise ValueError(f"NSA gates must be {len(BRANCHES)} numbers in [0, 1] ("
                     f"{', '.join(BRANCHES)}), got {gates!r}")
  return values


def _logit(g: float) -> float:
  if g <= 0.0:
    return -_SATURATED
  if g >= 1.0:
    return _SATURATED
  return math.log(g / (1.0 - g))


def _compression(cfg: ModelConfig) -> dict[str, np.ndarray]:
  shape = (cfg.num_kv_heads, cfg.nsa.compress_block, cfg.head_dim, cfg.head_dim)
  out = {}
  for i in range(cfg.num_layers):
    out[f"layers/{i}/self_attn/compress_k"] = np.zeros(shape, np.float32)
    out[f"layers/{i}/self_attn/compress_v"] = np.zeros(shape, np.float32)
  return out


def fixed_gate_parameters(cfg: ModelConfig, gates: Sequence[float] = DEFAULT_GATES
                          ) -> dict[str, np.ndarray]:
  """{param path: array} of an NSA config's parameters that a dense checkpoint lacks, for
  mean-pooling compression and the fixed `gates`."""
  if cfg.nsa is None:
    raise ValueError("fixed gates need an NSA config (ModelConfig.nsa)")
  bias = np.tile(np.asarray([_logit(g) for g in check_gates(gates)], np.float32), cfg.num_heads)
  out = _compression(cfg)
  for i in range(cfg.num_layers):
    out[f"layers/{i}/self_attn/g_proj/kernel"] = np.zeros(
        (cfg.hidden_size, cfg.num_heads * len(BRANCHES)), np.float32)
    out[f"layers/{i}/self_attn/g_proj/bias"] = bias
  return out


def fla_nsa_defaults(cfg: ModelConfig) -> dict[str, np.ndarray]:
  """{param path: array} of what an fla-org/native-sparse-attention checkpoint leaves out: zero
  compression linears (it mean-pools) and zero gate biases (its g_proj has none)."""
  out = _compression(cfg)
  for i in range(cfg.num_layers):
    out[f"layers/{i}/self_attn/g_proj/bias"] = np.zeros((cfg.num_heads * len(BRANCHES),),
                                                         np.float32)
  return out


def nsaify(model: Transformer, nsa: NSAConfig = NSAConfig(),
           gates: Sequence[float] = DEFAULT_GATES) -> Transformer:
  """The NSA-ified `model` (see the module docstring): a new model at its parameter dtype, its
  config's `nsa` set, holding the same dense weight arrays (not copied: a 1.5B model costs no
  second copy). A degraded model, for measurement only."""
  from jaxspec.io.weights import build_model, flat   # the loaders import the model, not back
  if model.cfg.nsa is not None:
    raise ValueError("the model already has NSA attention")
  if not isinstance(nsa, NSAConfig):
    raise ValueError(f"nsa must be an NSAConfig, got {type(nsa).__name__}")
  cfg = dataclasses.replace(model.cfg, nsa=nsa)
  state = nnx.to_pure_dict(nnx.state(model))
  params = flat(state)
  params.update(fixed_gate_parameters(cfg, gates))
  dtype = jax.tree.leaves(state)[0].dtype
  return build_model(cfg, params, dtype=dtype, source="nsaify", mesh=getattr(model, "mesh", None))
