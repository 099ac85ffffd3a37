"""Drafting accuracy of every selection policy on real weights (the paper's Fig. 4 / 10a).

  python -m benchmarks.acceptance                       # SmolLM2-135M, 16 AIME25 prompts, 512 tokens
  python -m benchmarks.acceptance --num_prompts=4 --max_new_tokens=128 --methods=vegas,streaming

For each method: mean accepted tokens per round (the accepted drafts plus the corrected/bonus
token, so gamma + 1 at best), the acceptance probability by draft position
(P(draft i accepted | drafts 1..i-1 accepted)) and, beside them, the mean share of distinct
4-grams in the outputs (`benchmarks.common.distinct_ngram_share`: text stuck in a loop drafts
well and scores low). Generation stops at the model's EOS; sampling defaults to the paper's
settings (temperature 0.6, top-p 0.95, top-k 20; SmolLM2-Instruct's model card suggests
--temperature=0.2 --top_p=0.9 --top_k=0). Prompts are AIME25 problems in the model's chat
template. Results go to --out as JSON, rewritten after every method, and a markdown table to stdout.
With --profile_rounds=N each method is also timed phase by phase (`Runner.profile_rounds`).
With --temperature=0 (greedy) vanilla decoding runs too and each method's agreement with it is
reported: the mean share of vanilla's tokens matched before the first difference, and the
number of identical outputs (1.0 and all in float32, where greedy speculative decoding is exact;
in bfloat16 the (gamma + 1)-token verification pass and the one-token step round differently, so
outputs can part at a near-tie). Library logging stays quiet unless --verbosity is given.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import sys
import time

import jax.numpy as jnp
from absl import app, flags

from benchmarks.common import (device_name, eos_settings, git_commit, repetition_summary,
                               write_json)
from jaxspec import cli
from jaxspec.drafting.policies import Scoring
from jaxspec.engine.runner import METHODS, Runner
from jaxspec.engine.sampling import SamplingParams

_MODEL = flags.DEFINE_string("model", "smollm2-135m", "jaxspec model spec (demo name, checkpoint dir)")
_DATA = flags.DEFINE_string("data", "../shared/data/aime25.jsonl", "AIME25 jsonl ({problem, answer})")
_NUM_PROMPTS = flags.DEFINE_integer("num_prompts", 16, "first N problems, one batch")
_MAX_PROMPT = flags.DEFINE_integer("max_prompt_tokens", 0, "skip problems whose templated prompt is "
                                   "longer (0 = keep all): prompts are padded to the longest one's "
                                   "power-of-two bucket, so one long prompt multiplies prefill cost")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 512, "new tokens per prompt")
_METHODS = flags.DEFINE_list("methods", ["vegas", "vegas-all", "vegas-last", "specextend",
                                         "streaming", "quest", "dense"], "methods to run")
_GAMMA = flags.DEFINE_integer("gamma", 6, "draft tokens per round")
_SPARSITY = flags.DEFINE_float("sparsity", 0.07, "sparsity ratio")
_MIN_TOKENS = flags.DEFINE_integer("min_tokens", 16, "KV budget floor (small, so the ratio binds "
                                   "at AIME's short contexts)")
_SCORE = flags.DEFINE_enum("score", "logits", ["logits", "weights"], "vegas score kind")
# The paper's settings (Qwen3's recommended ones), as every benchmark samples by default.
_TEMPERATURE = flags.DEFINE_float("temperature", 0.6, "0 = greedy")
_TOP_P = flags.DEFINE_float("top_p", 0.95, "1 = off")
_TOP_K = flags.DEFINE_integer("top_k", 20, "0 = off")
_SEED = flags.DEFINE_integer("seed", 0, "sampling seed")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "weights and cache")
_CHUNK = flags.DEFINE_integer("chunk_rounds", 32, "rounds per compiled call")
_PROFILE = flags.DEFINE_integer("profile_rounds", 0, "also time draft/verify/select over N rounds")
_OUT = flags.DEFINE_string("out", "benchmarks/out/acceptance.json", "JSON results")


def load_prompts(tokenizer, path: str, n: int, max_tokens: int = 0) -> tuple[list[list[int]], list[int]]:
  """The first n problems (fitting max_tokens if > 0) in the chat template; also their row numbers."""
  from jaxspec.io.loading import apply_chat_template
  with open(path) as f:
    problems = [json.loads(line)["problem"] for line in f if line.strip()]
  prompts, rows = [], []
  for i, p in enumerate(problems):
    ids = tokenizer.encode(apply_chat_template(tokenizer, p), add_special_tokens=False)
    if max_tokens and len(ids) > max_tokens:
      continue
    prompts.append(ids)
    rows.append(i)
    if len(prompts) == n:
      break
  return prompts, rows


def agreement(outputs: list[list[int]], reference: list[list[int]]) -> float:
  """Mean over sequences of the fraction of the reference matched before the first difference."""
  fractions = []
  for out, ref in zip(outputs, reference):
    same = next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), min(len(out), len(ref)))
    fractions.append(same / max(len(ref), 1))
  return sum(fractions) / len(fractions)


def table(results: list[dict], gamma: int) -> str:
  greedy = "agreement_with_vanilla" in results[0]
  head = ("| method | mean accepted tokens / round | distinct 4-gram share | "
          + " | ".join(f"p{i}" for i in range(1, gamma + 1)) + " | rounds | new tokens |"
          + (" agreement with vanilla |" if greedy else ""))
  rule = "|---|---|---|" + "---|" * gamma + "---|---|" + ("---|" if greedy else "")
  rows = [head, rule]
  for r in results:
    pos = " | ".join(f"{p:.3f}" for p in r["acceptance_by_position"])
    share = r.get("distinct_4gram_share_mean")
    rows.append(f"| {r['method']} | {r['mean_accepted_tokens']:.2f} | "
                f"{'-' if share is None else f'{share:.3f}'} | {pos} | {r['verify_rounds']} "
                f"| {r['new_tokens']} |"
                + (f" {r['agreement_with_vanilla']:.3f} |" if greedy else ""))
  return "\n".join(rows)


def main(argv):
  del argv
  cli.quiet_logging()
  from jaxspec.io.loading import load_model
  unknown = [m for m in _METHODS.value if m not in METHODS or m in ("none", "draft")]
  if unknown:
    raise app.UsageError(f"unknown or non-self-drafting methods {unknown}; choose from "
                         f"{METHODS[2:]}")
  dtype = jnp.float32 if _DTYPE.value == "float32" else jnp.bfloat16
  loaded = load_model(_MODEL.value, dtype=dtype)
  tok = loaded.tokenizer
  prompts, rows = load_prompts(tok, _DATA.value, _NUM_PROMPTS.value, _MAX_PROMPT.value)
  stop_ids = loaded.stop_ids
  sampling = SamplingParams(_TEMPERATURE.value, _TOP_K.value, _TOP_P.value)
  settings = dict(model=_MODEL.value, dtype=_DTYPE.value, num_prompts=len(prompts), problem_rows=rows,
                  prompt_tokens=[len(p) for p in prompts], max_new_tokens=_MAX_NEW.value,
                  gamma=_GAMMA.value, sparsity=_SPARSITY.value, min_tokens=_MIN_TOKENS.value,
                  score=_SCORE.value, sampling=dataclasses.asdict(sampling),
                  seed=_SEED.value, **eos_settings(False, stop_ids),
                  device=device_name(), commit=git_commit(),
                  date=datetime.date.today().isoformat())
  print(f"{device_name()} | {_MODEL.value} {_DTYPE.value} | {len(prompts)} prompts of "
        f"{min(settings['prompt_tokens'])}-{max(settings['prompt_tokens'])} tokens | "
        f"gamma {_GAMMA.value} ratio {_SPARSITY.value} min_tokens {_MIN_TOKENS.value}", file=sys.stderr)
  vanilla = None
  if sampling.greedy:
    # Greedy runs are also checked against vanilla greedy decoding: identical in float32 (the
    # method is lossless), an agreement rate in bfloat16 where rounding differs between the
    # one-token and the (gamma + 1)-token forward passes.
    vanilla, vstats = Runner(loaded.model, stop_ids=stop_ids, cache_dtype=dtype).generate(
        prompts, max_new_tokens=_MAX_NEW.value)
    settings["vanilla_decode_tokens_per_s"] = vstats.decode_tokens_per_s
  results = []
  for method in _METHODS.value:
    t0 = time.perf_counter()
    runner = Runner(loaded.model, method=method, gamma=_GAMMA.value, sparsity=_SPARSITY.value,
                    min_tokens=_MIN_TOKENS.value, scoring=Scoring(kind=_SCORE.value),
                    sampling=sampling, stop_ids=stop_ids, cache_dtype=dtype)
    outputs, stats = runner.generate(prompts, max_new_tokens=_MAX_NEW.value, seed=_SEED.value,
                                     chunk=_CHUNK.value)
    row = dict(stats.extra, new_tokens=stats.new_tokens, rounds=stats.rounds,
               prefill_s=stats.prefill_s, decode_s=stats.decode_s, decode_tokens_per_s=stats.decode_tokens_per_s,
               wall_s=time.perf_counter() - t0)
    row.update(repetition_summary(dict(enumerate(outputs)), stop_ids))
    if vanilla is not None:
      row["agreement_with_vanilla"] = agreement(outputs, vanilla)
      row["identical_sequences"] = sum(a == b for a, b in zip(outputs, vanilla))
    if _PROFILE.value:
      row["profile"] = runner.profile_rounds(prompts, rounds=_PROFILE.value, seed=_SEED.value)
    results.append(row)
    print(f"{method}: {row['mean_accepted_tokens']:.3f} tokens/round, by position "
          f"{[round(p, 3) for p in row['acceptance_by_position']]}, distinct 4-gram share "
          f"{row['distinct_4gram_share_mean']} ({row['wall_s']:.0f} s)", file=sys.stderr)
    write_json(_OUT.value, {"settings": settings, "results": results})
  print(table(results, _GAMMA.value))


if __name__ == "__main__":
  app.run(main)
