"""SSV through the engine (`jaxspec.ssv`, method 'ssv'), NSA targets with draft trees, the
refresh/reuse calibration tool, and the flags of the command-line tools, on a tiny random NSA
model (CPU, float32)."""
import dataclasses
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxspec import ssv
from jaxspec.engine.runner import Runner
from jaxspec.model.config import ModelConfig, NSAConfig
from jaxspec.model.transformer import init_random
from jaxspec.ssv_calibrate import calibrate

# Selection blocks of 8 tokens, 4 selected (initial, 2 local, and one by importance once a row is
# past 24 tokens), a window of 8: the prompts of 27 and 40 tokens are sparse in every branch.
NSA_CFG = NSAConfig(compress_block=4, compress_stride=2, select_block=8, num_selected=4, window=8)
# Two layers: a reuse layer needs the refresh layer 0 before it.
CFG = ModelConfig(arch="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=1000.0,
                  tie_word_embeddings=True, nsa=NSA_CFG)
NEW = 24
SETTINGS = dict(cache_dtype=jnp.float32, stop_ids=())


def _scaled(model, factor):
  """The matrices x factor: init_random's 0.02 leaves a tied-embedding model repeating its input
  token; larger weights make the attention, and so NSA's selection, decide the next token."""
  state = nnx.state(model, nnx.Param)
  nnx.update(model, jax.tree.map(lambda x: x * factor if x.ndim == 2 else x, state))
  return model


def _dense_copy(target):
  """A dense model holding the target's weights but its NSA ones: it agrees with the target on
  some drafts, so accepted paths of every depth get compacted."""
  model = init_random(dataclasses.replace(target.cfg, nsa=None), dtype=jnp.float32, seed=1)
  ours = nnx.to_pure_dict(nnx.state(model))

  def fill(dst, src):
    for k in dst:
      if isinstance(dst[k], dict):
        fill(dst[k], src[k])
      else:
        dst[k] = src[k]
  fill(ours, nnx.to_pure_dict(nnx.state(target)))
  state = nnx.state(model)
  nnx.replace_by_pure_dict(state, ours)
  nnx.update(model, state)
  return model


@pytest.fixture(scope="module")
def target():
  return _scaled(init_random(CFG, dtype=jnp.float32, seed=0), 20.0)


@pytest.fixture(scope="module")
def draft(target):
  return _dense_copy(target)


# Every speculative run below drafts 2 deep (a chain of 2, trees of widths (2, 1)) into caches of
# one size: their prefills are one program, compiled once (the persistent compilation cache that
# tests/conftest.py sets up), and each test compiles only its own decode loop.


@pytest.fixture(scope="module")
def prompts():
  rng = np.random.default_rng(0)
  return [rng.integers(0, CFG.vocab_size, n).tolist() for n in (27, 40)]


@pytest.fixture(scope="module")
def plain(target, prompts):
  """The NSA model's own greedy decoding, one token a step."""
  out, _ = Runner(target, **SETTINGS).generate(prompts, max_new_tokens=NEW)
  assert len(set(out[0])) > 5      # the model does not just repeat a token
  return out


def test_strict_ssv_chain_equals_plain_greedy(target, draft, prompts, plain):
  runner = Runner(target, method="ssv", draft_model=draft, gamma=2, ssv_group=2, **SETTINGS)
  out, stats = runner.generate(prompts, max_new_tokens=NEW)
  assert out == plain
  assert stats.extra["ssv_class"] == "strict" and stats.extra["ssv_group"] == 2
  assert stats.extra["acceptance_by_position"][0] > 0     # drafts were accepted, not only fixed


@pytest.mark.parametrize("method, group", [("draft", None), ("ssv", 1)])
def test_nsa_target_with_a_draft_tree_equals_plain_greedy(target, draft, prompts, plain, method,
                                                          group):
  """A tree of widths (2, 1): accepted paths of depth 1 and 2 are compacted, their compression
  blocks written again (`Transformer.recompress`); then decoding goes on as if the path had been
  decoded a token at a time. 'draft' verifies with plain NSA; strict SSV with G = 1 is that very
  plan, and compiles to the same program (the second case runs from the compilation cache); G = 2
  runs over the chain above, and under approx_reuse over this tree below."""
  runner = Runner(target, method=method, draft_model=draft, tree=(2, 1), ssv_group=group,
                  **SETTINGS)
  out, stats = runner.generate(prompts, max_new_tokens=NEW)
  assert out == plain
  assert min(stats.extra["acceptance_by_position"]) > 0   # some rounds accepted 2 deep


def test_reuse_and_approx_run_through_the_engine(target, draft, prompts):
  """approx_reuse (both approximations) over a draft tree: it runs, and its tokens are tokens.
  The verifier is not the NSA model (layer 1 reuses layer 0's blocks, each pair of rows shares
  one selection), so its output may part from the NSA model's greedy decoding."""
  runner = Runner(target, method="ssv", draft_model=draft, tree=(2, 1),
                  ssv_class="approx_reuse", ssv_group=2, refresh=(True, False), **SETTINGS)
  assert runner.config(128).ssv.plan().refresh == (True, False)
  out, stats = runner.generate(prompts, max_new_tokens=NEW)
  assert [len(x) for x in out] == [NEW, NEW]
  assert all(0 <= t < CFG.vocab_size for x in out for t in x)
  assert stats.extra["ssv_class"] == "approx_reuse" and stats.extra["mean_accepted_tokens"] >= 1
  # Without a draft model the NSA model drafts for itself (a chain: its drafts are exact NSA).
  assert Runner(target, method="ssv", ssv_class="approx").draft_model is target


def test_planned_strict_ssv_equals_plain_greedy(target, draft, prompts, plain):
  """A planner over two strict SSV strategies (a chain of 2 in merged groups of 2, a (2, 1) tree
  row by row): `benchmarks.plan_profile` measures both; planned generation switches mid-way (its
  inflated expectation for the chain forces the fall) and the output stays the NSA model's greedy
  decoding; a planner that mixes SSV with self-drafting strategies is refused, and so is a tree
  strategy drafted by an NSA model."""
  from benchmarks.plan_profile import profile as profile_strategies
  from jaxspec.engine.planner import (Bucket, Expectation, Planner, Profile, Refinement,
                                      Strategy, parse_strategy)
  chain, tree = parse_strategy("ssv:2@strict.2"), parse_strategy("ssv:t2.1@strict.1")
  profile = Profile({s.key: s for s in (chain, tree)}, (Bucket(128, 2, (
      (chain.key, Expectation(50.0, 1.0)), (tree.key, Expectation(1.0, 0.1)))),))
  planner = Planner(profile, refinement=Refinement(warmup_rounds=2, patience=1, max_switches=2))
  runner = Runner(target, planner=planner, draft_model=draft, **SETTINGS)
  measured = profile_strategies(runner, [chain, tree], [max(map(len, prompts)) + NEW],
                                [len(prompts)], lambda b, n: prompts, chunk=2, warmup_chunks=0,
                                chunks=1)
  for (key, e), s in zip(measured.buckets[0].entries, (chain, tree)):
    assert key == s.key and 1 <= e.accepted <= s.gamma + 1 and e.round_s > 0
  out, stats = runner.generate(prompts, max_new_tokens=NEW, chunk=2)
  assert out == plain
  assert [(e["from"], e["to"]) for e in stats.extra["plan_switches"]] == [(chain.key, tree.key)]
  assert set(stats.extra["plan_strategies"]) == {chain.key, tree.key}
  mixed = Profile({s.key: s for s in (chain, Strategy("vegas", 2, 0.2))}, (Bucket(128, 2, (
      (chain.key, Expectation(2.0, 1.0)), ("vegas/g2/r0.2", Expectation(2.0, 1.0)))),))
  with pytest.raises(ValueError, match="not both"):
    Runner(target, planner=Planner(mixed), draft_model=draft, **SETTINGS)
  with pytest.raises(ValueError, match="drafts chains only"):   # self-drafting: NSA drafts
    Runner(target, planner=planner, **SETTINGS)


def test_method_settings_refused_in_one_line(target, draft):
  cases = [
      (dict(model=draft, method="ssv"), "dense attention"),
      (dict(method="vegas"), "NSA models run method 'none', 'draft' or 'ssv'"),
      (dict(method="sts", draft_model=draft, sts_budget=8), "NSA models run method"),
      (dict(method="ssv", tree=(2, 1)), "an NSA draft model drafts chains only"),
      (dict(method="ssv", draft_model=draft, ssv_class="fast"), "ssv_class must be one of"),
      (dict(method="ssv", draft_model=draft, ssv_group=0), "ssv_group must be a positive"),
      (dict(method="ssv", ssv_class="reuse"), "needs a refresh/reuse schedule"),
      (dict(method="ssv", refresh=(True, False)), "is for ssv_class 'reuse' or 'approx_reuse'"),
      (dict(method="ssv", ssv_class="reuse", refresh=(False, True)), "layer 0 must be a refresh"),
      (dict(method="ssv", ssv_class="reuse", refresh=(True,)), "one bool per layer"),
      (dict(method="draft", draft_model=draft, ssv_group=2), "settings of method 'ssv'"),
  ]
  for kwargs, match in cases:
    model = kwargs.pop("model", target)
    with pytest.raises(ValueError, match=match) as e:
      Runner(model, **kwargs)
    assert "\n" not in str(e.value)


# ----------------------------------------------------------------------------------------------
# The refresh/reuse calibration

def test_calibration_writes_a_schedule_the_runner_loads(target, tmp_path):
  windows = np.random.default_rng(3).integers(0, CFG.vocab_size, (1, 48))
  refresh, steps = calibrate(target, windows, reuse_layers=1, progress=False)
  assert refresh == (True, False) and [s["layer"] for s in steps] == [1]
  assert 0 < steps[0]["kl"] < np.inf
  # A tolerance below that KL keeps every layer refreshing (the same compiled passes).
  assert calibrate(target, windows, tolerance=steps[0]["kl"] / 2, progress=False) == (
      (True, True), [])
  path = ssv.save_schedule(ssv.schedule_record(target, refresh, steps=steps),
                           ssv.default_schedule_path(tmp_path))
  assert path == tmp_path / "ssv_schedule.json"
  loaded = ssv.load_schedule(path, target)
  assert loaded == (True, False)
  runner = Runner(target, method="ssv", ssv_class="reuse", refresh=loaded, gamma=2)
  assert runner.config(128).ssv.plan().refresh == (True, False)

  other = init_random(CFG, dtype=jnp.float32, seed=5)
  with pytest.raises(ValueError, match="calibrated on another model"):
    ssv.load_schedule(path, other)
  record = json.loads(path.read_text())
  for bad, match in [(dict(record, refresh=[False, True]), "layer 0 must be a refresh"),
                     (dict(record, kind="map"), "cannot read the SSV schedule"),
                     ("{", "cannot read the SSV schedule")]:
    path.write_text(bad if isinstance(bad, str) else json.dumps(bad))
    with pytest.raises(ValueError, match=match) as e:
      ssv.load_schedule(path, target)
    assert "\n" not in str(e.value)


def test_calibration_through_the_kernels_matches_the_reference(target):
  """On a GPU the calibration runs the NSA kernels (the backend the engine serves with); here
  they run in interpret mode and must give the reference's KL up to float32 rounding."""
  windows = np.random.default_rng(3).integers(0, CFG.vocab_size, (1, 48))
  refresh, steps = calibrate(target, windows, reuse_layers=1, progress=False)
  kernels = calibrate(target, windows, reuse_layers=1, progress=False, backend="interpret")
  assert kernels[0] == refresh
  assert kernels[1][0]["kl"] == pytest.approx(steps[0]["kl"], rel=1e-5)
  with pytest.raises(ValueError, match="attention backend must be one of"):
    calibrate(target, windows, reuse_layers=1, progress=False, backend="cuda")


def test_calibrate_tool_writes_the_schedule_beside_the_model(target, tmp_path, monkeypatch,
                                                             capsys):
  """`python -m jaxspec.ssv_calibrate`'s main on a loaded model (a stand-in loader and tokenizer:
  no NSA checkpoint or tokenizer exists here), one window of the same shape as above, so the
  passes it compiles are those of the test before."""
  import types
  from jaxspec import ssv_calibrate
  from jaxspec.io import loading

  class Tokenizer:
    def encode(self, text, add_special_tokens=True):
      return [b % CFG.vocab_size for b in text.encode()]

  text = tmp_path / "text.txt"
  text.write_text("calibration text, long enough for one window of forty-eight tokens.")
  monkeypatch.setattr(loading, "load_model", lambda spec, dtype: loading.LoadedModel(
      cfg=target.cfg, model=target, tokenizer=Tokenizer(), source=tmp_path))
  values = dict(model="nsa", text=str(text), windows=1, window_tokens=48, reuse_layers=1,
                tolerance=None, out=None, dtype="float32", resume=None)
  ssv_calibrate.main([], {k: types.SimpleNamespace(value=v) for k, v in values.items()})
  path = tmp_path / "ssv_schedule.json"
  err = capsys.readouterr().err
  assert "1 reuse layers [1]" in err
  assert ssv.load_schedule(path, target) == (True, False)
  record = json.loads(path.read_text())
  assert record["name"] == "nsa" and record["steps"][0]["layer"] == 1 and record["windows"] == 1
  # The step's log line names the --resume value; resuming from it takes the step as given.
  value = err.split("--resume=")[1].split()[0]
  assert ssv_calibrate.parse_resume(value) == record["steps"]
  values.update(resume=value, out=str(tmp_path / "resumed.json"))
  ssv_calibrate.main([], {k: types.SimpleNamespace(value=v) for k, v in values.items()})
  assert json.loads((tmp_path / "resumed.json").read_text())["steps"] == record["steps"]


def test_calibration_refuses_bad_input(target, draft):
  dense = draft
  windows = np.zeros((1, 16), np.int32)
  for model, kwargs, match in [
      (dense, dict(reuse_layers=1), "dense attention"),
      (target, {}, "give --reuse_layers"),
      (target, dict(reuse_layers=2), "at most 1 reuse layers"),
      (target, dict(reuse_layers=-1), "--reuse_layers must be an integer >= 0"),
      (target, dict(tolerance=-1.0), "--tolerance must be a finite KL"),
      (target, dict(reuse_layers=1, resume=[dict(layer=0, kl=0.1)]), "distinct layers 1..1"),
      (target, dict(reuse_layers=0, resume=[dict(layer=1, kl=0.1)]), "more than the 0 reuse"),
  ]:
    with pytest.raises(ValueError, match=match) as e:
      calibrate(model, windows, progress=False, **kwargs)
    assert "\n" not in str(e.value)


# ----------------------------------------------------------------------------------------------
# The command-line tools

def test_throughput_ssv_entries():
  from absl import flags
  from absl.testing import flagsaver
  from benchmarks import throughput
  flags.FLAGS.mark_as_parsed()
  with flagsaver.flagsaver(gammas=["default=4"], ssv_class="strict", ssv_group=1):
    assert throughput.parse_entry("ssv") == ("ssv", flags.FLAGS.sparsity, 4)
    assert throughput.parse_entry("ssv@approx.2:3") == ("ssv", flags.FLAGS.sparsity, 3)
    assert throughput.ssv_entry("ssv") == ("strict", 1)
    assert throughput.ssv_entry("ssv@approx_reuse.2:3/2.1") == ("approx_reuse", 2)
    assert throughput.entry_tree("ssv@reuse.2/2.1") == ("ssv@reuse.2", (2, 1))
    for entry, match in [("ssv@fast", "the SSV class must be one of"),
                         ("ssv@approx.x", "ssv@class.G with G a positive integer"),
                         ("ssv@approx.0", "ssv@class.G with G a positive integer")]:
      with pytest.raises(ValueError, match=match):
        throughput.ssv_entry(entry)


def _run(module, *args):
  return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                        timeout=300)


def test_generate_refuses_ssv_on_a_dense_model(draft, tmp_path):
  """A dense checkpoint with --method=ssv: one line."""
  from jaxspec.io.weights import checkpoint, flat
  ckpt = checkpoint.save(tmp_path / "dense", draft.cfg,
                         flat(jax.device_get(nnx.to_pure_dict(nnx.state(draft)))))
  res = _run("jaxspec.generate", f"--model={ckpt}", "--method=ssv", "--prompt=hi")
  assert res.returncode == 1
  assert res.stderr.strip().splitlines() == [
      f"jaxspec.generate: error: --method=ssv verifies a Native Sparse Attention model; {ckpt} "
      "has dense attention"]


def test_calibrate_tool_refuses_bad_flags():
  res = _run("jaxspec.ssv_calibrate", "--model=whatever", "--reuse_layers=-2")
  assert res.returncode == 1
  assert res.stderr.strip().splitlines() == [
      "jaxspec.ssv_calibrate: error: --reuse_layers must be an integer >= 0, got -2"]
  from jaxspec.ssv_calibrate import parse_resume
  with pytest.raises(ValueError, match="--resume must be LAYER:KL") as e:
    parse_resume("7:0.1,seven")
  assert "\n" not in str(e.value)
