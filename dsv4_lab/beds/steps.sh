#!/usr/bin/env bash
# The recorded GPU runs (docs/results/README.md), in steps that each fit one device call.
# On a GPU host where SGLang 0.5.16 is importable, from the repository root:
#   dsv4_lab/beds/steps.sh check       dense_check in both dense modes (in-process ModelRunner, module state;
#                                  CHECK_MODES picks modes, CHECK_T the limit, 280 s: a cold Marlin build needs 540)
#   dsv4_lab/beds/steps.sh engine      engine_bed patched (bf16, fp8_marlin) vs the native oracle
#   dsv4_lab/beds/steps.sh dspark      engine_bed patched with DSPARK: the draft's linears in the load report
#   dsv4_lab/beds/steps.sh bench       bench/dense_linear.py (patch off: native FP8 is SGLang's own)
#   dsv4_lab/beds/steps.sh moe         moe_check: native, patched marlin, patched mxfp4_int8 on the same inputs
#   dsv4_lab/beds/steps.sh moe-engine  engine_bed patched with each MoE backend vs the native oracle
#   dsv4_lab/beds/steps.sh moe-bench   bench/moe.py
#   dsv4_lab/beds/steps.sh moe-close   the wide path's GPU tests, then bench/moe.py at every MoE size with Marlin
#                                  beside the defaults (run it after `seed`: bg moe-close)
#   dsv4_lab/beds/steps.sh moe-sweep   bench/moe.py at decode sizes (MOE_TOKENS, 1-64): the decode rows of the W4A8
#                                  table (MOE_ONLY picks rows) and a per-kernel profile
#   dsv4_lab/beds/steps.sh moe-prefill bench/moe.py's prefill rows (MOE_ONLY; MOE_TOKENS 512-16384) with Marlin
#                                  beside it (mma.sync only unless MMA=v3, as moe-bench; MOE_T s, 540: a cold
#                                  machine compiles SGLang's JIT Marlin MoE for ~5 minutes first)
#   dsv4_lab/beds/steps.sh moe-ncu     Nsight Compute of the W4A8 launches at NCU_TOKENS (8192) for NCU_VARIANTS (default and
#                                  the expanded path): occupancy, issue slots, warp stalls, DRAM (no SGLang needed)
#   dsv4_lab/beds/steps.sh moe-wide    every W4A8 table row at TP1 full width (intermediate 2048: e2e-bench's experts)
#   dsv4_lab/beds/steps.sh engine-wide the one-token MoE path (wide) inside the engine in CUDA graphs, tripwire on
#   dsv4_lab/beds/steps.sh vision-gemm vision-replay with native's DeepGEMM linears (kv,gemm,idx; tripwire off)
#   dsv4_lab/beds/steps.sh attention   SGLang's DSV4 attention test kit on the patched backend + BF16 pool (tripwire on)
#   dsv4_lab/beds/steps.sh oracle      the native record $ORACLE (engine_bed, patch off), unless it exists
#   dsv4_lab/beds/steps.sh e2e         engine_bed with the whole SM80 datapath (tripwire on) vs the native oracle
#   dsv4_lab/beds/steps.sh e2e-floors  the floors for e2e's record: native again teacher-forcing the oracle's sequences
#                                  one at a time (the batch floor), and native with its embedding moved one
#                                  BF16 ulp in PERTURB (1e-4 1e-3) of its entries (dsv4_lab/perturb.py: its sensitivity to
#                                  a rounding-level input change); e2e against the oracle with each floor in turn;
#                                  then each path against itself with that change (which one is the noisy one)
#   dsv4_lab/beds/steps.sh e2e-replay  e2e with Marlin experts and native's FP8 roundings replayed (kv,act,idx; act through
#                                  SGLang's own quantizer) against the oracle, e2e-floors' batch floor beside it
#   dsv4_lab/beds/steps.sh e2e-gemm    e2e-replay with native's own FP8 block linear (DeepGEMM, tripwire off) for act:
#                                  kv,gemm,idx, against the oracle with each e2e-floors floor present
#   dsv4_lab/beds/steps.sh machines    the across-machines floor: native teacher-forcing an earlier machine's native record
#                                  ($PREV), alone too, and patched on the same sequences; each against each
#   dsv4_lab/beds/steps.sh attn-bench  bench/attention.py (variants; batch 1 and 8 profiled per kernel)
#   dsv4_lab/beds/steps.sh mma-peak    bench/mma_peak.py: this GPU's mma.sync BF16 and INT8 peaks and their ratio (an A800's is 2)
#   dsv4_lab/beds/steps.sh idx-bench   bench/indexer.py (the C4 indexer's Q, compress-store and logits kernels at decode)
#   dsv4_lab/beds/steps.sh cold        the patched engine's first start on empty JIT caches (a fresh HOME) with SGLang's
#                                  own 300 s scheduler watchdog: does a user's first request survive the compiling?
#   dsv4_lab/beds/steps.sh mhc-bench   bench/mhc.py (the TF32 hc pre-norm GEMM vs DeepGEMM's)
#   dsv4_lab/beds/steps.sh jit         SGLang's JIT modules on the SM80 path compiled for sm_80 (own cache dir)
#   dsv4_lab/beds/steps.sh floor       native twice more on the oracle's sequences (another process, the second
#                                  teacher-forcing them one at a time; batch 16 over 20/300/3000/20000 ids): the
#                                  noise floor compare.py --floor calibrates on
#   dsv4_lab/beds/steps.sh parity      patched (tripwire on) bf16+marlin, bf16+mxfp4_int8, fp8_marlin+marlin on the
#                                  batch-16 sequences, each against native with the floor beside it
#   dsv4_lab/beds/steps.sh floor-ours  native with the SGLang options the SM80 bootstrap pins that native can run
#                                  (native_pins) against default native, floor beside it
#   dsv4_lab/beds/steps.sh floor-pins  native with each of those options (native_pins), one at a time, vs default native
#                                  (floor beside it): which of SGLang's own choices moves native (waits for $F16)
#   dsv4_lab/beds/steps.sh parity-pinned floor-ours's run (made first if absent) as the oracle, its one-at-a-time floor, then patched
#                                  against it: bf16+marlin (roundings 0 / act / kv,act), bf16+mxfp4_int8,
#                                  fp8_marlin+marlin (waits for $F16)
#   dsv4_lab/beds/steps.sh parity-replay  parity's bf16+marlin with native's FP8 roundings replayed
#                                  (DSV4_SM80_LAB_NATIVE_ROUNDING=kv, kv,act, kv,act,idx): their share of the gap
#   dsv4_lab/beds/steps.sh trace       one prompt's prefill module by module (TRACE_LEN ids, 300): native, native pinned,
#                                  patched, patched with native's roundings replayed; names where they part ways
#                                  (TRACE_RUNS picks runs: "pinned perturbed replay" is the replay against its floor;
#                                  "gemm" adds the replay with native's own DeepGEMM linears and mHC GEMM)
#   dsv4_lab/beds/steps.sh trace-linears  native's trace (made unless there) and its FP8 linears against native SGLang's
#                                  own activation quantizer and FP8 linear on their recorded inputs (dsv4_lab.trace
#                                  --sglang-models): what the replay's fp8-act model misses of native's linear
#   dsv4_lab/beds/steps.sh trained     the committed trained tiny checkpoint ($TRAINED, unpacked first): trained_bed for
#                                  native and the SM80 default path, each without and with DSPARK, CUDA graphs on; then
#                                  `python -m dsv4_lab.train score` on the GPU -> $OUT/trained.json (TRAINED_MODES adds
#                                  SM80 modes, e.g. "bf16-marlin fp8_marlin-mxfp4_int8")
#   dsv4_lab/beds/steps.sh trained-accuracy  dsv4_lab/oracle/accuracy.sh on it with held-out text prompts -> $OUT/acc-trained
#   dsv4_lab/beds/steps.sh graphs      patched with CUDA graphs vs patched eager (decode outputs)
#   dsv4_lab/beds/steps.sh graphs-self graphs on the teacher sequences of a patched eager run made first (no oracle)
#   dsv4_lab/beds/steps.sh spec        patched DSPARK vs patched without speculation (greedy tokens, acceptance), and
#                                  native DSPARK vs native without speculation beside it (the floor)
#   dsv4_lab/beds/steps.sh wide        generate the full-width checkpoint (/tmp/dsv4-wide, ~24 GB, fast experts)
#   dsv4_lab/beds/steps.sh wide-parity on it: native, native one sequence at a time (floor), patched (tripwire), TP1
#   dsv4_lab/beds/steps.sh e2e-bench   bench/e2e.py on it: decode tok/s and TTFT, patched vs native, batch 1 and 16 (also
#                                  with experts on Marlin / dense on FP8-Marlin), kernels per decode step
#   dsv4_lab/beds/steps.sh http        serve in lab mode (tiny model + stand-in tokenizer, --api-key): OpenAI and native
#                                  endpoints, the key enforced, bad requests answered 4xx, the server alive after;
#                                  then launches that must be refused naming their check (EP, NextN, MoE runner)
#   dsv4_lab/beds/steps.sh http-vision the tiny --vision checkpoint served with DSV4_SM80_VISION=1: image requests,
#                                  bad images answered 4xx, a different image changes the logprobs
#   dsv4_lab/beds/steps.sh vision-ab   the same image requests on the patched server and on native SGLang with the
#                                  vision overlay alone (patch off), then patched with 256-token prefill chunks (DSV4 pages are 256 tokens; SGLang asserts the chunk is a multiple)
#                                  (image blocks across chunks): greedy tokens and logprobs side by side, and a
#                                  teacher-forced A/B of two image prompts against native with native's own
#                                  batch floor (compare.py); each run also checks the bias_vl routing trace
#   dsv4_lab/beds/steps.sh vision-replay  vision-ab's image prompts, patched with native's roundings replayed (kv,act,idx),
#                                  teacher-forced against native with its batch floor
#   dsv4_lab/beds/steps.sh vision      the Vision-Exp model class loads the tiny --vision checkpoint in SGLang's ModelRunner
#   dsv4_lab/beds/steps.sh hygiene     page hygiene: the same requests with the pools poisoned (0xFF) after every
#                                  flush and without; outputs must be equal and finite (and with DSPARK)
#   dsv4_lab/beds/steps.sh fault       a scheduler (TP worker) SIGKILLed mid-request: the server must exit non-zero, the
#                                  client's request end (TP2 on x2: python dsv4_lab/beds/fault_kill.py --tp 2 --rank 1)
#   dsv4_lab/beds/steps.sh soak        64 streams against the patched server for SOAK_MIN (6) minutes; soak-dspark: with DSPARK;
#                                  soak-native: the same load on native SGLang (its memory growth beside ours)
#   dsv4_lab/beds/steps.sh tp4         TP4 on four GPUs (gate at its production count 4): native twice (oracle + floor,
#                                  (TP=2 steps.sh tp: the same at TP2 on the two-GPU kind, gate count overridden to 2)
#                                  the floor teacher-forcing one sequence at a time),
#                                  patched (tripwire), patched with DSPARK; CUDA graphs on; footprint per rank
#   dsv4_lab/beds/steps.sh fault-tp    fault with TP=$TP (2): the last rank's scheduler killed
#   dsv4_lab/beds/steps.sh par G0 G1.. each group (quoted, space-separated steps) on its own GPU, all at once;
#                                  e.g. par "check kernels" moe-bench attn-bench wide
#   dsv4_lab/beds/steps.sh bg G0 G1..  par, detached from a copy of the tree, into /tmp/res; returns at once
#                                  (THEN="tp4 ...": steps after every group, one at a time, all GPUs visible)
#   dsv4_lab/beds/steps.sh wait [S]    up to S s (500) for bg, then summaries and /tmp/res as $OUT/res-HHMMSS.tgz
#                                  (JSON over 1 MB left out; the JIT tarball once bg is done, or now with JIT_NOW=1)
#   dsv4_lab/beds/steps.sh seed        SGLang's JIT modules of $JIT_SEED built in parallel (bg runs it first; wait packs
#                                  the host's modules into $OUT/jit-seed.json.xz: commit it as $JIT_SEED)
#   dsv4_lab/beds/steps.sh kernels     the kernel tests, compiled on this GPU against their CPU references
#                                  (needs pytest importable)
# Results go to $OUT (default ./out). The native oracle is $OUT/oracle/native.json (dsv4_lab/beds/engine_bed.py).
set -u
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT" "$OUT/oracle"
export PYTHONPATH=$PWD:${PYTHONPATH:-} SGLANG_JIT_DEEPGEMM_PRECOMPILE=0
LAB="ENABLE_SGLANG_DSV4_A100_PATCH=1 DSV4_SM80_LAB=1 DSV4_SM80_LAB_GPU_COUNT=1 DSV4_SM80_LAB_CC=9.0"
ORACLE=${ORACLE:-$OUT/oracle/native.json}
JIT_SEED=${JIT_SEED:-$PWD/dsv4_lab/beds/jit-seed/tvm-ffi.json.xz}  # SGLang JIT module sources (dsv4_lab/beds/jit_seed.py)
FI_SEED=${FI_SEED:-$PWD/dsv4_lab/beds/jit-seed/flashinfer.json.xz}  # FlashInfer's JIT modules, the same way
TW=${DSV4_BED_TEACHER_WAIT:-0}  # engine_bed's wait for its teacher record (par with PAR_SAME_GPU): added to step limits
TRAINED=${TRAINED:-/tmp/dsv4-lab-tiny}  # the committed trained checkpoint, unpacked (steps trained*)
WIDE=${WIDE:-/tmp/dsv4-wide}  # the full-width checkpoint (step wide); $WIDE.ok once it is complete
rc=0
pins() {  # NAME=VALUE of every SGLang option the SM80 bootstrap pins at import to another value than SGLang's
  # (dsv4_sm80/env.py; its guards hold SGLang's own defaults and change nothing for native)
  python -c "from dsv4_sm80.env import IMPORT_TIME_DEFAULTS as D; print(' '.join(f'{d.name}={d.value}' for d in D if not d.guard))"
}
native_pins() {  # pins() that native can run: SGLANG_FP8_PAGED_MQA_LOGITS_TORCH=1 selects SGLang's torch
  # fallback for the paged MQA logits, which asserts at batch 16 on native (fp8_paged_mqa_logits_torch
  # `assert seq_lens.shape == (batch_size,)`); with the patch on our INT8 indexer replaces that function anyway
  pins | tr ' ' '\n' | grep -v '^SGLANG_FP8_PAGED_MQA_LOGITS_TORCH=' | tr '\n' ' '
}
floors() {  # the floors a native16-based comparison is held to: batch composition, and another machine if run
  echo "--floor $F16"
  [ -f "$OUT/native16-prev.json" ] && echo "--floor $OUT/native16-prev.json"
}
lab_tp() {  # lab mode for a TP run on $1 GPUs: the gate's GPU count overridden unless it is the production 4
  echo "ENABLE_SGLANG_DSV4_A100_PATCH=1 DSV4_SM80_LAB=1 DSV4_SM80_LAB_CC=9.0"
  [ "$1" = 4 ] || echo "DSV4_SM80_LAB_GPU_COUNT=$1"
}
need() {  # wait (up to 20 min) for a file another GPU lane writes, e.g. the floor's native16b.json
  local t=0
  while [ ! -f "$1" ] && [ $t -lt 1200 ]; do sleep 10; t=$((t + 10)); done
  [ -f "$1" ] || echo "=== need: $1 never appeared"
}
# the W4A8 benches (moe-bench, moe-prefill): Triton's MMA. On an H200 Triton lowers the 64-row tiles to wgmma, which an
# A800 lacks; by default they run with DISABLE_MMA_V3=1 (mma.sync only, the A800's instruction; its own Triton cache,
# the flag changes the code). MMA=v3: Triton's own choice.
if [ "${MMA:-v2}" = v2 ]; then MMA_ENV="env DISABLE_MMA_V3=1 TRITON_CACHE_DIR=$HOME/.triton/cache-mma-v2"; else MMA_ENV=; fi
run() {  # name, command...: log to $OUT/name.log, keep the tail on stdout
  local name=$1; shift
  echo "=== $name: $*"
  ( eval "$@" ) >"$OUT/$name.log" 2>&1 || { echo "=== $name: exit $?"; rc=1; }
  grep -E "^(  A/B|mma.sync|latency floor|fault_kill|hygiene|mhc_check|mhc bench|soak|vision_check|http_check|jit_sm80|prebuild-jit|jit_seed|dense_check|moe_check|moe bench|layer_trace|attention_kit|attention bench|prefill|native|c4 |c128|indexer bench|q  |compress|logits|engine_bed|trained_bed|reference R_|native: |sm80-[a-z0-9_-]*: |e2e |kernels per|  |dense_linear|load-time|x nat|ERROR|FAILED|Traceback| *[0-9]+ )|dsv4-sm80 (dense|moe|footprint)|us of kernels per decode step|Error|passed|failed|watchdog timeout" \
    "$OUT/$name.log" | grep -v "^  File" | tail -40
}
vs_floors() {  # RECORD LOG: compare.py, RECORD against the oracle beside each e2e-floors floor this $OUT holds (native
  # one sequence at a time; native with its embedding moved, per PERTURB); where it holds none, without a floor
  local rec=$1 log=$2 f any=
  for f in alone $(for p in ${PERTURB:-1e-4 1e-3}; do echo perturb-$p; done); do
    [ -f "$OUT/native-$f.json" ] || continue
    any=1
    echo "=== $(basename "$rec" .json) against the oracle, floor: native-$f" | tee -a "$log"
    python dsv4_lab/beds/compare.py "$ORACLE" "$rec" --floor "$OUT/native-$f.json" 2>&1 | tee -a "$log"
  done
  [ -n "$any" ] || python dsv4_lab/beds/compare.py "$ORACLE" "$rec" 2>&1 | tee -a "$log"
}
jit_tar() {  # the JIT caches into $OUT/jit.tar.xz; the device tool returns files of at most 16 MiB, so a
  # larger tarball comes back in parts (join: cat jit.tar.xz.* > jit.tar.xz)
  tar -C ~ -cf - .cache/tvm-ffi .cache/deep_gemm .cache/flashinfer .triton .tilelang 2>/dev/null | xz -T0 -3 > "$OUT/jit.tar.xz"
  if [ "$(stat -c %s "$OUT/jit.tar.xz")" -gt 15728640 ]; then
    split -b 15M -d "$OUT/jit.tar.xz" "$OUT/jit.tar.xz." && rm "$OUT/jit.tar.xz"
  fi
}
case ${1:?step} in
  check)
    for mode in ${CHECK_MODES:-bf16 fp8_marlin}; do
      run "check-$mode" env $LAB SGLANG_DSV4_A100_DENSE=$mode timeout ${CHECK_T:-280} \
        python -u dsv4_lab/beds/dense_check.py --out "$OUT/dense-$mode.json"
    done ;;
  engine)
    for mode in bf16 fp8_marlin; do
      run "engine-$mode" env $LAB SGLANG_DSV4_A100_DENSE=$mode DSV4_SM80_LOAD_REPORT="$OUT/report-$mode.jsonl" \
        timeout 280 python dsv4_lab/beds/engine_bed.py --out "$OUT/engine-$mode.json" --teacher-from "$ORACLE"
      python dsv4_lab/beds/compare.py "$ORACLE" "$OUT/engine-$mode.json" | tee -a "$OUT/engine-$mode.log"
    done ;;
  dspark)
    run dspark env $LAB DSV4_SM80_LOAD_REPORT="$OUT/report-dspark.jsonl" timeout 400 \
      python dsv4_lab/beds/engine_bed.py --out "$OUT/engine-dspark.json" --teacher-from "$ORACLE" \
      --speculative-algorithm DSPARK --lengths 20,300 ;;
  bench)
    run bench env ENABLE_SGLANG_DSV4_A100_PATCH=0 timeout 540 python bench/dense_linear.py --out "$OUT/dense_linear.json" ;;
  moe)
    run moe-native env ENABLE_SGLANG_DSV4_A100_PATCH=0 timeout 200 python -u dsv4_lab/beds/moe_check.py --out "$OUT/moe-native.pt"
    for b in marlin mxfp4_int8; do
      run "moe-$b" env $LAB SGLANG_DSV4_MXFP4_MOE_BACKEND=$b timeout 200 \
        python -u dsv4_lab/beds/moe_check.py --out "$OUT/moe-$b.pt" --compare "$OUT/moe-native.pt"
    done
    # 1024 tokens x top-6 = 6144 pairs: the W4A8 table's 32x64 shift tile
    run moe-native-1024 env ENABLE_SGLANG_DSV4_A100_PATCH=0 timeout 200 python -u dsv4_lab/beds/moe_check.py \
      --tokens 1024 --out "$OUT/moe-native-1024.pt"
    run moe-mxfp4_int8-1024 env $LAB SGLANG_DSV4_MXFP4_MOE_BACKEND=mxfp4_int8 timeout 200 \
      python -u dsv4_lab/beds/moe_check.py --tokens 1024 --out "$OUT/moe-mxfp4_int8-1024.pt" \
      --compare "$OUT/moe-native-1024.pt" ;;
  moe-engine)
    for b in mxfp4_int8 marlin; do
      run "engine-moe-$b" env $LAB SGLANG_DSV4_MXFP4_MOE_BACKEND=$b timeout 280 \
        python dsv4_lab/beds/engine_bed.py --out "$OUT/engine-moe-$b.json" --teacher-from "$ORACLE"
      python dsv4_lab/beds/compare.py "$ORACLE" "$OUT/engine-moe-$b.json" | tee -a "$OUT/engine-moe-$b.log"
    done ;;
  attention)
    run attention env $LAB DSV4_SM80_TRIPWIRE=1 timeout 500 python -u dsv4_lab/beds/attention_kit.py --out "$OUT/attention_kit.json" ;;
  e2e-replay)
    # the SM80 path with Marlin experts (native's own MoE kernel) and native's FP8 roundings replayed (kv,act,idx;
    # act through SGLang's own quantizer on this GPU) against the oracle, beside e2e-floors' batch
    # floor when it is there: does what is left of the gap fall within native's own noise?
    run e2e-replay env $LAB DSV4_SM80_TRIPWIRE=1 DSV4_SM80_LAB_NATIVE_ROUNDING=kv,act,idx \
      SGLANG_DSV4_MXFP4_MOE_BACKEND=marlin timeout 400 python dsv4_lab/beds/engine_bed.py \
      --out "$OUT/engine-e2e-replay.json" --teacher-from "$ORACLE"
    vs_floors "$OUT/engine-e2e-replay.json" "$OUT/e2e-replay.log" ;;
  e2e-gemm)
    # e2e-replay with native's own FP8 block linear (DeepGEMM) in place of the act model: kv,gemm,idx. DeepGEMM is
    # what the tripwire guards, so it is off here (e2e and e2e-replay prove the shipped path never reaches it)
    run e2e-gemm env $LAB DSV4_SM80_LAB_NATIVE_ROUNDING=kv,gemm,idx SGLANG_DSV4_MXFP4_MOE_BACKEND=marlin timeout 400 \
      python dsv4_lab/beds/engine_bed.py --out "$OUT/engine-e2e-gemm.json" --teacher-from "$ORACLE"
    vs_floors "$OUT/engine-e2e-gemm.json" "$OUT/e2e-gemm.log" ;;
  trained)
    [ -f "$TRAINED/config.json" ] || python -m dsv4_lab.train unpack "$(dirname "$TRAINED")" >/dev/null
    recs=()
    for path in native sm80-bf16-mxfp4_int8 ${TRAINED_MODES:-}; do
      if [ "$path" = native ]; then envs="ENABLE_SGLANG_DSV4_A100_PATCH=0"; else
        d=${path#sm80-}; envs="$LAB SGLANG_DSV4_A100_DENSE=${d%%-*} SGLANG_DSV4_MXFP4_MOE_BACKEND=${d#*-}"; fi
      # shellcheck disable=SC2086
      run "trained-$path" env $envs timeout 540 python dsv4_lab/beds/trained_bed.py --ckpt "$TRAINED" \
        --out "$OUT/trained-$path.json"
      # shellcheck disable=SC2086
      run "trained-$path-dspark" env $envs timeout 540 python dsv4_lab/beds/trained_bed.py --ckpt "$TRAINED" \
        --out "$OUT/trained-$path-dspark.json" --speculative-algorithm DSPARK
      recs+=(--record "$path=$OUT/trained-$path.json" --dspark "$path=$OUT/trained-$path-dspark.json")
    done
    run trained-score timeout 900 python -m dsv4_lab.train score --ckpt "$TRAINED" --device cuda "${recs[@]}" \
      --json-out "$OUT/trained.json" ;;
  trained-accuracy)
    [ -f "$TRAINED/config.json" ] || python -m dsv4_lab.train unpack "$(dirname "$TRAINED")" >/dev/null
    [ -f "$OUT/trained-prompts.json" ] || python -m dsv4_lab.train prompts "$OUT/trained-prompts.json"
    run trained-accuracy env CKPT="$TRAINED" PROMPTS="$OUT/trained-prompts.json" BED_ARGS="--head-scale 1.0" \
      dsv4_lab/oracle/accuracy.sh "$OUT/acc-trained" ;;
  oracle)
    # (a cold machine compiles for 8-10 minutes before native's first forward: ORACLE_T, 1200 s)
    # the native record e2e/engine/moe-engine compare against ($ORACLE), made here when this machine has none
    if [ -f "$ORACLE" ]; then echo "=== oracle: $ORACLE exists"; else
      mkdir -p "$(dirname "$ORACLE")"
      run oracle env ENABLE_SGLANG_DSV4_A100_PATCH=0 timeout ${ORACLE_T:-1200} python dsv4_lab/beds/engine_bed.py --out "$ORACLE"
    fi ;;
  e2e)
    run e2e env $LAB DSV4_SM80_TRIPWIRE=1 DSV4_SM80_LOAD_REPORT="$OUT/report-e2e.jsonl" timeout $((400 + TW)) \
      python dsv4_lab/beds/engine_bed.py --out "$OUT/engine-e2e.json" --teacher-from "$ORACLE"
    python dsv4_lab/beds/compare.py "$ORACLE" "$OUT/engine-e2e.json" | tee -a "$OUT/e2e.log" ;;
  cold)
    # every JIT cache under a fresh HOME (tvm-ffi, DeepGEMM, FlashInfer, Triton, TileLang resolve from it); the
    # watchdog at SGLang's default: a first forward compiling past it kills the engine
    rm -rf /tmp/coldhome && mkdir -p /tmp/coldhome
    run cold env HOME=/tmp/coldhome $LAB timeout ${COLD_T:-900} python dsv4_lab/beds/engine_bed.py --out "$OUT/cold.json" \
      --lengths 20,300 --watchdog-timeout 300
    # what it compiled, merged into this HOME's caches (nothing there overwritten): later steps start warm
    for d in .triton .cache .tilelang; do [ -d /tmp/coldhome/$d ] && cp -an /tmp/coldhome/$d ~/ ; done ;;
  e2e-floors)
    run floor-alone env ENABLE_SGLANG_DSV4_A100_PATCH=0 timeout $((300 + TW)) python dsv4_lab/beds/engine_bed.py \
      --out "$OUT/native-alone.json" --teacher-from "$ORACLE" --teacher-mode alone
    for p in ${PERTURB:-1e-4 1e-3}; do
      run "floor-perturb-$p" env ENABLE_SGLANG_DSV4_A100_PATCH=0 timeout 300 python dsv4_lab/beds/engine_bed.py \
        --out "$OUT/native-perturb-$p.json" --teacher-from "$ORACLE" --perturb "$p"
    done
    # beside e2e on one GPU (par with PAR_SAME_GPU): its record, once it is there
    [ "$TW" != 0 ] && [ ! -f "$OUT/engine-e2e.json" ] && need "$OUT/engine-e2e.json"
    if [ -f "$OUT/engine-e2e.json" ]; then
      : > "$OUT/e2e-floors.log"
      vs_floors "$OUT/engine-e2e.json" "$OUT/e2e-floors.log"
      # the SM80 path's own sensitivity to the same change (BF16 linears, no FP8 activation rounding): if it is
      # much smaller than native's, the patched-vs-native gap is native's own rounding noise
      p=$(echo ${PERTURB:-1e-4 1e-3} | cut -d' ' -f1)
      run "patched-perturb-$p" env $LAB DSV4_SM80_TRIPWIRE=1 timeout 300 python dsv4_lab/beds/engine_bed.py \
        --out "$OUT/patched-perturb-$p.json" --teacher-from "$ORACLE" --perturb "$p"
      for ab in "$OUT/engine-e2e.json:$OUT/patched-perturb-$p.json:SM80" "$ORACLE:$OUT/native-perturb-$p.json:native"; do
        IFS=: read -r ref moved who <<< "$ab"
        echo "=== the $who path against itself with its embedding moved one ulp in $p of its entries" \
          | tee -a "$OUT/e2e-floors.log"
        python dsv4_lab/beds/compare.py "$ref" "$moved" 2>&1 | tee -a "$OUT/e2e-floors.log"
      done
    fi ;;
  machines)
    # the floor across machines beside batch composition: this machine's native teacher-forcing an earlier
    # machine's native record ($PREV: same generated checkpoint, same sequences and batch), its one-at-a-time run,
    # and the patched path on the same sequences
    PREV=${PREV:?machines needs PREV, the native engine_bed record of another machine}
    [ -s "$PREV" ] || { echo "=== machines: no $PREV (an earlier machine's native engine_bed record)"; exit 1; }
    run machines-native env ENABLE_SGLANG_DSV4_A100_PATCH=0 timeout 300 python dsv4_lab/beds/engine_bed.py \
      --out "$OUT/native-here.json" --teacher-from "$PREV"
    run machines-alone env ENABLE_SGLANG_DSV4_A100_PATCH=0 timeout 300 python dsv4_lab/beds/engine_bed.py \
      --out "$OUT/native-here-alone.json" --teacher-from "$PREV" --teacher-mode alone
    run machines-patched env $LAB DSV4_SM80_TRIPWIRE=1 timeout 300 python dsv4_lab/beds/engine_bed.py \
      --out "$OUT/patched-here.json" --teacher-from "$PREV"
    {
      echo "=== native here against native on the earlier machine (the across-machines floor)"
      python dsv4_lab/beds/compare.py "$PREV" "$OUT/native-here.json"
      echo "=== patched here against native on the earlier machine; floors: native here, native here one at a time"
      python dsv4_lab/beds/compare.py "$PREV" "$OUT/patched-here.json" --floor "$OUT/native-here.json" \
        --floor "$OUT/native-here-alone.json"
      echo "=== patched here against native here; floor: native here one at a time (batch composition only)"
      python dsv4_lab/beds/compare.py "$OUT/native-here.json" "$OUT/patched-here.json" --floor "$OUT/native-here-alone.json"
    } 2>&1 | tee "$OUT/machines.log" | grep -E "^(===|verdict|confident)" ;;
  attn-bench)
    run attn-bench timeout 500 python bench/attention.py --variants --profile 1,8 --out "$OUT/attention.json" ;;
  mma-peak)
    run mma-peak timeout 120 python bench/mma_peak.py --out "$OUT/mma_peak.json" ;;
  idx-bench)
    run idx-bench timeout 300 python bench/indexer.py --out "$OUT/indexer.json" ;;
  floor)
    # N16_FROM=an earlier machine's native16.json(.xz): this machine's native run teacher-forces its sequences in
    # the same batch, so that pair is the across-machines floor (kept as $OUT/native16-prev.json; floors() adds it)
    B16="--lengths 20,300,3000,20000 --batch 16"; TF=""
    if [ -n "${N16_FROM:-}" ] && [ ! -s "$N16_FROM" ]; then
      echo "=== floor: N16_FROM=$N16_FROM is missing or empty: no across-machines floor"
      N16_FROM=""
    fi
    if [ -n "${N16_FROM:-}" ]; then
      case $N16_FROM in *.xz) xz -dc "$N16_FROM" > "$OUT/native16-prev.json" ;; *) cp "$N16_FROM" "$OUT/native16-prev.json" ;; esac
      TF="--teacher-from $OUT/native16-prev.json"
    fi
    run native16 env ENABLE_SGLANG_DSV4_A100_PATCH=0 timeout 280 \
      python dsv4_lab/beds/engine_bed.py --out "$OUT/native16.json" $B16 $TF
    [ -n "$TF" ] && python dsv4_lab/beds/compare.py "$OUT/native16.json" "$OUT/native16-prev.json" \
      | tee -a "$OUT/native16-machines.log"
    run native16b env ENABLE_SGLANG_DSV4_A100_PATCH=0 timeout 280 \
      python dsv4_lab/beds/engine_bed.py --out "$OUT/native16b.json" $B16 --teacher-from "$OUT/native16.json" \
      --teacher-mode alone
    python dsv4_lab/beds/compare.py "$OUT/native16.json" "$OUT/native16b.json" | tee -a "$OUT/native16b.log" ;;
  parity)
    N16=${N16:-$OUT/oracle/native16.json}; F16=${F16:-$OUT/oracle/native16b.json}
    for combo in bf16:marlin bf16:mxfp4_int8 fp8_marlin:marlin; do
      d=${combo%%:*}; b=${combo##*:}
      run "parity-$d-$b" env $LAB DSV4_SM80_TRIPWIRE=1 SGLANG_DSV4_A100_DENSE=$d SGLANG_DSV4_MXFP4_MOE_BACKEND=$b \
        timeout 200 python dsv4_lab/beds/engine_bed.py --out "$OUT/parity-$d-$b.json" --lengths 20,300,3000,20000 \
        --batch 16 --teacher-from "$N16"
      python dsv4_lab/beds/compare.py "$N16" "$OUT/parity-$d-$b.json" $(floors) | tee -a "$OUT/parity-$d-$b.log"
    done ;;
  floor-ours)
    # native itself with the SGLang options the SM80 bootstrap pins that native can run (native_pins()),
    # against default native: how far native's own options move it.
    # parity-pinned holds the SM80 path to this run.
    N16=${N16:-$OUT/oracle/native16.json}; F16=${F16:-$OUT/oracle/native16b.json}
    run native16-ours env ENABLE_SGLANG_DSV4_A100_PATCH=0 $(native_pins) timeout 280 python dsv4_lab/beds/engine_bed.py \
      --out "$OUT/native16-ours.json" --lengths 20,300,3000,20000 --batch 16 --teacher-from "$N16"
    python dsv4_lab/beds/compare.py "$N16" "$OUT/native16-ours.json" $(floors) | tee -a "$OUT/native16-ours.log" ;;
  floor-pins)
    # native with each SGLang option the SM80 bootstrap pins (dsv4_sm80/env.py IMPORT_TIME_DEFAULTS), one at a
    # time, against default native with the floor beside it: how far each of SGLang's own choices moves native
    N16=${N16:-$OUT/oracle/native16.json}; F16=${F16:-$OUT/oracle/native16b.json}; need "$F16"
    for kv in $(native_pins); do  # the torch paged-MQA fallback alone crashes native (native_pins)
      n=${kv%%=*}
      run "pin-$n" env ENABLE_SGLANG_DSV4_A100_PATCH=0 $kv timeout 280 python dsv4_lab/beds/engine_bed.py \
        --out "$OUT/pin-$n.json" --lengths 20,300,3000,20000 --batch 16 --teacher-from "$N16"
      python dsv4_lab/beds/compare.py "$N16" "$OUT/pin-$n.json" $(floors) | tee -a "$OUT/pin-$n.log" | grep verdict
    done ;;
  parity-pinned)
    # the oracle the SM80 path can be held to: native with every pin it can run (SGLang's own options an SM80 run must
    # take), its floor (one sequence at a time), then patched with marlin experts, as is and with native's
    # FP8 roundings replayed, against it
    N16=${N16:-$OUT/oracle/native16.json}; F16=${F16:-$OUT/oracle/native16b.json}; need "$F16"
    B16="--lengths 20,300,3000,20000 --batch 16"; P=$OUT/native16-ours.json
    [ -f "$P" ] || OUT=$OUT N16=$N16 F16=$F16 NO_JIT_TAR=1 "$0" floor-ours  # that run (with its figure against native)
    run native16-pinned-b env ENABLE_SGLANG_DSV4_A100_PATCH=0 $(native_pins) timeout 280 python dsv4_lab/beds/engine_bed.py \
      --out "$OUT/native16-pinned-b.json" $B16 --teacher-from "$P" --teacher-mode alone
    python dsv4_lab/beds/compare.py "$P" "$OUT/native16-pinned-b.json" | tee -a "$OUT/native16-pinned-b.log"
    # dense:experts:roundings; the default combination first, then the other backend and dense mode as is
    for c in ${PINNED_COMBOS:-bf16:marlin:0 bf16:marlin:act bf16:marlin:kv,act bf16:mxfp4_int8:0 fp8_marlin:marlin:0}; do
      IFS=: read -r d b nr <<< "$c"; n="parity-pinned-$d-$b-${nr//,/-}"
      run "$n" env $LAB DSV4_SM80_TRIPWIRE=1 DSV4_SM80_LAB_NATIVE_ROUNDING=$nr SGLANG_DSV4_A100_DENSE=$d \
        SGLANG_DSV4_MXFP4_MOE_BACKEND=$b timeout 250 python dsv4_lab/beds/engine_bed.py \
        --out "$OUT/$n.json" $B16 --teacher-from "$P"
      python dsv4_lab/beds/compare.py "$P" "$OUT/$n.json" --floor "$OUT/native16-pinned-b.json" | tee -a "$OUT/$n.log"
    done ;;
  parity-replay)
    # native's FP8 roundings replayed on the SM80 path (dsv4_lab/rounding.py): does the gap fall to the floor?
    N16=${N16:-$OUT/oracle/native16.json}; F16=${F16:-$OUT/oracle/native16b.json}
    for nr in kv kv,act kv,act,idx; do
      run "parity-replay-${nr//,/-}" env $LAB DSV4_SM80_TRIPWIRE=1 DSV4_SM80_LAB_NATIVE_ROUNDING=$nr \
        SGLANG_DSV4_MXFP4_MOE_BACKEND=marlin timeout 250 python dsv4_lab/beds/engine_bed.py \
        --out "$OUT/parity-replay-${nr//,/-}.json" --lengths 20,300,3000,20000 --batch 16 --teacher-from "$N16"
      python dsv4_lab/beds/compare.py "$N16" "$OUT/parity-replay-${nr//,/-}.json" $(floors) \
        | tee -a "$OUT/parity-replay-${nr//,/-}.log"
    done ;;
  trace)
    # one prompt's prefill module by module (dsv4_lab/trace.py): native, native with its pins (what SGLang's
    # own options change, per module), patched as is and with native's FP8 roundings replayed; the compare names
    # the first module whose output differs much more than its input
    # (tripwire off here: e2e proves the path; a trip would cost the trace)
    L=${TRACE_LEN:-300}; T="python dsv4_lab/beds/layer_trace.py --length $L --out-dir $OUT/trace"
    R=" ${TRACE_RUNS:-native pinned perturbed patched replay} "  # which runs (a subset saves device time)
    [[ $R == *" native "* ]] && run trace-native env ENABLE_SGLANG_DSV4_A100_PATCH=0 timeout 1200 $T-native  # a cold machine compiles ~9 min first
    [[ $R == *" pinned "* ]] && run trace-pinned env ENABLE_SGLANG_DSV4_A100_PATCH=0 $(native_pins) timeout 200 $T-pinned
    # the pinned run again with its embedding moved one ulp in 1e-4 of its entries (dsv4_lab/perturb.py): per module, how
    # far native itself moves for a rounding-level input change (the floor column of the compares below)
    [[ $R == *" perturbed "* ]] && run trace-perturbed env ENABLE_SGLANG_DSV4_A100_PATCH=0 $(native_pins) timeout 200 \
      $T-perturbed --perturb ${TRACE_PERTURB:-1e-4}
    [[ $R == *" patched "* ]] && run trace-patched env $LAB SGLANG_DSV4_MXFP4_MOE_BACKEND=marlin timeout 250 $T-patched
    [[ $R == *" replay "* ]] && run trace-replay env $LAB DSV4_SM80_LAB_NATIVE_ROUNDING=kv,act,idx \
      SGLANG_DSV4_MXFP4_MOE_BACKEND=marlin timeout 250 $T-replay
    # (not by default) the replay with native's own DeepGEMM linears and mHC GEMM: what the attention kernel adds
    [[ $R == *" gemm "* ]] && run trace-gemm env $LAB DSV4_SM80_LAB_NATIVE_ROUNDING=kv,gemm,idx \
      SGLANG_DSV4_MXFP4_MOE_BACKEND=marlin timeout 250 $T-gemm
    # native's pins against native; the SM80 path against the pinned oracle (as parity-pinned), the perturbed
    # pinned run beside it (the floor column)
    for ab in native:pinned pinned:perturbed pinned:patched pinned:replay pinned:gemm; do
      a=${ab%%:*}; b=${ab##*:}; F=$([ $a = pinned ] && [ $b != perturbed ] && echo --floor "$OUT/trace-perturbed")
      for r in $a $b; do  # a pair whose runs this call neither made nor found (TRACE_RUNS) is left out
        [[ $R == *" $r "* ]] || [ -d "$OUT/trace-$r" ] || continue 2
      done
      python -m dsv4_lab.trace "$OUT/trace-$a" "$OUT/trace-$b" $F | tee -a "$OUT/trace-$b.log"
      python -m dsv4_lab.trace "$OUT/trace-$a" "$OUT/trace-$b" $F --all > "$OUT/trace-$b-all.txt" 2>&1
    done
    # each run's linears on their own recorded inputs against exact / bf16 / fp8-act models of their arithmetic:
    # is native's FP8 linear what dsv4_lab/rounding.py's act replay says, and how far is each path from exact
    for r in native pinned perturbed patched replay gemm; do
      [ -d "$OUT/trace-$r" ] && python -m dsv4_lab.trace "$OUT/trace-$r" --linears 2>&1 | tee "$OUT/trace-$r-linears.txt" | tail -1
    done ;;  # the traces themselves (*.pt, hundreds of MB) stay on the host; the per-module tables come back
  trace-linears)
    L=${TRACE_LEN:-300}
    [ -d "$OUT/trace-native" ] || run trace-native env ENABLE_SGLANG_DSV4_A100_PATCH=0 timeout 1200 \
      python dsv4_lab/beds/layer_trace.py --length $L --out-dir $OUT/trace-native
    python -m dsv4_lab.trace "$OUT/trace-native" --linears --sglang-models 2>&1 \
      | tee "$OUT/trace-native-sglang-linears.txt" | tail -1 ;;
  graphs)
    for g in eager graph; do
      run "graphs-$g" env $LAB DSV4_SM80_TRIPWIRE=1 timeout $((280 + TW)) python dsv4_lab/beds/engine_bed.py \
        --out "$OUT/graphs-$g.json" --teacher-from "$ORACLE" --max-new 64 $([ $g = graph ] && echo --cuda-graph)
    done
    python dsv4_lab/beds/compare.py "$OUT/graphs-eager.json" "$OUT/graphs-graph.json" | tee -a "$OUT/graphs-graph.log" ;;
  graphs-self)
    # graphs without the native oracle (a cold native start compiles for minutes): a patched eager run makes the
    # teacher sequences ($SELF, unless there; SELF_T, 540 s, covers its cold Triton compiles)
    SELF=${SELF:-$OUT/self.json}
    [ -f "$SELF" ] || run graphs-self env $LAB DSV4_SM80_TRIPWIRE=1 timeout ${SELF_T:-540} python dsv4_lab/beds/engine_bed.py \
      --out "$SELF" --max-new 64
    OUT=$OUT ORACLE=$SELF "$0" graphs ;;
  spec)
    run spec-off env $LAB DSV4_SM80_TRIPWIRE=1 timeout 250 python dsv4_lab/beds/engine_bed.py \
      --out "$OUT/spec-off.json" --teacher-from "$ORACLE" --lengths 20,300 --max-new 64
    run spec-dspark env $LAB DSV4_SM80_TRIPWIRE=1 timeout 300 python dsv4_lab/beds/engine_bed.py \
      --out "$OUT/spec-dspark.json" --teacher-from "$ORACLE" --lengths 20,300 --max-new 64 --speculative-algorithm DSPARK
    python dsv4_lab/beds/compare.py "$OUT/spec-off.json" "$OUT/spec-dspark.json" | tee -a "$OUT/spec-dspark.log"
    # the floor: native SGLang's own DSPARK against its own non-speculative decode, same prompts
    run spec-native-off env ENABLE_SGLANG_DSV4_A100_PATCH=0 timeout 250 python dsv4_lab/beds/engine_bed.py \
      --out "$OUT/spec-native-off.json" --teacher-from "$ORACLE" --lengths 20,300 --max-new 64
    run spec-native-dspark env ENABLE_SGLANG_DSV4_A100_PATCH=0 timeout 300 python dsv4_lab/beds/engine_bed.py \
      --out "$OUT/spec-native-dspark.json" --teacher-from "$ORACLE" --lengths 20,300 --max-new 64 \
      --speculative-algorithm DSPARK
    python dsv4_lab/beds/compare.py "$OUT/spec-native-off.json" "$OUT/spec-native-dspark.json" \
      | tee -a "$OUT/spec-native-dspark.log" ;;
  wide)
    # $WIDE.ok once complete: the steps on it (another lane, or THEN) check for it, not for the folder
    rm -f "$WIDE.ok"
    # the head scale: generate.PEAKED_HEAD_SCALE["wide"] (peaked outputs like the tiny bed's)
    run wide timeout 500 python -m dsv4_sm80 make-tiny "$WIDE" --preset wide --head-scale 4.243
    [ $rc = 0 ] && [ -f "$WIDE/config.json" ] && touch "$WIDE.ok" ;;
  wide-parity)
    # the full-width checkpoint (step wide first): native, native teacher-forcing one sequence at a time (the
    # floor), patched with the tripwire; the whole model at DSV4-Flash width on one GPU
    W="--ckpt $WIDE --preset wide --lengths 20,300,3000 --batch 8 --max-new 16"
    [ -f "$WIDE.ok" ] || { echo "=== wide-parity: no complete $WIDE (step wide first)"; exit 1; }
    run wide-native env ENABLE_SGLANG_DSV4_A100_PATCH=0 timeout 900 python dsv4_lab/beds/engine_bed.py \
      --out "$OUT/wide-native.json" $W
    run wide-native-b env ENABLE_SGLANG_DSV4_A100_PATCH=0 timeout 900 python dsv4_lab/beds/engine_bed.py \
      --out "$OUT/wide-native-b.json" $W --teacher-from "$OUT/wide-native.json" --teacher-mode alone
    run wide-patched env $LAB DSV4_SM80_TRIPWIRE=1 timeout 900 python dsv4_lab/beds/engine_bed.py \
      --out "$OUT/wide-patched.json" $W --teacher-from "$OUT/wide-native.json"
    python dsv4_lab/beds/compare.py "$OUT/wide-native.json" "$OUT/wide-patched.json" --floor "$OUT/wide-native-b.json" \
      | tee -a "$OUT/wide-patched.log" ;;
  e2e-bench)
    [ -f "$WIDE.ok" ] || { echo "=== e2e-bench: no complete $WIDE (step wide first)"; exit 1; }
    # every mode (native, the SM80 path, and it with the experts on Marlin or the dense linears on FP8-Marlin) and
    # each one's kernels over 16 decode steps at each batch: which stage a gap to native comes from
    run e2e-bench timeout 1000 python bench/e2e.py --ckpt "$WIDE" --out "$OUT/e2e.json" --tp ${E2E_TP:-1} \
      --modes ${E2E_MODES:-native,patched,patched-marlin,patched-fp8} --profile "$OUT/e2e-prof" ${E2E_ARGS:-}
    grep -A60 "^kernels per decode step" "$OUT/e2e-bench.log" > "$OUT/e2e-kernels.txt" ;;
  tp4|tp)
    TP=${TP:-4}
    T4="--tp $TP --cuda-graph --cuda-graph-max-bs 8 --lengths 20,300,3000"
    LAB4="$(lab_tp "$TP") DSV4_SM80_TRIPWIRE=1"
    run tp$TP-native env ENABLE_SGLANG_DSV4_A100_PATCH=0 timeout 200 python dsv4_lab/beds/engine_bed.py \
      --out "$OUT/tp$TP-native.json" $T4
    run tp$TP-patched env $LAB4 timeout 200 python dsv4_lab/beds/engine_bed.py --out "$OUT/tp$TP-patched.json" $T4 \
      --teacher-from "$OUT/tp$TP-native.json"
    python dsv4_lab/beds/compare.py "$OUT/tp$TP-native.json" "$OUT/tp$TP-patched.json" | tee -a "$OUT/tp$TP-patched.log"
    run tp$TP-dspark env $LAB4 timeout 200 python dsv4_lab/beds/engine_bed.py --out "$OUT/tp$TP-dspark.json" $T4 \
      --teacher-from "$OUT/tp$TP-native.json" --speculative-algorithm DSPARK
    python dsv4_lab/beds/compare.py "$OUT/tp$TP-patched.json" "$OUT/tp$TP-dspark.json" | tee -a "$OUT/tp$TP-dspark.log"
    run tp$TP-native-b env ENABLE_SGLANG_DSV4_A100_PATCH=0 timeout 200 python dsv4_lab/beds/engine_bed.py \
      --out "$OUT/tp$TP-native-b.json" $T4 --teacher-from "$OUT/tp$TP-native.json" --teacher-mode alone
    python dsv4_lab/beds/compare.py "$OUT/tp$TP-native.json" "$OUT/tp$TP-patched.json" --floor "$OUT/tp$TP-native-b.json" \
      | tee -a "$OUT/tp$TP-native-b.log" ;;
  par)
    shift; i=0
    for group in "$@"; do
      # PAR_SAME_GPU=1: every group on GPU 0 (a one-GPU machine: kernel tests beside an engine's cold compile, or
      # engines side by side: each KV pool capped, and a teacher-forcing engine starts and compiles while the
      # record it reads is still being made, e.g. par oracle e2e graphs e2e-floors)
      ( [ -n "${PAR_SAME_GPU:-}" ] && export DSV4_BED_MAX_TOKENS=${DSV4_BED_MAX_TOKENS:-131072} \
          DSV4_BED_TEACHER_WAIT=${DSV4_BED_TEACHER_WAIT:-1500}
        for s in $group; do CUDA_VISIBLE_DEVICES=$([ -n "${PAR_SAME_GPU:-}" ] && echo 0 || echo $i) NO_JIT_TAR=1 OUT=$OUT "$0" "$s" || echo "=== $s: failed"; done ) \
        >"$OUT/par-$i.txt" 2>&1 &
      i=$((i + 1))
    done
    wait
    i=0
    for group in "$@"; do echo "##### GPU $i: $group"; cat "$OUT/par-$i.txt"; i=$((i + 1)); done ;;
  bg)
    # par, detached, from a copy of the tree (a later device call refreshes the tree under a running script):
    # device calls then only wait on it (step wait), so GPU time is not lost between calls
    shift
    rm -rf /tmp/res /tmp/w && mkdir -p /tmp/res && cp -a . /tmp/w
    # JIT_TAR=an earlier run's jit.tar.xz: its caches restored once before the steps
    if [ -f "${JIT_TAR:-}" ] && [ ! -f ~/.dsv4-jit-restored ]; then
      tar -C ~ -xJf "$JIT_TAR" && touch ~/.dsv4-jit-restored && echo "bg: JIT caches restored from $JIT_TAR"
    fi
    # THEN="s1 s2": steps run after every group, one at a time, with all GPUs visible (e.g. tp4); first the JIT seed
    # beside the engines: this path's SGLang JIT modules for this GPU, every mode's (the seed holds what a host built
    # before; the FP8-Marlin GEMM was in none of them), several at a time (PREBUILD=0: not)
    setsid nohup bash -c 'cd /tmp/w && export OUT=/tmp/res NO_JIT_TAR=1; dsv4_lab/beds/steps.sh seed > /tmp/res/seed.out 2>&1
      [ "${PREBUILD:-1}" = 1 ] && (python -m dsv4_sm80 prebuild-jit --arch gpu --all-modes --jobs 8 \
        --out /tmp/res/prebuild.json > /tmp/res/prebuild.out 2>&1 &)
      dsv4_lab/beds/steps.sh par "$@" > /tmp/res/par.out 2>&1
      for s in ${THEN:-}; do dsv4_lab/beds/steps.sh "$s" >> /tmp/res/then.txt 2>&1 || echo "=== $s: failed" >> /tmp/res/then.txt; done
      NO_JIT_TAR= dsv4_lab/beds/steps.sh jitpack > /dev/null 2>&1; touch /tmp/res/DONE' \
      _ "$@" > /dev/null 2>&1 < /dev/null &
    echo "bg: started on $# GPU group(s)${THEN:+, then $THEN}; results in /tmp/res (steps.sh wait SECONDS brings them back)"
    exit 0 ;;
  jitpack) ;;  # only the JIT cache tarball below
  seed)
    # SGLang's JIT modules of the committed seed ($JIT_SEED) built on all cores before any engine starts (a cold
    # native start builds them one at a time for 16+ minutes); `wait` packs this host's into $OUT
    # (and FlashInfer's, $FI_SEED, each into the cache it was packed from)
    if [ -f "$JIT_SEED" ]; then run jit-seed python dsv4_lab/beds/jit_seed.py build --seed "$JIT_SEED"
    else echo "=== seed: no $JIT_SEED (a run's \$OUT/jit-seed.json.xz, committed there, makes one)"; fi
    [ -f "$FI_SEED" ] && run jit-seed-flashinfer python dsv4_lab/beds/jit_seed.py build --seed "$FI_SEED" ;;
  wait)
    # up to $2 seconds (default 500) for the bg job, then its summaries and a tarball of /tmp/res into $OUT
    limit=${2:-500}; t0=$SECONDS
    while [ ! -f /tmp/res/DONE ] && [ $((SECONDS - t0)) -lt "$limit" ]; do sleep 5; done
    [ -f /tmp/res/DONE ] && echo "wait: bg job done" || echo "wait: bg job still running after ${limit} s"
    for f in /tmp/res/seed.out /tmp/res/prebuild.out /tmp/res/par-*.txt /tmp/res/then.txt; do
      [ -f "$f" ] || continue
      echo "##### $f"; grep -E "^(===|[a-z_-]+: |  A/B|  OK|  FAIL|seq |prompt |confident|  +[0-9]+ +[0-9]+ \|)" "$f" | cut -c1-220 | tail -40
    done
    tar -C /tmp/res -czf "$OUT/res-$(date +%H%M%S).tgz" --exclude='jit.tar.xz*' --exclude='*.pt' \
      $(cd /tmp/res && find . -name '*.json' -size +1M -printf '--exclude=%P ') . 2>/dev/null
    [ -f /tmp/res/DONE ] && cp /tmp/res/jit.tar.xz* "$OUT/" 2>/dev/null
    # the sources of every SGLang JIT module built or building on this host so far, with the committed seed's (a few
    # KB each; bg finished or not: commit it as $JIT_SEED and the next fresh host builds them in parallel, step seed)
    python dsv4_lab/beds/jit_seed.py pack --unfinished --out "$OUT/jit-seed.json.xz" --merge "$JIT_SEED" | tail -1
    for fi in ~/.cache/flashinfer/*/*/cached_ops; do  # FlashInfer's (sampling), as $FI_SEED
      [ -d "$fi" ] && python dsv4_lab/beds/jit_seed.py pack --cache "$fi" --out "$OUT/jit-seed-flashinfer.json.xz" \
        --merge "$FI_SEED" | tail -1
    done
    # JIT_NOW=1: the caches as they are now, even with bg still running (a budget that ends first loses them)
    [ -n "${JIT_NOW:-}" ] && [ ! -f /tmp/res/DONE ] && jit_tar
    # the native batch-16 record, compressed (~3 MB; as JSON it is over the 16 MiB a returned file may be): a
    # later run's `floor` teacher-forces it (N16_FROM) for the across-machines floor
    [ -f /tmp/res/native16b.json ] && xz -T0 -6 -c /tmp/res/native16.json > "$OUT/native16.json.xz"
    exit 0 ;;
  http)
    run http env $LAB timeout 560 python -u dsv4_lab/beds/http_check.py --out "$OUT/http.json" ;;
  http-vision)
    run http-vision env $LAB DSV4_SM80_TRIPWIRE=1 timeout 560 python -u dsv4_lab/beds/http_check.py --vision --port 30223 \
      --out "$OUT/http-vision.json" ;;
  vision-ab)
    run http-vision env $LAB DSV4_SM80_TRIPWIRE=1 timeout 280 python -u dsv4_lab/beds/http_check.py --vision --port 30223 \
      --out "$OUT/http-vision.json"
    run http-vision-native timeout 280 python -u dsv4_lab/beds/http_check.py --vision --port 30223 --native \
      --out "$OUT/http-vision-native.json" --compare "$OUT/http-vision.json"
    run http-vision-chunked env $LAB DSV4_SM80_TRIPWIRE=1 timeout 280 python -u dsv4_lab/beds/http_check.py --vision --port 30223 \
      --chunked-prefill-size 256 --out "$OUT/http-vision-chunked.json" --compare "$OUT/http-vision.json" ;;
  vision-replay|vision-gemm)
    # vision-ab's teacher-forced image prompts with native's FP8 roundings replayed on the patched server: is the
    # vision A/B's gap native's rounding, as the text one's? vision-replay: kv,act,idx (act through SGLang's own
    # quantizer), tripwire on. vision-gemm: kv,gemm,idx, native's own FP8 block linear (DeepGEMM) in place of the act
    # model, Marlin experts, as e2e-gemm for text; DeepGEMM is what the
    # tripwire guards, so it is off there (vision-ab runs the shipped path with it on)
    [ -f "$OUT/http-vision-native.json" ] || run http-vision-native timeout 280 python -u dsv4_lab/beds/http_check.py \
      --vision --port 30223 --native --out "$OUT/http-vision-native.json"
    if [ "$1" = vision-gemm ]; then replay="DSV4_SM80_LAB_NATIVE_ROUNDING=kv,gemm,idx SGLANG_DSV4_MXFP4_MOE_BACKEND=marlin"
    else replay="DSV4_SM80_TRIPWIRE=1 DSV4_SM80_LAB_NATIVE_ROUNDING=kv,act,idx"; fi
    run "http-$1" env $LAB $replay timeout 280 python -u dsv4_lab/beds/http_check.py --vision --port 30223 \
      --out "$OUT/http-$1.json" --compare "$OUT/http-vision-native.json" ;;
  engine-wide)
    # the one-token MoE (config wide) in the engine, in CUDA graphs, tripwire on: the one-at-a-time decodes run one token
    # a step (wide), the batched ones three (gemv); engine_bed prints how many greedy tokens the two agree on
    run engine-wide env $LAB DSV4_SM80_TRIPWIRE=1 timeout 400 python dsv4_lab/beds/engine_bed.py --cuda-graph --max-new 64 \
      --out "$OUT/engine-wide.json" ;;
  vision)
    run vision env $LAB timeout 400 python -u dsv4_lab/beds/vision_check.py --out "$OUT/vision.json" ;;
  hygiene)
    run hygiene env $LAB DSV4_SM80_TRIPWIRE=1 timeout 560 python -u dsv4_lab/beds/hygiene.py --out "$OUT/hygiene.json"
    run hygiene-dspark env $LAB DSV4_SM80_TRIPWIRE=1 timeout 560 python -u dsv4_lab/beds/hygiene.py --dspark \
      --out "$OUT/hygiene-dspark.json" ;;
  fault)
    run fault env $LAB timeout 400 python -u dsv4_lab/beds/fault_kill.py --out "$OUT/fault.json" ;;
  fault-tp)
    # the last TP rank's scheduler killed at TP=$TP (2 or 4; the gate's count is overridden below 4)
    TP=${TP:-2}
    run fault-tp$TP env $(lab_tp "$TP") timeout 400 python -u dsv4_lab/beds/fault_kill.py --tp $TP --rank $((TP - 1)) \
      --out "$OUT/fault-tp$TP.json" ;;
  soak)
    # (bg runs it detached: longer than one device call is fine) the memory log from inside the server beside it
    run soak env $LAB timeout $((${SOAK_MIN:-6} * 60 + 300)) python -u dsv4_lab/beds/soak.py --minutes ${SOAK_MIN:-6} \
      --out "$OUT/soak.json" ;;
  soak-native)
    # the same load on native SGLang (patch off): does its GPU memory grow the same way under it?
    run soak-native timeout $((${SOAK_MIN:-6} * 60 + 300)) python -u dsv4_lab/beds/soak.py --native \
      --minutes ${SOAK_MIN:-6} --out "$OUT/soak-native.json" ;;
  soak-dspark)
    run soak-dspark env $LAB timeout $((${SOAK_MIN:-6} * 60 + 300)) python -u dsv4_lab/beds/soak.py \
      --minutes ${SOAK_MIN:-6} --dspark --out "$OUT/soak-dspark.json" ;;
  jit)
    # a separate cache: sm_80 builds must not be picked up by this H200's own runs
    run jit env TVM_FFI_CACHE_DIR=/tmp/jit-sm80 timeout 560 python -u dsv4_lab/beds/jit_sm80.py --out "$OUT/jit_sm80.json" ;;
  kernels)
    # every kernel test, compiled on this GPU (the references still run on the CPU)
    run kernels timeout 540 python -m pytest -q -p no:cacheprovider tests/kernels
    run mhc-check timeout 120 python dsv4_lab/beds/mhc_check.py --out "$OUT/mhc_check.json" ;;
  mhc-bench)
    run mhc-bench timeout 420 python bench/mhc.py --variants --out "$OUT/mhc.json" ;;
  moe-bench)
    # every size, every row's kernel of the W4A8 table beside the default (the switch points)
    # (MMA=v3 lets Triton take wgmma on an H200; by default mma.sync only, an A800's instruction)
    run moe-bench $MMA_ENV timeout 540 python bench/moe.py --variants --out "$OUT/moe.json" ;;
  moe-close)
    # the MoE table in one run: the one-token wide path's kernel tests on this GPU at this commit, then every size
    # (decode 1-64, prefill 512-16384) with the defaults and SGLang's Marlin in the same process (its JIT
    # Marlin MoE built by `seed` first: cold, ~5 minutes on its own, which a bench limit must not have to absorb)
    run moe-close-tests timeout 400 python -m pytest -q -p no:cacheprovider \
      tests/kernels/test_w4a8_moe.py -k "'wide or one_token or gemv_equals or kernel_equals or routed_scaling'"
    run moe-close $MMA_ENV timeout ${MOE_T:-900} python bench/moe.py --out "$OUT/moe-close.json" ;;
  moe-wide)
    # the experts of bench/e2e.py's full-width checkpoint on one GPU (intermediate 2048, TP1): the decode tiles and
    # each kernel's time against Marlin at the batch where e2e-bench's decode fell behind (16 tokens)
    run moe-wide timeout 540 python bench/moe.py --inter 2048 --tokens 1,16,64 --variants --profile \
      --out "$OUT/moe-wide.json" ;;
  moe-prefill)
    # the prefill sweep: the table's prefill rows (MOE_ONLY) at MOE_TOKENS (512,2048,8192,16384), Marlin beside the
    # default where SGLang is importable, kernels profiled
    run moe-prefill $MMA_ENV timeout ${MOE_T:-540} python bench/moe.py --tokens ${MOE_TOKENS:-512,2048,8192,16384} --variants \
      --only "'${MOE_ONLY:-mma|expand}'" --profile --out "$OUT/moe-prefill.json" ;;
  moe-ncu)
    # Nsight Compute of the W4A8 launches (the second of two eager calls: gate-up and down) per variant at
    # NCU_TOKENS (8192): occupancy, issue slots, warp stalls, DRAM; NCU_VARIANTS '|'-separated table rows (default
    # and the expanded path); no SGLang needed (torch alignment fallback; its launches are not profiled)
    NCU=${NCU:-$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)}
    [ -n "$NCU" ] || { echo "=== moe-ncu: no ncu on this host"; exit 1; }
    IFS='|' read -ra vs <<< "${NCU_VARIANTS:-default|expand}"
    i=0
    for v in "${vs[@]}"; do
      run "moe-ncu-$i" timeout 280 "$NCU" --target-processes all -k regex:_w4a8 --launch-skip 2 --launch-count 2 \
        --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats \
        --section WarpStateStats --section MemoryWorkloadAnalysis \
        python bench/moe.py --no-marlin --tokens "${NCU_TOKENS:-8192}" --once "'$v'" --out "$OUT/moe-ncu-$i.json"
      i=$((i + 1))
    done ;;
  moe-sweep)
    # MOE_TOKENS: the sizes (e.g. 1,4: batch-1 decode at TP4 shapes); MOE_ONLY: the table rows (default: the decode ones)
    run moe-sweep timeout 540 python bench/moe.py --tokens ${MOE_TOKENS:-1,2,4,8,16,24,32,48,64} --variants \
      --only "'${MOE_ONLY:-wide|gemv|mma 16x32}'" --profile --profile-only "'${MOE_PROFILE_ONLY:-}'" --out "$OUT/moe-sweep.json" ;;
  *) echo "unknown step $1"; exit 2 ;;
esac
# keep the JIT caches this step built (restore with: cat jit.tar.xz* | tar -C ~ -xJf -)
[ -n "${NO_JIT_TAR:-}" ] && exit $rc
jit_tar
exit $rc
