"""Argument checks for the public generation API: pure functions raising a one-line ValueError that
names the argument.

The decode loops trust their inputs (a token id past the vocabulary silently reads a clamped
embedding row; a zero-step chunk loops forever; a cache longer than the model's context allocates
gigabytes and then decodes garbage), so every entry point (`engine.state.make_batch`,
`engine.runner.Runner`, `io.loading.load_model`, the CLI's flags) checks here first.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxspec.model.config import ModelConfig


def _is_int(value: Any) -> bool:
  return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_count(name: str, value: Any, minimum: int = 1) -> int:
  """`value` as an int when it is an integer >= minimum (not a bool or a float); else ValueError."""
  if not _is_int(value) or value < minimum:
    raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
  return int(value)


def check_prompts(prompts: Any, vocab_size: int | None = None, name: str = "prompts") -> None:
  """Prompts (or appended turns: `name`) are a non-empty list of non-empty lists of integer token
  ids in [0, vocab_size)."""
  if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (Sequence, np.ndarray)):
    raise ValueError(f"{name} must be a list of token-id lists, got {type(prompts).__name__}")
  if len(prompts) == 0:
    raise ValueError(f"{name} is empty: give at least one token-id list")
  for i, p in enumerate(prompts):
    if isinstance(p, (str, bytes)):
      raise ValueError(f"{name}[{i}] is a string; encode it with the tokenizer first")
    ids = np.asarray(p)
    if ids.ndim != 1 or ids.size == 0:
      raise ValueError(f"{name}[{i}] must be a non-empty list of token ids, got shape {ids.shape}")
    if ids.dtype.kind not in "iu":   # floats, bools and objects are not token ids
      raise ValueError(f"{name}[{i}] must hold integer token ids, got {ids.dtype} values "
                       f"such as {ids.flat[0]!r}")
    bad = (ids < 0) | (ids >= vocab_size) if vocab_size is not None else ids < 0
    if bad.any():
      j = int(np.argmax(bad))
      limit = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
      raise ValueError(f"{name}[{i}][{j}] = {int(ids[j])} is not a token id of this model "
                       f"(ids are {limit})")


def check_max_new_tokens(max_new_tokens: Any, num_prompts: int) -> None:
  """One integer >= 1, or one per prompt."""
  if _is_int(max_new_tokens):
    check_count("max_new_tokens", max_new_tokens)
    return
  if isinstance(max_new_tokens, (Sequence, np.ndarray)) and not isinstance(max_new_tokens, str):
    if len(max_new_tokens) != num_prompts:
      raise ValueError(f"max_new_tokens has {len(max_new_tokens)} entries for {num_prompts} "
                       "prompts; give one integer or one per prompt")
    for i, v in enumerate(max_new_tokens):
      check_count(f"max_new_tokens[{i}]", v)
    return
  raise ValueError(f"max_new_tokens must be an integer >= 1 or one per prompt, got "
                   f"{max_new_tokens!r}")


def context_limit(cfg: ModelConfig) -> int:
  """Positions the model was trained for: max_position_embeddings, or what its RoPE scaling
  extends that to (factor x original context, for YaRN configs that keep the original length)."""
  s = cfg.rope_scaling
  if s is None:
    return cfg.max_position_embeddings
  return max(cfg.max_position_embeddings, int(s.factor * s.original_max_position_embeddings))


def check_context(longest_prompt: int, max_len: int | None, max_new_tokens: Any,
                  cfg: ModelConfig) -> int:
  """The max_len (cache slots per sequence: prompt + new tokens) to use, within the model's context.

  Without max_len: longest prompt + the largest max_new_tokens, capped at the context (generation
  then stops when the context is full). A prompt that does not leave room for one new token, or an
  explicit max_len past the context, is refused before anything is allocated.
  """
  limit = context_limit(cfg)
  scaled = " with its RoPE scaling" if cfg.rope_scaling is not None else ""
  if longest_prompt >= limit:
    raise ValueError(f"the prompt of {longest_prompt} tokens exceeds the model's context of "
                     f"{limit} tokens{scaled} (prompt + at least one new token); shorten it")
  if max_len is None:
    return min(longest_prompt + int(np.max(max_new_tokens)), limit)
  check_count("max_len", max_len, 2)
  if max_len > limit:
    raise ValueError(f"max_len={max_len} exceeds the model's context of {limit} tokens{scaled} "
                     "(max_position_embeddings)")
  return max_len


def check_stop_ids(stop_ids: Any, cfg: ModelConfig) -> tuple[int, ...]:
  """Sorted unique stop ids; None means the model's end-of-sequence ids (cfg.eos_token_ids)."""
  if stop_ids is None:
    stop_ids = cfg.eos_token_ids
  ids = list(stop_ids)
  for s in ids:
    if not _is_int(s) or not 0 <= s < cfg.vocab_size:
      raise ValueError(f"stop_ids must be token ids in [0, {cfg.vocab_size}), got {s!r}")
  return tuple(sorted(set(int(s) for s in ids)))


def check_dtype(name: str, dtype: Any) -> np.dtype:
  """A floating-point dtype (bfloat16, float16, float32): what weights, activations and the cache
  are computed in."""
  try:
    dt = np.dtype(dtype)
  except TypeError:
    raise ValueError(f"{name} must be a floating-point dtype such as jnp.bfloat16 or "
                     f"jnp.float32, got {dtype!r}") from None
  if dt.kind != "f" and dt.name != "bfloat16":
    raise ValueError(f"{name} must be a floating-point dtype such as jnp.bfloat16 or "
                     f"jnp.float32, got {dt.name}")
  return dt


def check_request(cfg: ModelConfig, prompts: Any, max_new_tokens: Any, max_len: int | None) -> int:
  """Every check a generate call needs against the model; returns the max_len to use."""
  check_prompts(prompts, cfg.vocab_size)
  check_max_new_tokens(max_new_tokens, len(prompts))
  return check_context(max(len(p) for p in prompts), max_len, max_new_tokens, cfg)


# Methods that draft one token per step by construction (quest picks pages per query token).
_CHAIN_ONLY = ("quest",)
# Methods that build one mask per round from a chain's draft rows.
_ROUND_MASK = ("specattn", "sts")
MAX_TREE_NODES = 32   # the ancestor bitmask is one int32 per row


def check_tree(tree: Any, order: str, method: str, gamma: Any):
  """A draft tree (widths per depth, or a `drafting.trees.Tree`) for `method`, or None. One-line
  ValueError for a tree on vanilla or a chain-only method, a gamma that is not the tree's depth,
  more nodes than the kernels' bitmask holds, or bad widths / order."""
  from jaxspec.drafting.trees import ORDERS, Tree
  if tree is None:
    return None
  if method == "none":
    raise ValueError("a draft tree needs a speculative method, not 'none'")
  if method in _CHAIN_ONLY:
    raise ValueError(f"method {method!r} drafts one token per step and cannot draft a tree")
  if method in _ROUND_MASK:
    raise ValueError(f"method {method!r} builds its attention mask from a chain's draft rows and "
                     "cannot draft a tree")
  if order not in ORDERS:
    raise ValueError(f"tree order must be one of {', '.join(ORDERS)}, got {order!r}")
  if not isinstance(tree, Tree):
    if isinstance(tree, (str, bytes)) or not hasattr(tree, "__iter__"):
      raise ValueError(f"tree must be widths per depth such as (2, 2, 1, 1), got {tree!r}")
    tree = Tree.from_widths(tuple(tree), order)
  else:
    tree = tree.flatten(order)
  if tree.depth == 0:
    raise ValueError("a draft tree needs at least one depth (widths such as (2, 2, 1, 1))")
  if tree.size > MAX_TREE_NODES:
    raise ValueError(f"a draft tree holds at most {MAX_TREE_NODES} nodes (the attention kernels' "
                     f"ancestor bitmask), got {tree.size}")
  if gamma is not None and gamma != tree.depth:
    raise ValueError(f"gamma {gamma} conflicts with the tree's depth {tree.depth}: with a tree, "
                     "gamma is its depth")
  return tree
