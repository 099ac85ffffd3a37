"""Kernel benchmark: verify / sparse attention, top-k selection and the FP8 MLP's SwiGLU
quantization against the roofline.

One run measures a device copy (bytes read + written over time), then every case: the Pallas kernel,
the jitted pure-JAX reference (XLA) and, where it applies, torch SDPA, each as microseconds, GB/s of
the bytes the case must move at least (K/V rows it reads once, scores once) and % of the copy rate.
With --check it first runs every kernel on the GPU against its reference on small shapes.

  python -m benchmarks.kernels --out benchmarks/out/kernels.json

Timing: JAX calls are dispatched back to back (asynchronously) and the wall time of a batch is
divided by its size; the median over several batches is reported. torch is timed with
triton.testing.do_bench (CUDA events, median). Inputs that fit in L2 (top-k scores) are rotated.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import time
import traceback

from absl import app, flags
import numpy as np

import jax
import jax.numpy as jnp

from benchmarks.common import copy_ceiling, device_name, git_commit, time_batched, write_json
from benchmarks.common import time_chain as common_time_chain
from jaxspec.drafting.policies import budget
from jaxspec.drafting import sts
from jaxspec.drafting.specattn import SpecAttnConfig, capped_union, kept_union, row_sets
from jaxspec.drafting.trees import Tree
from jaxspec import cli
from pallas_kernels import rope_write as _rope
from pallas_kernels import sparse_attention as _sparse
from pallas_kernels import swiglu_quant as _swiglu
from pallas_kernels import verify_attention as _verify
from pallas_kernels.sparse_attention import sparse_attention_reference
from pallas_kernels.topk_select import topk_select, topk_select_reference
from pallas_kernels.topp_select import topp_select, topp_select_reference
from pallas_kernels.verify_attention import verify_attention_reference

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "benchmarks/out/kernels.json", "where to write the JSON results")
flags.DEFINE_bool("check", True, "first check every kernel against its reference on small shapes")
flags.DEFINE_bool("sweep", True, "time a few tuning-knob variants of the main cases")
flags.DEFINE_list("only", [], "run only these: the full and followup plans' groups (decode, "
                  "verify, sparse, small, topk, swiglu), or the verification and sparse "
                  "cases whose name starts with one of these prefixes, in any plan")
flags.DEFINE_integer("batches", 7, "timed batches per measurement (median reported)")
flags.DEFINE_float("batch_seconds", 0.05, "target wall time of one timed batch")
flags.DEFINE_integer("shrink", 1, "divide every sequence length by this (smoke runs on the CPU)")
flags.DEFINE_float("time_budget", 240, "skip the remaining cases after this many seconds")
flags.DEFINE_enum("plan", "full", ["full", "followup", "scores", "collect2", "gamma", "topp",
                                   "tree", "specattn", "sts", "sts_verify", "swiglu", "fold",
                                   "layout", "weights"],
                  "full: every case; followup: a second pass of tuning variants (verify defaults, "
                  "score path, sparse T=8 knobs, small cases chained); "
                  "collect2: the verification kernel with and without Collect-2's scores, the "
                  "scores from the tile's padding rows (the default) and from their own "
                  "product, at a vegas round's shapes (0.5B and 1.5B, B 64 and 128 x 24576, "
                  "T = 7 and 9; Qwen3-8B, B 4 x 131072, T = 8 and 12), 8 chained calls each; "
                  "fold: Collect-2's verification kernel at the 0.5B's four collect2 shapes "
                  "with its key blocks folded 1-4 an iteration under one rescale (4 and 8 "
                  "warps), 32-key blocks, the product at 128-key blocks and 4 pipeline stages, "
                  "against scores off, 8 chained calls each; "
                  "gamma: the verification kernel at long rounds (T = gamma + 1 up to 17: "
                  "more packed query rows than one 64-row tile), with and without Collect-2's "
                  "scores, and its tile knobs there; "
                  "scores: split count and block_k of the scored verification kernel; "
                  "topp: the sorting-free top-p select against sorting and top-k; "
                  "tree: verification and sparse attention under a draft tree's mask against "
                  "the chain at the same T; specattn: what SpecAttn adds to a round at the "
                  "end-to-end serving shape (the draft step's weights scores, the round's "
                  "top-p selection and capped union, per top-p method); sts: STS's round "
                  "selection at the same shape (per-head top-k and capped union, per top-k "
                  "method); sts_verify: STS's sparse verification attention against the dense "
                  "verify kernel at the 1.5B's shapes, B 16-64, 32K, T = 5, 10% budget; "
                  "swiglu: the FP8 MLP's SwiGLU quantization against XLA's form, and the "
                  "kernel's knobs, at a draft step's 128 rows (0.5B and 1.5B); layout: a draft "
                  "step's sparse attention over the same rows scattered, in aligned blocks of 8 "
                  "and as StreamingLLM's sinks and dense tail (0.5B and 1.5B, 128 x 24576); "
                  "weights: Collect-2's softmax weights (--score=weights) from the main pass's "
                  "stored logits (float16, the default; float32) and from a second pass over "
                  "K, against its logits and scores off (0.5B and 1.5B, 128 x 24576, T = 9 and "
                  "10)")
flags.DEFINE_string("sts_map", "benchmarks/results/maps/sts_map_k256.qwen2_5-coder-0_5b.json",
                    "the head map whose draft heads --plan=sts selects from")
flags.DEFINE_list("check_groups", ["verify", "sparse", "topk", "topp", "tree", "rope", "swiglu"],
                  "kernel groups --check runs")
flags.DEFINE_bool("interpret", False, "run the Pallas kernels in interpret mode (CPU smoke runs)")

MODELS = {"qwen3-8b": (32, 8, 128), "qwen2.5-0.5b": (14, 2, 64), "qwen2.5-1.5b": (12, 2, 128)}
RESULTS: list[dict] = []
T_START = time.time()


# ----------------------------------------------------------------------------------------------
# Timing

def time_jax(fn, arg_sets) -> float:
  """Median seconds per call of fn(*args), rotating through arg_sets (`time_batched`)."""
  return time_batched(fn, arg_sets, batch_seconds=FLAGS.batch_seconds, batches=FLAGS.batches)


def time_chain(fn, arg_sets, n: int = 8) -> float:
  """Device seconds per call, n calls chained in one program, rotating through arg_sets
  (`benchmarks.common.time_chain`)."""
  return common_time_chain(fn, arg_sets, n, batch_seconds=FLAGS.batch_seconds,
                           batches=FLAGS.batches)


def time_torch(fn) -> float | None:
  try:
    import triton.testing
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-3
  except Exception:
    return None


COPY_BPS = float("nan")


def record(case: str, impl: str, seconds, nbytes: int, **extra) -> None:
  """seconds: a number, None (not available) or a thunk timed here, its failure recorded alone."""
  if callable(seconds):
    try:
      seconds = seconds()
    except Exception as e:
      print(f"  !! {case} {impl}: {type(e).__name__}: {str(e)[:1500]}", flush=True)
      RESULTS.append(dict(case=case, impl=impl + " (error)", error=str(e)[:1500]))
      return
  if seconds is None:
    return
  gbps = nbytes / seconds / 1e9
  row = dict(case=case, impl=impl, us=seconds * 1e6, gb_s=gbps,
             pct_copy=100 * nbytes / seconds / COPY_BPS, bytes=nbytes, **extra)
  RESULTS.append(row)
  print(f"  {case:42s} {impl:28s} {row['us']:10.1f} us {gbps:8.0f} GB/s {row['pct_copy']:6.1f} %",
        flush=True)


def guarded(fn):
  @functools.wraps(fn)
  def wrapper(*a, **k):
    if time.time() - T_START > FLAGS.time_budget:
      print(f"  -- skipped {fn.__name__}{a}: over the time budget", flush=True)
      return None
    try:
      return fn(*a, **k)
    except Exception as e:  # one failing case must not lose the others
      print(f"  !! {fn.__name__}{a}: {type(e).__name__}: {str(e)[:2000]}", flush=True)
      traceback.print_exc(limit=4)
      RESULTS.append(dict(case=f"{fn.__name__}{a}", impl="error", error=str(e)[:2000]))
    finally:
      write_json(FLAGS.out, dict(device=device_name(), partial=True, results=RESULTS))
  return wrapper


def verify_attention(*a, **k):
  return _verify.verify_attention(*a, interpret=FLAGS.interpret, **k)


def sparse_attention(*a, **k):
  return _sparse.sparse_attention(*a, interpret=FLAGS.interpret, **k)


GROUPS = ("decode", "verify", "sparse", "small", "topk", "swiglu")   # the full plan's sections


def wanted(name: str) -> bool:
  return not FLAGS.only or any(name.startswith(p) for p in FLAGS.only)


def case_wanted(name: str) -> bool:
  """A dense or sparse case runs where --only names a group (the plans choose those) or a prefix
  of the case's name."""
  return not FLAGS.only or any(p in GROUPS or name.startswith(p) for p in FLAGS.only)


# ----------------------------------------------------------------------------------------------
# Inputs

def rand(key, shape, dtype=jnp.bfloat16):
  return jax.random.normal(jax.random.PRNGKey(key), shape, jnp.float32).astype(dtype)


def attention_rows(key, shape, dtype=jnp.bfloat16):
  """Attention-like weights: softmax of N(0, 2.5^2) logits; p = 0.97 keeps ~30% of a row (the
  paper's 68.8% KV reduction at p = 0.97)."""
  x = 2.5 * jax.random.normal(jax.random.PRNGKey(key), shape, jnp.float32)
  return jax.nn.softmax(x, axis=-1).astype(dtype)


def cache(b, s, hkv, d, seed=0):
  return rand(seed + 1, (b, s, hkv, d)), rand(seed + 2, (b, s, hkv, d))


def kv_bytes(tokens: int, hkv: int, d: int) -> int:
  return tokens * hkv * d * 2 * 2


# ----------------------------------------------------------------------------------------------
# Baselines

def torch_sdpa(b, t, hq, hkv, d, s):
  """torch SDPA over a [B, Hkv, S, D] cache (its preferred layout), causal among the T new rows."""
  try:
    import torch
    import torch.nn.functional as F
  except Exception:
    return None
  if not torch.cuda.is_available():
    return None
  dev = "cuda"
  q = torch.randn(b, hq, t, d, device=dev, dtype=torch.bfloat16)
  k = torch.randn(b, hkv, s, d, device=dev, dtype=torch.bfloat16)
  v = torch.randn(b, hkv, s, d, device=dev, dtype=torch.bfloat16)
  mask = None
  if t > 1:
    j = torch.arange(s, device=dev)[None, :]
    mask = j <= (s - t + torch.arange(t, device=dev))[:, None]
  sec = time_torch(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True))
  del q, k, v
  torch.cuda.empty_cache()
  return sec


@functools.partial(jax.jit, static_argnames=("tail_w",))
def xla_gather_attention(q, k, v, indices, counts, tail_start, lengths, *, tail_w):
  """XLA baseline for sparse: gather the selected and tail rows, then masked dense attention."""
  b, t, hq, d = q.shape
  hkv = k.shape[2]
  g = hq // hkv
  tail_pos = tail_start[:, None] + jnp.arange(tail_w)[None]
  pos = jnp.concatenate([indices, tail_pos], axis=1)                       # [B, K+W]
  kg = jnp.take_along_axis(k, pos[:, :, None, None], axis=1)
  vg = jnp.take_along_axis(v, pos[:, :, None, None], axis=1)
  kk = indices.shape[1]
  slot = jnp.arange(kk + tail_w)
  row_pos = lengths[:, None] + jnp.arange(t)[None]                         # [B, T]
  vis = jnp.where(slot[None, None] < kk, slot[None, None] < counts[:, None, None],
                  pos[:, None] <= row_pos[:, :, None])                     # [B, T, K+W]
  qg = q.reshape(b, t, hkv, g, d)
  logits = jnp.einsum("bthgd,bshd->bhgts", qg, kg, preferred_element_type=jnp.float32) * d ** -0.5
  logits = jnp.where(vis[:, None, None], logits, -jnp.inf)
  p = jax.nn.softmax(logits, axis=-1).astype(q.dtype)
  return jnp.einsum("bhgts,bshd->bthgd", p, vg).reshape(b, t, hq, d)


# ----------------------------------------------------------------------------------------------
# Correctness on the GPU (small shapes; compile errors surface here)

def rel_err(a, b):
  a = jnp.asarray(a, jnp.float32)
  b = jnp.asarray(b, jnp.float32)
  return float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30))


CHECKS: list[str] = []   # each check's PASS / FAIL line, for the JSON


def check_line(line: str) -> None:
  print(line, flush=True)
  CHECKS.append(line)


def check_all() -> bool:
  ok = True
  print("== GPU checks against the references", flush=True)
  groups = set(FLAGS.check_groups)
  verify_cases = [(1, 32, 8, 128, None, (0, -1)), (8, 32, 8, 128, "logits", (0, -1)),
                  (12, 32, 8, 128, "weights", (0, -1)), (12, 14, 2, 64, "logits", None),
                  (7, 7, 1, 128, "weights", None), (2, 12, 2, 128, "logits", (0, -1)),
                  (8, 32, 8, 128, "logits", "per_row"), (5, 14, 2, 64, "weights", "per_row"),
                  (1, 14, 2, 64, "weights", (0, -1)),   # a draft step: weights from stored logits
                  # the 0.5B's Collect-2 at gamma 8: the padding row, its blocks folded
                  (9, 14, 2, 64, "logits", (0, -1)),
                  (9, 14, 2, 64, "logits", (0, -1), dict(blocks_per_rescale=4)),
                  (9, 14, 2, 64, "logits", (0, -1), dict(block_k=32, blocks_per_rescale=3)),
                  # Collect-2's weights from the collected rows' stored logits (1.5B, 0.5B)
                  (10, 12, 2, 128, "weights", (0, -1)), (9, 14, 2, 64, "weights", (0, -1))]
  for (t, hq, hkv, d, kind, rows, *knobs) in verify_cases:
    if "verify" not in groups:
      break
    knobs = knobs[0] if knobs else {}
    label = (f"verify T={t} {hq}/{hkv}/{d} {kind}"
             + "".join(f" {a}={x}" for a, x in knobs.items()))
    try:
      b, s = 3, 1000
      k, v = cache(b, s, hkv, d, seed=t)
      q = rand(t + 7, (b, t, hq, d))
      lengths = jnp.array([0, 517, s - t], jnp.int32)
      opts = dict(score_kind=kind, per_row=True) if rows == "per_row" else dict(
          score_kind=kind, score_rows=rows)
      out, sc = verify_attention(q, k, v, lengths, **opts, **knobs)
      ro, rs = verify_attention_reference(q, k, v, lengths, **opts)
      if rows == "per_row":   # check row T-1 of the dump like a collected score row
        sc, rs = sc[:, -1], rs[:, -1]
      e = rel_err(out, ro)
      good = e < 1e-2 and not bool(jnp.isnan(out).any())
      msg = f"{label} rows={rows}: out err {e:.1e}"
      if kind is not None:
        fin = jnp.isfinite(rs)
        same_mask = bool(jnp.all(jnp.isfinite(sc) == fin))
        se = rel_err(jnp.where(fin, sc, 0), jnp.where(fin, rs, 0))
        kk = 50
        a = jax.lax.top_k(jnp.where(fin, sc.astype(jnp.float32), -1e30)[1:], kk)[1]
        r = jax.lax.top_k(jnp.where(fin, rs.astype(jnp.float32), -1e30)[1:], kk)[1]
        overlap = np.mean([len(set(np.asarray(a[i])) & set(np.asarray(r[i]))) / kk
                           for i in range(2)])
        good &= same_mask and se < 2e-2
        msg += f", scores err {se:.1e}, -inf pattern {same_mask}, top-{kk} overlap {overlap:.3f}"
      check_line(("PASS " if good else "FAIL ") + msg)
      ok &= good
    except Exception as e:
      ok = False
      check_line(f"FAIL {label}: {type(e).__name__}: {str(e)[:3000]}")
  rng = np.random.default_rng(0)
  for (t, hq, hkv, d, per_head, kk) in [(1, 32, 8, 128, False, 300), (8, 32, 8, 128, True, 300),
                                         (7, 14, 2, 64, False, 0), (12, 12, 2, 128, False, 977)]:
    if "sparse" not in groups:
      break
    try:
      b, s = 3, 1000
      k, v = cache(b, s, hkv, d, seed=3 * t)
      q = rand(t + 11, (b, t, hq, d))
      lengths = np.array([20, 517, s - t], np.int32)
      tails = np.array([25, 400, s - t - 16], np.int32)   # row 0 of batch 0 sees nothing
      shape = (b, hkv, kk) if per_head else (b, kk)
      idx = np.zeros(shape, np.int32)
      cnt = np.zeros(shape[:-1], np.int32)
      for bi in range(b):
        for h in range(hkv if per_head else 1):
          c = min(kk, tails[bi])
          sel = rng.permutation(tails[bi])[:c]
          if per_head:
            idx[bi, h, :c], cnt[bi, h] = sel, c
          else:
            idx[bi, :c], cnt[bi] = sel, c
      args = (q, k, v, jnp.asarray(idx), jnp.asarray(cnt), jnp.asarray(tails), jnp.asarray(lengths))
      out = sparse_attention(*args)
      ref = sparse_attention_reference(*args)
      e = rel_err(out, ref)
      good = e < 1e-2 and not bool(jnp.isnan(out).any())
      check_line(("PASS " if good else "FAIL ") +
                 f"sparse T={t} {hq}/{hkv}/{d} per_head={per_head} K={kk}: err {e:.1e}")
      ok &= good
    except Exception as e:
      ok = False
      check_line(f"FAIL sparse T={t} per_head={per_head}: {type(e).__name__}: {str(e)[:3000]}")
  for widths, hq, hkv, d in [((2, 2, 1, 1), 32, 8, 128), ((1, 2, 1, 1), 14, 2, 64)]:
    if "tree" not in groups:
      break
    try:
      bits = jnp.asarray(Tree.from_widths(widths).ancestor_bits)
      t, b, s = bits.shape[0], 3, 1000
      k, v = cache(b, s, hkv, d, seed=t)
      q = rand(t + 13, (b, t, hq, d))
      lengths = jnp.array([0, 517, s - t], jnp.int32)
      out, sc = verify_attention(q, k, v, lengths, score_kind="logits", tree_bits=bits)
      ro, rs = verify_attention_reference(q, k, v, lengths, score_kind="logits", tree_bits=bits)
      fin = jnp.isfinite(rs)
      e = rel_err(out, ro)
      se = rel_err(jnp.where(fin, sc, 0), jnp.where(fin, rs, 0))
      good = e < 1e-2 and se < 2e-2 and bool(jnp.all(jnp.isfinite(sc) == fin))
      tails = jnp.array([0, 300, s - t - 16], jnp.int32)
      idx = jnp.asarray(np.stack([np.resize(rng.permutation(max(int(x), 1)), 64) for x in tails]),
                        jnp.int32)   # distinct within the counted part
      cnt = jnp.minimum(tails, 64)
      args = (q, k, v, idx, cnt, tails, lengths)
      se2 = rel_err(sparse_attention(*args, tree_bits=bits),
                    sparse_attention_reference(*args, tree_bits=bits))
      good &= se2 < 1e-2
      check_line(("PASS " if good else "FAIL ") + f"tree {widths} T={t} {hq}/{hkv}/{d}: verify "
                 f"out err {e:.1e}, scores err {se:.1e}; sparse err {se2:.1e}")
      ok &= good
    except Exception as e:
      ok = False
      check_line(f"FAIL tree {widths}: {type(e).__name__}: {str(e)[:3000]}")
  for dt in (jnp.bfloat16, jnp.float32):
    if "topk" not in groups:
      break
    try:
      sc = rand(5, (4, 5000), dt)
      lengths = jnp.array([1, 100, 4321, 5000], jnp.int32)
      k = budget(lengths, 0.07, 16, 400)
      r = np.asarray(topk_select_reference(sc, lengths, k, k_max=400))
      kn = np.asarray(k)
      for method in ("threshold", "pallas") if dt == jnp.bfloat16 else ("threshold",):
        a = np.asarray(topk_select(sc, lengths, k, k_max=400, method=method,
                                   interpret=FLAGS.interpret))
        good = all(set(a[i, :kn[i]]) == set(r[i, :kn[i]]) for i in range(4))
        check_line(("PASS " if good else "FAIL ") + f"topk_select {method} {jnp.dtype(dt).name}")
        ok &= good
    except Exception as e:
      ok = False
      check_line(f"FAIL topk {dt}: {type(e).__name__}: {str(e)[:3000]}")
  for dt in (jnp.bfloat16, jnp.float32):
    if "topp" not in groups:
      break
    try:
      w = attention_rows(6, (4, 5000), dt)
      lengths = jnp.array([1, 100, 4321, 5000], jnp.int32)
      r = [np.asarray(x) for x in topp_select_reference(w, lengths, p=0.97, k_max=2000)]
      for method in ("threshold", "pallas") if dt == jnp.bfloat16 else ("threshold",):
        a = topp_select(w, lengths, p=0.97, k_max=2000, method=method, interpret=FLAGS.interpret)
        good = all(np.array_equal(np.asarray(x), y) for x, y in zip(a, r))
        check_line(("PASS " if good else "FAIL ") + f"topp_select {method} {jnp.dtype(dt).name} "
                   f"(counts {r[1].tolist()})")
        ok &= good
    except Exception as e:
      ok = False
      check_line(f"FAIL topp {dt}: {type(e).__name__}: {str(e)[:3000]}")
  # rope_write: the 1.5B's and 0.5B's draft step and verification, Qwen3-8B's with its q/k norms.
  for (t, hq, hkv, d, norm) in [(1, 12, 2, 128, False), (9, 12, 2, 128, False),
                                (1, 14, 2, 64, False), (9, 14, 2, 64, False),
                                (8, 32, 8, 128, True)]:
    if "rope" not in groups:
      break
    try:
      b, s = 3, 1000
      qkv = rand(t + 17, (b, t, hq + 2 * hkv, d))
      angles = jax.random.uniform(jax.random.PRNGKey(t), (b, t, d), jnp.float32, 0, 50)
      cos, sin = jnp.cos(angles), jnp.sin(angles)
      k, v = cache(b, s, hkv, d, seed=t + 19)
      lengths = jnp.array([0, 517, s - t], jnp.int32)
      norms = dict(q_norm=rand(t + 23, (d,)), k_norm=rand(t + 29, (d,))) if norm else {}
      want = _rope.rope_write_reference(qkv, cos, sin, k, v, lengths, num_heads=hq, **norms)
      got = _rope.rope_write(qkv, cos, sin, k, v, lengths, num_heads=hq,
                             interpret=FLAGS.interpret, **norms)
      # Rotated rows within one bf16 step (whether the rotation rounds once, as an FMA, is the
      # compiler's choice); values bit for bit.
      off, within = [], True
      for g_, w_ in ((got[0].rows, want[0].rows), (got[1], want[1])):
        a, r = np.asarray(g_, np.float32), np.asarray(w_, np.float32)
        off.append(int((a != r).sum()))
        within &= bool(np.all(np.abs(a - r) <= 2.0 ** -7 * np.abs(r) + 1e-5))
      same_v = bool(np.array_equal(np.asarray(got[2]), np.asarray(want[2])))
      good = within and same_v
      check_line(("PASS " if good else "FAIL ") + f"rope_write T={t} {hq}/{hkv}/{d} norms={norm}: "
                 f"queries / keys off the reference's bits {off[0]} / {off[1]} (within one step "
                 f"{within}), values bit for bit {same_v}")
      ok &= good
    except Exception as e:
      ok = False
      check_line(f"FAIL rope_write T={t}: {type(e).__name__}: {str(e)[:3000]}")
  # swiglu_quant: a draft step's 128 rows of the 1.5B's and 0.5B's MLPs, one row all zeros.
  for (m, f) in [(128, 8960), (128, 4864), (7, 8960)]:
    if "swiglu" not in groups:
      break
    try:
      gate_up = (rand(m + f, (m, 2 * f), jnp.float32) * 300).astype(jnp.bfloat16)
      args = (gate_up.at[m // 2].set(0), jnp.float32(0.03), jnp.float32(0.1))
      (q, rs), (wq, wrs) = (_swiglu.swiglu_quantize(*args, interpret=FLAGS.interpret),
                            _swiglu.swiglu_quantize_reference(*args))
      q, wq = np.asarray(q, np.float32), np.asarray(wq, np.float32)
      # e4m3 values within one step of the reference's (exp and the division may round apart on
      # a GPU), row scales to float32 rounding, nothing non-finite.
      good = bool(np.isfinite(q).all() and np.allclose(np.asarray(rs), np.asarray(wrs), rtol=1e-6)
                  and np.all(np.abs(q - wq) <= 2.0 ** -3 * np.abs(wq) + 2.0 ** -9))
      check_line(("PASS " if good else "FAIL ") + f"swiglu_quantize {m} x {f}: e4m3 values off "
                 f"the reference's {int((q != wq).sum())} of {q.size}")
      ok &= good
    except Exception as e:
      ok = False
      check_line(f"FAIL swiglu_quantize {m} x {f}: {type(e).__name__}: {str(e)[:3000]}")
  return ok


# ----------------------------------------------------------------------------------------------
# Cases

@guarded
def copy_case():
  """The copy ceiling: the best of XLA's and torch's device copies (common.copy_rates)."""
  global COPY_BPS
  n = (2 << 30) // FLAGS.shrink
  COPY_BPS, rates_gbps = copy_ceiling(n, chain=1)
  for impl, gbps in rates_gbps.items():
    record("copy 2 GiB (read+write)", impl, 2 * n / (gbps * 1e9), 2 * n)


# score mode -> verify_attention's (score_kind, score_rows, per_row)
MODES = {"off": (None, (0, -1), False), "collect2": ("logits", (0, -1), False),
         "collect2-weights": ("weights", (0, -1), False), "allrows": ("logits", None, False),
         "perrow-logits": ("logits", None, True), "perrow-weights": ("weights", None, True)}


@guarded
def dense_case(model, b, s, t, modes, with_ref=True, with_torch=True, variants=(), chain=False,
               tree=None):
  """`tree`: widths per depth; the case then verifies that tree's T nodes under its mask (t is
  ignored), with Collect-2's rows the root and the main path's leaf (`tree_score_spec`).
  chain: True adds a chained timing of each mode at default knobs; "only" times every mode and
  variant chained, and only chained."""
  hq, hkv, d = MODELS[model]
  tree_kw, rows_of = {}, {}
  if tree is not None:
    shape = Tree.from_widths(tree)
    t = shape.size
    tree_kw = dict(tree_bits=jnp.asarray(shape.ancestor_bits))
    main = [0]
    while shape.children[main[-1]]:
      main.append(shape.children[main[-1]][0])
    rows_of = dict(score_rows=(0, main[-1]))
  name = (f"{'decode' if t == 1 else 'verify'} {model} B{b}xL{s} T{t}"
          + (f" tree={'.'.join(map(str, tree))}" if tree is not None else ""))
  if not case_wanted(name):
    return
  k, v = cache(b, s, hkv, d)
  lengths = jnp.full((b,), s - t, jnp.int32)
  # Arrays are passed as arguments (closed-over arrays would be baked into the program).
  qs = [(rand(10 + i, (b, t, hq, d)), k, v, lengths) for i in range(2)]
  base = kv_bytes(b * s, hkv, d)
  # Each mode at default knobs, then the tuning variants ("scores" in a variant picks its mode).
  cases = [(mode, {}) for mode in modes] + [
      (kn.get("scores", "off"), {a: x for a, x in kn.items() if a != "scores"}) for kn in variants]
  for mode, knobs in cases:
    kind, rows, per_row = MODES[mode]
    nbytes = base + (b * s * 2 * (t if per_row else 1) if kind else 0)
    fn = functools.partial(verify_attention, score_kind=kind, per_row=per_row,
                           **{"score_rows": rows, **(rows_of if kind else {}), **tree_kw, **knobs})
    label = " ".join(([f"scores={mode}"] if kind or not knobs else [])
                     + ([",".join(f"{a}={x}" for a, x in knobs.items())] if knobs else []))
    extra = dict(mode=mode, knobs=knobs) if knobs else dict(mode=mode)
    if chain != "only":
      record(name, f"pallas {label}", lambda fn=fn: time_jax(fn, qs), nbytes, **extra)
    if chain == "only" or (chain and not knobs):
      record(name, f"pallas {label} [chained]", lambda fn=fn: time_chain(fn, qs), nbytes,
             timing="chained", **extra)
  if with_ref:
    kind = None if t == 1 else "logits"
    fn = functools.partial(verify_attention_reference, score_kind=kind, **tree_kw)
    record(name, f"xla reference scores={kind}", lambda: time_jax(fn, qs), base)
  del k, v, qs
  if with_torch:
    record(name, "torch sdpa (B,H,S,D layout)", lambda: torch_sdpa(b, t, hq, hkv, d, s), base)


def sparse_inputs(b, s, hkv, kk, tail, per_head, sort, seed=0, block=1):
  """Index lists of kk distinct positions below the dense tail: scattered one by one, or with
  `block` > 1 as kk // block aligned blocks of `block` positions (what `--score_block` selects)."""
  rng = np.random.default_rng(seed)
  tail_start = s - 64 - tail    # leave room for T new rows inside the cache
  shape = (b, hkv) if per_head else (b,)
  if kk % block:
    raise ValueError(f"{kk} indices do not split into blocks of {block}")

  def one_list():
    starts = rng.choice(tail_start // block, kk // block, replace=False) * block
    return (starts[:, None] + np.arange(block)).reshape(-1)

  idx = np.stack([one_list() for _ in range(math.prod(shape))])
  if sort:
    idx = np.sort(idx, axis=-1)
  idx = idx.reshape(*shape, kk).astype(np.int32)
  cnt = np.full(shape, kk, np.int32)
  return jnp.asarray(idx), jnp.asarray(cnt), jnp.full((b,), tail_start, jnp.int32)


@guarded
def sparse_case(model, b, s, kk, t, per_head=False, sort=True, with_ref=True, variants=(),
                chain=False, tree=None, tail=64, block=1):
  """`tree`: widths per depth; the case then drafts that tree's T nodes under its mask. `tail`:
  the dense tail's length; `block`: the indices as aligned blocks of that many positions."""
  hq, hkv, d = MODELS[model]
  tree_kw = {}
  if tree is not None:
    shape = Tree.from_widths(tree)
    t = shape.size
    tree_kw = dict(tree_bits=jnp.asarray(shape.ancestor_bits))
  name = (f"sparse {model} B{b}xL{s} K{kk}+{tail} T{t}" + (" per-head" if per_head else "")
          + ("" if sort else " unsorted") + (f" blocks of {block}" if block > 1 else "")
          + (f" tree={'.'.join(map(str, tree))}" if tree is not None else ""))
  if not case_wanted(name):
    return
  k, v = cache(b, s, hkv, d)
  idx, cnt, tail_start = sparse_inputs(b, s, hkv, kk, tail, per_head, sort, block=block)
  lengths = tail_start + tail
  qs = [(rand(20 + i, (b, t, hq, d)), k, v, idx, cnt, tail_start, lengths) for i in range(2)]
  nbytes = kv_bytes(b * (kk + tail + t), hkv, d) + idx.size * 4
  if tree is not None:
    fn = functools.partial(sparse_attention, **tree_kw)
    record(name, "pallas", lambda: time_jax(fn, qs), nbytes)
    return
  record(name, "pallas", lambda: time_jax(sparse_attention, qs), nbytes)
  if chain:
    record(name, "pallas [chained]", lambda: time_chain(sparse_attention, qs), nbytes,
           timing="chained")
  for knobs in variants:
    fn = functools.partial(sparse_attention, **knobs)
    record(name, "pallas " + ",".join(f"{a}={x}" for a, x in knobs.items()),
           lambda fn=fn: time_jax(fn, qs), nbytes, knobs=knobs)
  if with_ref and not per_head:
    fn = functools.partial(xla_gather_attention, tail_w=tail + t)
    record(name, "xla gather+attention", lambda: time_jax(fn, qs), nbytes)
    if chain:
      record(name, "xla gather+attention [chained]", lambda: time_chain(fn, qs), nbytes,
             timing="chained")
  del k, v, qs


@guarded
def topk_case(b, l, ratio, dtype):
  k_max = math.ceil(ratio * l)
  lengths = jnp.full((b,), l, jnp.int32)
  k = budget(lengths, ratio, 16, k_max)
  sets = [(rand(30 + i, (b, l), dtype), lengths, k) for i in range(8)]
  nbytes = b * l * jnp.dtype(dtype).itemsize + b * k_max * 4
  name = f"topk_select B{b}xL{l} ratio {ratio} {jnp.dtype(dtype).name}"
  variants = [("threshold", {}), ("top_k", {})]
  if dtype == jnp.bfloat16:
    variants += [("pallas", dict(digit=2)), ("pallas", dict(digit=4)),
                 ("pallas", dict(digit=2, num_warps=8)), ("pallas", dict(digit=2, block=2048))]
  for method, knobs in variants:
    fn = functools.partial(topk_select, k_max=k_max, method=method, interpret=FLAGS.interpret,
                           **knobs)
    label = " ".join([method] + [f"{a}={x}" for a, x in knobs.items()])
    record(name, label, lambda fn=fn: time_jax(fn, sets), nbytes)


@guarded
def swiglu_case(m, f, sweep=True):
  """The FP8 MLP's SwiGLU quantization at M rows of F columns: the kernel (and its knobs) against
  XLA's form (the reference jitted), 8 chained calls each. Its input is the gate/up GEMM's bf16
  output, in L2 in a draft step as here (two input sets of M x 2F rotate)."""
  sets = [(rand(40 + i, (m, 2 * f), jnp.float32).astype(jnp.bfloat16), jnp.float32(0.03),
           jnp.float32(0.1)) for i in range(2)]
  nbytes = m * 2 * f * 2 + m * f + m * 4          # read gate/up once, write e4m3 and the scales
  name = f"swiglu_quantize {m} x {f}"
  record(name, "xla", lambda: time_chain(jax.jit(_swiglu.swiglu_quantize_reference), sets), nbytes)
  knobs = [{}] + ([{"num_warps": 8}, {"block": 4096}, {"block": 2048, "num_warps": 8}]
                  if sweep else [])
  for kw in knobs:
    fn = functools.partial(_swiglu.swiglu_quantize, interpret=FLAGS.interpret, **kw)
    label = " ".join(["pallas"] + [f"{a}={x}" for a, x in kw.items()])
    record(name, label, lambda fn=fn: time_chain(fn, sets), nbytes)


def swiglu_plan(sh):
  for f in (8960, 4864):   # the 1.5B's and the 0.5B's
    swiglu_case(128, max(16, f // sh // 16 * 16), sweep=FLAGS.sweep)


def sort_topp(w, lengths, *, p, k_max):
  """The usual sorting top-p (what SpecAttn's kernel replaces): sort each row descending, f32
  cumulative sum, keep the prefix reaching p; positions sorted back into ascending order."""
  s = w.shape[1]
  x = jnp.where(jnp.arange(s)[None] < lengths[:, None], w.astype(jnp.float32), 0)
  pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), x.shape)
  neg, order = jax.lax.sort((-x, pos), dimension=1, num_keys=1)
  mass = jnp.cumsum(-neg, axis=1)
  counts = jnp.minimum(jnp.sum(mass < p * mass[:, -1:], axis=1) + 1, k_max).astype(jnp.int32)
  live = jnp.arange(k_max)[None] < counts[:, None]
  idx = jnp.sort(jnp.where(live, order[:, :k_max], s), axis=1)
  return jnp.where(live, idx, 0), counts


@guarded
def topp_case(rows, s, p, dtype, sweep=True):
  k_max = s // 2
  sets = [(attention_rows(40 + i, (rows, s), dtype), jnp.full((rows,), s, jnp.int32))
          for i in range(4)]
  kept = float(jnp.mean(topp_select(*sets[0], p=p, k_max=k_max)[1]))
  nbytes = rows * s * jnp.dtype(dtype).itemsize + rows * k_max * 4
  name = f"topp_select R{rows}xS{s} p {p} {jnp.dtype(dtype).name}"
  print(f"  {name}: keeps {kept:.0f} positions a row ({100 * kept / s:.1f}%)", flush=True)
  variants = [("threshold", {}), ("bisect10", {}), ("sort", {})]
  if sweep:
    variants += [("threshold", dict(digit=2))]
  if dtype == jnp.bfloat16:
    variants += [("pallas", dict(digit=4)), ("pallas", dict(digit=2))]
    if sweep:
      variants += [("pallas", dict(digit=2, num_warps=8)), ("pallas", dict(digit=4, block=512))]
  for method, knobs in variants:
    fn = functools.partial(topp_select, p=p, k_max=k_max, method=method,
                           interpret=FLAGS.interpret, **knobs)
    label = " ".join([method] + [f"{a}={x}" for a, x in knobs.items()])
    record(name, label, lambda fn=fn: time_jax(fn, sets), nbytes, kept=kept)
  fn = jax.jit(functools.partial(sort_topp, p=p, k_max=k_max))
  record(name, "sort f32 (plain top-p)", lambda: time_jax(fn, sets), nbytes, kept=kept)
  # topk_select keeping as many positions as top-p keeps on average.
  ratio = kept / s
  for method in ("threshold", "pallas") if dtype == jnp.bfloat16 else ("threshold",):
    @jax.jit
    def fn(scores, lengths, method=method):
      return topk_select(scores, lengths, budget(lengths, ratio, 1, k_max), k_max=k_max,
                         method=method, interpret=FLAGS.interpret)
    record(name, f"topk_select {method} k={math.ceil(ratio * s)}",
           lambda fn=fn: time_jax(fn, sets), nbytes, kept=kept)


def tree_plan(q3, sh):
  """Issue 17: a draft tree's mask inside the kernels against the chain at the same T (the chain
  with T - 1 drafts), scores off and Collect-2, at Qwen3-8B and Qwen2.5-0.5B shapes; then sparse
  (tree drafting over a selection) at the 0.5B's. Goal: the tree within 5% of the chain."""
  for model, b, s in ((q3, 4, 131072 // sh), ("qwen2.5-0.5b", 64, 16384 // sh)):
    for widths in ((1, 2, 1, 1), (2, 2, 1, 1)):   # 8 and 15 nodes
      t = Tree.from_widths(widths).size
      dense_case(model, b, s, t, ("off", "collect2"), with_ref=False, with_torch=False)
      dense_case(model, b, s, t, ("off", "collect2"), with_ref=False, with_torch=False,
                 tree=widths)
  for widths in ((1, 2, 1, 1), (2, 2, 1, 1)):
    t = Tree.from_widths(widths).size
    sparse_case("qwen2.5-0.5b", 64, 16384 // sh, 1024 // sh, t, with_ref=False)
    sparse_case("qwen2.5-0.5b", 64, 16384 // sh, 1024 // sh, t, with_ref=False, tree=widths)


def topp_plan(sh):
  """Issue 16's top-p kernel speed: rows of 2K-128K positions (SpecAttn selects per draft step
  and draft layer: gamma x layers x batch rows) against a sort-based top-p, the paper's 10-step
  bisection and topk_select at the same kept count."""
  for s in (2048, 8192, 32768):
    topp_case(96, s // sh, 0.97, jnp.bfloat16)
  topp_case(16, 131072 // sh, 0.97, jnp.bfloat16)
  topp_case(1536, 8192 // sh, 0.97, jnp.bfloat16, sweep=False)   # 4 steps x 24 layers x 16 seqs
  topp_case(96, 8192 // sh, 0.99, jnp.bfloat16, sweep=False)
  topp_case(96, 8192 // sh, 0.97, jnp.float32, sweep=False)


@guarded
def specattn_select_case(gamma, layers, b, s, p, cap):
  """The round's selection of `jaxspec.drafting.specattn.kept_union` (gamma x layers x b draft rows
  of s positions: top-p per row, the union over the gamma rows, capped at `cap` by summed weight),
  and its two parts, per top-p method."""
  rows = [attention_rows(60 + i, (gamma, layers, b, s)) for i in range(2)]
  start = jnp.full((b,), s - gamma - 1, jnp.int32)
  nbytes = gamma * layers * b * s * 2 + layers * b * cap * 4
  name = f"specattn select {gamma}x{layers}x{b} rows x S{s} p {p} cap {cap}"
  lengths = (start[None, None] + jnp.arange(gamma, dtype=jnp.int32)[:, None, None] + 1)
  lengths = jnp.broadcast_to(lengths, (gamma, layers, b)).reshape(-1)
  for method in ("threshold", "pallas", "sort", "bisect10"):
    spec = SpecAttnConfig(layers=tuple(range(layers)), top_p=p, cap=cap, dense_layers=0,
                          topp_method=method)
    fn = jax.jit(functools.partial(kept_union, spec=spec, k_max=cap, interpret=FLAGS.interpret))
    kept = float(jnp.mean(fn(rows[0], start)[1]))
    record(name, f"kept_union {method}", lambda fn=fn: time_jax(fn, [(r, start) for r in rows]),
           nbytes, kept=kept)
    sel = jax.jit(functools.partial(topp_select, p=p, k_max=cap, method=method,
                                    interpret=FLAGS.interpret and method == "pallas"))
    record(name, f"topp_select {method} alone",
           lambda sel=sel: time_jax(sel, [(r.reshape(-1, s), lengths) for r in rows]), nbytes)
  idx, cnt = topp_select(rows[0].reshape(-1, s), lengths, p=p, k_max=cap)

  @jax.jit
  def union(idx, cnt, w, start):
    return capped_union(row_sets(idx, cnt, s).reshape(gamma, layers, b, s), w, start, cap)
  record(name, "row_sets + capped_union alone",
         lambda: time_jax(union, [(idx, cnt, r, start) for r in rows]), nbytes)


def specattn_plan(sh):
  """SpecAttn's round costs at the end-to-end run's shapes (benchmarks/RESULTS.md: the 1.5B
  verifying, the 0.5B drafting, B = 32, 16K-32K-token prompts, the KL map's 10 draft layers,
  cap 4096): a draft step's attention with and without the 'weights' scores of its sampling row
  (from the main pass's stored logits, the default at T = 1, and from a second pass over K; summed
  over heads as SpecAttn collects them, per KV head as STS does), and the round's selection."""
  weights = "collect2-weights"
  for s in (16384, 32768):
    dense_case("qwen2.5-0.5b", 32, s // sh, 1, ("off", weights, "collect2"),
               with_ref=False, with_torch=False,
               variants=({"scores": weights, "weights_store": False},
                         {"scores": weights, "score_heads": "kv"},
                         {"scores": weights, "score_heads": "kv", "weights_store": False}))
  for s in (16384, 32768):
    specattn_select_case(4, 10, 32, s // sh, 0.95, 4096 // sh)


@guarded
def sts_select_case(gamma, b, s, path):
  """STS's round selection (`jaxspec.drafting.sts.head_union`) from gamma draft steps' per-KV-head
  rows of the draft layers the head map at `path` reads, and its per-row top-k alone, per top-k
  method."""
  with open(path) as f:
    m = json.load(f)
  heads = tuple(tuple(tuple(e) for e in layer) for layer in m["heads"])
  hd, hkv = 2, len(heads[0])                                     # the 0.5B's KV heads, the 1.5B's
  spec = sts.STSConfig(heads=heads, draft_heads=hd, target_kv_heads=hkv, budget=m["budget"])
  ls, used = len(spec.score_layers), len(set(spec.table))
  rows = [attention_rows(70 + i, (gamma, ls, b, hd, s)) for i in range(2)]
  start = jnp.full((b,), s - gamma - 1, jnp.int32)
  nbytes = rows[0].size * 2
  name = f"sts select {gamma}x{ls}x{b}x{hd} rows x S{s} k {m['budget']}"
  lengths = jnp.broadcast_to(start[None, None] + jnp.arange(gamma, dtype=jnp.int32)[:, None, None]
                             + 1, (gamma, used, b)).reshape(-1)
  for method in ("threshold", "pallas"):
    cfg = dataclasses.replace(spec, topk_method=method)
    fn = jax.jit(functools.partial(sts.head_union, spec=cfg, capacity=s,
                                   interpret=FLAGS.interpret))
    record(name, f"head_union {method} ({used} draft heads, {len(heads) * hkv} target)",
           lambda fn=fn: time_jax(fn, [(r, start) for r in rows]), nbytes)
    k_max = min(spec.budget, s)
    sel = jax.jit(functools.partial(topk_select, k_max=k_max, method=method,
                                    interpret=FLAGS.interpret and method == "pallas"))
    picked = jnp.asarray(sorted(set(spec.table)))
    flat = [r.swapaxes(2, 3).reshape(gamma, ls * hd, b, s)[:, picked].reshape(-1, s)
            for r in rows]
    k = jnp.minimum(lengths, k_max)
    record(name, f"topk_select {method} alone ({flat[0].shape[0]} rows)",
           lambda sel=sel: time_jax(sel, [(x, lengths, k) for x in flat]), nbytes)


def sts_plan(sh):
  """STS's round selection at the end-to-end run's shape (the 1.5B verifying, the 0.5B drafting,
  B = 32, 16K-32K-token prompts, the recorded k = 256 head map, gamma = 4). The draft step's
  per-KV-head 'weights' are in --plan=specattn."""
  for s in (16384, 32768):
    sts_select_case(4, 32, s // sh, FLAGS.sts_map)


def sts_verify_plan(sh):
  """STS's verification attention (issue 15's speed table): one 1.5B layer (12 query heads, 2 KV
  heads of 128) verifying T = gamma + 1 = 5 rows over a 32K cache, dense (`verify_attention`, no
  scores) against sparse over per-KV-head lists of 10% of the cache plus the 64-token tail
  (`sparse_attention`, STS's plan), at B = 16, 32 and 64; each also chained (8 calls in one
  program: no host dispatch between them)."""
  s = 32768 // sh
  for b in (16, 32, 64):
    dense_case("qwen2.5-1.5b", b, s, 5, ("off",), with_ref=False, with_torch=False, chain=True)
    sparse_case("qwen2.5-1.5b", b, s, math.ceil(0.1 * s), 5, per_head=True, with_ref=False,
                chain=True)


def layout_plan(sh):
  """Where a draft step's sparse attention spends its time by the layout of what it reads: at a
  draft step of the 0.5B and the 1.5B (B = 128 x 24576, T = 1, 7% of the cache plus the 64-token
  tail, the vegas rows' budget), the same count of rows as scattered positions, as aligned
  blocks of 8 (`--score_block=8`), and as StreamingLLM reads them: 4 indices (its sinks) and the
  rest as one dense tail. Equal bytes in every case, 8 chained calls each."""
  s = 24576 // sh
  kk = 8 * math.ceil(0.07 * s / 8)
  for model in ("qwen2.5-0.5b", "qwen2.5-1.5b"):
    sparse_case(model, 128, s, kk, 1, with_ref=False, chain=True)
    sparse_case(model, 128, s, kk, 1, with_ref=False, chain=True, block=8)
    sparse_case(model, 128, s, 4, 1, with_ref=False, chain=True, tail=kk + 64 - 4)


def summary():
  print("\n== summary (device %s, copy %.0f GB/s)" % (device_name(), COPY_BPS / 1e9))
  # Each column is as wide as its longest label: variants differ only at the end of theirs.
  c = max([44] + [len(r.get("case", "")) for r in RESULTS])
  w = max([30] + [len(r.get("impl", "")) for r in RESULTS])
  print(f"{'case':{c}s} {'impl':{w}s} {'us':>9s} {'GB/s':>7s} {'%copy':>6s}")
  for r in RESULTS:
    if r.get("impl") == "error":
      print(f"{r['case']:{c}s} ERROR {r['error'][:80]}")
    elif "error" in r:
      print(f"{r['case']:{c}s} {r['impl']:{w}s} ERROR {r['error'][:60]}")
    else:
      print(f"{r['case']:{c}s} {r['impl']:{w}s} {r['us']:9.1f} {r['gb_s']:7.0f} "
            f"{r['pct_copy']:6.1f}")


def main(argv):
  del argv
  cli.quiet_logging()
  t_start = time.time()
  print(f"jax {jax.__version__} on {device_name()}", flush=True)
  checks = None
  if FLAGS.check:
    checks = check_all()
    print(f"== checks {'all passed' if checks else 'FAILED'} ({time.time() - t_start:.0f} s)",
          flush=True)
  copy_case()
  q3 = "qwen3-8b"
  sweep_dense = ({"block_k": 128}, {"block_k": 32}, {"num_stages": 2}, {"num_stages": 4},
                 {"num_warps": 8}, {"block_k": 128, "num_warps": 8}, {"num_splits": 8},
                 {"num_splits": 16}, {"num_splits": 32}) if FLAGS.sweep else ()
  sweep_sparse = ({"block_k": 16}, {"block_k": 64}, {"num_stages": 2}, {"num_stages": 4},
                  {"num_warps": 8}, {"num_splits": 2}, {"num_splits": 8}) if FLAGS.sweep else ()
  sh = FLAGS.shrink
  if FLAGS.plan == "followup":
    followup(q3, sh)
  elif FLAGS.plan == "scores":
    scores_plan(q3, sh)
  elif FLAGS.plan == "collect2":
    collect2_plan(q3, sh)
  elif FLAGS.plan == "gamma":
    gamma_plan(q3, sh)
  elif FLAGS.plan == "fold":
    fold_plan(sh)
  elif FLAGS.plan == "topp":
    topp_plan(sh)
  elif FLAGS.plan == "tree":
    tree_plan(q3, sh)
  elif FLAGS.plan == "specattn":
    specattn_plan(sh)
  elif FLAGS.plan == "sts":
    sts_plan(sh)
  elif FLAGS.plan == "sts_verify":
    sts_verify_plan(sh)
  elif FLAGS.plan == "swiglu":
    swiglu_plan(sh)
  elif FLAGS.plan == "layout":
    layout_plan(sh)
  elif FLAGS.plan == "weights":
    weights_plan(sh)
  else:
    full(q3, sh, sweep_dense, sweep_sparse)
  summary()
  write_json(FLAGS.out, dict(device=device_name(), jax=jax.__version__, commit=git_commit(),
                             copy_gb_s=None if math.isnan(COPY_BPS) else COPY_BPS / 1e9,
                             checks_passed=checks, checks=CHECKS, results=RESULTS,
                             wall_s=time.time() - t_start))
  print(f"wrote {FLAGS.out} ({time.time() - t_start:.0f} s)")


def followup(q3, sh):
  """Second run: new verify defaults and score path, sparse T=8 knobs, small cases chained."""
  if wanted("decode"):
    dense_case(q3, 4, 131072 // sh, 1, ("off",), with_ref=False, with_torch=False,
               variants=({"num_stages": 4}, {"block_k": 64}))
  if wanted("verify"):
    dense_case(q3, 4, 131072 // sh, 8, ("off", "collect2"), with_ref=False, with_torch=False,
               variants=({"num_stages": 4},))
    dense_case(q3, 4, 131072 // sh, 12, ("off", "collect2", "allrows"), with_ref=False,
               with_torch=False, variants=({"block_k": 128},))
    dense_case(q3, 16, 32768 // sh, 12, ("off", "collect2"), with_ref=False, with_torch=False)
  if wanted("sparse"):
    sparse_case(q3, 16, 131072 // sh, 8192 // sh, 8, with_ref=False,
                variants=({"block_k": 64}, {"block_k": 16}, {"num_warps": 8}, {"num_stages": 2},
                          {"num_splits": 8}))
  if wanted("small"):
    for m in ("qwen2.5-0.5b", "qwen2.5-1.5b"):
      sparse_case(m, 64, 16384 // sh, 1024 // sh, 1, chain=True)
      sparse_case(m, 64, 16384 // sh, 1024 // sh, 8, chain=True)
    dense_case("qwen2.5-0.5b", 64, 16384 // sh, 8, ("off",), with_ref=False, with_torch=False,
               chain=True, variants=({"block_k": 64}, {"num_splits": 8}))


def scores_plan(q3, sh):
  """The scored kernel's grid: how many splits (programs per SM) and which block_k suit it."""
  c2 = lambda **kw: dict(scores="collect2", **kw)
  dense_case(q3, 4, 131072 // sh, 12, ("off", "collect2"), with_ref=False, with_torch=False,
             variants=(c2(num_splits=17), c2(num_splits=24), c2(num_splits=32),
                       c2(block_k=64), c2(block_k=64, num_splits=32),
                       c2(num_stages=2), c2(num_stages=4), c2(num_warps=8)))
  dense_case(q3, 16, 32768 // sh, 12, ("collect2",), with_ref=False, with_torch=False,
             variants=(c2(num_splits=5), c2(num_splits=8)))
  dense_case(q3, 4, 131072 // sh, 8, ("collect2",), with_ref=False, with_torch=False,
             variants=(c2(num_splits=17), c2(num_splits=32), c2(num_stages=2), c2(num_stages=4),
                       c2(num_warps=8)))
  for t in (5, 8):
    dense_case("qwen2.5-0.5b", 64, 16384 // sh, t, ("off", "collect2"), with_ref=False,
               with_torch=False,
               variants=(c2(num_splits=5), c2(num_splits=8), c2(num_splits=16),
                         c2(block_k=128, num_splits=8), c2(block_k=32, num_splits=8),
                         c2(num_stages=2), c2(num_stages=4), c2(num_warps=8),
                         c2(num_warps=2)))
  dense_case("qwen2.5-1.5b", 64, 16384 // sh, 8, ("collect2",), with_ref=False, with_torch=False,
             variants=(c2(num_splits=5), c2(num_splits=8)))
  dense_case("qwen2.5-0.5b", 64, 16384 // sh, 5, ("perrow-logits", "perrow-weights"),
             with_ref=False, with_torch=False,
             variants=(dict(scores="perrow-weights", num_splits=8),))


def collect2_plan(q3, sh):
  """Collect-2's cost (issue 14's goal: at most 5% over the same verification without it), 8
  chained calls a mode: scores off, Collect-2 at the defaults (the summed query in the tile's
  padding rows where one is free) and Collect-2 from the separate k @ qsum product."""
  product = (dict(scores="collect2", logits_store=False),)
  for m in ("qwen2.5-0.5b", "qwen2.5-1.5b"):
    for b in (64, 128):
      for t in (7, 9):
        dense_case(m, b, 24576 // sh, t, ("off", "collect2"), with_ref=False, with_torch=False,
                   chain="only", variants=product)
  for t in (8, 12):     # 8: 32 packed rows fill the tile, so the defaults take the product
    dense_case(q3, 4, 131072 // sh, t, ("off", "collect2"), with_ref=False, with_torch=False,
               chain="only", variants=product)


def weights_plan(sh):
  """Collect-2's softmax weights at a vegas round's shapes (the 0.5B and the 1.5B at B = 128 x
  24576, T = 9 and 10: gamma 8 and 9), 8 chained calls each: from the collected rows' logits
  stored by the main pass (the default) and from a second pass over K, against Collect-2's logits
  and scores off. The chained calls include XLA's epilogue (the final lse applied, the rows and
  heads summed). The logits are stored in float16 (the default) and in float32."""
  weights = "collect2-weights"
  variants = (dict(scores=weights, weights_store_dtype="float32"),
              dict(scores=weights, weights_store=False))
  for m in ("qwen2.5-0.5b", "qwen2.5-1.5b"):
    for t in (9, 10):
      dense_case(m, 128, 24576 // sh, t, ("off", "collect2", weights), with_ref=False,
                 with_torch=False, chain="only", variants=variants)


def fold_plan(sh):
  """Collect-2 at head_dim 64 (the 0.5B's shapes, where it runs +7-11% over scores off): the key
  blocks every row sees folded 1-4 an iteration under one rescale of the accumulator (2 is the
  default), with 4 warps (the default) and 8, 32-key blocks, the k @ qsum product at 128-key
  blocks, and a fourth pipeline stage, 8 chained calls each."""
  c2 = lambda **kn: dict(scores="collect2", **kn)
  variants = (c2(num_warps=8), c2(num_warps=8, blocks_per_rescale=3),
              c2(num_warps=8, blocks_per_rescale=4),
              c2(blocks_per_rescale=1), c2(blocks_per_rescale=3), c2(blocks_per_rescale=4),
              c2(block_k=32, blocks_per_rescale=4), c2(num_stages=4),
              c2(logits_store=False, block_k=128), dict(blocks_per_rescale=2))
  for b in (64, 128):
    for t in (7, 9):
      dense_case("qwen2.5-0.5b", b, 24576 // sh, t, ("off", "collect2"), with_ref=False,
                 with_torch=False, chain="only", variants=variants)


def gamma_plan(q3, sh):
  """Verification at long rounds, 8 chained calls each: T = gamma + 1 rows whose G x T packed
  query rows fill one 64-row tile (the 1.5B at gamma 8, the 0.5B at 8, Qwen3-8B at 12) or
  outgrow it (gamma 10 and 12; Qwen3-8B 16), with and without Collect-2's scores, and the tile
  knobs that bound its shared memory and registers."""
  c2 = lambda **kn: dict(scores="collect2", **kn)
  wide = ({"block_k": 128}, {"num_warps": 8}, {"num_warps": 8, "block_k": 64},
          c2(num_warps=4), c2(num_warps=8), c2(num_warps=8, block_k=64), c2(block_k=64))
  for m, b in (("qwen2.5-1.5b", 128), ("qwen2.5-1.5b", 64), ("qwen2.5-0.5b", 128)):
    dense_case(m, b, 24576 // sh, 9, ("off", "collect2"), with_ref=False, with_torch=False,
               chain="only", variants=(c2(block_k=32), c2(block_k=64), c2(num_splits=2),
                                       c2(num_splits=3), c2(num_splits=6)))
  dense_case("qwen2.5-1.5b", 128, 24576 // sh, 7, ("off", "collect2"), with_ref=False,
             with_torch=False, chain="only")
  for m in ("qwen2.5-1.5b", "qwen2.5-0.5b"):
    for t in (11, 13):
      dense_case(m, 128, 24576 // sh, t, ("off",), with_ref=False, with_torch=False,
                 chain="only", variants=wide)
  dense_case(q3, 4, 131072 // sh, 17, ("off",), with_ref=False, with_torch=False, chain="only",
             variants=wide)


def full(q3, sh, sweep_dense, sweep_sparse):
  if wanted("decode"):
    dense_case(q3, 4, 131072 // sh, 1, ("off",), variants=sweep_dense)
    dense_case(q3, 16, 32768 // sh, 1, ("off",))
  if wanted("verify"):
    dense_case(q3, 4, 131072 // sh, 8, ("off", "collect2", "collect2-weights", "allrows",
                                        "perrow-logits", "perrow-weights"),
               variants=sweep_dense[:5])
    dense_case(q3, 4, 131072 // sh, 12, ("off", "collect2", "allrows"))
    dense_case(q3, 16, 32768 // sh, 8, ("off", "collect2"))
    dense_case(q3, 16, 32768 // sh, 12, ("off", "collect2", "allrows"))
  if wanted("sparse"):
    sparse_case(q3, 16, 131072 // sh, 8192 // sh, 1, variants=sweep_sparse)
    sparse_case(q3, 16, 131072 // sh, 8192 // sh, 8)
    sparse_case(q3, 16, 131072 // sh, 8192 // sh, 1, sort=False, with_ref=False)
    sparse_case(q3, 16, 131072 // sh, 8192 // sh, 1, per_head=True)
  if wanted("small"):
    for m in ("qwen2.5-0.5b", "qwen2.5-1.5b"):
      splits = ({"num_splits": 4}, {"num_splits": 8}) if FLAGS.sweep else ()
      dense_case(m, 64, 16384 // sh, 1, ("off",), variants=splits)
      dense_case(m, 64, 16384 // sh, 8, ("off", "collect2", "perrow-weights"), variants=splits)
      sparse_case(m, 64, 16384 // sh, 1024 // sh, 1)
      sparse_case(m, 64, 16384 // sh, 1024 // sh, 8)
  if wanted("topk"):
    topk_case(16, 131072 // sh, 0.07, jnp.bfloat16)
    topk_case(16, 131072 // sh, 0.07, jnp.float32)
    topk_case(24 * 64, 33792 // sh, 0.07, jnp.bfloat16)   # per-layer selection, long workload
  if wanted("swiglu"):
    swiglu_plan(sh)


if __name__ == "__main__":
  app.run(main)
