"""The model: one Flax NNX decoder, its config, RoPE, the KV cache, the attention dispatch and NSA."""
from jaxspec.model.config import ModelConfig, NSAConfig, RopeScaling
from jaxspec.model.kv_cache import KVCache
from jaxspec.model.transformer import Transformer, abstract_model, init_random

__all__ = ["ModelConfig", "NSAConfig", "RopeScaling", "KVCache", "Transformer", "abstract_model",
           "init_random"]
