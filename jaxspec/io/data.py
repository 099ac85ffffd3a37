"""The project's data files (../shared/data beside the repository, or $JAXSPEC_DATA)."""
from __future__ import annotations

import os

DATA = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data")


def data_path(name: str) -> str:
  """The path of data file `name`; a one-line FileNotFoundError when it is not there."""
  path = os.path.abspath(os.path.join(os.environ.get("JAXSPEC_DATA", DATA), name))
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path} not found: jaxspec reads ../shared/data beside the repo "
                            "(or set JAXSPEC_DATA)")
  return path
