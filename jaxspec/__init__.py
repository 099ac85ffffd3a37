"""jaxspec: speculative decoding with sparse attention (Vegas and its baselines, draft models) in
JAX and Pallas.

Lossless as speculative sampling is: sampled output follows plain decoding's distribution, and
greedy output equals plain greedy decoding exactly in float32; in bfloat16 the verification pass
and the one-token step round differently, so greedy texts can part at a near-tie (README, "What
lossless means here").

Entry points: `jaxspec.io.loading.load_model`, `jaxspec.engine.runner.Runner` (vanilla,
self-drafting and draft-model decoding; `generate` and continuous-batching `serve`), and the CLI
`python -m jaxspec.generate`. See README.md.
"""
__version__ = "0.1.0"
