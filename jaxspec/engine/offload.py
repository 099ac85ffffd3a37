"""KV offload for STS: the target's KV cache in host memory; each round copies to the device only
the rows its sparse verification reads.

Why it fits STS (`../shared/papers/sts.txt`, the "known in advance" property): a round's
verification reads, per target layer and KV head, at most k prefix keys picked by the draft
model's attention, plus the round's new tokens, and that mask exists once the draft has run,
before the target needs it. So the full cache can live in host memory (memory kind `pinned_host`)
and a round copies k rows of K and V per layer and KV head instead of the whole prefix.

Layout (`HostKVCache`): per layer one array of rows [B * S * Hkv + 1, D] for K and one for V in
host memory; row (b * S + s) * Hkv + h holds sequence b, position s, KV head h. The last row is a
spare that takes the writes that are dropped, so every gather and scatter index is in bounds.
With flat rows a per-head gather is one row gather with a single index array (in host memory, like
the rows: a computation in host memory takes its operands there).

One round (`jaxspec.engine.speculative.verify` calls these):
  gather   `gather_selected`: per layer, the rows of its index lists (per KV head [B, Hkv, K];
           lists shared by the heads are broadcast to them) and of the tail window (the cached
           positions from tail_start up to lengths, at most `window`: STS's rounds start their
           tail at lengths, so none) are gathered in host memory and copied to the device into a
           compact cache [B, C, Hkv, D] (C: K + W + T rounded up to 128): compact slot i < K
           holds entry i of the head's list, the next w slots the window, and the T verification
           rows are written after them.
  verify   `verify_pass`: the target runs over the compact cache with the plan remapped to it
           (indices 0..K-1 with the same counts, tail_start K, lengths K + w). `positions` still
           carry the true positions (RoPE), only the slots move, so every query sees the same keys
           and values as sparse verification over the full cache: the same attention and logits,
           up to float rounding (the softmax sums run over another order of the same terms).
  write    `write_back`: after acceptance the kept rows' K/V (the root and the accepted drafts of
           the active sequences) go to their positions in the host cache, the rest to the spare.

Modes (`OffloadConfig.mode`):
  device     the cache stays on the device (today's path; every method).
  on_demand  gather once the plan exists, then verify: an optimization barrier holds the whole
             target pass until every layer's rows are on the device. The no-overlap baseline.
  prefetch   the same gather, issued as soon as the plan exists and without the barrier: layer j
             of verification waits for layer j's rows only, so the copies of later layers can run
             while earlier layers compute.

What overlap JAX can give. Within one jitted program (the runner runs a chunk of rounds as one)
JAX decides nothing about timing: XLA orders the work by its data dependencies, so issuing a copy
"early" in Python changes nothing, and a copy between memory kinds is an asynchronous copy that
XLA's scheduler may, or may not, run beside device work that does not depend on it. The only such
work in a round is verification's own (the embedding, and with prefetch the layers whose rows have
arrived): drafting cannot overlap, since the plan needs every draft step's rows and the next
round's draft needs this round's acceptance. Across jitted calls dispatch is asynchronous (a call
returns once queued, so Python overlaps the device), but programs on one device run one after the
other: a gather dispatched as its own program after the draft's does not run beside it. Hiding the
copy behind drafting would need a round's plan before the previous round's acceptance, which STS
does not have. How the gather runs: on a GPU (jax 0.11.2, seen once on an H100) XLA's host
offloader turns the gather of host-memory rows into host compute (it warns that this is "likely
to have a very slow execution time"): the CPU gathers the rows, then one copy per layer and
tensor moves them. `benchmarks/offload.py` measures the three modes and the host-to-device
bandwidth; nothing is measured yet. On the CPU backend (jax 0.10.2) `pinned_host` is one of the
device's memories and the same code runs, both kinds in host RAM.

Not built: prefill writes the cache on the device and then moves it (the device holds the prompts'
whole cache once); `Runner.serve` and tensor parallelism with an offloaded cache; offloading the
draft model's cache.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import SingleDeviceSharding

from jaxspec.model.attention import LayerMapped, Plan, Sparse
from jaxspec.model.kv_cache import KVCache

OFFLOAD_MODES = ("device", "on_demand", "prefetch")


@dataclasses.dataclass(frozen=True)
class OffloadConfig:
  """Where the target's KV cache lives and how a round's rows reach the device (static).

  mode: 'device', 'on_demand' or 'prefetch' (module docstring); window: the most cached tail
  positions (from the plan's tail_start up to lengths) a round copies besides the selected rows
  (0 for STS, whose tail starts at lengths)."""
  mode: str = "device"
  window: int = 0

  def __post_init__(self):
    if self.mode not in OFFLOAD_MODES:
      raise ValueError(f"kv_offload must be one of {', '.join(OFFLOAD_MODES)}, got {self.mode!r}")
    if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 0:
      raise ValueError(f"the offload tail window must be an integer >= 0, got {self.window!r}")

  @property
  def on_host(self) -> bool:
    return self.mode != "device"


def host_sharding(device: jax.Device | None = None) -> SingleDeviceSharding:
  """Pinned host memory of `device` (default: the first device)."""
  device = jax.devices()[0] if device is None else device
  kinds = {m.kind for m in device.addressable_memories()}
  # A backend without pinned host memory keeps the "host" cache in its default memory.
  return SingleDeviceSharding(device, memory_kind="pinned_host" if "pinned_host" in kinds else None)


def device_sharding(device: jax.Device | None = None) -> SingleDeviceSharding:
  device = jax.devices()[0] if device is None else device
  return SingleDeviceSharding(device, memory_kind=device.default_memory().kind)


@struct.dataclass
class HostKVCache:
  """The target's KV cache in host memory (module docstring): k, v per layer [B * S * Hkv + 1, D],
  row (b * S + s) * Hkv + h, the last row a spare; lengths [B] int32 on the device. Reads like a
  `KVCache` where the decode loop only needs lengths, batch and capacity."""
  k: tuple[jax.Array, ...]
  v: tuple[jax.Array, ...]
  lengths: jax.Array
  capacity: int = struct.field(pytree_node=False, default=0)
  kv_heads: int = struct.field(pytree_node=False, default=1)

  @property
  def batch(self) -> int:
    return (self.k[0].shape[0] - 1) // (self.capacity * self.kv_heads)

  @property
  def head_dim(self) -> int:
    return self.k[0].shape[1]

  def rows(self, positions: jax.Array) -> jax.Array:
    """positions [B, N] (every KV head's) or [B, N, Hkv] (one per head), in [0, S) -> the rows
    [B, N, Hkv] holding them."""
    if positions.ndim == 2:
      positions = positions[..., None]
    seq = jnp.arange(self.batch, dtype=jnp.int32)[:, None, None]
    return (seq * self.capacity + positions) * self.kv_heads + jnp.arange(self.kv_heads,
                                                                          dtype=jnp.int32)


def to_host(cache: KVCache) -> HostKVCache:
  """A device `KVCache` moved to host memory (inside or outside jit)."""
  b, s, h, d = cache.k[0].shape
  host = host_sharding()

  def rows(x):
    flat = jnp.concatenate([x.reshape(b * s * h, d), jnp.zeros((1, d), x.dtype)])
    return jax.device_put(flat, host)
  return HostKVCache(k=tuple(map(rows, cache.k)), v=tuple(map(rows, cache.v)),
                     lengths=cache.lengths, capacity=s, kv_heads=h)


def to_device(cache: HostKVCache) -> KVCache:
  """The whole host cache back on the device as a `KVCache` (tests, inspection)."""
  shape = (cache.batch, cache.capacity, cache.kv_heads, cache.head_dim)
  dev = device_sharding()

  def back(x):
    return jax.device_put(x, dev)[:-1].reshape(shape)
  return KVCache(k=tuple(map(back, cache.k)), v=tuple(map(back, cache.v)), lengths=cache.lengths)


def layer_lists(plan: Plan, layers: int, kv_heads: int) -> tuple[jax.Array, jax.Array]:
  """A plan in which every layer is sparse -> (indices [L, B, Hkv, K], counts [L, B, Hkv])."""
  if isinstance(plan, LayerMapped):
    if len(plan.slots) != layers or min(plan.slots) < 0:
      raise ValueError("KV offload verifies a plan with every layer sparse; this one has dense "
                       f"layers or not {layers} of them (slots {plan.slots})")
    idx, cnt = plan.indices, plan.counts
    if plan.slots != tuple(range(layers)):   # selections shared by several layers
      idx, cnt = idx[jnp.asarray(plan.slots)], cnt[jnp.asarray(plan.slots)]
  elif isinstance(plan, Sparse) and plan.tree_bits is None:
    idx, cnt = plan.indices, plan.counts
  else:
    raise ValueError(f"KV offload verifies a chain over sparse plans, got {type(plan).__name__}"
                     + (" with a draft tree" if isinstance(plan, Sparse) else ""))
  if idx.ndim == 3:   # one list per layer shared by the KV heads: [L, B, K]
    l, b, k = idx.shape
    idx = jnp.broadcast_to(idx[:, :, None], (l, b, kv_heads, k))
    cnt = jnp.broadcast_to(cnt[:, :, None], (l, b, kv_heads))
  return idx, cnt


def gather_selected(cache: HostKVCache, plan: Plan, window: int, new_rows: int
                    ) -> tuple[KVCache, Sparse]:
  """The rows `plan` selects (and the tail window) copied from the host cache into a compact
  device cache with room for `new_rows` new tokens, and the plan remapped to it (module
  docstring). Returns (compact `KVCache` [B, C, Hkv, D] per layer, C = K + window + new_rows
  rounded up to 128, lengths K + w; `Sparse` plan over it)."""
  idx, cnt = layer_lists(plan, len(cache.k), cache.kv_heads)
  n_layers, b, h, k = idx.shape
  s, d = cache.capacity, cache.head_dim
  tail = plan.tail_start
  w = jnp.clip(cache.lengths - tail, 0, window).astype(jnp.int32)                     # [B]
  win = jnp.broadcast_to(tail[:, None] + jnp.arange(window, dtype=jnp.int32), (b, window))
  host, dev = host_sharding(), device_sharding()

  # Room for the new rows, rounded up to 128 slots (the attention kernels' tiles divide it).
  room = -(-(k + window + new_rows) // 128) * 128 - k - window

  def fetch(x, at):
    """Rows `at` [B * N * Hkv] of host rows x, gathered in host memory, on the device."""
    # Reshaped in host memory, then moved: a reshape after the move became a bitcast across
    # memory spaces, which XLA's GPU compiler rejects (jax 0.11.2).
    got = jax.device_put(x[at].reshape(b, k + window, h, d), dev)
    return jnp.concatenate([got, jnp.zeros((b, room, h, d), x.dtype)], axis=1)

  ks, vs = [], []
  for layer in range(n_layers):
    # Per sequence the K selected positions of each head, then the window: [B, K + W, Hkv].
    pos = jnp.concatenate([idx[layer].swapaxes(1, 2), jnp.broadcast_to(
        win[:, :, None], (b, window, h))], axis=1)
    at = jax.device_put(cache.rows(jnp.clip(pos, 0, s - 1)).reshape(-1), host)
    ks.append(fetch(cache.k[layer], at))
    vs.append(fetch(cache.v[layer], at))
  compact = KVCache(k=tuple(ks), v=tuple(vs), lengths=k + w)
  remapped = Sparse(indices=jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), idx.shape),
                    counts=cnt, tail_start=jnp.full((b,), k, jnp.int32))
  return compact, remapped


def verify_pass(target, tokens: jax.Array, positions: jax.Array, cache: HostKVCache, plan: Plan,
                config: OffloadConfig, backend: str
                ) -> tuple[jax.Array, tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]]:
  """The target's sparse verification of tokens [B, T] at `positions` with the cache in host
  memory: `gather_selected`, then the target (a `Transformer`) over the compact cache. Returns
  (hidden [B, T, H], the T new rows' K and V per layer, each [B, T, Hkv, D], for `write_back`)."""
  t = tokens.shape[1]
  compact, remapped = gather_selected(cache, plan, config.window, t)
  if config.mode == "on_demand":   # nothing of the target pass starts before every row is in
    tokens, positions, compact = jax.lax.optimization_barrier((tokens, positions, compact))
  hidden, compact, _ = target(tokens, positions, compact, remapped, backend)
  at = (compact.lengths[:, None] + jnp.arange(t, dtype=jnp.int32))[:, :, None, None]

  def new(x):
    return jnp.take_along_axis(x, at, axis=1)
  return hidden, (tuple(map(new, compact.k)), tuple(map(new, compact.v)))


def write_back(cache: HostKVCache, new: tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]],
               start: jax.Array, keep: jax.Array) -> HostKVCache:
  """The new rows (per layer K and V [B, T, Hkv, D] of positions start + t) written to the host
  cache, the first keep[b] of each sequence (those past the capacity dropped too); the others go
  to the spare row. Lengths unchanged (the caller moves them)."""
  new_k, new_v = new
  b, t, h, d = new_k[0].shape
  pos = start[:, None] + jnp.arange(t, dtype=jnp.int32)                              # [B, T]
  ok = (jnp.arange(t)[None] < keep[:, None]) & (pos >= 0) & (pos < cache.capacity)
  spare = cache.k[0].shape[0] - 1
  rows = jnp.where(ok[..., None], cache.rows(jnp.clip(pos, 0, cache.capacity - 1)), spare)
  host = host_sharding()
  at = jax.device_put(rows.reshape(-1), host)

  def put(x, rows_new):
    return x.at[at].set(jax.device_put(rows_new.reshape(-1, d).astype(x.dtype), host))
  return cache.replace(k=tuple(map(put, cache.k, new_k)), v=tuple(map(put, cache.v, new_v)))
