"""benchmarks.specattn end to end on a tiny random pair (a smoke run: the numbers mean nothing),
Quest included."""
import json
import math
import subprocess
import sys


def test_specattn_benchmark_smoke(tmp_path):
  out = tmp_path / "specattn.json"
  res = subprocess.run([sys.executable, "-m", "benchmarks.specattn", "--random_pair",
                        "--window=160", "--windows=1", "--top_ps=0.9", "--gamma=3",
                        "--dtype=float32", f"--out={out}"], capture_output=True, text=True,
                       timeout=600)
  assert res.returncode == 0, res.stderr[-2000:]
  written = json.loads(out.read_text())
  assert written["complete"] is True
  rows = written["results"]
  assert [r["method"] for r in rows] == ["full", "specattn", "streaming", "quest"]
  full, spec, stream, quest = rows
  assert full["kv_reduction"] == 0 and full["ppl_increase"] == 0
  assert 0 <= spec["kv_reduction"] < 1 and spec["perplexity"] > 1
  # StreamingLLM runs at SpecAttn's budget per chunk: the same reduction, up to rounding.
  assert abs(stream["kv_reduction"] - spec["kv_reduction"]) < 0.02
  # Quest at the same budget: whole pages, the partial last one counted in, so it reads no more.
  assert spec["kv_reduction"] - 0.02 <= quest["kv_reduction"] < 1 and quest["perplexity"] > 1
  assert full["scored_tokens"] == spec["scored_tokens"] == stream["scored_tokens"] > 0
  assert quest["scored_tokens"] == full["scored_tokens"]
  assert (tmp_path / "specattn.png").stat().st_size > 0


def test_rows_are_reported_as_they_are_made():
  """run() hands every row to on_row as soon as it exists (the CLI writes the JSON then), so a
  run cut short keeps the rows it made. In a subprocess: benchmarks.specattn defines its flags at
  import, which would collide with another benchmark's imported in this worker."""
  script = """
import json
import jax.numpy as jnp
from benchmarks import sparse_eval as se
from benchmarks import specattn as bench
from jaxspec import specattn_map as sm
pair = se.load_pair(None, None, True, jnp.float32)
tokens = se.book_tokens(pair.tokenizer)[:128]
maps = {"proportional": sm.proportional_map(pair.target.cfg.num_layers, pair.draft.cfg.num_layers)}
seen = []
rows = bench.run(pair.target, pair.draft, tokens[None], top_ps=[0.9], maps=maps, prefill=64,
                 gamma=3, on_row=lambda rows: seen.append([r["method"] for r in rows]))
print(json.dumps(dict(seen=seen, methods=[r["method"] for r in rows],
                      increases=[r["ppl_increase"] for r in rows])))
"""
  res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
  assert res.returncode == 0, res.stderr[-2000:]
  got = json.loads(res.stdout.strip().splitlines()[-1])
  assert got["seen"] == [["full"], ["full", "specattn"], ["full", "specattn", "streaming"],
                         ["full", "specattn", "streaming", "quest"]]
  assert got["methods"] == got["seen"][-1]
  assert got["increases"][0] == 0 and all(math.isfinite(x) for x in got["increases"])
