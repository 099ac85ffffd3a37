"""STS-PD's sparse prefill of an appended turn, timed: does prefill matter enough for a kernel?

  python -m benchmarks.sts_prefill --contexts=16384,28672 --turns=512,2048 --chunks=16,64,256
  python -m benchmarks.sts_prefill --tiny --contexts=96 --turns=16 --chunks=4 --reps=1   # CPU smoke

A session of B sequences holds a context of n tokens (random tokens, prefilled by `Runner.start`)
and appends a turn of L tokens with `Runner.extend(..., chunk=C)` (method 'sts', budget
--budget of n per target KV head; `jaxspec.drafting.sts_prefill`: one scan step per chunk of C
rows, the draft dense, the target sparse). Reported per (n, L, B) and C, beside what the same
session spends elsewhere, all on the same runner:
  extend_ms        the turn's sparse prefill (median of --reps, compile excluded);
  round_ms         one STS decoding round after it (γ = --gamma), so the prefill reads as a number
                   of rounds (`extend_rounds`): a reply of R tokens at a tokens per round costs
                   R / a rounds;
  full_prefill_ms  a dense prefill of context and turn, n + L tokens, from scratch (what a server
                   without incremental prefill does): both models' forward passes under the
                   engine's prefill plan, at the exact length (the engine pads prompts to a power
                   of two, which would hide the turn's cost);
  dense_turn_ms    full_prefill_ms less the same prefill of the context alone: what a dense
                   prefill of the turn alone costs (L rows over n + L causal keys, L tokens
                   through the weights) with the same kernels; the engine has no dense append.
Random weights by default (timing only: the masks' contents do not change the work). Like STS
decoding, STS-PD CHANGES the target's output; this benchmark measures only time.
"""
from __future__ import annotations

import dataclasses
import datetime
import sys

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from flax import nnx

from benchmarks import sparse_eval as se
from benchmarks.common import device_name, git_commit, load, time_fn, write_json
from jaxspec import cli
from jaxspec.engine.runner import Runner
from jaxspec.model.attention import Prefill, default_backend
from jaxspec.model.kv_cache import KVCache

_TARGET = flags.DEFINE_string("target", "random:qwen2.5-coder-1.5b", "random:<shape> or a model spec")
_DRAFT = flags.DEFINE_string("draft", "random:qwen2.5-coder-0.5b", "random:<shape> or a model spec")
_TINY = flags.DEFINE_bool("tiny", False, "the tiny random pair of benchmarks.sparse_eval (a CPU "
                          "smoke run: its numbers mean nothing)")
_CONTEXTS = flags.DEFINE_list("contexts", ["16384", "28672"], "tokens in the session before the "
                              "turn (with the turn and the reply within the model's context)")
_TURNS = flags.DEFINE_list("turns", ["512", "2048"], "tokens in the appended turn")
_BATCHES = flags.DEFINE_list("batches", ["1", "8"], "sequences in the session")
_CHUNKS = flags.DEFINE_list("chunks", ["16", "64", "256"], "C: turn rows sharing one selection")
_BUDGET = flags.DEFINE_float("budget", 0.1, "STS budget: this share of the context per KV head")
_GAMMA = flags.DEFINE_integer("gamma", 4, "drafts per STS round")
_ROUNDS = flags.DEFINE_integer("rounds", 8, "decoding rounds timed per call")
_REPS = flags.DEFINE_integer("reps", 3, "timed calls (median; one more call warms up)")
_OUT = flags.DEFINE_string("out", "benchmarks/out/sts_prefill.json", "JSON results")


def _pair():
  if _TINY.value:
    pair = se.load_pair(None, None, True, jnp.float32)
    return pair.target, pair.draft
  return load(_TARGET.value)[0], load(_DRAFT.value)[0]


def _copy(state):
  return jax.block_until_ready(jax.tree.map(jnp.copy, state))


def _median_ms(fn, reps: int, setup=None) -> float:
  """common.time_fn in ms, one untimed call first (it compiles)."""
  return time_fn(fn, warmup=1, reps=reps, setup=setup) * 1e3


def dense_prefill_ms(target, draft, tokens: np.ndarray, reps: int, cache_dtype) -> float:
  """Both models' dense prefill of tokens [B, S] into fresh caches (the engine's `Prefill` plan
  and attention backend: cuDNN's flash attention on a GPU; no padding), median ms."""
  graphdefs, params = zip(*(nnx.split(m) for m in (target, draft)))
  b, s = tokens.shape

  @jax.jit
  def run(params, tokens):
    out = []
    for g, p in zip(graphdefs, params):
      model = nnx.merge(g, p)
      cache = KVCache.create(model.cfg, b, se.capacity_for(s), cache_dtype)
      positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
      hidden, cache, _ = model(tokens, positions, cache, Prefill(), default_backend())
      out.append((hidden[:, -1], cache))
    return out

  tokens = jnp.asarray(tokens, jnp.int32)
  return _median_ms(lambda: run(params, tokens), reps)


def measure(target, draft, n: int, turn: int, batch: int, chunks: list[int], *, budget: int,
            gamma: int, rounds: int, reps: int, cache_dtype=jnp.bfloat16, seed: int = 0
            ) -> list[dict]:
  """One session shape: a row per chunk size."""
  runner = Runner(target, method="sts", draft_model=draft, gamma=gamma, sts_budget=budget,
                  stop_ids=(), cache_dtype=cache_dtype)
  rng = np.random.default_rng(seed)
  vocab = target.cfg.vocab_size
  context = rng.integers(0, vocab, (batch, n))
  turns = rng.integers(0, vocab, (batch, turn))
  reply = (rounds + 2) * (gamma + 1)
  max_len = n + turn + 1 + reply + max(chunks) + 2 * (gamma + 1)
  state = jax.block_until_ready(runner.start(context.tolist(), reply, max_len=max_len)[0])

  full_ms = dense_prefill_ms(target, draft, np.concatenate([context, turns], 1), reps, cache_dtype)
  context_ms = dense_prefill_ms(target, draft, np.asarray(context), reps, cache_dtype)
  dense_turn_ms = full_ms - context_ms
  rows = []
  for c in chunks:
    extend_ms = _median_ms(lambda s: runner.extend(s, turns.tolist(), reply, chunk=c)[0], reps,
                           setup=lambda: (_copy(state),))
    after = jax.block_until_ready(runner.extend(_copy(state), turns.tolist(), reply, chunk=c)[0])
    round_ms = _median_ms(lambda s: runner.step(s, rounds)[0], reps,
                          setup=lambda: (_copy(after),)) / rounds
    rows.append(dict(context=n, turn=turn, batch=batch, chunk=c, budget=budget,
                     extend_ms=extend_ms, round_ms=round_ms, extend_rounds=extend_ms / round_ms,
                     full_prefill_ms=full_ms, context_prefill_ms=context_ms,
                     dense_turn_ms=dense_turn_ms, extend_over_full_prefill=extend_ms / full_ms,
                     extend_over_dense_turn=extend_ms / dense_turn_ms))
    print(f"n={n:6d} L={turn:5d} B={batch:3d} C={c:4d}: extend {extend_ms:9.2f} ms "
          f"({extend_ms / round_ms:6.1f} rounds of {round_ms:.2f} ms), full prefill of n + L "
          f"{full_ms:9.2f} ms, of the turn alone (dense) {dense_turn_ms:8.2f} ms", file=sys.stderr)
  return rows


def main(argv):
  del argv
  cli.quiet_logging()
  try:
    ints = {name: [int(x) for x in flag.value] for name, flag in
            (("contexts", _CONTEXTS), ("turns", _TURNS), ("batches", _BATCHES),
             ("chunks", _CHUNKS))}
    if any(x < 1 for xs in ints.values() for x in xs) or min(_GAMMA.value, _ROUNDS.value,
                                                             _REPS.value) < 1:
      raise ValueError("--contexts, --turns, --batches, --chunks, --gamma, --rounds and --reps "
                       "take integers >= 1")
    if not 0 < _BUDGET.value < 1:
      raise ValueError(f"--budget is a share of the context in (0, 1), got {_BUDGET.value}")
    target, draft = _pair()
  except ValueError as e:
    cli.fail("benchmarks.sts_prefill", str(e))
  settings = dict(target="tiny" if _TINY.value else _TARGET.value,
                  draft="tiny" if _TINY.value else _DRAFT.value,
                  target_config=dataclasses.asdict(target.cfg), budget_share=_BUDGET.value,
                  gamma=_GAMMA.value, rounds=_ROUNDS.value, reps=_REPS.value,
                  device=device_name(), commit=git_commit(),
                  date=datetime.date.today().isoformat(),
                  note="random weights: timing only; STS-PD changes the target's output")
  rows = []
  for n in ints["contexts"]:
    for turn in ints["turns"]:
      for b in ints["batches"]:
        rows += measure(target, draft, n, turn, b, ints["chunks"],
                        budget=max(1, int(_BUDGET.value * n)), gamma=_GAMMA.value,
                        rounds=_ROUNDS.value, reps=_REPS.value,
                        cache_dtype=jnp.float32 if _TINY.value else jnp.bfloat16)
        # Rewritten after every session shape, `complete` false until the last.
        write_json(_OUT.value, {"settings": settings, "results": rows, "complete": False})
  write_json(_OUT.value, {"settings": settings, "results": rows, "complete": True})


if __name__ == "__main__":
  cli.run(main, "benchmarks.sts_prefill")
