"""The HF transformers peer benchmark (`benchmarks.peer_hf`) on the real SmolLM2-135M GGUF, on the
CPU in float32: both frameworks' decode rows and batch-1 runs, the JSON's rows and ratios, and a
cross-check of jaxspec against transformers (the same GGUF read by each framework's own reader;
greedy decoding in float32 must agree token for token)."""
import json

import pytest
import torch

from benchmarks import peer_hf
from benchmarks.common import write_json

from subproc import run_module

SPEC_METHODS = ("hf:static", "hf:dynamic", "hf:prompt_lookup", "hf:assisted", "jaxspec:none")


@pytest.fixture(scope="module")
def torch_one_thread():
  # On a shared 2-core machine torch's intra-op threads spin against the other jobs' (one
  # SmolLM2 step took 1.3-3.5 s with 2 threads against 0.2 s with 1).
  threads = torch.get_num_threads()
  torch.set_num_threads(1)
  yield
  torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def smollm2_side(weights_smollm2_gguf, torch_one_thread):
  """SmolLM2 as both frameworks hold it (float32, CPU), loaded once: transformers' GGUF reader
  takes half a minute. `payload`'s run drops HF's copy, so the test that reads it comes first."""
  return peer_hf.load_side(str(weights_smollm2_gguf), peer_hf.Settings(device="cpu",
                                                                      dtype="float32"))


def test_hf_decode_windows_run_past_the_models_own_eos(smollm2_side):
  """`generate` fills a None `eos_token_id` from the model's generation config: a greedy token
  that is the model's EOS must not end a timed window (on the GPU a 4K random prompt's second
  token was Qwen's <|im_end|>, and the row failed)."""
  settings = peer_hf.Settings(batch_sizes=(1,), contexts=(16,), steps=3, reps=1, warmup=0,
                              prefill_tokens=16, device="cpu", compile=False, dtype="float32")
  model = smollm2_side.hf
  assert model is not None, "run before the tests of `payload`, whose run drops HF's model"
  prompts = peer_hf.random_prompts(1, 16, model.config.vocab_size, 0)
  free = peer_hf.hf_decode_row(model, prompts, settings)["tokens"][0]
  assert len(free) == 4   # the token not yet in the cache, then 3 steps
  eos = model.generation_config.eos_token_id
  model.generation_config.eos_token_id = free[1]
  assert peer_hf.hf_decode_row(model, prompts, settings)["tokens"][0] == free
  assert model.generation_config.eos_token_id == free[1]   # put back after each window
  model.generation_config.eos_token_id = eos


@pytest.fixture(scope="module")
def payload(smollm2_side, tmp_path_factory):
  """One run of both sections: decode at B=2 x 64 tokens, and one AIME25/GSM8K prompt at batch 1
  with every HF method and jaxspec's vanilla (vegas and the draft model would each add ~30-60 s
  of compiling; their runs are `Runner.generate` calls like vanilla's). SmolLM2 is its own
  assistant: assisted generation then accepts every draft."""
  settings = peer_hf.Settings(batch_sizes=(2,), contexts=(64,), steps=3, reps=2, warmup=1,
                              prefill_tokens=64, decode_draft=False, prompts=1,
                              max_new_tokens=10, spec_methods=SPEC_METHODS, spec_warmup=False,
                              device="cpu", compile=False, dtype="float32")
  target = smollm2_side
  checkpoints = []
  out = peer_hf.run(target, target, settings, checkpoints.append, copy_rate=1e10)
  assert target.hf is None   # HF's model is dropped before jaxspec runs
  assert len(checkpoints) == 1 and checkpoints[0]["decode"][0]["ratio"] is None   # HF's part only
  path = tmp_path_factory.mktemp("peer") / "peer_hf.json"
  write_json(str(path), out)
  return json.loads(path.read_text())


def test_decode_rows_time_both_frameworks_and_agree_in_float32(payload):
  row, = payload["decode"]
  assert (row["batch"], row["context"], row["prompt_tokens"]) == (2, 64, 64)
  hf, js = row["hf"], row["jaxspec"]
  assert "skipped" not in hf and "skipped" not in js, (hf, js)
  for side in (hf, js):
    assert side["step_ms"] > 0 and side["tokens_per_s"] == pytest.approx(2e3 / side["step_ms"])
    assert 64 < side["mean_context"] < 64 + 3 * 4   # inside the run's 3 windows of 3 steps
  assert len(hf["step_ms_windows"]) == 2
  # The floor: SmolLM2's weights (tied head) and both rows' K/V at each side's mean context, over
  # the 10 GB/s the run was given.
  weights = 134_515_008 * 4
  for side in (hf, js):
    step_bytes = weights + 2 * side["mean_context"] * (2 * 30 * 3 * 64 * 4)
    assert side["step_gb"] == pytest.approx(step_bytes / 1e9)
    assert side["gb_s"] == pytest.approx(step_bytes / side["step_ms"] / 1e6)
    assert side["x_floor"] == pytest.approx(side["step_ms"] / (step_bytes / 1e10 * 1e3))
  assert row["ratio"] == pytest.approx(js["tokens_per_s"] / hf["tokens_per_s"])
  # The greedy continuations of the same random prompts: jaxspec's first token and 2 windows of 3
  # steps against HF's, identical in float32 on both rows (chunked HF prefill, per-row jaxspec
  # prefill into slots).
  assert row["greedy_compared_tokens"] == 1 + 3 * 3
  assert row["greedy_prefix_share"] == 1.0 and row["greedy_identical_rows"] == 2


def test_batch1_methods_and_ratios(payload):
  spec = payload["speculative"]
  assert payload["spec_prompt_tokens"][0] > 20 and payload["stop_ids"] == [2]
  methods = spec["methods"]
  assert set(methods) == set(SPEC_METHODS)
  for name, m in methods.items():
    assert "skipped" not in m, (name, m)
    assert 1 <= m["new_tokens"] <= 10 and m["decode_tokens"] < m["new_tokens"]
    assert m["decode_tokens_per_s"] == pytest.approx(m["decode_tokens"] / m["decode_s"])
    assert m["tokens_per_s"] == pytest.approx(m["new_tokens"] / (m["decode_s"] + m["prefill_s"]))
    # Greedy in float32: jaxspec's vanilla equals transformers', and HF's assisted and
    # prompt-lookup outputs equal its plain greedy output (both lossless).
    assert m["agreement_with_hf_static"] == dict(prefix_share=1.0, identical=1, prompts=1), name
  assert methods["jaxspec:none"]["agreement_with_jaxspec_none"]["identical"] == 1
  ratios = {r["name"]: r for r in spec["ratios"]}
  vanilla = ratios["vanilla"]
  assert vanilla["decode_tokens_per_s_ratio"] == pytest.approx(
      methods["jaxspec:none"]["decode_tokens_per_s"] / methods["hf:static"]["decode_tokens_per_s"])
  # Not run here: no ratio, rather than a made-up one.
  assert ratios["draft model vs assisted"]["decode_tokens_per_s_ratio"] is None
  assert ratios["self-drafting vs prompt lookup"]["tokens_per_s_ratio"] is None
  fastest = max((m for m in SPEC_METHODS if m.startswith("hf:")),
                key=lambda m: methods[m]["decode_tokens_per_s"])
  assert ratios["fastest of each"]["hf"] == fastest
  assert ratios["fastest of each"]["jaxspec"] == "jaxspec:none"


def test_summary(payload):
  s = payload["summary"]
  ratios = [payload["decode"][0]["ratio"]] + [
      r["decode_tokens_per_s_ratio"] for r in payload["speculative"]["ratios"]
      if r["decode_tokens_per_s_ratio"] is not None]
  assert s["decode_ratio_min"] == s["decode_ratio_max"] == payload["decode"][0]["ratio"]
  assert s["jaxspec_ahead_everywhere"] == (min(ratios) > 1)
  assert s["decode_rows_not_compared"] == 0


def test_failures_and_helpers():
  oom = peer_hf.failure(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
  assert oom["skipped"] == "out of memory" and oom["error"].startswith("OutOfMemoryError")
  xla = peer_hf.failure(RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate"))
  assert xla["skipped"] == "out of memory"
  assert peer_hf.failure(ValueError("bad shape"))["skipped"] == "error"
  # A 32K row of a 32768-position model leaves room for the tokens the run generates.
  assert peer_hf.prompt_length(32768, 32768, 133) == 32768 - 133
  assert peer_hf.prompt_length(4096, 32768, 133) == 4096
  assert peer_hf.first_difference([1, 2, 3], [1, 2, 4]) == 2
  assert peer_hf.first_difference([1, 2], [1, 2, 3]) == 2
  # A side that ran out of memory gives a row without a ratio, and the summary counts it.
  rows = peer_hf.decode_rows([dict(model="m", batch=64, context=32768, prompt_tokens=32635,
                                   hf=peer_hf.failure(torch.OutOfMemoryError("out of memory")),
                                   jaxspec=dict(step_ms=10.0, tokens_per_s=6400.0, tokens=[[1]]))])
  assert rows[0]["ratio"] is None and rows[0]["hf"]["skipped"] == "out of memory"
  assert "tokens" not in rows[0]["jaxspec"]
  s = peer_hf.summary(dict(decode=rows))
  assert s["decode_rows_not_compared"] == 1 and s["jaxspec_ahead_everywhere"] is False
  assert s["decode_ratio_min"] is None


def test_cli_refuses_bad_flags_before_loading():
  res = run_module("benchmarks.peer_hf", "--device=cpu", "--spec_methods=hf:static,vllm",
                   "--model=/nonexistent.gguf", timeout=300)
  assert res.returncode == 1, res.stderr[-2000:]
  assert "Traceback" not in res.stderr
  last = res.stderr.strip().splitlines()[-1]
  assert "unknown --spec_methods ['vllm']" in last and last.startswith("benchmarks.peer_hf")
