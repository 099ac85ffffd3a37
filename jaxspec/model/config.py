"""Model configuration: one frozen, hashable object built from HF `config.json` or GGUF metadata.

One decoder covers Llama 3 / SmolLM2, Qwen2/2.5 and Qwen3; the architecture differences are
flags here (`qkv_bias`, `qk_norm`, explicit `head_dim`, tied embeddings, RoPE scaling), never
subclasses. `nsa` (an `NSAConfig`) turns every attention layer into Native Sparse Attention
(`jaxspec.model.nsa`).
"""
from __future__ import annotations

import dataclasses
from typing import Any

ARCHITECTURES = ("llama", "qwen2", "qwen3")
FLA_NSA = "nsa"   # config.json model_type of fla-org/native-sparse-attention's NSAForCausalLM


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """RoPE frequency scaling. `kind` is 'llama3' or 'yarn' (HF's `rope_type`)."""
  kind: str
  factor: float
  original_max_position_embeddings: int
  # llama3
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  # yarn
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  attention_factor: float | None = None
  mscale: float | None = None
  mscale_all_dim: float | None = None
  truncate: bool = True


@dataclasses.dataclass(frozen=True)
class NSAConfig:
  """Native Sparse Attention (Yuan et al., 2025) for every attention layer (`jaxspec.model.nsa`).

  The defaults are NSA's published ones (the SSV paper's text lost its constants; these are what
  it says it instantiates): compression blocks of `compress_block` l = 32 tokens every
  `compress_stride` d = 16 tokens; selection blocks of `select_block` l' = 64 tokens, of which each
  query attends to `num_selected` n = 16, always including the initial block and the 2 local ones
  (the block holding the query and the one before); a sliding window of `window` w = 512 tokens.
  The three branches are mixed by learned gates, per query head and branch, sigmoid(linear(hidden
  state)); the compression is a learned linear over the block's tokens plus their mean.
  """
  compress_block: int = 32
  compress_stride: int = 16
  select_block: int = 64
  num_selected: int = 16
  window: int = 512

  def __post_init__(self):
    for name in ("compress_block", "compress_stride", "select_block", "num_selected", "window"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"NSA {name} must be a positive integer, got {value!r}")
    if self.compress_stride > self.compress_block:
      raise ValueError(f"NSA compress_stride={self.compress_stride} exceeds compress_block="
                       f"{self.compress_block}: compression blocks would skip tokens")
    if self.num_selected < 3:
      raise ValueError(f"NSA num_selected={self.num_selected} must be at least 3 (the initial "
                       "block and the 2 local blocks are always selected)")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  arch: str
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rms_norm_eps: float = 1e-6
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling | None = None
  qkv_bias: bool = False
  qk_norm: bool = False
  tie_word_embeddings: bool = False
  max_position_embeddings: int = 32768
  bos_token_id: int | None = None
  eos_token_ids: tuple[int, ...] = ()
  nsa: NSAConfig | None = None     # Native Sparse Attention in every layer; None: dense attention

  def __post_init__(self):
    if self.arch not in ARCHITECTURES:
      raise ValueError(f"unknown architecture {self.arch!r}; supported: {', '.join(ARCHITECTURES)}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
    if self.nsa is not None and not isinstance(self.nsa, NSAConfig):
      raise ValueError(f"nsa must be an NSAConfig or None, got {type(self.nsa).__name__}")

  # --- HF config.json -------------------------------------------------------------------------
  @classmethod
  def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
    """Build from a HF `config.json` dict (transformers 4.x `rope_scaling` or 5.x `rope_parameters`)."""
    arch = hf.get("model_type")
    if arch == FLA_NSA:
      return cls._from_fla_nsa(hf)
    if arch not in ARCHITECTURES:
      raise ValueError(f"unknown architecture model_type={arch!r} in config.json; "
                       f"supported: {', '.join(ARCHITECTURES + (FLA_NSA,))}")
    rope = dict(hf.get("rope_parameters") or {})
    rope.update(hf.get("rope_scaling") or {})
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    max_pos = hf.get("max_position_embeddings", 32768)
    scaling = None
    if kind in ("llama3", "yarn"):
      scaling = RopeScaling(
          kind=kind, factor=float(rope["factor"]),
          original_max_position_embeddings=int(rope.get("original_max_position_embeddings", max_pos)),
          low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
          high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
          beta_fast=float(rope.get("beta_fast") or 32.0), beta_slow=float(rope.get("beta_slow") or 1.0),
          attention_factor=rope.get("attention_factor"), mscale=rope.get("mscale"),
          mscale_all_dim=rope.get("mscale_all_dim"), truncate=bool(rope.get("truncate", True)))
    elif kind not in ("default", None):
      raise ValueError(f"unsupported RoPE scaling type {kind!r}; supported: default, llama3, yarn")
    eos = hf.get("eos_token_id")
    eos = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
    num_heads = hf["num_attention_heads"]
    return cls(
        arch=arch, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"], num_layers=hf["num_hidden_layers"],
        num_heads=num_heads, num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=float(theta), rope_scaling=scaling,
        qkv_bias=arch == "qwen2" or bool(hf.get("attention_bias", False)),
        qk_norm=arch == "qwen3", tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=max_pos, bos_token_id=hf.get("bos_token_id"), eos_token_ids=eos)

  @classmethod
  def _from_fla_nsa(cls, hf: dict[str, Any]) -> "ModelConfig":
    """fla-org/native-sparse-attention's `NSAForCausalLM` config: a Llama-shaped decoder whose
    attention is NSA with one block size for compression (mean pooling, stride = block) and
    selection, `block_counts` selected blocks and a `window_size` window."""
    try:
      hidden, heads, block = hf["hidden_size"], hf["num_heads"], hf.get("block_size", 64)
      inter = hf.get("intermediate_size")
      if inter is None:   # fla's GatedMLP: 2/3 of hidden_ratio * hidden, rounded up to 256
        inter = int(hidden * hf.get("hidden_ratio", 4) * 2 / 3)
        inter = 256 * ((inter + 255) // 256)
      eos = hf.get("eos_token_id", 2)
      return cls(
          arch="llama", vocab_size=hf["vocab_size"], hidden_size=hidden, intermediate_size=inter,
          num_layers=hf["num_hidden_layers"], num_heads=heads,
          num_kv_heads=hf.get("num_kv_heads") or heads,
          head_dim=hf.get("head_dim") or hidden // heads, rms_norm_eps=hf.get("norm_eps", 1e-6),
          rope_theta=float(hf.get("rope_theta") or 10000.0),
          qkv_bias=bool(hf.get("qkv_bias", False)),
          tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
          max_position_embeddings=hf.get("max_position_embeddings", 2048),
          bos_token_id=hf.get("bos_token_id"),
          eos_token_ids=() if eos is None else tuple(eos) if isinstance(eos, list) else (eos,),
          nsa=NSAConfig(compress_block=block, compress_stride=block, select_block=block,
                        num_selected=hf.get("block_counts", 16),
                        window=hf.get("window_size", 512)))
    except KeyError as e:
      raise ValueError(f"NSA config.json has no {e.args[0]!r}") from None

  # --- our own serialisation (written next to orbax checkpoints) -------------------------------
  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
    d = dict(d)
    if d.get("rope_scaling"):
      d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
    d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
    if d.get("nsa"):
      d["nsa"] = NSAConfig(**d["nsa"])
    return cls(**d)

  @property
  def kv_bytes_per_token(self) -> int:
    """Bytes of K+V per token across all layers in bf16."""
    return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 2
