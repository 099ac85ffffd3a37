"""STS's evaluation (issue 15, `../shared/papers/sts.txt`): how well the draft's attention picks
the target's keys, and what the sparse verification costs in perplexity and in passkey retrieval,
against baselines at the same budget. STS CHANGES the target's output (the target verifies under
a per-head sparse mask, `jaxspec.drafting.sts`); this measures how much.

  python -m benchmarks.sts --target=qwen2.5-coder-1.5b --draft=qwen2.5-coder-0.5b \\
      --sts_map=checkpoints/qwen2.5-coder-1.5b/sts_map_k256.qwen2_5-coder-0_5b.json
  python -m benchmarks.sts --random --context=512 --verify_tokens=64 --passages=1 \\
      --budgets=32,64 --passkey_contexts=512 --passkey_depths=0.5   # CPU smoke run

Speed is measured elsewhere, on a GPU: the kernels by `python -m benchmarks.kernels`, end to end
by `python -m benchmarks.throughput --model=qwen2.5-coder-1.5b --draft_model=qwen2.5-coder-0.5b
--methods=none,draft,sts@256` (with --sts_map for a learned map).

Methods, each reading at most `budget` prefix keys per target layer and KV head (the chunk's own
keys, the dense tail, besides), every target layer sparse (`benchmarks.sparse_eval` defines the
baselines):
  dense       full attention (the reference);
  oracle      the target's own top-k per layer and KV head (its dense attention over the chunk's
              rows): the most mass k keys can capture;
  quest       Quest: 16-token pages per KV head, scored by the current query rows, the partial
              last page read densely and counted in the budget;
  streaming   StreamingLLM: 4 sinks + the most recent keys;
  sts         STS with the proportional head map (draft layer floor(j Ld / Lt), head floor(h Hd /
              Ht));
  sts-map     STS with the learned head map of --sts_map (`jaxspec.sts_map`; one file per budget,
              each run at the budget it was made for).
--budgets: keys (256) or a share of the context (10%: of --context, or of each passkey context),
at least one Quest page (16).

Evaluations (--evals):
  mass      mapping quality. Passages of --context tokens of frankenstein.txt ($JAXSPEC_DATA,
            else ../shared/data), --passages of them evenly spaced; the last --verify_tokens are
            read in chunks of gamma + 1 as in `ppl`, densely. For every chunk the target's
            attention rows per KV head are recorded, each method selects from that dense view
            (STS from the draft's rows n..n+gamma-1, as a decoding round does; Quest from the
            target's own queries), and the share of the target's softmax mass the selection lets
            it read is averaged per layer over rows, KV heads, chunks and passages
            (`sparse_eval.captured_mass`).
  ppl       perplexity, teacher-forced on the same passages: dense prefill, then the last
            --verify_tokens tokens verified in chunks of gamma + 1, each chunk under the method's
            selection (STS: the draft reads the chunk and its own rows pick the keys, as the
            engine does; the oracle: the target's dense pass of the chunk first). Reported with
            the KV reduction (1 - keys read / dense keys read, over every layer and chunk).
  passkey   a 5-digit pass key hidden in Paul Graham's essays (`paul_graham_essays.json`) at
            each of --passkey_depths, prompts of each of --passkey_contexts tokens, continued
            greedily for --answer_tokens tokens; an answer is right when its first number is the
            key. The prompt is prefilled densely and the first answer token comes from that
            prefill (as in the engine); dense first, then the baselines one token a step under
            their selection, then STS through the engine (`jaxspec.engine.runner.Runner`,
            method 'sts', gamma --gamma: its greedy output is the masked target's).
Output: JSON (--out) and PNGs beside it (_mass: captured mass per layer; _ppl: perplexity per
budget; _passkey: accuracy per budget).
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import re
import sys
from pathlib import Path
from typing import Sequence

import jax.numpy as jnp
import numpy as np
from absl import flags
from tqdm import tqdm

from benchmarks import sparse_eval as se
from benchmarks.common import device_name, git_commit, parse_tokens, write_json
from jaxspec import cli
from jaxspec.drafting import sts as sts_drafting
from jaxspec.io.data import data_path
from jaxspec.model.attention import LayerMapped, default_backend
from jaxspec.pairmap import calibration_windows

PROG = "benchmarks.sts"
METHODS = ("oracle", "quest", "streaming", "sts", "sts-map")
EVALS = ("mass", "ppl", "passkey")
HAYSTACK = "paul_graham_essays.json"
PASSKEY_INTRO = ("There is an important piece of information hidden inside a lot of irrelevant "
                 "text. Find it and memorize it. I will quiz you about it.\n\n")
NEEDLE = "\nThe pass key is {key}. Remember it. {key} is the pass key.\n"
QUESTION = "\n\nWhat is the pass key? The pass key is"


# ----------------------------------------------------------------------------------------------
# Flags

def define_flags(fv: flags.FlagValues = flags.FLAGS) -> None:
  """The flags, into `fv`. Defined only when run as a program, so that importing the module (the
  tests do) does not collide with another benchmark's flags of the same names."""
  f = dict(flag_values=fv)
  flags.DEFINE_string("target", None, "target model spec", **f)
  flags.DEFINE_string("draft", None, "draft model spec (same tokenizer)", **f)
  flags.DEFINE_bool("random", False, "a tiny random pair on bytes (a smoke run: its numbers mean "
                    "nothing)", **f)
  flags.DEFINE_list("sts_map", [], "learned head map JSON files (jaxspec.sts_map), each run at the "
                    "budget it was made for (method sts-map)", **f)
  flags.DEFINE_list("methods", list(METHODS), "methods besides dense: " + ", ".join(METHODS), **f)
  flags.DEFINE_list("evals", list(EVALS), "evaluations: " + ", ".join(EVALS), **f)
  flags.DEFINE_list("budgets", ["256", "512", "10%"], "prefix keys per layer and KV head: a count, "
                    "or a share of the context (10%)", **f)
  flags.DEFINE_string("context", "16K", "tokens per passage (mass, ppl); K = 1024", **f)
  flags.DEFINE_integer("passages", 4, "passages (evenly spaced over the book)", **f)
  flags.DEFINE_integer("verify_tokens", 512, "the last tokens of a passage, verified in chunks of "
                       "gamma + 1 (mass, ppl)", **f)
  flags.DEFINE_integer("gamma", 4, "drafts per round: chunks of gamma + 1 tokens", **f)
  flags.DEFINE_list("passkey_contexts", ["10K", "28K"], "passkey prompt lengths in tokens; "
                    "K = 1024", **f)
  flags.DEFINE_list("passkey_depths", ["0.1", "0.3", "0.5", "0.7", "0.9"], "where the key sits in "
                    "the haystack (0: start, 1: end)", **f)
  flags.DEFINE_integer("answer_tokens", 8, "greedy tokens per passkey answer", **f)
  flags.DEFINE_integer("seed", 0, "seed of the pass keys", **f)
  flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "weights and cache", **f)
  flags.DEFINE_string("out", "benchmarks/out/sts.json", "JSON results (PNGs beside)", **f)


def parse_budget(spec: str) -> str:
  """A --budgets entry, checked: a count >= 16 ('256') or a share of the context in (0, 100]
  ('10%')."""
  m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*(%?)\s*", str(spec))
  if not m:
    raise ValueError(f"--budgets entries are key counts (256) or shares of the context (10%), "
                     f"got {spec!r}")
  value = float(m.group(1))
  if m.group(2):
    if not 0 < value <= 100:
      raise ValueError(f"a --budgets share must be in (0%, 100%], got {spec!r}")
    return f"{m.group(1)}%"
  if value != int(value) or value < se.PAGE:
    raise ValueError(f"a --budgets count must be an integer >= {se.PAGE} (one Quest page), got "
                     f"{spec!r}")
  return str(int(value))


def resolve_budget(spec: str, context: int) -> int:
  """A checked --budgets entry at a context: the count, or that share of `context` (rounded)."""
  if spec.endswith("%"):
    k = int(round(float(spec[:-1]) / 100 * context))
    if k < se.PAGE:
      raise ValueError(f"--budgets {spec} of {context} tokens is {k} keys, less than one Quest "
                       f"page ({se.PAGE})")
    return k
  return int(spec)


def distinct_budgets(specs: Sequence[str], context: int) -> list[tuple[str, int]]:
  """(entry, keys) per distinct budget at `context`, in flag order (the first entry names it)."""
  out = {}
  for spec in specs:
    out.setdefault(resolve_budget(spec, context), spec)
  return [(spec, k) for k, spec in out.items()]


def parse_flags(v: dict) -> dict:
  """The flags' values checked and parsed (before any model loads); one-line ValueErrors."""
  out = dict(v)
  unknown = sorted(set(v["methods"]) - set(METHODS))
  if unknown:
    raise ValueError(f"unknown --methods {', '.join(unknown)}; choose from {', '.join(METHODS)}")
  unknown = sorted(set(v["evals"]) - set(EVALS))
  if unknown or not v["evals"]:
    raise ValueError(f"--evals must name some of {', '.join(EVALS)}, got {v['evals']}")
  if not v["budgets"]:
    raise ValueError("give at least one --budgets entry")
  out["budgets"] = [parse_budget(b) for b in v["budgets"]]
  out["context"] = parse_tokens(v["context"], "--context")
  out["passkey_contexts"] = [parse_tokens(c, "--passkey_contexts") for c in v["passkey_contexts"]]
  if v["gamma"] < 1:
    raise ValueError(f"--gamma must be >= 1, got {v['gamma']}")
  if v["passages"] < 1:
    raise ValueError(f"--passages must be >= 1, got {v['passages']}")
  if not v["gamma"] + 1 < v["verify_tokens"] < out["context"]:
    raise ValueError(f"--verify_tokens must exceed gamma + 1 ({v['gamma'] + 1}) and be less than "
                     f"--context ({out['context']}), got {v['verify_tokens']}")
  if v["answer_tokens"] < 1:
    raise ValueError(f"--answer_tokens must be >= 1, got {v['answer_tokens']}")
  try:
    out["passkey_depths"] = [float(d) for d in v["passkey_depths"]]
  except ValueError:
    raise ValueError(f"--passkey_depths must be numbers in [0, 1], got {v['passkey_depths']}") \
        from None
  if not out["passkey_depths"] or any(not 0 <= d <= 1 for d in out["passkey_depths"]):
    raise ValueError(f"--passkey_depths must be numbers in [0, 1], got {v['passkey_depths']}")
  if "passkey" in v["evals"] and not out["passkey_contexts"]:
    raise ValueError("give --passkey_contexts (or leave passkey out of --evals)")
  for c in (out["context"], *out["passkey_contexts"]):   # every share resolves to >= one page
    for b in out["budgets"]:
      resolve_budget(b, c)
  return out


# ----------------------------------------------------------------------------------------------
# Methods

@dataclasses.dataclass(frozen=True)
class STS(se.Method):
  """STS: the draft's rows n..n+gamma-1 of the chunk pick per target layer and KV head the keys
  (`jaxspec.drafting.sts.head_union`, as `STSDrafter.select` does in a decoding round)."""
  needs_view = True
  uses_draft = True
  spec: sts_drafting.STSConfig | None = None

  def select(self, view, budget):
    rows = view.draft_rows[self.spec.granularity][:, jnp.asarray(self.spec.score_layers)]
    idx, cnt = sts_drafting.head_union(rows, view.start, self.spec, view.weights.shape[-1])
    return LayerMapped(indices=idx, counts=cnt, tail_start=view.start, slots=self.spec.slots)


def load_maps(paths: Sequence[str], target, draft) -> dict:
  """--sts_map files -> {budget: HeadMap}, each checked against the pair (one-line ValueErrors)."""
  from jaxspec import sts_map
  out = {}
  for path in paths:
    try:
      budget = int(json.loads(Path(path).read_text())["budget"])
    except (OSError, ValueError, KeyError, TypeError) as e:
      raise ValueError(f"cannot read the STS head map {path}: {e}") from None
    if budget in out:
      raise ValueError(f"two --sts_map files were made for budget {budget}")
    out[budget] = sts_map.load_map(path, target, draft, budget)
  return out


def make_methods(names: Sequence[str], k: int, pair: se.Pair, maps: dict,
                 baselines_only: bool = False) -> dict[str, se.Method]:
  """name -> the method at budget k, for the names in `names` that run at k (sts-map only at its
  map's budget; `baselines_only`: the oracle, Quest and StreamingLLM)."""
  from jaxspec.engine.runner import sts_config
  out = {}
  for name in names:
    if name == "oracle":
      out[name] = se.Oracle(k=k)
    elif name == "quest":
      out[name] = se.Quest(max_pages=max(1, k // se.PAGE))
    elif name == "streaming":
      out[name] = se.Streaming()
    elif baselines_only:
      continue
    elif name == "sts":
      out[name] = STS(spec=sts_config(pair.target, pair.draft, k, 1, None, None))
    elif name == "sts-map" and k in maps:
      out[name] = STS(spec=sts_config(pair.target, pair.draft, k, 1, maps[k], None))
  return out


# ----------------------------------------------------------------------------------------------
# Mapping quality and perplexity

def mass_and_perplexity(pair: se.Pair, windows: np.ndarray, *, verify_tokens: int, gamma: int,
                        budgets: Sequence[tuple[str, int]], names: Sequence[str], maps: dict,
                        evals: Sequence[str], dtype=jnp.float32) -> tuple[list[dict], list[dict]]:
  """(mass rows, perplexity rows) over windows [B, W], dense first. A mass row: method, budget,
  budget_spec, per_layer (mean captured mass per target layer), mean; a perplexity row: method,
  budget, perplexity, ppl_increase, kv_reduction, scored_tokens."""
  b, w = windows.shape
  prefill = w - verify_tokens
  backend = default_backend()
  runs = [(spec, k, name, m) for spec, k in budgets
          for name, m in make_methods(names, k, pair, maps).items()]
  probe = se.Probe(tuple(sorted({m.spec.granularity for *_, m in runs if isinstance(m, STS)})))
  sums = {(name, k): 0.0 for _, k, name, _ in runs}
  counted = [0]

  def on_view(view):
    counted[0] += int(np.prod(view.weights.shape[1:4]))
    for _, k, name, method in runs:
      sums[name, k] = sums[name, k] + se.mass_sums(view, jnp.full((b,), k, jnp.int32), method)

  kw = dict(prefill_len=prefill, gamma=gamma, dtype=dtype, backend=backend, probe=probe)
  dense, _ = se.teacher_forced(pair.target, pair.draft, windows, method=se.Method(),
                               on_view=on_view if "mass" in evals else None,
                               desc="dense" + (" + mass" if "mass" in evals else ""), **kw)
  mass_rows = []
  if "mass" in evals:
    for spec, k, name, _ in runs:
      per_layer = sums[name, k] / counted[0]
      mass_rows.append(dict(method=name, budget=k, budget_spec=spec,
                            per_layer=[round(float(x), 5) for x in per_layer],
                            mean=round(float(per_layer.mean()), 5)))
  ppl_rows = []
  if "ppl" in evals:
    ppl_rows.append(dict(method="dense", budget=None, **dense))
    for spec, k, name, method in runs:
      res, _ = se.teacher_forced(pair.target, pair.draft, windows, method=method,
                                 budgets=lambda c, k=k: np.full(b, k), desc=f"{name}@{k}", **kw)
      ppl_rows.append(dict(method=name, budget=k, budget_spec=spec, **res))
    for r in ppl_rows:
      r["ppl_increase"] = r["perplexity"] / dense["perplexity"] - 1
  return mass_rows, ppl_rows


# ----------------------------------------------------------------------------------------------
# Passkey retrieval

@dataclasses.dataclass(frozen=True)
class Passkey:
  """One passkey prompt: tokens (exactly the context), the key, the depth asked for, where the
  needle's tokens start (needle_at, needle_len) and how many haystack tokens surround it."""
  tokens: list[int]
  key: int
  depth: float
  needle_at: int
  needle_len: int
  haystack: int
  head: int            # tokens before the haystack

  @property
  def needle_depth(self) -> float:
    """Where the needle sits in the haystack: 0 at its start, 1 at its end."""
    return (self.needle_at - self.head) / self.haystack


def haystack_tokens(tokenizer, tokens: int) -> list[int]:
  """The first `tokens` (at least) tokens of the essays; a one-line ValueError if they are
  fewer."""
  with open(data_path(HAYSTACK), encoding="utf-8") as f:
    text = json.load(f)["text"]
  ids = tokenizer.encode(text[:8 * tokens + 1024], add_special_tokens=False)
  if len(ids) < tokens:
    raise ValueError(f"{HAYSTACK} holds {len(ids)} tokens here, fewer than the {tokens} a passkey "
                     "prompt needs")
  return list(ids)


def _sentence_start(tokenizer, hay: Sequence[int], cut: int, reach: int = 32) -> int:
  """The last position at or before `cut` (at most `reach` back) that follows a token ending a
  sentence or a line, so the needle does not split a word; `cut` when none does."""
  for i in range(cut, max(cut - reach, 0) - 1, -1):
    if i == 0 or tokenizer.decode([hay[i - 1]]).rstrip(" ").endswith((".", "!", "?", "\n")):
      return i
  return cut


def passkey_prompt(tokenizer, haystack: Sequence[int], context: int, depth: float,
                   key: int) -> Passkey:
  """A prompt of exactly `context` tokens: the instruction, the haystack with the needle ("The
  pass key is KEY. Remember it. KEY is the pass key.") inserted at `depth` of it (moved back, by
  at most 32 tokens, to a sentence's start), and the question ending "The pass key is"."""
  if not 0 <= depth <= 1:
    raise ValueError(f"a passkey depth must be in [0, 1], got {depth}")
  head = (tokenizer.encode("", add_special_tokens=True)
          + tokenizer.encode(PASSKEY_INTRO, add_special_tokens=False))
  needle = tokenizer.encode(NEEDLE.format(key=key), add_special_tokens=False)
  question = tokenizer.encode(QUESTION, add_special_tokens=False)
  room = context - len(head) - len(needle) - len(question)
  if room < 1:
    raise ValueError(f"a passkey prompt of {context} tokens leaves no room for the haystack "
                     f"(the instruction, needle and question take {context - room})")
  if room > len(haystack):
    raise ValueError(f"a passkey prompt of {context} tokens needs {room} haystack tokens, "
                     f"{len(haystack)} given")
  hay = list(haystack[:room])
  cut = _sentence_start(tokenizer, hay, round(depth * room))
  tokens = head + hay[:cut] + needle + hay[cut:] + question
  return Passkey(tokens=tokens, key=key, depth=depth, needle_at=len(head) + cut,
                 needle_len=len(needle), haystack=room, head=len(head))


def parse_passkey(text: str) -> int | None:
  """The first number in an answer, or None."""
  m = re.search(r"\d+", text)
  return int(m.group()) if m else None


def passkey_correct(text: str, key: int) -> bool:
  """Exact: the answer's first number is the key."""
  return parse_passkey(text) == key


def passkey_keys(seed: int, context: int, n: int) -> list[int]:
  return [int(k) for k in np.random.default_rng([seed, context]).integers(10_000, 100_000, n)]


def _sts_answers(pair: se.Pair, prompts: np.ndarray, k: int, head_map, *, gamma: int,
                 new_tokens: int, dtype) -> np.ndarray:
  """STS as the engine decodes it (greedy): new tokens [B, new_tokens]."""
  from jaxspec.engine.runner import Runner
  backend = "reference" if head_map is not None and head_map.granularity == "q" else None
  runner = Runner(pair.target, method="sts", draft_model=pair.draft, gamma=gamma, sts_budget=k,
                  head_map=head_map, stop_ids=(), cache_dtype=dtype, backend=backend)
  out, _ = runner.generate([list(p) for p in prompts], max_new_tokens=new_tokens)
  return np.asarray([o[:new_tokens] for o in out])


def passkey(pair: se.Pair, *, contexts: Sequence[int], depths: Sequence[float],
            budgets: Sequence[str], names: Sequence[str], maps: dict, new_tokens: int, gamma: int,
            seed: int = 0, dtype=jnp.float32, haystack: list[int] | None = None) -> list[dict]:
  """Per context and method (dense first) and budget: accuracy over the depths and every answer
  (depth, needle_depth, passkey, answer, correct)."""
  hay = haystack or haystack_tokens(pair.tokenizer, max(contexts))
  rows = []
  for context in contexts:
    keys = passkey_keys(seed, context, len(depths))
    prompts = [passkey_prompt(pair.tokenizer, hay, context, d, key)
               for d, key in zip(depths, keys)]
    arr = np.asarray([p.tokens for p in prompts], np.int32)
    runs = {("dense", None): (se.Method(), 0)}
    engine = []
    for _, k in distinct_budgets(budgets, context):
      for name, method in make_methods(names, k, pair, maps, baselines_only=True).items():
        runs[name, k] = (method, k)
      engine += [(name, k) for name in ("sts", "sts-map")
                 if name in names and (name == "sts" or k in maps)]
    answers = se.greedy(pair.target, arr, new_tokens, {f"{n}@{k}": m for (n, k), m in runs.items()},
                        dtype=dtype, backend=default_backend(), desc=f"passkey {context}")
    answers = {key: answers[f"{key[0]}@{key[1]}"] for key in runs}
    for name, k in tqdm(engine, desc=f"passkey {context} sts", unit="run", leave=False):
      answers[name, k] = _sts_answers(pair, arr, k, maps.get(k) if name == "sts-map" else None,
                                      gamma=gamma, new_tokens=new_tokens, dtype=dtype)
    for (name, k), toks in answers.items():
      got = []
      for p, t in zip(prompts, toks):
        text = pair.tokenizer.decode([int(x) for x in t])
        got.append(dict(depth=p.depth, needle_depth=round(p.needle_depth, 4), passkey=p.key,
                        answer=text, correct=passkey_correct(text, p.key)))
      rows.append(dict(method=name, budget=k, context=context,
                       accuracy=sum(a["correct"] for a in got) / len(got), answers=got))
  return rows


# ----------------------------------------------------------------------------------------------
# Plots

def _plt():
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt


def _budget_axis(ax, budgets) -> None:
  ks = sorted({k for k in budgets if k is not None})
  ax.set_xscale("log")
  ax.set_xticks(ks, [str(k) for k in ks])
  ax.minorticks_off()


def _against_budget(ax, rows: list[dict], value: str) -> None:
  """One line per method of `value` against the budget, dense as a dashed level."""
  for name in dict.fromkeys(r["method"] for r in rows if r["budget"] is not None):
    pts = sorted((r["budget"], r[value]) for r in rows if r["method"] == name)
    ax.plot(*zip(*pts), marker="o", label=name)
  dense = next(r for r in rows if r["method"] == "dense")
  ax.axhline(dense[value], color="k", ls="--", label="dense")
  _budget_axis(ax, [r["budget"] for r in rows])


def plot_mass(rows: list[dict], path: str, title: str) -> None:
  plt = _plt()
  budgets = sorted({r["budget"] for r in rows})
  fig, axes = plt.subplots(1, len(budgets), figsize=(4.5 * len(budgets), 3.6), squeeze=False)
  for ax, k in zip(axes[0], budgets):
    for r in (r for r in rows if r["budget"] == k):
      ax.plot(range(len(r["per_layer"])), r["per_layer"], marker=".",
              label=f"{r['method']} ({r['mean']:.3f})")
    ax.set_title(f"budget {k}", fontsize=8)
    ax.set_xlabel("target layer")
    ax.set_ylabel("captured attention mass")
    ax.legend(fontsize=6)
  fig.suptitle(title, fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def plot_ppl(rows: list[dict], path: str, title: str) -> None:
  plt = _plt()
  fig, ax = plt.subplots(figsize=(6, 4))
  _against_budget(ax, rows, "perplexity")
  ax.set_yscale("log")
  ax.set_xlabel("budget (prefix keys per layer and KV head)")
  ax.set_ylabel("perplexity")
  ax.set_title(title, fontsize=8)
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def plot_passkey(rows: list[dict], path: str, title: str) -> None:
  plt = _plt()
  contexts = sorted({r["context"] for r in rows})
  fig, axes = plt.subplots(1, len(contexts), figsize=(4.5 * len(contexts), 3.6), squeeze=False)
  for ax, c in zip(axes[0], contexts):
    here = [r for r in rows if r["context"] == c]
    _against_budget(ax, here, "accuracy")
    ax.set_ylim(-0.05, 1.05)
    ax.set_title(f"{c} tokens", fontsize=8)
    ax.set_xlabel("budget")
    ax.set_ylabel("passkey accuracy")
    ax.legend(fontsize=6)
  fig.suptitle(title, fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


# ----------------------------------------------------------------------------------------------
# Main

def _check_maps(maps: dict, v: dict, names: Sequence[str]) -> None:
  """Every map's budget is one some evaluation runs; a note when sts-map is not asked for."""
  runs = set()
  if {"mass", "ppl"} & set(v["evals"]):
    runs |= {resolve_budget(b, v["context"]) for b in v["budgets"]}
  if "passkey" in v["evals"]:
    runs |= {resolve_budget(b, c) for b in v["budgets"] for c in v["passkey_contexts"]}
  for k in maps:
    if k not in runs:
      raise ValueError(f"an --sts_map file was made for budget {k}, which no --budgets entry "
                       f"gives here (budgets run: {sorted(runs)})")
  if "sts-map" in names and not maps:
    print(f"[{PROG}] skipping sts-map: it needs --sts_map", file=sys.stderr)
  if maps and "sts-map" not in names:
    print(f"[{PROG}] --sts_map given but sts-map is not in --methods", file=sys.stderr)


def inputs(pair: se.Pair, v: dict) -> tuple[np.ndarray | None, list[int] | None]:
  """(the passages [B, context] for mass and ppl, the haystack for passkey), None where the
  evaluation is not asked for; one-line ValueErrors when the texts are too short."""
  windows = hay = None
  if {"mass", "ppl"} & set(v["evals"]):
    windows = calibration_windows(se.book_tokens(pair.tokenizer), v["passages"], v["context"])
  if "passkey" in v["evals"]:
    hay = haystack_tokens(pair.tokenizer, max(v["passkey_contexts"]))
  return windows, hay


def evaluate(pair: se.Pair, v: dict, names: Sequence[str], maps: dict, out: str,
             dtype=jnp.float32, texts: tuple | None = None) -> dict:
  """Run the evaluations `v` (parsed flags) asks for, write the JSON to `out` and the PNGs beside
  it, print a summary; returns the JSON's payload. texts: `inputs(pair, v)`, if made already."""
  windows, hay = texts or inputs(pair, v)
  base = os.path.splitext(out)[0]
  os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
  title = f"{pair.names[1]} -> {pair.names[0]}"
  settings = dict(target=pair.names[0], draft=pair.names[1], methods=["dense", *names],
                  evals=list(v["evals"]), budgets=list(v["budgets"]), gamma=v["gamma"],
                  dtype=jnp.dtype(dtype).name,
                  maps={str(k): dict(file=v.get("map_files", {}).get(k), granularity=m.granularity)
                        for k, m in maps.items()},
                  attention_backend=default_backend(), device=device_name(), commit=git_commit(),
                  date=datetime.date.today().isoformat())
  payload = {"settings": settings}
  if windows is not None:
    settings.update(context=v["context"], passages=len(windows), verify_tokens=v["verify_tokens"])
    mass, ppl = mass_and_perplexity(pair, windows, verify_tokens=v["verify_tokens"],
                                    gamma=v["gamma"], budgets=distinct_budgets(v["budgets"],
                                                                               v["context"]),
                                    names=names, maps=maps, evals=v["evals"], dtype=dtype)
    sub = (f"{title}, {len(windows)} x {v['context']} tokens, last {v['verify_tokens']} in "
           f"chunks of {v['gamma'] + 1}")
    if "mass" in v["evals"]:
      payload["mass"] = mass
      if mass:
        plot_mass(mass, base + "_mass.png", sub)
      for r in mass:
        print(f"mass     {r['method']:9s} k={r['budget']:<6d} mean {r['mean']:.4f}")
    if "ppl" in v["evals"]:
      payload["perplexity"] = ppl
      plot_ppl(ppl, base + "_ppl.png", sub)
      for r in ppl:
        print(f"ppl      {r['method']:9s} k={r['budget'] or '-'!s:6s} {r['perplexity']:.3f} "
              f"({r['ppl_increase']:+.2%}) KV reduction {r['kv_reduction']:.1%}")
  if hay is not None:
    settings.update(passkey_contexts=v["passkey_contexts"], passkey_depths=v["passkey_depths"],
                    answer_tokens=v["answer_tokens"], seed=v["seed"])
    rows = passkey(pair, contexts=v["passkey_contexts"], depths=v["passkey_depths"],
                   budgets=v["budgets"], names=names, maps=maps, new_tokens=v["answer_tokens"],
                   gamma=v["gamma"], seed=v["seed"], dtype=dtype, haystack=hay)
    payload["passkey"] = rows
    plot_passkey(rows, base + "_passkey.png", f"{title}, passkey retrieval")
    for r in rows:
      print(f"passkey  {r['method']:9s} k={r['budget'] or '-'!s:6s} context {r['context']:6d} "
            f"accuracy {r['accuracy']:.2f}")
  write_json(out, payload)
  return payload


FLAG_NAMES = ("methods", "evals", "budgets", "context", "passkey_contexts", "gamma", "passages",
              "verify_tokens", "answer_tokens", "passkey_depths", "seed")


def main(argv):
  del argv
  FLAGS = flags.FLAGS
  cli.quiet_logging()
  try:
    v = parse_flags({k: getattr(FLAGS, k) for k in FLAG_NAMES})
    names = list(dict.fromkeys(v["methods"]))
    dtype = jnp.float32 if FLAGS.dtype == "float32" else jnp.bfloat16
    pair = se.load_pair(FLAGS.target, FLAGS.draft, FLAGS.random, dtype)
    longest = max([v["context"]] * bool({"mass", "ppl"} & set(v["evals"]))
                  + [c + v["answer_tokens"] for c in v["passkey_contexts"]
                     if "passkey" in v["evals"]])
    if longest > pair.context:
      raise ValueError(f"{longest} tokens per sequence exceed the pair's context ({pair.context})")
    maps = load_maps(FLAGS.sts_map, pair.target, pair.draft)
    v["map_files"] = {k: f for f, k in zip(FLAGS.sts_map, maps)}
    _check_maps(maps, v, names)
    texts = inputs(pair, v)
  except (OSError, ValueError) as e:
    cli.fail(PROG, str(e))
  evaluate(pair, v, names, maps, FLAGS.out, dtype, texts)


if __name__ == "__main__":
  define_flags()
  cli.run(main, PROG)
