"""jaxspec against HF transformers on the same device, in one process (issue 14 section 3).

  python -m benchmarks.peer_hf --model=/tmp/shipped/qwen15.gguf \
      --draft_model=/tmp/shipped/qwen05.gguf
  python -m benchmarks.peer_hf --model=smollm2-135m --draft_model=smollm2-135m --device=cpu \
      --dtype=float32 --batch_sizes=1,2 --contexts=64 --steps=4 --reps=2 --prompts=1 \
      --max_new_tokens=16 --nospec_warmup      # a CPU smoke run of every piece

vLLM and SGLang cannot be installed on the GPU machine, so the peer is transformers' fastest
documented path. Both frameworks load the same weights: each reads the GGUF file (or HF
directory) with its own reader, at --dtype (bfloat16 by default).

decode: for --model (and --draft_model, unless --nodecode_draft), each --batch_sizes x --contexts:
  a prompt of random tokens per sequence, `context` long (less where prompt plus the tokens the run
  generates would pass the model's context), prefilled once and not timed; then --warmup + --reps
  timed windows of --steps greedy decode steps, end-of-sequence ignored; the median window / steps
  is the step time.
  HF: a `StaticCache` sized for the whole run, prefilled by the model's own forward in chunks of
    --prefill_tokens tokens (all rows at once); each window is one `generate` call on that cache
    (greedy, SDPA, and with --compile transformers' automatic `torch.compile` of the decode
    forward: CompileConfig(fullgraph=True, dynamic=False, mode="reduce-overhead"), CUDA graphs on
    a GPU). The call first runs the one token not yet in the cache, eagerly; a stopping criterion
    (`StepClock`) synchronises the device and starts the clock when that first token is out, and
    the clock stops when `generate` has returned and the device is synchronised. Timed: --steps
    compiled forward passes with `generate`'s own per-step work (logits processing, argmax, token
    append, its per-step stop check, which waits for the device every step).
  jaxspec: `Runner(method="none")`; each sequence prefilled on its own and put into its slot
    (`insert_slot`, as `Runner.serve` does: a batched prefill of 64 x 32K tokens needs activation
    memory for all of them at once); each window is one `Runner.step` call (--steps steps in one
    compiled `lax.while_loop`, no host round trip inside), timed with `jax.block_until_ready`
    around it (`benchmarks.common.time_fn`).
  Reported: ms per step, tokens/s (batch / step time), the mean context over the timed steps, the
  bytes a step must read there (every weight once, each sequence's K/V) and the rate each side
  read them at, its time over the floor (those bytes over the device's copy ceiling, measured at
  the start of the run: `benchmarks.common.copy_ceiling`, in the JSON's `copy_gb_s`), the ratio
  jaxspec tokens/s / HF tokens/s, and how much of each sequence's greedy continuation the two
  frameworks share before the first difference. A shape that runs out of memory is recorded
  with its reason (`skipped`), not fatal; so is any other failure of one side at one shape.

speculative: batch 1 on --prompts prompts of --workload (`benchmarks.workloads`: short = AIME25 /
  GSM8K with the chat template), greedy, --max_new_tokens each, stopping at the model's
  end-of-sequence ids on both sides. HF: `hf:static` (vanilla on a StaticCache sized for the
  longest prompt, reset between prompts, compiled as above), `hf:dynamic` (vanilla, the default
  DynamicCache, eager: the baseline HF's assisted generation runs against, since it refuses static
  caches), `hf:prompt_lookup` (`prompt_lookup_num_tokens`), `hf:assisted` (`assistant_model=` the
  draft model, at transformers' default assistant settings, recorded in the JSON). jaxspec:
  `jaxspec:none`, `jaxspec:vegas` (--vegas_gamma, --sparsity, --min_tokens), `jaxspec:draft` (the
  draft model, --gamma). Each method runs one untimed warm-up prompt first (--spec_warmup), then
  every prompt timed on its own. End-to-end tokens/s: every new token over prefill plus decode.
  Decode tokens/s: the tokens after the first over the time after the first is out (jaxspec: after
  prefill, compile excluded; HF: from `StepClock`'s first call, which for assisted generation and
  prompt lookup comes after the first round, whose prefill sits inside it, so their first round's
  tokens are left out too).
  Greedy outputs are compared token for token with `hf:static` and with `jaxspec:none` (the share
  of the reference before the first difference, and how many are identical): reported, not
  asserted, since bfloat16 kernels of the two frameworks round differently.

Ratios are jaxspec / HF tokens/s (above 1: jaxspec ahead): per decode shape, and for the pairs
vanilla / vanilla, vegas / prompt lookup, draft / assisted and each framework's fastest method
(by decode tokens/s; both decode and end-to-end ratios). Memory: HF runs first, for every
section, and frees what it held (caches, compiled graphs, the models) before jaxspec runs; JAX
allocates on demand (XLA_PYTHON_CLIENT_PREALLOCATE=false, set below unless already set), so each
framework has the device to itself while it runs. JSON to --out, a PNG of the ratios beside it.
"""
from __future__ import annotations

import os

# Before jax is imported: JAX would reserve 75% of the GPU at its first use, leaving HF, which
# runs first, a quarter.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import contextlib
import dataclasses
import datetime
import gc
import importlib.util
import inspect
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers
from absl import app, flags
from flax import nnx

from benchmarks import workloads
from benchmarks.common import copy_ceiling, device_name, git_commit, time_fn, write_json
from jaxspec import cli, fetch, requests
from jaxspec.engine.batching import insert_slot
from jaxspec.engine.runner import Runner
from jaxspec.io.loading import LoadedModel, check_draft_pair, load_model

HF_METHODS = ("hf:static", "hf:dynamic", "hf:prompt_lookup", "hf:assisted")
JAXSPEC_METHODS = ("jaxspec:none", "jaxspec:vegas", "jaxspec:draft")
NEEDS_DRAFT = ("hf:assisted", "jaxspec:draft")
# (name, jaxspec method, HF method): the ratios the speculative section reports.
PAIRS = (("vanilla", "jaxspec:none", "hf:static"),
         ("self-drafting vs prompt lookup", "jaxspec:vegas", "hf:prompt_lookup"),
         ("draft model vs assisted", "jaxspec:draft", "hf:assisted"))
DTYPES = {"bfloat16": (jnp.bfloat16, torch.bfloat16), "float32": (jnp.float32, torch.float32)}


@dataclasses.dataclass(frozen=True)
class Settings:
  """Everything a run is configured by (the flags, in `main`)."""
  batch_sizes: tuple[int, ...] = (1, 16, 64)
  contexts: tuple[int, ...] = (4096, 16384, 32768)
  steps: int = 32
  reps: int = 3
  warmup: int = 1
  prefill_tokens: int = 32768
  decode_draft: bool = True
  prompts: int = 8
  workload: str = "short"
  max_new_tokens: int = 256
  prompt_lookup_tokens: int = 10
  gamma: int = 4
  vegas_gamma: int = 6
  sparsity: float = 0.07
  min_tokens: int = 256
  spec_methods: tuple[str, ...] = HF_METHODS + JAXSPEC_METHODS
  spec_warmup: bool = True
  sections: tuple[str, ...] = ("decode", "speculative")
  device: str = "cuda"
  compile: bool = True
  dtype: str = "bfloat16"
  seed: int = 0


@dataclasses.dataclass
class Side:
  """One model as both frameworks hold it."""
  name: str                    # the spec it was given as
  source: Path                 # the GGUF file or HF directory both loaded
  jax: LoadedModel
  hf: torch.nn.Module | None   # None once HF's part of the run is over


# -- loading ---------------------------------------------------------------------------------------

def resolve_source(spec: str) -> Path:
  """The file or directory both frameworks load for `spec`: a .gguf file, a HF safetensors
  directory, or a demo name (its verified GGUF in the jaxspec cache, fetched if absent). An orbax
  checkpoint has no transformers reader, so it is refused."""
  path = Path(spec)
  if path.is_file() and path.suffix == ".gguf":
    return path
  if path.is_dir() and (path / "config.json").is_file():
    return path
  if not path.exists() and spec in fetch.DEMOS:
    return fetch.download_gguf(spec, progress=False)
  raise ValueError(f"{spec}: give a .gguf file, a HF safetensors directory or a demo name "
                   f"({', '.join(fetch.DEMOS)}); both frameworks must read the same weights")


def hf_load(source: Path, dtype: torch.dtype, device: str) -> torch.nn.Module:
  """transformers' causal LM for `source` (a GGUF file or HF directory) at `dtype` with SDPA
  attention, in eval mode on `device`.

  A GGUF file goes through transformers' own GGUF reader (its config parsing, dequantization and
  Q/K un-permutation). `from_pretrained(gguf_file=...)` runs that reader but refuses to start
  without `accelerate`; where `accelerate` is missing, the reader is called directly, as
  tests/test_weights.py does, and every parameter but a tied LM head must come back filled."""
  kw = dict(dtype=dtype, attn_implementation="sdpa")
  auto = transformers.AutoModelForCausalLM
  if source.is_dir():
    model = auto.from_pretrained(source, **kw)
  elif importlib.util.find_spec("accelerate") is not None:
    model = auto.from_pretrained(source.parent, gguf_file=source.name, **kw)
  else:
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    config = transformers.AutoConfig.from_pretrained(source.parent, gguf_file=source.name)
    model = auto.from_config(config, **kw)
    extra = {}
    if "model_to_load" in inspect.signature(load_gguf_checkpoint).parameters:
      extra["model_to_load"] = model   # maps GGUF names to this model's parameter names
    tensors = load_gguf_checkpoint(str(source), return_tensors=True, **extra)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    tied = getattr(config, "tie_word_embeddings", False)
    missing = [k for k in missing if not (tied and k == "lm_head.weight")]
    if missing or unexpected:
      raise ValueError(f"{source}: transformers' GGUF reader left {missing[:4]} unfilled and "
                       f"{list(unexpected)[:4]} unused; install accelerate so that "
                       "from_pretrained(gguf_file=...) loads it")
  return model.to(device).eval()


def load_side(spec: str, settings: Settings, loaded: dict[Path, Side] | None = None) -> Side:
  """Both frameworks' copies of `spec` (shared with an earlier `Side` of the same source)."""
  source = resolve_source(spec)
  if loaded is not None and source in loaded:
    return dataclasses.replace(loaded[source], name=spec)
  jdtype, tdtype = DTYPES[settings.dtype]
  side = Side(name=spec, source=source, jax=load_model(source, dtype=jdtype),
              hf=hf_load(source, tdtype, settings.device))
  if loaded is not None:
    loaded[source] = side
  return side


# -- timing helpers --------------------------------------------------------------------------------

def device_sync(device: str) -> Callable[[], None]:
  """A function that waits for the torch device's queued work (nothing to wait for on the CPU)."""
  if device.startswith("cuda"):
    return torch.cuda.synchronize
  return lambda: None


class StepClock(transformers.StoppingCriteria):
  """A stopping criterion that never stops generation: at its first call (the first new token is
  out, so prefill is over) it synchronises the device and notes the time and the sequence length.
  `generate` calls stopping criteria after every step (after every round when assisted)."""

  def __init__(self, sync: Callable[[], None]):
    self.sync = sync
    self.t_first: float | None = None
    self.len_first = 0
    self._never = None

  def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
    if self.t_first is None:
      self.sync()
      self.t_first = time.perf_counter()
      self.len_first = input_ids.shape[1]
      self._never = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    return self._never


def compile_config(settings: Settings) -> transformers.CompileConfig:
  """HF's documented static-cache recipe (`torch.compile(..., mode="reduce-overhead",
  fullgraph=True)`), through `generate`'s automatic compilation of the decode forward; shapes
  static, since each shape gets a fresh compile (`reset_compiled`)."""
  config = transformers.CompileConfig(fullgraph=True, dynamic=False, mode="reduce-overhead")
  if settings.compile and not settings.device.startswith("cuda"):
    # generate compiles on CUDA only unless told otherwise (for tests, CompileConfig's docs say).
    config._compile_all_devices = True
  return config


def reset_compiled() -> None:
  """Drop torch.compile's graphs (and CUDA graphs) so the next shape compiles afresh, under the
  recompile limit, and frees what the old ones held."""
  torch._dynamo.reset()
  if torch.cuda.is_available():
    # torch 2.13's dynamo.reset resets the CUDA graph trees too; older releases may not, and what
    # the recorded graphs hold (their memory pool, references to the StaticCache they read)
    # would then outlive their shape.
    from torch._inductor.cudagraph_trees import reset_cudagraph_trees
    reset_cudagraph_trees()
  gc.collect()
  if torch.cuda.is_available():
    torch.cuda.empty_cache()


def failure(e: BaseException) -> dict:
  """A shape or method that failed: out of memory or another error, with the message."""
  msg = f"{type(e).__name__}: {str(e)[:400]}"
  oom = "out of memory" in msg.lower() or "RESOURCE_EXHAUSTED" in msg
  return dict(skipped="out of memory" if oom else "error", error=msg)


def first_difference(a: Sequence[int], b: Sequence[int]) -> int:
  """Tokens the two sequences share before they first differ."""
  return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# -- decode steps at fixed shapes ------------------------------------------------------------------

def prompt_length(context: int, limit: int, new_tokens: int) -> int:
  """The prompt for a `context`-token row: `context`, or shorter so that prompt plus the
  `new_tokens` the run generates fit the model's `limit` positions."""
  return max(1, min(context, limit - new_tokens))


def random_prompts(batch: int, length: int, vocab: int, seed: int) -> np.ndarray:
  return np.random.default_rng(seed).integers(0, vocab, (batch, length), dtype=np.int64)


@contextlib.contextmanager
def eos_ignored(model: torch.nn.Module):
  """`generate` fills every field a generation config leaves None from the model's own
  generation config, `eos_token_id` included, so a None there does not turn EOS off: the model's
  EOS is unset meanwhile (a random prompt's greedy continuation can hit it in a few tokens)."""
  own = model.generation_config.eos_token_id
  model.generation_config.eos_token_id = None
  try:
    yield
  finally:
    model.generation_config.eos_token_id = own


def hf_decode_row(model: torch.nn.Module, prompts: np.ndarray, settings: Settings) -> dict:
  """HF's step time over `prompts` [B, T] (see the module docstring); also the greedy tokens
  generated per sequence (`tokens`, for the cross-check; not written to the JSON)."""
  device, steps = settings.device, settings.steps
  b, t = prompts.shape
  per_call = steps + 1   # the token not yet in the cache, then `steps` decode steps
  windows = settings.warmup + settings.reps
  sync = device_sync(device)
  reset_compiled()
  ids = torch.as_tensor(prompts, device=device)
  cache = transformers.StaticCache(config=model.config, max_cache_len=t + windows * per_call)
  chunk = max(1, settings.prefill_tokens // b)
  with torch.no_grad():   # not inference_mode: the cache's tensors are updated in place later
    for start in range(0, t - 1, chunk):
      model(ids[:, start:min(start + chunk, t - 1)], past_key_values=cache, use_cache=True,
            logits_to_keep=1)
  config = transformers.GenerationConfig(
      max_new_tokens=per_call, do_sample=False, eos_token_id=None, pad_token_id=0,
      compile_config=compile_config(settings), disable_compile=not settings.compile)
  seq, times = ids, []
  for window in range(windows):
    clock = StepClock(sync)
    with eos_ignored(model):
      out = model.generate(seq, attention_mask=torch.ones_like(seq), past_key_values=cache,
                           generation_config=config,
                           stopping_criteria=transformers.StoppingCriteriaList([clock]))
    sync()
    elapsed = time.perf_counter() - clock.t_first
    if out.shape[1] != seq.shape[1] + per_call or clock.len_first != seq.shape[1] + 1:
      raise RuntimeError(f"generate made {out.shape[1] - seq.shape[1]} tokens, not {per_call}")
    if window >= settings.warmup:
      times.append(elapsed / steps)
    seq = out
  step = statistics.median(times)
  row = dict(step_ms=step * 1e3, tokens_per_s=b / step, step_ms_windows=[x * 1e3 for x in times],
             mean_context=t + settings.warmup * per_call + settings.reps * per_call / 2,
             tokens=seq[:, t:].tolist())
  del cache, ids, seq, out
  reset_compiled()
  return row


def jaxspec_decode_row(runner: Runner, prompts: np.ndarray, settings: Settings) -> dict:
  """jaxspec's step time over `prompts` [B, T] (see the module docstring); also the greedy tokens
  generated per sequence (`tokens`)."""
  b, t = prompts.shape
  steps = settings.steps
  total = 1 + (settings.warmup + settings.reps) * steps   # the prefill's token, then the steps
  max_len = t + total
  rows = prompts.tolist()
  if b == 1:
    state = runner.start(rows, total, max_len=max_len, max_new_buffer=total)[0]
  else:
    # The one-token placeholder batch only fixes the state's static sizes.
    state = runner.start([[0]] * b, total, max_len=max_len, max_new_buffer=total)[0]
    for slot, row in enumerate(rows):
      fresh = runner.start([row], total, max_len=max_len, max_new_buffer=total)[0]
      state = insert_slot(state, fresh, jnp.int32(slot))
  holder = [jax.block_until_ready(state)]

  def window():
    holder[0] = runner.step(holder[0], steps)[0]
    return holder[0].num_new
  step = time_fn(window, warmup=settings.warmup, reps=settings.reps) / steps
  tokens, num_new = jax.device_get((holder[0].tokens, holder[0].num_new))
  if not (num_new == total).all():
    raise RuntimeError(f"decode made {num_new.tolist()} tokens per sequence, not {total}")
  holder = state = None
  return dict(step_ms=step * 1e3, tokens_per_s=b / step,
              mean_context=t + settings.warmup * steps + (settings.reps * steps + 1) / 2,
              tokens=[tokens[i, :total].tolist() for i in range(b)])


def decode_cases(sides: Sequence[Side], settings: Settings) -> list[dict]:
  """One case per (model, batch, context): the prompt both frameworks decode from."""
  new_tokens = (settings.warmup + settings.reps) * (settings.steps + 1) + 1
  cases = []
  for side in sides:
    cfg = side.jax.cfg
    # What one decode step must read: every weight once (a tied LM head is the embedding), and
    # each sequence's K/V.
    weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(
        nnx.state(side.jax.model, nnx.Param)))
    kv_bytes_per_token = cfg.kv_bytes_per_token // 2 * jnp.dtype(DTYPES[settings.dtype][0]).itemsize
    vocab = min(cfg.vocab_size, side.hf.config.vocab_size)
    for b in settings.batch_sizes:
      for ctx in settings.contexts:
        t = prompt_length(ctx, requests.context_limit(cfg), new_tokens)
        cases.append(dict(side=side, model=side.name, batch=b, context=ctx, prompt_tokens=t,
                          prompts=random_prompts(b, t, vocab, settings.seed + 1000 * b + ctx),
                          weight_bytes=weight_bytes, kv_bytes_per_token=kv_bytes_per_token))
  return cases


def hf_decode(cases: list[dict], settings: Settings) -> None:
  """HF's part of every decode case, stored in case['hf']."""
  for case in cases:
    try:
      case["hf"] = hf_decode_row(case["side"].hf, case["prompts"], settings)
    except Exception as e:   # keep the other shapes (e.g. out of memory at the largest)
      case["hf"] = failure(e)
    # Out here: inside the except block the traceback would keep a failed shape's tensors alive.
    reset_compiled()
    print(f"hf      {case['model']} B={case['batch']} ctx={case['context']}: "
          f"{short(case['hf'])}", file=sys.stderr)


def jaxspec_decode(cases: list[dict], settings: Settings) -> None:
  """jaxspec's part of every decode case, stored in case['jaxspec']."""
  runners = {}
  for case in cases:
    side = case["side"]
    if side.source not in runners:
      runners[side.source] = Runner(side.jax.model, stop_ids=(),
                                    cache_dtype=DTYPES[settings.dtype][0])
    try:
      case["jaxspec"] = jaxspec_decode_row(runners[side.source], case["prompts"], settings)
    except Exception as e:
      case["jaxspec"] = failure(e)
    print(f"jaxspec {case['model']} B={case['batch']} ctx={case['context']}: "
          f"{short(case['jaxspec'])}", file=sys.stderr)


def short(result: dict) -> str:
  if "skipped" in result:
    return f"skipped ({result['error'][:120]})"
  return f"{result['step_ms']:.3f} ms/step, {result['tokens_per_s']:.1f} tok/s"


def decode_rows(cases: list[dict], copy_rate: float | None = None) -> list[dict]:
  """The JSON rows: each side's figures (tokens left out), the ratio where both ran, and how far
  the two greedy continuations agree. Where the case knows its bytes (`decode_cases`), each
  side's step also gets the bytes it must read at its mean context (`step_gb`), the rate it read
  them at (`gb_s`) and, given the run's copy rate in bytes/s, its time over that floor
  (`x_floor`)."""
  rows = []
  for case in cases:
    hf, js = case.get("hf", {}), case.get("jaxspec", {})
    row = dict(model=case["model"], batch=case["batch"], context=case["context"],
               prompt_tokens=case["prompt_tokens"],
               hf={k: v for k, v in hf.items() if k != "tokens"},
               jaxspec={k: v for k, v in js.items() if k != "tokens"})
    for side in (row["hf"], row["jaxspec"]):
      if "step_ms" in side and "weight_bytes" in case:
        step_bytes = (case["weight_bytes"]
                      + case["batch"] * side["mean_context"] * case["kv_bytes_per_token"])
        side.update(step_gb=step_bytes / 1e9, gb_s=step_bytes / side["step_ms"] / 1e6)
        if copy_rate:
          side["x_floor"] = side["step_ms"] / (step_bytes / copy_rate * 1e3)
    if "tokens_per_s" in hf and "tokens_per_s" in js:
      row["ratio"] = js["tokens_per_s"] / hf["tokens_per_s"]
      same = [first_difference(a, b) for a, b in zip(js["tokens"], hf["tokens"])]
      compared = min(len(js["tokens"][0]), len(hf["tokens"][0]))
      row.update(greedy_compared_tokens=compared,
                 greedy_prefix_share=sum(same) / (len(same) * compared),
                 greedy_identical_rows=sum(s == compared for s in same))
    else:
      row["ratio"] = None
    rows.append(row)
  return rows


# -- batch-1 speculative decoding ------------------------------------------------------------------

def hf_generate_timed(model: torch.nn.Module, prompt: Sequence[int], settings: Settings,
                      config: transformers.GenerationConfig, **kwargs) -> dict:
  """One greedy `generate` of `prompt` (batch 1): its new tokens and timings (module docstring)."""
  sync = device_sync(settings.device)
  ids = torch.tensor([list(prompt)], device=settings.device)
  clock = StepClock(sync)
  sync()
  t0 = time.perf_counter()
  out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config,
                       stopping_criteria=transformers.StoppingCriteriaList([clock]), **kwargs)
  sync()
  t1 = time.perf_counter()
  return dict(tokens=out[0, len(prompt):].tolist(), new_tokens=out.shape[1] - len(prompt),
              decode_tokens=out.shape[1] - clock.len_first, prefill_s=clock.t_first - t0,
              decode_s=t1 - clock.t_first)


def jaxspec_generate_timed(runner: Runner, prompt: Sequence[int], settings: Settings,
                           max_len: int) -> dict:
  """One greedy `Runner.generate` of `prompt` (batch 1): its new tokens and timings."""
  out, stats = runner.generate([list(prompt)], max_new_tokens=settings.max_new_tokens,
                               max_len=max_len)
  row = dict(tokens=out[0], new_tokens=stats.new_tokens, decode_tokens=stats.decode_tokens,
             prefill_s=stats.prefill_s, decode_s=stats.decode_s)
  if runner.speculative:
    row["accepted_per_round"] = stats.extra["mean_accepted_tokens"]
  return row


def hf_spec_runs(target: Side, draft: Side | None, prompts: list[list[int]], stop_ids,
                 settings: Settings) -> dict[str, object]:
  """Every HF method of --spec_methods on every prompt: method -> per-prompt results, or the
  reason it did not run."""
  common = dict(max_new_tokens=settings.max_new_tokens, do_sample=False,
                eos_token_id=list(stop_ids), pad_token_id=stop_ids[0])
  longest = max(map(len, prompts)) + settings.max_new_tokens
  results: dict[str, object] = {}
  for method in (m for m in settings.spec_methods if m.startswith("hf:")):
    if method in NEEDS_DRAFT and draft is None:
      results[method] = dict(skipped="no --draft_model")
      continue
    cache, kwargs = None, {}
    if method == "hf:static":
      reset_compiled()
      cache = transformers.StaticCache(config=target.hf.config, max_cache_len=longest)
      config = transformers.GenerationConfig(**common, compile_config=compile_config(settings),
                                             disable_compile=not settings.compile)
    elif method == "hf:prompt_lookup":
      config = transformers.GenerationConfig(
          **common, prompt_lookup_num_tokens=settings.prompt_lookup_tokens)
    else:   # dynamic; assisted
      config = transformers.GenerationConfig(**common)
      if method == "hf:assisted":
        kwargs["assistant_model"] = draft.hf

    def run(prompt):
      if cache is not None:
        cache.reset()
        kwargs["past_key_values"] = cache
      return hf_generate_timed(target.hf, prompt, settings, config, **kwargs)
    try:
      if settings.spec_warmup:
        run(prompts[0])
      results[method] = [run(p) for p in prompts]
    except Exception as e:
      results[method] = failure(e)
    del cache
    print(f"{method}: {spec_line(results[method])}", file=sys.stderr)
  reset_compiled()
  return results


def jaxspec_spec_runs(target: Side, draft: Side | None, prompts: list[list[int]], stop_ids,
                      settings: Settings) -> dict[str, object]:
  """Every jaxspec method of --spec_methods on every prompt (as `hf_spec_runs`)."""
  max_len = max(map(len, prompts)) + settings.max_new_tokens   # one cache size for all prompts
  dtype = DTYPES[settings.dtype][0]
  results: dict[str, object] = {}
  for method in (m for m in settings.spec_methods if m.startswith("jaxspec:")):
    if method in NEEDS_DRAFT and draft is None:
      results[method] = dict(skipped="no --draft_model")
      continue
    name = method.split(":", 1)[1]
    kw = {}
    if name == "vegas":
      kw = dict(gamma=settings.vegas_gamma, sparsity=settings.sparsity,
                min_tokens=settings.min_tokens)
    elif name == "draft":
      kw = dict(gamma=settings.gamma, draft_model=draft.jax.model)
    try:
      runner = Runner(target.jax.model, method=name, stop_ids=stop_ids, cache_dtype=dtype, **kw)
      if settings.spec_warmup:
        jaxspec_generate_timed(runner, prompts[0], settings, max_len)
      results[method] = [jaxspec_generate_timed(runner, p, settings, max_len) for p in prompts]
    except Exception as e:
      results[method] = failure(e)
    print(f"{method}: {spec_line(results[method])}", file=sys.stderr)
  return results


def summarize_method(runs: list[dict]) -> dict:
  """Totals over prompts: decode tokens/s (the tokens after the first over the time after it was
  out; see the module docstring) and end-to-end tokens/s (every new token over prefill plus
  decode)."""
  decode_s = sum(r["decode_s"] for r in runs)
  wall = sum(r["prefill_s"] + r["decode_s"] for r in runs)
  out = dict(new_tokens=sum(r["new_tokens"] for r in runs),
             decode_tokens=sum(r["decode_tokens"] for r in runs), decode_s=decode_s,
             prefill_s=sum(r["prefill_s"] for r in runs))
  out["decode_tokens_per_s"] = out["decode_tokens"] / decode_s if decode_s > 0 else None
  out["tokens_per_s"] = out["new_tokens"] / wall if wall > 0 else None
  accepted = [r["accepted_per_round"] for r in runs if "accepted_per_round" in r]
  if accepted:
    out["accepted_per_round_mean"] = sum(accepted) / len(accepted)
  return out


def spec_line(result) -> str:
  if isinstance(result, dict):
    return f"skipped ({result.get('error', result['skipped'])[:120]})"
  s = summarize_method(result)
  return (f"decode {s['decode_tokens_per_s'] or float('nan'):.1f} tok/s, end to end "
          f"{s['tokens_per_s'] or float('nan'):.1f} tok/s, {s['new_tokens']} new tokens")


def agreement(runs: list[dict], reference) -> dict | None:
  """How far each prompt's output matches the reference method's: the mean share of the
  reference's tokens before the first difference, and how many outputs are identical."""
  if not isinstance(reference, list):
    return None
  shares = [first_difference(r["tokens"], ref["tokens"]) / max(len(ref["tokens"]), 1)
            for r, ref in zip(runs, reference)]
  return dict(prefix_share=sum(shares) / len(shares),
              identical=sum(r["tokens"] == ref["tokens"] for r, ref in zip(runs, reference)),
              prompts=len(shares))


def spec_payload(results: dict[str, object]) -> dict:
  """The speculative section's JSON: per method totals, per-prompt figures and agreement; the
  ratios of PAIRS and of each framework's fastest method."""
  methods = {}
  for method, runs in results.items():
    if not isinstance(runs, list):
      methods[method] = runs
      continue
    methods[method] = dict(
        summarize_method(runs),
        agreement_with_hf_static=agreement(runs, results.get("hf:static")),
        agreement_with_jaxspec_none=agreement(runs, results.get("jaxspec:none")),
        per_prompt=[{k: v for k, v in r.items() if k != "tokens"} for r in runs])

  def rate(method, key):
    m = methods.get(method)
    return None if m is None or "skipped" in m else m.get(key)

  def ratio(name, js, hf):
    out = dict(name=name, jaxspec=js, hf=hf)
    for key in ("decode_tokens_per_s", "tokens_per_s"):
      a, b = rate(js, key), rate(hf, key)
      out[f"{key}_ratio"] = a / b if a and b else None
    return out
  ratios = [ratio(*pair) for pair in PAIRS]
  best = {}
  for framework, names in (("jaxspec", JAXSPEC_METHODS), ("hf", HF_METHODS)):
    ran = [m for m in names if rate(m, "decode_tokens_per_s")]
    best[framework] = max(ran, key=lambda m: rate(m, "decode_tokens_per_s"), default=None)
  if best["jaxspec"] and best["hf"]:
    ratios.append(ratio("fastest of each", best["jaxspec"], best["hf"]))
  return dict(methods=methods, ratios=ratios)


# -- the run ---------------------------------------------------------------------------------------

def spec_prompts(tokenizer, settings: Settings, context: int) -> list[list[int]]:
  max_tokens = workloads.prompt_max_tokens(None, context, settings.max_new_tokens)
  return workloads.build(settings.workload, tokenizer, settings.prompts,
                         min(16384, max_tokens), max_tokens, settings.seed)


def free_hf(sides: Sequence[Side]) -> float:
  """Drop the HF models and everything torch still caches; the device memory torch keeps
  reserved afterwards, in GB (0 on the CPU)."""
  for side in sides:
    side.hf = None
  reset_compiled()
  return torch.cuda.memory_reserved() / 1e9 if torch.cuda.is_available() else 0.0


def run(target: Side, draft: Side | None, settings: Settings,
        checkpoint: Callable[[dict], None] = lambda payload: None,
        copy_rate: float | None = None) -> dict:
  """Both sections for the loaded models; HF's work first, then jaxspec's (module docstring).
  `checkpoint(payload)` gets the results so far after each framework's part; `copy_rate` (the
  device's copy ceiling in bytes/s, measured in the same run) puts each decode step against its
  floor."""
  sides = [target] + ([draft] if draft is not None and settings.decode_draft else [])
  cases = decode_cases(sides, settings) if "decode" in settings.sections else []
  prompts, stop_ids = [], target.jax.stop_ids
  if "speculative" in settings.sections:
    limit = min(requests.context_limit(s.jax.cfg) for s in (target, draft) if s is not None)
    prompts = spec_prompts(target.jax.tokenizer, settings, limit)
  fixed = dict(spec_prompt_tokens=[len(p) for p in prompts], stop_ids=list(stop_ids))

  def assemble(hf_spec, js_spec):
    payload = dict(fixed, decode=decode_rows(cases, copy_rate))
    if prompts:
      payload["speculative"] = spec_payload({**hf_spec, **js_spec})
    payload["summary"] = summary(payload)
    return payload

  hf_decode(cases, settings)
  hf_spec = hf_spec_runs(target, draft, prompts, stop_ids, settings) if prompts else {}
  hf_sides = [s for s in (target, draft) if s is not None]
  fixed["hf_reserved_gb_after_free"] = free_hf(hf_sides)
  checkpoint(assemble(hf_spec, {}))
  jaxspec_decode(cases, settings)
  js_spec = jaxspec_spec_runs(target, draft, prompts, stop_ids, settings) if prompts else {}
  return assemble(hf_spec, js_spec)


def summary(payload: dict) -> dict:
  """Whether jaxspec was ahead at every measured shape and pair, the ratios' range, and what
  was not measured."""
  decode = [r["ratio"] for r in payload.get("decode", []) if r["ratio"] is not None]
  spec = [r["decode_tokens_per_s_ratio"] for r in payload.get("speculative", {}).get("ratios", [])
          if r["decode_tokens_per_s_ratio"] is not None]
  both = decode + spec
  return dict(decode_ratio_min=min(decode, default=None),
              decode_ratio_max=max(decode, default=None),
              speculative_ratio_min=min(spec, default=None),
              jaxspec_ahead_everywhere=bool(both) and min(both) > 1,
              decode_rows_not_compared=sum(r["ratio"] is None for r in payload.get("decode", [])))


def plot(payload: dict, png_path: str) -> None:
  """Bars of jaxspec / HF tokens/s: every decode shape, then every speculative pair."""
  try:
    import matplotlib
  except ImportError:   # matplotlib is the `bench` extra, not a requirement
    return
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  bars = [(f"{Path(r['model']).stem[:14]}\nB{r['batch']} {r['context'] // 1024 or r['context']}"
           f"{'K' if r['context'] >= 1024 else ''}", r["ratio"])
          for r in payload.get("decode", []) if r["ratio"] is not None]
  bars += [(r["name"].replace(" vs ", "\nvs "), r["decode_tokens_per_s_ratio"])
           for r in payload.get("speculative", {}).get("ratios", [])
           if r["decode_tokens_per_s_ratio"] is not None]
  if not bars:
    return
  fig, ax = plt.subplots(figsize=(1.5 + 0.75 * len(bars), 3.6))
  ax.bar(range(len(bars)), [v for _, v in bars],
         color=["tab:green" if v > 1 else "tab:red" for _, v in bars])
  ax.axhline(1.0, color="black", linewidth=0.8)
  for i, (_, v) in enumerate(bars):
    ax.text(i, v, f"{v:.2f}", ha="center", va="bottom", fontsize=7)
  ax.set_xticks(range(len(bars)), [name for name, _ in bars], fontsize=6)
  ax.set_ylabel("jaxspec / HF tokens/s")
  ax.set_title(f"jaxspec vs HF transformers {payload['versions']['transformers']}, "
               f"{payload['device']}, {payload['settings']['dtype']}", fontsize=8)
  fig.tight_layout()
  fig.savefig(png_path, dpi=100)


def print_tables(payload: dict) -> None:
  print(f"\n{'model':<24} {'B':>3} {'ctx':>6} {'HF ms (x floor)':>16} "
        f"{'jaxspec ms (x floor)':>20} {'ratio':>6} {'greedy same':>11}")
  def cell(side: dict) -> str:
    if "step_ms" not in side:
      return side.get("skipped", "-")
    return f"{side['step_ms']:.3f}" + (f" ({side['x_floor']:.2f})" if "x_floor" in side else "")

  for r in payload.get("decode", []):
    hf, js = r["hf"], r["jaxspec"]
    same = r.get("greedy_prefix_share")
    print(f"{Path(r['model']).name[:24]:<24} {r['batch']:>3} {r['context']:>6} {cell(hf):>16} "
          f"{cell(js):>20} {r['ratio'] or float('nan'):>6.2f} "
          f"{'-' if same is None else f'{same:.2f}':>11}")
  spec = payload.get("speculative")
  if spec:
    print(f"\n{'method':<18} {'decode tok/s':>12} {'e2e tok/s':>10} {'same as hf:static':>17}")
    for name, m in spec["methods"].items():
      if "skipped" in m:
        print(f"{name:<18} skipped: {m.get('error', m['skipped'])[:70]}")
        continue
      agree = m["agreement_with_hf_static"]
      same = "-" if agree is None else f"{agree['identical']}/{agree['prompts']}"
      print(f"{name:<18} {m['decode_tokens_per_s']:>12.1f} {m['tokens_per_s']:>10.1f} "
            f"{same:>17}")
    for r in spec["ratios"]:
      ratio = r["decode_tokens_per_s_ratio"]
      print(f"{r['name']}: {r['jaxspec']} / {r['hf']} = "
            f"{'-' if ratio is None else f'{ratio:.2f}'}")


def header(target: Side, draft: Side | None, settings: Settings) -> dict:
  return dict(device=device_name(), torch_device=settings.device, commit=git_commit(),
              date=datetime.date.today().isoformat(), argv=" ".join(sys.argv),
              versions=dict(jax=jax.__version__, torch=torch.__version__,
                            transformers=transformers.__version__),
              model=target.name, model_source=str(target.source),
              draft_model=None if draft is None else draft.name,
              draft_source=None if draft is None else str(draft.source),
              settings=dataclasses.asdict(settings),
              hf=dict(attn_implementation="sdpa", static_cache=True, compile=settings.compile,
                      compile_config=compile_config(settings).to_dict(),
                      assistant_defaults=assistant_defaults(draft)))


def assistant_defaults(draft: Side | None) -> dict | None:
  """The draft model's generation settings that drive HF's assisted generation."""
  if draft is None or draft.hf is None:
    return None
  g = draft.hf.generation_config
  # Unset values fall back to transformers' global defaults when assisted generation starts
  # (5.x: GenerationConfig._get_default_generation_params).
  defaults = getattr(g, "_get_default_generation_params", dict)()
  keys = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
  return {k: defaults.get(k) if getattr(g, k, None) is None else getattr(g, k) for k in keys}


# -- command line ----------------------------------------------------------------------------------

def define_flags() -> None:
  """The flags; defined only when run as a program, so that importing the pieces (the tests do)
  does not collide with another benchmark's flags of the same names."""
  d = Settings()
  flags.DEFINE_string("model", "qwen2.5-coder-1.5b", "target: a .gguf file, HF directory or demo "
                      "name (both frameworks load it)")
  flags.DEFINE_string("draft_model", "qwen2.5-coder-0.5b", "draft model for hf:assisted and "
                      "jaxspec:draft, and a second decode model ('' for none)")
  flags.DEFINE_list("batch_sizes", list(map(str, d.batch_sizes)), "decode: batch sizes")
  flags.DEFINE_list("contexts", list(map(str, d.contexts)), "decode: prompt tokens per sequence")
  flags.DEFINE_integer("steps", d.steps, "decode: steps per timed window")
  flags.DEFINE_integer("reps", d.reps, "decode: timed windows (median)")
  flags.DEFINE_integer("warmup", d.warmup, "decode: untimed windows first (compiles)")
  flags.DEFINE_integer("prefill_tokens", d.prefill_tokens, "decode: tokens per HF prefill forward "
                       "(all rows at once, so a chunk of prefill_tokens / batch per row)")
  flags.DEFINE_bool("decode_draft", d.decode_draft, "decode: time --draft_model's steps too")
  flags.DEFINE_integer("prompts", d.prompts, "speculative: number of prompts (batch 1 each)")
  flags.DEFINE_enum("workload", d.workload, ["short", "long"], "speculative: prompts "
                    "(benchmarks.workloads)")
  flags.DEFINE_integer("max_new_tokens", d.max_new_tokens, "speculative: new tokens per prompt")
  flags.DEFINE_integer("prompt_lookup_tokens", d.prompt_lookup_tokens,
                       "hf:prompt_lookup: prompt_lookup_num_tokens")
  flags.DEFINE_integer("gamma", d.gamma, "jaxspec:draft: draft tokens per round")
  flags.DEFINE_integer("vegas_gamma", d.vegas_gamma, "jaxspec:vegas: draft tokens per round")
  flags.DEFINE_float("sparsity", d.sparsity, "jaxspec:vegas: KV ratio for drafting")
  flags.DEFINE_integer("min_tokens", d.min_tokens, "jaxspec:vegas: smallest KV budget")
  flags.DEFINE_list("spec_methods", list(d.spec_methods), "speculative: methods to run")
  flags.DEFINE_bool("spec_warmup", d.spec_warmup, "speculative: one untimed prompt per method")
  flags.DEFINE_list("sections", list(d.sections), "decode, speculative")
  flags.DEFINE_enum("device", "cuda" if torch.cuda.is_available() else "cpu", ["cuda", "cpu"],
                    "torch device (JAX must be on the same kind)")
  flags.DEFINE_bool("compile", None, "HF: torch.compile the decode forward (default: on cuda; "
                    "on the CPU it works, slowly: minutes of compiling per shape)")
  flags.DEFINE_enum("dtype", d.dtype, list(DTYPES), "weights and caches, both frameworks")
  flags.DEFINE_integer("seed", d.seed, "random decode prompts and the speculative prompt order")
  flags.DEFINE_string("out", "benchmarks/out/peer_hf.json", "JSON results (PNG beside it)")


def settings_from_flags() -> Settings:
  f = flags.FLAGS
  unknown = [m for m in f.spec_methods if m not in HF_METHODS + JAXSPEC_METHODS]
  if unknown:
    raise ValueError(f"unknown --spec_methods {unknown}; choose from "
                     f"{', '.join(HF_METHODS + JAXSPEC_METHODS)}")
  sections = [s for s in f.sections if s not in ("decode", "speculative")]
  if sections:
    raise ValueError(f"unknown --sections {sections}; choose from decode, speculative")
  for name in ("steps", "reps", "prompts", "max_new_tokens", "prefill_tokens"):
    requests.check_count(f"--{name}", f[name].value)
  return Settings(
      batch_sizes=tuple(int(b) for b in f.batch_sizes), contexts=tuple(int(c) for c in f.contexts),
      steps=f.steps, reps=f.reps, warmup=f.warmup, prefill_tokens=f.prefill_tokens,
      decode_draft=f.decode_draft, prompts=f.prompts, workload=f.workload,
      max_new_tokens=f.max_new_tokens, prompt_lookup_tokens=f.prompt_lookup_tokens,
      gamma=f.gamma, vegas_gamma=f.vegas_gamma, sparsity=f.sparsity, min_tokens=f.min_tokens,
      spec_methods=tuple(f.spec_methods), spec_warmup=f.spec_warmup, sections=tuple(f.sections),
      device=f.device, compile=f.device == "cuda" if f.compile is None else f.compile,
      dtype=f.dtype, seed=f.seed)


def main(argv):
  del argv
  cli.quiet_logging()
  prog = "benchmarks.peer_hf"
  f = flags.FLAGS
  try:
    settings = settings_from_flags()
  except ValueError as e:
    cli.fail(prog, str(e))
  jax_kind = "cuda" if jax.default_backend() == "gpu" else jax.default_backend()
  if jax_kind != settings.device:
    cli.fail(prog, f"JAX runs on {jax.default_backend()} but --device={settings.device}: both "
                   "frameworks must share the device")
  # The copy ceiling first, on a device nothing else holds yet: the decode floors' rate.
  copy_rate, copy_rates = copy_ceiling()
  loaded: dict[Path, Side] = {}
  try:
    target = load_side(f.model, settings, loaded)
    draft = load_side(f.draft_model, settings, loaded) if f.draft_model else None
    if draft is not None:
      check_draft_pair(target.jax, draft.jax, f.model, f.draft_model)
  except (OSError, ValueError) as e:
    cli.fail(prog, str(e))
  head = dict(header(target, draft, settings), copy_gb_s=copy_rates)
  print(f"{head['device']} | torch {settings.device} | {settings.dtype} | HF compile "
        f"{settings.compile} | {f.model}" + (f" + draft {f.draft_model}" if draft else ""),
        file=sys.stderr)
  payload = run(target, draft, settings, lambda p: write_json(f.out, dict(head, **p)),
                copy_rate)
  payload = dict(head, **payload)
  write_json(f.out, payload)
  plot(payload, f.out.removesuffix(".json") + ".png")
  print_tables(payload)


if __name__ == "__main__":
  define_flags()
  app.run(main)
