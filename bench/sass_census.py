"""Static SASS census of the W4A8 MoE kernel's K loops for sm_80 (no GPU needed; counts, not timings).

Compiles `_w4a8_moe_kernel` for sm_80 with the divisibility hints the real JIT derives (pointers, N, K,
strides multiples of 16), disassembles it with Triton's bundled nvdisasm and, per loop (a backward
branch), counts instructions, IMMA (m16n8k32 INT8 MMA), I2F (int32 -> fp32 conversions) and local-memory
spills (LDL/STL, whole kernel). Rows: decode and prefill tiles, gate-up and down, per-group and shift.

    TRITON_INTERPRET=0 python bench/sass_census.py [--json out.json]
"""

from __future__ import annotations

import collections
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SIG = {
    "a_ptr": "*i8", "a_scale_ptr": "*fp32", "b_ptr": "*u8", "bs_ptr": "*u8", "c_ptr": "*i8", "c_scale_ptr": "*fp32",
    "sorted_ids_ptr": "*i32", "block_expert_ptr": "*i32", "num_padded_ptr": "*i32", "topk_w_ptr": "*fp32",
    "eref_ptr": "*u8", "N": "i32", "K": "i32", "num_pairs": "i32", "a_row_div": "i32", "a_scale_groups": "i32",
    "limit": "fp32", "stride_am": "i32", "stride_be": "i32", "stride_bn": "i32", "stride_bse": "i32",
    "stride_bsn": "i32", "stride_cm": "i32", "c_scale_groups": "i32", "stride_ere": "i32"}
DIV16 = {"a_ptr", "a_scale_ptr", "b_ptr", "bs_ptr", "c_ptr", "c_scale_ptr", "sorted_ids_ptr", "block_expert_ptr",
         "num_padded_ptr", "topk_w_ptr", "eref_ptr", "N", "K", "stride_am", "stride_be", "stride_bn", "stride_bse",
         "stride_bsn", "stride_cm", "stride_ere"}


def sass(consts: dict, num_warps: int, num_stages: int = 3, gated: bool = True) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from dsv4_sm80.kernels import w4a8_moe as k

    fn = k._w4a8_moe_kernel
    params = list(inspect.signature(fn.fn).parameters)
    sig = {p: SIG.get(p, "constexpr") for p in params}
    sig["c_ptr"] = "*i8" if gated else "*fp32"
    consts = {p: v for p, v in consts.items() if p in sig and sig[p] == "constexpr"}
    defaults = inspect.signature(fn.fn).parameters  # constexprs with a default (SPAN, SHIFT, SPLIT_K, ...)
    consts.update({p: d.default for p, d in defaults.items()
                   if sig[p] == "constexpr" and p not in consts and d.default is not inspect.Parameter.empty})
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(params) if p in DIV16}
    c = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 80, 32), options={"num_warps": num_warps, "num_stages": num_stages})
    return disassemble(c.asm["cubin"])


W8_SIG = {  # the expanded path's GEMM (config expand): INT8 weights from the workspace, no decode in the K loop
    "a_ptr": "*i8", "a_scale_ptr": "*fp32", "w8_ptr": "*i8", "ok_ptr": "*u8", "c_ptr": "*i8", "c_scale_ptr": "*fp32",
    "sorted_ids_ptr": "*i32", "block_expert_ptr": "*i32", "num_padded_ptr": "*i32", "topk_w_ptr": "*fp32", "N": "i32",
    "K": "i32", "num_pairs": "i32", "a_row_div": "i32", "a_scale_groups": "i32", "limit": "fp32", "expert_lo": "i32",
    "expert_hi": "i32", "stride_am": "i32", "stride_we": "i32", "stride_wn": "i32", "stride_oke": "i32",
    "stride_cm": "i32", "c_scale_groups": "i32"}


def sass_expanded(consts: dict, num_warps: int, num_stages: int = 3, gated: bool = True) -> str:
    """`_w8_moe_kernel` for sm_80 with the same divisibility hints (pointers, N, K, strides)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from dsv4_sm80.kernels import w4a8_moe as k

    params = list(inspect.signature(k._w8_moe_kernel.fn).parameters)
    sig = {p: W8_SIG.get(p, "constexpr") for p in params}
    sig["c_ptr"] = "*i8" if gated else "*fp32"
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(params)
             if sig[p].startswith("*") or p in ("N", "K") or p.startswith("stride_")}
    c = triton.compile(ASTSource(fn=k._w8_moe_kernel, signature=sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 80, 32), options={"num_warps": num_warps, "num_stages": num_stages})
    return disassemble(c.asm["cubin"])


def census_expanded():
    """The expanded path's K loops (bench/moe.py prefill-expand: 64x128, K steps 128 and 64, 4 warps; 128x128, 8)."""
    rows = []
    for tile, (bm, bk, warps) in {"expand 64x128 k128/4w": (64, 128, 4), "expand 64x128 k64/4w": (64, 64, 4),
                                  "expand 128x128 k128/8w": (128, 128, 8)}.items():
        for gated in (True, False):
            consts = {"GATED": gated, "MUL_WEIGHT": not gated, "A_GROUP": 0 if gated else 128, "BLOCK_M": bm,
                      "BLOCK_N": 128, "BLOCK_K": bk if gated else 128}
            r = loops(sass_expanded(consts, warps, gated=gated))
            for i, cnt in enumerate(r["loops"]):
                n, imma = sum(cnt.values()), cnt["IMMA"]
                rows.append({"tile": tile, "kernel": "gate-up" if gated else "down", "shift": True,
                             "a_group": consts["A_GROUP"], "loop": i, "instrs": n, "imma": imma,
                             "per_imma": round(n / imma, 1), "I2F": cnt["I2F"], "PRMT": cnt["PRMT"],
                             "LDL_loop": cnt["LDL"], "LDL": r["LDL"], "STL": r["STL"]})
    return rows


def disassemble(cubin: bytes) -> str:
    """A compiled kernel's SASS, through the nvdisasm Triton bundles (no GPU needed)."""
    import triton

    d = tempfile.mkdtemp()
    with open(f"{d}/k.cubin", "wb") as f:
        f.write(cubin)
    nvd = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/nvdisasm")
    return subprocess.run([nvd, "-c", "-g", f"{d}/k.cubin"], capture_output=True, text=True, check=True).stdout


MMA_PTX = {  # the mma.sync forms an sm_80 kernel's PTX may hold
    "int8_mma": r"mma[.]sync[.]aligned[.]m16n8k32[.]row[.]col([.]satfinite)?[.]s32[.]s8[.]s8[.]s32",
    "bf16_mma": r"mma[.]sync[.]aligned[.]m16n8k16[.]row[.]col[.]f32[.]bf16[.]bf16[.]f32",
    "tf32_mma": r"mma[.]sync[.]aligned[.]m16n8k8[.]row[.]col[.]f32[.]tf32[.]tf32[.]f32",
}


def sm80_build(fn, signature: dict, constexprs: dict, num_warps: int = 4) -> dict:
    """A Triton kernel compiled for sm_80 (no GPU needed), as facts of its PTX (targets sm_80; any FP8 or FP4 type;
    each MMA_PTX form present), its shared memory and its local-memory spills (LDL + STL in its SASS)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    r = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=GPUTarget("cuda", 80, 32),
                       options={"num_warps": num_warps})
    census = loops(disassemble(r.asm["cubin"]))
    ptx = r.asm["ptx"]
    return {"sm80": ".target sm_80" in ptx, "fp8": any(t in ptx for t in ("e4m3", "e5m2", "e2m1")),
            **{name: bool(re.search(pat, ptx)) for name, pat in MMA_PTX.items()},
            "shared": r.metadata.shared, "spills": census["LDL"] + census["STL"]}


def _op(line):
    m = re.search(r"\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
    return m.group(2).split(".")[0] if m else None


def loops(text: str) -> dict:
    """{'loops': [Counter per backward-branch loop with >= 1 IMMA], 'LDL': n, 'STL': n} for one kernel."""
    lines = text.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"\s*(\.L_x_\d+):", line))}
    out = []
    for i, line in enumerate(lines):
        m = re.search(r"BRA\s+`\((\.L_x_\d+)\)", line)
        if m and labels.get(m.group(1), 1 << 30) < i:
            cnt = collections.Counter(o for o in map(_op, lines[labels[m.group(1)]:i + 1]) if o)
            if cnt["IMMA"]:
                out.append(cnt)
    allc = collections.Counter(o for o in map(_op, lines) if o)
    return {"loops": out, "LDL": allc["LDL"], "STL": allc["STL"]}


TILES = {  # name: (block_m, block_n gate-up, block_n2 down, warps)
    "decode 16x32/4w": (16, 32, 64, 4),
    "prefill 64x64/8w": (64, 64, 128, 8),
    "prefill 64x128/4w": (64, 128, 128, 4),
    "prefill 64x128/8w": (64, 128, 128, 8),  # no spills, against 4 warps' 45 (2026-12-02, bench/moe.py prefill-)
    "prefill 32x128/4w": (32, 128, 128, 4),
}


def census(shift_modes=(0, 1)):
    from dsv4_sm80.kernels import w4a8_moe as k

    has_shift = "SHIFT" in inspect.signature(k._w4a8_moe_kernel.fn).parameters
    rows = []
    for tile, (bm, bn, bn2, warps) in TILES.items():
        for gated in (True, False):
            # the down kernel's activation group is the gate-up block_n; the down tile is block_n2 wide
            consts = {"GATED": gated, "MUL_WEIGHT": not gated, "A_GROUP": 0 if gated else bn, "BLOCK_M": bm,
                      "BLOCK_N": bn if gated else bn2, "SPAN": 32, "DECODE_ASM": True}
            for shift in (shift_modes if has_shift else (0,)):
                if has_shift:
                    consts["SHIFT"] = bool(shift)
                    if shift and not gated:  # the shift path needs an activation group of 64 (block_n 64)
                        consts["A_GROUP"] = max(64, bn)
                r = loops(sass(consts, warps, gated=gated))
                # with SHIFT the kernel has two K loops: the shift loop (no I2F when A_GROUP = 0), then the
                # per-group fallback
                for i, cnt in enumerate(r["loops"]):
                    n, imma = sum(cnt.values()), cnt["IMMA"]
                    rows.append({"tile": tile, "kernel": "gate-up" if gated else "down", "shift": bool(shift),
                                 "a_group": consts["A_GROUP"],
                                 "loop": i, "instrs": n, "imma": imma, "per_imma": round(n / imma, 1),
                                 "I2F": cnt["I2F"], "PRMT": cnt["PRMT"], "LDL_loop": cnt["LDL"], "LDL": r["LDL"],
                                 "STL": r["STL"]})
    return rows


if __name__ == "__main__":
    rows = census() + census_expanded()
    print(f"{'tile':20s} {'kernel':8s} {'shift':5s} {'loop':4s} {'instrs':>6s} {'IMMA':>4s} {'/IMMA':>6s} "
          f"{'I2F':>4s} {'PRMT':>4s} {'LDL/loop':>8s} {'LDL':>4s} {'STL':>4s}")
    for r in rows:
        print(f"{r['tile']:20s} {r['kernel']:8s} {str(r['shift']):5s} {r['loop']:4d} {r['instrs']:6d} {r['imma']:4d} "
              f"{r['per_imma']:6.1f} {r['I2F']:4d} {r['PRMT']:4d} {r['LDL_loop']:8d} {r['LDL']:4d} {r['STL']:4d}")
    if "--json" in sys.argv:
        with open(sys.argv[sys.argv.index("--json") + 1], "w") as f:
            json.dump(rows, f, indent=1)
