#!/usr/bin/env bash
# The GPU runs recorded in benchmarks/RESULTS.md, as they were made on the lent machine.
# Weights travel as the GGUF file in chunks (../shared/tools/ship_chunks.sh) to /tmp/shipped/
# (qwen05.gguf, or qwen15.gguf with MODEL=1.5b). Both at once in 28 calls (about 190 s of held
# time): split the concatenation (0.5B first) into 56 MiB parts (a part and the tracked tree must
# fit one call's 64 MiB), append them to /tmp/shipped/all,
# cut it at the 0.5B's 491,400,064 bytes (head -c / tail -c +491400065), check both sha256s;
# the gguf package as a wheel in .whl/, the data files (../shared/data) in .data/.
# Send the first part alone and the rest only once it has run: when the first call starts no
# machine, the others reach a fresh one and their appends fail (the file is not there).
# Usage: bash benchmarks/run_gpu.sh STEP...
# JAXSPEC_COMMIT=<sha> names the commit in every JSON: the machine's copy of the tree may carry a
# stale .git, and the JSONs would then name an older commit.
#   prep        install the carried wheels, convert the GGUF to an orbax checkpoint
#   smoke       real-weight greedy generation on the GPU: vanilla vs vegas (must match)
#   decode      vanilla decode roofline runs
#   sweep       Vegas's (gamma, ratio) tuning on the long workload, Fig. 8 / Fig. 13 PNGs
#   long, short, cont
#               continuous-batching runs of every method, at GAMMA / RATIO from the sweep:
#               long = 16K-32K-token passages + a question (chat), 1024 new tokens; short =
#               AIME25/GSM8K (chat), 4096 new tokens; cont = 16K-32K-token passages as plain text
#               continued for 1024 tokens (MagicDec / TriForce's PG-19 workload)
#               (METHODS overrides the method list; WARMUP / MEASURE the window, default 6 / 12 s;
#               BATCH the decode slots, default 128: the throughput goals' batch cap;
#               REQUESTS the stream's length, default 512: short answers at B = 128 need more;
#               PROMPT_BUCKETS the padded prompt lengths per power of two, default 8;
#               CHUNK_ROUNDS the rounds or steps per call, default 8 for every method
#               (none=32,default=8 gives vanilla its best length on short, forty-third session);
#               SEED the prompts' and the sampling's seed, default 0: runs with one seed share
#               their prompts, draws and mostly their tokens, so their paired differences are
#               not independent;
#               SUFFIX is appended to the output file's name; FP8_DRAFTS=1 passes --fp8_drafts: the
#               speculative methods draft on FP8 copies of the MLP weights; SCORE_POOL=W passes
#               --score_pool=W: the vegas family pools its scores over W positions before the top-k;
#               SCORE=weights passes --score=weights: the vegas family ranks keys by Collect-2's
#               softmax weights rather than its logits;
#               SCORE_BLOCK=N passes --score_block=N: its top-k keeps aligned blocks of N positions;
#               SCORE_WINDOW=W passes --score_window=W: it keeps the newest W positions whole)
#   prefill     one-prompt prefills (a serving refill) of 16K-32K tokens against the bf16 matmul
#               rate, random weights, the 1.5B then the 0.5B, prompts padded to powers of two and
#               to eight lengths per power of two, with a kernel trace (SUFFIX as above)
#   scale       Qwen3-8B shapes, random weights, 4 x 128K: ms per step and per round
#   levers      XLA command buffers (default, off, extended to WHILE/CONDITIONAL) and fused
#               q/k/v and gate/up GEMMs (fused: --fuse_projections) on the scale workload at the
#               0.5B's shapes, 64 x 24K, one process per setting (SETTINGS, default "default off
#               while"; SHAPE, BATCH, CONTEXT, METHODS override); pdl / nopdl: fused, with XLA's
#               programmatic dependent launch (--xla_gpu_enable_pdl) on / off; a setting that is
#               one XLA flag (--xla_gpu_...=...) runs fused with it; TRACE=1 adds --trace
#   draft       draft-model decoding, the 0.5B drafting for the 1.5B (both shipped and prepped:
#               MODEL=0.5b prep, then MODEL=1.5b prep), against the 1.5B's vanilla and vegas in
#               the same run; WORKLOAD short or long (default short), EOS honoured, sampled;
#               METHODS / BATCH / WARMUP / MEASURE / SUFFIX as above
#   peer        jaxspec against HF transformers (the machine's torch and transformers) in one run,
#               both reading the shipped GGUFs (both shipped; no prep needed): decode steps of the
#               1.5B at B = 1, 16, 64 x 4K and 16K (BATCHES / CONTEXTS override), then batch 1 on
#               PROMPTS (default 4) short prompts: HF static+compiled, dynamic, prompt lookup and
#               assisted (0.5B) against jaxspec vanilla, vegas and draft (0.5B), greedy. Each
#               section takes 7-8 minutes on an H100: SECTIONS=decode or speculative runs one per
#               call
#   sts         STS's evaluation (benchmarks.sts; both models prepped, as for draft): the 1.5B's
#               head maps for STS_BUDGETS (default "256 512"; jaxspec.sts_map, made once beside its
#               checkpoint and copied to $OUT/maps), then captured mass + perplexity and passkey
#               retrieval as two runs (EVALS overrides: space-separated --evals values, default
#               "mass,ppl passkey"; STS_EVAL_BUDGETS the evaluations' --budgets)
#   specattn    SpecAttn's perplexity against KV reduction and the layer-map ablation
#               (benchmarks.specattn; both models prepped): the KL layer map (jaxspec.specattn_map,
#               made once beside the 1.5B), then WINDOWS (default 8) windows of WINDOW (default
#               2048) tokens at TOP_PS (default 0.95,0.97,0.99), MAPS (default kl,proportional,argmax)
#   sparse_e2e  the draft-guided sparse methods end to end (both models prepped; the maps of the
#               sts and specattn steps): the 1.5B with the 0.5B drafting, WORKLOAD (default long),
#               METHODS (default none,draft:4,sts@256,specattn@0.95), BATCH (default 32),
#               ATTN_CAP (specattn's most keys per layer, default 4096: uncapped, its index lists
#               are as long as the cache); sts and specattn CHANGE the target's output
#   ssv_e2e     SSV end to end on the NSA-ified 1.5B (MODEL=1.5b prepped; the 0.5B drafts):
#               autoregressive NSA against strict SSV (lossless) per query and in merged groups
#               of 4, WORKLOAD (default short), BATCH (default 32), METHODS overrides; the reuse
#               classes (ssv@reuse.4, ssv@approx_reuse.4) read the schedule of ssv_calibrate
#   ssv_calibrate
#               SSV's refresh/reuse schedule of the NSA-ified 1.5B (jaxspec.ssv_calibrate, one
#               compiled program for every candidate, bfloat16, the NSA kernels; MODEL=1.5b
#               prepped): REUSE_LAYERS (default 14) reuse layers over CAL_WINDOWS (default 2)
#               WikiText-2 windows of CAL_TOKENS (default 4096: NSA's 16 selected blocks of 64
#               cover a 1024-token context whole, so shorter windows cannot tell a reuse layer
#               from a refresh one), written beside the checkpoint and copied to $OUT; RESUME
#               (the LAYER:KL,... value a run cut short logged) goes on from its last step
#   ssv_plan    SSV's planner on the NSA-ified 1.5B with the 0.5B drafting: the offline profile
#               (benchmarks.plan_profile; STRATEGIES, PLAN_CONTEXTS, BATCH) of strict strategies,
#               then the throughput run with its static-best and refined rows beside METHODS
#               (default none,ssv@strict.4), WORKLOAD (default short); PLAN_STEPS=profile or
#               throughput runs one half per call (the profile stays in /tmp/plan)
#   ssv         SSV's kernels on synthetic selections and block overlap on the NSA-ified 1.5B
#               (benchmarks.ssv; MODEL=1.5b prepped; EVALS=verify, the verification stage of a
#               random-weight NSA model, needs no weights); EVALS, CONTEXTS (default 8K,16K),
#               PASSAGES (default 4), KERNEL_BATCH (sequences in the kernel rows, default 1),
#               KERNEL_SPLITS (programs a branch, default auto) and KERNEL_OVERLAPS override
# EOS is honoured (requests stop at the model's end-of-sequence tokens) and sampling is the
# paper's (temperature 0.6, top-p 0.95, top-k 20). IGNORE_EOS=1 passes --ignore_eos to sweep,
# long, short and cont (stress mode: every request runs to its token budget); those results say
# "(ignore_eos)" in their labels, JSON and plot titles, and their file names carry _ignore_eos.
# The fifth session's sweep and throughput runs (RESULTS.md) ignored EOS: IGNORE_EOS=1 repeats
# them.
# AUTOTUNE_CACHE=DIR: every process reads and writes XLA's per-fusion autotuning results in DIR
# (made if missing), so processes that compile the same fusion run the same GEMM configuration.
# XLA otherwise autotunes anew in each process, and its picks differ from one process to the
# next by 0.1-0.3 ms a vegas round: an A/B whose processes share a cache measures its change, not
# the autotuner. A cache holds one XLA version's results; start a new DIR for another.
set -uo pipefail
if [ -n "${AUTOTUNE_CACHE:-}" ]; then
  mkdir -p "$AUTOTUNE_CACHE" || exit 1
  # No stray blank: XLA reads an XLA_FLAGS that does not start with "--" as a file name.
  export XLA_FLAGS=$(echo ${XLA_FLAGS:-} --xla_gpu_per_fusion_autotune_cache_dir=$AUTOTUNE_CACHE)
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:. XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 JAXSPEC_DATA=.data
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# MODEL=0.5b (default) or 1.5b: which shipped GGUF (/tmp/shipped/qwen05.gguf or qwen15.gguf).
case ${MODEL:-0.5b} in
  0.5b) GGUF=/tmp/shipped/qwen05.gguf; CKPT=/tmp/ckpt/qwen2.5-coder-0.5b
        SHA=1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32 ;;
  1.5b) GGUF=/tmp/shipped/qwen15.gguf; CKPT=/tmp/ckpt/qwen2.5-coder-1.5b
        SHA=cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046 ;;
  *) echo "MODEL must be 0.5b or 1.5b"; exit 2 ;;
esac
TAG=_${MODEL:-0.5b}   # every long/short/cont JSON names its model, the default's too
# ssv_calibrate's schedule (prep copies the recorded one): the reuse classes of ssv_e2e and
# ssv_plan read it.
SCHEDULE=; [ -f /tmp/ckpt/qwen2.5-coder-1.5b/ssv_schedule.json ] && SCHEDULE=/tmp/ckpt/qwen2.5-coder-1.5b/ssv_schedule.json
EOS_FLAG= EOS_TAG=
if [ "${IGNORE_EOS:-0}" = 1 ]; then EOS_FLAG=--ignore_eos EOS_TAG=_ignore_eos; fi
FP8_FLAG=; [ "${FP8_DRAFTS:-0}" = 1 ] && FP8_FLAG=--fp8_drafts
SCORE_FLAGS=; [ -n "${SCORE:-}" ] && SCORE_FLAGS=--score=$SCORE
[ -n "${SCORE_POOL:-}" ] && SCORE_FLAGS="$SCORE_FLAGS --score_pool=$SCORE_POOL"
[ -n "${SCORE_BLOCK:-}" ] && SCORE_FLAGS="$SCORE_FLAGS --score_block=$SCORE_BLOCK"
[ -n "${SCORE_WINDOW:-}" ] && SCORE_FLAGS="$SCORE_FLAGS --score_window=$SCORE_WINDOW"
for step in "$@"; do
  echo "=== $step ==="
  case $step in
    prep)
      python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
      echo "$SHA  $GGUF" | sha256sum -c || exit 1
      [ -d $CKPT ] || python3 -m jaxspec.convert --src=$GGUF --out=$CKPT --dtype=bfloat16 2>&1 | tail -3
      # The recorded maps of the 1.5B/0.5B pair and the NSA-ified 1.5B's SSV schedule
      # (benchmarks/results/maps) go beside the 1.5B, so the sts, specattn, sparse_e2e and ssv_*
      # steps need not rebuild them (minutes of device time); each names the checkpoints' hashes,
      # so one that no longer fits is a clear error at load.
      if [ "${MODEL:-0.5b}" = 1.5b ]; then
        for m in benchmarks/results/maps/*.json; do [ -f "$CKPT/${m##*/}" ] || cp "$m" "$CKPT/"; done
        SCHEDULE=$CKPT/ssv_schedule.json
      fi
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
      export XLA_PYTHON_CLIENT_MEM_FRACTION=0.8   # torch's copy (the ceiling) needs room beside JAX
      python3 -m benchmarks.decode --model=$CKPT --batch_sizes=1,16,64 \
        --contexts=4096,16384,32768 --steps=16 --reps=3 --out=$OUT/decode_qwen05.json 2>&1 | tail -12
      python3 -m benchmarks.decode --model=random:qwen3-8b --batch_sizes=4 --contexts=131072 \
        --steps=8 --reps=3 --out=$OUT/decode_qwen3_8b.json 2>&1 | tail -4 ;;
    sweep)
      # Vegas's three-step tuning on the long workload (a smaller grid than the flags' defaults).
      python3 -m benchmarks.sweep --model=$CKPT --workload=long --batch=64 --max_new_tokens=256 \
        --accept_batch=16 --num_requests=256 --ratios=0.02,0.04,0.07,0.12 --big_gamma=8 --gammas=4,6,8 \
        --warmup_s=3 --measure_s=6 $EOS_FLAG --out=$OUT/sweep_long$EOS_TAG 2>&1 | grep -v "^[IW]1" | tail -16 ;;
    long|short|cont)
      # GAMMA and RATIO: the sweep's choice. EOS honoured unless IGNORE_EOS=1 (the 0.5B coder ends
      # most answers early, so honoured runs see shorter outputs and more refills).
      case $step in
        long)  workload=long;         extra="--max_new_tokens=1024" ;;
        short) workload=short;        extra="--max_new_tokens=4096" ;;
        cont)  workload=continuation; extra="--max_new_tokens=1024" ;;
      esac
      python3 -m benchmarks.throughput --model=$CKPT --workload=$workload --batch=${BATCH:-128} $extra \
        --methods=${METHODS:-none,streaming,quest,specextend,vegas-all,vegas,vegas@${RATIO:-0.07}} \
        --gammas=default=${GAMMA:-6} $EOS_FLAG --num_requests=${REQUESTS:-512} --warmup_s=${WARMUP:-6} --measure_s=${MEASURE:-12} \
        --prompt_buckets=${PROMPT_BUCKETS:-8} --chunk_rounds=${CHUNK_ROUNDS:-8} --seed=${SEED:-0} \
        $FP8_FLAG $SCORE_FLAGS --out=$OUT/throughput_$step$TAG$EOS_TAG${SUFFIX:-}.json 2>&1 | grep -v "^[IW]1" | tail -12 ;;
    prefill)
      for shape in qwen2.5-coder-1.5b qwen2.5-coder-0.5b; do
        python3 -m benchmarks.prefill --model=random:$shape --trace \
          --out=$OUT/prefill_$shape${SUFFIX:-}.json 2>&1 | grep -v "^[IW]1" | tail -12
      done ;;
    scale)
      export XLA_PYTHON_CLIENT_MEM_FRACTION=0.8   # torch's copy (the ceiling) needs room beside JAX
      python3 -m benchmarks.throughput --model=random:qwen3-8b --workload=scale --batch=4 \
        --context=131072 --methods=${METHODS:-none,streaming,vegas} --gammas=default=${GAMMA:-6} \
        --out=$OUT/throughput_scale.json 2>&1 | grep -v "^[IW]1" | grep "^{" ;;
    levers)
      # Issue 14's launch-overhead lever, one process per setting (XLA reads its flags at start):
      # XLA's command buffers (CUDA graphs) as they come, switched off, and extended to the
      # loop's control flow (+WHILE,+CONDITIONAL); the fused projections; and programmatic
      # dependent launch (Hopper: a kernel's prologue overlaps its producer's tail). On the scale
      # workload at SHAPE (default the 0.5B's), BATCH x CONTEXT (default 64 x 24576), METHODS
      # (default none,vegas:6); each JSON records its XLA_FLAGS and fuse_projections.
      export XLA_PYTHON_CLIENT_MEM_FRACTION=0.8   # torch's copy (the ceiling) needs room beside JAX
      for setting in ${SETTINGS:-default off while}; do
        case $setting in
          default) flags= ;;
          off)     flags=--xla_gpu_enable_command_buffer= ;;
          while)   flags=--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL ;;
          fused)   flags= ;;
          pdl)     flags=--xla_gpu_enable_pdl=true ;;
          nopdl)   flags=--xla_gpu_enable_pdl=false ;;
          --xla_*) flags=$setting ;;   # any one XLA flag, with the fused projections
          *) echo "unknown setting $setting (default, off, while, fused, pdl, nopdl, --xla_...=...)"; exit 2 ;;
        esac
        fuse=--fuse_projections; case $setting in default|off|while) fuse=--nofuse_projections ;; esac
        # A flag setting's files are named after the flag: --xla_gpu_a_b=true -> levers_a_b-true.
        setting=$(echo "${setting#--xla_gpu_}" | tr '=,+' '-__')
        # No stray blank: XLA reads an XLA_FLAGS that does not start with "--" as a file name.
        xla_flags=$(echo ${XLA_FLAGS:-} $flags)
        env ${xla_flags:+XLA_FLAGS="$xla_flags"} python3 -m benchmarks.throughput $fuse \
          --model=random:${SHAPE:-qwen2.5-coder-0.5b} --workload=scale --batch=${BATCH:-64} \
          --context=${CONTEXT:-24576} --methods=${METHODS:-none,vegas:6} --gammas=default=6 \
          ${TRACE:+--trace} --out=$OUT/levers_$setting${SUFFIX:-}.json > $OUT/levers_$setting${SUFFIX:-}.log 2>&1
        rc=$?
        # The rows, or how the process ended (one setting's run once printed neither).
        grep "^{" $OUT/levers_$setting${SUFFIX:-}.log || { echo "$setting: exit $rc"; tail -5 $OUT/levers_$setting${SUFFIX:-}.log; }
      done ;;
    draft)
      python3 -m benchmarks.throughput --model=/tmp/ckpt/qwen2.5-coder-1.5b \
        --draft_model=/tmp/ckpt/qwen2.5-coder-0.5b --workload=${WORKLOAD:-short} \
        --batch=${BATCH:-128} --methods=${METHODS:-none,vegas:6,draft:2,draft:3,draft:4} \
        --num_requests=${REQUESTS:-512} --warmup_s=${WARMUP:-6} --measure_s=${MEASURE:-12} \
        --out=$OUT/throughput_${WORKLOAD:-short}_draft${SUFFIX:-}.json 2>&1 | grep -v "^[IW]1" | tail -12 ;;
    sts)
      T=/tmp/ckpt/qwen2.5-coder-1.5b D=/tmp/ckpt/qwen2.5-coder-0.5b maps=
      mkdir -p $OUT/maps
      for k in ${STS_BUDGETS:-256 512}; do
        m=$T/sts_map_k$k.qwen2_5-coder-0_5b.json
        # A sample must hold 64 rows that each see k keys: WikiText-2 articles up to 2048 tokens
        # (46 of the first 100 have the 1702 that k = 1638 needs).
        [ -f $m ] || { python3 -m jaxspec.sts_map --target=$T --draft=$D --budget=$k \
          --max_tokens=$(( k + 64 > 1024 ? 2048 : 1024 )) 2>&1 | tail -1; cp $m $OUT/maps/; }
        maps=$maps${maps:+,}$m
      done
      for e in ${EVALS:-mass,ppl passkey}; do
        python3 -m benchmarks.sts --target=$T --draft=$D --sts_map=$maps --evals=$e \
          ${STS_EVAL_BUDGETS:+--budgets=$STS_EVAL_BUDGETS} \
          --out=$OUT/sts_${e//,/_}${SUFFIX:-}.json 2>&1 | grep -v "^[IW]1" | tail -40
      done ;;
    specattn)
      T=/tmp/ckpt/qwen2.5-coder-1.5b D=/tmp/ckpt/qwen2.5-coder-0.5b
      m=$T/specattn_map.qwen2_5-coder-0_5b.json
      [ -f $m ] || python3 -m jaxspec.specattn_map --target=$T --draft=$D 2>&1 | grep -v "^[IW]1" | tail -2
      python3 -m benchmarks.specattn --target=$T --draft=$D --specattn_map=$m --windows=${WINDOWS:-8} \
        --window=${WINDOW:-2048} --top_ps=${TOP_PS:-0.95,0.97,0.99} ${MAPS:+--maps=$MAPS} \
        --out=$OUT/specattn${SUFFIX:-}.json 2>&1 | grep -v "^[IW]1" | grep -v "chunk/s" | tail -20 ;;
    sparse_e2e)
      T=/tmp/ckpt/qwen2.5-coder-1.5b
      python3 -m benchmarks.throughput --model=$T --draft_model=/tmp/ckpt/qwen2.5-coder-0.5b \
        --sts_map=$T/sts_map_k256.qwen2_5-coder-0_5b.json \
        --specattn_map=$T/specattn_map.qwen2_5-coder-0_5b.json --attn_cap=${ATTN_CAP:-4096} \
        --workload=${WORKLOAD:-long} \
        --batch=${BATCH:-32} --methods=${METHODS:-none,draft:4,sts@256,specattn@0.95} \
        --num_requests=${REQUESTS:-512} --warmup_s=${WARMUP:-6} --measure_s=${MEASURE:-12} \
        --out=$OUT/throughput_${WORKLOAD:-long}_sparse${SUFFIX:-}.json 2>&1 | grep -v "^[IW]1" | tail -12 ;;
    ssv_e2e)
      python3 -m benchmarks.throughput --model=nsa:/tmp/ckpt/qwen2.5-coder-1.5b \
        --draft_model=/tmp/ckpt/qwen2.5-coder-0.5b --workload=${WORKLOAD:-short} \
        --batch=${BATCH:-32} --methods=${METHODS:-none,ssv,ssv@strict.4} --gammas=default=4 \
        ${SCHEDULE:+--ssv_schedule=$SCHEDULE} --num_requests=${REQUESTS:-512} --warmup_s=${WARMUP:-6} --measure_s=${MEASURE:-12} \
        --out=$OUT/throughput_${WORKLOAD:-short}_ssv${SUFFIX:-}.json 2>&1 | grep -v "^[IW]1" | tail -12 ;;
    ssv_calibrate)
      # bfloat16, as the 1.5B is served (ssv_e2e, ssv_plan); each candidate is one pass. The log
      # goes straight to $OUT: a run cut short by the call's limit still tells how far it got.
      python3 -m jaxspec.ssv_calibrate --model=nsa:$CKPT --reuse_layers=${REUSE_LAYERS:-14} \
        --windows=${CAL_WINDOWS:-2} --window_tokens=${CAL_TOKENS:-4096} --dtype=bfloat16 \
        ${RESUME:+--resume=$RESUME} --out=$CKPT/ssv_schedule.json 2> $OUT/ssv_calibrate.log
      tr '\r' '\n' < $OUT/ssv_calibrate.log | grep -v "^[IW]1" | tail -4
      grep -a "to go on from here" $OUT/ssv_calibrate.log | tail -1
      cp $CKPT/ssv_schedule.json "$OUT/ssv_schedule_qwen2.5-coder-1.5b_nsa.json" ;;
    ssv_plan)
      mkdir -p /tmp/plan
      if [ "${PLAN_STEPS:-profile throughput}" != throughput ]; then
        python3 -m benchmarks.plan_profile --model=nsa:$CKPT --draft_model=/tmp/ckpt/qwen2.5-coder-0.5b \
          --strategies=${STRATEGIES:-ssv:2@strict.4,ssv:4@strict.4,ssv:6@strict.4,ssv:4@strict.1} \
          --contexts=${PLAN_CONTEXTS:-2048,8192} --batches=${BATCH:-32} ${SCHEDULE:+--ssv_schedule=$SCHEDULE} \
          --out=/tmp/plan/ssv_profile.json 2>&1 | grep -v "^[IW]1" | tail -12
        cp /tmp/plan/ssv_profile.json "$OUT/plan_profile_ssv${SUFFIX:-}.json"
      fi
      if [ "${PLAN_STEPS:-profile throughput}" != profile ]; then
        python3 -m benchmarks.throughput --model=nsa:$CKPT --draft_model=/tmp/ckpt/qwen2.5-coder-0.5b \
          --workload=${WORKLOAD:-short} --batch=${BATCH:-32} --methods=${METHODS:-none,ssv@strict.4} \
          --gammas=default=4 --plan=/tmp/plan/ssv_profile.json ${SCHEDULE:+--ssv_schedule=$SCHEDULE} \
          --num_requests=${REQUESTS:-512} --warmup_s=${WARMUP:-6} --measure_s=${MEASURE:-12} \
          --out=$OUT/throughput_${WORKLOAD:-short}_ssv_plan${SUFFIX:-}.json 2>&1 | grep -v "^[IW]1" | tail -12
      fi ;;
    ssv)
      # SSV's kernels on synthetic selections, and the overlap on the NSA-ified 1.5B (needs
      # MODEL=1.5b prep first).
      export XLA_PYTHON_CLIENT_MEM_FRACTION=0.75   # torch's copy (the ceiling) needs room beside JAX
      python3 -m benchmarks.ssv --model=nsa:/tmp/ckpt/qwen2.5-coder-1.5b --evals=${EVALS:-kernel,overlap} \
        --contexts=${CONTEXTS:-8K,16K} --passages=${PASSAGES:-4} --kernel_batch=${KERNEL_BATCH:-1} \
        --kernel_splits=${KERNEL_SPLITS:-auto} --kernel_overlaps=${KERNEL_OVERLAPS:-3,7,11,15} \
        --out=$OUT/ssv${SUFFIX:-}.json 2>&1 | grep -v "^[IW]1" | tail -24 ;;
    peer)
      for entry in 1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32:qwen05 \
                   cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046:qwen15; do
        echo "${entry%%:*}  /tmp/shipped/${entry##*:}.gguf" | sha256sum -c || exit 1
      done
      # Both frameworks read GGUF through the gguf package (carried in .whl/, as prep installs it).
      python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
      python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', \
        transformers.__version__, 'cuda', torch.cuda.is_available())"
      # JAX allocates on demand so that HF, which runs first, has the GPU (peer_hf's docstring).
      XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -m benchmarks.peer_hf \
        --model=/tmp/shipped/qwen15.gguf --draft_model=/tmp/shipped/qwen05.gguf \
        --batch_sizes=${BATCHES:-1,16,64} --contexts=${CONTEXTS:-4096,16384} --nodecode_draft \
        --sections=${SECTIONS:-decode,speculative} --prompts=${PROMPTS:-4} --max_new_tokens=256 \
        --out=$OUT/peer_hf${SUFFIX:-}.json 2>&1 | grep -v "^[IW]1" | tail -40 ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
