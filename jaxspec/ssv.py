"""SSV (../shared/papers/ssv.txt): speculative decoding of a Native Sparse Attention model whose
verification pass runs one of SSV's schedules (`jaxspec.model.nsa`), and the file that holds a
refresh/reuse schedule.

Method 'ssv' (`jaxspec.engine.runner.Runner(method="ssv", ...)`) drafts with a separate draft
model (dense or NSA), or with the NSA model itself, and verifies the round's rows, a chain or a
whole draft tree, in one NSA pass under the class's schedule:

  strict        the exact merged schedule alone (`group` rows share one load of the union of
                their selected blocks): lossless, greedy output is the NSA model's own;
  reuse         strict plus the refresh/reuse layer schedule (reuse layers take the selected
                blocks of the nearest earlier refresh layer): CHANGES the output;
  approx        strict plus the shared index (each group's last row selects for the group):
                CHANGES the output;
  approx_reuse  both: CHANGES the output.

Speculative sampling stays exact with respect to the verifier: under reuse and approx the output
is that of the NSA model run with the schedule in its verification passes (prefill and the draft
are not affected), not the NSA model's own.

Self-drafting (no draft model): the NSA model drafts with its own plain NSA decoding over a second
cache. Under strict and greedy decoding every draft is then accepted (the drafts are the verifier's
own tokens), so this saves nothing there; it measures how far reuse and approx verification agree
with the exact model, and is the place a cheaper NSA drafter (fewer selected blocks) would go.

The schedule file (`python -m jaxspec.ssv_calibrate` writes it, beside the checkpoint by default:
`default_schedule_path`) is a small JSON: `refresh`, one bool per layer, and the model's
fingerprint (`jaxspec.pairmap.fingerprint`), so that a schedule is never applied to a model it was
not calibrated on.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Sequence

import jax
import numpy as np

from jaxspec.model import nsa
from jaxspec.model.attention import NSA

CLASSES = ("strict", "reuse", "approx", "approx_reuse")
REUSE_CLASSES = ("reuse", "approx_reuse")
SCHEDULE_FILE = "ssv_schedule.json"
SCHEDULE_KIND = "jaxspec.ssv_schedule"


@dataclasses.dataclass(frozen=True)
class SSVConfig:
  """Method 'ssv''s verification schedule, static. ssv_class: one of CLASSES; group: rows per
  group of the merged schedule (and of the shared index, for approx classes); refresh: one bool
  per layer for reuse classes (False: reuse the selection of the nearest earlier refresh layer),
  None for the others."""
  ssv_class: str = "strict"
  group: int = 1
  refresh: tuple[bool, ...] | None = None

  @property
  def shared(self) -> bool:
    return self.ssv_class in ("approx", "approx_reuse")

  @property
  def lossless(self) -> bool:
    return self.ssv_class == "strict"

  def plan(self, tree_bits: jax.Array | None = None) -> NSA:
    """The verification pass's attention plan (tree_bits: the rows are a whole draft tree)."""
    return NSA(tree_bits=tree_bits, group=self.group, shared=self.shared, refresh=self.refresh)


def check_class(value, name: str = "ssv_class") -> str:
  if value not in CLASSES:
    raise ValueError(f"{name} must be one of {', '.join(CLASSES)}, got {value!r}")
  return value


def check_group(value, name: str = "ssv_group") -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
    raise ValueError(f"{name} must be a positive number of verification rows, got {value!r}")
  return int(value)


def make_config(model, ssv_class: str | None, group: int | None,
                refresh: Sequence[bool] | None) -> SSVConfig:
  """Method 'ssv''s settings for `model` (an NSA `Transformer`), checked: one-line ValueErrors.
  ssv_class defaults to 'strict', group to 1; reuse classes need `refresh`, the others refuse it."""
  if model.cfg.nsa is None:
    raise ValueError("method 'ssv' verifies a Native Sparse Attention model (ModelConfig.nsa); "
                     "this target has dense attention")
  cls = check_class("strict" if ssv_class is None else ssv_class)
  group = check_group(1 if group is None else group)
  if cls in REUSE_CLASSES:
    if refresh is None:
      raise ValueError(f"ssv_class {cls!r} needs a refresh/reuse schedule (refresh=, or "
                       "--ssv_schedule: python -m jaxspec.ssv_calibrate makes one)")
    refresh = nsa.check_refresh(refresh, model.cfg.num_layers)
  elif refresh is not None:
    raise ValueError(f"a refresh/reuse schedule is for ssv_class 'reuse' or 'approx_reuse'; "
                     f"{cls!r} selects in every layer")
  return SSVConfig(ssv_class=cls, group=group, refresh=refresh)


# ----------------------------------------------------------------------------------------------
# The schedule file

def default_schedule_path(source: str | Path) -> Path:
  """Beside the checkpoint: <dir>/ssv_schedule.json, or <file>.ssv_schedule.json for a file."""
  src = Path(source)
  return src / SCHEDULE_FILE if src.is_dir() else src.with_name(f"{src.name}.{SCHEDULE_FILE}")


def schedule_record(model, refresh: Sequence[bool], **info) -> dict:
  """The file's contents: the schedule, the model's fingerprint, and what made it (`info`)."""
  from jaxspec.pairmap import fingerprint
  refresh = nsa.check_refresh(tuple(bool(r) for r in refresh), model.cfg.num_layers)
  return dict(kind=SCHEDULE_KIND, refresh=list(refresh),
              reuse_layers=[i for i, r in enumerate(refresh) if not r],
              model=fingerprint(model), **info)


def save_schedule(record: dict, path: str | Path) -> Path:
  from jaxspec.pairmap import save_json
  return save_json(record, path)


def load_schedule(path: str | Path, model) -> tuple[bool, ...]:
  """The refresh schedule in `path`, checked against `model`: a one-line ValueError when the file
  is not a schedule, or was calibrated on another model."""
  from jaxspec.pairmap import fingerprint
  try:
    raw = json.loads(Path(path).read_text())
    if raw.get("kind") != SCHEDULE_KIND:
      raise ValueError(f"kind is {raw.get('kind')!r}, not {SCHEDULE_KIND!r}")
    refresh, saved = raw["refresh"], dict(raw["model"])
  except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
    raise ValueError(f"cannot read the SSV schedule {path}: {e}") from None
  now = fingerprint(model)
  if any(saved.get(k) != now[k] for k in now):
    raise ValueError(f"the SSV schedule {path} was calibrated on another model "
                     f"({saved.get('layers')} layers, config {saved.get('config')}); run "
                     "python -m jaxspec.ssv_calibrate on this one")
  try:
    return nsa.check_refresh(refresh, model.cfg.num_layers)
  except ValueError as e:
    raise ValueError(f"the SSV schedule {path}: {e}") from None
