"""The KV cache: one preallocated [B, S, Hkv, D] buffer per layer for K and for V, plus lengths.

Static shapes (batch, capacity) are separate from traced counts (`lengths`). The model writes the
K/V of new tokens at positions lengths[b] + t but never moves `lengths`: the caller decides how many
of the written entries to keep (all of them for plain decoding, accepted + 1 after verification),
so rejected drafts are dropped by lengths, never by copying the cache.
On a tensor-parallel mesh the K/V buffers are split by KV head (`jaxspec.model.sharding`).
An NSA model (`ModelConfig.nsa`) also keeps compressed K/V per layer, [B, C, Hkv, D] with
C = `nsa.num_compressed(S)`, entry c holding compression block c once its last token is written
(`jaxspec.model.nsa`); other models keep none (empty tuples).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import Mesh

from jaxspec.model import nsa
from jaxspec.model.config import ModelConfig
from jaxspec.model.sharding import HEADS, constrain


@struct.dataclass
class KVCache:
  k: tuple[jax.Array, ...]   # per layer [B, S, Hkv, D]
  v: tuple[jax.Array, ...]
  lengths: jax.Array         # [B] int32: valid entries per sequence
  ck: tuple[jax.Array, ...] = ()   # NSA only: per layer compressed K [B, C, Hkv, D]
  cv: tuple[jax.Array, ...] = ()

  @classmethod
  def create(cls, cfg: ModelConfig, batch: int, capacity: int, dtype=jnp.bfloat16,
             mesh: Mesh | None = None) -> "KVCache":
    """Zeroed buffers; on `mesh` (the model's, `Transformer.mesh`) split by KV head."""
    shape = (batch, capacity, cfg.num_kv_heads, cfg.head_dim)

    def zeros(shape=shape):
      return constrain(jnp.zeros(shape, dtype), mesh, HEADS)
    compressed = ()
    if cfg.nsa is not None:
      shape_c = (batch, nsa.num_compressed(capacity, cfg.nsa), cfg.num_kv_heads, cfg.head_dim)
      compressed = tuple(zeros(shape_c) for _ in range(cfg.num_layers))
    return cls(k=tuple(zeros() for _ in range(cfg.num_layers)),
               v=tuple(zeros() for _ in range(cfg.num_layers)),
               lengths=jnp.zeros((batch,), jnp.int32), ck=compressed,
               cv=tuple(zeros(shape_c) for _ in compressed))

  @property
  def batch(self) -> int:
    return self.k[0].shape[0]

  @property
  def capacity(self) -> int:
    return self.k[0].shape[1]

  def chain_positions(self, t: int) -> jax.Array:
    """[B, t] positions of t new tokens that continue each sequence: lengths + 0..t-1."""
    return self.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None]


def write(cache_layer: jax.Array, new: jax.Array, positions: jax.Array) -> jax.Array:
  """Scatter new [B, T, H, D] into cache_layer [B, S, H, D] at positions [B, T].

  Positions past the capacity are dropped (prompt padding may run past the end of a short cache).
  """
  b = jnp.arange(new.shape[0])[:, None]
  return cache_layer.at[b, positions].set(new.astype(cache_layer.dtype), mode="drop")
