"""`RunConfig`: everything static about a decoding run, bound once and shared by every loop."""
from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from jaxspec.engine.sampling import SamplingParams
from jaxspec.model.attention import check_backend, default_backend


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """Static settings of a run (hashable: the jitted loops take it as a static argument).

  capacity: cache slots per sequence; gamma: draft tokens per round (0 = vanilla decoding);
  drafter: what drafts them (a `jaxspec.drafting` drafter; None for vanilla); backend: the
  attention implementation (`jaxspec.model.attention.BACKENDS`); cache_dtype: a dtype name.
  """
  capacity: int
  sampling: SamplingParams = SamplingParams()
  stop_ids: tuple[int, ...] = ()
  backend: str = dataclasses.field(default_factory=default_backend)
  cache_dtype: str = "bfloat16"
  gamma: int = 0
  drafter: Any = None

  def __post_init__(self):
    check_backend(self.backend)
    object.__setattr__(self, "cache_dtype", jnp.dtype(self.cache_dtype).name)
    object.__setattr__(self, "stop_ids", tuple(sorted(set(int(s) for s in self.stop_ids))))
    if (self.gamma == 0) != (self.drafter is None):
      raise ValueError("a speculative run needs both gamma >= 1 and a drafter; vanilla neither")
    if not isinstance(self.gamma, int) or self.gamma < 0:
      raise ValueError(f"gamma (draft tokens per round) must be an integer, got {self.gamma!r}")

  @property
  def speculative(self) -> bool:
    return self.drafter is not None

  @property
  def reserve(self) -> int:
    """Free cache slots an active sequence needs for its next step (gamma + 1 to verify)."""
    return self.gamma + 1
