"""Continuous batching for the benchmarks: one method's engine and the serving loop (no flags)."""
from __future__ import annotations

import collections
import sys
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from jaxspec.engine import decode, speculative
from jaxspec.drafting import policies as selection
from jaxspec.engine.batching import insert_slot


class Engine:
  """One method's prefill / chunk / refill functions over a fixed batch of slots."""

  def __init__(self, model, method, gamma, sampling, stop_ids, capacity_len, backend, *,
               sparsity: float, min_tokens: int, score_kind: str = "logits"):
    self.method, self.gamma = method, gamma
    self.graphdef, self.params = nnx.split(model)
    self.sampling, self.stop_ids, self.backend = sampling, stop_ids, backend
    self.max_len = capacity_len
    self.spare = gamma + 1 if method != "none" else 1
    self.capacity = decode.make_batch([[0]], 1, capacity_len, spare=self.spare).capacity
    self.config = None
    if method != "none":
      policy = selection.make_policy(
          method, ratio=sparsity, min_tokens=min_tokens,
          k_max=selection.static_k_max(self.capacity, sparsity, min_tokens),
          score_kind=score_kind)
      self.config = speculative.SpecConfig(policy=policy, gamma=gamma, sampling=sampling,
                                           stop_ids=stop_ids, backend=backend)

  def prefill(self, prompts, max_new, seed, budget=None):
    """A state for `prompts` with room for max_new tokens each; `budget` (default max_new) is how
    many they may generate."""
    batch = decode.make_batch(prompts, budget or max_new, self.max_len, spare=self.spare)
    args = (self.graphdef, self.params, jnp.asarray(batch.prompts), jnp.asarray(batch.prompt_lens),
            jnp.asarray(batch.max_new), jax.random.PRNGKey(seed))
    if self.config is None:
      return decode.prefill_state(*args, capacity=batch.capacity, max_new_buffer=max_new,
                                  sampling=self.sampling, stop_ids=self.stop_ids,
                                  backend=self.backend, cache_dtype=jnp.bfloat16,
                                  reserve=self.spare)
    return speculative.speculative_prefill(*args, capacity=batch.capacity, max_new_buffer=max_new,
                                           cache_dtype=jnp.bfloat16, config=self.config)

  def chunk(self, state, rounds):
    if self.config is None:
      return decode.decode_chunk(self.graphdef, self.params, state, steps=rounds,
                                 sampling=self.sampling, stop_ids=self.stop_ids, backend=self.backend)
    return speculative.speculative_chunk(self.graphdef, self.params, state, rounds=rounds,
                                         config=self.config)

  def _decode_state(self, state):
    return state if self.config is None else state.decode

  def progress(self, state):
    """(num_new [B], done [B], accept histogram summed over slots or None)."""
    ds = self._decode_state(state)
    hist = None if self.config is None else state.accept_hist.sum(0)
    return jax.device_get((ds.num_new, ds.done, hist))

  def new_tokens(self, state, slot: int) -> np.ndarray:
    """The tokens slot `slot` has generated so far."""
    ds = self._decode_state(state)
    num_new, tokens = jax.device_get((ds.num_new[slot], ds.tokens[slot]))
    return tokens[:num_new]


def _put(state, fresh, slot: int, batch: int):
  """Refill one slot with a freshly prefilled batch-1 state (at batch 1, the state itself)."""
  return fresh if batch == 1 else insert_slot(state, fresh, jnp.int32(slot))


def serve(engine: Engine, prompts: list[list[int]], batch: int, max_new: int, *, chunk: int,
          warmup_s: float, measure_s: float, seed: int = 0, stagger: bool = False,
          on_finish: Callable[[int, np.ndarray], None] | None = None) -> tuple[dict, object]:
  """Continuous batching over the request stream.

  stagger: the first B requests may generate max_new * (i + 1) / B tokens (slot i), every later
  one max_new. Requests of one length that start together also finish together, so the window
  would see waves of B refills and little decoding between them; staggered, the slots finish
  evenly spread over one request's lifetime, as in a server that has been running for a while.
  Returns (the measured window's numbers, the final state: a steady-state batch to profile).
  `on_finish(request index, its new tokens)` runs for every request that finishes (tests use it
  to check that a request served in a refilled slot gets the tokens it would get alone).
  """
  queue = collections.deque(range(len(prompts)))
  # The first B requests go in one by one, like every later refill: a batched prefill of B long
  # prompts needs activation memory for B x 32K tokens at once (it ran out of memory on an H200 at
  # B=64). The placeholder one-token batch only fixes the state's static sizes.
  t_setup = time.perf_counter()
  state = engine.prefill([[0]] * batch, max_new, seed)
  slot_req = [queue.popleft() for _ in range(batch)]
  reported = np.zeros(batch, bool)
  for slot, req in enumerate(slot_req):
    budget = max(1, max_new * (slot + 1) // batch) if stagger else max_new
    state = _put(state, engine.prefill([prompts[req]], max_new, seed + req, budget), slot, batch)

  def finish(slots):
    for slot in slots:
      if on_finish is not None and not reported[slot]:
        on_finish(slot_req[slot], engine.new_tokens(state, slot))
      reported[slot] = True

  state = engine.chunk(state, chunk)             # compiles the chunk
  num_new, done, hist = engine.progress(state)
  t_setup = time.perf_counter() - t_setup
  counted = dict(tokens=0, seconds=0.0, refill_s=0.0, rounds=0, finished=0)
  hist_window = None
  t_start = time.perf_counter()
  measuring, t_measure = False, 0.0
  bar = tqdm(total=warmup_s + measure_s, desc=engine.method, unit="s", file=sys.stderr,
             bar_format="{desc}: {n:.0f}/{total:.0f} s {postfix}", disable=not sys.stderr.isatty())
  while True:
    t0 = time.perf_counter()
    state = engine.chunk(state, chunk)
    new_num, done, new_hist = engine.progress(state)   # waits for the chunk
    t1 = time.perf_counter()
    produced = int((new_num - num_new).sum())
    delta_hist = None if new_hist is None else new_hist - hist
    refilled = False
    for slot in np.flatnonzero(done):
      finish([slot])
      if not queue:
        continue
      counted["finished"] += measuring
      slot_req[slot] = req = queue.popleft()
      reported[slot] = False
      state = _put(state, engine.prefill([prompts[req]], max_new, seed + req), slot, batch)
      refilled = True
    if refilled:   # refilled slots restart their token counts and acceptance histograms
      new_num, done, new_hist = engine.progress(state)   # waits for the refills
    t2 = time.perf_counter()
    if measuring:
      counted["tokens"] += produced
      counted["seconds"] += t2 - t0
      counted["refill_s"] += t2 - t1
      counted["rounds"] += chunk
      if delta_hist is not None:
        hist_window = delta_hist if hist_window is None else hist_window + delta_hist
    num_new, hist = new_num, new_hist
    elapsed = t2 - t_start
    bar.n = min(elapsed, bar.total)
    bar.set_postfix_str(f"{counted['tokens'] / max(counted['seconds'], 1e-9):.0f} tok/s"
                        if measuring else "warming up")
    bar.refresh()
    if not measuring and elapsed >= warmup_s:
      measuring, t_measure = True, t2
    if measuring and t2 - t_measure >= measure_s:
      break
    if not queue and done.all():
      break
  bar.close()
  finish(np.flatnonzero(done))
  out = dict(method=engine.method, gamma=engine.gamma, setup_s=t_setup,
             measured_s=counted["seconds"], tokens=counted["tokens"],
             tokens_per_s=counted["tokens"] / counted["seconds"] if counted["seconds"] else None,
             decode_only_tokens_per_s=(counted["tokens"] / (counted["seconds"] - counted["refill_s"])
                                       if counted["seconds"] > counted["refill_s"] else None),
             refill_share=counted["refill_s"] / counted["seconds"] if counted["seconds"] else None,
             requests_finished=counted["finished"])
  if hist_window is not None:
    out.update(speculative.acceptance_summary(hist_window[None]))
  return out, state
