"""Tensor parallelism over two CPU devices against one device: greedy tokens, logits, Collect-2
scores and the selected positions, where the weights and the KV cache live, and the errors.

XLA_FLAGS=--xla_force_host_platform_device_count=2 must be set before jax is imported, and this
pytest process has imported it already, so the checks run in one subprocess (this file run as a
script: `_worker`), which writes a JSON report; each test asserts on one part of it. One process
compiles everything once: the whole file took 2.5 minutes on two shared cores.
"""
import json
import sys
import time
from pathlib import Path

import pytest

from subproc import run_module, run_worker, two_devices_env

PROMPT_LENS = (9, 40, 13)
MAX_NEW = 12


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
  return run_worker(__file__, tmp_path_factory.mktemp("tp"))


@pytest.mark.parametrize("method", ["none", "vegas", "draft"])
def test_greedy_tokens_equal_one_device(report, method):
  """Each method on two devices against plain greedy decoding on one (which every method's greedy
  output equals on one device: test_speculative, test_serving)."""
  one, two = report["generate"]["none/tp1"], report["generate"][f"{method}/tp2"]
  assert two["tokens"] == one["tokens"]
  assert all(len(t) == MAX_NEW for t in one["tokens"])
  if method != "none":   # drafts were accepted and rejected, not only one or the other
    assert 1 < two["accepted"] < 4, two["accepted"]


def test_interpret_kernels_under_shard_map_give_the_same_tokens(report):
  """The Pallas kernels in interpret mode, each device on its own heads (vegas: verification with
  Collect-2 scores, sparse drafting, the top-k kernel), against one device's greedy tokens."""
  two = report["generate"]["vegas-interpret/tp2"]
  assert two["tokens"] == report["generate"]["none/tp1"]["tokens"]
  assert two["accepted"] == report["generate"]["vegas/tp2"]["accepted"]


@pytest.mark.parametrize("name", ["vegas-tree-interpret", "draft-tree"])
def test_draft_trees_on_two_devices_give_the_same_tokens(report, name):
  """Draft trees (2, 2, 1): their ancestor bits replicated under shard_map (interpret kernels),
  and the draft model's breadth-first tree compacted in its sharded cache."""
  two = report["generate"][f"{name}/tp2"]
  assert two["tokens"] == report["generate"]["none/tp1"]["tokens"]
  assert two["accepted"] > 1


@pytest.mark.parametrize("backend", ["reference", "interpret"])
def test_logits_within_tolerance(report, backend):
  r = report["forward"][backend]
  assert r["logits_max_abs_diff"] < 1e-5 * r["logits_scale"], r
  assert r["logits_scale"] > 0.1   # not vacuous


@pytest.mark.parametrize("backend", ["reference", "interpret"])
def test_collect2_scores_and_selection_equal_one_device(report, backend):
  """Bitwise-equal bf16 scores (the prefill's row and verification's Collect-2 rows, averaged over
  all query heads) and the same selected positions, on two devices as on one."""
  r = report["forward"][backend]
  assert r["scores_shape"] == [2, len(PROMPT_LENS), 128], r    # [L, B, S]
  assert r["scores_equal"] and r["prefill_scores_equal"], r
  assert r["selection_equal"] and r["prefill_selection_equal"], r
  assert r["selected"] > 0


def test_serving_refills_a_slot_on_two_devices(report):
  alone = report["generate"]["none/tp1"]["tokens"]
  assert report["serve"] == [alone[0], alone[2], alone[0]]


def test_weights_and_cache_placed_in_shards(report):
  p = report["placement"]
  assert p["layers/0/self_attn/q_proj/kernel"] == "P(None, 'tp')"
  assert p["layers/0/self_attn/k_proj/bias"] == "P('tp',)"
  assert p["layers/0/self_attn/o_proj/kernel"] == "P('tp', None)"
  assert p["layers/1/mlp/up_proj/kernel"] == "P(None, 'tp')"
  assert p["layers/1/mlp/down_proj/kernel"] == "P('tp', None)"
  assert p["embed_tokens/embedding"] == p["lm_head/kernel"] == p["norm/weight"] == "P()"
  assert p["layers/0/self_attn/q_norm/weight"] == "P()"
  assert p["cache_after_prefill"] == p["cache_after_decoding"] == "P(None, None, 'tp')"
  # One all-reduce after attention and one after the MLP per layer, and no gathers, in a step.
  assert p["decode_step_collectives"] == {"all-reduce": 4}


def test_loading_goes_straight_into_shards(report):
  """From an orbax checkpoint and from host arrays (the HF / GGUF path): every parameter sharded
  as on a placed model, half of each split one per device, and equal to the saved weights."""
  for source in ("checkpoint", "host arrays"):
    r = report["loading"][source]
    assert r["equal"] and r["specs_as_placed"], (source, r)
    assert r["q_proj_shard_shapes"] == [[32, 32], [32, 32]], (source, r)
  assert report["loading"]["random init"]["close"]


def test_bad_tp_is_refused_in_one_line(report):
  e = report["errors"]
  assert e["too many devices"] == "tp=3 needs 3 devices, but only 2 cpu device(s) are available"
  assert e["kv heads"] == ("tp=2 does not divide the 1 KV heads of the model: tensor parallelism "
                           "gives every device whole KV heads")
  assert e["draft kv heads"].startswith("tp=2 does not divide the 1 KV heads of the draft model")
  assert e["load kv heads"].startswith(
      f"tp=2 does not divide the 1 KV heads of {report['model_1kv']}")


@pytest.mark.parametrize("module, args, line", [
    ("jaxspec.generate", ["--tp=3"],
     "jaxspec.generate: error: tp=3 needs 3 devices, but only 2 cpu device(s) are available"),
    ("jaxspec.generate", ["--tp=0"],
     "jaxspec.generate: error: --tp must be an integer >= 1, got 0"),
    ("jaxspec.generate", ["--tp=2", "MODEL_1KV"],
     "jaxspec.generate: error: tp=2 does not divide the 1 KV heads of MODEL_1KV: tensor "
     "parallelism gives every device whole KV heads"),
    ("benchmarks.throughput", ["--tp=3"], "benchmarks.throughput: error: tp=3 needs 3 devices, "
     "but only 2 cpu device(s) are available"),
])
def test_command_line_tp_errors(report, module, args, line):
  model = report["model_1kv"]
  args = [f"--model={model}" if a == "MODEL_1KV" else a for a in args]
  if module == "jaxspec.generate":
    args.append("--prompt=hi")
  res = run_module(module, *args, env=two_devices_env(), timeout=300)
  assert res.returncode == 1, res.stderr[-3000:]
  assert "Traceback" not in res.stderr, res.stderr[-3000:]
  assert res.stderr.strip().splitlines()[-1] == line.replace("MODEL_1KV", model)


# ------------------------------------------------------------------------------------------------
# The subprocess

def _worker(out_dir: Path) -> None:
  import collections
  import dataclasses
  import re

  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  from jaxspec.engine.runner import Runner
  from jaxspec.engine.vanilla import decode_step
  from jaxspec.io.loading import load_model
  from jaxspec.io.weights import build_model, checkpoint, flat
  from jaxspec.model import sharding
  from jaxspec.drafting.policies import make_policy
  from jaxspec.model.attention import Dense, Prefill
  from jaxspec.model.config import ModelConfig
  from jaxspec.model.kv_cache import KVCache
  from jaxspec.model.transformer import init_random

  assert jax.device_count() == 2, jax.devices()
  # qkv bias and qk-norm both on, so that biases and the per-head norms meet the sharding too;
  # head_dim 16: the smallest the Pallas kernels take.
  cfg = ModelConfig(arch="qwen3", vocab_size=96, hidden_size=32, intermediate_size=64,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=1000.0,
                    qkv_bias=True, qk_norm=True)
  model = init_random(cfg, dtype=jnp.float32, seed=7)
  host = {k: np.asarray(v) for k, v in flat(nnx.to_pure_dict(nnx.state(model))).items()}
  # The draft model: the target without its second layer and with noise on its weights, so that
  # it guesses some tokens right and some wrong.
  draft_cfg = dataclasses.replace(cfg, num_layers=1)
  noise = np.random.default_rng(0)
  draft = build_model(draft_cfg, {k: v + noise.normal(0, 0.01, v.shape).astype(np.float32)
                                  for k, v in host.items() if not k.startswith("layers/1/")},
                      dtype=jnp.float32)
  rng = np.random.default_rng(1)
  prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in PROMPT_LENS]
  settings = dict(gamma=3, sparsity=0.2, min_tokens=4, cache_dtype=jnp.float32)
  report: dict = {"generate": {}, "forward": {}, "loading": {}, "errors": {}, "seconds": {}}
  runners = {}
  clock = [time.perf_counter()]

  def lap(name):   # where the worker's time goes (printed on stderr)
    now = time.perf_counter()
    report["seconds"][name] = round(now - clock[0], 1)
    print(f"{name}: {now - clock[0]:.1f} s", file=sys.stderr, flush=True)
    clock[0] = now

  def generate(name, method, backend, tp, **kw):
    r = Runner(model, method=method, backend=backend, tp=tp,
               draft_model=draft if method == "draft" else None, **settings, **kw)
    tokens, stats = r.generate(prompts, max_new_tokens=MAX_NEW)
    report["generate"][f"{name}/tp{tp}"] = dict(
        tokens=tokens, accepted=stats.extra.get("mean_accepted_tokens"))
    runners[name, tp] = r
    lap(f"generate {name} tp={tp}")

  generate("none", "none", "reference", 1)
  for method in ("none", "vegas", "draft"):
    generate(method, method, "reference", 2)
  generate("vegas-interpret", "vegas", "interpret", 2)
  generate("vegas-tree-interpret", "vegas", "interpret", 2, tree=(2, 2, 1))
  generate("draft-tree", "draft", "reference", 2, tree=(2, 2, 1), tree_order="dfs")

  # Continuous batching: three requests through two slots, the third in a refilled slot (prompts
  # of one length bucket: one prefill to compile).
  served = {}
  runners["none", 2].serve([prompts[0], prompts[2], prompts[0]], 2, MAX_NEW,
                           max_len=max(PROMPT_LENS) + MAX_NEW, chunk=4, warmup_s=0.0,
                           measure_s=1e9,
                           on_finish=lambda req, toks: served.setdefault(req, toks.tolist()))
  report["serve"] = [served.get(i) for i in range(3)]
  lap("serve")

  # One prefill and one verification pass with Collect-2 scores, and the positions vegas selects
  # from each, as the engine runs them (`jaxspec.engine.prefill`, `speculative.verify`).
  tokens = np.zeros((len(prompts), 64), np.int32)
  for i, p in enumerate(prompts):
    tokens[i, :len(p)] = p
  lens = np.asarray(PROMPT_LENS, np.int32)
  drafts = rng.integers(0, cfg.vocab_size, (len(prompts), 4)).astype(np.int32)

  def forward(m, backend):
    policy = make_policy("vegas", ratio=0.2, min_tokens=4, k_max=32, backend=backend,
                         mesh=m.mesh)
    graphdef, params = nnx.split(m)

    def run(params, tokens, lens, drafts):
      m = nnx.merge(graphdef, params)
      b, t = tokens.shape
      cache = KVCache.create(m.cfg, b, 128, jnp.float32, m.mesh)
      positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
      hidden, cache, pre_scores = m(tokens, positions, cache,
                                    Prefill(query_lens=lens, scores=policy.prefill_scores), backend)
      cache = cache.replace(lengths=lens)
      pre = policy.select_kv(cache, pre_scores, lens - 1, jnp.zeros_like(lens))
      _, cache, scores = m(drafts, cache.chain_positions(drafts.shape[1]), cache,
                           Dense(scores=policy.verify_scores), backend)
      plan = policy.select_kv(cache, scores, lens, jnp.zeros_like(lens))
      return dict(logits=m.logits(hidden), prefill_scores=pre_scores, scores=scores,
                  prefill_selection=(pre.indices, pre.counts),
                  selection=(plan.indices, plan.counts))
    out = jax.device_get(jax.jit(run)(params, tokens, lens, drafts))
    return {k: v if k.endswith("selection") else np.asarray(v, np.float32) for k, v in out.items()}

  def selection(indices, counts):
    return [sorted(idx[:c].tolist()) for idx, c in zip(indices.reshape(-1, indices.shape[-1]),
                                                       counts.reshape(-1))]

  def same(a, b):   # bitwise, -inf included
    return bool(np.array_equal(a, b))

  placed = runners["none", 2].model
  one = {backend: forward(model, backend) for backend in ("reference", "interpret")}
  real = np.arange(tokens.shape[1])[None] < lens[:, None]     # not the prompts' padding
  for backend in ("reference", "interpret"):
    two = forward(placed, backend)
    report["forward"][backend] = dict(
        logits_max_abs_diff=float(np.abs(two["logits"] - one["reference"]["logits"])[real].max()),
        logits_scale=float(np.abs(one["reference"]["logits"][real]).max()),
        scores_shape=list(two["scores"].shape),
        scores_equal=same(two["scores"], one[backend]["scores"]),
        prefill_scores_equal=same(two["prefill_scores"], one[backend]["prefill_scores"]),
        selection_equal=selection(*two["selection"]) == selection(*one[backend]["selection"]),
        prefill_selection_equal=(selection(*two["prefill_selection"])
                                 == selection(*one[backend]["prefill_selection"])),
        selected=int(two["selection"][1].sum()))
  lap("forward")

  # Where the parameters and the cache live, and the collectives of one decode step.
  runner = runners["none", 2]
  specs = {k: str(v.sharding.spec) for k, v in flat(nnx.to_pure_dict(nnx.state(placed))).items()}
  state, _, batch = runner.start(prompts, MAX_NEW)
  specs["cache_after_prefill"] = str(state.cache.k[0].sharding.spec)
  state, _ = runner.step(state, 64)   # generate's chunk: compiled already
  specs["cache_after_decoding"] = str(state.cache.k[1].sharding.spec)
  graphdef, params = nnx.split(placed)
  config = runner.config(batch.capacity)
  hlo = jax.jit(lambda p, s: decode_step(nnx.merge(graphdef, p), s, config)).lower(
      params, state).compile().as_text()
  specs["decode_step_collectives"] = dict(collections.Counter(re.findall(
      r"= \S+ (all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(",
      hlo)))
  report["placement"] = specs
  lap("placement")

  # Loading: from an orbax checkpoint, and from host numpy arrays (the HF and GGUF loaders' path).
  ckpt = checkpoint.save(out_dir / "ckpt", cfg, host)
  mesh = sharding.make_mesh(2)

  def check_loaded(m):
    got = flat(nnx.to_pure_dict(nnx.state(m)))
    q = got["layers/0/self_attn/q_proj/kernel"]
    return dict(equal=all(np.array_equal(np.asarray(got[k]), v) for k, v in host.items()),
                specs_as_placed=all(str(got[k].sharding.spec) == specs[k] for k in host),
                q_proj_shard_shapes=[list(s.data.shape) for s in q.addressable_shards])
  report["loading"]["checkpoint"] = check_loaded(load_model(ckpt, dtype=jnp.float32, tp=2).model)
  report["loading"]["host arrays"] = check_loaded(build_model(cfg, host, dtype=jnp.float32,
                                                              mesh=mesh))
  # Drawn under jit, one shard per device: XLA's fused normal sampler rounds differently from
  # the eager one, by an ulp.
  sharded_init = init_random(cfg, dtype=jnp.float32, seed=7, tp=2)
  report["loading"]["random init"] = dict(close=all(
      np.allclose(np.asarray(v), host[k], rtol=1e-6, atol=1e-8)
      for k, v in flat(nnx.to_pure_dict(nnx.state(sharded_init))).items()))
  lap("loading")

  # Bad input.
  def error(fn):
    try:
      fn()
    except ValueError as e:
      return str(e)
    return None
  one_kv = dataclasses.replace(cfg, num_kv_heads=1)
  one_kv_model = init_random(one_kv, dtype=jnp.float32, seed=1)
  report["errors"]["too many devices"] = error(lambda: Runner(model, tp=3))
  report["errors"]["kv heads"] = error(lambda: Runner(one_kv_model, tp=2))
  report["errors"]["draft kv heads"] = error(lambda: Runner(
      model, method="draft", tp=2, draft_model=init_random(dataclasses.replace(
          draft_cfg, num_kv_heads=1), dtype=jnp.float32)))
  # A HF model directory: its config is read, and refused, before any weight file is opened.
  hf_1kv = out_dir / "hf_1kv"
  hf_1kv.mkdir()
  (hf_1kv / "config.json").write_text(json.dumps(dict(
      model_type="qwen3", vocab_size=96, hidden_size=32, intermediate_size=64,
      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=16)))
  report["model_1kv"] = str(hf_1kv)
  report["errors"]["load kv heads"] = error(lambda: load_model(hf_1kv, tp=2))

  lap("errors")
  (out_dir / "report.json").write_text(json.dumps(report))


if __name__ == "__main__":
  _worker(Path(sys.argv[1]))
