"""Draft trees through the decoding loop (`Runner(..., tree=...)`): greedy output is vanilla's, a
width-1 tree is the chain, and a round leaves both caches as plain decoding of its tokens would."""
import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.drafting.trees import Tree
from jaxspec.engine.runner import Runner, generate
from jaxspec.engine.sampling import SamplingParams
from jaxspec.engine.state import decode_state
from jaxspec.model.config import ModelConfig
from jaxspec.model.transformer import init_random

CFG = ModelConfig(arch="qwen3", vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=1000.0)
PROMPT_LENS = (13, 40, 27)
MAX_NEW = 24
COMMON = dict(sparsity=0.2, min_tokens=4, cache_dtype=jnp.float32, backend="reference")


@pytest.fixture(scope="module")
def model():
  return init_random(CFG, dtype=jnp.float32, seed=5)


@pytest.fixture(scope="module")
def draft_model():
  return init_random(dataclasses.replace(CFG, num_layers=1), dtype=jnp.float32, seed=6)


@pytest.fixture(scope="module")
def prompts():
  rng = np.random.default_rng(2)
  return [rng.integers(0, CFG.vocab_size, n).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def vanilla(model, prompts):
  out, _ = generate(model, prompts, max_new_tokens=MAX_NEW, cache_dtype=jnp.float32)
  return out


def run(model, prompts, method, sampling=SamplingParams(), **kw):
  runner = Runner(model, method=method, sampling=sampling, **{**COMMON, **kw})
  return runner.generate(prompts, max_new_tokens=MAX_NEW, chunk=3, seed=4)


@pytest.mark.parametrize("method, drafter", [("vegas", None), ("streaming", None),
                                             ("vegas-last", None), ("draft", "small"),
                                             ("draft", "self")])
@pytest.mark.parametrize("order", ["bfs", "dfs"])
def test_greedy_tree_decoding_equals_vanilla(model, draft_model, prompts, vanilla, method,
                                             drafter, order):
  """'self': the target drafts for itself as a separate model, so whole paths are accepted."""
  kw = {}
  if drafter is not None:
    kw["draft_model"] = draft_model if drafter == "small" else model
  out, stats = run(model, prompts, method, tree=(2, 2, 1), tree_order=order, **kw)
  assert out == vanilla
  assert stats.extra["verify_rounds"] > 0
  if drafter == "self":   # every round accepts the main path in full
    assert stats.extra["mean_accepted_tokens"] > 3.5


@pytest.mark.parametrize("method", ["vegas", "streaming"])
def test_the_kernels_run_trees_through_the_model(prompts, method):
  """The interpret backend: the verify kernel with tree bits and Collect-2 scores on the main
  path, the sparse kernel drafting each level against its window (head_dim 16: tl.dot's least)."""
  model = init_random(dataclasses.replace(CFG, head_dim=16), dtype=jnp.float32, seed=5)
  want, _ = generate(model, prompts[:2], max_new_tokens=MAX_NEW, cache_dtype=jnp.float32)
  out, _ = run(model, prompts[:2], method, tree=(2, 2, 1), tree_order="dfs", backend="interpret")
  assert out == want


@pytest.mark.parametrize("method, drafter", [("vegas", None), ("draft", "small"),
                                             ("draft", "self")])
@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.8, top_k=20)])
def test_width_one_tree_is_the_chain(model, draft_model, prompts, method, drafter, sampling):
  kw = {}
  if drafter is not None:
    kw["draft_model"] = draft_model if drafter == "small" else model
  chain, chain_stats = run(model, prompts, method, sampling, gamma=3, **kw)
  tree, tree_stats = run(model, prompts, method, sampling, tree=Tree.chain(3), **kw)
  assert tree == chain
  np.testing.assert_equal(tree_stats.extra, chain_stats.extra)   # nan == nan here


@pytest.mark.parametrize("order", ["bfs", "dfs"])
def test_a_round_leaves_both_caches_as_plain_decoding_would(model, prompts, order):
  """After one tree round the target cache holds, on [0, lengths), the K/V a prefill of the same
  tokens writes; the draft cache the same on [0, lengths - 1) (its last entry is rewritten next
  round). The draft model is the target, so rounds accept deep nodes off the first slot."""
  tree = Tree.from_widths((3, 2, 1), order)
  runner = Runner(model, method="draft", draft_model=model, tree=tree, **COMMON)
  plain = Runner(model, method="none", **COMMON)
  for prompt in prompts[:2]:
    state, _, _ = runner.start([prompt], MAX_NEW, max_len=len(prompt) + MAX_NEW)
    state, _ = runner.step(state, 1)
    ds = decode_state(state)
    n = int(ds.cache.lengths[0])
    tokens = prompt + np.asarray(ds.tokens[0, :int(ds.num_new[0])]).tolist()
    assert n == len(tokens) - 1 > len(prompt) + 1          # drafts were accepted
    fresh, _, _ = plain.start([tokens[:n]], 1, max_len=n + 1)
    ref = decode_state(fresh).cache
    for got, want in ((ds.cache, n), (state.drafter.cache, n - 1)):
      for layer in range(CFG.num_layers):
        np.testing.assert_allclose(got.k[layer][0, :want], ref.k[layer][0, :want], atol=2e-5)
        np.testing.assert_allclose(got.v[layer][0, :want], ref.v[layer][0, :want], atol=2e-5)


@pytest.mark.parametrize("kwargs, match", [
    (dict(method="none", tree=(2, 1)), "speculative method"),
    (dict(method="quest", tree=(2, 1)), "cannot draft a tree"),
    (dict(method="vegas", tree=(2, 1), gamma=3), "conflicts with the tree's depth 2"),
    (dict(method="vegas", tree=(4, 4, 2)), "at most 32 nodes"),
    (dict(method="vegas", tree=(2, 0)), "widths must be integers >= 1"),
    (dict(method="vegas", tree="2,1"), "widths per depth"),
    (dict(method="vegas", tree=(2, 1), tree_order="random"), "tree order"),
])
def test_bad_trees_raise_one_line(model, kwargs, match):
  with pytest.raises(ValueError, match=match):
    Runner(model, **kwargs)


def test_serving_and_phase_timing_with_a_tree(model, prompts, vanilla):
  """Continuous batching refills slots of a tree run; the phase timer runs its three phases."""
  runner = Runner(model, method="vegas", tree=(2, 1), **COMMON)
  got = {}
  runner.serve(prompts, 2, MAX_NEW, max_len=max(PROMPT_LENS) + MAX_NEW, chunk=2, warmup_s=0.0,
               measure_s=1e9, on_finish=lambda req, tokens: got.setdefault(req, tokens.tolist()))
  assert [got[i] for i in range(len(prompts))] == vanilla
  prof = runner.profile_rounds(prompts, rounds=2, warmup=1)
  assert all(prof[f"{k}_share"] > 0 for k in ("draft", "verify", "select"))
  assert 1 <= prof["mean_accepted_tokens"] <= 3 and len(prof["acceptance_by_position"]) == 2
