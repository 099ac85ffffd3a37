"""Vegas's three-step tuning (paper §3.4) and the plots of its Fig. 8 and Fig. 13.

  python -m benchmarks.sweep --model=qwen2.5-coder-0.5b --workload=long --batch=16

1. Sweep the sparsity ratio at a large gamma (--big_gamma) on one batch of prompts; keep the
   smallest ratio whose mean accepted tokens per round is within --tolerance of the best.
2. At that ratio, sweep gamma for steady-state decode throughput (continuous batching, as
   throughput.py; refill prefills left out).
3. At that gamma, refine the ratio (x0.5, x0.75, x1.5 of step 1's) for throughput.
Prints the chosen (gamma, ratio); writes JSON and two PNGs: accepted tokens vs sparsity (Fig. 8)
and throughput over gamma x sparsity (Fig. 13; cells not measured are blank).
With --grid, step 2 and 3 measure the whole gamma x ratio grid instead.

Workloads as in throughput.py (`short`, `long`, `continuation`; --prompt_min_tokens /
--prompt_max_tokens for the last two). As there, EOS is honoured and sampling is the paper's
(temperature 0.6, top-p 0.95, top-k 20) by default; --ignore_eos (stress mode) is written into
the JSON (`ignore_eos`, `eos`) and both plot titles. Every measurement also records the mean share
of distinct 4-grams in the outputs (`benchmarks.common.distinct_ngram_share`): step 1 over its
batch, steps 2-3 over the requests that finished, so a setting that drafts well only because the
text loops shows.
"""
from __future__ import annotations

import os
import sys

import jax.numpy as jnp
import numpy as np
from absl import app, flags

from benchmarks import workloads
from benchmarks.common import (device_name, eos_label, eos_settings, git_commit,
                               repetition_summary, write_json)
from jaxspec import cli, requests
from jaxspec.engine.runner import Runner
from jaxspec.model.attention import default_backend
from jaxspec.engine.sampling import SamplingParams

_MODEL = flags.DEFINE_string("model", "qwen2.5-coder-0.5b", "jaxspec model spec")
_WORKLOAD = flags.DEFINE_enum("workload", "long", workloads.WORKLOADS, "see throughput.py")
_METHOD = flags.DEFINE_string("method", "vegas", "the method tuned")
_RATIOS = flags.DEFINE_list("ratios", ["0.01", "0.02", "0.03", "0.05", "0.07", "0.1", "0.15"],
                            "step 1 sparsity ratios")
_GAMMAS = flags.DEFINE_list("gammas", ["2", "4", "6", "8", "10"], "step 2 gammas")
_BIG_GAMMA = flags.DEFINE_integer("big_gamma", 10, "gamma for step 1")
_TOL = flags.DEFINE_float("tolerance", 0.03, "step 1: within this fraction of the best acceptance")
_MIN_TOKENS = flags.DEFINE_integer("min_tokens", 256, "smallest KV budget")
_BATCH = flags.DEFINE_integer("batch", 16, "slots (steps 2-3)")
_ACC_BATCH = flags.DEFINE_integer("accept_batch", 16, "step 1: prompts per ratio, prefilled as one "
                                  "batch (64 x 32K-token prompts at once do not fit an H200)")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 512, "tokens per request")
_PROMPT_MIN = flags.DEFINE_integer("prompt_min_tokens", 16384, "long and continuation workloads")
_PROMPT_MAX = flags.DEFINE_integer("prompt_max_tokens", None, "long and continuation workloads "
                                   "(default 32768, or less so that it and --max_new_tokens fit "
                                   "the model's context)")
_REQUESTS = flags.DEFINE_integer("num_requests", 128, "requests in the stream")
_WARMUP = flags.DEFINE_float("warmup_s", 5.0, "seconds before each throughput window")
_MEASURE = flags.DEFINE_float("measure_s", 15.0, "seconds per throughput window")
_CHUNK = flags.DEFINE_integer("chunk_rounds", 8, "rounds per compiled call")
_GRID = flags.DEFINE_bool("grid", False, "measure the whole gamma x ratio grid in steps 2-3")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.6, "")
_TOP_P = flags.DEFINE_float("top_p", 0.95, "")
_TOP_K = flags.DEFINE_integer("top_k", 20, "")
_IGNORE_EOS = flags.DEFINE_bool("ignore_eos", False, "stress mode: generate max_new_tokens for "
                                "every request; the JSON and plot titles say so")
_OUT = flags.DEFINE_string("out", "benchmarks/out/sweep",
                           "output prefix (.json, _fig8.png, _fig13.png)")
_SHARE = "distinct_4gram_share_mean"


def plot(acc: dict[float, float], tput: dict[tuple[int, float], float], prefix: str,
         ignore_eos: bool = False) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  ratios = sorted(acc)
  fig, ax = plt.subplots(figsize=(4.5, 3.2))
  ax.plot([100 * r for r in ratios], [acc[r] for r in ratios], "o-")
  ax.set_xlabel("sparsity ratio (% of KV entries)")
  ax.set_ylabel("accepted tokens / round")
  ax.set_title(eos_label(f"{_METHOD.value}, gamma={_BIG_GAMMA.value}", ignore_eos))
  fig.tight_layout()
  fig.savefig(prefix + "_fig8.png", dpi=110)
  gammas = sorted({g for g, _ in tput})
  rs = sorted({r for _, r in tput})
  grid = np.full((len(gammas), len(rs)), np.nan)
  for (g, r), v in tput.items():
    grid[gammas.index(g), rs.index(r)] = v
  fig, ax = plt.subplots(figsize=(1.2 + 0.9 * len(rs), 1.0 + 0.5 * len(gammas)))
  im = ax.imshow(grid, cmap="viridis", aspect="auto")
  ax.set_xticks(range(len(rs)), [f"{100 * r:g}%" for r in rs])
  ax.set_yticks(range(len(gammas)), [str(g) for g in gammas])
  ax.set_xlabel("sparsity ratio")
  ax.set_ylabel("gamma")
  for i in range(len(gammas)):
    for j in range(len(rs)):
      if np.isfinite(grid[i, j]):
        ax.text(j, i, f"{grid[i, j]:.0f}", ha="center", va="center", color="w", fontsize=8)
  fig.colorbar(im, label="decode tokens/s")
  ax.set_title(eos_label(f"{_METHOD.value}, {_WORKLOAD.value}", ignore_eos), fontsize=9)
  fig.tight_layout()
  fig.savefig(prefix + "_fig13.png", dpi=110)


def main(argv):
  del argv
  cli.quiet_logging()
  from jaxspec.io.loading import load_model
  prog, ignore_eos = "benchmarks.sweep", _IGNORE_EOS.value
  if _WORKLOAD.value in ("long", "continuation"):   # before the model loads
    try:
      workloads.check_prompt_range(_PROMPT_MIN.value,
                                   _PROMPT_MAX.value or workloads.PASSAGE_MAX,
                                   workloads.LONG_ROOM if _WORKLOAD.value == "long" else 0)
    except ValueError as e:
      cli.fail(prog, str(e))
  backend = default_backend()
  loaded = load_model(_MODEL.value, dtype=jnp.bfloat16)
  try:
    prompt_max = workloads.prompt_max_tokens(
        _PROMPT_MAX.value, requests.context_limit(loaded.model.cfg), _MAX_NEW.value)
    prompts = workloads.build(_WORKLOAD.value, loaded.tokenizer, _REQUESTS.value,
                              _PROMPT_MIN.value, prompt_max)
  except ValueError as e:   # passages longer than the context, or than the book
    cli.fail(prog, str(e))
  stop_ids = () if ignore_eos else loaded.stop_ids
  sampling = SamplingParams(_TEMPERATURE.value, _TOP_K.value, _TOP_P.value)
  capacity_len = max(len(p) for p in prompts) + _MAX_NEW.value
  ratios = [float(r) for r in _RATIOS.value]
  gammas = [int(g) for g in _GAMMAS.value]

  acc, acc_share = {}, {}
  for r in ratios:   # step 1
    runner = Runner(loaded.model, method=_METHOD.value, gamma=_BIG_GAMMA.value, sparsity=r,
                    min_tokens=_MIN_TOKENS.value, sampling=sampling, stop_ids=stop_ids,
                    backend=backend)
    outputs, stats = runner.generate(prompts[:_ACC_BATCH.value], max_new_tokens=_MAX_NEW.value,
                                     max_len=capacity_len)
    acc[r] = stats.extra["mean_accepted_tokens"]
    acc_share[r] = repetition_summary(dict(enumerate(outputs)))[_SHARE]
    print(f"step 1: ratio {r:g}: {acc[r]:.2f} accepted tokens / round, distinct 4-gram share "
          f"{acc_share[r]}", file=sys.stderr)
  best = max(acc.values())
  ratio = min(r for r in ratios if acc[r] >= (1 - _TOL.value) * best)

  tput, rows = {}, {}

  def measure(g, r):
    if (g, r) not in tput:
      runner = Runner(loaded.model, method=_METHOD.value, gamma=g, sparsity=r,
                      min_tokens=_MIN_TOKENS.value, sampling=sampling, stop_ids=stop_ids,
                      backend=backend)
      # Staggered first requests: slots finish spread out, not in waves (throughput --stagger).
      outputs = {}
      row, _ = runner.serve(prompts, _BATCH.value, _MAX_NEW.value, max_len=capacity_len,
                            chunk=_CHUNK.value, warmup_s=_WARMUP.value, measure_s=_MEASURE.value,
                            stagger=True, on_finish=outputs.__setitem__)
      summary = repetition_summary(outputs, loaded.stop_ids)
      rows[(g, r)] = dict(mean_accepted_tokens=row.get("mean_accepted_tokens"),
                          **{k: summary[k] for k in (_SHARE, "stopped_share")})
      # Decode-only: the refill prefills are the same work for every (gamma, ratio) and, with long
      # prompts and short windows, mostly noise (the first GPU sweep ranked by tokens/s with
      # refills and picked from that noise).
      tput[(g, r)] = row["decode_only_tokens_per_s"]
      print(f"gamma {g}, ratio {r:g}: {tput[(g, r)]:.1f} tok/s, {rows[(g, r)]}", file=sys.stderr)
    return tput[(g, r)]

  refine = sorted({ratio * f for f in (0.5, 0.75, 1.0, 1.5) if 0 < ratio * f <= 1})
  if _GRID.value:
    for g in gammas:
      for r in sorted(set(ratios) | set(refine)):
        measure(g, r)
  gamma = max(gammas, key=lambda g: measure(g, ratio))         # step 2
  ratio = max(refine, key=lambda r: measure(gamma, r))         # step 3
  print(f"chosen: gamma={gamma} ratio={ratio:g} ({tput[(gamma, ratio)]:.1f} tok/s)")
  os.makedirs(os.path.dirname(_OUT.value) or ".", exist_ok=True)
  write_json(_OUT.value + ".json", dict(
      device=device_name(), commit=git_commit(), model=_MODEL.value, workload=_WORKLOAD.value,
      method=_METHOD.value, batch=_BATCH.value, max_new_tokens=_MAX_NEW.value,
      sampling=dict(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k),
      **eos_settings(ignore_eos, loaded.stop_ids), argv=" ".join(sys.argv),
      step1_accepted={str(r): v for r, v in acc.items()},
      step1_distinct_4gram_share={str(r): v for r, v in acc_share.items()},
      throughput=[dict(gamma=g, ratio=r, decode_tokens_per_s=v, **rows[(g, r)])
                  for (g, r), v in tput.items()],
      chosen=dict(gamma=gamma, ratio=ratio)))
  plot(acc, tput, _OUT.value, ignore_eos)


if __name__ == "__main__":
  app.run(main)
