"""The GPU suite: every job a GPU host runs, declared once, in two tiers.

A job is one process (a bed, a kernel test run, the scorer) that writes its record into the results folder.
Verdicts (`verdicts.py`) read those records and hold them to fixed thresholds; `tests/gpu/` asserts the same
verdicts under pytest, and `python -m dsv4_lab.gpu run` runs the jobs inside a time budget and resumes a cut run.

- core: what a change must pass. The trained checkpoint on native SGLang and on the SM80 default path, each
  with and without DSPARK, scored against the oracle; SGLang's own DSV4 attention kit on the SM80 backend; the
  kernel tests compiled on the GPU; `serve` in lab mode over HTTP.
- full: what a longer window adds (the accuracy table, full depth, soak, page hygiene, vision A/B).

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
               ("{py}", "dsv4_lab/beds/trained_bed.py", "--ckpt", "{ckpt}", "--out", "{res}/" + name + ".json",
                "--mem-fraction", "0.85", "--max-total-tokens", str(BED_TOKENS), *spec),
               env=env, needs=("unpack",), gpu_share=0.2, records=(name + ".json",),
               what=f"the trained checkpoint on the {'native' if path == 'native' else 'SM80 default'} path"
                    + (" with DSPARK" if dspark else ""))


PATHS = ("native", "sm80")
JOBS: tuple[Job, ...] = (
    Job("jit-seed", "core", 10,
        ("bash", "-c", f"{{py}} dsv4_lab/beds/jit_seed.py build --seed {SEED}/tvm-ffi.json.xz && "
                       f"{{py}} dsv4_lab/beds/jit_seed.py build --seed {SEED}/flashinfer.json.xz"),
        timeout_s=900, what="SGLang's and FlashInfer's JIT modules built on every core (a cold host: minutes)"),
    Job("unpack", "core", 20, ("{py}", "-m", "dsv4_lab.train", "unpack", "{res}"),
        records=(), what="the committed trained checkpoint in its served shape"),
    *(_trained(p, d) for d in (False, True) for p in PATHS),
    Job("trained-score", "core", 150,
        ("{py}", "-m", "dsv4_lab.gpu", "score", "--res", "{res}", "--ckpt", "{ckpt}"),
        needs=tuple(f"trained-{p}{d}" for p in PATHS for d in ("", "-dspark")), gpu_share=0.3,
        records=("trained.json",), what="the trained records against the oracle (R_q, R_x) -> trained.json"),
    Job("attention-kit", "core", 200,
        ("{py}", "-u", "dsv4_lab/beds/attention_kit.py", "--out", "{res}/attention_kit.json"),
        env={**LAB, "DSV4_SM80_TRIPWIRE": "1"}, gpu_share=0.2, records=("attention_kit.json",),
        what="SGLang 0.5.16's DSV4 attention kit on the SM80 backend and BF16 pool"),
    Job("kernels", "core", 240,
        ("{py}", "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/kernels/test_w4a8_moe.py",
         "tests/kernels/test_sparse_attn.py", "tests/kernels/test_indexer_kv_store.py", "tests/kernels/test_mhc.py",
         "--junitxml", "{res}/kernels.xml"),
        env={"DISABLE_MMA_V3": "1"}, gpu_share=0.1, records=("kernels.xml",),
        what="the kernel tests compiled on the GPU (mma.sync only, as on an A800) against their references"),
    Job("http", "core", 200, ("{py}", "-u", "dsv4_lab/beds/http_check.py", "--out", "{res}/http.json"),
        env=LAB, gpu_share=0.4, records=("http.json",),
        what="serve in lab mode: OpenAI and native endpoints, the API key, bad requests 4xx, refused launches"),
    # full
    Job("e2e-bench", "full", 900,
        ("bash", "-c", "[ -f /tmp/dsv4-wide/config.json ] || {py} -m dsv4_sm80 make-tiny /tmp/dsv4-wide --preset "
                       "wide --head-scale 4.243; {py} bench/e2e.py --ckpt /tmp/dsv4-wide --preset full "
                       "--out {res}/e2e.json"),
        gpu_share=1.0, timeout_s=1500, records=("e2e.json",),
        what="full depth: decode ids/s and TTFT, native vs SM80, batch 1/16/64 (alone on the GPU)"),
    Job("hygiene", "full", 300, ("{py}", "dsv4_lab/beds/hygiene.py", "--out", "{res}/hygiene.json"),
        env={**LAB, "DSV4_SM80_TRIPWIRE": "1"}, gpu_share=0.3, records=("hygiene.json",),
        what="page hygiene: pools poisoned after every flush, outputs equal and finite"),
    Job("soak", "full", 480, ("{py}", "dsv4_lab/beds/soak.py", "--minutes", "6", "--out", "{res}/soak.json"),
        env=LAB, gpu_share=1.0, timeout_s=720, records=("soak.json",),
        what="64 streaming clients: errors, pages back to idle, memory growth"),
    Job("vision-ab", "full", 300,
        ("bash", "-c", "{py} -u dsv4_lab/beds/http_check.py --vision --port 30223 --out {res}/http-vision.json && "
                       "ENABLE_SGLANG_DSV4_A100_PATCH=0 {py} -u dsv4_lab/beds/http_check.py --vision --port 30223 "
                       "--native --out {res}/http-vision-native.json --compare {res}/http-vision.json"),
        env={**LAB, "DSV4_SM80_TRIPWIRE": "1"}, gpu_share=0.3, records=("http-vision.json", "http-vision-native.json"),
        what="the same image requests on the SM80 server and on native with the vision overlay alone"),
)
BY_NAME = {j.name: j for j in JOBS}


def tier(name: str) -> list[Job]:
    """The jobs of a tier, in declaration order (full includes core)."""
    if name not in ("core", "full"):
        raise ValueError(f"gpu suite: unknown tier {name!r}; expected core or full")
    return [j for j in JOBS if j.tier == "core" or name == "full"]
