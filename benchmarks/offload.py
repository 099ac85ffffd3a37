"""STS verification step with the target's KV cache on the device, or in host memory with the
round's selected rows copied over (`jaxspec.engine.offload`): device vs on_demand vs prefetch.

  python -m benchmarks.offload --out benchmarks/out/offload.json      # 1.5B shapes, on a GPU
  python -m benchmarks.offload --smoke --out /tmp/offload_smoke.json   # tiny, CPU check

Random weights of --model's shape (default Qwen2.5-Coder-1.5B: 28 layers, 2 KV heads of 128), a
cache of --batch sequences filled with random K/V to --context tokens, and random selections: per
layer, sequence and KV head k = ceil(--budget_share * context) distinct positions below the
context (every list full, as STS's are when the round's union exceeds k). One step is what
`speculative.verify` runs before acceptance plus the write-back: the target's pass over
gamma + 1 new tokens with every layer sparse, the LM head, and for the host modes the write-back of
the gamma + 1 rows (all kept). The cache is donated from step to step.

  device     the pass over the full device cache (today's STS).
  on_demand  gather the rows from host memory, then the pass (a barrier between them).
  prefetch   the same without the barrier (the copies of later layers may overlap earlier layers'
             compute; the engine's mode). Both are single jitted programs: what XLA overlaps in
             them is what is measured (module docstring of `jaxspec.engine.offload`).
Apart: `gather` (the gather alone: bytes copied over its time is the achieved host-to-device
rate), `compact_verify` (the pass over a compact cache already on the device: the step's work
without the copy), `write_back` (the host scatter of the new rows alone).

Floor (METHOD.md): the bytes a step must copy host to device (K and V rows of every selected
position, per layer and KV head) over the host-to-device bandwidth measured in the same run (a
large `pinned_host` array moved with `device_put`, the best of an eager and a jitted copy). The
table gives each mode's ms per step, the floor, step / floor and achieved GB/s (copied bytes over
step time). Before timing, each host mode's hidden states are checked against the device mode's
(relative L2 error, reported). The H100 numbers are in benchmarks/RESULTS.md.
"""
from __future__ import annotations

import math
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx

from benchmarks.common import device_name, error_text, git_commit, load, time_fn, write_json
from jaxspec import cli
from jaxspec.engine import offload
from jaxspec.engine.state import capacity_for
from jaxspec.model.attention import LayerMapped, default_backend
from jaxspec.model.config import ModelConfig
from jaxspec.model.kv_cache import KVCache
from jaxspec.model.transformer import init_random

_MODEL = flags.DEFINE_string("model", "random:qwen2.5-coder-1.5b",
                             "random:<shape> (benchmarks/common.py SHAPES): the target's shape")
_SMOKE = flags.DEFINE_bool("smoke", False, "a tiny model, context 1024, batch 2 (CPU check)")
_CONTEXT = flags.DEFINE_integer("context", 32768, "tokens in the cache per sequence")
_BATCH = flags.DEFINE_integer("batch", 16, "sequences")
_SHARE = flags.DEFINE_float("budget_share", 0.1, "k, the keys per layer and KV head, as a share "
                            "of the context")
_GAMMA = flags.DEFINE_integer("gamma", 6, "drafts per round (gamma + 1 rows verified)")
_MODES = flags.DEFINE_list("modes", list(offload.OFFLOAD_MODES), "modes to time")
_REPS = flags.DEFINE_integer("reps", 10, "timed calls per case (median)")
_H2D_GB = flags.DEFINE_float("h2d_gb", 2.0, "size of the host-to-device bandwidth test, GB")
_BACKEND = flags.DEFINE_string("backend", None, "attention backend (default: pallas on a GPU)")
_OUT = flags.DEFINE_string("out", "benchmarks/out/offload.json", "JSON results")

SMOKE = ModelConfig(arch="qwen2", vocab_size=512, hidden_size=128, intermediate_size=256,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, qkv_bias=True)


def transfer_rates(nbytes: int, reps: int) -> dict[str, float]:
  """Host-to-device and device-to-host bytes/s of one `pinned_host` array of nbytes (random
  data), eager `device_put` and a jitted copy; the best per direction."""
  host, dev = offload.host_sharding(), offload.device_sharding()
  x_dev = jax.random.normal(jax.random.PRNGKey(7), (nbytes // 2,), jnp.bfloat16)
  x_host = jax.block_until_ready(jax.device_put(x_dev, host))
  to_dev = jax.jit(lambda a: jax.device_put(a, dev))
  to_host = jax.jit(lambda a: jax.device_put(a, host))
  rates = {}
  for name, fn, arg in (("h2d_eager", lambda a: jax.device_put(a, dev), x_host),
                        ("h2d_jit", to_dev, x_host),
                        ("d2h_eager", lambda a: jax.device_put(a, host), x_dev),
                        ("d2h_jit", to_host, x_dev)):
    rates[name] = nbytes / time_fn(lambda: fn(arg), warmup=2, reps=reps)
  del x_dev, x_host
  return {"h2d": max(rates["h2d_eager"], rates["h2d_jit"]),
          "d2h": max(rates["d2h_eager"], rates["d2h_jit"]), **rates}


def random_plan(key, layers: int, batch: int, heads: int, context: int, k: int) -> LayerMapped:
  """Every layer sparse, one full list of k distinct ascending positions < context per layer,
  sequence and KV head."""
  u = jax.random.uniform(key, (layers * batch * heads, context))
  idx = jnp.sort(jax.lax.top_k(u, k)[1], axis=-1).astype(jnp.int32).reshape(layers, batch, heads, k)
  return LayerMapped(indices=idx, counts=jnp.full((layers, batch, heads), k, jnp.int32),
                     tail_start=jnp.full((batch,), context, jnp.int32), slots=tuple(range(layers)))


def main(argv):
  del argv
  cli.quiet_logging()
  unknown = [m for m in _MODES.value if m not in offload.OFFLOAD_MODES]
  if unknown:
    raise app.UsageError(f"unknown modes {unknown}; choose from {', '.join(offload.OFFLOAD_MODES)}")
  if _SMOKE.value:
    model, weights = init_random(SMOKE, dtype=jnp.bfloat16), "random weights (smoke)"
    context, batch, h2d_bytes = 1024, 2, 64 << 20
  else:
    model, weights = load(_MODEL.value)
    context, batch, h2d_bytes = _CONTEXT.value, _BATCH.value, int(_H2D_GB.value * 1e9)
  cfg = model.cfg
  backend = _BACKEND.value or default_backend()
  rows = _GAMMA.value + 1
  k = math.ceil(_SHARE.value * context)
  capacity = capacity_for(context, rows)
  itemsize = jnp.dtype(jnp.bfloat16).itemsize
  row_bytes = 2 * cfg.num_kv_heads * cfg.head_dim * itemsize          # K and V, one position
  copied = cfg.num_layers * batch * k * row_bytes                       # host -> device per step
  written = cfg.num_layers * batch * rows * row_bytes                   # device -> host per step
  print(f"{device_name()} | {_MODEL.value if not _SMOKE.value else 'smoke'} ({weights}) | "
        f"B={batch} context={context} k={k} T={rows} | {copied / 1e6:.1f} MB copied per step | "
        f"memories {[m.kind for m in jax.devices()[0].addressable_memories()]}", file=sys.stderr)
  rates = transfer_rates(h2d_bytes, _REPS.value)
  print(f"host->device {rates['h2d'] / 1e9:.1f} GB/s, device->host {rates['d2h'] / 1e9:.1f} GB/s",
        file=sys.stderr)

  graphdef, params = nnx.split(model)
  keys = jax.random.split(jax.random.PRNGKey(0), 2 * cfg.num_layers + 3)
  fill = jax.jit(lambda key: jax.random.normal(key, (batch, capacity, cfg.num_kv_heads,
                                                     cfg.head_dim), jnp.bfloat16))
  cache = KVCache(k=tuple(fill(x) for x in keys[:cfg.num_layers]),
                  v=tuple(fill(x) for x in keys[cfg.num_layers:2 * cfg.num_layers]),
                  lengths=jnp.full((batch,), context, jnp.int32))
  plans = [random_plan(x, cfg.num_layers, batch, cfg.num_kv_heads, context, k)
           for x in keys[-3:-1]]
  tokens = jax.random.randint(keys[-1], (batch, rows), 0, cfg.vocab_size, jnp.int32)
  positions = cache.lengths[:, None] + jnp.arange(rows, dtype=jnp.int32)
  keep = jnp.full((batch,), rows, jnp.int32)

  def device_step(params, cache, plan):
    target = nnx.merge(graphdef, params)
    hidden, cache, _ = target(tokens, positions, cache, plan, backend)
    return jnp.argmax(target.logits(hidden), -1), hidden, cache

  def host_step(params, cache, plan, *, mode):
    target = nnx.merge(graphdef, params)
    hidden, new = offload.verify_pass(target, tokens, positions, cache, plan,
                                      offload.OffloadConfig(mode), backend)
    cache = offload.write_back(cache, new, cache.lengths, keep)
    return jnp.argmax(target.logits(hidden), -1), hidden, cache

  def compact_step(params, compact, plan):
    target = nnx.merge(graphdef, params)
    hidden, compact, _ = target(tokens, positions, compact, plan, backend)
    return jnp.argmax(target.logits(hidden), -1), compact

  def timed(step, cache):
    """Median seconds per step, the cache donated from call to call; the cache back."""
    holder, i = [cache], [0]

    def run():
      i[0] += 1
      out = step(params, holder[0], plans[i[0] % len(plans)])
      holder[0] = out[-1]
      return out[0]
    return time_fn(run, warmup=2, reps=_REPS.value), holder[0]

  out_rows, ref = [], None
  steps = {"device": jax.jit(device_step, donate_argnums=1)}
  for mode in ("on_demand", "prefetch"):
    steps[mode] = jax.jit(lambda p, c, pl, mode=mode: host_step(p, c, pl, mode=mode),
                          donate_argnums=1)
  _, ref, cache = steps["device"](params, cache, plans[0])   # the reference for the check
  ref = np.asarray(ref.astype(jnp.float32))
  if "device" in _MODES.value:
    t, cache = timed(steps["device"], cache)
    out_rows.append(dict(mode="device", step_ms=t * 1e3))
  host_cache = jax.block_until_ready(offload.to_host(cache))
  del cache                                   # the device copy of the full cache is not needed
  for mode in ("on_demand", "prefetch"):
    if mode not in _MODES.value:
      continue
    try:
      _, hidden, host_cache = steps[mode](params, host_cache, plans[0])
      hidden = np.asarray(hidden.astype(jnp.float32))
      rel = float(np.linalg.norm(hidden - ref) / np.linalg.norm(ref))
      t, host_cache = timed(steps[mode], host_cache)
      floor = copied / rates["h2d"]
      out_rows.append(dict(mode=mode, step_ms=t * 1e3, floor_ms=floor * 1e3,
                           step_over_floor=t / floor, achieved_gbps=copied / t / 1e9,
                           rel_err_vs_device=rel))
    except Exception as e:   # keep the other modes (e.g. a host computation XLA refuses)
      out_rows.append(dict(mode=mode, error=error_text(e, 500)))
    print(out_rows[-1], file=sys.stderr)

  parts = {}
  try:
    gather = jax.jit(offload.gather_selected, static_argnums=(2, 3))
    t = time_fn(lambda: gather(host_cache, plans[0], 0, rows)[0].k[-1], warmup=2,
                reps=_REPS.value)
    parts["gather"] = dict(ms=t * 1e3, gbps=copied / t / 1e9,
                           floor_ms=copied / rates["h2d"] * 1e3)
    compact, remapped = gather(host_cache, plans[0], 0, rows)
    compact_jit = jax.jit(compact_step, donate_argnums=1)
    holder = [compact]

    def run_compact():
      out, holder[0] = compact_jit(params, holder[0], remapped)
      return out
    parts["compact_verify"] = dict(ms=time_fn(run_compact, warmup=2, reps=_REPS.value) * 1e3)
    del holder, compact
    new = jax.jit(lambda p, c: offload.verify_pass(nnx.merge(graphdef, p), tokens, positions, c,
                                                   plans[0], offload.OffloadConfig("prefetch"),
                                                   backend)[1])(params, host_cache)
    back = jax.jit(offload.write_back, donate_argnums=0)
    box, start = [host_cache], jnp.full((batch,), context, jnp.int32)

    def run_back():
      box[0] = back(box[0], new, start, keep)
      return box[0].k[-1]
    t = time_fn(run_back, warmup=2, reps=_REPS.value)
    parts["write_back"] = dict(ms=t * 1e3, gbps=written / t / 1e9,
                               floor_ms=written / rates["d2h"] * 1e3)
  except Exception as e:
    parts["error"] = f"{type(e).__name__}: {str(e)[:500]}"
  print(parts, file=sys.stderr)

  write_json(_OUT.value, dict(
      device=device_name(), commit=git_commit(), jax=jax.__version__, model=_MODEL.value,
      weights=weights, smoke=_SMOKE.value, backend=backend, batch=batch, context=context,
      budget=k, rows=rows, capacity=capacity, bytes_copied_per_step=copied,
      bytes_written_back_per_step=written, h2d_gbps=rates["h2d"] / 1e9,
      d2h_gbps=rates["d2h"] / 1e9, transfer_rates_gbps={n: r / 1e9 for n, r in rates.items()},
      rows_by_mode=out_rows, parts=parts,
      time=time.strftime("%Y-%m-%d %H:%M:%S")))
  print(f"\nB={batch} context={context} k={k}: {copied / 1e6:.1f} MB host->device per step at "
        f"{rates['h2d'] / 1e9:.1f} GB/s")
  print(f"{'mode':>10} {'step ms':>9} {'floor ms':>9} {'x floor':>8} {'GB/s':>7} {'rel err':>8}")
  for r in out_rows:
    if "error" in r:
      print(f"{r['mode']:>10}  {r['error'][:70]}")
    elif r["mode"] == "device":
      print(f"{r['mode']:>10} {r['step_ms']:>9.3f}")
    else:
      print(f"{r['mode']:>10} {r['step_ms']:>9.3f} {r['floor_ms']:>9.3f} "
            f"{r['step_over_floor']:>8.2f} {r['achieved_gbps']:>7.1f} "
            f"{r['rel_err_vs_device']:>8.1e}")
  for name, p in parts.items():
    print(f"{name:>14} {p}" if name == "error" else
          f"{name:>14} {p['ms']:>9.3f} ms" + (f" {p['gbps']:.1f} GB/s" if "gbps" in p else ""))


if __name__ == "__main__":
  app.run(main)
