"""jaxspec checkpoints: an orbax tree of the params, our config, and normal tokenizer files.

Layout of `checkpoints/NAME/`:
  params/                  orbax (StandardCheckpointer) tree: nested dict of the nnx Param state
  jaxspec_config.json      ModelConfig.to_dict()
  tokenizer.json, tokenizer_config.json, chat_template.jinja, ...   tokenizer.save_pretrained()
  generation_config.json   copied from the source when it has one
  params_files.json        {file under params/: size in bytes}, checked before restoring

Writing is atomic: everything goes into a temp dir beside the target (`.NAME.tmp-PID-XXXXXXXX`),
renamed into place at the end; any failure (KeyboardInterrupt included) removes the temp dir, so a
checkpoint dir that exists is complete. SIGINT/SIGTERM are held while orbax's threads write the
params, so the cleanup never races them; a temp dir that a killed run (SIGKILL, power loss) left
is removed by the next write to the same target, once its PID is gone. `--overwrite` replaces only
an existing checkpoint (or an empty dir), never a file or another directory.
Loading restores straight into the abstract model's shapes at the requested dtype, and on a
tensor-parallel mesh straight into each parameter's shards (orbax reads each device's slice).
A damaged checkpoint raises one WeightsError: a missing or truncated params file is named from the
sizes recorded at conversion; anything else orbax cannot read names the parameter.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import sys
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from jax.sharding import Mesh

from jaxspec import cli
from jaxspec.model import sharding
from jaxspec.model.config import ModelConfig
from jaxspec.model.transformer import Transformer
from jaxspec.io.weights import (CONFIG_FILE, PARAMS_DIR, WeightsError, abstract_params, build_model,
                             check_params, flat, load_saved_tokenizer, nested)

PARAMS_FILES = "params_files.json"

if TYPE_CHECKING:
  from transformers import PreTrainedTokenizerBase


def is_checkpoint(path: str | Path) -> bool:
  return (Path(path) / CONFIG_FILE).is_file()


def check_target(out: str | Path, overwrite: bool) -> None:
  """Raise FileExistsError unless a checkpoint may be written at `out`: nothing is there, or
  `overwrite` is set and it is a checkpoint or an empty directory."""
  out = Path(out)
  if not out.exists():
    return
  if not overwrite:
    raise FileExistsError(f"{out} already exists; pass --overwrite to replace it")
  if not out.is_dir():
    raise FileExistsError(f"{out} is a file, not a checkpoint; --overwrite replaces only a "
                          "jaxspec checkpoint directory")
  if not is_checkpoint(out) and any(out.iterdir()):
    raise FileExistsError(f"{out} is not a jaxspec checkpoint ({CONFIG_FILE} is missing); "
                          "--overwrite replaces only a checkpoint directory")


# .NAME.tmp-PID-XXXXXXXX (being written) and .NAME.old-PID-XXXXXXXX (the checkpoint being
# replaced); names without the PID are from before it was recorded.
_TEMP_NAME = re.compile(r"\.(?P<name>.+)\.(?P<kind>tmp|old)-(?:(?P<pid>\d+)-)?[0-9a-f]{8}")


def _temp_path(out: Path, kind: str) -> Path:
  return out.with_name(f".{out.name}.{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def _alive(pid: str | None) -> bool:
  if pid is None:
    return False
  try:
    os.kill(int(pid), 0)
  except ProcessLookupError:
    return False
  except (PermissionError, OverflowError):
    return True   # another user's process, or a PID we cannot judge: leave its dir alone
  return True


def sweep_stale(out: str | Path) -> list[Path]:
  """Remove the temp dirs beside `out` whose writer is gone (killed before it could clean up),
  saying so on stderr; return them. An `.old` dir is kept while `out` is missing: it is then the
  only copy of a checkpoint whose replacement was cut short."""
  out = Path(out)
  removed = []
  for p in sorted(out.parent.glob(f".{out.name}.*-*")):
    m = _TEMP_NAME.fullmatch(p.name)
    if not m or m["name"] != out.name or _alive(m["pid"]) or not p.is_dir():
      continue
    if m["kind"] == "old" and not out.exists():
      continue
    shutil.rmtree(p, ignore_errors=True)
    print(f"removed {p}, left by an interrupted conversion", file=sys.stderr)
    removed.append(p)
  return removed


@contextlib.contextmanager
def atomic_dir(out: str | Path, *, overwrite: bool = False) -> Iterator[Path]:
  """Yield a fresh temp dir beside `out`; on success it becomes `out`, on any failure it is removed.

  With `overwrite`, an existing checkpoint at `out` is swapped out and deleted (see check_target).
  """
  out = Path(out).absolute()
  check_target(out, overwrite)
  out.parent.mkdir(parents=True, exist_ok=True)
  sweep_stale(out)
  tmp = _temp_path(out, "tmp")
  tmp.mkdir()   # not mkdtemp: its 0700 mode would stick to the checkpoint after the rename
  try:
    yield tmp
    if not out.exists():
      tmp.rename(out)
    else:
      old = _temp_path(out, "old")
      with cli.signals_deferred("replacing the checkpoint"):   # never leave `out` missing
        out.rename(old)
        try:
          tmp.rename(out)
        except BaseException:
          old.rename(out)
          raise
      shutil.rmtree(old, ignore_errors=True)   # if cut short, the next write sweeps the rest
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
    # orbax writes from background threads: an interrupt here would unwind only our thread, and
    # they would go on writing into the temp dir after its cleanup.
    with cli.signals_deferred("the orbax write"), ocp.StandardCheckpointer() as ckptr:
      ckptr.save(tmp / PARAMS_DIR, nested(params))
      cli.interrupt_point("checkpoint-write")
      ckptr.wait_until_finished()
    sizes = {str(f.relative_to(tmp)): f.stat().st_size
             for f in sorted((tmp / PARAMS_DIR).rglob("*")) if f.is_file()}
    (tmp / PARAMS_FILES).write_text(json.dumps(sizes, indent=1) + "\n")
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


def load(path: str | Path, *, dtype=jnp.bfloat16, mesh: Mesh | None = None
         ) -> tuple[ModelConfig, Transformer]:
  """(config, model) from a checkpoint dir: orbax restores into the model's shapes at `dtype`,
  on `mesh` (None: the first device) with each parameter's tensor-parallel sharding."""
  path = Path(path).absolute()
  cfg = read_config(path)
  sharding.check_divides(cfg, mesh, str(path))
  params_dir = path / PARAMS_DIR
  if not params_dir.is_dir():
    raise WeightsError(f"corrupt checkpoint {path}: {PARAMS_DIR}/ is missing")
  _check_file_sizes(path)
  # A sharding on every leaf makes orbax return device arrays (numpy ones otherwise), each device
  # reading only its own slice; the target dtype makes it cast while restoring.
  target = nested({k: jax.ShapeDtypeStruct(v.shape, dtype,
                                           sharding=sharding.param_sharding(k, mesh))
                   for k, v in abstract_params(cfg, dtype).items()})
  unsilence = _silence_orphaned_reads()
  try:
    with ocp.StandardCheckpointer() as ckptr:
      _check_stored_shapes(ckptr, params_dir, cfg, path)
      restored = ckptr.restore(params_dir, target)
  except WeightsError:
    unsilence()
    raise
  except Exception as e:   # orbax/tensorstore raise many types for truncated or garbled files
    # The silencing stays: the failed restore's other reads go on finishing after we return.
    raise WeightsError(f"corrupt checkpoint {path}: {_restore_error(e, params_dir)}") from e
  unsilence()
  return cfg, build_model(cfg, flat(restored), dtype=dtype, source=str(path), mesh=mesh)


def _restore_error(e: BaseException, params_dir: Path) -> str:
  """One line for a failed restore: the parameter and the file that could not be read, and
  tensorstore's reason, without the multi-line TensorStore spec that orbax's message carries."""
  chain = []
  while e is not None and len(chain) < 8:
    chain.append(e)
    e = e.__cause__ or e.__context__
  # tensorstore's own errors start with a status: 'OUT_OF_RANGE: Error reading "x.kernel/0.0" ...'
  msg = next((str(x) for x in chain if re.match(r"[A-Z_]+: ", str(x))),
             f"{type(chain[0]).__name__}: {chain[0]}")
  msg = msg.split(" [tensorstore_spec")[0].splitlines()[0]
  msg = re.sub(r' in OCDBT database at local file "[^"]*"', "", msg)
  param = re.search(r'"([\w.]+)/(?:\.zarray|[\d.]+)"', msg)
  what = f"cannot read parameter {param[1].replace('.', '/')}" if param else "cannot restore"
  return f"{what} from {PARAMS_DIR}/ ({msg[:300]}); convert the model again"


def _check_file_sizes(path: Path) -> None:
  """Name a missing or truncated params file from the sizes recorded at conversion (orbax would
  blame whichever parameter it read first from it). Checkpoints without the record pass."""
  try:
    sizes = json.loads((path / PARAMS_FILES).read_text())
  except (OSError, ValueError):
    return
  for name, size in sizes.items():
    f = path / name
    if not f.is_file():
      raise WeightsError(f"corrupt checkpoint {path}: {name} is missing; convert the model again")
    if f.stat().st_size != size:
      raise WeightsError(f"corrupt checkpoint {path}: {name} is {f.stat().st_size:,} bytes, "
                         f"{size:,} when written; convert the model again")


def _silence_orphaned_reads() -> Callable[[], None]:
  """Drop the echoes of a failed restore; returns the function that stops dropping them.

  orbax reads every array concurrently and, when one read fails, closes the event loop while the
  others are still in flight; each of those then ends as an unraisable exception ('Event loop is
  closed', or the read's own error) or as asyncio's 'exception was never retrieved' log record:
  dozens of tracebacks around the one-line error. `load` installs this before restoring (the
  first echoes can come before orbax raises) and removes it when the restore succeeded. Anything
  else still reaches the previous hook and the asyncio logger.
  """
  previous = sys.unraisablehook

  def hook(u):
    closed = isinstance(u.exc_value, RuntimeError) and str(u.exc_value) == "Event loop is closed"
    if closed or "_read_array_index_and_device_put" in getattr(u.object, "__qualname__", ""):
      return
    previous(u)

  def log_filter(record: logging.LogRecord) -> bool:
    msg = record.getMessage()
    return not ("exception was never retrieved" in msg
                and ("reading array index" in msg or "OCDBT database" in msg))

  sys.unraisablehook = hook
  asyncio_logger = logging.getLogger("asyncio")
  asyncio_logger.addFilter(log_filter)

  def remove():
    if sys.unraisablehook is hook:
      sys.unraisablehook = previous
    asyncio_logger.removeFilter(log_filter)
  return remove


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
  path = Path(path)
  if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
    return None
  return load_saved_tokenizer(path)
