"""Weights in and out: HF safetensors, GGUF and orbax checkpoints, and `load_model`."""
