#!/usr/bin/env bash
# The GPU runs recorded in benchmarks/RESULTS.md, as they were made on the lent machine.
# Weights travel as the GGUF file in chunks (../shared/tools/ship_chunks.sh) to /tmp/shipped/;
# the gguf package as a wheel in .whl/, the data files (../shared/data) in .data/.
# Usage: bash benchmarks/run_gpu.sh STEP...
#   prep        install the carried wheels, convert the GGUF to an orbax checkpoint
#   smoke       real-weight greedy generation on the GPU: vanilla vs vegas (must match)
#   decode      vanilla decode roofline runs (issue 2)
#   throughput  continuous-batching runs, several methods (issue 5)
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:. XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 JAXSPEC_DATA=.data
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
CKPT=/tmp/ckpt/qwen2.5-coder-0.5b
for step in "$@"; do
  echo "=== $step ==="
  case $step in
    prep)
      python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
      echo "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32  /tmp/shipped/qwen05.gguf" | sha256sum -c || exit 1
      python3 -m jaxspec.convert --src=/tmp/shipped/qwen05.gguf --out=$CKPT --dtype=bfloat16 2>&1 | tail -3
      nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv ;;
    smoke)
      for m in none vegas; do
        python3 -m jaxspec.generate --model=$CKPT --chat --max_new_tokens=96 --method=$m \
          --min_tokens=16 --prompt "Write a Python function that checks whether a number is prime." \
          > "$OUT/smoke_$m.txt" 2> "$OUT/smoke_$m.err"; echo "rc=$?"; tail -2 "$OUT/smoke_$m.err"
      done
      head -c 600 "$OUT/smoke_none.txt"; echo
      cmp "$OUT/smoke_none.txt" "$OUT/smoke_vegas.txt" && echo "smoke: vegas == vanilla (greedy)" ;;
    decode)
      python3 -m benchmarks.decode --model=$CKPT --batch_sizes=1,16,64 \
        --contexts=4096,16384,32768 --steps=16 --reps=3 --out=$OUT/decode_qwen05.json 2>&1 | tail -12
      python3 -m benchmarks.decode --model=random:qwen3-8b --batch_sizes=4 --contexts=131072 \
        --steps=8 --reps=3 --out=$OUT/decode_qwen3_8b.json 2>&1 | tail -4 ;;
    throughput)
      # --ignore_eos: the 0.5B coder ends most answers early; the paper's workloads keep long contexts.
      python3 -m benchmarks.throughput --model=$CKPT --workload=long --batch=64 \
        --methods=none,streaming,quest,vegas-all,vegas --gammas=vegas=6,vegas-all=6,default=4 \
        --max_new_tokens=1024 --ignore_eos --num_requests=512 --warmup_s=10 --measure_s=25 \
        --noprofile --out=$OUT/throughput_long.json 2>&1 | tail -9 ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
