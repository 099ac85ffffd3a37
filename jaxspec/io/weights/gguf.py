"""GGUF file -> config (from its metadata), params (dequantized with `gguf`) and tokenizer.

Facts about llama.cpp's layout this relies on:
- Tensor data dequantizes to numpy in HF's [out, in] layout; names are llama.cpp's (`blk.3.attn_q`).
- For llama-arch files, llama.cpp's converter permuted the rows of q_proj/k_proj (weights and
  biases) within each head from rotate-half order to interleaved pairs, because its RoPE rotates
  adjacent pairs. We rotate halves, so we undo that. qwen2/qwen3 files are not permuted.
- Llama 3 RoPE scaling is not in the metadata: the converter stores the per-frequency divisors as a
  `rope_freqs.weight` tensor instead.
- There is no `output.weight` when the embeddings are tied.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import gguf
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from tqdm import tqdm

from jaxspec.model import sharding
from jaxspec.model.config import ARCHITECTURES, ModelConfig, RopeScaling
from jaxspec.model.transformer import Transformer
from jaxspec.model.rope import inverse_frequencies
from jaxspec.io.weights import ParamDict, WeightsError, build_model, load_saved_tokenizer

if TYPE_CHECKING:
  from transformers import PreTrainedTokenizerBase


def _rows(x: np.ndarray, cfg: ModelConfig) -> np.ndarray:
  return x


def _unpermute(x: np.ndarray, heads: int) -> np.ndarray:
  """Undo llama.cpp's per-head row permutation: rows (h, i, pair) -> (h, pair, i)."""
  rows = x.shape[0]
  return x.reshape(heads, rows // heads // 2, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def _q_rows(x: np.ndarray, cfg: ModelConfig) -> np.ndarray:
  return _unpermute(x, cfg.num_heads) if cfg.arch == "llama" else x


def _k_rows(x: np.ndarray, cfg: ModelConfig) -> np.ndarray:
  return _unpermute(x, cfg.num_kv_heads) if cfg.arch == "llama" else x


# The mapping table: GGUF tensor name -> (our param path, the order of its rows, transposed?).
# `{i}` is the layer index. Rows are reordered before they are dequantized (a quantized row
# dequantizes on its own); a transposed matrix goes from [out, in] to nnx.Linear's [in, out].
_GLOBAL: dict[str, tuple[str, Callable, bool]] = {
    "token_embd.weight": ("embed_tokens/embedding", _rows, False),
    "output_norm.weight": ("norm/weight", _rows, False),
    "output.weight": ("lm_head/kernel", _rows, True),
}
_PER_LAYER: dict[str, tuple[str, Callable, bool]] = {
    "attn_norm.weight": ("input_layernorm/weight", _rows, False),
    "ffn_norm.weight": ("post_attention_layernorm/weight", _rows, False),
    "attn_q.weight": ("self_attn/q_proj/kernel", _q_rows, True),
    "attn_k.weight": ("self_attn/k_proj/kernel", _k_rows, True),
    "attn_v.weight": ("self_attn/v_proj/kernel", _rows, True),
    "attn_output.weight": ("self_attn/o_proj/kernel", _rows, True),
    "attn_q.bias": ("self_attn/q_proj/bias", _q_rows, False),
    "attn_k.bias": ("self_attn/k_proj/bias", _k_rows, False),
    "attn_v.bias": ("self_attn/v_proj/bias", _rows, False),
    "attn_q_norm.weight": ("self_attn/q_norm/weight", _rows, False),
    "attn_k_norm.weight": ("self_attn/k_norm/weight", _rows, False),
    "ffn_gate.weight": ("mlp/gate_proj/kernel", _rows, True),
    "ffn_up.weight": ("mlp/up_proj/kernel", _rows, True),
    "ffn_down.weight": ("mlp/down_proj/kernel", _rows, True),
}
# Tensors that configure rather than parameterize the model (read by `read_config`).
_CONFIG_TENSORS = ("rope_freqs.weight",)


def key_map(cfg: ModelConfig) -> dict[str, tuple[str, Callable, bool]]:
  table = dict(_GLOBAL)
  for i in range(cfg.num_layers):
    for name, (path, rows, transposed) in _PER_LAYER.items():
      table[f"blk.{i}.{name}"] = (f"layers/{i}/{path}", rows, transposed)
  return table


def open_reader(path: str | Path) -> gguf.GGUFReader:
  path = Path(path)
  if not path.is_file():
    raise WeightsError(f"GGUF file {path} does not exist")
  try:
    return _Reader(path)
  except Exception as e:   # the reader raises ValueError, struct.error, IndexError... on bad bytes
    raise WeightsError(f"{path} is not a readable GGUF file: {type(e).__name__}: {e}") from e


class _Reader(gguf.GGUFReader):
  """gguf's reader over a plain ndarray view of its memory map. The reader slices the map once per
  metadata value (300K slices for a 151K-token vocabulary with its merges), and every slice of a
  numpy memmap runs the subclass's Python hooks: they took half of its 8 s for a Qwen2.5 file."""

  def _get(self, *args, **kwargs):
    if type(self.data) is np.memmap:
      self.data = np.asarray(self.data)   # same pages, no subclass
    return super()._get(*args, **kwargs)


class _Meta:
  """Typed access to the metadata of one GGUF file, with errors that name the missing key."""

  def __init__(self, reader: gguf.GGUFReader, source: str):
    self.reader, self.source = reader, source

  def get(self, key: str, default: Any = KeyError) -> Any:
    field = self.reader.fields.get(key)
    if field is None:
      if default is KeyError:
        raise WeightsError(f"{self.source}: GGUF metadata has no {key!r}")
      return default
    return field.contents()

  def count(self, key: str) -> int | None:
    field = self.reader.fields.get(key)
    return None if field is None else len(field.data)


def read_config(reader: gguf.GGUFReader, source: str = "GGUF file") -> ModelConfig:
  """ModelConfig from the GGUF metadata (and the tensor list, for tying and llama3 RoPE)."""
  meta = _Meta(reader, source)
  arch = meta.get("general.architecture")
  if arch not in ARCHITECTURES:
    raise WeightsError(f"{source}: unsupported GGUF architecture {arch!r}; "
                       f"supported: {', '.join(ARCHITECTURES)}")
  tensors = {t.name: t for t in reader.tensors}
  a = lambda key, default=KeyError: meta.get(f"{arch}.{key}", default)   # noqa: E731
  hidden, heads = int(a("embedding_length")), int(a("attention.head_count"))
  vocab = a("vocab_size", None) or meta.count("tokenizer.ggml.tokens")
  if vocab is None:
    raise WeightsError(f"{source}: GGUF metadata has neither {arch}.vocab_size nor a token list")
  eos = [meta.get(f"tokenizer.ggml.{k}_token_id", None) for k in ("eos", "eot", "eom")]
  cfg = ModelConfig(
      arch=arch, vocab_size=int(vocab), hidden_size=hidden,
      intermediate_size=int(a("feed_forward_length")), num_layers=int(a("block_count")),
      num_heads=heads, num_kv_heads=int(a("attention.head_count_kv", heads)),
      head_dim=int(a("attention.key_length", hidden // heads)),
      rms_norm_eps=float(a("attention.layer_norm_rms_epsilon")),
      rope_theta=float(a("rope.freq_base", 10000.0)),
      qkv_bias="blk.0.attn_q.bias" in tensors, qk_norm="blk.0.attn_q_norm.weight" in tensors,
      tie_word_embeddings="output.weight" not in tensors,
      max_position_embeddings=int(a("context_length")),
      bos_token_id=meta.get("tokenizer.ggml.bos_token_id", None),
      eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)))
  scaling = _rope_scaling(meta, arch, cfg, tensors.get("rope_freqs.weight"), source)
  return dataclasses.replace(cfg, rope_scaling=scaling) if scaling else cfg


def _rope_scaling(meta: _Meta, arch: str, cfg: ModelConfig, rope_freqs, source: str
                  ) -> RopeScaling | None:
  kind = meta.get(f"{arch}.rope.scaling.type", "none")
  if rope_freqs is not None:
    if kind != "none":
      raise WeightsError(f"{source}: both rope_freqs.weight and rope.scaling.type={kind!r}")
    return _llama3_from_factors(cfg, gguf.quants.dequantize(rope_freqs.data, rope_freqs.tensor_type),
                                source)
  if kind == "none":
    return None
  if kind != "yarn":
    raise WeightsError(f"{source}: unsupported RoPE scaling type {kind!r}; supported: yarn, llama3")
  r = lambda key, default=KeyError: meta.get(f"{arch}.rope.scaling.{key}", default)   # noqa: E731
  # llama.cpp's attn_factor / log multiplier multiply the YaRN mscale in ways HF's config does not
  # express one-to-one; refuse rather than guess.
  if float(r("attn_factor", 1.0)) != 1.0 or float(r("yarn_log_multiplier", 0.0)) != 0.0:
    raise WeightsError(f"{source}: YaRN with attn_factor / yarn_log_multiplier is not supported")
  return RopeScaling(kind="yarn", factor=float(r("factor")),
                     original_max_position_embeddings=int(r("original_context_length")),
                     beta_fast=float(r("yarn_beta_fast", 32.0)), beta_slow=float(r("yarn_beta_slow", 1.0)))


def _llama3_from_factors(cfg: ModelConfig, factors: np.ndarray, source: str) -> RopeScaling:
  """Llama 3 scaling whose per-frequency divisors reproduce `rope_freqs.weight`.

  The file stores only the divisors. Llama 3.x used low/high freq factors 1/4 and an original
  context of 8192, with `factor` the largest divisor; accept that only if it reproduces every stored
  divisor, so nothing is assumed that the data does not confirm.
  """
  factors = np.asarray(factors, np.float64).reshape(-1)
  scaling = RopeScaling(kind="llama3", factor=float(factors.max()),
                        original_max_position_embeddings=8192, low_freq_factor=1.0,
                        high_freq_factor=4.0)
  base, _ = inverse_frequencies(dataclasses.replace(cfg, rope_scaling=None))
  scaled, _ = inverse_frequencies(dataclasses.replace(cfg, rope_scaling=scaling))
  if factors.shape != base.shape or not np.allclose(base / scaled, factors, rtol=1e-4):
    raise WeightsError(f"{source}: rope_freqs.weight does not match Llama 3 RoPE scaling "
                       f"(factor={scaling.factor}, low/high freq factor 1/4, original context 8192); "
                       "other frequency-factor tensors are not supported")
  return scaling


def read_params(reader: gguf.GGUFReader, cfg: ModelConfig, *, dtype=jnp.bfloat16,
                progress: bool = False, source: str = "GGUF file") -> ParamDict:
  """All tensors dequantized, mapped to param paths, as numpy arrays of `dtype`. Tensors are
  dequantized on up to 8 threads (numpy releases the GIL inside each pass)."""
  table = key_map(cfg)
  unknown = [t.name for t in reader.tensors if t.name not in table and t.name not in _CONFIG_TENSORS]
  if unknown:
    raise WeightsError(f"{source}: tensors with no place in the {cfg.arch} model: "
                       f"{', '.join(sorted(unknown)[:8])}" + (" ..." if len(unknown) > 8 else ""))
  np_dtype = jnp.dtype(dtype)

  def read(t: gguf.ReaderTensor) -> tuple[str, np.ndarray]:
    path, rows, transposed = table[t.name]
    return path, _dequantize(rows(np.asarray(t.data), cfg), t.tensor_type, np_dtype, transposed)

  tensors = [t for t in reader.tensors if t.name not in _CONFIG_TENSORS]
  with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
    return dict(tqdm(pool.map(read, tensors), total=len(tensors), unit="tensor",
                     desc=f"dequantizing {Path(source).name}", disable=not progress))


# Values per numpy pass when dequantizing: gguf's own `dequantize` passes 16 rows at a time, and
# the numpy calls' fixed cost then dominated loading (about 30 s of a Q4_K 1.5B model's float32
# load on 2 cores). Larger passes gain little more: their temporaries fault in fresh pages.
_DEQUANT_PASS = 1 << 16


def _dequantize(data: np.ndarray, qtype: gguf.GGMLQuantizationType, dtype: np.dtype,
                transposed: bool) -> np.ndarray:
  """One tensor's data (`ReaderTensor.data`, [out, in] in quantized bytes) dequantized by gguf
  into a C-contiguous array of `dtype`, transposed if asked, a few rows at a time: each pass is
  written straight into its place, cast as it goes, so no float32 copy of the whole matrix and
  no second pass to transpose it are made."""
  # gguf's per-type classes (not F32/F16), a private table: without it, gguf's public path.
  quant = getattr(gguf.quants, "_type_traits", {}).get(qtype)
  if quant is None or data.ndim != 2:
    x = gguf.quants.dequantize(data, qtype)
    return _contiguous(x.T if transposed else x, dtype)
  quant.init_grid()
  rows, cols = data.shape[0], data.shape[1] // quant.type_size * quant.block_size
  out = np.empty((cols, rows) if transposed else (rows, cols), dtype)
  source_rows = out.T if transposed else out        # a view: row i of the source, in place
  # Whole cache lines of `out` per pass when transposing: at least 16 rows of the source.
  step = max(16, _DEQUANT_PASS // cols // 16 * 16)
  for i in range(0, rows, step):
    source_rows[i:i + step] = quant.dequantize_rows(data[i:i + step])
  return out


def _contiguous(x: np.ndarray, dtype: np.dtype, block: int = 64) -> np.ndarray:
  """x as a C-contiguous array of `dtype`, cast as it is copied (one pass, not a copy and then
  an astype). A matrix that is a transposed view is copied a block of its source's rows at a
  time: numpy's copy of a whole transpose misses the cache on every write."""
  if x.ndim != 2 or x.flags.c_contiguous:
    return np.ascontiguousarray(x, dtype=dtype)
  out = np.empty(x.shape, dtype)
  for i in range(0, x.shape[1], block):
    out[:, i:i + block] = x[:, i:i + block]
  return out


def require_torch(path: str | Path) -> None:
  """transformers' GGUF reader imports torch, even for the tokenizer alone: say so up front."""
  if importlib.util.find_spec("torch") is None:
    raise WeightsError(f"{path}: reading a GGUF tokenizer needs torch (transformers' GGUF reader "
                       "imports it); install it with: pip install -e '.[gguf]'")


def load_tokenizer(path: str | Path, arch: str | None = None) -> PreTrainedTokenizerBase:
  """A transformers tokenizer built from the GGUF's tokenizer metadata (vocab, merges, template).

  arch: the model's architecture (`ModelConfig.arch`), if known. Where transformers has a
  tokenizer class of that name (qwen2, qwen3) it is asked for that class, and it skips the pass
  over all of the GGUF's metadata it otherwise makes to find the class (10 of 11 s for a
  151K-token vocabulary); the tokenizer is the same. For other architectures that pass stays, so
  the tokenizer is also saved under the cache ($JAXSPEC_CACHE, else ~/.cache/jaxspec), keyed by
  the file's path, size and modification time, and later loads read that copy."""
  path = Path(path)
  cached = tokenizer_cache_path(path) if path.is_file() else None
  if cached is not None and cached.is_dir():
    try:
      return load_saved_tokenizer(cached)
    except Exception:   # a damaged copy: build from the GGUF again below, and replace it
      shutil.rmtree(cached, ignore_errors=True)
  require_torch(path)
  from transformers import AutoTokenizer
  from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES
  try:
    typed = dict(tokenizer_type=arch) if arch in TOKENIZER_MAPPING_NAMES else {}
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, **typed)
  except Exception as e:
    raise WeightsError(f"{path}: transformers could not build a tokenizer from the GGUF "
                       f"metadata: {type(e).__name__}: {e}") from e
  if cached is not None:
    _save_copy(tokenizer, cached)
  return tokenizer


def tokenizer_cache_path(path: Path) -> Path:
  """Where the tokenizer built from the GGUF at `path` is kept (`load_tokenizer`)."""
  from jaxspec.fetch import cache_dir
  st = path.stat()
  key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()
  return cache_dir() / "tokenizers" / f"{path.stem}-{key[:16]}"


def _save_copy(tokenizer: PreTrainedTokenizerBase, dest: Path) -> None:
  """Save into a temporary folder, then rename: a reader never sees half a copy, and of two
  processes saving at once one wins. Best effort: a cache that cannot be written is skipped."""
  try:
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent)
  except OSError:
    return
  try:
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, dest)
  except OSError:   # written by another process meanwhile, or no room
    pass
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


def load(path: str | Path, *, dtype=jnp.bfloat16, progress: bool = False,
         mesh: Mesh | None = None) -> tuple[ModelConfig, Transformer]:
  """(config, filled model) from a GGUF file, on `mesh` if given (host arrays sent straight into
  their shards)."""
  reader = open_reader(path)
  cfg = read_config(reader, str(path))
  sharding.check_divides(cfg, mesh, str(path))   # before reading the weights
  params = read_params(reader, cfg, dtype=dtype, progress=progress, source=str(path))
  return cfg, build_model(cfg, params, dtype=dtype, source=str(path), mesh=mesh)
