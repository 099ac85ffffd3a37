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
self-drafting strategy is lossless: 'exact'). SSV strategies (an NSA --model, e.g.
nsa:qwen2.5-coder-1.5b) are ssv[:gamma | :tWIDTHS[/order]][@class[.group]], drafted by
--draft_model (without one, by the NSA model itself); their class is their precision class
(strict: 'exact'; reuse, approx and approx_reuse CHANGE the output, and the reuse classes read
--ssv_schedule). One profile holds strategies of one kind. Sampling defaults to the benchmarks' (temperature
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
from jaxspec.drafting.policies import Scoring
from jaxspec.engine.planner import (Bucket, Expectation, Planner, Profile, Strategy,
                                    accepted_per_round, parse_strategy)
from jaxspec.engine.runner import Runner
from jaxspec.engine.sampling import SamplingParams


def define_flags(fv: flags.FlagValues = flags.FLAGS) -> None:
  """The flags, into `fv`. Defined only when run as a program, so that importing the module (the
  tests do) does not collide with another benchmark's flags of the same names."""
  f = dict(flag_values=fv)
  flags.DEFINE_string("model", "qwen2.5-coder-0.5b", "jaxspec model spec", **f)
  flags.DEFINE_list("strategies", ["vegas:6@0.07", "vegas:4@0.07", "vegas:8@0.07"],
                    "candidate strategies, method[:gamma | :tWIDTHS][@ratio]", **f)
  flags.DEFINE_list("contexts", ["4096", "16384"], "context buckets (upper bounds)", **f)
  flags.DEFINE_list("batches", ["1"], "batch sizes", **f)
  flags.DEFINE_string("precision", "exact", "the strategies' precision class label", **f)
  flags.DEFINE_string("draft_model", None, "SSV strategies: the draft model spec", **f)
  flags.DEFINE_string("ssv_schedule", None, "SSV reuse classes: the refresh/reuse schedule JSON "
                      "from jaxspec.ssv_calibrate", **f)
  flags.DEFINE_integer("min_tokens", 256, "smallest KV budget for drafting", **f)
  flags.DEFINE_enum("score", "logits", ["logits", "weights"], "vegas scores", **f)
  flags.DEFINE_integer("chunk_rounds", 8, "rounds per compiled call (as served)", **f)
  flags.DEFINE_integer("warmup_chunks", 1, "untimed chunks before timing", **f)
  flags.DEFINE_integer("chunks", 4, "timed chunks per strategy and bucket", **f)
  flags.DEFINE_float("temperature", 0.6, "sampling while profiling", **f)
  flags.DEFINE_float("top_p", 0.95, "", **f)
  flags.DEFINE_integer("top_k", 20, "", **f)
  flags.DEFINE_integer("seed", 0, "", **f)
  flags.DEFINE_string("out", "benchmarks/out/plan_profile.json", "the profile JSON", **f)


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
  FLAGS = flags.FLAGS
  cli.quiet_logging()
  prog = "benchmarks.plan_profile"
  try:
    strategies = [parse_strategy(t, FLAGS.precision) for t in FLAGS.strategies]
    if len({s.key for s in strategies}) != len(strategies):
      raise ValueError("--strategies names a strategy twice")
    if len({s.precision for s in strategies}) > 1:
      raise ValueError("--strategies mixes precision classes "
                       f"({', '.join(sorted({s.precision for s in strategies}))}): profile each "
                       "class in a run of its own")
    contexts = sorted(set(integers("--contexts", FLAGS.contexts, 16)))
    batches = sorted(set(integers("--batches", FLAGS.batches, 1)))
    for name, least in (("chunk_rounds", 1), ("chunks", 1), ("warmup_chunks", 0)):
      requests.check_count(f"--{name}", FLAGS[name].value, least)
    sampling = SamplingParams(FLAGS.temperature, FLAGS.top_k, FLAGS.top_p)
  except ValueError as e:
    cli.fail(prog, str(e))
  from jaxspec import ssv
  from jaxspec.io.loading import check_draft_pair, load_model
  try:
    loaded = load_model(FLAGS.model, dtype=jnp.bfloat16)
    extra = {}
    if strategies[0].method == "ssv":
      if FLAGS.draft_model:
        draft = load_model(FLAGS.draft_model, dtype=jnp.bfloat16)
        check_draft_pair(loaded, draft, FLAGS.model, FLAGS.draft_model)
        extra["draft_model"] = draft.model
      if strategies[0].ssv_class in ssv.REUSE_CLASSES:
        if not FLAGS.ssv_schedule:
          raise ValueError(f"SSV class {strategies[0].ssv_class} needs --ssv_schedule")
        extra["refresh"] = ssv.load_schedule(FLAGS.ssv_schedule, loaded.model)
    elif FLAGS.draft_model or FLAGS.ssv_schedule:
      raise ValueError("--draft_model and --ssv_schedule are for SSV strategies")
    runner = profiling_runner(loaded.model, strategies, min_tokens=FLAGS.min_tokens,
                              scoring=Scoring(kind=FLAGS.score), sampling=sampling, **extra)

    def book(batch, length):
      return workloads.continuation_prompts(loaded.tokenizer, batch, length, length, FLAGS.seed)
    result = profile(runner, strategies, contexts, batches, book, chunk=FLAGS.chunk_rounds,
                     warmup_chunks=FLAGS.warmup_chunks, chunks=FLAGS.chunks, seed=FLAGS.seed)
  except (OSError, ValueError) as e:
    cli.fail(prog, str(e))
  meta = dict(model=FLAGS.model, device=device_name(), commit=git_commit(),
              date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), min_tokens=FLAGS.min_tokens,
              score=FLAGS.score, chunk_rounds=FLAGS.chunk_rounds, chunks=FLAGS.chunks,
              sampling=dict(temperature=sampling.temperature, top_p=sampling.top_p,
                            top_k=sampling.top_k), argv=" ".join(sys.argv))
  result = Profile(result.strategies, result.buckets, meta)
  os.makedirs(os.path.dirname(os.path.abspath(FLAGS.out)), exist_ok=True)
  result.save(FLAGS.out)
  for b in result.buckets:
    ranked = sorted(b.entries, key=lambda kv: -kv[1].rate)
    print(f"B={b.batch} C={b.context}: " + ", ".join(
        f"{k} {e.accepted:.2f} tok/round {e.round_s * 1e3:.1f} ms" for k, e in ranked))
  print(f"wrote {FLAGS.out}", file=sys.stderr)


if __name__ == "__main__":
  define_flags()
  app.run(main)
