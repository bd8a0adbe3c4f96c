"""bench/mma_peak.py compiled for sm_80 on the CPU: the loop issues the two instructions it claims to time, four
independent ones an iteration, and nothing else of weight (it cannot run here: the interpreter does not execute
inline PTX). The timing itself is a GPU run (issue 4: whether an H200's mma.sync keeps an A800's INT8:BF16 2:1)."""

from conftest import last_json, run_python

COMPILE = """
import json, re, sys
sys.path.insert(0, "bench")
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import mma_peak as m
import sass_census as sc
out = {}
for int8 in (False, True):
    sig = {"out_ptr": "*i32" if int8 else "*fp32", "iters": "i32", "INT8": "constexpr", "BLOCK": "constexpr"}
    r = triton.compile(ASTSource(fn=m._mma_loop_kernel, signature=sig, constexprs={"INT8": int8, "BLOCK": 256}),
                       target=GPUTarget("cuda", 80, 32), options={"num_warps": 8})
    sass = sc.disassemble(r.asm["cubin"])
    census = sc.loops(sass)
    out["int8" if int8 else "bf16"] = {
        "ptx_mma": r.asm["ptx"].count("mma.sync.aligned." + ("m16n8k32.row.col.s32.s8.s8.s32" if int8 else
                                                              "m16n8k16.row.col.f32.bf16.bf16.f32")),
        "hmma": len(re.findall(r"HMMA\\.16816\\.F32\\.BF16", sass)), "imma": len(re.findall(r"IMMA\\.16832\\.S8\\.S8", sass)),
        "spills": census["LDL"] + census["STL"]}
print(json.dumps(out))
"""


def test_the_loop_issues_four_independent_mma_sync_of_each_kind_for_sm80():
    out = last_json(run_python(COMPILE, TRITON_INTERPRET="0"))
    assert out["bf16"]["ptx_mma"] == 4 and out["int8"]["ptx_mma"] == 4, out  # one per chain, none merged
    assert out["bf16"]["hmma"] >= 4 and out["bf16"]["imma"] == 0, out
    assert out["int8"]["imma"] >= 4 and out["int8"]["hmma"] == 0, out
    assert out["bf16"]["spills"] == 0 and out["int8"]["spills"] == 0, out
