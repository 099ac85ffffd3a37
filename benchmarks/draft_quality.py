"""Expected draft acceptance of the self-drafting policies, without sampling noise (runs on a CPU).

  python -m benchmarks.draft_quality                  # the 0.5B, 2 passages of 4096 tokens
  python -m benchmarks.draft_quality --methods=vegas,streaming --context=8192 --passages=4

Each passage (workload (c)'s: a book passage as plain text, `workloads.continuation_prompts`) is
continued by the model's own samples (vanilla decoding at the sampling flags), and rounds are then
teacher-forced on that text, the same rounds for every method:
  1. verification: a dense pass over the gamma + 1 tokens from the prefix length P collects the
     scores the policy asks for (`verify_scores`);
  2. the prefix moves `--stride` tokens on, to P': the tokens a round commits, the accepted
     drafts plus the corrected or bonus token (about 7 in the engine's (c) runs at gamma 8);
  3. the policy selects from those scores (`select_kv`, with `stride - 1` drafts accepted), and
     one sparse pass over the gamma tokens from P' drafts them as a chain would: q;
  4. the next verification, the dense pass over the gamma + 1 tokens from P', gives the target's
     p at the same positions (and the next selection's scores). Draft i is accepted with
     probability alpha_i = sum_v min(p_i(v), q_i(v)), p and q under the sampling filters:
     speculative sampling's exact acceptance, given drafts 1..i-1 accepted. A round's expected
     tokens are 1 + sum_i prod_{j <= i} alpha_j.
Method `oracle` is no policy but the bound on every per-round selection at the same budget: step 3
first runs the gamma drafts densely, and the keys before P' with the largest softmax weight of
their own rows (summed over the rows and query heads, per layer) are what its sparse pass sees,
shaped as the vegas family's are (`--score_block` etc.; `--score` does not apply). Its gap to vegas
is what better-chosen keys could still give (benchmarks/RESULTS.md, sixty-fourth session).

Teacher forcing feeds the text's tokens where the engine feeds the drafts' own samples, and the
prefix moves by a fixed stride where the engine's moves by what was accepted; what it gives in
exchange is a figure free of sampling noise whose differences between methods are paired. The
rounds' attention is the pure-JAX reference's by default, which runs on any device; with
`--backend=pallas` (a GPU) the verification and draft passes run the engine's kernels, whose
Collect-2 scores are computed and rounded as the engine's are, so two trees' kernels can be
compared on the same rounds. The passages' prefill stays on the reference.

`--score=logits,weights` runs the vegas family once per Collect-2 score kind (the raw logits q.k,
the paper's, or the softmax weights), `--score_pool=1,9` once per pooling width of its scores
(`policies.pool_scores`), `--score_block=1,8` once per selection block (`policies.per_layer_topk`:
whole aligned blocks at the same budget), `--score_window=0,256` once per recent window (the
newest positions kept whole, the rest of the same budget ranked), and `--draft_mlp=model,fp8` each
method's draft passes with the model's MLP weights and with FP8 copies of them
(`jaxspec.model.fp8`, what `RunConfig.fp8_drafts` drafts with), on the same rounds.

Output: a markdown table on stdout (alpha by position, expected tokens a round with its standard
error, and the paired difference from the first method), the settings and per-round alphas as
JSON in --out.
"""
from __future__ import annotations

import dataclasses
import datetime
import functools
import itertools
import sys

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from flax import nnx
from tqdm import tqdm

from benchmarks import workloads
from benchmarks.common import device_name, git_commit, write_json
from jaxspec import cli
from jaxspec.drafting.policies import (POOLED, SCORE_BLOCK, SCORE_KINDS, SCORE_POOL,
                                       SCORE_WINDOW, SELF_DRAFTING, Scoring, SelectionPolicy,
                                       check_score_block, check_score_pool, check_score_window,
                                       make_policy, static_k_max)
from jaxspec.engine.runner import Runner
from jaxspec.engine.sampling import SamplingParams, probabilities
from jaxspec.model.attention import BACKENDS, Dense, ScoreSpec
from jaxspec.model.fp8 import add_fp8_mlps
from jaxspec.model.kv_cache import KVCache
from jaxspec.model.transformer import Transformer


def define_flags() -> None:
  """The flags, defined only when run as a program: the tests import this module beside other
  benchmarks whose flags share these names."""
  flags.DEFINE_string("model", "qwen2.5-coder-0.5b", "jaxspec model spec (demo name, checkpoint "
                      "dir)")
  flags.DEFINE_list("methods", ["vegas", "vegas-all", "streaming"],
                    f"self-drafting policies ({', '.join(SELF_DRAFTING)}), or '{ORACLE}': the "
                    "keys the drafts' own softmax weights rank first (module docstring)")
  flags.DEFINE_integer("context", 4096, "passage tokens before the first round")
  flags.DEFINE_integer("passages", 2, "passages (one batch)")
  flags.DEFINE_integer("rounds", 24, "teacher-forced rounds per passage")
  flags.DEFINE_integer("gamma", 8, "draft tokens per round")
  flags.DEFINE_integer("stride", 7, "tokens the prefix moves each round (1..gamma + 1)")
  flags.DEFINE_float("sparsity", 0.07, "sparsity ratio")
  flags.DEFINE_integer("min_tokens", 16, "KV budget floor")
  flags.DEFINE_float("temperature", 0.6, "sampling temperature (> 0)")
  flags.DEFINE_float("top_p", 0.95, "1 = off")
  flags.DEFINE_integer("top_k", 20, "0 = off")
  flags.DEFINE_integer("seed", 0, "passages' and continuation's seed")
  flags.DEFINE_list("score", [SCORE_KINDS[0]], "the vegas family's Collect-2 score kinds "
                    f"({', '.join(SCORE_KINDS)}), each method run once per kind on the same rounds")
  flags.DEFINE_list("score_pool", [str(SCORE_POOL)], "the vegas family's score pooling widths "
                    "(`policies.pool_scores`; odd, 1: the scores as they are), each method run "
                    "once per width on the same rounds")
  flags.DEFINE_list("score_block", [str(SCORE_BLOCK)], "the vegas family's selection blocks "
                    "(`policies.per_layer_topk`; 1: position by position), each method run once "
                    "per block on the same rounds")
  flags.DEFINE_list("score_window", [str(SCORE_WINDOW)], "the vegas family's recent windows "
                    "(`policies.per_layer_topk`: the newest positions kept whole, the rest of the "
                    "budget ranked; 0: none), each method run once per window on the same rounds")
  flags.DEFINE_list("draft_mlp", ["model"], "the draft passes' MLP weights, each method run once "
                    "per entry: 'model' (the model's own) and 'fp8' (FP8 copies, "
                    "jaxspec.model.fp8; rows 'METHOD fp8')")
  flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "weights and cache")
  flags.DEFINE_enum("backend", "reference", list(BACKENDS), "attention of the verification and "
                    "draft passes (module docstring)")
  flags.DEFINE_string("out", "benchmarks/out/draft_quality.json", "JSON results")


DRAFT_MLP = ("model", "fp8")
ORACLE = "oracle"   # the drafts' own attention picks their keys (module docstring)
_PREFILL_CHUNK = 512   # tokens per prefill pass: the reference attention's [T, S] logits stay small


@functools.partial(jax.jit, static_argnames=("graphdef", "logits", "backend", "fp8_mlp"))
def _forward(graphdef, state, cache: KVCache, tokens, plan, logits: bool = True,
             backend: str = "reference", fp8_mlp: bool = False):
  """T tokens after cache.lengths -> (logits [B, T, V] f32, or None without `logits`; the cache
  with their K/V written; scores or None)."""
  model = nnx.merge(graphdef, state)
  hidden, cache, scores = model(tokens, cache.chain_positions(tokens.shape[1]), cache, plan,
                                backend=backend, fp8_mlp=fp8_mlp)
  return (model.logits(hidden) if logits else None), cache, scores


@functools.partial(jax.jit, static_argnames=("policy",))
def _select(policy: SelectionPolicy, cache: KVCache, scores, first_row, accepted):
  return policy.select_kv(cache, scores, first_row, accepted)


@functools.partial(jax.jit, static_argnames=("policy",))
def _oracle_top(policy: SelectionPolicy, weights, prefix):
  """weights [L, B, gamma, S] (each draft row's, -inf where unseen) -> the top of their sum over
  the rows, before `prefix`."""
  summed = jnp.where(jnp.isfinite(weights), weights.astype(jnp.float32), 0.0).sum(2)
  return policy.top_plan(summed.astype(weights.dtype), prefix)


def cache_capacity(positions: int) -> int:
  """The cache slots `expected_acceptance` allocates for `positions` tokens: whole 128s (Quest's
  page summaries need whole pages)."""
  return -(-positions // 128) * 128


def _at(cache: KVCache, length: int) -> KVCache:
  return cache.replace(lengths=jnp.full_like(cache.lengths, length))


def expected_acceptance(model: Transformer, tokens: jax.Array, context: int,
                        policy: SelectionPolicy, *, gamma: int, stride: int, rounds: int,
                        sampling: SamplingParams, cache_dtype=jnp.float32,
                        backend: str = "reference", fp8_mlp: bool = False, oracle: bool = False,
                        progress: bool = False) -> np.ndarray:
  """alpha [rounds, B, gamma]: each draft's acceptance probability under `policy` (module doc),
  teacher-forced on tokens [B, >= context + rounds * stride + gamma + 1], the first `context` of
  which are the prompt; the rounds' attention on `backend` (the prefill's on the reference);
  `fp8_mlp`: the draft passes' MLPs multiply by their FP8 copies (`jaxspec.model.fp8`).
  `oracle`: the drafts see the keys their own dense pass weighs most (`ORACLE`), at `policy`'s
  budget and shaped by its `scoring` (a vegas-family policy; its scores are not used)."""
  b, n = tokens.shape
  need = context + rounds * stride + gamma + 1
  if n < need:
    raise ValueError(f"tokens hold {n} positions; {rounds} rounds from {context} need {need}")
  if not 1 <= stride <= gamma + 1:
    raise ValueError(f"stride must be in 1..gamma + 1 = {gamma + 1}, got {stride}")
  graphdef, state = nnx.split(model)
  cache = KVCache.create(model.cfg, b, cache_capacity(need), dtype=cache_dtype)
  for start in range(0, context, _PREFILL_CHUNK):
    t = min(_PREFILL_CHUNK, context - start)
    _, cache, _ = _forward(graphdef, state, _at(cache, start), tokens[:, start:start + t],
                           Dense(), logits=False)

  def verify(cache, p):
    return _forward(graphdef, state, _at(cache, p), tokens[:, p:p + gamma + 1],
                    Dense(scores=None if oracle else policy.verify_scores), backend=backend)

  def oracle_plan(cache, nxt):
    # Each draft row's own weights over the keys before it, summed over the rows: the keys the
    # drafts attend to most, before nxt, the tail from nxt on.
    _, _, weights = _forward(graphdef, state, _at(cache, nxt), tokens[:, nxt:nxt + gamma],
                             Dense(scores=ScoreSpec("weights", per_row=True)), logits=False,
                             backend=backend)
    return _oracle_top(policy, weights, jnp.full((b,), nxt, jnp.int32))

  alphas = []
  p = context
  _, cache, scores = verify(cache, p)
  for _ in tqdm(range(rounds), desc=policy.name, disable=not progress, file=sys.stderr):
    nxt = p + stride
    if oracle:
      plan = oracle_plan(cache, nxt)
    else:
      plan = _select(policy, _at(cache, nxt), scores, jnp.full((b,), p, jnp.int32),
                     jnp.full((b,), stride - 1, jnp.int32))
    q, _, _ = _forward(graphdef, state, _at(cache, nxt), tokens[:, nxt:nxt + gamma], plan,
                       backend=backend, fp8_mlp=fp8_mlp)
    # The drafts' K/V stay in that pass (its cache is dropped): verification writes the target's
    # own at those positions, as it overwrites the drafts' in the engine.
    logits, cache, scores = verify(cache, nxt)
    pd, qd = probabilities(logits[:, :gamma], sampling), probabilities(q, sampling)
    alphas.append(np.asarray(jnp.minimum(pd, qd).sum(-1)))
    p = nxt
  return np.stack(alphas)


def expected_tokens(alpha: np.ndarray) -> np.ndarray:
  """alpha [..., gamma] -> a round's expected tokens [...]: 1 + sum_i prod_{j <= i} alpha_j."""
  return 1.0 + np.cumprod(alpha, axis=-1).sum(-1)


def summary(alpha: np.ndarray, base: np.ndarray | None) -> dict:
  tokens = expected_tokens(alpha).ravel()
  row = dict(alpha_by_position=alpha.mean((0, 1)).round(4).tolist(),
             mean_alpha=round(float(alpha.mean()), 4),
             expected_tokens=round(float(tokens.mean()), 4),
             expected_tokens_se=round(float(tokens.std(ddof=1) / np.sqrt(tokens.size)), 4))
  if base is not None:
    diff = tokens - expected_tokens(base).ravel()
    row.update(diff_from_first=round(float(diff.mean()), 4),
               diff_from_first_se=round(float(diff.std(ddof=1) / np.sqrt(diff.size)), 4))
  return row


def table(rows: list[dict]) -> str:
  gamma = len(rows[0]["alpha_by_position"])
  lines = ["| method | expected tokens / round | vs first | "
           + " | ".join(f"alpha{i}" for i in range(1, gamma + 1)) + " |",
           "|---|---|---|" + "---|" * gamma]
  for r in rows:
    vs = ("-" if "diff_from_first" not in r
          else f"{r['diff_from_first']:+.3f} ± {r['diff_from_first_se']:.3f}")
    lines.append(f"| {r['method']} | {r['expected_tokens']:.3f} ± {r['expected_tokens_se']:.3f} "
                 f"| {vs} | " + " | ".join(f"{a:.3f}" for a in r["alpha_by_position"]) + " |")
  return "\n".join(lines)


# Each row label names the Scoring fields that vary across the run, e.g. "vegas score weights".
_SCORING_FIELDS = {"score": "kind", "pool": "pool", "block": "block", "window": "window"}


def _scoring_label(scoring: Scoring, scorings: list[Scoring], oracle: bool = False) -> str:
  return "".join(f" {name} {getattr(scoring, field)}" for name, field in _SCORING_FIELDS.items()
                 if len({getattr(s, field) for s in scorings}) > 1
                 and not (oracle and field == "kind"))


def _checked_ints(prog: str, flag: str, values: list[str], kind: str, check) -> list[int]:
  """A list flag's integers, each passed through `check`; a one-line failure naming the flag."""
  try:
    ints = [int(v) for v in values]
  except ValueError:
    cli.fail(prog, f"--{flag} takes {kind} integers, got {','.join(values)}")
  try:
    for n in ints:
      check(n)
  except ValueError as e:
    cli.fail(prog, f"--{flag}: {e}")
  return ints


def main(argv):
  del argv
  prog = "benchmarks.draft_quality"
  fv = flags.FLAGS
  cli.quiet_logging()
  unknown = [m for m in fv.methods if m not in SELF_DRAFTING + (ORACLE,)]
  if unknown:
    cli.fail(prog, f"unknown self-drafting methods {unknown}; choose from "
                   f"{', '.join(SELF_DRAFTING + (ORACLE,))}")
  for name, value in (("context", fv.context), ("passages", fv.passages),
                      ("rounds", fv.rounds), ("gamma", fv.gamma)):
    if value < 1:
      cli.fail(prog, f"{name} must be >= 1, got {value}")
  if not 1 <= fv.stride <= fv.gamma + 1:
    cli.fail(prog, f"stride must be in 1..gamma + 1 = {fv.gamma + 1}, got {fv.stride}")
  if not fv.score or set(fv.score) - set(SCORE_KINDS):
    cli.fail(prog, f"--score takes {' and '.join(SCORE_KINDS)}, got {fv.score}")
  pools = _checked_ints(prog, "score_pool", fv.score_pool, "odd positive", check_score_pool)
  blocks = _checked_ints(prog, "score_block", fv.score_block, "positive", check_score_block)
  windows = _checked_ints(prog, "score_window", fv.score_window, "non-negative",
                          check_score_window)
  scorings = [Scoring(kind=kind, pool=pool, block=block, window=window)
              for kind, pool, block, window in itertools.product(fv.score, pools, blocks, windows)]
  if not fv.draft_mlp or set(fv.draft_mlp) - set(DRAFT_MLP):
    cli.fail(prog, f"--draft_mlp takes {' and '.join(DRAFT_MLP)}, got {fv.draft_mlp}")
  if fv.temperature <= 0:
    cli.fail(prog, "temperature must be > 0: under greedy decoding alpha is 0 or 1 per draft")
  if fv.backend == "pallas" and jax.default_backend() != "gpu":
    cli.fail(prog, f"--backend=pallas runs the kernels on a GPU; jax's backend here is "
                   f"{jax.default_backend()} (--backend=interpret runs them on a CPU, slowly)")
  from jaxspec.io.loading import load_model
  dtype = jnp.float32 if fv.dtype == "float32" else jnp.bfloat16
  loaded = load_model(fv.model, dtype=dtype)
  if loaded.tokenizer is None:
    cli.fail(prog, f"{fv.model} ships no tokenizer: the passages are encoded from text")
  sampling = SamplingParams(fv.temperature, fv.top_k, fv.top_p)
  gamma, stride, rounds, context = fv.gamma, fv.stride, fv.rounds, fv.context
  try:
    prompts = workloads.continuation_prompts(loaded.tokenizer, fv.passages, context, context,
                                             seed=fv.seed)
  except ValueError as e:
    cli.fail(prog, str(e))
  # The model's own continuation, EOS ignored: the rounds need every position.
  new = rounds * stride + gamma + 1
  outputs, _ = Runner(loaded.model, sampling=sampling, cache_dtype=dtype).generate(
      prompts, max_new_tokens=new, seed=fv.seed)
  tokens = jnp.asarray([p + o for p, o in zip(prompts, outputs)], jnp.int32)
  capacity = cache_capacity(tokens.shape[1])
  settings = dict(model=fv.model, dtype=fv.dtype, context=context,
                  passages=fv.passages, rounds=rounds, gamma=gamma, stride=stride,
                  sparsity=fv.sparsity, min_tokens=fv.min_tokens, scores=fv.score,
                  score_pools=pools, score_blocks=blocks, score_windows=windows,
                  backend=fv.backend,
                  sampling=dataclasses.asdict(sampling), seed=fv.seed, device=device_name(),
                  commit=git_commit(), date=datetime.date.today().isoformat(), argv=sys.argv)
  if "fp8" in fv.draft_mlp:
    add_fp8_mlps(loaded.model)
  rows, first = [], None
  for method, scoring, mlp in itertools.product(fv.methods, scorings, fv.draft_mlp):
    oracle = method == ORACLE
    shaped = method in POOLED or oracle
    if scoring != scorings[0] and not shaped:
      continue   # the other policies take no scores to shape: the same rows again
    if oracle and scoring.kind != scorings[0].kind:
      continue   # the oracle ranks by the drafts' own weights, whatever the score kind
    policy = make_policy("vegas" if oracle else method, ratio=fv.sparsity,
                         min_tokens=fv.min_tokens,
                         k_max=static_k_max(capacity, fv.sparsity, fv.min_tokens),
                         scoring=scoring)
    alpha = expected_acceptance(loaded.model, tokens, context, policy, gamma=gamma, stride=stride,
                                rounds=rounds, sampling=sampling, cache_dtype=dtype,
                                backend=fv.backend, fp8_mlp=mlp == "fp8", oracle=oracle,
                                progress=True)
    label = method + (_scoring_label(scoring, scorings, oracle) if shaped else "")
    rows.append(dict(method=label if mlp == "model" else f"{label} fp8", draft_mlp=mlp,
                     **{f"score_{field}": getattr(scoring, field)
                        if shaped and not (oracle and field == "kind") else None
                        for field in _SCORING_FIELDS.values()},
                     **summary(alpha, first), alpha=alpha.round(5).tolist()))
    first = alpha if first is None else first
    write_json(fv.out, dict(settings, rows=rows))
  print(table(rows))


if __name__ == "__main__":
  define_flags()
  cli.run(main, "benchmarks.draft_quality")
