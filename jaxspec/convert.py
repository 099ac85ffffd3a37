"""Convert a HF safetensors directory or a GGUF file into a jaxspec (orbax) checkpoint.

`python -m jaxspec.convert --src=PATH --out=checkpoints/NAME [--dtype=bfloat16|float32] [--overwrite]`

Writes params (orbax), jaxspec_config.json and the tokenizer files; see jaxspec.io.weights.checkpoint.
A failed or interrupted (Ctrl-C, SIGTERM) conversion leaves nothing at --out and nothing beside it;
temp dirs that a killed conversion left beside --out are removed, and said so, by the next one.
--overwrite replaces only an existing checkpoint, never a file or another directory.
"""
from __future__ import annotations

import sys
from pathlib import Path

import jax.numpy as jnp
from absl import flags

from jaxspec import cli
from jaxspec.io.weights import WeightsError, source_kind
from jaxspec.io.weights import checkpoint
from jaxspec.io.weights import gguf as gguf_weights
from jaxspec.io.weights import hf as hf_weights

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


def convert(src: str | Path, out: str | Path, *, dtype=jnp.bfloat16, overwrite: bool = False,
            progress: bool = True) -> Path:
  """Read `src` (HF dir or GGUF file), write a checkpoint at `out`; return `out`."""
  src, out = Path(src), Path(out)
  checkpoint.check_target(out, overwrite)   # fail before the slow part; atomic_dir checks again
  kind = source_kind(src)
  copy_files = {}
  if kind == "hf":
    cfg = hf_weights.read_config(src)
    params = hf_weights.read_params(src, cfg, dtype=dtype, progress=progress)
    tokenizer = hf_weights.load_tokenizer(src)
    if (src / "generation_config.json").is_file():
      copy_files["generation_config.json"] = src / "generation_config.json"
  elif kind == "gguf":
    reader = gguf_weights.open_reader(src)
    cfg = gguf_weights.read_config(reader, str(src))
    tokenizer = gguf_weights.load_tokenizer(src, cfg.arch)   # before the slow part: may need torch
    params = gguf_weights.read_params(reader, cfg, dtype=dtype, progress=progress, source=str(src))
  else:
    raise WeightsError(f"{src} is already a jaxspec checkpoint; load it directly")
  if tokenizer is None:
    print(f"warning: {src} has no tokenizer files; the checkpoint will have none", file=sys.stderr)
  return checkpoint.save(out, cfg, params, tokenizer=tokenizer, copy_files=copy_files,
                         overwrite=overwrite)


def main(argv: list[str]) -> None:
  del argv
  cli.quiet_logging()
  F = flags.FLAGS
  try:
    out = convert(F.src, F.out, dtype=DTYPES[F.dtype], overwrite=F.overwrite)
  except (OSError, ValueError) as e:   # WeightsError, FileExistsError, unknown architecture
    print(f"error: {e}", file=sys.stderr)
    sys.exit(1)
  print(out)


if __name__ == "__main__":
  # Flags live here, not at import time, so importing convert (fetch and loading do) never
  # clashes with the flags of another entry point such as jaxspec.generate.
  flags.DEFINE_string("src", None, "HF model directory or GGUF file", required=True)
  flags.DEFINE_string("out", None, "checkpoint directory to create, e.g. checkpoints/NAME",
                      required=True)
  flags.DEFINE_enum("dtype", "bfloat16", list(DTYPES), "dtype the params are stored in")
  flags.DEFINE_bool("overwrite", False, "replace an existing checkpoint at --out")
  cli.run(main, "jaxspec.convert")
