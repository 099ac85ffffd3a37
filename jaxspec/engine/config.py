"""`RunConfig`: everything static about a decoding run, bound once and shared by every loop."""
from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from jaxspec.engine.offload import OffloadConfig
from jaxspec.engine.sampling import SamplingParams
from jaxspec.model.attention import check_backend, default_backend


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """Static settings of a run (hashable: the jitted loops take it as a static argument).

  capacity: cache slots per sequence; gamma: draft tokens per round (0 = vanilla decoding);
  drafter: what drafts them (a `jaxspec.drafting` drafter; None for vanilla); backend: the
  attention implementation (`jaxspec.model.attention.BACKENDS`); cache_dtype: a dtype name;
  tree: a draft tree (`jaxspec.drafting.trees.Tree`) verified in one pass instead of a chain, with
  gamma its depth (the most drafts a round accepts); None drafts a chain of gamma; offload: where
  the target's KV cache lives (`jaxspec.engine.offload`; default on the device); ssv: an NSA
  target's verification schedule (`jaxspec.ssv.SSVConfig`, method 'ssv'; None: plain NSA or
  dense verification); fp8_drafts: the draft steps' MLPs multiply by FP8 copies of their weights
  (`jaxspec.model.fp8.add_fp8_mlps`, which the drafting model must have); verification and
  prefill keep the model's weights, so the output distribution is unchanged.
  """
  capacity: int
  sampling: SamplingParams = SamplingParams()
  stop_ids: tuple[int, ...] = ()
  backend: str = dataclasses.field(default_factory=default_backend)
  cache_dtype: str = "bfloat16"
  gamma: int = 0
  drafter: Any = None
  tree: Any = None
  offload: OffloadConfig = OffloadConfig()
  ssv: Any = None
  fp8_drafts: bool = False

  def __post_init__(self):
    check_backend(self.backend)
    object.__setattr__(self, "cache_dtype", jnp.dtype(self.cache_dtype).name)
    object.__setattr__(self, "stop_ids", tuple(sorted(set(int(s) for s in self.stop_ids))))
    if (self.gamma == 0) != (self.drafter is None):
      raise ValueError("a speculative run needs both gamma >= 1 and a drafter; vanilla neither")
    if not isinstance(self.gamma, int) or self.gamma < 0:
      raise ValueError(f"gamma (draft tokens per round) must be an integer, got {self.gamma!r}")
    if self.tree is not None and (self.drafter is None or self.gamma != self.tree.depth):
      raise ValueError(f"a draft tree needs a drafter and gamma = its depth ({self.tree.depth}), "
                       f"got gamma {self.gamma}")
    if self.offload.on_host and (self.drafter is None or self.tree is not None):
      raise ValueError("an offloaded KV cache is verified in speculative rounds over a chain")
    if self.ssv is not None and self.drafter is None:
      raise ValueError("an SSV verification schedule needs a speculative run")
    if self.fp8_drafts and self.drafter is None:
      raise ValueError("fp8_drafts needs a speculative run: vanilla decoding drafts nothing")

  @property
  def speculative(self) -> bool:
    return self.drafter is not None

  @property
  def verify_rows(self) -> int:
    """Tokens one verification pass feeds: gamma + 1 for a chain, the tree's nodes for a tree."""
    return self.gamma + 1 if self.tree is None else self.tree.size

  @property
  def reserve(self) -> int:
    """Free cache slots an active sequence needs for its next step (the verification's rows)."""
    return self.verify_rows
