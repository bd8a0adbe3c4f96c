"""Compile, for sm_80, every SGLang 0.5.16 JIT (tvm-ffi/nvcc) module the SM80 datapath still uses, on the GPU
machine (nvcc is there; no A800 is needed to compile): `jit_kernel.utils.arch.override_jit_cuda_arch(8, 0)`
from the first JIT call of a fresh process, so PDL (sm_90+) is also resolved for sm_80.

    TVM_FFI_CACHE_DIR=/tmp/jit-sm80 python tests/gpu/jit_sm80.py --out $OUT/jit_sm80.json [--only NAME,...]

(A cache directory of its own, so these sm_80 builds are never loaded by the same machine's SM90 runs.)

Each module prints OK (with seconds) or the compiler's error; nothing is run. Cold compiles take minutes
(the Marlin units instantiate many types): this is also how an image gets its caches warm for an A800.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def modules():
    import torch

    from sglang.jit_kernel import all_reduce, gptq_marlin, gptq_marlin_repack, moe_fused_gate, moe_wna16_marlin
    from sglang.jit_kernel.dsv4 import attn, compress, elementwise, moe, topk

    f32, bf16 = torch.float32, torch.bfloat16
    return [
        ("compress c4 (state ring + softmax pooling)", lambda: compress._jit_compress_module(512, f32, f32, f32, 4)),
        ("compress c128", lambda: compress._jit_compress_module(512, f32, f32, f32, 128)),
        ("compress c4 indexer", lambda: compress._jit_compress_module(128, f32, f32, f32, 4)),
        ("compress plan", compress._jit_compress_plan_module),
        ("compress_norm_rope_store bf16_store (main cache, page 1)",
         lambda: compress._jit_compress_norm_rope_module(f32, 512, 64, 1, True)),
        ("topk_transform_512 v1", lambda: topk._jit_topk_v1_module(512)),
        ("fused_rope (inverse RoPE on the output)", elementwise._jit_fused_rope_module),
        ("fused_q_norm_rope (main Q)", lambda: elementwise._jit_main_q_norm_rope_module(bf16, 512, 64)),
        ("attention metadata", attn._jit_metadata_module),
        ("hash_topk", moe._jit_hash_topk_module),
        ("silu_and_mul_clamp (shared expert)", lambda: moe._jit_silu_and_mul_clamp_module(bf16)),
        ("moe_fused_gate (sqrtsoftplus top-k)", moe_fused_gate._jit_moe_fused_gate_module),
        ("gptq_marlin (dense FP8-Marlin W8A16)", lambda: gptq_marlin._jit_gptq_marlin_module(bf16)),
        ("gptq_marlin_repack", gptq_marlin_repack._jit_gptq_marlin_repack_module),
        ("moe_wna16_marlin (MXFP4 Marlin MoE)", lambda: moe_wna16_marlin._jit_moe_wna16_marlin_module(bf16)),
        # every TP all-reduce with full NVLink (custom all-reduce v2); multimem / PDL code is Hopper-guarded
        ("custom_all_reduce bf16 x4 (TP all-reduce)", lambda: all_reduce.get_all_reduce_module(bf16, 4)),
    ]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out")
    ap.add_argument("--only", help="comma-separated substrings of module names")
    args = ap.parse_args(argv)

    from sglang.jit_kernel.utils.arch import override_jit_cuda_arch

    results = []
    with override_jit_cuda_arch(8, 0):
        from sglang.jit_kernel.utils.arch import get_jit_cuda_arch, is_arch_support_pdl

        arch = get_jit_cuda_arch()
        print(f"jit_sm80: compiling for sm_{arch.major}{arch.minor}{arch.suffix}; PDL {is_arch_support_pdl()}",
              flush=True)
        for name, build in modules():
            if args.only and not any(s in name for s in args.only.split(",")):
                continue
            t0 = time.time()
            try:
                build()
                results.append({"module": name, "ok": True, "seconds": round(time.time() - t0, 1)})
                print(f"  OK   {name} ({time.time() - t0:.0f} s)", flush=True)
            except Exception as e:
                msg = f"{type(e).__name__}: {e}"
                results.append({"module": name, "ok": False, "seconds": round(time.time() - t0, 1), "error": msg[-3000:]})
                print(f"  FAIL {name}: {msg.splitlines()[0][:300]}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    failed = [r for r in results if not r["ok"]]
    print("jit_sm80:", "OK" if not failed else f"{len(failed)} FAILED", f"({len(results)} modules)")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
