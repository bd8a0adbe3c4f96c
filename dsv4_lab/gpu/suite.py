"""The GPU suite: every job a GPU host runs, declared once, in two tiers.

A job is one process (a bed, a kernel test run, the scorer) that writes its record into the results folder.
Verdicts (`verdicts.py`) read those records and hold them to fixed thresholds; `tests/gpu/` asserts the same
verdicts under pytest, and `python -m dsv4_lab.gpu run` runs the jobs inside a time budget and resumes a cut run.

- core: what a change must pass. The trained checkpoint on native SGLang and on the SM80 default path, each
  with and without DSPARK, scored against the oracle; the accuracy rule on its held-out text (the SM80 path, the
  negative control, mutants of four stages); SGLang's own DSV4 attention kit on the SM80 backend; the kernel tests
  compiled on the GPU; `serve` in lab mode over HTTP; tool calls, reasoning and structured output; the trained
  Vision-Exp's held-out picture questions on both paths, scored against the vision oracle, with one mutant.
- full: what a longer window adds: the accuracy table on the trained checkpoint, the trained Vision-Exp's 200
  questions per path with every vision mutant and chunked prefill, full depth, soak, page hygiene,
  vision (A/B over HTTP, the VL class), the dense and MoE stages after load, the mHC GEMM against DeepGEMM, a
  killed scheduler, the sm_80 JIT builds, a cold first start, and TP4 (a four-GPU host only).

Engines of different jobs share the one GPU (`gpu_share`, the fraction of its memory a job may take; each
engine's KV pool is capped at `BED_TOKENS` so several fit): speed figures made side by side are recorded with
the jobs that overlapped them and are never asserted.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass, field
from pathlib import Path

# the SM80 path forced on a one-GPU Hopper host: the gate's lab overrides (never a default)
LAB = {"ENABLE_SGLANG_DSV4_A100_PATCH": "1", "DSV4_SM80_LAB": "1", "DSV4_SM80_LAB_GPU_COUNT": "1",
       "DSV4_SM80_LAB_CC": "9.0"}
NATIVE = {"ENABLE_SGLANG_DSV4_A100_PATCH": "0"}
# engines side by side: each KV pool capped (the trained bed's longest batch is 8 windows of 3,000 ids)
BED_TOKENS = 65536
SEED = "dsv4_lab/beds/jit-seed"
# the accuracy run's mutants, one per stage: four switched at run time in one engine, the dense one at load
RUNTIME_MUTANTS = ("kv_store_skip_last", "indexer_topk_511", "router_bias_on_weights", "attn_sink_dropped")
LOAD_MUTANT = "e8m0_exponent_off"


@dataclass(frozen=True)
class Job:
    name: str
    tier: str
    estimate_s: int                # on a host whose JIT caches are built
    argv: tuple[str, ...]          # {py}: this interpreter, {res}: the results folder, {ckpt}: the trained checkpoint
    env: dict = field(default_factory=dict)
    needs: tuple[str, ...] = ()    # jobs whose records this one reads: it runs once they have ended
    gpu_share: float = 0.0         # fraction of GPU memory; 0 = no GPU (a build, an unpack)
    timeout_s: int = 540
    records: tuple[str, ...] = ()  # files it writes in the results folder
    what: str = ""

    def command(self, res: Path, ckpt: Path) -> list[str]:
        subs = {"{py}": sys.executable, "{res}": str(res), "{ckpt}": str(ckpt)}
        return [functools.reduce(lambda a, kv: a.replace(*kv), subs.items(), arg) for arg in self.argv]


def _trained(path: str, dspark: bool) -> Job:
    env = NATIVE if path == "native" else {**LAB, "DSV4_SM80_TRIPWIRE": "1"}
    name = f"trained-{path}" + ("-dspark" if dspark else "")
    spec = ("--speculative-algorithm", "DSPARK") if dspark else ()
    return Job(name, "core", 240 if dspark else 180,
               ("{py}", "-m", "dsv4_lab.beds.trained_bed", "--ckpt", "{ckpt}", "--out", "{res}/" + name + ".json",
                "--mem-fraction", "0.85", "--max-total-tokens", str(BED_TOKENS), *spec),
               env=env, needs=("unpack",), gpu_share=0.2, records=(name + ".json",),
               what=f"the trained checkpoint on the {'native' if path == 'native' else 'SM80 default'} path"
                    + (" with DSPARK" if dspark else ""))


def _env(env: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in env.items())


# moe_check on native, then each SM80 expert backend against native's outputs (the native runs first: --compare)
MOE = " && ".join(
    f"env {_env(e)} {{py}} -u -m dsv4_lab.beds.moe_check{tok} --out {{res}}/moe-{name}.pt{cmp}"
    for name, e, tok, cmp in (
        ("native", NATIVE, "", ""),
        *((b, {**LAB, "SGLANG_DSV4_MXFP4_MOE_BACKEND": b}, "", " --compare {res}/moe-native.pt")
          for b in ("marlin", "mxfp4_int8")),
        # 1,024 tokens x top-6 = 6,144 pairs: the W4A8 table's 32x64 shift tile
        ("native-1024", NATIVE, " --tokens 1024", ""),
        ("mxfp4_int8-1024", {**LAB, "SGLANG_DSV4_MXFP4_MOE_BACKEND": "mxfp4_int8"}, " --tokens 1024",
         " --compare {res}/moe-native-1024.pt")))
# every JIT cache resolves under HOME; what the cold start built is merged into the real HOME afterwards (nothing
# there overwritten), so later jobs start warm
COLD = ("rm -rf /tmp/coldhome && mkdir -p /tmp/coldhome && HOME=/tmp/coldhome {py} -m dsv4_lab.beds.engine_bed "
        "--out {res}/cold.json --lengths 20,300 --watchdog-timeout 300; rc=$?; "
        "for d in .triton .cache .tilelang; do [ -d /tmp/coldhome/$d ] && cp -an /tmp/coldhome/$d ~/; done; exit $rc")
# the gate at its production GPU count (4): no DSV4_SM80_LAB_GPU_COUNT override
LAB_TP4 = {"ENABLE_SGLANG_DSV4_A100_PATCH": "1", "DSV4_SM80_LAB": "1", "DSV4_SM80_LAB_CC": "9.0",
           "DSV4_SM80_TRIPWIRE": "1"}
_T4 = "--tp 4 --cuda-graph --cuda-graph-max-bs 8 --lengths 20,300,3000"
_BED = "{py} -m dsv4_lab.beds.engine_bed"
_CMP = "{py} -m dsv4_lab.beds.compare"
TP4 = "; ".join((
    "set -e",
    "{py} -c \"import torch; assert torch.cuda.device_count() >= 4, 'tp4 needs 4 GPUs'\"",
    f"env {_env(NATIVE)} {_BED} --out {{res}}/tp4-native.json {_T4}",
    f"env {_env(LAB_TP4)} {_BED} --out {{res}}/tp4-patched.json {_T4} --teacher-from {{res}}/tp4-native.json",
    f"{_CMP} {{res}}/tp4-native.json {{res}}/tp4-patched.json",
    f"env {_env(LAB_TP4)} {_BED} --out {{res}}/tp4-dspark.json {_T4} --teacher-from {{res}}/tp4-native.json "
    "--speculative-algorithm DSPARK",
    f"{_CMP} {{res}}/tp4-patched.json {{res}}/tp4-dspark.json",
    f"env {_env(NATIVE)} {_BED} --out {{res}}/tp4-native-b.json {_T4} --teacher-from {{res}}/tp4-native.json "
    "--teacher-mode alone",
    f"{_CMP} {{res}}/tp4-native.json {{res}}/tp4-patched.json --floor {{res}}/tp4-native-b.json"))

PATHS = ("native", "sm80")
JOBS: tuple[Job, ...] = (
    Job("jit-seed", "core", 10,
        ("bash", "-c", f"{{py}} -m dsv4_lab.beds.jit_seed build --seed {SEED}/tvm-ffi.json.xz && "
                       f"{{py}} -m dsv4_lab.beds.jit_seed build --seed {SEED}/flashinfer.json.xz"),
        timeout_s=900, what="SGLang's and FlashInfer's JIT modules built on every core (a cold host: minutes)"),
    Job("unpack", "core", 20, ("{py}", "-m", "dsv4_lab.train", "unpack", "{res}"),
        records=(), what="the committed trained checkpoint in its served shape"),
    *(_trained(p, d) for d in (False, True) for p in PATHS),
    Job("trained-score", "core", 150,
        ("{py}", "-m", "dsv4_lab.gpu", "score", "--res", "{res}", "--ckpt", "{ckpt}"),
        needs=tuple(f"trained-{p}{d}" for p in PATHS for d in ("", "-dspark")), gpu_share=0.3,
        records=("trained.json",), what="the trained records against the oracle (R_q, R_x) -> trained.json"),
    # the accuracy rule on the trained checkpoint: one engine per path; the SM80 engine switches its mutants at run
    # time, the dense one (a load-time bug in the weights) has an engine of its own
    Job("acc-prompts", "core", 10,
        ("bash", "-c", "mkdir -p {res}/acc && {py} -m dsv4_lab.train prompts {res}/acc/prompts.json"),
        what="held-out text prompts of 20, 300, 1,984 and 3,000 ids (the last one past the indexer's 2,048)"),
    Job("acc-ref", "core", 120,
        ("{py}", "-m", "dsv4_lab.oracle", "score", "--ckpt", "{ckpt}", "--record", "{res}/acc/prompts.json",
         "--refs", "R_q,R_x", "--device", "cuda", "--out", "{res}/acc/ref.json"),
        needs=("unpack", "acc-prompts"), gpu_share=0.3, what="the references R_q and R_x on the prompts"),
    Job("acc-native", "core", 200,
        ("{py}", "-m", "dsv4_lab.beds.accuracy_bed", "--ckpt", "{ckpt}", "--prompts", "{res}/acc/prompts.json",
         "--out-dir", "{res}/acc", "--runs", "native,native-reversed"),
        env=NATIVE, needs=("unpack", "acc-prompts"), gpu_share=0.2,
        what="native teacher-forced on the prompts, and in reverse batch order (the negative control)"),
    Job("acc-sm80", "core", 200,
        ("{py}", "-m", "dsv4_lab.beds.accuracy_bed", "--ckpt", "{ckpt}", "--prompts", "{res}/acc/prompts.json",
         "--out-dir", "{res}/acc", "--runs", ",".join(["sm80", *(f"mutant-{m}" for m in RUNTIME_MUTANTS)])),
        env={**LAB, "DSV4_SM80_TRIPWIRE": "1", "DSV4_SM80_LAB_MUTANT": "runtime"}, needs=("unpack", "acc-prompts"),
        gpu_share=0.2, what="the SM80 default path, then each run-time mutant switched on in the same engine"),
    Job("acc-sm80-dense", "core", 180,
        ("{py}", "-m", "dsv4_lab.beds.accuracy_bed", "--ckpt", "{ckpt}", "--prompts", "{res}/acc/prompts.json",
         "--out-dir", "{res}/acc", "--runs", f"mutant-{LOAD_MUTANT}"),
        env={**LAB, "DSV4_SM80_LAB_MUTANT": LOAD_MUTANT}, needs=("unpack", "acc-prompts"), gpu_share=0.2,
        what="the dense-stage mutant, a bug in the loaded weights: an engine of its own"),
    Job("accuracy", "core", 30,
        ("{py}", "-m", "dsv4_lab.oracle", "compare", "--ref", "{res}/acc/ref.json", "--native",
         "{res}/acc/native.json", "--path", "sm80={res}/acc/sm80.json",
         "--control", "native-reversed={res}/acc/native-reversed.json",
         *(a for m in (*RUNTIME_MUTANTS, LOAD_MUTANT) for a in ("--mutant", f"{m}={{res}}/acc/mutant-{m}.json")),
         "--json-out", "{res}/accuracy.json"),
        needs=("acc-ref", "acc-native", "acc-sm80", "acc-sm80-dense"), records=("accuracy.json",),
        what="the rule against R_q: the SM80 path passes, the control passes, every mutant is caught"),
    Job("tools", "core", 240,
        ("{py}", "-u", "-m", "dsv4_lab.beds.tools_check", "--model-path", "{ckpt}", "--out", "{res}/tools.json"),
        env=LAB, needs=("unpack",), gpu_share=0.4, records=("tools.json",),
        what="tool calls, streamed reasoning, JSON-schema and regex output, a bad schema: the trained checkpoint"),
    Job("tools-tiny", "core", 200,
        ("{py}", "-u", "-m", "dsv4_lab.beds.tools_check", "--port", "30134", "--out", "{res}/tools-tiny.json"),
        env=LAB, gpu_share=0.4, records=("tools-tiny.json",), what="the same on serve's embedded tiny checkpoint"),
    Job("attention-kit", "core", 200,
        ("{py}", "-u", "-m", "dsv4_lab.beds.attention_kit", "--out", "{res}/attention_kit.json"),
        env={**LAB, "DSV4_SM80_TRIPWIRE": "1"}, gpu_share=0.2, records=("attention_kit.json",),
        what="SGLang 0.5.16's DSV4 attention kit on the SM80 backend and BF16 pool"),
    Job("kernels", "core", 240,
        ("{py}", "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/kernels/test_w4a8_moe.py",
         "tests/kernels/test_sparse_attn.py", "tests/kernels/test_indexer_kv_store.py", "tests/kernels/test_mhc.py",
         "--junitxml", "{res}/kernels.xml"),
        env={"DISABLE_MMA_V3": "1"}, gpu_share=0.1, records=("kernels.xml",),
        what="the kernel tests compiled on the GPU (mma.sync only, as on an A800) against their references"),
    Job("http", "core", 200, ("{py}", "-u", "-m", "dsv4_lab.beds.http_check", "--out", "{res}/http.json"),
        env=LAB, gpu_share=0.4, records=("http.json",),
        what="serve in lab mode: OpenAI and native endpoints, the API key, bad requests 4xx, refused launches"),
    # full
    # the trained Vision-Exp through the backport: 20 held-out questions of each kind on each path, one mutant
    Job("vision-unpack", "core", 20, ("{py}", "-m", "dsv4_lab.vision", "unpack", "{res}/vl"),
        what="the committed trained Vision-Exp in its served shape (and the trained shape for the oracle)"),
    Job("vision-sm80", "core", 240,
        ("{py}", "-u", "-m", "dsv4_lab.beds.vision_trained", "--ckpt", "{res}/vl/dsv4-lab-tiny-vl", "--port", "30251",
         "--per-kind", "20", "--mutants", "image_patches_transposed", "--out", "{res}/vision-sm80.json"),
        env={**LAB, "DSV4_SM80_TRIPWIRE": "1"}, needs=("vision-unpack",), gpu_share=0.2,
        records=("vision-sm80.json",), what="held-out picture questions on the SM80 path, then with a mutant"),
    Job("vision-native", "core", 240,
        ("{py}", "-u", "-m", "dsv4_lab.beds.vision_trained", "--ckpt", "{res}/vl/dsv4-lab-tiny-vl", "--port", "30252",
         "--per-kind", "20", "--native", "--out", "{res}/vision-native.json"),
        env={**LAB, **NATIVE}, needs=("vision-unpack",), gpu_share=0.2, records=("vision-native.json",),
        what="the same questions on native SGLang with the vision overlay alone"),
    Job("vision-score", "core", 60,
        ("bash", "-c", "{py} -m dsv4_lab.vision unpack {res}/vl-trained --as-trained && {py} -m dsv4_lab.vision "
                       "score --ckpt {res}/vl-trained/dsv4-lab-tiny-vl --device cuda --record native="
                       "{res}/vision-native.json --record sm80={res}/vision-sm80.json --json-out "
                       "{res}/vision-trained.json"),
        needs=("vision-sm80", "vision-native"), gpu_share=0.1, records=("vision-trained.json",),
        what="answers against the vision oracle: accuracy per kind, the rule, the mutant -> vision-trained.json"),
    Job("e2e-bench", "full", 900,
        ("bash", "-c", "[ -f /tmp/dsv4-wide/config.json ] || {py} -m dsv4_sm80 make-tiny /tmp/dsv4-wide --preset "
                       "wide --head-scale 4.243; {py} bench/e2e.py --ckpt /tmp/dsv4-wide --preset full "
                       "--out {res}/e2e.json"),
        gpu_share=1.0, timeout_s=1500, records=("e2e.json",),
        what="full depth: decode ids/s and TTFT, native vs SM80, batch 1/16/64 (alone on the GPU)"),
    Job("router", "full", 300, ("{py}", "-u", "-m", "dsv4_lab.beds.router_check", "--out", "{res}/router.json"),
        env=LAB, gpu_share=0.7, records=("router.json",),
        what="two servers behind SGLang's router (smg): both answer; one killed, the other keeps answering"),
    Job("hygiene", "full", 300, ("{py}", "-m", "dsv4_lab.beds.hygiene", "--out", "{res}/hygiene.json"),
        env={**LAB, "DSV4_SM80_TRIPWIRE": "1"}, gpu_share=0.3, records=("hygiene.json",),
        what="page hygiene: pools poisoned after every flush, outputs equal and finite"),
    Job("soak", "full", 480, ("{py}", "-m", "dsv4_lab.beds.soak", "--minutes", "6", "--out", "{res}/soak.json"),
        env=LAB, gpu_share=1.0, timeout_s=720, records=("soak.json",),
        what="64 streaming clients: errors, pages back to idle, memory growth"),
    Job("vision-ab", "full", 300,
        ("bash", "-c", "{py} -u -m dsv4_lab.beds.http_check --vision --port 30223 --out {res}/http-vision.json && "
                       "ENABLE_SGLANG_DSV4_A100_PATCH=0 {py} -u -m dsv4_lab.beds.http_check --vision --port 30223 "
                       "--native --out {res}/http-vision-native.json --compare {res}/http-vision.json"),
        env={**LAB, "DSV4_SM80_TRIPWIRE": "1"}, gpu_share=0.3, records=("http-vision.json", "http-vision-native.json"),
        what="the same image requests on the SM80 server and on native with the vision overlay alone"),
    Job("vision-full", "full", 900,
        ("bash", "-c", "{py} -m dsv4_lab.vision unpack {res}/vl && {py} -m dsv4_lab.vision unpack {res}/vl-trained "
                       "--as-trained && B='{py} -u -m dsv4_lab.beds.vision_trained --ckpt {res}/vl/dsv4-lab-tiny-vl "
                       "--per-kind 50 --port 30253' && $B --out {res}/vision-full-sm80.json --mutants "
                       "image_patches_transposed,image_window_one_short,bias_vl_on_text_rows && "
                       "$B --out {res}/vision-full-chunked.json --chunked-prefill-size 256 && "
                       "ENABLE_SGLANG_DSV4_A100_PATCH=0 $B --native --out {res}/vision-full-native.json && "
                       "{py} -m dsv4_lab.vision score --ckpt {res}/vl-trained/dsv4-lab-tiny-vl --device cuda "
                       "--record native={res}/vision-full-native.json --record sm80={res}/vision-full-sm80.json "
                       "--record chunked={res}/vision-full-chunked.json --json-out {res}/vision-trained-full.json"),
        env={**LAB, "DSV4_SM80_TRIPWIRE": "1"}, gpu_share=0.3, timeout_s=1500, records=("vision-trained-full.json",),
        what="200 held-out questions per path, all three vision mutants, image blocks across 256-token chunks"),
    Job("hygiene-dspark", "full", 300,
        ("{py}", "-m", "dsv4_lab.beds.hygiene", "--dspark", "--out", "{res}/hygiene-dspark.json"),
        env={**LAB, "DSV4_SM80_TRIPWIRE": "1"}, gpu_share=0.3, records=("hygiene-dspark.json",),
        what="page hygiene with DSPARK's draft pools"),
    # ModelRunner in-process beds take mem_fraction_static 0.6 (vision 0.5) of the GPU with an uncapped KV pool
    *(Job(f"dense-{m}", "full", 150,
          ("{py}", "-u", "-m", "dsv4_lab.beds.dense_check", "--out", f"{{res}}/dense-{m}.json"),
          env={**LAB, "SGLANG_DSV4_A100_DENSE": m}, gpu_share=0.6, records=(f"dense-{m}.json",),
          what=f"every dense linear after load in {m} mode: method, weight and output against the exact reference"
               + (" (a cold Marlin build takes most of the limit)" if m == "fp8_marlin" else ""))
      for m in ("bf16", "fp8_marlin")),
    Job("moe", "full", 400, ("bash", "-c", MOE), gpu_share=0.6, timeout_s=1000,
        records=tuple(f"moe-{n}.pt.json" for n in ("native", "marlin", "mxfp4_int8", "native-1024",
                                                   "mxfp4_int8-1024")),
        what="every expert layer on seeded inputs: native, then marlin and mxfp4_int8 against native and the "
             "float64 reference; 1,024 tokens too (the W4A8 32x64 shift tile)"),
    Job("mhc-check", "full", 60, ("{py}", "-m", "dsv4_lab.beds.mhc_check", "--out", "{res}/mhc_check.json"),
        gpu_share=0.1, timeout_s=300, records=("mhc_check.json",),
        what="the SM80 hc pre-norm GEMM against DeepGEMM's own kernel (SM90) at DSV4-Flash's shape"),
    Job("vision", "full", 120, ("{py}", "-u", "-m", "dsv4_lab.beds.vision_check", "--out", "{res}/vision.json"),
        env=LAB, gpu_share=0.5, timeout_s=400, records=("vision.json",),
        what="the Vision-Exp class loads the tiny --vision checkpoint in SGLang's ModelRunner"),
    Job("fault", "full", 120, ("{py}", "-u", "-m", "dsv4_lab.beds.fault_kill", "--out", "{res}/fault.json"),
        env=LAB, gpu_share=0.5, timeout_s=400, records=("fault.json",),
        what="a scheduler SIGKILLed mid-request: the server exits non-zero and the client's stream ends"),
    Job("jit-sm80", "full", 300,
        ("{py}", "-m", "dsv4_sm80", "prebuild-jit", "--all-modes", "--out", "{res}/jit_sm80.json"),
        env={"TVM_FFI_CACHE_DIR": "/tmp/jit-sm80"}, timeout_s=600, records=("jit_sm80.json",),
        what="SGLang's JIT modules of every SM80 mode built for sm_80 (a cache of their own: this GPU's runs "
             "must never load them)"),
    Job("cold", "full", 300, ("bash", "-c", COLD), env=LAB, gpu_share=1.0, timeout_s=900, records=("cold.json",),
        what="the SM80 engine's first start on empty JIT caches (a fresh HOME) under SGLang's own 300 s watchdog "
             "(alone: other jobs' compiles on the same cores would slow it)"),
    Job("trained-accuracy", "full", 2400,
        ("bash", "-c", "[ -s {res}/trained-prompts.json ] || {py} -m dsv4_lab.train prompts {res}/trained-prompts.json"
                       " && CKPT={ckpt} PROMPTS={res}/trained-prompts.json BED_ARGS='--head-scale 1.0' PYTHON={py} "
                       "bash dsv4_lab/oracle/accuracy.sh {res}/acc-trained"),
        needs=("unpack",), gpu_share=0.6, timeout_s=3600, records=("acc-trained/accuracy.json",),
        what="the accuracy table (dsv4_lab/oracle/accuracy.sh: every path, the rounding options, the mutants) on the "
             "trained checkpoint's held-out text; a cut run resumes at its first missing record"),
    Job("tp4", "full", 600, ("bash", "-c", TP4), gpu_share=1.0, timeout_s=900,
        records=tuple(f"tp4-{n}.json" for n in ("native", "patched", "dspark", "native-b")),
        what="TP4 (only meaningful on a four-GPU host; it stops at once with fewer): native, its one-at-a-time floor, "
             "SM80 with the tripwire, SM80 with DSPARK, CUDA graphs on, compared; footprint per rank"),
)
BY_NAME = {j.name: j for j in JOBS}


def tier(name: str) -> list[Job]:
    """The jobs of a tier, in declaration order (full includes core)."""
    if name not in ("core", "full"):
        raise ValueError(f"gpu suite: unknown tier {name!r}; expected core or full")
    return [j for j in JOBS if j.tier == "core" or name == "full"]
