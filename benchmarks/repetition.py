"""The paired repetition test for throughput JSONs on record: each method's distinct-4-gram shares
against vanilla's in the same run, request by request (`benchmarks.common.paired_repetition`).

  python -m benchmarks.repetition benchmarks/results/throughput_long_*.json

prints, per file and method, the requests both rows finished, the mean difference (method -
vanilla) ± its standard error and the two-sided Wilcoxon signed-rank p; --out writes the same
as JSON. A lossless method's difference is zero within noise. `benchmarks.throughput` records
the same figures in each row it writes (`distinct_4gram_share_paired`).
"""
from __future__ import annotations

from absl import app, flags

from benchmarks.common import paired_rows, read_throughput_json, write_json
from jaxspec import cli

_BASELINE = flags.DEFINE_string("baseline", "none", "the method the others are paired against")
_OUT = flags.DEFINE_string("out", None, "also write the results to this JSON file")


def main(argv):
  cli.quiet_logging()
  paths = argv[1:]
  if not paths:
    raise app.UsageError("name one or more throughput JSON files")
  results = {}
  for path in paths:
    try:
      results[path] = paired_rows(read_throughput_json(path), _BASELINE.value)
    except (OSError, ValueError) as e:
      cli.fail("benchmarks.repetition", f"{path}: {e}")
  for path, entries in results.items():
    print(path)
    for e in entries:
      if "requests" not in e:
        print(f"  {e['label']:<24} no per-request figures to pair")
        continue
      se = "-" if e["stderr"] is None else f"{e['stderr']:.3f}"
      print(f"  {e['label']:<24} {e['requests']:>4} requests  {e['mean_diff']:+.3f} ± {se}  "
            f"Wilcoxon p {e['wilcoxon_p']:.2f}")
  if _OUT.value:
    write_json(_OUT.value, results)


if __name__ == "__main__":
  app.run(main)
