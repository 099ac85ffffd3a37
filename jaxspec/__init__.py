"""jaxspec: lossless self-speculative decoding with sparse attention (Vegas) in JAX and Pallas.

Entry points: `jaxspec.io.loading.load_model`, `jaxspec.engine.decode.generate` (vanilla),
`jaxspec.engine.speculative.speculative_generate` (Vegas and the baselines), and the CLI
`python -m jaxspec.generate`. See README.md.
"""
__version__ = "0.1.0"
