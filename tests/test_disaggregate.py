"""Disaggregated serving (`Runner.serve(..., disaggregate=True)`) on two CPU devices: prefills on
the second device, moved into the decode device's free slots, give every request exactly its
greedy tokens.

As in test_tensor_parallel.py, the two devices exist only in a subprocess (this file run as a
script: `_worker`), which writes a JSON report for the tests to assert on.
"""
import json
import sys
from pathlib import Path

import pytest

from subproc import run_worker

PROMPT_LENS = (9, 13, 5, 11, 14)    # one length bucket: one prefill to compile per device
MAX_NEW = 10


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
  return run_worker(__file__, tmp_path_factory.mktemp("disaggregate"))


@pytest.mark.parametrize("method", ["none", "vegas"])
def test_every_request_gets_its_greedy_tokens(report, method):
  r = report[method]
  assert r["served"] == r["alone"]
  assert r["prefill_devices"] == ["cpu:1"] and r["decode_device"] == "cpu:0", r
  assert r["row"]["disaggregate"] and r["row"]["tokens"] > 0


def test_refused_with_tensor_parallelism(report):
  assert report["tp_error"] == ("disaggregated serving runs on one device for decoding and one "
                                "for prefill; with tp=2 it is not built yet")


def _worker(out_dir: Path) -> None:
  import jax
  import jax.numpy as jnp
  import numpy as np

  from jaxspec.engine.runner import Runner
  from jaxspec.model.config import ModelConfig
  from jaxspec.model.transformer import init_random

  assert jax.device_count() == 2, jax.devices()
  cfg = ModelConfig(arch="qwen3", vocab_size=96, hidden_size=32, intermediate_size=64,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=1000.0)
  model = init_random(cfg, dtype=jnp.float32, seed=7)
  rng = np.random.default_rng(1)
  prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in PROMPT_LENS]
  report = {}
  for method in ("none", "vegas"):
    runner = Runner(model, method=method, gamma=2, sparsity=0.2, min_tokens=4,
                    backend="reference", cache_dtype=jnp.float32)
    alone, _ = runner.generate(prompts, max_new_tokens=MAX_NEW)
    served = {}
    # Five requests through two slots: three of them prefilled on the second device mid-stream.
    row, _ = runner.serve(prompts, 2, MAX_NEW, max_len=max(PROMPT_LENS) + MAX_NEW, chunk=2,
                          warmup_s=0.0, measure_s=1e9, disaggregate=True,
                          on_finish=lambda req, toks: served.setdefault(req, toks.tolist()))
    params, decode = runner._prefill_placement()
    report[method] = dict(
        alone=alone, served=[served.get(i) for i in range(len(prompts))], row=row,
        prefill_devices=sorted(str(d) for d in jax.tree.leaves(params)[0].devices()),
        decode_device=str(decode))
  try:
    Runner(model, tp=2).serve(prompts, 2, MAX_NEW, max_len=32, chunk=2, warmup_s=0.0,
                              measure_s=1.0, disaggregate=True)
  except ValueError as e:
    report["tp_error"] = str(e)
  (out_dir / "report.json").write_text(json.dumps(report))


if __name__ == "__main__":
  _worker(Path(sys.argv[1]))
