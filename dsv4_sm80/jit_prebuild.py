"""SGLang 0.5.16's JIT (tvm-ffi) modules the SM80 datapath calls, built before the first start, several at a time.

SGLang builds each of these modules with nvcc at its first call, one after another, inside the first forward (a cold
native start on an H200 host was still building them 16 minutes after launch; the SM80 path's own cold start took
222 s: docs/results/README.md). `python -m dsv4_sm80 prebuild-jit` builds this path's list into SGLang's own cache
(`TVM_FFI_CACHE_DIR`, default `~/.cache/tvm-ffi`), `--jobs` at a time, for an arch given on the command line
(default sm_80): no GPU is needed, only nvcc and the CUDA runtime library, so it runs in the image build
(docker/Dockerfile) or on an A800 host before its first start. Each module is built by SGLang's own module function
(the names, template arguments and source hashes SGLang's first call asks for) inside
`jit_kernel.utils.arch.override_jit_cuda_arch`, in a fresh process, so PDL (sm_90+) is resolved for the target arch.

The list is the modules a patched forward calls (from reading the forward): the DSV4 compressors and their BF16 main
store, RoPE and norms, top-k v1, the attention metadata, the router's gate and hash top-k, the shared expert's SiLU
clamp, the decode positions' clamp, the TP4 all-reduce, and per mode the Marlin modules
(jitcache.FIRST_FORWARD_MODULES: built at the first forward, not at load). The committed H200 seed
(dsv4_lab/beds/jit-seed/tvm-ffi.json.xz, from a host that ran native and patched engines, TP1) names most of them,
with PDL on; not the TP4 all-reduce, moe_fused_gate or gptq_marlin, which no engine there called. A module SGLang asks
for with other template arguments (another page size, say) is still built at its first call, as before.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass

from . import env, jitcache


@dataclass(frozen=True)
class Module:
    label: str
    build: Callable[[], object]  # SGLang's own module function, called with this path's arguments
    mode: tuple | None = None  # (knob, value): only when that mode is chosen (or --all-modes)


def modules() -> list[Module]:
    import torch
    from sglang.jit_kernel import (
        all_reduce,
        clamp_position,
        gptq_marlin,
        gptq_marlin_repack,
        moe_fused_gate,
        moe_wna16_marlin,
    )
    from sglang.jit_kernel.dsv4 import attn, compress, elementwise, moe, topk

    f32, bf16 = torch.float32, torch.bfloat16
    fp8_dense, marlin_moe = (env.DENSE, "fp8_marlin"), (env.MOE_BACKEND, "marlin")
    return [
        Module("compress c4 (state ring + softmax pooling)",
               lambda: compress._jit_compress_module(512, f32, f32, f32, 4)),
        Module("compress c128", lambda: compress._jit_compress_module(512, f32, f32, f32, 128)),
        Module("compress c4 indexer", lambda: compress._jit_compress_module(128, f32, f32, f32, 4)),
        Module("compress plan", compress._jit_compress_plan_module),
        # the compressor's main store in its bf16_store mode, into the BF16 pools' flat slots (page 1)
        Module("compress_norm_rope_store bf16_store",
               lambda: compress._jit_compress_norm_rope_module(f32, 512, 64, 1, True)),
        Module("topk_transform_512 v1", lambda: topk._jit_topk_v1_module(512)),
        Module("fused_rope (inverse RoPE on the output)", elementwise._jit_fused_rope_module),
        Module("fused_q_norm_rope (main Q)", lambda: elementwise._jit_main_q_norm_rope_module(bf16, 512, 64)),
        Module("attention metadata", attn._jit_metadata_module),
        Module("hash_topk", moe._jit_hash_topk_module),
        Module("silu_and_mul_clamp (shared expert)", lambda: moe._jit_silu_and_mul_clamp_module(bf16)),
        Module("moe_fused_gate (sqrtsoftplus top-k)", moe_fused_gate._jit_moe_fused_gate_module),
        Module("clamp_position (decode positions)", lambda: clamp_position._jit_clamp_position_module(torch.int64)),
        # TP4 all-reduce with full NVLink (custom all-reduce v2); its multimem / PDL code is Hopper-guarded
        Module("custom_all_reduce bf16 x4 (TP all-reduce)", lambda: all_reduce.get_all_reduce_module(bf16, 4)),
        Module("gptq_marlin (dense FP8-Marlin W8A16)", lambda: gptq_marlin._jit_gptq_marlin_module(bf16), fp8_dense),
        Module("gptq_marlin_repack (FP8-Marlin load)", gptq_marlin_repack._jit_gptq_marlin_repack_module, fp8_dense),
        Module("moe_wna16_marlin (MXFP4 Marlin MoE)", lambda: moe_wna16_marlin._jit_moe_wna16_marlin_module(bf16),
               marlin_moe),
    ]


def select(mods: list[Module], environ: Mapping[str, str] | None = None, all_modes: bool = False,
           only: list[str] | None = None) -> list[Module]:
    """The modules the configured modes call (every mode's with all_modes); `only`: labels containing one of them."""
    out = []
    for m in mods:
        if m.mode and not all_modes and env.get(m.mode[0], environ) != m.mode[1]:
            continue
        if only and not any(s in m.label for s in only):
            continue
        out.append(m)
    return out


def parse_arch(text: str) -> tuple[int, int, str] | None:
    """"8.0" -> (8, 0, ""); "9.0a" -> (9, 0, "a"): SGLang's ArchInfo fields. "gpu" -> None: the visible GPU's, as
    SGLang's own first call resolves it (no override; e.g. the lab's H200 host before its engines start)."""
    import re

    if text.strip() == "gpu":
        return None
    m = re.fullmatch(r"(\d+)\.(\d+)([a-z]?)", text.strip())
    if not m:
        raise ValueError(f"--arch {text!r}: expected MAJOR.MINOR[suffix], e.g. 8.0 (A800/A100) or 9.0a (H100/H200), "
                         "or gpu (the visible GPU's)")
    return int(m.group(1)), int(m.group(2)), m.group(3)


@dataclass
class Result:
    label: str
    ok: bool
    seconds: float
    error: str = ""


def _build_one(label: str, arch: tuple[int, int, str] | None) -> Result:
    """In a fresh process: the arch overridden before SGLang resolves it (PDL follows it), then the module; with
    arch None SGLang resolves the visible GPU's itself."""
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    # its "Cannot detect CUDA architecture." on a machine without a GPU: the arch is the one overridden below
    logging.getLogger("sglang.jit_kernel.utils.arch").setLevel(logging.ERROR)
    from sglang.jit_kernel.utils.arch import override_jit_cuda_arch

    t0 = time.time()
    try:
        mod = next(m for m in modules() if m.label == label)
        if arch is None:
            mod.build()
        else:
            with override_jit_cuda_arch(*arch):
                mod.build()
        return Result(label, True, round(time.time() - t0, 1))
    except Exception as e:  # the compiler's own message, kept (nvcc / ninja / the linker)
        return Result(label, False, round(time.time() - t0, 1), f"{type(e).__name__}: {e}"[-3000:])


def _hint(error: str) -> str:
    if "cannot find -lcudart" in error:
        return (" (the link step found no libcudart under the CUDA home SGLang's JIT derived from nvcc's place: set "
                "CUDA_HOME to the CUDA toolkit, e.g. /usr/local/cuda)")
    return ""


def run(args, environ: Mapping[str, str] | None = None) -> int:
    environ = os.environ if environ is None else environ
    try:
        arch = parse_arch(args.arch)
    except ValueError as e:
        print(f"prebuild-jit: {e}", file=sys.stderr)
        return 2
    # the gate's own checks of what the builds need: nvcc 12+, SGLang's JIT cache writable with room
    from .gate import check_jit_cache, check_jit_compiler

    nvcc = jitcache.nvcc_facts(environ)
    label, cache = next((k, v) for k, v in jitcache.cache_dirs(environ).items() if k.startswith("SGLang JIT"))
    refused = [f for f in [check_jit_compiler(nvcc), *check_jit_cache([jitcache.probe(label, cache)])]
               if f.status == "fail"]
    for f in refused:
        print(f"prebuild-jit: {f.line()}", file=sys.stderr)
    if refused:
        return 1
    chosen = select(modules(), environ, args.all_modes, args.only.split(",") if args.only else None)
    if not chosen:
        print(f"prebuild-jit: no module matches --only {args.only!r}", file=sys.stderr)
        return 2
    jobs = max(1, min(args.jobs or os.cpu_count() or 1, len(chosen)))
    if arch is None:
        import torch

        if not torch.cuda.is_available():
            print("prebuild-jit: --arch gpu: no CUDA GPU is visible here; give the target instead: --arch 8.0 "
                  "(A800/A100)", file=sys.stderr)
            return 2
        from sglang.jit_kernel.utils.arch import get_jit_cuda_arch

        name = f"sm_{get_jit_cuda_arch().target_name.replace('.', '')}"
    else:
        name = f"sm_{arch[0]}{arch[1]}{arch[2]}"
    print(f"prebuild-jit: {len(chosen)} SGLang JIT modules for {name} into {cache}, {jobs} at a time "
          f"(nvcc {nvcc.version} at {nvcc.path})", flush=True)
    import multiprocessing

    t0, results = time.time(), []
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(_build_one, m.label, arch) for m in chosen]
        for f in as_completed(futures):
            r = f.result()
            results.append(r)
            # a build tool's own result line per module (not a refusal: the gate's refusals are above)
            print(f"  OK   {r.label} ({r.seconds:.0f} s)" if r.ok else
                  f"  FAIL {r.label}: {r.error.strip().splitlines()[-1][:300] if r.error.strip() else r.error}"
                  f"{_hint(r.error)}", flush=True)
    failed = [r for r in results if not r.ok]
    wall = time.time() - t0
    print(f"prebuild-jit: {len(results) - len(failed)} of {len(results)} built or already there for {name} in "
          f"{wall:.0f} s wall ({sum(r.seconds for r in results):.0f} s of builds)"
          + (f"; {len(failed)} FAILED (lines above; the full errors with --out)" if failed else ""), flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"arch": name, "cache": cache, "results": [asdict(r) for r in results]}, fh, indent=1)
    return 1 if failed else 0
