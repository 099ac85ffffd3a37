"""STS's head map: the overlap search against a brute-force reference on a tiny pair, per-head
attention rows, the map file's pair and budget checks."""
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import pairmap
from jaxspec import sts_map as st
from jaxspec.model.config import ModelConfig
from jaxspec.model.transformer import init_random


def cfg(layers, heads, kv_heads):
  return ModelConfig(arch="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64,
                     num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=16)


@pytest.fixture(scope="module")
def pair():
  return init_random(cfg(3, 4, 2), seed=0), init_random(cfg(2, 2, 1), seed=1)


SAMPLES = [np.random.default_rng(s).integers(0, 64, n) for s, n in ((0, 40), (1, 33))]


def brute_force(target, draft, samples, budget, rows, granularity):
  """Per target head, the draft head with the largest summed |top-k ∩ top-k|, by Python sets over
  each recorded row (numpy's stable argsort: ties to the lower position), scanning draft heads
  in (layer, head) order and keeping the first best."""
  ht, hd = st.heads_of(target, granularity), st.heads_of(draft, granularity)
  lt, ld = target.cfg.num_layers, draft.cfg.num_layers
  score = np.zeros((lt, ht, ld, hd), np.int64)
  for tokens in samples:
    w = jnp.asarray(tokens, jnp.int32)[None]
    a_t = np.asarray(pairmap.attention_rows(target, w, rows, granularity))[:, 0]   # [L, R, H, S]
    a_d = np.asarray(pairmap.attention_rows(draft, w, rows, granularity))[:, 0]

    def top(row):
      return set(np.argsort(-row, kind="stable")[:budget].tolist())

    for r in range(rows):
      for j in range(lt):
        for h in range(ht):
          mine = top(a_t[j, r, h])
          for i in range(ld):
            for e in range(hd):
              score[j, h, i, e] += len(mine & top(a_d[i, r, e]))
  best = []
  for j in range(lt):
    layer = []
    for h in range(ht):
      cands = [(i, e) for i in range(ld) for e in range(hd)]
      layer.append(max(cands, key=lambda c: (score[j, h][c], -cands.index(c))))
    best.append(tuple(layer))
  return tuple(best)


@pytest.mark.parametrize("granularity, budget", [("kv", 4), ("kv", 9), ("q", 6)])
def test_head_map_equals_brute_force(pair, granularity, budget):
  target, draft = pair
  rows = 5
  counts = st.calibrate(target, draft, SAMPLES, budget=budget, rows=rows, granularity=granularity)
  m = st.make_map(counts, 2 * rows, target, draft, "t", "d", budget, granularity)
  assert m.heads == brute_force(target, draft, SAMPLES, budget, rows, granularity)
  assert all(0 < x <= 1 for layer in m.overlap for x in layer)
  # A model against itself: every head maps to itself with full overlap.
  same = st.make_map(st.calibrate(target, target, SAMPLES, budget=budget, rows=rows,
                                  granularity=granularity), 2 * rows, target, target, "t", "t",
                     budget, granularity)
  ht = st.heads_of(target, granularity)
  assert same.heads == tuple(tuple((j, h) for h in range(ht)) for j in range(3))


def test_per_head_rows_average_to_the_mean(pair):
  target, _ = pair
  w = jnp.asarray(SAMPLES[0], jnp.int32)[None]
  mean = pairmap.attention_rows(target, w, 4)
  kv = pairmap.attention_rows(target, w, 4, "kv")
  q = pairmap.attention_rows(target, w, 4, "q")
  assert kv.shape == (3, 1, 4, 2, 40) and q.shape == (3, 1, 4, 4, 40)
  np.testing.assert_allclose(np.asarray(kv.mean(3)), np.asarray(mean), atol=1e-2)   # bf16 scores
  np.testing.assert_allclose(np.asarray(q.reshape(3, 1, 4, 2, 2, 40).mean(4)), np.asarray(kv),
                             atol=1e-2)


def test_wikitext_samples_split_articles():
  text = " = A = \n a b \n = = S = = \n c \n = B = \n d \n = C = \n e \n"
  got = st.wikitext_samples(text, 2)
  assert got == [" = A = \n a b \n = = S = = \n c \n", " = B = \n d \n"]


def test_map_file_checks_pair_and_budget(pair, tmp_path):
  target, draft = pair
  counts = st.calibrate(target, draft, SAMPLES[:1], budget=4, rows=3)
  m = st.make_map(counts, 3, target, draft, "t", "d", 4)
  path = st.save_map(m, st.default_map_path(tmp_path, "d", 4))
  assert path.name == "sts_map_k4.d.json"
  assert st.load_map(path, target, draft, 4) == m
  for call, message in [
      (lambda: st.load_map(path, target, draft, 8), "was made for budget 4, not 8"),
      (lambda: st.load_map(path, init_random(cfg(3, 4, 2), seed=7), draft, 4),
       "STS head map .* was made for another pair: its target"),
      (lambda: st.load_map(path, target, init_random(cfg(2, 2, 1), seed=9), 4),
       "made for another pair: its draft"),
      (lambda: st.load_map(path, target, draft, 0), "must be an integer >= 1, got 0"),
      (lambda: st.calibrate(target, draft, SAMPLES, budget=0, rows=3), "got 0"),
  ]:
    with pytest.raises(ValueError, match=message) as e:
      call()
    assert "\n" not in str(e.value)


def test_cli_flag_errors_are_one_line():
  import subprocess
  import sys
  for args, message in [(["--target=x"], "give both --draft and --target"),
                        (["--target=x", "--draft=y"], "give --budget"),
                        (["--target=x", "--draft=y", "--budget=0"], "must be an integer >= 1, got 0")]:
    res = subprocess.run([sys.executable, "-m", "jaxspec.sts_map", *args], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 1
    assert res.stderr.startswith("jaxspec.sts_map: error: ") and message in res.stderr
    assert res.stderr.count("\n") == 1


def test_cli_maps_a_checkpoint_then_generate_reads_the_map(tiny_smollm2_ckpt, tmp_path):
  """A checkpoint (SmolLM2's tokenizer, 2 random layers) against itself: every head maps to
  itself; generate runs STS with the map and refuses it for another budget in one line."""
  import json
  import subprocess
  import sys
  ckpt, out = str(tiny_smollm2_ckpt), tmp_path / "map.json"
  res = subprocess.run([sys.executable, "-m", "jaxspec.sts_map", f"--target={ckpt}",
                        f"--draft={ckpt}", "--budget=8", "--samples=2", "--max_tokens=40",
                        "--rows=4", f"--out={out}"], capture_output=True, text=True, timeout=600)
  assert res.returncode == 0, res.stderr[-2000:]
  saved = json.loads(out.read_text())
  assert saved["budget"] == 8 and saved["granularity"] == "kv"
  assert saved["heads"] == [[[j, h] for h in range(2)] for j in range(2)]   # 2 layers, 2 KV heads
  common = [sys.executable, "-m", "jaxspec.generate", f"--model={ckpt}", "--method=sts",
            f"--draft_model={ckpt}", f"--sts_map={out}", "--gamma=2", "--max_new_tokens=5",
            "--prompt=One, two, three, four,"]
  res = subprocess.run([*common, "--sts_budget=8"], capture_output=True, text=True, timeout=600)
  assert res.returncode == 0, res.stderr[-2000:]
  assert "method sts" in res.stderr and res.stdout.strip()
  res = subprocess.run([*common, "--sts_budget=16"], capture_output=True, text=True, timeout=600)
  assert res.returncode == 1
  assert res.stderr.startswith("jaxspec.generate: error: the STS head map") and \
      "was made for budget 8, not 16" in res.stderr and res.stderr.count("\n") == 1
