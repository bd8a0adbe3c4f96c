"""Kernels the benchmarks bring of their own, on the CPU: bench/mma_peak.py's loop compiled for sm_80 (it issues the
two instructions it claims to time, four independent ones an iteration; the interpreter cannot execute inline PTX,
so the timing is a GPU run: whether an H200's mma.sync keeps an A800's INT8:BF16 2:1), and
bench/attention.py's latency-chain kernels in the interpreter."""

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
        "hmma": len(re.findall(r"HMMA\\.16816\\.F32\\.BF16", sass)),
        "imma": len(re.findall(r"IMMA\\.16832\\.S8\\.S8", sass)),
        "spills": census["LDL"] + census["STL"]}
print(json.dumps(out))
"""


def test_the_loop_issues_four_independent_mma_sync_of_each_kind_for_sm80():
    out = last_json(run_python(COMPILE, TRITON_INTERPRET="0"))
    assert out["bf16"]["ptx_mma"] == 4 and out["int8"]["ptx_mma"] == 4, out  # one per chain, none merged
    assert out["bf16"]["hmma"] >= 4 and out["bf16"]["imma"] == 0, out
    assert out["int8"]["imma"] >= 4 and out["int8"]["hmma"] == 0, out
    assert out["bf16"]["spills"] == 0 and out["int8"]["spills"] == 0, out


def test_attention_bench_latency_chain_computes_what_it_claims():
    """bench/attention.py's latency floor (`chain_us`): its two kernels, in the interpreter here, gather the rows
    the ids name and sum them per program, then sum the programs' partials (a count that is not a power of two)."""
    import importlib.util
    import os

    import torch

    from conftest import DEV, REPO

    spec = importlib.util.spec_from_file_location("bench_attention", os.path.join(REPO, "bench", "attention.py"))
    att = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(att)
    g = torch.Generator().manual_seed(3)
    cache = torch.randn(300, 512, generator=g).to(torch.bfloat16)
    ids = torch.randperm(300, generator=g)[:80].to(torch.int32)
    parts = torch.empty(5, 512, device=DEV)
    out = torch.empty(512, device=DEV)
    att._gather_chain_kernel[(5,)](cache.to(DEV), ids.to(DEV), parts, D=512, BLOCK_N=16)
    att._read_parts_kernel[(1,)](parts, out, PARTS=5, PARTS_P2=8, D=512)
    want = cache[ids.long()].float().view(5, 16, 512).sum(1)
    assert torch.allclose(parts.cpu(), want, atol=1e-4) and torch.allclose(out.cpu(), want.sum(0), atol=1e-3)
    # the one-launch chain: the last program's ticket reads the five partials, and the counter is back at 0 for the
    # next call (a CUDA graph replays it), twice in a row
    count = torch.zeros(1, dtype=torch.int32, device=DEV)
    for _ in range(2):
        parts.zero_(), out.zero_()
        att._gather_chain_ticket_kernel[(5,)](cache.to(DEV), ids.to(DEV), parts, count, out, PARTS=5, PARTS_P2=8,
                                              D=512, BLOCK_N=16)
        assert torch.allclose(out.cpu(), want.sum(0), atol=1e-3) and int(count.item()) == 0


def test_moe_bench_read_floor_kernel_reads_each_pairs_expert():
    """bench/moe.py's read floor: program (pair, chunk) reads READ_CHUNK bytes of its pair's expert as int32 words
    and stores the sum of their low bytes (in the interpreter; a repeated expert is read once per pair, as pair
    blocks do)."""
    import importlib.util
    import os

    import torch

    from conftest import DEV, REPO

    spec = importlib.util.spec_from_file_location("bench_moe_rf", os.path.join(REPO, "bench", "moe.py"))
    moe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(moe)
    chunk = moe.READ_CHUNK
    g = torch.Generator().manual_seed(5)
    w = torch.randint(-128, 128, (4, 2, chunk), generator=g, dtype=torch.int8)  # 2 chunks an expert
    ids = torch.tensor([3, 1, 3], dtype=torch.int32)
    out = torch.empty(3 * 2, dtype=torch.int32, device=DEV)
    moe._read_experts_kernel[(3, 2)](w.to(DEV), ids.to(DEV), out, 2 * chunk, CHUNK=chunk)
    words = w.view(4, 2, chunk // 4, 4).view(torch.int32).view(4, 2, chunk // 4).long()
    want = (words[ids.long()] & 0xFF).sum(-1).reshape(-1)
    assert torch.equal(out.cpu().long(), want)
