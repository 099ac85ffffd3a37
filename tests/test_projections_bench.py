"""benchmarks.projections: the fused stack computes what the separate one does, and the CLI's
smoke run reports the dots XLA compiled (the numbers of a CPU run mean nothing)."""
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import projections as bench


def test_fused_weights_compute_the_separate_forward():
  cfg = bench.TINY
  w = jax.tree.map(lambda a: a.astype(jnp.float32), bench.random_weights(cfg, seed=3))
  x = jax.random.normal(jax.random.PRNGKey(0), (5, cfg.hidden_size), jnp.float32)
  np.testing.assert_allclose(bench.forward(bench.fuse(w), x, cfg), bench.forward(w, x, cfg),
                             rtol=1e-5, atol=1e-5)


def test_projections_smoke(tmp_path):
  out = tmp_path / "projections.json"
  res = subprocess.run([sys.executable, "-m", "benchmarks.projections", "--shape=tiny",
                        "--rows=4", "--steps=2", "--reps=1", f"--out={out}"],
                       capture_output=True, text=True, timeout=600)
  assert res.returncode == 0, res.stderr[-2000:]
  rows = {r["variant"]: r for r in json.loads(out.read_text())["results"]}
  assert set(rows) == {"separate", "fused"}   # the other variants are the GPU's
  layers = bench.TINY.num_layers
  assert rows["separate"]["dots"] == 7 * layers and rows["fused"]["dots"] == 4 * layers
  assert all(r["us_per_forward"] > 0 and r["x_floor"] > 0 for r in rows.values())


def test_bad_flags_are_a_one_line_error(tmp_path):
  res = subprocess.run([sys.executable, "-m", "benchmarks.projections", "--shape=nope",
                        f"--out={tmp_path / 'x.json'}"], capture_output=True, text=True,
                       timeout=300)
  assert res.returncode != 0 and "unknown shape 'nope'" in res.stderr
  assert not (tmp_path / "x.json").exists()
