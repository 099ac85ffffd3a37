"""jaxspec: lossless self-speculative decoding with sparse attention (Vegas) in JAX and Pallas.

Entry points: `jaxspec.loading.load_model`, `jaxspec.decode.generate` (vanilla),
`jaxspec.speculative.speculative_generate` (Vegas and the baselines), and the CLI
`python -m jaxspec.generate`. See README.md.
"""
__version__ = "0.1.0"
