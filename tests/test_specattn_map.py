"""SpecAttn's layer map: the monotone DP against brute force, the other maps, calibration on tiny
models, and the map file's pair check."""
import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import specattn_map as sm
from jaxspec.model.config import ModelConfig
from jaxspec.model.transformer import init_random


def cfg(layers):
  return ModelConfig(arch="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64,
                     num_layers=layers, num_heads=2, num_kv_heads=1, head_dim=16)


def brute_force(sim):
  lt, ld = sim.shape
  best = max(itertools.combinations_with_replacement(range(ld), lt),
             key=lambda f: sum(sim[j, i] for j, i in enumerate(f)))
  return tuple(best)


@pytest.mark.parametrize("shape, seed", [((5, 3), 0), ((6, 4), 1), ((4, 6), 2), ((7, 2), 3),
                                         ((1, 4), 4), ((5, 1), 5)])
def test_monotone_map_equals_brute_force_and_is_monotone(shape, seed):
  sim = np.random.default_rng(seed).normal(size=shape)
  f = sm.monotone_map(sim)
  assert f == brute_force(sim)
  assert all(a <= b for a, b in zip(f, f[1:]))
  assert len(f) == shape[0] and all(0 <= i < shape[1] for i in f)


def test_monotone_map_differs_from_argmax_when_argmax_goes_back():
  sim = np.array([[0.0, 1.0], [1.0, 0.0]])
  assert sm.argmax_map(sim) == (1, 0)
  assert sm.monotone_map(sim) in ((0, 0), (1, 1))


def test_proportional_map():
  assert sm.proportional_map(8, 4) == (0, 0, 1, 1, 2, 2, 3, 3)
  assert sm.proportional_map(3, 5) == (0, 1, 3)


def test_calibration_and_map_file(tmp_path):
  target, draft = init_random(cfg(4), seed=0), init_random(cfg(2), seed=1)
  windows = sm.calibration_windows(np.arange(300) % 64, 3, 40)
  assert windows.shape == (3, 40)
  rows = sm.attention_rows(draft, jnp.asarray(windows), 5)
  assert rows.shape == (2, 3, 5, 40)
  np.testing.assert_allclose(np.asarray(rows).sum(-1), 1.0, atol=2e-2)   # bf16 scores
  assert float(rows[:, :, 0, 36:].max()) == 0.0                          # row 0 sees keys <= 35
  sim = sm.kl_similarity(target, draft, windows, rows=5, batch=2)
  assert sim.shape == (4, 2) and np.all(sim <= 1e-3)                     # -KL <= 0
  # A model against itself: the diagonal is (near) zero KL and the map the identity.
  assert sm.monotone_map(sm.kl_similarity(target, target, windows, rows=5, batch=3)) == (0, 1, 2, 3)
  m = sm.make_map("kl", target, draft, "t", "d", sim)
  path = sm.save_map(m, sm.default_map_path(tmp_path, "d"))
  assert path.parent == tmp_path
  assert sm.load_map(path, target, draft).layers == m.layers == sm.monotone_map(sim)


def test_map_for_another_pair_is_a_one_line_error(tmp_path):
  target, draft = init_random(cfg(4), seed=0), init_random(cfg(2), seed=1)
  path = sm.save_map(sm.make_map("proportional", target, draft, "t", "d"), tmp_path / "m.json")
  other = init_random(cfg(4), seed=7)    # same config, other weights
  with pytest.raises(ValueError, match="made for another pair: its target") as e:
    sm.load_map(path, other, draft)
  assert "\n" not in str(e.value)
  with pytest.raises(ValueError, match="made for another pair: its draft"):
    sm.load_map(path, target, init_random(cfg(3), seed=1))
  (tmp_path / "bad.json").write_text("{")
  with pytest.raises(ValueError, match="cannot read the SpecAttn layer map"):
    sm.load_map(tmp_path / "bad.json", target, draft)


def test_cli_needs_both_models():
  import subprocess
  import sys
  res = subprocess.run([sys.executable, "-m", "jaxspec.specattn_map", "--target=x"],
                       capture_output=True, text=True, timeout=120)
  assert res.returncode == 1
  assert res.stderr == "jaxspec.specattn_map: error: give both --draft and --target\n"
