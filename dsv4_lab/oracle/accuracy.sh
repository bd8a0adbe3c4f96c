#!/usr/bin/env bash
# The accuracy table on one GPU host: every serving path teacher-forced on the same sequences, scored against
# the reference oracle (R_q, R_x). README.md beside this file says what each step is; docs/accuracy.md the method.
#
#   dsv4_lab/oracle/accuracy.sh OUT_DIR
#
# Environment: CKPT (default /tmp/dsv4-tiny, generated on first use); LENGTHS (prompt lengths before the 64 teacher
# tokens, default 20,300,1984,3000: up to 2,048 tokens the C4 indexer keeps every entry, above it selects); CHUNK
# (an odd prefill chunk, default 333); SM80_ENV (default lab mode on one H200, the SM80 datapath forced onto an SM90
# GPU; on an A800 set it to ENABLE_SGLANG_DSV4_A100_PATCH=1); MUTANTS (default every name in
# dsv4_lab.mutants.MUTANTS); PROMPTS (a JSON list of prompt id lists used instead of LENGTHS' random ids: held-out
# text for the trained checkpoint, `python -m dsv4_lab.train prompts`); BED_ARGS (more engine_bed options for every
# run, e.g. `--head-scale 1.0` for the trained checkpoint, written without the generator's peaked head); DRY=1 prints
# the commands only. A step whose record exists is skipped: a cut run resumes.
set -euo pipefail
OUT=${1:?usage: accuracy.sh OUT_DIR}
CKPT=${CKPT:-/tmp/dsv4-tiny}
LENGTHS=${LENGTHS:-20,300,1984,3000}
CHUNK=${CHUNK:-333}
SM80_ENV=${SM80_ENV:-ENABLE_SGLANG_DSV4_A100_PATCH=1 DSV4_SM80_LAB_GPU_COUNT=1 DSV4_SM80_LAB_CC=9.0}
NATIVE_ENV=ENABLE_SGLANG_DSV4_A100_PATCH=0
PY=${PYTHON:-python}
PROMPT_ARGS=()
[ -z "${PROMPTS:-}" ] || PROMPT_ARGS=(--prompts "$PROMPTS")
# shellcheck disable=SC2206
PROMPT_ARGS+=(${BED_ARGS:-})
mkdir -p "$OUT"

run() {  # run NAME ENV... -- ARGS...: one step, skipped when $OUT/NAME.json exists
  local name=$1; shift
  local envs=()
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  if [ -s "$OUT/$name.json" ] && [ -z "${DRY:-}" ]; then echo "= $name: $OUT/$name.json exists"; return; fi
  echo "+ ${envs[*]} $*"
  [ -n "${DRY:-}" ] || env "${envs[@]}" "$@"
}

bed() {  # bed NAME ENV... -- ENGINE_BED_ARGS...: an engine_bed record on the reference's sequences and ids
  local name=$1; shift
  local envs=()
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  run "$name" "${envs[@]}" -- $PY -u -m dsv4_lab.beds.engine_bed --ckpt "$CKPT" --lengths "$LENGTHS" "${PROMPT_ARGS[@]}" \
    --teacher-from "$OUT/sequences.json" --token-ids-logprob "$OUT/ids.json" --out "$OUT/$name.json" "$@"
}

# 1. the sequences (native SGLang's greedy continuations), then the references on them and their support ids
run sequences $NATIVE_ENV -- $PY -u -m dsv4_lab.beds.engine_bed --ckpt "$CKPT" --lengths "$LENGTHS" \
  "${PROMPT_ARGS[@]}" --out "$OUT/sequences.json"
run ref -- $PY -u -m dsv4_lab.oracle score --ckpt "$CKPT" --record "$OUT/sequences.json" --out "$OUT/ref.json" \
  --support-out "$OUT/ids.json"

# 2. native SGLang, the bar; a second native run in another batch order, the negative control
bed native $NATIVE_ENV --
bed native-reversed $NATIVE_ENV -- --teacher-mode reversed

# 3. the SM80 datapath in each mode, batched; the default mode also alone, chunked and on a prefix-cache hit
paths=()
for dense in bf16 fp8_marlin; do
  for moe in mxfp4_int8 marlin; do
    bed "sm80-$dense-$moe" $SM80_ENV SGLANG_DSV4_A100_DENSE=$dense SGLANG_DSV4_MXFP4_MOE_BACKEND=$moe --
    paths+=(--path "sm80-$dense-$moe=$OUT/sm80-$dense-$moe.json")
  done
done
# the model's own KV and indexer roundings (docs/attention.md), each alone and together, on the default mode
for r in "kv-fp8=SGLANG_DSV4_A100_KV_ROUNDING=fp8_sim" "idx-fp4=SGLANG_DSV4_A100_INDEXER_ROUNDING=fp4_sim" \
         "qat=SGLANG_DSV4_A100_KV_ROUNDING=fp8_sim SGLANG_DSV4_A100_INDEXER_ROUNDING=fp4_sim"; do
  # shellcheck disable=SC2086
  bed "sm80-${r%%=*}" $SM80_ENV ${r#*=} --
  paths+=(--path "sm80-${r%%=*}=$OUT/sm80-${r%%=*}.json")
done
bed sm80-alone $SM80_ENV -- --teacher-mode alone
bed sm80-chunked $SM80_ENV -- --chunked-prefill-size "$CHUNK"
bed sm80-prefix-hit $SM80_ENV -- --prefix-hit
paths+=(--path "sm80-alone=$OUT/sm80-alone.json" --path "sm80-chunked=$OUT/sm80-chunked.json"
        --path "sm80-prefix-hit=$OUT/sm80-prefix-hit.json")

# 4. the fault-injection mutants (dsv4_lab/mutants.py), each on the default SM80 mode
MUTANTS=${MUTANTS-$($PY -c 'from dsv4_lab.mutants import MUTANTS; print(" ".join(MUTANTS))')}
mutants=()
for m in $MUTANTS; do
  bed "mutant-$m" $SM80_ENV DSV4_SM80_LAB=1 DSV4_SM80_LAB_MUTANT="$m" --
  mutants+=(--mutant "$m=$OUT/mutant-$m.json")
done

# 5. the table (stdout, accuracy.txt) and its JSON
echo "+ $PY -m dsv4_lab.oracle compare --ref $OUT/ref.json --native $OUT/native.json ..."
if [ -z "${DRY:-}" ]; then
  $PY -m dsv4_lab.oracle compare --ref "$OUT/ref.json" --native "$OUT/native.json" "${paths[@]}" "${mutants[@]}" \
    --control "native-reversed=$OUT/native-reversed.json" --json-out "$OUT/accuracy.json" | tee "$OUT/accuracy.txt"
fi
