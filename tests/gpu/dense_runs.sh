#!/usr/bin/env bash
# The dense stage's recorded GPU runs (docs/gpu-runs.md), in steps that each fit one device call.
# On the GPU host, from the repository root, after `source .dev/c5/setup.sh`:
#   tests/gpu/dense_runs.sh check    dense_check in both modes (in-process ModelRunner, module state)
#   tests/gpu/dense_runs.sh engine   engine_bed patched (bf16, fp8_marlin) vs the native oracle
#   tests/gpu/dense_runs.sh dspark   engine_bed patched with DSPARK: the draft's linears in the load report
#   tests/gpu/dense_runs.sh bench    bench/dense_linear.py (patch off: native FP8 is SGLang's own)
# Results go to $OUT (default ./out). The native oracle is .dev/oracle/native.json (tests/gpu/engine_bed.py).
set -u
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD:${PYTHONPATH:-} SGLANG_JIT_DEEPGEMM_PRECOMPILE=0
LAB="ENABLE_SGLANG_DSV4_A100_PATCH=1 DSV4_SM80_LAB_GPU_COUNT=1 DSV4_SM80_LAB_CC=9.0"
ORACLE=${ORACLE:-.dev/oracle/native.json}
rc=0
run() {  # name, command...: log to $OUT/name.log, keep the tail on stdout
  local name=$1; shift
  echo "=== $name: $*"
  ( eval "$@" ) >"$OUT/$name.log" 2>&1 || { echo "=== $name: exit $?"; rc=1; }
  grep -E "^(dense_check|engine_bed|  |dense_linear|load-time|x nat|ERROR|Traceback)|dsv4-sm80 dense|Error" \
    "$OUT/$name.log" | grep -v "^  File" | tail -40
}
case ${1:?step} in
  check)
    for mode in bf16 fp8_marlin; do
      run "check-$mode" env $LAB SGLANG_DSV4_A100_DENSE=$mode timeout 280 \
        python -u tests/gpu/dense_check.py --out "$OUT/dense-$mode.json"
    done ;;
  engine)
    for mode in bf16 fp8_marlin; do
      run "engine-$mode" env $LAB SGLANG_DSV4_A100_DENSE=$mode DSV4_SM80_LOAD_REPORT="$OUT/report-$mode.jsonl" \
        timeout 280 python tests/gpu/engine_bed.py --out "$OUT/engine-$mode.json" --teacher-from "$ORACLE"
      python tests/gpu/compare.py "$ORACLE" "$OUT/engine-$mode.json" | tee -a "$OUT/engine-$mode.log"
    done ;;
  dspark)
    run dspark env $LAB DSV4_SM80_LOAD_REPORT="$OUT/report-dspark.jsonl" timeout 400 \
      python tests/gpu/engine_bed.py --out "$OUT/engine-dspark.json" --teacher-from "$ORACLE" \
      --speculative-algorithm DSPARK --lengths 20,300 ;;
  bench)
    run bench env ENABLE_SGLANG_DSV4_A100_PATCH=0 timeout 540 python bench/dense_linear.py --out "$OUT/dense_linear.json" ;;
  *) echo "unknown step $1"; exit 2 ;;
esac
# keep the JIT caches this step built (restore with: tar -C ~ -xJf jit.tar.xz)
tar -C ~ -cf - .cache/tvm-ffi .cache/deep_gemm .cache/flashinfer .triton .tilelang 2>/dev/null | xz -T0 -3 > "$OUT/jit.tar.xz"
exit $rc
