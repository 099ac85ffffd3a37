"""jaxspec: speculative decoding with sparse attention (Vegas and its baselines, draft models) in
JAX and Pallas.

Entry points: `jaxspec.io.loading.load_model`, `jaxspec.engine.runner.Runner` (vanilla,
self-drafting and draft-model decoding; `generate` and continuous-batching `serve`), and the CLI
`python -m jaxspec.generate`. See README.md.
"""
__version__ = "0.1.0"
