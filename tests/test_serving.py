"""Continuous batching (`Runner.serve`, behind the throughput benchmarks): a request served in a slot that
was refilled mid-stream must get exactly the tokens it gets when generated alone (greedy)."""
import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.engine.runner import Runner, generate
from jaxspec.model.config import ModelConfig
from jaxspec.model.transformer import init_random
from jaxspec.engine.sampling import SamplingParams

CFG = ModelConfig(arch="qwen3", vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=1000.0)
PROMPT_LENS = (5, 40, 17, 3, 28, 11, 33)
MAX_NEW = 10


@pytest.fixture(scope="module")
def model():
  return init_random(CFG, dtype=jnp.float32, seed=7)


@pytest.fixture(scope="module")
def prompts():
  rng = np.random.default_rng(1)
  return [rng.integers(0, CFG.vocab_size, n).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def alone(model, prompts):
  """Each request's greedy tokens when generated alone, computed once for every test here (each
  prompt length compiles its own prefill)."""
  capacity_len = max(PROMPT_LENS) + MAX_NEW
  return [generate(model, [p], max_new_tokens=MAX_NEW, max_len=capacity_len)[0][0]
          for p in prompts]


@pytest.fixture(scope="module")
def draft_model():
  return init_random(dataclasses.replace(CFG, num_layers=1, hidden_size=16, head_dim=4),
                     dtype=jnp.float32, seed=8)


@pytest.mark.parametrize("method, gamma, batch", [("none", 1, 3), ("vegas", 3, 3),
                                                  ("streaming", 2, 2), ("vegas", 2, 1),
                                                  ("draft", 2, 3)])
def test_every_request_gets_its_own_tokens(model, draft_model, prompts, alone, method, gamma,
                                           batch):
  capacity_len = max(PROMPT_LENS) + MAX_NEW
  runner = Runner(model, method=method, gamma=gamma, sampling=SamplingParams(), sparsity=0.2,
                  min_tokens=4, backend="reference",
                  draft_model=draft_model if method == "draft" else None)
  got = {}

  def on_finish(req, tokens):
    assert req not in got, f"request {req} reported twice"
    got[req] = tokens.tolist()

  # 7 requests through fewer slots: most are served in refilled slots. No time limit: the stream
  # runs until every request is done.
  row, _ = runner.serve(prompts, batch, MAX_NEW, max_len=capacity_len, chunk=2, warmup_s=0.0,
                        measure_s=1e9, on_finish=on_finish)
  assert sorted(got) == list(range(len(prompts)))
  for i, p in enumerate(prompts):
    assert got[i] == alone[i], f"request {i} (prompt of {len(p)} tokens)"
  assert row["tokens"] > 0 and row["tokens_per_s"] > 0
  # Refills counted in the window (the first chunk is not): at most one a request past the batch.
  assert 0 < row["refills"] <= len(prompts) - batch and row["ms_per_refill"] > 0


def _falling_planner():
  """(chain, tree, a planner whose profile's inflated expectation for the chain makes it fall to
  the (2, 1) tree after two rounds)."""
  from jaxspec.engine.planner import (Bucket, Expectation, Planner, Profile, Refinement,
                                      Strategy)
  chain, tree = Strategy("vegas", 2, 0.2), Strategy("vegas-all", 2, 0.3, tree=(2, 1))
  profile = Profile({s.key: s for s in (chain, tree)}, (Bucket(4096, 3, (
      (chain.key, Expectation(50.0, 1.0)), (tree.key, Expectation(1.0, 0.1)))),))
  return chain, tree, Planner(profile, refinement=Refinement(warmup_rounds=2, patience=1))


def test_planned_serving_gives_every_request_its_own_tokens(model, prompts, alone):
  """serve with a planner: the profile's inflated expectation for the chain forces a fall to a
  (2, 1) tree mid-stream, the state switched at a chunk boundary and later refills prefilled
  with the chain and switched to the tree; every request still gets exactly its greedy tokens."""
  chain, tree, planner = _falling_planner()
  runner = Runner(model, min_tokens=4, backend="reference", planner=planner)
  got = {}
  row, _ = runner.serve(prompts, 3, MAX_NEW, max_len=max(PROMPT_LENS) + MAX_NEW, chunk=2,
                        warmup_s=0.0, measure_s=1e9,
                        on_finish=lambda req, tokens: got.setdefault(req, tokens.tolist()))
  assert [got[i] for i in range(len(prompts))] == alone
  assert [(e["from"], e["to"], e["reason"]) for e in row["plan_switches"]] == [
      (chain.key, tree.key, "fall")]
  assert row["method"] == "plan" and row["plan_strategies"][tree.key]["verify_rounds"] > 0


def test_precompile_leaves_no_switch_to_compile(model, prompts):
  """After `precompile` every switch between the planner's strategies, in either direction, and
  every strategy's chunk are cache hits (0 s compiling), though only the first strategy ran."""
  chain, tree, planner = _falling_planner()
  runner = Runner(model, min_tokens=4, backend="reference", planner=planner)
  state, _, _ = runner.start(prompts[:3], MAX_NEW, max_len=max(PROMPT_LENS) + MAX_NEW,
                             strategy=chain)
  assert runner.precompile(state, chain, 2) > 0
  for strategy in (tree, chain, tree):
    state, switching = runner.switch(state, strategy)
    state, stepping = runner.step(state, 2, strategy)
    assert (switching, stepping) == (0.0, 0.0), strategy.key
  assert runner.precompile(state, tree, 2) == 0.0     # everything cached already
  with pytest.raises(ValueError, match="needs a runner with a planner"):
    Runner(model, method="vegas", gamma=2, min_tokens=4, backend="reference").precompile(
        state, tree, 2)


def test_planned_window_leaves_its_compiles_out(model, prompts, monkeypatch):
  """What compiles inside the window (here a whole strategy: precompiling is switched off, as
  for a prompt length first seen there) is left out; the window still serves measure_s seconds
  besides that compile (closed on wall time instead, a compile longer than the window would
  leave it nearly empty)."""
  monkeypatch.setattr(Runner, "precompile", lambda self, state, strategy, steps: 0.0)
  runner = Runner(model, min_tokens=4, backend="reference", planner=_falling_planner()[2])
  measure_s = 0.5
  row, _ = runner.serve(prompts * 40, 3, MAX_NEW, max_len=max(PROMPT_LENS) + MAX_NEW, chunk=2,
                        warmup_s=0.0, measure_s=measure_s)
  assert row["plan_switches"] and row["plan_compile_s"] > measure_s
  assert row["measured_s"] >= measure_s


def test_stagger_spreads_the_first_requests(model, prompts, alone):
  """stagger: the first B requests stop at max_new * (i + 1) / B tokens (their greedy tokens are a
  prefix of the request's alone), later ones at max_new."""
  capacity_len = max(PROMPT_LENS) + MAX_NEW
  runner = Runner(model, method="vegas", gamma=2, sparsity=0.2, min_tokens=4, backend="reference")
  got = {}
  runner.serve(prompts, 3, MAX_NEW, max_len=capacity_len, chunk=2, warmup_s=0.0, measure_s=1e9,
               stagger=True, on_finish=lambda req, tokens: got.setdefault(req, tokens.tolist()))
  assert sorted(got) == list(range(len(prompts)))
  assert [len(got[i]) for i in range(len(prompts))] == [3, 6, 10, 10, 10, 10, 10]
  for i in range(len(prompts)):
    assert got[i] == alone[i][:len(got[i])], f"request {i}"


def test_kernel_times_counts_only_gpu_stream_lines():
  from benchmarks.common import kernel_times
  meta = lambda pid, tid, kind, name: dict(ph="M", pid=pid, tid=tid, name=kind, args=dict(name=name))
  events = [meta(1, None, "process_name", "/host:CPU"), meta(1, 5, "thread_name", "python"),
            meta(2, None, "process_name", "/device:GPU:0"),
            meta(2, 7, "thread_name", "Stream #14(Compute)"), meta(2, 8, "thread_name", "XLA Ops")]
  x = lambda pid, tid, name, dur: dict(ph="X", pid=pid, tid=tid, name=name, ts=0.0, dur=dur)
  events += [x(2, 7, "gemm", 10.0), x(2, 7, "gemm", 5.0), x(2, 7, "sort", 30.0),
             x(2, 8, "gemm", 99.0), x(1, 5, "PjitFunction", 500.0)]
  t = kernel_times(events)
  assert t["device_us"] == 45.0
  assert t["kernels"] == [dict(name="sort", us=30.0, calls=1), dict(name="gemm", us=15.0, calls=2)]
  assert t["lines"] == ["Stream #14(Compute)", "XLA Ops"]


def test_kernel_families_sort_every_kernel_into_one_family():
  from benchmarks.common import kernel_families
  kernels = [dict(name="verify_attention_t7_g6_d128_scores_sum", us=100.0, calls=28),
             dict(name="sparse_attention_t1_g6_d128", us=50.0, calls=168),
             dict(name="topk_select_d4", us=4.0, calls=1),
             dict(name="gemm_fusion_dot_901", us=20.0, calls=168),
             dict(name="nvjet_sm90_tss_96x64_64x8_2x1_v_bz_NNN", us=10.0, calls=168),
             dict(name="void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>",
                  us=2.0, calls=168),
             dict(name="sort_14_1", us=1.5, calls=5),
             dict(name="loop_add_fusion_85", us=3.0, calls=168),
             dict(name="memcpy32_post", us=0.5, calls=12)]
  got = kernel_families(kernels)
  assert got == {"dense attention": 100.0, "sparse attention": 50.0, "top-k selection": 4.0,
                 "GEMMs": 32.0, "sorts": 1.5, "other": 3.5}
  assert kernel_families([]) == dict.fromkeys(got, 0.0)


def test_throughput_scale_trace_reports_family_shares(monkeypatch, capsys):
  """--trace: the chunk's kernel table, its families and their shares of the GPU time."""
  from absl import flags
  from absl.testing import flagsaver
  from benchmarks import throughput
  from jaxspec.engine.sampling import SamplingParams
  from jaxspec.model.config import ModelConfig
  from jaxspec.model.transformer import init_random
  flags.FLAGS.mark_as_parsed()
  table = dict(device_us=200.0, wall_us=210.0, lines=["Stream #14(Compute)"],
               kernels=[dict(name="verify_attention_t1_g2_d16", us=150.0, calls=4),
                        dict(name="gemm_fusion_dot_3", us=40.0, calls=8),
                        dict(name="loop_add_fusion", us=10.0, calls=8)])
  monkeypatch.setattr(throughput, "kernel_table", lambda fn, top: dict(table))
  cfg = ModelConfig(arch="qwen3", vocab_size=96, hidden_size=64, intermediate_size=128,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
  with flagsaver.flagsaver(trace=True, profile=False):
    row, = throughput.scale_run(init_random(cfg, dtype=jnp.bfloat16), None, ["none"], 2, 64,
                                SamplingParams(), "reference")
  assert row["compile_s"] > 0                         # the chunk compiled in this call
  assert row["trace"]["families_us"]["dense attention"] == 150.0
  assert row["trace"]["families_us"]["GEMMs"] == 40.0
  assert row["trace"]["family_shares"] == {
      "dense attention": 0.75, "sparse attention": 0.0, "top-k selection": 0.0, "GEMMs": 0.2,
      "sorts": 0.0, "other": 0.05}
  assert "dense attention 75.0%, sparse attention 0.0%" in capsys.readouterr().err


def test_throughput_fp8_drafts_apply_to_speculative_entries_only():
  """--fp8_drafts: a speculative entry's runner drafts with FP8 MLP copies (added to the model);
  vanilla's entry in the same run takes none rather than failing."""
  from absl import flags
  from absl.testing import flagsaver
  from benchmarks import throughput
  from jaxspec.engine.sampling import SamplingParams
  from jaxspec.model import fp8
  from jaxspec.model.config import ModelConfig
  from jaxspec.model.transformer import init_random
  flags.FLAGS.mark_as_parsed()
  cfg = ModelConfig(arch="qwen3", vocab_size=96, hidden_size=64, intermediate_size=128,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
  model = init_random(cfg, dtype=jnp.bfloat16)
  with flagsaver.flagsaver(fp8_drafts=True):
    vanilla = throughput.make_runner(model, None, "none", SamplingParams(), (), "reference")
    assert not vanilla.fp8_drafts and not fp8.has_fp8_mlps(model)
    vegas = throughput.make_runner(model, None, "vegas:3", SamplingParams(), (), "reference")
    assert vegas.fp8_drafts and vegas.config(64).fp8_drafts and fp8.has_fp8_mlps(model)


def test_throughput_method_entries():
  """--methods entries: method, method@ratio, method:gamma, method@ratio:gamma; the rest from
  --sparsity and --gammas (entry, then method, then default)."""
  from absl import flags
  from absl.testing import flagsaver
  from benchmarks import throughput
  flags.FLAGS.mark_as_parsed()
  with flagsaver.flagsaver(gammas=["vegas=6", "default=4"], sparsity=0.07):
    assert throughput.parse_entry("none") == ("none", 0.07, 4)
    assert throughput.parse_entry("vegas") == ("vegas", 0.07, 6)
    assert throughput.parse_entry("vegas@0.12") == ("vegas", 0.12, 6)
    assert throughput.parse_entry("streaming:8") == ("streaming", 0.07, 8)
    assert throughput.parse_entry("vegas@0.04:3") == ("vegas", 0.04, 3)
    assert throughput.parse_entry("vegas@0.04/2.2.1") == ("vegas", 0.04, 3)
    assert throughput.entry_tree("draft:4/3.1") == ("draft:4", (3, 1))
    assert throughput.entry_tree("streaming:4") == ("streaming:4", None)
  with flagsaver.flagsaver(gammas=["default=4"], top_p_attn=0.97):   # specattn@p: the kept mass
    assert throughput.parse_entry("specattn") == ("specattn", 0.97, 4)
    assert throughput.parse_entry("specattn@0.95:6") == ("specattn", 0.95, 6)
  with flagsaver.flagsaver(gammas=["default=4"], sts_budget=256):   # sts@k: the budget
    assert throughput.parse_entry("sts") == ("sts", 256, 4)
    assert throughput.parse_entry("sts@64:3") == ("sts", 64, 3)
  with flagsaver.flagsaver(tree=["2", "1"]):
    assert throughput.entry_tree("vegas") == ("vegas", (2, 1))
    assert throughput.entry_tree("vegas/3") == ("vegas", (3,))
    assert throughput.entry_tree("none") == ("none", None)
  # --chunk_rounds: a bare N for every method, or per entry, then method, then default.
  with flagsaver.flagsaver(chunk_rounds=["8"]):
    assert throughput.chunk_rounds("none") == throughput.chunk_rounds("vegas:6") == 8
  with flagsaver.flagsaver(chunk_rounds=["none=32", "vegas:8=4", "default=16"]):
    assert throughput.chunk_rounds("none") == 32
    assert throughput.chunk_rounds("vegas:8") == 4
    assert throughput.chunk_rounds("vegas@0.05:6") == 16
  for bad in (["none=x"], ["0"]):
    with flagsaver.flagsaver(chunk_rounds=bad), pytest.raises(ValueError, match="--chunk_rounds"):
      throughput.chunk_rounds("none")


def test_insert_slot_refuses_a_batch_one_state():
  """At batch 1 no leaf shows where the batch axis is: a clear error, not a silent no-op."""
  from jaxspec.engine.batching import insert_slot
  one = {"tokens": jnp.zeros((1, 4), jnp.int32), "key": jnp.zeros((2,), jnp.uint32)}
  with pytest.raises(ValueError, match="batch > 1"):
    insert_slot(one, {"tokens": jnp.ones((1, 4), jnp.int32), "key": jnp.ones((2,), jnp.uint32)},
                jnp.int32(0))
  big = {"tokens": jnp.zeros((3, 4), jnp.int32), "key": jnp.zeros((2,), jnp.uint32)}
  out = insert_slot(big, {"tokens": jnp.ones((1, 4), jnp.int32), "key": jnp.ones((2,), jnp.uint32)},
                    jnp.int32(1))
  np.testing.assert_array_equal(out["tokens"].sum(axis=1), [0, 4, 0])
  np.testing.assert_array_equal(out["key"], [0, 0])            # no batch axis: the big state's


def test_throughput_scale_run_of_specattn_and_sts():
  """The scale workload builds SpecAttn's and STS's starting states by hand (their plans' lengths
  a copy: the loop donates the state) and times their rounds."""
  from absl import flags
  from absl.testing import flagsaver
  from benchmarks import throughput
  from jaxspec.engine.sampling import SamplingParams
  from jaxspec.model.config import ModelConfig
  from jaxspec.model.transformer import init_random
  flags.FLAGS.mark_as_parsed()
  cfg = lambda n: ModelConfig(arch="qwen3", vocab_size=96, hidden_size=64, intermediate_size=128,
                              num_layers=n, num_heads=4, num_kv_heads=2, head_dim=16)
  target = init_random(cfg(4), dtype=jnp.bfloat16)
  draft = init_random(cfg(2), dtype=jnp.bfloat16, seed=1)
  with flagsaver.flagsaver(gammas=["default=2"], profile=False, attn_cap=24):
    rows = throughput.scale_run(target, draft, ["specattn@0.9", "sts@16"], 2, 100,
                                SamplingParams(), "reference")
    runner = throughput.make_runner(target, draft, "specattn@0.9", SamplingParams(), (),
                                    "reference")
  assert runner.specattn.cap == 24 and runner.specattn.k_max(100) == 24
  assert all("error" not in row for row in rows), rows
  assert rows[0]["sparsity"] == 0.9 and rows[0]["ms_per_round"] > 0
  assert rows[1]["sparsity"] == 16 and rows[1]["ms_per_round"] > 0
  assert not any("phases" in row for row in rows)   # --noprofile: no phase timers compiled
