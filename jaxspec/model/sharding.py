"""Tensor parallelism over one mesh axis, `tp`: where every parameter and KV cache entry lives.

Megatron's layout, written as `NamedSharding`s on a `jax.sharding.Mesh` with an Auto axis, so that
XLA's SPMD partitioner (GSPMD) places the collectives:

  q/k/v_proj, gate/up_proj   kernels [in, out] split by output columns, biases likewise. Columns
                             h * head_dim .. (h + 1) * head_dim - 1 are head h, so each device
                             gets whole, contiguous heads (and whole MLP columns);
  o_proj, down_proj          kernels split by input rows: each device's partial product is summed
                             by one all-reduce after attention and one after the MLP;
  KV cache [B, S, Hkv, D]    split by KV head. Query head h reads KV head h // G and both head axes
                             are split into contiguous blocks, so each device holds the K/V its
                             own query heads read: attention needs no communication;
  embeddings, LM head, norms replicated (`param_spec`).

The embeddings and the LM head stay whole on every device: every sampling and acceptance path (the
top-k / top-p masks, speculative rejection over [B, gamma + 1, vocab] float32 logits) then sees full
rows without an all-gather of the logits, and greedy picks the same argmax as one device. The price
is the vocab x hidden table in every device's memory and read by every device each step (Qwen3-8B:
1.2 GB, 7% of its weights; Qwen2.5-0.5B: 28%). Splitting it by vocabulary is the alternative to
measure on GPUs (nothing here is measured on GPUs yet).

A mesh is bound once, to the model: `load_model(..., tp=N)` loads the weights straight into their
shards, `Runner(..., tp=N)` (or `shard_model`) places a model already in memory; `Transformer.mesh`
records it, and the model's forward pass, the KV cache and the attention dispatch read it from
there. No mesh (None) is one device and the unsharded code path.
"""
from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from jaxspec import requests
from jaxspec.model.config import ModelConfig

AXIS = "tp"
HEADS = P(None, None, AXIS, None)    # [B, T or S, heads, D]: q/k/v and the KV cache
REPLICATED = P()

_BY_COLUMNS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_BY_ROWS = ("o_proj", "down_proj")


def make_mesh(tp: int) -> Mesh | None:
  """A 1-D mesh over the first `tp` devices (None for tp=1: one device, nothing sharded).

  Raises a one-line ValueError when fewer than `tp` devices are available."""
  tp = requests.check_count("tp (tensor-parallel devices)", tp)
  devices = jax.devices()
  if tp > len(devices):
    raise ValueError(f"tp={tp} needs {tp} devices, but only {len(devices)} "
                     f"{devices[0].platform} device(s) are available")
  if tp == 1:
    return None
  # Auto: GSPMD propagates the parameter and cache shardings through the model (jax.make_mesh
  # defaults to Explicit axes, which would put the shardings into every array's type).
  return jax.make_mesh((tp,), (AXIS,), axis_types=(AxisType.Auto,), devices=devices[:tp])


def tp_size(mesh: Mesh | None) -> int:
  return 1 if mesh is None else mesh.shape[AXIS]


def check_divides(cfg: ModelConfig, mesh: Mesh | None, what: str = "the model") -> None:
  """Raise a one-line ValueError unless the mesh splits the model into whole KV heads and whole
  MLP columns."""
  tp = tp_size(mesh)
  if cfg.nsa is not None and tp > 1:
    raise ValueError(f"{what} uses NSA attention, which runs on one device for now (tp={tp})")
  if cfg.num_kv_heads % tp:
    raise ValueError(f"tp={tp} does not divide the {cfg.num_kv_heads} KV heads of {what}: "
                     "tensor parallelism gives every device whole KV heads")
  if cfg.intermediate_size % tp:
    raise ValueError(f"tp={tp} does not divide the MLP width {cfg.intermediate_size} of {what}")


def param_spec(path: str) -> P:
  """The PartitionSpec of a parameter, from its path (`layers/3/self_attn/q_proj/kernel`)."""
  parts = path.split("/")
  layer, name = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", parts[-1])
  if layer in _BY_COLUMNS:
    return P(None, AXIS) if name == "kernel" else P(AXIS)
  if layer in _BY_ROWS and name == "kernel":
    return P(AXIS, None)
  return REPLICATED


def param_sharding(path: str, mesh: Mesh | None) -> jax.sharding.Sharding:
  if mesh is None:
    return jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return NamedSharding(mesh, param_spec(path))


def place(x: Any, dtype, sharding: jax.sharding.Sharding) -> jax.Array:
  """`x` at `dtype` on `sharding`. A host array is cast on the host and `device_put` sends each
  device only its own slice, so no device ever holds the whole parameter of a sharded one."""
  if isinstance(x, jax.Array):
    x = x.astype(dtype)
  else:
    x = np.asarray(x).astype(dtype, copy=False)
  return jax.device_put(x, sharding)


def constrain(x: jax.Array, mesh: Mesh | None, spec: P) -> jax.Array:
  """`with_sharding_constraint` on the mesh; nothing without one."""
  if mesh is None:
    return x
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def _path_str(path) -> str:
  return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def state_shardings(state: Any, mesh: Mesh | None) -> Any:
  """The same pure-dict tree of parameters as `state`, with each leaf's sharding."""
  return jax.tree_util.tree_map_with_path(lambda p, _: param_sharding(_path_str(p), mesh), state)


def shard_model(model, mesh: Mesh | None):
  """The model with its parameters on `mesh` (None: all on the first device) and `model.mesh`
  set; the model passed in is left as it was. Arrays move device to device; for loading from disk
  use `load_model(..., tp=N)`, which reads each device's slice straight into it."""
  if mesh == model.mesh:
    return model
  if mesh is not None:
    check_divides(model.cfg, mesh)
  graphdef, state = nnx.split(model)
  state = jax.tree.map(lambda x: x, state)   # a fresh copy: `model` keeps its own arrays
  pure = nnx.to_pure_dict(state)
  placed = jax.tree.map(jax.device_put, pure, state_shardings(pure, mesh))
  nnx.replace_by_pure_dict(state, placed)
  out = nnx.merge(graphdef, state)
  out.mesh = mesh
  return out
