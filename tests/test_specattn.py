"""SpecAttn: greedy speculative output equals greedy decoding of the SpecAttn-masked target, built
independently (one target token per step, the sorting reference of top-p, a numpy union); the
union's cap; bad input."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxspec.drafting import specattn
from jaxspec.engine.runner import Runner
from jaxspec.engine.state import capacity_for
from jaxspec.model.attention import Dense, LayerMapped, Prefill, ScoreSpec
from jaxspec.model.config import ModelConfig
from jaxspec.model.kv_cache import KVCache
from jaxspec.model.transformer import init_random
from pallas_kernels.topp_select import topp_select_reference
from test_speculative import sharpen


def cfg(layers):
  return ModelConfig(arch="qwen3", vocab_size=96, hidden_size=64, intermediate_size=128,
                     num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=16,
                     rope_theta=1000.0)


@pytest.fixture(scope="module")
def pair():
  return (sharpen(init_random(cfg(4), dtype=jnp.float32, seed=3)),
          sharpen(init_random(cfg(2), dtype=jnp.float32, seed=4)))


PROMPTS = [list(np.random.default_rng(0).integers(0, 96, 70)),
           list(np.random.default_rng(1).integers(0, 96, 33))]
MAX_NEW, GAMMA = 24, 3
LAYERS = (0, 0, 0, 1)


def reference_mask(rows, n, spec, k_max):
  """rows [gamma, Ld, S] (the draft rows of positions n..n+gamma-1) -> LayerMapped indices and
  counts [U, 1, k_max], with numpy and the sorting top-p."""
  g = rows.shape[0]
  idx, cnt = [], []
  for d in spec.draft_layers:
    kept, total = set(), np.zeros(rows.shape[-1], np.float64)
    for s in range(g):
      w = rows[s, d]
      i, c = topp_select_reference(w[None], jnp.asarray([n + s + 1]), p=spec.top_p, k_max=k_max)
      kept |= {int(x) for x in np.asarray(i)[0, :int(c[0])] if x < n}
      wf = np.asarray(w.astype(jnp.float32))
      total += np.where(np.isfinite(wf) & (wf > 0), wf, 0)
    chosen = sorted(sorted(kept, key=lambda x: (-np.float32(total[x]), x))[:k_max])
    idx.append(chosen + [0] * (k_max - len(chosen)))
    cnt.append(len(chosen))
  return (jnp.asarray(idx, jnp.int32)[:, None], jnp.asarray(cnt, jnp.int32)[:, None])


@functools.partial(jax.jit, static_argnums=0)
def _step(graphdef, params, tokens, positions, cache, plan):
  """One forward pass: (last row's logits, cache, scores)."""
  model = nnx.merge(graphdef, params)
  hidden, cache, scores = model(tokens, positions, cache, plan)
  return model.logits(hidden[:, -1]), cache, scores


def specattn_plan(spec):
  """The SpecAttn plan of a round from its draft rows [gamma, Ld, S] at start n (`reference_mask`)."""
  def plan(rows, n, cap):
    idx, cnt = reference_mask(rows, n, spec, spec.k_max(cap))
    return LayerMapped(indices=idx, counts=cnt, tail_start=jnp.asarray([n]), slots=spec.slots)
  return plan


def masked_greedy(target, draft, prompt, gamma, max_new, scores, plan_of):
  """Greedy decoding of a draft-masked target (module docstring of jaxspec.drafting.specattn): at
  each round start the draft drafts gamma tokens greedily (one token per step), collecting
  `scores`, and `plan_of(its rows [gamma, Ld, ...], n, capacity)` gives the mask; the target then
  emits one token per step under it while it agrees with the drafts."""
  cap = capacity_for(len(prompt) + max_new, gamma + 1)
  tm, dm = nnx.split(target), nnx.split(draft)

  def run(model, cache, tokens, pos, plan):
    return _step(*model, jnp.asarray([tokens]), jnp.asarray([pos]),
                 cache.replace(lengths=jnp.asarray([pos[0]])), plan)

  seq = list(prompt)
  p = len(seq)
  logits, tcache, _ = run(tm, KVCache.create(target.cfg, 1, cap, jnp.float32), seq,
                          list(range(p)), Prefill())
  _, dcache, _ = run(dm, KVCache.create(draft.cfg, 1, cap, jnp.float32), seq, list(range(p)),
                     Prefill())
  seq.append(int(jnp.argmax(logits[0])))
  out, dlen = [seq[-1]], p
  while len(out) < max_new:
    n = len(seq) - 1
    for m in range(dlen, n):   # the draft cache catches up with the accepted tokens
      _, dcache, _ = run(dm, dcache, [seq[m]], [m], Dense())
    token, drafts, rows = seq[n], [], []
    for s in range(gamma):
      logits, dcache, sc = run(dm, dcache, [token], [n + s], Dense(scores=scores))
      token = int(jnp.argmax(logits[0]))
      drafts.append(token)
      rows.append(sc[:, 0])
    dlen = n + 1            # position n holds seq[n]; those after it hold drafts, maybe rejected
    plan = plan_of(jnp.stack(rows), n, cap)
    for t in range(gamma + 1):
      feed = seq[n] if t == 0 else drafts[t - 1]
      logits, tcache, _ = run(tm, tcache, [feed], [n + t], plan)
      y = int(jnp.argmax(logits[0]))
      seq.append(y)
      out.append(y)
      if t == gamma or y != drafts[t]:
        break
  return out[:max_new]


# The reference collects every draft layer's rows; the engine only those of the map's draft layers
# (the second case reads draft layer 1 only).
ALL_LAYER_WEIGHTS = ScoreSpec("weights", rows=(-1,))


@pytest.mark.parametrize("top_p, cap, layers", [(0.9, None, LAYERS), (0.8, 12, (0, 0, 1, 1))])
def test_greedy_specattn_equals_greedy_masked_target(pair, top_p, cap, layers):
  target, draft = pair
  runner = Runner(target, method="specattn", draft_model=draft, gamma=GAMMA, top_p_attn=top_p,
                  layer_map=layers, attn_cap=cap, cache_dtype=jnp.float32, stop_ids=())
  out, stats = runner.generate(PROMPTS, max_new_tokens=MAX_NEW)
  spec = runner.specattn
  assert 0 < stats.extra["kv_kept_share"] < 1   # peaked attention: top-p drops keys
  for prompt, got in zip(PROMPTS, out):
    assert got == masked_greedy(target, draft, prompt, GAMMA, MAX_NEW, ALL_LAYER_WEIGHTS,
                                specattn_plan(spec))
  if cap is None:   # the mask matters: dense speculative decoding (the dense target's) differs
    dense, _ = Runner(target, method="draft", draft_model=draft, gamma=GAMMA,
                      cache_dtype=jnp.float32, stop_ids=()).generate(PROMPTS,
                                                                     max_new_tokens=MAX_NEW)
    assert dense != out


@pytest.mark.parametrize("cap", [64, 5])
def test_kept_union_is_the_same_with_the_pallas_top_p(cap):
  """'auto' picks the Pallas top-p on the Pallas backend: it keeps the XLA search's set."""
  x = 3.0 * jax.random.normal(jax.random.PRNGKey(0), (3, 2, 2, 64))
  rows = jax.nn.softmax(x, axis=-1).astype(jnp.bfloat16)
  start = jnp.asarray([40, 61])
  got = [specattn.kept_union(rows, start, specattn.SpecAttnConfig(layers=(0, 0, 0), top_p=0.9,
                                                                   topp_method=m), cap,
                             interpret=True) for m in ("threshold", "pallas")]
  assert int(got[0][1].min()) > 0
  for a, b in zip(*got):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_score_layers_collect_only_the_named_layers(pair):
  """A pass whose ScoreSpec names layers returns those layers' rows, as the all-layer pass does."""
  target, _ = pair
  model = nnx.split(target)
  seq = list(PROMPTS[1][:20])
  _, cache, _ = _step(*model, jnp.asarray([seq]), jnp.asarray([list(range(20))]),
                      KVCache.create(target.cfg, 1, 32, jnp.float32), Prefill())
  step = lambda spec: _step(*model, jnp.asarray([[seq[-1]]]), jnp.asarray([[20]]), cache,
                            Dense(scores=spec))[2]
  every, some = step(ALL_LAYER_WEIGHTS), step(ScoreSpec("weights", rows=(-1,), layers=(1, 3)))
  assert every.shape[0] == 4 and some.shape == (2, *every.shape[1:])
  np.testing.assert_array_equal(np.asarray(some), np.asarray(every[jnp.asarray([1, 3])]))
  with pytest.raises(ValueError, match="score layers must be distinct non-negative layers, "
                     "ascending, got \\(3, 1\\)"):
    ScoreSpec("weights", layers=(3, 1))


def test_kept_union_caps_by_summed_weight():
  spec = specattn.SpecAttnConfig(layers=(0, 0, 0), top_p=1.0)
  w = np.zeros((2, 1, 1, 16), np.float32)
  w[0, 0, 0, [1, 3, 5]] = [0.5, 0.3, 0.2]          # row of position 8 (start), keys [0, 8]
  w[1, 0, 0, [3, 7, 9]] = [0.6, 0.3, 0.1]          # row of position 9: key 9 is in the tail
  rows = jnp.asarray(w, jnp.bfloat16)
  idx, cnt = specattn.kept_union(rows, jnp.asarray([8]), spec, k_max=8)
  assert int(cnt[0, 0]) == 4 and list(np.asarray(idx[0, 0, :4])) == [1, 3, 5, 7]
  idx, cnt = specattn.kept_union(rows, jnp.asarray([8]), spec, k_max=2)
  assert int(cnt[0, 0]) == 2 and list(np.asarray(idx[0, 0])) == [1, 3]   # sums 0.9 and 0.5


@pytest.mark.parametrize("kw, message", [
    (dict(top_p_attn=0.0), "top_p_attn (SpecAttn's kept attention mass) must be in (0, 1], got 0.0"),
    (dict(top_p_attn=1.5), "must be in (0, 1], got 1.5"),
    (dict(layer_map=(0, 0, 2, 1)), "a SpecAttn layer map needs one draft layer in [0, 2)"),
    (dict(layer_map=(0, 1)), "one draft layer in [0, 2) per target layer (4)"),
    (dict(attn_cap=0), "the SpecAttn index cap must be an integer >= 1"),
    (dict(tree=(2, 1)), "method 'specattn' builds its attention mask from a chain"),
])
def test_bad_input_is_a_one_line_error(pair, kw, message):
  target, draft = pair
  with pytest.raises(ValueError) as e:
    Runner(target, method="specattn", draft_model=draft, **kw)
  assert message in str(e.value) and "\n" not in str(e.value)


def test_a_map_with_no_sparse_layer_is_a_one_line_error():
  with pytest.raises(ValueError, match="dense_layers \\(2\\) must leave a sparse layer of the "
                     "target's 2"):
    specattn.SpecAttnConfig(layers=(0, 1))


def test_specattn_needs_a_draft_model_with_the_same_vocabulary(pair):
  target, _ = pair
  with pytest.raises(ValueError, match="method 'specattn' needs a draft model"):
    Runner(target, method="specattn")
  other = init_random(ModelConfig(arch="qwen3", vocab_size=50, hidden_size=32,
                                  intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                                  head_dim=16), dtype=jnp.float32)
  with pytest.raises(ValueError, match="must share a tokenizer"):
    Runner(target, method="specattn", draft_model=other)


def test_sampled_specattn_runs_and_reports_acceptance(pair):
  """Sampling takes the draft's distributions beside its attention rows (the non-greedy path)."""
  from jaxspec.engine.sampling import SamplingParams
  target, draft = pair
  out, stats = Runner(target, method="specattn", draft_model=draft, gamma=GAMMA, top_p_attn=0.9,
                      layer_map=LAYERS, cache_dtype=jnp.float32, stop_ids=(),
                      sampling=SamplingParams(temperature=1.0)).generate(PROMPTS, max_new_tokens=12,
                                                                         seed=1)
  assert [len(o) for o in out] == [12, 12] and all(0 <= t < 96 for o in out for t in o)
  assert stats.extra["method"] == "specattn" and 1 <= stats.extra["mean_accepted_tokens"] <= 4
  assert 0 < stats.extra["kv_kept_share"] <= 1
