"""`python -m jaxspec.generate`: generate text with vanilla or speculative decoding.

  python -m jaxspec.generate --chat --prompt "Write a Python function that checks if a string is a palindrome."
  python -m jaxspec.generate --model=qwen2.5-coder-0.5b --prompt_file=prompts.txt --temperature=0.6
  python -m jaxspec.generate --method=vegas --gamma=6 --sparsity=0.07 --min_tokens=256 --prompt "..."
  python -m jaxspec.generate --model=qwen2.5-coder-1.5b --method=draft \
      --draft_model=qwen2.5-coder-0.5b --gamma=4 --prompt "..."
  python -m jaxspec.generate --model=qwen2.5-coder-1.5b --method=specattn \
      --draft_model=qwen2.5-coder-0.5b --top_p_attn=0.97 --prompt "..."   # changes the output
  python -m jaxspec.generate --model=qwen2.5-coder-1.5b --method=sts \
      --draft_model=qwen2.5-coder-0.5b --sts_budget=256 --prompt "..."   # changes the output
  python -m jaxspec.generate --method=vegas --tree=2,2,1,1 --prompt "..."   # a draft tree
  python -m jaxspec.generate --model=qwen2.5-coder-1.5b --method=vegas --fp8_drafts --prompt "..."
  python -m jaxspec.generate --model=my-nsa-model --method=ssv --ssv_class=strict --ssv_group=2 \
      --draft_model=my-draft --tree=2,2,1 --prompt "..."   # an NSA model, SSV verification
  python -m jaxspec.generate --model=qwen2.5-coder-1.5b --tp=2 --prompt "..."   # two devices
  python -m jaxspec.generate --plan=plan.json --prompt "..."   # strategies chosen as it decodes

Text goes to stdout (streamed per chunk of decode steps for a single prompt; for a batch, each
completion is printed when it finishes), one stats line to stderr. Speculative methods are
lossless: sampled text follows plain decoding's distribution, and greedy text equals plain greedy
decoding exactly with --dtype=float32; in bfloat16 (the default) the verification pass rounds
differently from a one-token step, so a greedy text can part from plain decoding's at a near-tie.
--method=specattn is the exception: its verification attends sparsely (the keys the draft model's
attention kept), so its text is that masked target's, not the model's own (approximate
verification; see jaxspec/drafting/specattn.py). Its layer map is read from beside the target
(`python -m jaxspec.specattn_map` writes it), else --specattn_map, else the proportional map.
--method=sts changes the output the same way: each of the model's heads verifies over the
--sts_budget keys its mapped draft head attended to most (see jaxspec/drafting/sts.py), so the text
is that masked model's. Its head map is --sts_map, else the one `python -m jaxspec.sts_map` saved
beside the model for this draft model and budget, else the proportional map.
--method=ssv needs a Native Sparse Attention model: it verifies under SSV's schedule, drafted by
--draft_model or, without one, by the NSA model's own plain decoding (jaxspec/ssv.py). Its class
strict is lossless; reuse, approx and approx_reuse CHANGE the output (reuse layers copy another
layer's selected blocks; approx shares one selection per group of rows). The reuse classes read
the refresh/reuse schedule from --ssv_schedule, else the one `python -m jaxspec.ssv_calibrate`
saved beside the model.
--plan=PROFILE.json (from `python -m benchmarks.plan_profile`) lets the planner choose the
self-drafting strategy (method, gamma, sparsity, tree), or for an NSA model the SSV strategy
(gamma or tree, class, group; with --draft_model, and --ssv_schedule for the reuse classes), per
context bucket and switch between chunks when acceptance stays below the profile's expectation
(`jaxspec.engine.planner`); it replaces --method, --gamma, --sparsity, --tree, --ssv_class and
--ssv_group.
--score_pool=W (odd) pools the vegas family's scores before its top-k: each position ranks by the
largest score within W // 2 positions of it, so the drafts see spans around the keys that scored
high (default 1, the paper's rule; the output distribution is the same at any width).
--score_block=N has the vegas family's top-k rank aligned blocks of N positions by their best
score and keep whole blocks at the same token budget (default 1, the paper's per-position rule;
the output distribution is the same at any N; 8 decoded the 0.5B 5.9% faster on an H200).
--score_window=W keeps the prefix's newest W positions whole and ranks only the rest of the same
budget by score (default 0, the paper's rule; lossless at any W).
--fp8_drafts runs the draft steps' MLPs on FP8 copies of their weights (`jaxspec.model.fp8`,
about half the MLP weights' memory again; one device, speculative methods); verification keeps
the model's weights, so the output distribution is unchanged. On an H200 it made a vegas round of
the 1.5B at 128 sequences 3-6% shorter; on a 2-core CPU the quick start's vegas was slower with
it (benchmarks/RESULTS.md).
Compiled programs are kept in JAX's persistent compilation cache (--compilation_cache), so a later
run of the same model, method and shapes skips most of its compile time.
Bad flags fail with one line before the model loads; Ctrl-C exits with status 130 and one line.
"""
from __future__ import annotations

import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from absl import flags

from jaxspec import cli, requests, ssv, sts_map
from jaxspec.drafting import policies, specattn
from jaxspec.engine.sampling import SamplingParams

# jaxspec.engine.runner.METHODS.
METHODS = ("none", "draft", "specattn", "sts", "ssv", *policies.SELF_DRAFTING)
DRAFT_MODEL_METHODS = ("draft", "specattn", "sts")

_MODEL = flags.DEFINE_string("model", "smollm2-135m",
                             "orbax checkpoint dir, HF dir, .gguf file or demo name "
                             "(smollm2-135m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b)")
_PROMPT = flags.DEFINE_string("prompt", None, "the prompt")
_PROMPT_FILE = flags.DEFINE_string("prompt_file", None, "a file with one prompt per line (a batch)")
_CHAT = flags.DEFINE_bool("chat", False, "wrap each prompt in the model's chat template")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 256, "new tokens per prompt, at most")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "0 = greedy")
_TOP_K = flags.DEFINE_integer("top_k", 0, "0 = off")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "1 = off")
_MIN_P = flags.DEFINE_float("min_p", 0.0, "0 = off")
_SEED = flags.DEFINE_integer("seed", 0, "sampling seed")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "weights, activations, cache")
_MAX_LEN = flags.DEFINE_integer("max_len", None, "cache slots per sequence (prompt + new tokens), "
                                "at most the model's context; default: longest prompt + "
                                "max_new_tokens, capped at the context")
_METHOD = flags.DEFINE_enum("method", "none", list(METHODS),
                            "decoding method: none = vanilla; draft = a separate --draft_model "
                            "drafts; specattn = a --draft_model drafts and its attention picks "
                            "the keys the model verifies with (CHANGES the output: approximate "
                            "verification); sts = a --draft_model drafts and each of its heads "
                            "picks the keys a head of the model verifies with (CHANGES the "
                            "output likewise); the rest draft with the model itself over a KV "
                            "selection; ssv = an NSA model verifies under SSV's schedule "
                            "(--ssv_class), drafted by --draft_model or by itself. All but "
                            "specattn, sts and ssv's reuse/approx classes are lossless (greedy "
                            "output equals vanilla's exactly in float32; in bfloat16 it can part "
                            "at a near-tie)")
_DRAFT_MODEL = flags.DEFINE_string("draft_model", None, "methods draft, specattn, sts, ssv: the "
                                   "draft model (any --model spec with the same tokenizer), e.g. "
                                   "qwen2.5-coder-0.5b; ssv without one drafts with the model")
_SSV_CLASS = flags.DEFINE_string("ssv_class", None, "ssv: strict (default; lossless: the exact "
                                 "merged schedule), reuse (+ refresh/reuse layers), approx (+ a "
                                 "shared index per group of rows) or approx_reuse (both); reuse "
                                 "and approx CHANGE the model's output")
_SSV_GROUP = flags.DEFINE_integer("ssv_group", None, "ssv: G, verification rows per merged group "
                                  "(default 1; strict output does not depend on it, approx's "
                                  "does)")
_SSV_SCHEDULE = flags.DEFINE_string("ssv_schedule", None, "ssv reuse classes: the refresh/reuse "
                                    "schedule JSON (default: the one python -m "
                                    "jaxspec.ssv_calibrate saved beside --model)")
_TOP_P_ATTN = flags.DEFINE_float("top_p_attn", 0.97, "specattn: the draft attention mass each "
                                 "draft row keeps, in (0, 1]; lower = sparser verification and "
                                 "output further from the model's own")
_SPECATTN_MAP = flags.DEFINE_string("specattn_map", None, "specattn: the layer map JSON (default: "
                                    "the one jaxspec.specattn_map saved beside --model for this "
                                    "--draft_model, else the proportional map)")
_ATTN_CAP = flags.DEFINE_integer("attn_cap", None, "specattn: the most keys (besides the new "
                                 "tokens) a verification attends to per layer (default: no cap)")
_STS_BUDGET = flags.DEFINE_integer("sts_budget", None, "sts: the keys (besides the new tokens) "
                                  "each KV head of the model reads per round; the output is the "
                                  "masked model's, not the model's own")
_STS_BLOCK = flags.DEFINE_integer("sts_block", 1, "sts: pick pages of this many tokens (1: tokens)")
_STS_MAP = flags.DEFINE_string("sts_map", None, "sts: the head map JSON (default: the one "
                               "jaxspec.sts_map saved beside --model for this --draft_model and "
                               "--sts_budget, else the proportional map)")
_GAMMA = flags.DEFINE_integer("gamma", None, "draft tokens per round (speculative methods; "
                              "default 6, with --tree its depth)")
_TREE = flags.DEFINE_list("tree", None, "draft a tree of these widths per depth (e.g. 2,2,1,1: "
                          "the root's 2 children, 2 each for them, then 1 and 1), verified in "
                          "one pass; default: a chain of --gamma")
_TREE_ORDER = flags.DEFINE_enum("tree_order", "bfs", ["bfs", "dfs"],
                                "the order --tree's nodes are verified in")
_PLAN = flags.DEFINE_string("plan", None, "a planner profile JSON (benchmarks.plan_profile): the "
                            "planner picks and switches the strategy (self-drafting, or SSV with "
                            "--draft_model); replaces --method, --gamma, --sparsity, --tree, "
                            "--ssv_class and --ssv_group")
_PLAN_CLASS = flags.DEFINE_string("plan_class", None, "--plan: the precision class to plan in "
                                  "(default: the profile's only one)")
_SPARSITY = flags.DEFINE_float("sparsity", 0.07, "fraction of the KV cache drafts attend to")
_MIN_TOKENS = flags.DEFINE_integer("min_tokens", 256, "smallest KV budget for drafting")
_SCORE = flags.DEFINE_enum("score", "logits", ["logits", "weights"], "vegas criticality scores")
_SCORE_POOL = flags.DEFINE_integer("score_pool", policies.SCORE_POOL, "vegas family: each "
                                   "position's score becomes the largest within score_pool // 2 "
                                   "positions before the top-k (odd; 1: the scores as they are)")
_SCORE_BLOCK = flags.DEFINE_integer("score_block", policies.SCORE_BLOCK, "vegas family: the "
                                    "top-k keeps aligned blocks of this many positions, ranked "
                                    "by their best score (1: position by position)")
_SCORE_WINDOW = flags.DEFINE_integer("score_window", policies.SCORE_WINDOW, "vegas family: the "
                                     "prefix's newest positions kept whole, the rest of the "
                                     "budget ranked by score (0: every kept position ranked)")
_TP = flags.DEFINE_integer("tp", 1, "tensor parallelism: shard the model (and the draft model) "
                           "over this many devices, by attention head and MLP column")
_COMPILATION_CACHE = flags.DEFINE_string(
    "compilation_cache", None, "directory of JAX's persistent compilation cache (default: "
    "$JAX_COMPILATION_CACHE_DIR if set, else xla/ in jaxspec's cache, $JAXSPEC_CACHE or "
    "~/.cache/jaxspec; '' turns it off): a later run of the same model, method and shapes loads "
    "its compiled loops from it instead of compiling them")
_FP8_DRAFTS = flags.DEFINE_bool("fp8_drafts", False, "speculative methods: the draft steps' MLPs "
                                "multiply by FP8 (e4m3) copies of their weights; verification keeps "
                                "the model's, so the output distribution is unchanged (one device)")
_FUSE = flags.DEFINE_bool("fuse_projections", True, "run each layer's q/k/v and gate/up "
                          "projections as one GEMM each (the same function in fewer, larger "
                          "kernels: jaxspec.model.transformer.fuse_projections); on one device "
                          "only, so --tp > 1 keeps them apart")


def fail(message: str):
  cli.fail("jaxspec.generate", message)


def read_prompts() -> list[str]:
  if (_PROMPT.value is None) == (_PROMPT_FILE.value is None):
    fail("give exactly one of --prompt or --prompt_file")
  if _PROMPT.value is not None:
    if not _PROMPT.value.strip():
      fail("--prompt is empty")
    return [_PROMPT.value]
  try:
    raw = Path(_PROMPT_FILE.value).read_bytes()
  except OSError as e:
    fail(f"cannot read --prompt_file: {e}")
  try:
    text = raw.decode("utf-8")
  except UnicodeDecodeError as e:
    fail(f"--prompt_file {_PROMPT_FILE.value} is not UTF-8 text (byte {raw[e.start]:#04x} at "
         f"offset {e.start})")
  prompts = [line for line in text.replace("\r\n", "\n").split("\n") if line.strip()]
  if not prompts:
    fail(f"--prompt_file {_PROMPT_FILE.value} has no prompts")
  return prompts


class TextStreamer:
  """Prints each sequence's text as tokens arrive (one prompt) or when it finishes (a batch)."""

  def __init__(self, tokenizer, n: int, stop_ids: set[int]):
    self.tok, self.n, self.stop_ids = tokenizer, n, stop_ids
    self.printed = [""] * n
    self.finished = [False] * n
    self.open_line = False   # stdout ends mid-line (streamed text so far)

  def text(self, ids) -> str:
    return self.tok.decode([t for t in ids if t not in self.stop_ids], skip_special_tokens=True)

  def __call__(self, tokens: np.ndarray, num_new: np.ndarray, done: np.ndarray | None = None):
    for i in range(self.n):
      ids = tokens[i, :num_new[i]].tolist()
      if self.n == 1:
        text = self.text(ids)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next chunk
          continue
        sys.stdout.write(text[len(self.printed[0]):])
        sys.stdout.flush()
        self.printed[0] = text
        self.open_line = bool(text)
        cli.interrupt_point("streamed")
      elif done is not None and done[i] and not self.finished[i]:
        self.finished[i] = True
        sys.stdout.write(f"=== [{i}] ===\n{self.text(ids)}\n")
        sys.stdout.flush()

  def close_line(self):
    """End a streamed line cut short, so that what stderr prints next starts on its own line."""
    if self.open_line:
      sys.stdout.write("\n")
      sys.stdout.flush()
      self.open_line = False

  def finish(self, outputs: list[list[int]]):
    for i, ids in enumerate(outputs):
      if self.n == 1:
        sys.stdout.write(self.text(ids)[len(self.printed[0]):] + "\n")
      elif not self.finished[i]:
        sys.stdout.write(f"=== [{i}] ===\n{self.text(ids)}\n")
    sys.stdout.flush()


def tree_widths() -> tuple[int, ...] | None:
  """--tree as integers, checked against --method and --gamma (a one-line ValueError)."""
  if _TREE.value is None:
    return None
  try:
    widths = tuple(int(w) for w in _TREE.value)
  except ValueError:
    raise ValueError(f"--tree takes widths per depth such as 2,2,1,1, got "
                     f"{','.join(_TREE.value)}") from None
  requests.check_tree(widths, _TREE_ORDER.value, _METHOD.value, _GAMMA.value)
  return widths


def scoring() -> policies.Scoring:
  """--score, --score_pool, --score_block and --score_window (`cli.scoring`)."""
  return cli.scoring(_SCORE.value, _SCORE_POOL.value, _SCORE_BLOCK.value, _SCORE_WINDOW.value)


def check_flags() -> SamplingParams:
  """Every check that needs no model, so that a bad flag fails before the model loads."""
  try:
    sampling = SamplingParams(_TEMPERATURE.value, _TOP_K.value, _TOP_P.value, _MIN_P.value)
    if _PLAN.value is not None:
      given = [f"--{name}" for name in ("method", "gamma", "sparsity", "tree", "ssv_class",
                                         "ssv_group") if flags.FLAGS[name].present]
      if given:
        raise ValueError(f"--plan chooses the strategy: drop {', '.join(given)}")
    requests.check_count("--max_new_tokens", _MAX_NEW.value)
    if _MAX_LEN.value is not None:
      requests.check_count("--max_len", _MAX_LEN.value, minimum=2)
    if _METHOD.value != "none" and _GAMMA.value is not None:
      requests.check_count("--gamma", _GAMMA.value)
    tree_widths()
    scoring()
    if _METHOD.value in policies.SELF_DRAFTING:
      policies.validate(_METHOD.value, ratio=_SPARSITY.value, min_tokens=_MIN_TOKENS.value)
    if _METHOD.value in DRAFT_MODEL_METHODS and _DRAFT_MODEL.value is None:
      raise ValueError(f"--method={_METHOD.value} needs --draft_model")
    if (_METHOD.value not in (*DRAFT_MODEL_METHODS, "ssv") and _DRAFT_MODEL.value is not None
        and _PLAN.value is None):   # a plan of SSV strategies drafts with --draft_model
      raise ValueError(f"--draft_model is only for --method=draft, specattn, sts or ssv, not "
                       f"--method={_METHOD.value}")
    if _METHOD.value == "ssv":
      cls = ssv.check_class(_SSV_CLASS.value or "strict", "--ssv_class")
      if _SSV_GROUP.value is not None:
        ssv.check_group(_SSV_GROUP.value, "--ssv_group")
      if _SSV_SCHEDULE.value is not None and cls not in ssv.REUSE_CLASSES:
        raise ValueError(f"--ssv_schedule is for --ssv_class=reuse or approx_reuse, not {cls}")
      if _TP.value != 1:
        raise ValueError("--method=ssv runs on one device (no --tp yet)")
    else:
      for flag in (_SSV_CLASS, _SSV_GROUP, _SSV_SCHEDULE):
        if flag.value is not None and not (flag is _SSV_SCHEDULE and _PLAN.value is not None):
          raise ValueError(f"--{flag.name} is only for --method=ssv, not --method={_METHOD.value}")
    if _METHOD.value == "specattn":
      specattn.check_top_p(_TOP_P_ATTN.value)
      if _ATTN_CAP.value is not None:
        requests.check_count("--attn_cap", _ATTN_CAP.value)
      if _TP.value != 1:
        raise ValueError("--method=specattn runs on one device (no --tp yet)")
    if _METHOD.value == "sts":
      sts_map.check_budget(_STS_BUDGET.value)
      requests.check_count("--sts_block", _STS_BLOCK.value)
      if _TP.value != 1:
        raise ValueError("--method=sts runs on one device (no --tp yet)")
    if _FP8_DRAFTS.value:
      if _PLAN.value is not None:
        raise ValueError("--fp8_drafts does not combine with --plan yet")
      if _METHOD.value == "none":
        raise ValueError("--fp8_drafts is for speculative methods: --method=none drafts nothing")
      if _TP.value != 1:
        raise ValueError("--fp8_drafts runs on one device (no --tp yet)")
    requests.check_count("--tp", _TP.value)
  except ValueError as e:
    fail(str(e))
  return sampling


def use_compilation_cache() -> None:
  """Point JAX's persistent compilation cache at --compilation_cache (an unusable path fails in
  one line); without the flag, a cache JAX was given ($JAX_COMPILATION_CACHE_DIR) stays. JAX
  stores only compiles of a second or more: the loops and prefills, not the small jits around
  them."""
  import jax
  if _COMPILATION_CACHE.value == "":
    jax.config.update("jax_compilation_cache_dir", None)
    return
  if _COMPILATION_CACHE.value is None and jax.config.jax_compilation_cache_dir:
    return
  from jaxspec.fetch import cache_dir
  path = Path(_COMPILATION_CACHE.value or cache_dir() / "xla")
  try:
    path.mkdir(parents=True, exist_ok=True)
  except OSError as e:
    fail(f"--compilation_cache {path}: cannot use it as a directory ({e.strerror})")
  jax.config.update("jax_compilation_cache_dir", str(path))


def load_planner():
  """The --plan profile's planner (None without --plan); a bad profile fails in one line."""
  if _PLAN.value is None:
    return None
  from jaxspec.engine.planner import Planner
  try:
    return Planner.load(_PLAN.value, _PLAN_CLASS.value)
  except (OSError, ValueError) as e:
    fail(str(e))


def specattn_layers(target, draft) -> tuple[int, ...] | None:
  """The SpecAttn layer map: --specattn_map, else the one saved beside the target for this draft
  model, else None (the proportional map, said on stderr). A map for another pair: ValueError."""
  from jaxspec import specattn_map
  path = _SPECATTN_MAP.value
  if path is None:
    saved = specattn_map.default_map_path(target.source, _DRAFT_MODEL.value)
    if not saved.is_file():
      print(f"[jaxspec] no SpecAttn layer map at {saved}: using the proportional map "
            "(python -m jaxspec.specattn_map makes the KL map)", file=sys.stderr)
      return None
    path = saved
  return specattn_map.load_map(path, target.model, draft.model).layers


def sts_head_map(target, draft):
  """The STS head map: --sts_map, else the one saved beside the target for this draft model and
  budget, else None (the proportional map, said on stderr). A map for another pair or budget:
  ValueError."""
  path = _STS_MAP.value
  if path is None:
    saved = sts_map.default_map_path(target.source, _DRAFT_MODEL.value, _STS_BUDGET.value)
    if not saved.is_file():
      print(f"[jaxspec] no STS head map at {saved}: using the proportional map "
            "(python -m jaxspec.sts_map makes the learned one)", file=sys.stderr)
      return None
    path = saved
  return sts_map.load_map(path, target.model, draft.model, _STS_BUDGET.value)


def ssv_refresh(target, cls: str | None) -> tuple[bool, ...] | None:
  """The refresh/reuse schedule of an ssv reuse class `cls` (None: strict): --ssv_schedule, else
  the one saved beside the model; None for the other classes. Missing, or made for another model:
  ValueError."""
  cls = cls or "strict"
  if cls not in ssv.REUSE_CLASSES:
    return None
  path = _SSV_SCHEDULE.value
  if path is None:
    path = ssv.default_schedule_path(target.source)
    if not path.is_file():
      raise ValueError(f"--ssv_class={cls} needs --ssv_schedule (no schedule at {path}; python -m "
                       "jaxspec.ssv_calibrate makes one)")
  return ssv.load_schedule(path, target.model)


def main(argv):
  del argv
  cli.quiet_logging()
  sampling = check_flags()
  planner = load_planner()
  prompts = read_prompts()
  use_compilation_cache()
  from jaxspec.engine.runner import Runner
  from jaxspec.io.loading import apply_chat_template, check_draft_pair, load_model
  from jaxspec.model.transformer import fuse_projections
  dtype = jnp.bfloat16 if _DTYPE.value == "bfloat16" else jnp.float32
  try:
    loaded = load_model(_MODEL.value, dtype=dtype, tp=_TP.value)
    draft = None
    if _DRAFT_MODEL.value is not None:
      draft = load_model(_DRAFT_MODEL.value, dtype=dtype, tp=_TP.value)
      check_draft_pair(loaded, draft, _MODEL.value, _DRAFT_MODEL.value)
    layer_map = specattn_layers(loaded, draft) if _METHOD.value == "specattn" else None
    head_map = sts_head_map(loaded, draft) if _METHOD.value == "sts" else None
    if _METHOD.value == "ssv" and loaded.model.cfg.nsa is None:
      raise ValueError(f"--method=ssv verifies a Native Sparse Attention model; {_MODEL.value} has "
                       "dense attention")
    # With --plan, the strategies' class (one per planner) decides, not --ssv_class.
    plan_ssv = planner is not None and planner.strategies[0].method == "ssv"
    ssv_class = planner.strategies[0].ssv_class if plan_ssv else _SSV_CLASS.value
    refresh = ssv_refresh(loaded, ssv_class) if _METHOD.value == "ssv" or plan_ssv else None
    if _FUSE.value and _TP.value == 1:
      for m in (loaded.model, draft and draft.model):
        if m is not None:
          fuse_projections(m)
  except (OSError, ValueError) as e:
    fail(str(e))
  tok = loaded.tokenizer
  if tok is None:
    fail(f"{loaded.source} has no tokenizer files; convert it from a source that has one")
  try:
    texts = [apply_chat_template(tok, p) for p in prompts] if _CHAT.value else prompts
  except ValueError as e:
    fail(str(e))
  ids = [tok.encode(t, add_special_tokens=not _CHAT.value) for t in texts]
  stop_ids = loaded.stop_ids
  streamer = TextStreamer(tok, len(ids), set(stop_ids))
  try:
    runner = Runner(loaded.model, method=_METHOD.value, gamma=_GAMMA.value,
                    sparsity=_SPARSITY.value, min_tokens=_MIN_TOKENS.value, scoring=scoring(),
                    draft_model=draft and draft.model, sampling=sampling, stop_ids=stop_ids,
                    cache_dtype=dtype, tree=tree_widths(), tree_order=_TREE_ORDER.value,
                    top_p_attn=_TOP_P_ATTN.value, layer_map=layer_map, attn_cap=_ATTN_CAP.value,
                    sts_budget=_STS_BUDGET.value, sts_block=_STS_BLOCK.value, head_map=head_map,
                    planner=planner, ssv_class=_SSV_CLASS.value,
                    ssv_group=_SSV_GROUP.value, refresh=refresh,
                    fp8_drafts=_FP8_DRAFTS.value)
    outputs, stats = runner.generate(ids, max_new_tokens=_MAX_NEW.value, max_len=_MAX_LEN.value,
                                     seed=_SEED.value, on_chunk=streamer)
  except ValueError as e:
    streamer.close_line()
    fail(str(e))
  except KeyboardInterrupt:
    streamer.close_line()
    raise
  streamer.finish(outputs)
  print("[jaxspec] " + stats.line(), file=sys.stderr)


if __name__ == "__main__":
  cli.run(main, "jaxspec.generate")
