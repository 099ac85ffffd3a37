"""Steady-state decode throughput with continuous batching, several methods in one run.

  python -m benchmarks.throughput --model=qwen2.5-coder-0.5b --workload=short --batch=64 \
      --methods=none,streaming,quest,specextend,vegas-all,vegas --gammas=vegas=6,default=4
  python -m benchmarks.throughput --model=qwen2.5-coder-0.5b --workload=long --batch=16
  python -m benchmarks.throughput --model=random:qwen3-8b --workload=scale --batch=4
  python -m benchmarks.throughput --model=random:qwen3-8b --workload=scale --batch=4 --tp=2

Workloads: `short` (AIME25 + GSM8K with the chat template, --max_new_tokens 4096), `long` (16K-32K
token Frankenstein passages + a question, --max_new_tokens 1024), `scale` (random weights, a cache
filled to --context tokens: time per step / round only; acceptance means nothing on random weights).

For each method, B slots decode the request stream; whenever a sequence finishes, at the next chunk
boundary (every --chunk_rounds rounds) its slot is refilled with the next request (prefill of one
prompt + `jaxspec.engine.batching.insert_slot`); with --stagger (default) the first B requests have
staggered lengths, so finishes and refills spread evenly from the start. After --warmup_s seconds
the harness counts, over --measure_s seconds, the tokens produced and the wall time (refill prefills
included, as a serving engine's throughput counter would; decode-only throughput is reported too),
the mean accepted tokens per round, and (--profile) the drafting / verification / selection time
shares (`Runner.time_phases`) over a few rounds of the serving batch as it stands at the end of
the window. Same prompts and seed for all methods. A --methods entry `vegas@0.05` runs vegas at its
own ratio and `vegas:6` at its own gamma, so one run can hold a method at 0.07 and at its tuned
(gamma, ratio). Method `draft` drafts with the separate --draft_model (same tokenizer).
--tp=N shards the model (and the draft model) over N devices (`jaxspec.model.sharding`); the
copy ceiling in the JSON is still one device's. --disaggregate (short and long workloads) prefills
the refills on a second device while the first one decodes (`Runner.serve`).
"""
from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
from absl import app, flags

from benchmarks import workloads
from benchmarks.common import (copy_ceiling, device_name, filled_state, git_commit,
                               kernel_table, load, time_fn, write_json)
from jaxspec import cli
from jaxspec.drafting.draft_model import DraftModelState
from jaxspec.engine.runner import Runner
from jaxspec.engine.sampling import SamplingParams
from jaxspec.engine.state import SpecState, capacity_for
from jaxspec.io.loading import check_draft_pair
from jaxspec.model.attention import default_backend
from jaxspec.model.sharding import make_mesh

_MODEL = flags.DEFINE_string("model", "qwen2.5-coder-0.5b", "jaxspec model spec, or random:<shape>")
_DRAFT_MODEL = flags.DEFINE_string("draft_model", None, "method 'draft': the draft model (a jaxspec "
                                   "model spec sharing --model's tokenizer, or random:<shape>)")
_WORKLOAD = flags.DEFINE_enum("workload", "short", ["short", "long", "scale"], "see module doc")
_METHODS = flags.DEFINE_list("methods", ["none", "streaming", "quest", "specextend", "vegas-all",
                                         "vegas"],
                             "methods to run, in order; method@ratio overrides --sparsity, "
                             "method:gamma (or method@ratio:gamma) --gammas")
_GAMMAS = flags.DEFINE_list("gammas", ["vegas=6", "default=4"],
                            "gamma per method: method=g entries and default=g")
_SPARSITY = flags.DEFINE_float("sparsity", 0.07, "KV ratio for drafting")
_MIN_TOKENS = flags.DEFINE_integer("min_tokens", 256, "smallest KV budget")
_SCORE = flags.DEFINE_enum("score", "logits", ["logits", "weights"], "vegas scores")
_BATCH = flags.DEFINE_integer("batch", 64, "decode slots")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", None, "per request (default 4096 short, 1024 long)")
_PROMPT_MIN = flags.DEFINE_integer("prompt_min_tokens", 16384, "long workload: shortest passage")
_PROMPT_MAX = flags.DEFINE_integer("prompt_max_tokens", 32768, "long workload: longest passage")
_CONTEXT = flags.DEFINE_integer("context", 131072, "scale workload: tokens in the cache")
_REQUESTS = flags.DEFINE_integer("num_requests", 512, "requests in the stream (cycled data)")
_WARMUP = flags.DEFINE_float("warmup_s", 20.0, "seconds before measuring (compile excluded)")
_MEASURE = flags.DEFINE_float("measure_s", 40.0, "seconds measured per method")
_CHUNK = flags.DEFINE_integer("chunk_rounds", 8, "rounds (or steps) per compiled call")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.6, "sampling (the paper's Qwen3 settings)")
_TOP_P = flags.DEFINE_float("top_p", 0.95, "")
_TOP_K = flags.DEFINE_integer("top_k", 20, "")
_SEED = flags.DEFINE_integer("seed", 0, "")
_IGNORE_EOS = flags.DEFINE_bool("ignore_eos", False, "generate max_new_tokens for every request "
                                 "(steady long contexts when the model would stop early)")
_STAGGER = flags.DEFINE_bool("stagger", True, "the first B requests stop after max_new * (i + 1) "
                             "/ B tokens, so slots finish spread out as in a long-running server "
                             "(not all at once, then B refills in a row)")
_TRACE = flags.DEFINE_bool("trace", False, "scale workload: GPU time per kernel of one chunk "
                           "(jax.profiler) in the JSON")
_PROFILE = flags.DEFINE_bool("profile", True, "measure phase time shares (speculative methods)")
_PLOT_ONLY = flags.DEFINE_string("plot_only", None, "redraw the PNG of an existing JSON and exit")
_OUT = flags.DEFINE_string("out", None, "JSON path (default benchmarks/out/throughput_<workload>.json)")
_TP = flags.DEFINE_integer("tp", 1, "tensor parallelism: devices to shard the model over")
_DISAGGREGATE = flags.DEFINE_bool("disaggregate", False, "prefill refills on a second device "
                                  "while the first one decodes (short and long workloads)")


def parse_entry(entry: str) -> tuple[str, float, int]:
  """A --methods entry -> (method, ratio, gamma). 'vegas' runs at --sparsity, 'vegas@0.05' at its
  own ratio, 'vegas:6' or 'vegas@0.05:6' at its own gamma; otherwise gamma comes from --gammas:
  the entry itself, then its method, then 'default'."""
  name, _, own_gamma = entry.partition(":")
  method, _, ratio = name.partition("@")
  table = dict(item.split("=") for item in _GAMMAS.value)
  gamma = own_gamma or table.get(entry, table.get(method, table.get("default", 4)))
  return method, float(ratio) if ratio else _SPARSITY.value, int(gamma)


def phase_times(runner: Runner, state):
  """(state, draft / verify / select seconds per round and shares) over 4 rounds of `state`."""
  state, phases = runner.time_phases(state, rounds=4, warmup=1)
  return state, {k: v for k, v in phases.items() if k.endswith(("_share", "_per_round"))}


def make_runner(model, draft_model, entry: str, sampling: SamplingParams, stop_ids, backend: str
                ) -> Runner:
  method, ratio, g = parse_entry(entry)
  return Runner(model, method=method, gamma=g, sparsity=ratio, min_tokens=_MIN_TOKENS.value,
                score_kind=_SCORE.value, draft_model=draft_model if method == "draft" else None,
                sampling=sampling, stop_ids=stop_ids, backend=backend)


def scale_state(runner: Runner, batch: int, context: int, max_len: int, steps_total: int):
  """A state whose cache holds `context` random tokens per sequence; for self-drafting the
  policy's first selection, from random stand-in scores (random like the weights); for a draft
  model its cache filled likewise."""
  cap = capacity_for(max_len, runner.spare)
  cfg, mesh = runner.model.cfg, runner.mesh
  ds = filled_state(cfg, batch, context, cap, steps_total, mesh=mesh)
  if not runner.speculative:
    return ds
  config = runner.config(cap)
  if runner.method == "draft":
    drafter = DraftModelState(cache=filled_state(runner.draft_model.cfg, batch, context - 1, cap,
                                                 steps_total, seed=1, mesh=mesh).cache,
                              prev_token=jnp.ones((batch,), jnp.int32))
  else:
    scores = None
    if config.drafter.prefill_scores is not None:
      scores = jax.random.normal(jax.random.PRNGKey(1), (cfg.num_layers, batch, cap), jnp.bfloat16)
    drafter = jax.jit(lambda ds, scores: config.drafter.start(None, None, None, ds, scores,
                                                              config))(ds, scores)
  return SpecState(decode=ds, drafter=drafter,
                   accept_hist=jnp.zeros((batch, config.gamma + 1), jnp.int32),
                   rounds=jnp.zeros((), jnp.int32))


def scale_run(model, draft_model, methods, batch: int, context: int, sampling: SamplingParams,
              backend: str) -> list[dict]:
  """Random weights: ms per vanilla step and per speculative round over a filled cache, the
  draft / verify / select shares, and (--trace) GPU time per kernel of one compiled chunk."""
  cfg = model.cfg
  rows = []
  steps = 8
  for entry in methods:
    method, ratio, g = parse_entry(entry)
    try:
      runner = make_runner(model, draft_model, entry, sampling, (), backend)
      holder = [scale_state(runner, batch, context, context + 64 * (g + 1), steps * 64)]

      def run():
        holder[0] = runner.step(holder[0], steps)[0]
        return holder[0]
      t = time_fn(run, warmup=1, reps=3) / steps
      row = dict(method=entry, gamma=g, sparsity=ratio, batch=batch, context=context,
                 ms_per_round=t * 1e3,
                 note="random weights: acceptance meaningless; ms per step (none) or per "
                      "draft+verify round")
      if _TRACE.value:
        row["trace"] = kernel_table(run, top=60)
        row["trace"]["per"] = f"one chunk of {steps} rounds"
      if runner.speculative:
        holder[0], row["phases"] = phase_times(runner, holder[0])
      rows.append(row)
      holder = None  # free this cache before the next method
    except Exception as e:
      rows.append(dict(method=entry, gamma=g, error=f"{type(e).__name__}: {str(e)[:300]}"))
    print({k: v for k, v in rows[-1].items() if k != "trace"}, file=sys.stderr)
    for k in rows[-1].get("trace", {}).get("kernels", [])[:12]:
      print(f"   {k['us']:>10.1f} us {k['calls']:>5}x  {k['name']}", file=sys.stderr)
  return rows


def plot(payload: dict, png_path: str) -> None:
  """Bars per method: tokens/s with refills and decode-only, with accepted tokens per round."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  rows = [r for r in payload["rows"] if r.get("tokens_per_s")]
  if not rows:
    return
  names = [r["method"] for r in rows]
  x = range(len(rows))
  fig, ax = plt.subplots(figsize=(1.6 + 1.0 * len(rows), 3.4))
  ax.bar([i - 0.2 for i in x], [r["tokens_per_s"] for r in rows], 0.4, label="with refills")
  ax.bar([i + 0.2 for i in x], [r["decode_only_tokens_per_s"] for r in rows], 0.4,
         label="decode only")
  for i, r in zip(x, rows):
    ax.text(i + 0.2, r["decode_only_tokens_per_s"], f"{r.get('mean_accepted_tokens', 1.0):.2f}",
            ha="center", va="bottom", fontsize=8)
  ax.set_xticks(list(x), names, rotation=20, fontsize=8)
  ax.set_ylabel("tokens / s")
  ax.set_title(f"{payload['workload']}, B={payload['batch']}, {payload['device']} "
               "(labels: accepted tokens / round)", fontsize=8)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(png_path, dpi=100)


def main(argv):
  del argv
  cli.quiet_logging()
  if _PLOT_ONLY.value:
    with open(_PLOT_ONLY.value) as f:
      plot(json.load(f), _PLOT_ONLY.value.removesuffix(".json") + ".png")
    return
  try:
    make_mesh(_TP.value)   # too few devices: one line before anything loads
  except ValueError as e:
    cli.fail("benchmarks.throughput", str(e))
  backend = default_backend()
  out_path = _OUT.value or f"benchmarks/out/throughput_{_WORKLOAD.value}.json"
  header = dict(device=device_name(), commit=git_commit(), model=_MODEL.value,
                workload=_WORKLOAD.value, batch=_BATCH.value, sparsity=_SPARSITY.value,
                min_tokens=_MIN_TOKENS.value, backend=backend, tp=_TP.value,
                disaggregate=_DISAGGREGATE.value, argv=" ".join(sys.argv))
  if _WORKLOAD.value == "scale":
    model, _ = load(_MODEL.value, _TP.value)
    draft_model = load(_DRAFT_MODEL.value, _TP.value)[0] if _DRAFT_MODEL.value else None
    bw, rates_gbps = copy_ceiling()
    header.update(copy_gbps=bw / 1e9, copy_rates_gbps=rates_gbps)
    sampling = SamplingParams(_TEMPERATURE.value, _TOP_K.value, _TOP_P.value)
    rows = scale_run(model, draft_model, _METHODS.value, _BATCH.value, _CONTEXT.value, sampling,
                     backend)
    write_json(out_path, dict(header, rows=rows))
    return
  from jaxspec.io.loading import load_model
  loaded = load_model(_MODEL.value, dtype=jnp.bfloat16, tp=_TP.value)
  draft_model = None
  if _DRAFT_MODEL.value:
    draft = load_model(_DRAFT_MODEL.value, dtype=jnp.bfloat16, tp=_TP.value)
    check_draft_pair(loaded, draft, _MODEL.value, _DRAFT_MODEL.value)
    draft_model = draft.model
  tok = loaded.tokenizer
  if _WORKLOAD.value == "short":
    max_new = _MAX_NEW.value or 4096
    prompts = workloads.short_prompts(tok, _REQUESTS.value, _SEED.value)
  else:
    max_new = _MAX_NEW.value or 1024
    prompts = workloads.long_prompts(tok, _REQUESTS.value, _PROMPT_MIN.value, _PROMPT_MAX.value,
                                     _SEED.value)
  stop_ids = loaded.stop_ids
  if _IGNORE_EOS.value:
    stop_ids = ()
  sampling = SamplingParams(_TEMPERATURE.value, _TOP_K.value, _TOP_P.value)
  capacity_len = max(len(p) for p in prompts) + max_new
  rows = []
  for entry in _METHODS.value:
    method, ratio, g = parse_entry(entry)
    try:
      runner = make_runner(loaded.model, draft_model, entry, sampling, stop_ids, backend)
      row, state = runner.serve(prompts, _BATCH.value, max_new, max_len=capacity_len,
                                chunk=_CHUNK.value, warmup_s=_WARMUP.value,
                                measure_s=_MEASURE.value, seed=_SEED.value, stagger=_STAGGER.value,
                                disaggregate=_DISAGGREGATE.value)
      row.update(method=entry, sparsity=ratio)
      if _PROFILE.value and runner.speculative:
        # Phase shares on the serving batch as it stands at the end (steady state, mixed lengths).
        _, row["phases"] = phase_times(runner, state)
      state = None
    except Exception as e:
      row = dict(method=entry, error=f"{type(e).__name__}: {str(e)[:500]}")
    rows.append(row)
    print(row, file=sys.stderr)
    write_json(out_path, dict(header, rows=rows))   # keep what finished if a later method dies
  plot(dict(header, rows=rows), out_path.removesuffix(".json") + ".png")
  base = next((r for r in rows if r.get("method") == "none" and r.get("tokens_per_s")), None)
  print(f"\n{'method':<12} {'g':>2} {'tok/s':>8} {'x none':>6} {'decode tok/s':>12} {'x none':>6} "
        f"{'acc/round':>9} {'draft':>5} {'verify':>6} {'select':>6}")
  for r in rows:
    if "error" in r or r.get("tokens_per_s") is None:
      print(f"{r['method']:<12} {r.get('error', 'nothing measured (stream ran out in warm-up)')[:80]}")
      continue
    ph = r.get("phases", {})
    x = r["tokens_per_s"] / base["tokens_per_s"] if base else float("nan")
    xd = (r["decode_only_tokens_per_s"] / base["decode_only_tokens_per_s"] if base
          else float("nan"))
    print(f"{r['method']:<12} {r['gamma'] if r['method'] != 'none' else '-':>2} "
          f"{r['tokens_per_s']:>8.0f} {x:>6.2f} {r['decode_only_tokens_per_s']:>12.0f} {xd:>6.2f} "
          f"{r.get('mean_accepted_tokens', 1.0):>9.2f} {ph.get('draft_share', 0):>5.2f} "
          f"{ph.get('verify_share', 0):>6.2f} {ph.get('select_share', 0):>6.2f}")


if __name__ == "__main__":
  app.run(main)
