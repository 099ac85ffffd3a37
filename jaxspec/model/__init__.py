"""The model: one Flax NNX decoder, its config, RoPE, the KV cache and the attention dispatch."""
from jaxspec.model.config import ModelConfig, RopeScaling
from jaxspec.model.kv_cache import KVCache
from jaxspec.model.transformer import Transformer, abstract_model, init_random

__all__ = ["ModelConfig", "RopeScaling", "KVCache", "Transformer", "abstract_model", "init_random"]
