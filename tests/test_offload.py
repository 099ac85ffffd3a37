"""KV offload (`jaxspec.engine.offload`): attention over the compact gathered cache equals sparse
attention over the full cache (per layer, per-KV-head lists of different counts, the tail window
and the new rows); the target's verification pass likewise; write-back then gather round-trips;
greedy STS with the cache in host memory equals STS without; bad configuration."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxspec.engine import offload
from jaxspec.engine.config import RunConfig
from jaxspec.engine.runner import Runner
from jaxspec.model.attention import LayerMapped, Sparse, attend
from jaxspec.model.kv_cache import KVCache, write
from jaxspec.model.transformer import init_random
from test_specattn import PROMPTS, cfg
from test_speculative import sharpen

L, B, S, HKV, HQ, D, T, K, W = 3, 2, 64, 2, 4, 16, 3, 10, 5
LENGTHS = np.array([40, 25], np.int32)
TAIL = np.array([36, 25], np.int32)   # 4 cached tail positions for sequence 0, none for 1


def random_cache(rng, layers=L, heads=HKV, dim=D):
  def arr():
    return jnp.asarray(rng.normal(size=(B, S, heads, dim)), jnp.float32)
  return KVCache(k=tuple(arr() for _ in range(layers)), v=tuple(arr() for _ in range(layers)),
                 lengths=jnp.asarray(LENGTHS))


def random_lists(rng, layers, heads=HKV):
  """Per layer, sequence and KV head: distinct ascending positions below the tail, each list its
  own count (0 and K among them)."""
  idx = np.zeros((layers, B, heads, K), np.int32)
  cnt = rng.integers(1, K, size=(layers, B, heads)).astype(np.int32)
  cnt[0, 0, 0], cnt[-1, 1, -1] = 0, K
  for (j, b, h), c in np.ndenumerate(cnt):
    idx[j, b, h, :c] = np.sort(rng.choice(TAIL[b], size=c, replace=False))
  return jnp.asarray(idx), jnp.asarray(cnt)


@functools.partial(jax.jit, static_argnames="backend")
def attention(q, k_new, v_new, k, v, lengths, plan, backend):
  """One layer's attention of the T new rows (written at lengths + t) over its cache k, v."""
  slots = lengths[:, None] + jnp.arange(T)
  kc, vc = write(k, k_new, slots), write(v, v_new, slots)
  return attend(q, k_new, v_new, kc, vc, lengths, plan, backend)[0]


def layer_attention(q, k_new, v_new, cache, layer, plan, backend):
  return attention(q, k_new, v_new, cache.k[layer], cache.v[layer], cache.lengths,
                   plan.for_layer(layer), backend)


gather = jax.jit(offload.gather_selected, static_argnums=(2, 3))


@pytest.mark.parametrize("backend, shared", [("reference", False), ("reference", True),
                                             ("interpret", False)])
def test_compact_attention_equals_full_cache(backend, shared):
  """`backend` runs the compact side (the Pallas kernel in interpret mode: the GPU's path); the
  full cache's side is the reference."""
  rng = np.random.default_rng(0 if shared else 1)
  cache = random_cache(rng)
  if shared:   # SpecAttn-like: lists shared by the KV heads and by layers 0 and 2
    idx, cnt = random_lists(rng, 2, heads=1)
    plan = LayerMapped(indices=idx[:, :, 0], counts=cnt[:, :, 0], tail_start=jnp.asarray(TAIL),
                       slots=(0, 1, 0))
  else:
    idx, cnt = random_lists(rng, L)
    plan = LayerMapped(indices=idx, counts=cnt, tail_start=jnp.asarray(TAIL), slots=(0, 1, 2))
  host = offload.to_host(cache)
  if "pinned_host" in {m.kind for m in jax.devices()[0].addressable_memories()}:
    assert {x.sharding.memory_kind for x in host.k + host.v} == {"pinned_host"}
  compact, remapped = gather(host, plan, W, T)
  assert compact.k[0].shape == (B, 128, HKV, D)   # K + W + T rows, rounded up to 128
  assert compact.k[0].sharding.memory_kind == jax.devices()[0].default_memory().kind
  np.testing.assert_array_equal(compact.lengths, K + np.minimum(LENGTHS - TAIL, W))
  for layer in range(L):
    q = jnp.asarray(rng.normal(size=(B, T, HQ, D)), jnp.float32)
    k_new, v_new = (jnp.asarray(rng.normal(size=(B, T, HKV, D)), jnp.float32) for _ in "kv")
    full = layer_attention(q, k_new, v_new, cache, layer, plan, "reference")
    got = layer_attention(q, k_new, v_new, compact, layer, remapped, backend)
    np.testing.assert_allclose(np.asarray(got), np.asarray(full), rtol=1e-5, atol=1e-6)


def test_verify_pass_equals_full_cache_verification():
  """The target's whole verification pass with the on-demand barrier (prefetch, the same pass
  without it, runs end to end below): logits and the new rows' K/V equal the pass over the full
  device cache."""
  rng = np.random.default_rng(2)
  layers = 2
  graphdef, params = nnx.split(init_random(cfg(layers), dtype=jnp.float32, seed=5))

  @functools.partial(jax.jit, static_argnames="mode")
  def run(params, tokens, positions, cache, plan, mode):
    target = nnx.merge(graphdef, params)
    if mode == "device":
      hidden, cache, _ = target(tokens, positions, cache, plan, "reference")
      return target.logits(hidden), (cache.k, cache.v)
    hidden, rows = offload.verify_pass(target, tokens, positions, cache, plan,
                                       offload.OffloadConfig(mode, window=W), "reference")
    return target.logits(hidden), rows

  cache = random_cache(rng, layers)
  idx, cnt = random_lists(rng, layers)
  plan = LayerMapped(indices=idx, counts=cnt, tail_start=jnp.asarray(TAIL), slots=(0, 1))
  tokens = jnp.asarray(rng.integers(0, 96, size=(B, T)), jnp.int32)
  positions = cache.lengths[:, None] + jnp.arange(T)
  logits, full = run(params, tokens, positions, cache, plan, "device")
  slots = np.asarray(positions)
  got, new = run(params, tokens, positions, offload.to_host(cache), plan, "on_demand")
  np.testing.assert_allclose(np.asarray(got), np.asarray(logits), rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(np.argmax(got, -1), np.argmax(logits, -1))
  for rows, old in zip(new, full):
    for layer in range(layers):
      want = np.asarray(old[layer])[np.arange(B)[:, None], slots]
      np.testing.assert_allclose(np.asarray(rows[layer]), want, rtol=1e-6, atol=1e-6)


def test_write_back_then_gather_round_trips():
  rng = np.random.default_rng(3)
  cache = random_cache(rng)
  host = offload.to_host(cache)
  new = tuple(tuple(jnp.asarray(rng.normal(size=(B, T, HKV, D)), jnp.float32) for _ in range(L))
              for _ in "kv")
  start = jnp.asarray([20, S - 1], jnp.int32)   # sequence 1's rows past S - 1 must not spill
  keep = jnp.asarray([2, 3], jnp.int32)
  host = offload.write_back(host, new, start, keep)
  back = offload.to_device(host)
  for layer in range(L):
    for got, old, rows in zip((back.k, back.v), (cache.k, cache.v), new):
      want = np.asarray(old[layer]).copy()
      want[0, 20:22] = rows[layer][0, :2]        # row 2 of sequence 0 is dropped (keep 2)
      want[1, S - 1] = rows[layer][1, 0]         # rows at S, S + 1 are past the capacity
      np.testing.assert_array_equal(np.asarray(got[layer]), want)
  # Gathering the written positions brings the new rows back, each head its own list.
  idx = np.zeros((L, B, HKV, K), np.int32)
  idx[:, 0, :, :2] = [20, 21]
  idx[:, 1, :, :1] = S - 1
  cnt = np.broadcast_to(np.asarray([2, 1], np.int32)[None, :, None], (L, B, HKV))
  host = host.replace(lengths=jnp.asarray([S, S], jnp.int32))
  plan = Sparse(indices=jnp.asarray(idx), counts=jnp.asarray(cnt), tail_start=host.lengths)
  compact, _ = gather(host, plan, 0, T)
  for layer in range(L):
    for got, rows in zip((compact.k, compact.v), new):
      np.testing.assert_array_equal(np.asarray(got[layer][0, :2]), rows[layer][0, :2])
      np.testing.assert_array_equal(np.asarray(got[layer][1, :1]), rows[layer][1, :1])


def test_greedy_sts_with_offload_equals_without():
  """A 2-layer target drafting for itself (so that rounds accept some drafts and reject others):
  the cache in host memory, every round's rows gathered and written back, gives the same tokens."""
  target = sharpen(init_random(cfg(2), dtype=jnp.float32, seed=3))
  outs = {}
  for mode in ("device", "prefetch"):
    runner = Runner(target, method="sts", draft_model=target, gamma=1, sts_budget=4,
                    cache_dtype=jnp.float32, stop_ids=(), kv_offload=mode)
    outs[mode], stats = runner.generate(PROMPTS, max_new_tokens=16)
    assert 1 < stats.extra["mean_accepted_tokens"] < 2   # accepted drafts and rejected ones
  assert outs["prefetch"] == outs["device"]


@pytest.mark.parametrize("make, message", [
    (lambda t: offload.OffloadConfig("host"), "kv_offload must be one of device, on_demand, "
     "prefetch, got 'host'"),
    (lambda t: offload.OffloadConfig("prefetch", window=-1), "the offload tail window must be an "
     "integer >= 0, got -1"),
    (lambda t: Runner(t, method="sts", draft_model=t, sts_budget=4, kv_offload="pinned"),
     "kv_offload must be one of"),
    (lambda t: Runner(t, method="draft", draft_model=t, kv_offload="prefetch"),
     "kv_offload='prefetch' is built for method 'sts'"),
    (lambda t: Runner(t, method="sts", draft_model=t, sts_budget=4, kv_offload="on_demand").serve(
        PROMPTS, 2, 4, max_len=80, chunk=2, warmup_s=0, measure_s=1), "built for generate only"),
    (lambda t: RunConfig(capacity=128, offload=offload.OffloadConfig("prefetch")),
     "verified in speculative rounds over a chain"),
    (lambda t: offload.layer_lists(LayerMapped(indices=jnp.zeros((1, B, K), jnp.int32),
                                               counts=jnp.zeros((1, B), jnp.int32),
                                               tail_start=jnp.zeros((B,), jnp.int32),
                                               slots=(-1, 0)), 2, HKV), "every layer sparse"),
])
def test_bad_config_is_a_one_line_error(make, message):
  target = init_random(cfg(2), dtype=jnp.float32, seed=3)
  with pytest.raises(ValueError) as e:
    make(target)
  assert message in str(e.value) and "\n" not in str(e.value)
