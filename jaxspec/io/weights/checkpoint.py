"""jaxspec checkpoints: an orbax tree of the params, our config, and normal tokenizer files.

Layout of `checkpoints/NAME/`:
  params/                  orbax (StandardCheckpointer) tree: nested dict of the nnx Param state
  jaxspec_config.json      ModelConfig.to_dict()
  tokenizer.json, tokenizer_config.json, chat_template.jinja, ...   tokenizer.save_pretrained()
  generation_config.json   copied from the source when it has one

Writing is atomic: everything goes into a temp dir beside the target, renamed into place at the
end; any failure (KeyboardInterrupt included) removes the temp dir, so a checkpoint dir that exists
is complete. Loading restores straight into the abstract model's shapes at the requested dtype.
"""
from __future__ import annotations

import contextlib
import json
import shutil
import sys
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from jaxspec.model.config import ModelConfig
from jaxspec.model.transformer import Transformer
from jaxspec.io.weights import (CONFIG_FILE, PARAMS_DIR, WeightsError, abstract_params, build_model,
                             check_params, flat, nested)

if TYPE_CHECKING:
  from transformers import PreTrainedTokenizerBase


def is_checkpoint(path: str | Path) -> bool:
  return (Path(path) / CONFIG_FILE).is_file()


@contextlib.contextmanager
def atomic_dir(out: str | Path, *, overwrite: bool = False) -> Iterator[Path]:
  """Yield a fresh temp dir beside `out`; on success it becomes `out`, on any failure it is removed."""
  out = Path(out).absolute()
  if out.exists() and not overwrite:
    raise FileExistsError(f"{out} already exists; pass --overwrite to replace it")
  out.parent.mkdir(parents=True, exist_ok=True)
  tmp = out.with_name(f".{out.name}.tmp-{uuid.uuid4().hex[:8]}")
  tmp.mkdir()   # not mkdtemp: its 0700 mode would stick to the checkpoint after the rename
  try:
    yield tmp
    if out.exists():
      old = out.with_name(f".{out.name}.old-{uuid.uuid4().hex[:8]}")
      out.rename(old)
      try:
        tmp.rename(out)
      except BaseException:
        old.rename(out)
        raise
      shutil.rmtree(old, ignore_errors=True)
    else:
      tmp.rename(out)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise


def save(out: str | Path, cfg: ModelConfig, params: Mapping[str, Any], *,
         tokenizer: PreTrainedTokenizerBase | None = None,
         copy_files: Mapping[str, Path] | None = None, overwrite: bool = False) -> Path:
  """Write a complete checkpoint of `params` (flat {param path: array}) to `out`, atomically.

  copy_files: {name in checkpoint: source file}, e.g. generation_config.json.
  """
  check_params(cfg, params, "params to save")   # never write a checkpoint that cannot load
  out = Path(out).absolute()
  with atomic_dir(out, overwrite=overwrite) as tmp:
    print(f"writing orbax checkpoint to {out}", file=sys.stderr)
    with ocp.StandardCheckpointer() as ckptr:
      ckptr.save(tmp / PARAMS_DIR, nested(params))
      ckptr.wait_until_finished()
    _write_config(tmp / CONFIG_FILE, cfg)
    if tokenizer is not None:
      tokenizer.save_pretrained(str(tmp))
    for name, src in (copy_files or {}).items():
      shutil.copyfile(src, tmp / name)
  return out


def _write_config(path: Path, cfg: ModelConfig) -> None:
  path.write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")


def read_config(path: str | Path) -> ModelConfig:
  path = Path(path)
  if not path.is_dir():
    raise WeightsError(f"checkpoint directory {path} does not exist")
  f = path / CONFIG_FILE
  if not f.is_file():
    raise WeightsError(f"{path} is not a jaxspec checkpoint: {CONFIG_FILE} is missing")
  try:
    return ModelConfig.from_dict(json.loads(f.read_text()))
  except (json.JSONDecodeError, TypeError, ValueError, KeyError) as e:
    raise WeightsError(f"corrupt checkpoint config {f}: {type(e).__name__}: {e}") from e


def load(path: str | Path, *, dtype=jnp.bfloat16) -> tuple[ModelConfig, Transformer]:
  """(config, model) from a checkpoint dir: orbax restores into the model's shapes at `dtype`."""
  path = Path(path).absolute()
  cfg = read_config(path)
  params_dir = path / PARAMS_DIR
  if not params_dir.is_dir():
    raise WeightsError(f"corrupt checkpoint {path}: {PARAMS_DIR}/ is missing")
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  # A sharding on every leaf makes orbax return device arrays (numpy ones otherwise); the target
  # dtype makes it cast while restoring.
  target = nested({k: jax.ShapeDtypeStruct(v.shape, dtype, sharding=device)
                   for k, v in abstract_params(cfg, dtype).items()})
  try:
    with ocp.StandardCheckpointer() as ckptr:
      _check_stored_shapes(ckptr, params_dir, cfg, path)
      restored = ckptr.restore(params_dir, target)
  except WeightsError:
    raise
  except Exception as e:   # orbax/tensorstore raise many types for truncated or garbled files
    raise WeightsError(f"corrupt checkpoint {path}: orbax could not restore {PARAMS_DIR}/: "
                       f"{type(e).__name__}: {str(e)[:500]}") from e
  return cfg, build_model(cfg, flat(restored), dtype=dtype, source=str(path))


def _check_stored_shapes(ckptr: ocp.StandardCheckpointer, params_dir: Path, cfg: ModelConfig,
                         path: Path) -> None:
  """Compare the stored tree with the config before restoring, so a mismatch is named clearly."""
  try:
    meta = ckptr.metadata(params_dir)
    # Newer orbax wraps the tree in StepMetadata.item_metadata(.tree); older returns it bare.
    tree = getattr(meta, "item_metadata", meta)
    tree = dict(getattr(tree, "tree", tree))
  except Exception:   # unreadable metadata: let restore report the corruption
    return
  check_params(cfg, flat(tree), f"checkpoint {path}")


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase | None:
  """The tokenizer saved in the checkpoint, or None when it was converted without one."""
  from transformers import AutoTokenizer
  path = Path(path)
  if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
    return None
  return AutoTokenizer.from_pretrained(str(path))
