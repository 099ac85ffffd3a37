"""Rotary position embeddings (HF's rotate-half layout) with default, llama3 and YaRN scaling."""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from jaxspec.model.config import ModelConfig


def inverse_frequencies(cfg: ModelConfig) -> tuple[np.ndarray, float]:
  """Per-pair inverse frequencies [head_dim // 2] (float64 on the host) and the cos/sin scale."""
  dim, base = cfg.head_dim, cfg.rope_theta
  inv_freq = 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
  s = cfg.rope_scaling
  if s is None:
    return inv_freq, 1.0
  if s.kind == "llama3":
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled), 1.0
  if s.kind == "yarn":
    def mscale(scale, m=1.0):
      return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
    attn = s.attention_factor
    if attn is None:
      attn = (mscale(s.factor, s.mscale) / mscale(s.factor, s.mscale_all_dim)
              if s.mscale and s.mscale_all_dim else mscale(s.factor))

    def correction_dim(rotations):
      return dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
          2 * math.log(base))
    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
      low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
      high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    interp = inv_freq / s.factor
    return interp * (1 - extrapolation) + inv_freq * extrapolation, float(attn)
  raise ValueError(f"unsupported RoPE scaling {s.kind!r}")


def rope_tables(cfg: ModelConfig, positions: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
  """cos, sin of shape positions.shape + [head_dim], float32."""
  inv_freq, scale = inverse_frequencies(cfg)
  angles = positions[..., None].astype(jnp.float32) * jnp.asarray(inv_freq, jnp.float32)
  angles = jnp.concatenate([angles, angles], axis=-1)
  return jnp.cos(angles) * scale, jnp.sin(angles) * scale


def apply_rope(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
  """x [B, T, H, D]; cos/sin [B, T, D]. Rotate-half convention, computed in float32."""
  half = x.shape[-1] // 2
  xf = x.astype(jnp.float32)
  rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
  return (xf * cos[:, :, None] + rotated * sin[:, :, None]).astype(x.dtype)
