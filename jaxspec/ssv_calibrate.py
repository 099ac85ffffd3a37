"""`python -m jaxspec.ssv_calibrate`: calibrate SSV's refresh/reuse layer schedule for an NSA model.

  python -m jaxspec.ssv_calibrate --model=checkpoints/my-nsa-model --reuse_layers=12
  python -m jaxspec.ssv_calibrate --model=... --tolerance=0.05 --text=my_text.txt --out=FILE
  python -m jaxspec.ssv_calibrate --model=... --reuse_layers=12 --resume=7:0.0012,19:0.0031

Greedy, training-free (IndexCache-style, as SSV calibrates it): windows of calibration text (the
model's tokenizer over WikiText-2's test split, or --text) run through the model with every layer
selecting its own blocks (all refresh), which gives the reference next-token distributions. Then,
one layer at a time, every refresh layer but layer 0 is tried as a reuse layer on top of those
already chosen, and the one whose reuse moves the distributions least (the mean over every window
position of KL(reference || schedule) of the final logits) becomes a reuse layer; this stops after
--reuse_layers layers, or before the first step whose KL would pass --tolerance. The schedule goes
to --out, by default `ssv_schedule.json` beside the checkpoint, where `--method=ssv` finds it
(`jaxspec.ssv.load_schedule` checks that it was made for that model). Reuse layers change the
model's output: the KL in the file says by how much, on this text. Each step is logged as it is
taken, with the --resume value that goes on from it: a run cut short (a time limit) continues
there, given the same windows and --dtype.

The passes are prefills (every window position a row), one window at a time. The all-refresh
pass runs once per window and its [T, vocab] log-probabilities stay on the device for every
candidate (windows x T x vocab floats: 10 GB for 4 windows of 4096 tokens of a Qwen model), so a
candidate costs one pass. The candidate schedule is data (`NSA.refresh_mask`), so one compiled
program runs all L - 1 + (L - 2) + ... candidates for L layers over every window; in it every
layer also selects its own blocks, which the mask keeps or drops. The passes run on the backend
the engine serves with: the NSA kernels on a GPU, the pure-JAX reference elsewhere.
No trained NSA weights exist here; the tool runs on whatever NSA model it is given.
"""
from __future__ import annotations

import functools
import sys
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from flax import nnx
from tqdm import tqdm

from jaxspec import cli, requests, ssv
from jaxspec.engine.state import capacity_for
from jaxspec.model.attention import NSA, check_backend, default_backend
from jaxspec.model.kv_cache import KVCache
from jaxspec.model.transformer import Transformer


def _log_probs(model: Transformer, window: jax.Array, plan: NSA, backend: str) -> jax.Array:
  """window [1, T] -> float32 next-token log-probabilities [1, T, vocab] under `plan`. The cache
  holds the weights' dtype, so the kernels' operands match."""
  t = window.shape[1]
  cache = KVCache.create(model.cfg, 1, capacity_for(t, 0), model.embed_tokens.embedding[...].dtype)
  hidden, _, _ = model(window, cache.chain_positions(t), cache, plan, backend)
  return jax.nn.log_softmax(model.logits(hidden), axis=-1)


@functools.partial(jax.jit, static_argnames=("graphdef", "backend"))
def _reference(graphdef, params, window, backend):
  """The all-refresh log-probabilities of one window, computed once and kept for every
  candidate (module docstring)."""
  return _log_probs(nnx.merge(graphdef, params), window, NSA(), backend)


@functools.partial(jax.jit, static_argnames=("graphdef", "backend"))
def _window_kl(graphdef, params, window, reference, refresh, backend):
  """The mean over one window's positions of KL(all refresh || `refresh`, [L] bool) of the
  next-token distributions. The schedule is data (`NSA.refresh_mask`), so every candidate runs
  in one compiled program."""
  candidate = _log_probs(nnx.merge(graphdef, params), window, NSA(refresh_mask=refresh),
                         backend)
  return jnp.mean(jnp.sum(jnp.exp(reference) * (reference - candidate), axis=-1))


def check_stop(num_layers: int, reuse_layers: int | None, tolerance: float | None) -> int:
  """The most reuse layers to choose, checked (one-line ValueErrors naming the flags)."""
  if reuse_layers is None and tolerance is None:
    raise ValueError("give --reuse_layers (how many reuse layers) or --tolerance (the largest "
                     "mean KL), or both")
  if tolerance is not None and not (np.isfinite(tolerance) and tolerance >= 0):
    raise ValueError(f"--tolerance must be a finite KL >= 0, got {tolerance}")
  if reuse_layers is None:
    return num_layers - 1
  requests.check_count("--reuse_layers", reuse_layers, minimum=0)
  if reuse_layers > num_layers - 1:
    raise ValueError(f"--reuse_layers={reuse_layers}: a {num_layers}-layer model has at most "
                     f"{num_layers - 1} reuse layers (layer 0 always refreshes)")
  return reuse_layers


def calibrate(model: Transformer, windows: np.ndarray, *, reuse_layers: int | None = None,
              tolerance: float | None = None, progress: bool = True, backend: str | None = None,
              resume: Sequence[dict] = ()) -> tuple[tuple[bool, ...], list[dict]]:
  """The greedy schedule (module docstring) for `model` on token windows [N, T]. Returns (refresh,
  one bool per layer; the steps taken: {'layer', 'kl'} each, in order, kl that of the schedule
  after the step). backend: the attention backend of the passes (`jaxspec.model.attention`;
  default: the NSA kernels on a GPU, the reference elsewhere, as the engine serves). resume: the
  first steps, taken as given (those a run cut short logged, on the same windows); the greedy
  search goes on from them. With progress, each step is logged as it is taken, with the
  --resume value that continues from it."""
  if model.cfg.nsa is None:
    raise ValueError("--model has dense attention: SSV's refresh/reuse schedule is for a Native "
                     "Sparse Attention model (ModelConfig.nsa)")
  num_layers = model.cfg.num_layers
  most = check_stop(num_layers, reuse_layers, tolerance)
  windows = jnp.asarray(windows, jnp.int32)
  if windows.ndim != 2 or windows.size == 0:
    raise ValueError(f"calibration windows must be [N, T] token ids, got shape {windows.shape}")
  backend = check_backend(backend or default_backend())
  steps = check_resume(resume, num_layers, most)
  refresh = [True] * num_layers
  for step in steps:
    refresh[step["layer"]] = False
  graphdef, params = nnx.split(model)
  references = [_reference(graphdef, params, w[None], backend) for w in windows]

  def kl(refresh) -> float:
    mask = jnp.asarray(refresh, bool)
    return float(np.mean([_window_kl(graphdef, params, w[None], r, mask, backend)
                          for w, r in zip(windows, references)]))

  total = sum(num_layers - 1 - k for k in range(len(steps), most))
  with tqdm(total=total, desc="ssv_calibrate", unit="schedule", file=sys.stderr,
            disable=not progress) as bar:
    while len(steps) < most:
      scores = {}
      for layer in range(1, num_layers):
        if refresh[layer]:
          scores[layer] = kl(refresh[:layer] + [False] + refresh[layer + 1:])
          bar.update(1)
      layer = min(scores, key=lambda i: (scores[i], i))
      if tolerance is not None and scores[layer] > tolerance:
        break
      refresh[layer] = False
      steps.append(dict(layer=layer, kl=scores[layer]))
      bar.set_postfix_str(f"{len(steps)} reuse, KL {scores[layer]:.3g}")
      if progress:
        bar.write(f"[jaxspec] step {len(steps)}: layer {layer} reuses, mean KL "
                  f"{scores[layer]!r}; to go on from here: --resume={format_resume(steps)}",
                  file=sys.stderr)
  return tuple(refresh), steps


def format_resume(steps: Sequence[dict]) -> str:
  """The --resume value of `steps`: LAYER:KL,... (the KLs in full, so the record is the same)."""
  return ",".join(f"{s['layer']}:{s['kl']!r}" for s in steps)


def parse_resume(text: str) -> list[dict]:
  """--resume's LAYER:KL,... as steps (one-line ValueError on anything else)."""
  steps = []
  for item in filter(None, text.split(",")):
    try:
      layer, kl = item.split(":")
      steps.append(dict(layer=int(layer), kl=float(kl)))
    except ValueError:
      raise ValueError(f"--resume must be LAYER:KL,... (the value a cut-off run logged), got "
                       f"{item!r}") from None
  return steps


def check_resume(steps: Sequence[dict], num_layers: int, most: int) -> list[dict]:
  """The steps to resume from, checked against the model's layers and the stop."""
  layers = [s["layer"] for s in steps]
  if len(set(layers)) != len(layers) or not all(0 < i < num_layers for i in layers):
    raise ValueError(f"--resume's layers must be distinct layers 1..{num_layers - 1} (layer 0 "
                     f"always refreshes), got {layers}")
  if len(steps) > most:
    raise ValueError(f"--resume has {len(steps)} steps, more than the {most} reuse layers asked")
  return [dict(layer=int(s["layer"]), kl=float(s["kl"])) for s in steps]


def _define_flags() -> dict:
  """The CLI's flags, defined only when it runs: other entry points import `calibrate` and define
  flags of the same names (--model, --out, --dtype)."""
  return dict(
      model=flags.DEFINE_string("model", None, "the NSA model: orbax checkpoint dir, HF dir or "
                                ".gguf"),
      text=flags.DEFINE_string("text", None, "calibration text file (default: WikiText-2's test "
                               "split, the text the other calibration tools use)"),
      windows=flags.DEFINE_integer("windows", 8, "windows of calibration text, evenly spaced"),
      window_tokens=flags.DEFINE_integer("window_tokens", 1024, "tokens per window"),
      reuse_layers=flags.DEFINE_integer("reuse_layers", None, "stop after this many reuse layers "
                                        "(at most layers - 1; default: all that --tolerance "
                                        "allows)"),
      tolerance=flags.DEFINE_float("tolerance", None, "stop before the mean KL (nats per "
                                   "position) against the all-refresh model would pass this"),
      out=flags.DEFINE_string("out", None, "the schedule JSON (default: ssv_schedule.json beside "
                              "--model)"),
      resume=flags.DEFINE_string("resume", None, "go on from these first steps, LAYER:KL,... "
                                 "(the value a run cut short logged at its last step; the same "
                                 "windows and --dtype)"),
      dtype=flags.DEFINE_enum("dtype", "float32", ["bfloat16", "float32"],
                              "weights and activations"))


def main(argv, f: dict):
  del argv
  prog = "jaxspec.ssv_calibrate"
  cli.quiet_logging()
  v = {k: flag.value for k, flag in f.items()}
  try:   # every check that needs no model first
    if v["model"] is None:
      raise ValueError("--model is required (the NSA model to calibrate)")
    requests.check_count("--windows", v["windows"])
    requests.check_count("--window_tokens", v["window_tokens"], minimum=2)
    check_stop(2 ** 31 - 1, v["reuse_layers"], v["tolerance"])
    resume = parse_resume(v["resume"] or "")
  except ValueError as e:
    cli.fail(prog, str(e))
  from jaxspec.io.loading import load_model
  from jaxspec.pairmap import calibration_text, calibration_windows
  try:
    loaded = load_model(v["model"], dtype=jnp.float32 if v["dtype"] == "float32"
                        else jnp.bfloat16)
    model = loaded.model
    if model.cfg.nsa is None:
      raise ValueError(f"{v['model']} has dense attention: SSV's refresh/reuse schedule is for "
                       "a Native Sparse Attention model (ModelConfig.nsa)")
    check_stop(model.cfg.num_layers, v["reuse_layers"], v["tolerance"])
    if loaded.tokenizer is None:
      raise ValueError(f"{loaded.source} has no tokenizer: the calibration text cannot be encoded")
    try:
      text = (calibration_text() if v["text"] is None
              else open(v["text"], encoding="utf-8").read())
    except (OSError, UnicodeDecodeError) as e:
      raise ValueError(f"cannot read the calibration text: {e}") from None
    tokens = loaded.tokenizer.encode(text, add_special_tokens=False)
    length = min(v["window_tokens"], requests.context_limit(model.cfg))
    windows = calibration_windows(tokens, v["windows"], length)
    refresh, steps = calibrate(model, windows, reuse_layers=v["reuse_layers"],
                               tolerance=v["tolerance"], resume=resume)
    record = ssv.schedule_record(model, refresh, name=str(v["model"]), steps=steps,
                                 windows=int(windows.shape[0]), window_tokens=int(length),
                                 tolerance=v["tolerance"], metric="mean KL(all refresh || "
                                 "schedule) of the next-token distributions")
    path = ssv.save_schedule(record, v["out"] or ssv.default_schedule_path(loaded.source))
  except (OSError, ValueError) as e:
    cli.fail(prog, str(e))
  reuse = [i for i, r in enumerate(refresh) if not r]
  kl = steps[-1]["kl"] if steps else 0.0
  print(f"[jaxspec] {len(reuse)} reuse layers {reuse} (mean KL {kl:.4g}) -> {path}",
        file=sys.stderr)


if __name__ == "__main__":
  _flags = _define_flags()
  cli.run(lambda argv: main(argv, _flags), "jaxspec.ssv_calibrate")
