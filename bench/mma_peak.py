"""The `mma.sync` tensor-core peaks of the GPU it runs on: BF16 (m16n8k16, what SGLang's Marlin kernels and the
SM80 datapath's BF16 tiles issue) and INT8 (m16n8k32, what the W4A8 MoE issues), and their ratio.

The W4A8 prefill is meant to beat Marlin's. On an A800 (SM80) `mma.sync` is the only tensor-core instruction and
INT8 runs at twice the BF16 rate (624 against 312 dense TOP/s). On an H200 the full rates need Hopper's `wgmma`, and
whether the H200's `mma.sync` keeps the 2:1 ratio decides whether an H200 prefill comparison can stand in for the
A800's. This measures it instead of assuming it: each warp issues CHAINS independent `mma.sync` chains in a loop
(inline PTX, the same instruction shapes Marlin and `tl.dot` on sm_80 use), every SM busy.

    python bench/mma_peak.py --out mma.json          (an H200 prints H200 numbers, not A800 ones)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import best_seconds  # noqa: E402

# one warp-wide instruction each; D = A x B + C with every fragment register of A and B the same value
BF16_MMA = tl.constexpr("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0,$1,$2,$3}, {$4,$4,$4,$4}, {$4,$4}, "
            "{$5,$6,$7,$8};")
INT8_MMA = tl.constexpr("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {$0,$1,$2,$3}, {$4,$4,$4,$4}, {$4,$4}, "
            "{$5,$6,$7,$8};")
OPS = {"bf16": 2 * 16 * 8 * 16, "int8": 2 * 16 * 8 * 32}  # multiply-adds x 2 per instruction


@triton.jit
def _mma_chain(a, c0, c1, c2, c3, INT8: tl.constexpr):
    if INT8:  # (a constexpr branch: one of the two is compiled, so the one return has one type)
        d = tl.inline_asm_elementwise(INT8_MMA, "=r,=r,=r,=r,r,r,r,r,r", [a, c0, c1, c2, c3],
                                      dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)
    else:
        d = tl.inline_asm_elementwise(BF16_MMA, "=f,=f,=f,=f,r,f,f,f,f", [a, c0, c1, c2, c3],
                                      dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)
    return d


@triton.jit
def _mma_loop_kernel(out_ptr, iters, INT8: tl.constexpr, BLOCK: tl.constexpr):
    """Each of the program's BLOCK threads owns one element, so every asm statement is one instruction per warp;
    four independent accumulator chains per thread keep the tensor pipe fed (each depends on its own last result
    only; their operands differ, so the compiler cannot merge them). The sums are stored so nothing is dead."""
    pid = tl.program_id(0)
    a = (tl.arange(0, BLOCK) + pid) | 0x3F803F80  # bf16 pairs near 1.0 / int8 quads, never all zero
    acc_ty = tl.int32 if INT8 else tl.float32
    z = tl.zeros((BLOCK,), dtype=acc_ty)
    p0, p1, p2, p3 = z, z, z, z
    q0, q1, q2, q3 = z, z, z, z
    r0, r1, r2, r3 = z, z, z, z
    s0, s1, s2, s3 = z, z, z, z
    for _ in range(iters):
        p0, p1, p2, p3 = _mma_chain(a, p0, p1, p2, p3, INT8)
        q0, q1, q2, q3 = _mma_chain(a ^ 1, q0, q1, q2, q3, INT8)
        r0, r1, r2, r3 = _mma_chain(a ^ 2, r0, r1, r2, r3, INT8)
        s0, s1, s2, s3 = _mma_chain(a ^ 4, s0, s1, s2, s3, INT8)
    total = (p0 + p1 + p2 + p3) + (q0 + q1 + q2 + q3) + (r0 + r1 + r2 + r3) + (s0 + s1 + s2 + s3)
    tl.store(out_ptr + pid * BLOCK + tl.arange(0, BLOCK), total)


CHAINS = 4  # mma chains per thread in _mma_loop_kernel


def measure(kind: str, iters: int = 4096, warps: int = 8, blocks_per_sm: int = 4) -> float:
    """TOP/s of `kind` ('bf16' or 'int8') mma.sync on GPU 0: best of 5 launches of every SM x blocks_per_sm
    programs of `warps` warps, each warp issuing iters x CHAINS instructions."""
    import torch

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    grid = sms * blocks_per_sm
    block = 32 * warps
    out = torch.empty(grid * block, dtype=torch.int32 if kind == "int8" else torch.float32, device="cuda")
    best = best_seconds(lambda: _mma_loop_kernel[(grid,)](out, iters, INT8=kind == "int8", BLOCK=block,
                                                          num_warps=warps))
    return grid * warps * iters * CHAINS * OPS[kind] / best / 1e12


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--iters", type=int, default=4096)
    args = ap.parse_args(argv)

    import torch

    record = {"gpu": torch.cuda.get_device_name(0), "capability": list(torch.cuda.get_device_capability(0))}
    for kind in ("bf16", "int8"):
        record[f"{kind}_tops"] = measure(kind, args.iters)
    record["int8_over_bf16"] = record["int8_tops"] / record["bf16_tops"]
    print(f"mma.sync peaks on {record['gpu']}: BF16 m16n8k16 {record['bf16_tops']:.0f} TFLOP/s, INT8 m16n8k32 "
          f"{record['int8_tops']:.0f} TOP/s, INT8 / BF16 {record['int8_over_bf16']:.2f} (an A800's datasheet: 2.00)")
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
