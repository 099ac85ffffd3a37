"""The planner's offline profile: per context bucket and batch size, per strategy, the mean
accepted tokens per round and the round's latency.

  python -m benchmarks.plan_profile --model=qwen2.5-coder-0.5b \\
      --strategies=vegas:6@0.07,vegas:4@0.07,vegas:8@0.05,vegas:t2.2.1.1@0.07 \\
      --contexts=4096,16384 --batches=1,16 --out=plan.json
  python -m jaxspec.generate --model=qwen2.5-coder-0.5b --plan=plan.json --prompt "..."
  python -m benchmarks.throughput --model=qwen2.5-coder-0.5b --plan=plan.json --methods=none,vegas

For each batch size B and context bucket C (an upper bound: the planner uses the smallest
profiled bucket that holds a sequence's context), B plain-text passages of the book that
`benchmarks.workloads` continues (opening at paragraphs, no chat template) are prefilled to
3/4 C tokens, and each strategy decodes them with EOS ignored: --warmup_chunks untimed chunks of
--chunk_rounds rounds, then --chunks timed ones. Accepted tokens per round come from the
acceptance histogram of the timed rounds; the round latency is the timed chunks' wall time over
their rounds, the fused loop as `generate` and `serve` run it (`Runner.time_phases` times the
phases apart, which adds dispatch and loses fusion). Compiling is left out.

Strategies: method[:gamma | :tWIDTHS[/order]][@ratio], for methods vegas, vegas-all and
vegas-last (`jaxspec.engine.planner.parse_strategy`); --precision labels them (every
self-drafting strategy is lossless: 'exact'). Sampling defaults to the benchmarks' (temperature
0.6, top-p 0.95, top-k 20): acceptance depends on it, so profile with the settings you serve with.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from tqdm import tqdm

from benchmarks import workloads
from benchmarks.common import device_name, git_commit
from jaxspec import cli, requests
from jaxspec.engine.planner import (Bucket, Expectation, Planner, Profile, Strategy,
                                    accepted_per_round, parse_strategy)
from jaxspec.engine.runner import Runner
from jaxspec.engine.sampling import SamplingParams

_MODEL = flags.DEFINE_string("model", "qwen2.5-coder-0.5b", "jaxspec model spec")
_STRATEGIES = flags.DEFINE_list("strategies", ["vegas:6@0.07", "vegas:4@0.07", "vegas:8@0.07"],
                                "candidate strategies, method[:gamma | :tWIDTHS][@ratio]")
_CONTEXTS = flags.DEFINE_list("contexts", ["4096", "16384"], "context buckets (upper bounds)")
_BATCHES = flags.DEFINE_list("batches", ["1"], "batch sizes")
_PRECISION = flags.DEFINE_string("precision", "exact", "the strategies' precision class label")
_MIN_TOKENS = flags.DEFINE_integer("min_tokens", 256, "smallest KV budget for drafting")
_SCORE = flags.DEFINE_enum("score", "logits", ["logits", "weights"], "vegas scores")
_CHUNK = flags.DEFINE_integer("chunk_rounds", 8, "rounds per compiled call (as served)")
_WARMUP = flags.DEFINE_integer("warmup_chunks", 1, "untimed chunks before timing")
_CHUNKS = flags.DEFINE_integer("chunks", 4, "timed chunks per strategy and bucket")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.6, "sampling while profiling")
_TOP_P = flags.DEFINE_float("top_p", 0.95, "")
_TOP_K = flags.DEFINE_integer("top_k", 20, "")
_SEED = flags.DEFINE_integer("seed", 0, "")
_OUT = flags.DEFINE_string("out", "benchmarks/out/plan_profile.json", "the profile JSON")


def measure(runner: Runner, strategy: Strategy, prompts: list[list[int]], max_len: int, *,
            chunk: int, warmup_chunks: int, chunks: int, seed: int = 0) -> Expectation:
  """One strategy on one batch of prompts: accepted tokens per round and seconds per round over
  `chunks` timed chunks of `chunk` rounds, after `warmup_chunks` untimed ones (compiling
  excluded). `runner` carries a planner holding `strategy` (one cache size for all strategies).
  The prefill is the planner's first strategy's, switched to `strategy` (`Runner.switch`) as a
  planned run would be: one prefill compile per shape instead of one per strategy."""
  first = runner.planner.strategies[0]
  state, _, _ = runner.start(prompts, max_len - max(map(len, prompts)), max_len=max_len,
                             seed=seed, strategy=first)
  if strategy != first:
    state, _ = runner.switch(state, strategy)
  state, _ = runner.step(state, chunk, strategy)      # compiles
  for _ in range(warmup_chunks):
    state, _ = runner.step(state, chunk, strategy)
  hist0, rounds0 = jax.device_get((state.accept_hist, state.rounds))
  t0 = time.perf_counter()
  for _ in range(chunks):
    state, _ = runner.step(state, chunk, strategy)
  state = jax.block_until_ready(state)
  seconds = time.perf_counter() - t0
  hist, rounds, done = jax.device_get((state.accept_hist, state.rounds, state.decode.done))
  ran = int(rounds - rounds0)
  if done.any() or ran < chunks * chunk:
    raise ValueError(f"sequences finished while {strategy.key} was profiled: the context bucket "
                     f"leaves too little room for {warmup_chunks + chunks + 1} chunks of "
                     f"{chunk} rounds (raise the bucket or lower --chunks)")
  _, accepted = accepted_per_round(np.asarray(hist) - np.asarray(hist0))
  return Expectation(accepted=accepted, round_s=seconds / ran)


def profile(runner: Runner, strategies: list[Strategy], contexts: list[int], batches: list[int],
            prompts_for: Callable[[int, int], list[list[int]]], *, chunk: int,
            warmup_chunks: int, chunks: int, seed: int = 0) -> Profile:
  """Measure every strategy in every (context bucket, batch size) with `runner` (a Runner whose
  planner holds the strategies: see `profiling_runner`); `prompts_for(batch, length)` gives the
  prompts, which decode up to `context` tokens per sequence."""
  buckets = []
  bar = tqdm(total=len(contexts) * len(batches) * len(strategies), desc="profiling",
             file=sys.stderr, disable=not sys.stderr.isatty())
  for batch in batches:
    for context in contexts:
      prompts = prompts_for(batch, context * 3 // 4)
      entries = []
      for s in strategies:
        bar.set_postfix_str(f"B={batch} C={context} {s.key}")
        entries.append((s.key, measure(runner, s, prompts, context, chunk=chunk,
                                       warmup_chunks=warmup_chunks, chunks=chunks, seed=seed)))
        bar.update()
      buckets.append(Bucket(context, batch, tuple(entries)))
  bar.close()
  return Profile({s.key: s for s in strategies}, tuple(buckets))


def profiling_runner(model, strategies: list[Strategy], **settings) -> Runner:
  """One runner for every candidate, EOS ignored: a planner over them (with placeholder
  expectations) sizes one cache that holds each, as the planned runs will."""
  placeholder = Profile({s.key: s for s in strategies}, (Bucket(1, 1, tuple(
      (s.key, Expectation(1.0, 1.0)) for s in strategies)),))
  return Runner(model, stop_ids=(), planner=Planner(placeholder, strategies[0].precision),
                **settings)


def integers(name: str, values: list[str], minimum: int) -> list[int]:
  """A list flag's integers, each at least `minimum` (one-line ValueError)."""
  try:
    out = [int(v) for v in values]
  except ValueError:
    raise ValueError(f"{name} takes integers, got {','.join(values)}") from None
  if not out or min(out) < minimum:
    raise ValueError(f"{name} takes integers >= {minimum}, got {','.join(values)}")
  return out


def main(argv):
  del argv
  cli.quiet_logging()
  prog = "benchmarks.plan_profile"
  try:
    strategies = [parse_strategy(t, _PRECISION.value) for t in _STRATEGIES.value]
    if len({s.key for s in strategies}) != len(strategies):
      raise ValueError("--strategies names a strategy twice")
    contexts = sorted(set(integers("--contexts", _CONTEXTS.value, 16)))
    batches = sorted(set(integers("--batches", _BATCHES.value, 1)))
    for name, flag, least in (("--chunk_rounds", _CHUNK, 1), ("--chunks", _CHUNKS, 1),
                              ("--warmup_chunks", _WARMUP, 0)):
      requests.check_count(name, flag.value, least)
    sampling = SamplingParams(_TEMPERATURE.value, _TOP_K.value, _TOP_P.value)
  except ValueError as e:
    cli.fail(prog, str(e))
  from jaxspec.io.loading import load_model
  try:
    loaded = load_model(_MODEL.value, dtype=jnp.bfloat16)
    runner = profiling_runner(loaded.model, strategies, min_tokens=_MIN_TOKENS.value,
                              score_kind=_SCORE.value, sampling=sampling)

    def book(batch, length):
      return workloads.continuation_prompts(loaded.tokenizer, batch, length, length, _SEED.value)
    result = profile(runner, strategies, contexts, batches, book, chunk=_CHUNK.value,
                     warmup_chunks=_WARMUP.value, chunks=_CHUNKS.value, seed=_SEED.value)
  except (OSError, ValueError) as e:
    cli.fail(prog, str(e))
  meta = dict(model=_MODEL.value, device=device_name(), commit=git_commit(),
              date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), min_tokens=_MIN_TOKENS.value,
              score=_SCORE.value, chunk_rounds=_CHUNK.value, chunks=_CHUNKS.value,
              sampling=dict(temperature=sampling.temperature, top_p=sampling.top_p,
                            top_k=sampling.top_k), argv=" ".join(sys.argv))
  result = Profile(result.strategies, result.buckets, meta)
  os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
  result.save(_OUT.value)
  for b in result.buckets:
    ranked = sorted(b.entries, key=lambda kv: -kv[1].rate)
    print(f"B={b.batch} C={b.context}: " + ", ".join(
        f"{k} {e.accepted:.2f} tok/round {e.round_s * 1e3:.1f} ms" for k, e in ranked))
  print(f"wrote {_OUT.value}", file=sys.stderr)


if __name__ == "__main__":
  app.run(main)
