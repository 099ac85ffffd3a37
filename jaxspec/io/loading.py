"""`load_model(spec)`: one entry point for every way of naming a model.

spec is a jaxspec checkpoint dir (the fast path), a HF safetensors dir, a .gguf file, or a demo
name from `jaxspec.fetch.DEMOS` (fetched and converted into checkpoints/ on first use); `nsa:SPEC`
is SPEC's dense model NSA-ified (`jaxspec.model.nsaify`: a degraded model, for measuring SSV).
With tp > 1 the weights go straight into their tensor-parallel shards (`jaxspec.model.sharding`).
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import jax.numpy as jnp

from jaxspec import fetch as fetch_lib
from jaxspec import requests
from jaxspec.model import sharding
from jaxspec.model.config import ModelConfig
from jaxspec.model.nsaify import nsaify
from jaxspec.model.transformer import Transformer
from jaxspec.io.weights import WeightsError, source_kind
from jaxspec.io.weights import checkpoint
from jaxspec.io.weights import gguf as gguf_weights
from jaxspec.io.weights import hf as hf_weights

if TYPE_CHECKING:
  from transformers import PreTrainedTokenizerBase


@dataclasses.dataclass(frozen=True)
class LoadedModel:
  cfg: ModelConfig
  model: Transformer
  tokenizer: PreTrainedTokenizerBase | None   # None for a source that ships no tokenizer files
  source: Path

  @property
  def stop_ids(self) -> tuple[int, ...]:
    """End-of-sequence ids: the config's and the tokenizer's, sorted."""
    tok_eos = None if self.tokenizer is None else self.tokenizer.eos_token_id
    return tuple(sorted(set(self.cfg.eos_token_ids) | ({tok_eos} - {None})))


NSAIFY = "nsa:"


def load_model(spec: str | Path, *, dtype=jnp.bfloat16, progress: bool = False,
               tp: int = 1) -> LoadedModel:
  """Config, filled model at `dtype` (a floating-point dtype) and tokenizer for `spec` (see the
  module docstring). tp: devices to shard the model over (the first tp devices). A tp above the
  device count raises a one-line ValueError before anything is read, one that does not divide
  the KV heads as soon as the config is read."""
  requests.check_dtype("dtype", dtype)
  if str(spec).startswith(NSAIFY):
    dense = load_model(str(spec)[len(NSAIFY):], dtype=dtype, progress=progress, tp=tp)
    model = nsaify(dense.model)
    return dataclasses.replace(dense, cfg=model.cfg, model=model)
  mesh = sharding.make_mesh(tp)
  path = Path(spec)
  if not path.exists() and str(spec) in fetch_lib.DEMOS:
    path = fetch_lib.default_checkpoint_dir() / str(spec)
    if not checkpoint.is_checkpoint(path):
      print(f"demo model {spec} is not in {path.parent} yet: fetching and converting it",
            file=sys.stderr)
      path = fetch_lib.fetch(str(spec), path.parent)
  elif not path.exists():
    raise WeightsError(f"{spec}: no such checkpoint dir, HF dir or GGUF file, and not a demo "
                       f"model name ({', '.join(fetch_lib.DEMOS)})")
  kind = source_kind(path)
  if kind == "orbax":
    cfg, model = checkpoint.load(path, dtype=dtype, mesh=mesh)
    tokenizer = checkpoint.load_tokenizer(path)
  elif kind == "hf":
    cfg, model = hf_weights.load(path, dtype=dtype, progress=progress, mesh=mesh)
    tokenizer = hf_weights.load_tokenizer(path)
  else:
    gguf_weights.require_torch(path)   # before dequantizing, not after
    cfg, model = gguf_weights.load(path, dtype=dtype, progress=progress, mesh=mesh)
    tokenizer = gguf_weights.load_tokenizer(path, cfg.arch)
  return LoadedModel(cfg=cfg, model=model, tokenizer=tokenizer, source=path)


def check_draft_pair(target: LoadedModel, draft: LoadedModel, target_name: str,
                     draft_name: str) -> None:
  """Raise a one-line ValueError unless the draft model shares the target's tokenizer (the same
  vocabulary, token for token): speculative decoding compares their token ids."""
  same = target.cfg.vocab_size == draft.cfg.vocab_size
  if same and target.tokenizer is not None and draft.tokenizer is not None:
    same = target.tokenizer.get_vocab() == draft.tokenizer.get_vocab()
  if not same:
    raise ValueError(f"draft model {draft_name} ({draft.cfg.vocab_size} tokens) and target "
                     f"{target_name} ({target.cfg.vocab_size} tokens) do not share a tokenizer")


def apply_chat_template(tokenizer: PreTrainedTokenizerBase | None, prompt: str) -> str:
  """`prompt` as one user turn in the tokenizer's chat template, ready for the assistant's reply."""
  if tokenizer is None:
    raise ValueError("--chat needs a tokenizer, but this model has none")
  if not getattr(tokenizer, "chat_template", None):
    raise ValueError(f"the tokenizer ({getattr(tokenizer, 'name_or_path', '?')}) has no chat "
                     "template; run without --chat")
  return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                       add_generation_prompt=True)
