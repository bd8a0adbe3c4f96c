"""The W4A8 MoE kernels (dsv4_sm80/kernels/w4a8_moe*.py) in the Triton interpreter at tiny sizes, against
plain-PyTorch references written from the math (dsv4_sm80/kernels/w4a8_moe_ref.py): every kernel family the table
(w4a8_moe_table.py) runs, at the tiles it runs them with."""

import json
import os
import re

import pytest
import torch

from conftest import REPO, dev
from dsv4_sm80.kernels import w4a8_moe_ref as ref


@pytest.fixture(scope="module")
def k():
    """The kernel module; on a CPU machine conftest has put Triton in its interpreter."""
    import torch

    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and TRITON_INTERPRET is not 1")
    import dsv4_sm80.kernels.w4a8_moe as mod

    return mod


def experts(e, n, kdim, seed, exp_lo=118, exp_hi=131):
    """Random MXFP4 bytes [e, n, kdim/2] and E8M0 scale bytes [e, n, kdim/32]; neighbouring scale
    groups differ by up to exp_hi - exp_lo - 1 binades (> 4: a folded-scale kernel would lose bits)."""
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (e, n, kdim // 2), generator=g, dtype=torch.int32).to(torch.uint8)
    scale = torch.randint(exp_lo, exp_hi, (e, n, kdim // 32), generator=g, dtype=torch.int32).to(torch.uint8)
    return packed, scale


def routing(t, e, top_k, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:top_k] for _ in range(t)]).to(torch.int32)
    w = torch.rand(t, top_k, generator=g)
    return w / w.sum(dim=1, keepdim=True), ids


def case(t=5, h=128, inter=128, e=8, top_k=3, seed=0, x_scale=1.0, **kw):
    w13, s13 = experts(e, 2 * inter, h, seed, **kw)
    w2, s2 = experts(e, h, inter, seed + 1, **kw)
    x = (torch.randn(t, h, generator=torch.Generator().manual_seed(seed + 2)) * x_scale).to(torch.bfloat16)
    tw, ids = routing(t, e, top_k, seed + 3)
    return x, w13, s13, w2, s2, tw, ids


def run_kernel(k, x, w13, s13, w2, s2, tw, ids, **kw):
    a, b = k.repack_mxfp4_for_w4a8(dev(w13.clone())), k.repack_mxfp4_for_w4a8(dev(w2.clone()))
    out = dev(torch.empty(x.shape, dtype=torch.float32))
    return k.w4a8_moe(*dev(x, a, s13, b, s2, tw, ids), out=out, **kw).cpu()


def rel(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def test_repack_keeps_every_code_and_4_bits(k):
    w, _ = experts(3, 64, 128, 1)  # 64 rows: two 32-row tiles
    out = k.repack_mxfp4_for_w4a8(dev(w.clone())).cpu()
    assert out.dtype == torch.uint8 and out.shape == w.shape  # same bytes: 4 bits per weight
    codes = torch.stack((w & 0xF, w >> 4), dim=-1).flatten(-2)  # checkpoint: low nibble = even k
    flat = out.reshape(3, -1)
    # kernel layout, written from its definition: tile-major [N/32, K/64, 32 rows, 32 bytes] per expert; in
    # each row's 32-byte chunk, word q (bytes 4q..4q+3) holds as nibbles 0..3 the codes of k = 4q..4q+3 and
    # as nibbles 4..7 those of k = 32+4q..32+4q+3
    half_k = 64
    for n in (0, 1, 31, 32, 45, 63):
        for chunk in range(2):
            base = (n // 32) * (32 * half_k) + chunk * 1024 + (n % 32) * 32
            for q in range(8):
                word = sum(flat[:, base + 4 * q + b].to(torch.int64) << (8 * b) for b in range(4))
                for nib in range(8):
                    kk = 64 * chunk + 32 * (nib // 4) + 4 * q + nib % 4
                    assert torch.equal((word >> (4 * nib)) & 0xF, codes[:, n, kk].to(torch.int64)), (n, chunk, q, nib)


def test_repack_refuses_rows_not_a_multiple_of_the_tile(k):
    w, _ = experts(1, 40, 128, 1)
    with pytest.raises(ValueError, match="N=40"):
        k.repack_mxfp4_for_w4a8(dev(w.clone()))


def test_repack_is_in_place(k):
    """The parameter object and its storage survive the repack: no second copy of the experts."""
    p = torch.nn.Parameter(dev(torch.randint(-128, 127, (4, 32, 64), dtype=torch.int8)), requires_grad=False)
    ptr = p.data_ptr()
    k.repack_mxfp4_for_w4a8(p.data)
    assert p.data_ptr() == ptr and p.dtype == torch.int8


def test_align_by_expert(k):
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [5, 3]], dtype=torch.int32)
    sorted_ids, block_expert, num_padded = (t.cpu() for t in k.align_by_expert(dev(ids), 6, 4))
    flat = ids.flatten()
    assert int(num_padded) == 4 + 4 + 4 + 4  # experts 0, 1, 3, 5: one block each (3 has 4 pairs)
    for b in range(int(num_padded) // 4):
        e = int(block_expert[b])
        members = [int(i) for i in sorted_ids[4 * b: 4 * b + 4] if i < flat.numel()]
        assert members and all(int(flat[i]) == e for i in members), (b, e, members)
    assert sorted(int(i) for i in sorted_ids if i < 8) == list(range(8))
    assert (block_expert[int(num_padded) // 4:] == -1).all()


def kernels():
    """The table's tiles by name (a test of a family names its kernel; the table picks by batch size)."""
    from dsv4_sm80.kernels.w4a8_moe import Gemv, Mma, Wide

    return {"mma16": Mma(block_m=16, block_n=32, block_n2=128, warps=2, stages=4),
            "mma32": Mma(block_m=32, block_n=64, block_n2=128, warps=2, stages=4, shift=True),
            "mma64": Mma(block_m=64, block_n=128, block_n2=128, warps=4, stages=3, shift=True),
            "gemv": Gemv(), "wide": Wide()}


KERNELS = kernels()
MMA16, MMA32, MMA64 = KERNELS["mma16"], KERNELS["mma32"], KERNELS["mma64"]


def per_token(got, want):
    return (got.float() - want.float()).norm(dim=-1) / want.float().norm(dim=-1).clamp_min(1e-30)


@pytest.mark.parametrize("seed,t,top_k,name", [(0, 5, 3, "mma16"), (4, 1, 2, "mma16"), (9, 19, 6, "mma32"),
                                               (7, 9, 6, "mma64"), (8, 2, 6, "gemv")])
def test_kernel_equals_int8_emulation(k, seed, t, top_k, name):
    """Weight side exact: with scale groups 12 binades apart, each kernel equals the reference that rounds only the
    activations to INT8, at the same points (the intermediate per pair and the kernel's group of columns), up to
    fp32 accumulation order. (The shift tiles without shift maps run their per-group loop; gemv in 2 K shares.)

    Accumulation order (and the GPU's exp in SiLU) can move an intermediate value across a rounding
    boundary of the INT8 re-quantization: one code step in one element, which shows as ~1e-3 on the
    token that holds it (measured on the H200: 2.0e-3 on one case of five). So: nearly every token
    exact, and at most one token in four off by no more than such a flip."""
    from dataclasses import replace

    cfg = KERNELS[name] if name != "gemv" else replace(KERNELS[name], split_k=2)
    x, w13, s13, w2, s2, tw, ids = case(t=t, top_k=top_k, seed=seed)
    got = run_kernel(k, x, w13, s13, w2, s2, tw, ids, routed_scaling_factor=1.5, kernel=cfg).float().cpu()
    want = ref.moe_int8_emulated(x, w13, s13, w2, s2, tw, ids, scaling=1.5, group=cfg.group).float().cpu()
    err = per_token(got, want)
    assert int((err > 1e-5).sum()) <= max(1, t // 4) and float(err.max()) < 1e-2, err.tolist()


@pytest.mark.parametrize("rows,cols", [(3, 256), (1, 4096), (0, 128), (7, 128)])
def test_quantizer_equals_the_reference_rounding(k, rows, cols):
    """The layer input's one-launch INT8 quantizer against the reference's INT8 round trip written from the math:
    the same q * s bit for bit (IEEE division in both), zero rows and huge values included. (7, 128) is a row set
    whose scale comes out one ulp off when a quantizer divides by the Python scalar 127 (PyTorch's CUDA division
    multiplies by its reciprocal) and so flips a code."""
    if (rows, cols) == (7, 128):
        x = case(t=7, top_k=3, seed=37)[0].float()
    else:
        x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(cols)) * 3
    if rows > 1 and cols != 128:
        x[1] = 0.0
        x[0, :5] = torch.tensor([1e30, -1e30, 65504.0, 1e-30, -0.0])
    x = x.to(torch.bfloat16)
    q, s = k.quantize_rows_int8(dev(x))
    q, s = q.cpu(), s.cpu()
    assert q.dtype == torch.int8 and s.shape == (rows, 1)
    assert torch.equal(q.float() * s, ref.int8_round_trip(x.float()))
    assert q.abs().max() <= 127 if rows else True


def test_bf16_pair_outputs_stay_within_their_rounding(k):
    """pair_bf16 keeps each (token, expert) output in BF16 before the top-k sum: within a BF16 rounding of the
    fp32-pair result of the same tile, and held to the reference written from the math as the fp32 path is."""
    from dataclasses import replace

    x, w13, s13, w2, s2, tw, ids = case(t=7, top_k=3, seed=37)
    out32 = run_kernel(k, x, w13, s13, w2, s2, tw, ids, routed_scaling_factor=1.5, kernel=MMA16)
    out16 = run_kernel(k, x, w13, s13, w2, s2, tw, ids, routed_scaling_factor=1.5,
                       kernel=replace(MMA16, pair_bf16=True))
    err = per_token(out16, out32)
    assert 0 < float(err.max()) < 4e-3, err.tolist()  # 2^-9 per pair
    want = ref.moe_int8_emulated(x, w13, s13, w2, s2, tw, ids, scaling=1.5, group=MMA16.group)
    assert float(per_token(out16, want).max()) < 1e-2


def test_split_k_equals_the_unsplit_kernel_and_is_deterministic(k):
    """gemv's gate-up in 4 K shares (more programs for small batches): the same output as one share up to fp32
    summation order (and the rare INT8 re-quantization flip that order can cause, as in the emulation test),
    bit-equal from run to run (the shares are added in a fixed order, no atomics); a share count whose shares are
    not whole 64-deep steps is refused."""
    from dsv4_sm80.kernels.w4a8_moe import Gemv

    # 256 wide: one 64-wide K step per share; 20 pairs: two row blocks of the finishing kernel, the second part-masked
    x, w13, s13, w2, s2, tw, ids = case(t=5, top_k=4, h=256, inter=64, e=4, seed=41)
    one = run_kernel(k, x, w13, s13, w2, s2, tw, ids, kernel=Gemv(split_k=1)).float().cpu()
    four = run_kernel(k, x, w13, s13, w2, s2, tw, ids, kernel=Gemv(split_k=4)).float().cpu()
    again = run_kernel(k, x, w13, s13, w2, s2, tw, ids, kernel=Gemv(split_k=4)).float().cpu()
    assert torch.equal(four, again)
    err = per_token(four, one)
    assert int((err > 1e-5).sum()) <= 1 and float(err.max()) < 1e-2, err.tolist()
    for bad in (Gemv(split_k=3), Gemv(split_k=16), Gemv(split_k=0)):
        with pytest.raises(ValueError, match="split_k"):
            run_kernel(k, x, w13, s13, w2, s2, tw, ids, kernel=bad)


def test_table_picks_a_kernel_for_every_batch(k):
    """The table (w4a8_moe_table.TABLE) has a row for every pair count, at TP4's intermediate (512 per rank) and
    TP1's (2048), with and without the caller's word that every column is shiftable: one token the wide kernel,
    2-32 tokens gemv (2-16 at the wider intermediate), the 16x32 MMA tile to 682 tokens (BF16 pair outputs above
    512), the 32x64 shift tile to 1,280, the 64x128 shift tile beyond, the expanded kernel above 8,192 tokens where
    every column is shiftable. Every row's kernel fits DSV4's shapes, and each row cites its measured figure as
    `H200, mma.sync only, bench/moe.py, <date>`; the benchmark's alternatives are the table's kernels."""
    def name(tokens, inter=512, expand_ok=False):
        return k.select(6 * tokens, inter, expand_ok).name

    for inter in (512, 2048):
        for expand_ok in (False, True):
            for pairs in range(1, 100_001, 7):
                k.select(pairs, inter, expand_ok)  # raises where no row serves
    assert [name(t) for t in (1, 2, 32, 33, 64, 512, 513, 682, 683, 1280, 1281, 8192, 8193)] == [
        "wide", "gemv", "gemv", "mma 16x32", "mma 16x32", "mma 16x32", "mma 16x32, bf16 pairs",
        "mma 16x32, bf16 pairs", "mma 32x64 shift", "mma 32x64 shift", "mma 64x128 shift", "mma 64x128 shift",
        "mma 64x128 shift"]
    assert name(8192, expand_ok=True) == "mma 64x128 shift" and name(8193, expand_ok=True) == "expand"
    assert [name(t, 2048) for t in (1, 16, 17)] == ["wide", "gemv, wide intermediate", "mma 16x32"]
    assert k.choose(12, 128, 512, False).split_k == 2  # gemv's K shares lowered to what hidden 128 divides
    for row in k.TABLE:
        row.kernel.check(4096, 512)
        assert row.reason and re.search(r"H200, mma\.sync only, bench/moe\.py[^)]*, 2026-\d\d-\d\d\)", row.figure), row
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_moe_rows", os.path.join(REPO, "bench", "moe.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert set(bench.alternatives().values()) == {row.kernel for row in k.TABLE}


def test_gemv_equals_the_mma_per_group_loop_bit_for_bit(k):
    """gemv (each pair's one row on CUDA cores: the codes decoded once, multiplied by DP4A on the GPU, elementwise
    here) runs the same exact int32 group dots and the same fp32 steps as the 16x32 MMA tile's per-group loop, so in
    the interpreter it is bit-equal to it (one K share: the same summation; hidden 192, three K steps, so the loop's
    look-ahead runs past the end of K); compiled, within fp32 rounding (FMA contraction may differ). In K shares it
    holds to the INT8 emulation reference, and the default at 4 tokens is the table's gemv."""
    from dsv4_sm80.kernels.w4a8_moe import Gemv

    x, w13, s13, w2, s2, tw, ids = case(t=3, top_k=3, h=192, inter=128, seed=83)
    mma = run_kernel(k, x, w13, s13, w2, s2, tw, ids, routed_scaling_factor=1.5, kernel=MMA16)
    gemv = run_kernel(k, x, w13, s13, w2, s2, tw, ids, routed_scaling_factor=1.5, kernel=Gemv(split_k=1))
    if k.INTERPRETED:
        assert torch.equal(gemv, mma)
    else:
        assert float((gemv - mma).norm() / mma.norm()) < 1e-3
    x, w13, s13, w2, s2, tw, ids = case(t=4, top_k=3, h=512, inter=64, seed=84)
    default = run_kernel(k, x, w13, s13, w2, s2, tw, ids, routed_scaling_factor=1.5)
    assert k.choose(12, 512, 64, False) == Gemv()
    assert torch.equal(default, run_kernel(k, x, w13, s13, w2, s2, tw, ids, routed_scaling_factor=1.5,
                                           kernel=Gemv()))
    want = ref.moe_int8_emulated(x, w13, s13, w2, s2, tw, ids, scaling=1.5, group=32)
    assert float(per_token(default, want).max()) < 1e-2


def test_error_against_exact_is_bounded(k):
    """W4A8 against the float64 exact reference (what W4A16 Marlin approximates): the activation
    rounding, measured as ||err|| / ||ref|| with scale groups spread over 5 binades."""
    errs = []
    for seed in range(3):
        x, w13, s13, w2, s2, tw, ids = case(t=7, seed=10 + seed, exp_lo=120, exp_hi=125)
        got = run_kernel(k, x, w13, s13, w2, s2, tw, ids)
        want = ref.moe_exact(x, w13, s13, w2, s2, tw, ids)
        errs.append(float((got.double() - want).norm() / want.norm()))
    print(f"W4A8 vs exact, relative error per case: {[f'{e:.2e}' for e in errs]}")
    assert max(errs) < 2.5e-2, errs


def test_routed_scaling_applied_once(k):
    x, w13, s13, w2, s2, tw, ids = case(seed=21)
    one = run_kernel(k, x, w13, s13, w2, s2, tw, ids, routed_scaling_factor=1.0)
    scaled = run_kernel(k, x, w13, s13, w2, s2, tw, ids, routed_scaling_factor=1.5)
    assert torch.equal(scaled, one * 1.5)  # x1.5 is exact in fp32; 2.25 would be the double application
    exact = ref.moe_exact(x, w13, s13, w2, s2, tw, ids, scaling=1.5)
    assert rel(scaled, exact) < 5e-2 and rel(scaled, exact * 1.5) > 0.3


def test_swiglu_limit_clamps(k):
    """Large weights push gate and up past +-10: the clamp must act as in the reference."""
    x, w13, s13, w2, s2, tw, ids = case(seed=31, exp_lo=127, exp_hi=129, x_scale=4.0)
    gate_up = ref.dequant_mxfp4(w13, s13)[ids[0, 0].item()] @ x[0].double()
    assert gate_up.abs().max() > 20  # the clamp is really exercised
    got = run_kernel(k, x, w13, s13, w2, s2, tw, ids)
    assert rel(got, ref.moe_int8_emulated(x, w13, s13, w2, s2, tw, ids, group=32)) < 2e-3
    unclamped = ref.moe_int8_emulated(x, w13, s13, w2, s2, tw, ids, limit=0.0, group=32)
    assert rel(got, unclamped) > 0.05


def test_bad_shapes_refused(k):
    x, w13, s13, w2, s2, tw, ids = case(h=96)  # 96 is not a multiple of 64
    with pytest.raises(ValueError, match="multiples of 64"):
        k.w4a8_moe(x, w13, s13, w2, s2, tw, ids)


def test_non_contiguous_weights_refused(k):
    """The tile-major weights and the scale pairs are addressed from the shape: a strided view would be read
    as the wrong bytes, so it is refused, naming the tensor."""
    x, w13, s13, w2, s2, tw, ids = case()
    w13_wide = torch.cat([w13, w13], dim=-1)[..., : w13.shape[-1]]  # same shape, rows K bytes apart
    with pytest.raises(ValueError, match="w13 must be contiguous"):
        k.w4a8_moe(x, w13_wide, s13, w2, s2, tw, ids)
    s2_t = s2.transpose(1, 2).contiguous().transpose(1, 2)
    with pytest.raises(ValueError, match="w2_scale must be contiguous"):
        k.w4a8_moe(x, w13, s13, w2, s2_t, tw, ids)


COMPILE = r"""
import json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from dsv4_sm80.kernels import w4a8_moe as k, w4a8_moe_io as kio
SIG = {
    "a_ptr": "*i8", "a_scale_ptr": "*fp32", "b_ptr": "*u8", "bs_ptr": "*u8", "c_ptr": "*i8", "c_scale_ptr": "*fp32",
    "sorted_ids_ptr": "*i32", "block_expert_ptr": "*i32", "num_padded_ptr": "*i32", "topk_w_ptr": "*fp32",
    "eref_ptr": "*u8", "N": "i32", "K": "i32", "num_pairs": "i32", "a_row_div": "i32", "a_scale_groups": "i32",
    "limit": "fp32", "stride_am": "i32", "stride_be": "i32", "stride_bn": "i32", "stride_bse": "i32",
    "stride_bsn": "i32", "stride_cm": "i32", "c_scale_groups": "i32", "stride_ere": "i32",
    "GATED": "constexpr", "MUL_WEIGHT": "constexpr", "A_GROUP": "constexpr", "BLOCK_M": "constexpr",
    "BLOCK_N": "constexpr", "DECODE_ASM": "constexpr", "SHIFT": "constexpr",
}


def asm_layouts(ttgir):  # the layouts of every inline-asm decoder's operands and results
    out = set()
    for line in ttgir.splitlines():
        if "tt.elementwise_inline_asm" in line:
            out |= set(re.findall(r"tensor<[^>]*?(#[^<]*<[^>]*>)", line.split('"')[-1]))
    return out


out = {}
for name, (bm, bn, bn2, warps, stages, shift) in TILES.items():
    for gated in (True, False):
        sig = dict(SIG, c_ptr="*i8" if gated else "*fp32")
        consts = {"GATED": gated, "MUL_WEIGHT": not gated, "A_GROUP": 0 if gated else bn, "BLOCK_M": bm,
                  "BLOCK_N": bn if gated else bn2, "DECODE_ASM": True, "SHIFT": shift and (gated or bn % 64 == 0)}
        c = triton.compile(ASTSource(fn=k._w4a8_moe_kernel, signature=sig, constexprs=consts),
                           target=GPUTarget("cuda", 80, 32), options={"num_warps": warps, "num_stages": stages})
        ptx = c.asm["ptx"]
        layouts = asm_layouts(c.asm["ttgir"])
        out[f"{name}-{'gate_up' if gated else 'down'}"] = {
            "sm80": ".target sm_80" in ptx,
            "int8_mma": bool(re.search(r"mma[.]sync[.]aligned[.]\S+[.]s32[.]s8[.]s8[.]s32", ptx)),
            "prmt": "0xF4F8FAFC" in ptx,  # the negative table of the per-group decoder (every kernel has that loop)
            "prmt_shift": "0x7F7F7F7F" in ptx,  # the shift decoder's sign mask
            # the decoders' words must be 4 consecutive k of one column: the INT8 MMA B operand layout
            "asm_in_mma_b_layout": bool(layouts) and all("dot_op<{opIdx = 1" in l for l in layouts),
            "fp8": "e4m3" in ptx or "e5m2" in ptx}
io = {}  # the activation-side kernels: plain sm_80 code, IEEE division in the quantizer
for fn, sig, consts in (
        (kio._quantize_rows_kernel, {"x_ptr": "*bf16", "stride_x": "i32", "q_ptr": "*i8", "s_ptr": "*fp32",
                                               "cols": "i32", "BLOCK": "constexpr"}, {"BLOCK": 4096}),
        (kio._sum_pairs_kernel, {"y_ptr": "*fp32", "out_ptr": "*bf16", "h": "i32", "scale": "fp32",
                                           "TOP_K": "constexpr", "BLOCK": "constexpr"}, {"TOP_K": 6, "BLOCK": 1024}),
        (kio._glu_finish_kernel, {"part_ptr": "*fp32", "q_ptr": "*i8", "s_ptr": "*fp32", "pairs": "i32",
                                            "N": "i32", "groups": "i32", "limit": "fp32", "SPLIT_K": "constexpr",
                                            "BLOCK_R": "constexpr", "BLOCK_N": "constexpr"},
         {"SPLIT_K": 8, "BLOCK_R": 16, "BLOCK_N": 32})):
    ptx = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 80, 32),
                         options={"num_warps": 8}).asm["ptx"]
    io[fn.__name__] = {"sm80": ".target sm_80" in ptx, "fp8": "e4m3" in ptx or "e5m2" in ptx,
                       "div_rn": "div.rn.f32" in ptx}
gemv = {}  # the CUDA-core kernel as the table runs it: gate-up in 8 K shares, down; and gate-up with its GLU (1 share)
gsig = {"a_ptr": "*i8", "a_scale_ptr": "*fp32", "b_ptr": "*u8", "bs_ptr": "*u8", "c_ptr": "*fp32",
        "c_scale_ptr": "*fp32", "expert_ptr": "*i32", "topk_w_ptr": "*fp32", "N": "i32", "K": "i32",
        "num_pairs": "i32", "a_row_div": "i32", "a_scale_groups": "i32", "limit": "fp32", "stride_am": "i32",
        "stride_be": "i32", "stride_bn": "i32", "stride_bse": "i32", "stride_bsn": "i32", "stride_cm": "i32",
        "c_scale_groups": "i32", "GATED": "constexpr", "MUL_WEIGHT": "constexpr", "A_GROUP": "constexpr",
        "BLOCK_N": "constexpr", "DECODE_ASM": "constexpr", "SPLIT_K": "constexpr"}
for name, c_ptr, consts, warps in (("gate_up-split8", "*fp32", {"GATED": True, "BLOCK_N": 128, "SPLIT_K": 8}, 4),
                                   ("gate_up-glu", "*i8", {"GATED": True, "BLOCK_N": 32, "SPLIT_K": 1}, 1),
                                   ("down", "*fp32", {"GATED": False, "MUL_WEIGHT": True, "A_GROUP": 32,
                                                      "BLOCK_N": 128, "SPLIT_K": 1}, 4)):
    consts = dict({"MUL_WEIGHT": False, "A_GROUP": 0, "DECODE_ASM": True}, **consts)
    ptx = triton.compile(ASTSource(fn=k._w4a8_gemv_kernel, signature=dict(gsig, c_ptr=c_ptr), constexprs=consts),
                         target=GPUTarget("cuda", 80, 32), options={"num_warps": warps, "num_stages": 3}).asm["ptx"]
    gemv[name] = {"sm80": ".target sm_80" in ptx, "dp4a": "dp4a.s32.s32" in ptx, "prmt": "0xF4F8FAFC" in ptx,
                  "fp8": "e4m3" in ptx or "e5m2" in ptx}
expanded = {}  # the expanded kernel: the decode into the INT8 workspace (PRMT shift decoder) and the plain INT8 GEMMs
esig = {"b_ptr": "*u8", "bs_ptr": "*u8", "eref_ptr": "*u8", "w8_ptr": "*i8", "ok_ptr": "*u8", "K": "i32",
        "expert_lo": "i32", "stride_be": "i32", "stride_bn": "i32", "stride_bse": "i32", "stride_bsn": "i32",
        "stride_ere": "i32", "stride_we": "i32", "stride_wn": "i32", "stride_oke": "i32", "BLOCK_N": "constexpr",
        "DECODE_ASM": "constexpr"}
ptx = triton.compile(ASTSource(fn=k._expand_kernel, signature=esig, constexprs={"BLOCK_N": 32, "DECODE_ASM": True}),
                     target=GPUTarget("cuda", 80, 32), options={"num_warps": 2}).asm["ptx"]
expanded["expand"] = {"sm80": ".target sm_80" in ptx, "prmt_shift": "0x7F7F7F7F" in ptx, "fp8": "e4m3" in ptx}
wsig = {"a_ptr": "*i8", "a_scale_ptr": "*fp32", "w8_ptr": "*i8", "ok_ptr": "*u8", "c_ptr": "*i8",
        "c_scale_ptr": "*fp32", "sorted_ids_ptr": "*i32", "block_expert_ptr": "*i32", "num_padded_ptr": "*i32",
        "topk_w_ptr": "*fp32", "N": "i32", "K": "i32", "num_pairs": "i32", "a_row_div": "i32",
        "a_scale_groups": "i32", "limit": "fp32", "expert_lo": "i32", "expert_hi": "i32", "stride_am": "i32",
        "stride_we": "i32", "stride_wn": "i32", "stride_oke": "i32", "stride_cm": "i32", "c_scale_groups": "i32",
        "GATED": "constexpr", "MUL_WEIGHT": "constexpr", "A_GROUP": "constexpr", "BLOCK_M": "constexpr",
        "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"}
for name, c_ptr, consts in (("gate_up-64x128x128", "*i8", {"GATED": True, "MUL_WEIGHT": False, "A_GROUP": 0,
                                                          "BLOCK_K": 128}),
                            ("down-64x128x128", "*fp32", {"GATED": False, "MUL_WEIGHT": True, "A_GROUP": 128,
                                                         "BLOCK_K": 128})):
    # the divisibility the real JIT derives (pointers, N, K, strides multiples of 16): what vectorized, pipelined
    # operand loads need
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(wsig)
             if wsig[p].startswith("*") or p in ("N", "K") or p.startswith("stride_")}
    c = triton.compile(ASTSource(fn=k._w8_moe_kernel, signature=dict(wsig, c_ptr=c_ptr),
                                 constexprs=dict(consts, BLOCK_M=64, BLOCK_N=128), attrs=attrs),
                       target=GPUTarget("cuda", 80, 32), options={"num_warps": 4, "num_stages": 3})
    ptx = c.asm["ptx"]
    expanded[name] = {"sm80": ".target sm_80" in ptx, "fp8": "e4m3" in ptx or "e5m2" in ptx,
                      "int8_mma": bool(re.search(r"mma[.]sync[.]aligned[.]\S+[.]s32[.]s8[.]s8[.]s32", ptx)),
                      "cp_async": "cp.async" in ptx}
print(json.dumps({"gemm": out, "io": io, "gemv": gemv, "expanded": expanded}))
"""


def test_compiles_for_sm80_with_int8_mma():
    """The table's kernels at its tiles, compiled for sm_80 without a GPU (in a process where Triton's interpreter is
    off): the MMA kernel's three tiles (gate-up and down; the shift tiles hold both loops) on INT8 tensor-core MMA
    with the PRMT decoders running in the MMA B-operand layout (what their word layout assumes); the activation-side
    launches with IEEE division in the quantizer; gemv with DP4A and the PRMT decoder; the expanded kernel's decode
    (the shift decoder) and its GEMMs on INT8 MMA fed by cp.async; no FP8 type anywhere."""
    from conftest import last_json, run_python

    tiles = {n: (c.block_m, c.block_n, c.block_n2, c.warps, c.stages, c.shift)
             for n, c in (("mma16", MMA16), ("mma32", MMA32), ("mma64", MMA64))}
    res = last_json(run_python(COMPILE.replace("TILES", repr(tiles)), TRITON_INTERPRET="0"))
    assert len(res["gemm"]) == 6
    for name, r in res["gemm"].items():
        assert r == {"sm80": True, "int8_mma": True, "prmt": True, "prmt_shift": not name.startswith("mma16"),
                     "asm_in_mma_b_layout": True, "fp8": False}, (name, r)
    assert res["io"]["_quantize_rows_kernel"] == {"sm80": True, "fp8": False, "div_rn": True}, res["io"]
    for name in ("_sum_pairs_kernel", "_glu_finish_kernel"):
        assert res["io"][name]["sm80"] and not res["io"][name]["fp8"], res["io"]
    assert res["gemv"] == {n: {"sm80": True, "dp4a": True, "prmt": True, "fp8": False}
                           for n in ("gate_up-split8", "gate_up-glu", "down")}, res["gemv"]
    assert res["expanded"] == {"expand": {"sm80": True, "prmt_shift": True, "fp8": False},
                               **{n: {"sm80": True, "fp8": False, "int8_mma": True, "cp_async": True}
                                  for n in ("gate_up-64x128x128", "down-64x128x128")}}, res["expanded"]


E2M1X2 = [0, 1, 2, 3, 4, 6, 8, 12]


def _prmt(a, b, c):
    """PTX prmt.b32 (default mode): byte i of the result = byte (selector nibble i & 7) of {b, a}, or, if
    bit 3 of that nibble is set, that byte's msb replicated over the byte (sign-replicate)."""
    src, out = (b << 32) | a, 0
    for i in range(4):
        sel = (c >> (4 * i)) & 0xF
        byte = (src >> (8 * (sel & 7))) & 0xFF
        if sel & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def _decode_word(x):
    """w4a8_moe_layout.PTX_DECODE, instruction by instruction, on one 32-bit word: (lo, hi)."""
    sel = x & 0x77777777
    selh = sel >> 16
    sx = (x << 4) & 0xFFFFFFFF
    out = []
    for s, m in ((sel, 0x9D8C), (selh, 0xBFAE)):
        pos = _prmt(0x03020100, 0x0C080604, s)
        neg = _prmt(0xFDFEFF00, 0xF4F8FAFC, s)
        sg = _prmt(x, sx, m)
        out.append(((sg & neg) | (~sg & pos)) & 0xFFFFFFFF)  # lop3 0xD8: c ? b : a
    return out


def _decode_word_shift(x, mb):
    """PTX_DECODE_SHIFT instruction by instruction: x the codes, mb the operand register (4 identical
    bytes m0 | m1 << 4, m = 2^s). Also checks the no-carry reasoning: the 32-bit multiply-add equals the
    bytewise one (no byte of P * m + M exceeds 255)."""
    sel = x & 0x77777777
    selh = sel >> 16
    sx = (x << 4) & 0xFFFFFFFF
    m0, m1 = mb & 15, (mb >> 4) & 15  # and 15; bfe.u32 4, 4
    out = []
    for s, sm, m in ((sel, 0x9D8C, m0), (selh, 0xBFAE, m1)):
        pos = _prmt(0x03020100, 0x0C080604, s)
        sg = _prmt(x, sx, sm) & 0x7F7F7F7F
        v = (pos * m + sg) & 0xFFFFFFFF  # mad.lo.u32
        bytewise = [((pos >> (8 * i)) & 0xFF) * m + ((sg >> (8 * i)) & 0xFF) for i in range(4)]
        assert all(b < 256 for b in bytewise) and v == sum(b << (8 * i) for i, b in enumerate(bytewise))
        out.append(v ^ sg)
    return out


def _words():
    g = torch.Generator().manual_seed(0)
    words = torch.randint(0, 2**32, (4096,), generator=g, dtype=torch.int64).tolist()
    # every code in every nibble position, with varied neighbours
    words += [sum(((c + 3 * p * r) % 16) << (4 * p) for p in range(8)) for c in range(16) for r in range(16)]
    return words + [0, 0xFFFFFFFF, 0x88888888, 0x77777777, 0xF0F0F0F0]


def _want(x, group, mul=1):
    """The bytes the decoder must give for word x: code k0 + i of the group (nibble 4*group + i) x mul."""
    vals = []
    for i in range(4):
        c = (x >> (4 * (4 * group + i))) & 0xF
        vals.append(((-1 if c & 8 else 1) * E2M1X2[c & 7] * mul) & 0xFF)
    return vals


def test_swar_decode_algorithm():
    """The PTX decoders (8 codes per 32-bit word of the repacked layout: three PRMTs and a blend per four
    codes; the shift decoder's multiply-add and sign flip), emulated instruction by instruction over
    many words and every multiplier pair, against the E2M1 table. The kernel's PTX text is checked to be
    these instructions with these constants; a GPU run checks the compiled kernel against the reference."""
    from dsv4_sm80.kernels import w4a8_moe_layout as mod

    for const in ("0x77777777", "0x9D8C", "0xBFAE", "0x03020100", "0x0C080604", "0xFDFEFF00", "0xF4F8FAFC",
                  "0xD8", "shr.b32 selh, sel, 16", "shl.b32 sx, $2, 4"):
        assert const in mod.PTX_DECODE, const
    for const in ("0x77777777", "0x9D8C", "0xBFAE", "0x03020100", "0x0C080604", "0x7F7F7F7F",
                  "and.b32 m0, $3, 15", "bfe.u32 m1, $3, 4, 4", "mad.lo.u32 v, pos, m0, sg", "xor.b32 $0, v, sg"):
        assert const in mod.PTX_DECODE_SHIFT, const
    bytes_of = lambda w: [(w >> (8 * i)) & 0xFF for i in range(4)]  # noqa: E731
    for x in _words():
        lo, hi = _decode_word(x)
        assert bytes_of(lo) == _want(x, 0) and bytes_of(hi) == _want(x, 1), hex(x)
    for s0 in range(4):
        for s1 in range(4):
            mb = ((1 << s0) | ((1 << s1) << 4)) * 0x01010101
            for x in _words()[::7]:
                lo, hi = _decode_word_shift(x, mb)
                assert bytes_of(lo) == _want(x, 0, 1 << s0) and bytes_of(hi) == _want(x, 1, 1 << s1), (hex(x), s0, s1)


def column_scales(e, n, kdim, seed, spread, bad_every=0):
    """E8M0 bytes [e, n, kdim/32] as real MXFP4 checkpoints have them: a base exponent per column (output
    row) plus a per-group offset in 0..spread (spread <= 3: every column shiftable). bad_every=j: every
    j-th column (offset by the expert) gets one group 4..6 binades above its base instead (not shiftable),
    so tiles mix shiftable and non-shiftable columns."""
    g = torch.Generator().manual_seed(seed)
    groups = kdim // 32
    base = torch.randint(118, 126, (e, n, 1), generator=g)
    s = base + torch.randint(0, spread + 1, (e, n, groups), generator=g)
    if bad_every:
        cols = (torch.arange(n)[None, :] + torch.arange(e)[:, None]) % bad_every == 0
        grp = torch.randint(0, groups, (e, n), generator=g)
        jump = torch.randint(4, 7, (e, n), generator=g)
        kept = s.gather(2, grp[..., None])[..., 0]
        s.scatter_(2, grp[..., None], torch.where(cols, base[..., 0] + jump, kept)[..., None])
    return s.to(torch.uint8)


def shift_case(spread, bad_every=0, t=5, top_k=3, seed=50, h=128, inter=128, e=8):
    x, w13, _, w2, _, tw, ids = case(t=t, top_k=top_k, seed=seed, h=h, inter=inter, e=e)
    s13 = column_scales(e, 2 * inter, h, seed + 10, spread, bad_every)
    s2 = column_scales(e, h, inter, seed + 11, spread, bad_every)
    return x, w13, s13, w2, s2, tw, ids


def test_shift_refs_against_brute_force(k):
    s = column_scales(4, 37, 256, 3, 4)
    s[0, 0, :] = 130  # constant column: shiftable, e_ref = 130
    s[0, 1, 3] = 0  # an E8M0 0 group (flushes to zero per group): not shiftable
    s[0, 2, :] = 0
    s[0, 3, :] = 1
    s[0, 3, 5] = 4  # spread exactly 3 from e = 1
    s[0, 4, :] = 200
    s[0, 4, 2] = 196  # spread 4
    got = k.shift_refs(dev(s)).cpu()
    assert got.dtype == torch.uint8 and got.shape == (4, 37)
    for e in range(4):
        for n in range(37):
            col = [int(v) for v in s[e, n]]
            want = 0
            for ref_e in range(255, 0, -1):  # the largest e_ref with every shift e - e_ref in 0..3 (min shift 0)
                if all(v > 0 and 0 <= v - ref_e <= 3 for v in col):
                    want = ref_e
                    break
            assert int(got[e, n]) == want, (e, n, col, int(got[e, n]))
    assert int(got[0, 0]) == 130 and int(got[0, 1]) == 0 and int(got[0, 2]) == 0 and int(got[0, 3]) == 1
    assert int(got[0, 4]) == 0
    assert 0 < float((got > 0).float().mean()) < 1  # spread 4 draws: some columns of each kind


def run_shift(k, x, w13, s13, w2, s2, tw, ids, erefs=None, **kw):
    a, b = k.repack_mxfp4_for_w4a8(dev(w13.clone())), k.repack_mxfp4_for_w4a8(dev(w2.clone()))
    e13, e2 = erefs if erefs is not None else (k.shift_refs(dev(s13)), k.shift_refs(dev(s2)))
    out = dev(torch.empty(x.shape, dtype=torch.float32))
    return k.w4a8_moe(*dev(x, a, s13, b, s2, tw, ids), out=out, w13_eref=dev(e13), w2_eref=dev(e2), **kw).cpu()


@pytest.mark.parametrize("spread,bad_every", [(3, 0), (4, 3), (3, 7)])  # all, none, some columns shiftable
@pytest.mark.parametrize("name,t,top_k", [("mma32", 4, 3), ("mma32", 2, 2), ("mma64", 11, 6)])
def test_shift_path_equals_int8_emulation(k, spread, bad_every, name, t, top_k):
    """The shift tiles (int32 accumulation over K, one conversion per activation-scale change) against the
    reference written from the math, with the same tolerance rule as test_kernel_equals_int8_emulation:
    all columns shiftable (spread <= 3), none (a group 4..6 binades up in every 3rd column: every tile
    falls back), and mixed columns within a tile (every 7th: fallback for those tiles only)."""
    cfg = KERNELS[name]
    x, w13, s13, w2, s2, tw, ids = shift_case(spread, bad_every, t=t, top_k=top_k, seed=60 + t)
    got = run_shift(k, x, w13, s13, w2, s2, tw, ids, routed_scaling_factor=1.5, kernel=cfg).float()
    want = ref.moe_int8_emulated(x, w13, s13, w2, s2, tw, ids, scaling=1.5, group=cfg.group).float()
    err = per_token(got, want)
    assert int((err > 1e-5).sum()) <= max(1, t // 4) and float(err.max()) < 1e-2, err.tolist()
    frac = float((k.shift_refs(s13) > 0).float().mean())
    assert (frac == 1.0) if not bad_every else (frac < 1.0)


def expand_of(tile, **kw):
    from dsv4_sm80.kernels.w4a8_moe import Expand

    return Expand(tile=tile, **kw)


@pytest.mark.parametrize("extra,t,top_k", [({}, 9, 3), ({"workspace_mb": 0}, 5, 2), ({"block_k": 64}, 4, 2)])
def test_expanded_weights_equal_the_shift_loop_bit_for_bit(k, extra, t, top_k):
    """The expanded kernel (codes decoded once per call into an INT8 workspace, then plain INT8 GEMMs) computes the
    shift loop's int32 sums and fp32 steps: with every column shiftable, the shift tile's result bit for bit,
    whether the workspace holds every expert or one at a time (workspace_mb 0), whatever its K step."""
    x, w13, s13, w2, s2, tw, ids = shift_case(2, 0, t=t, top_k=top_k, seed=80 + t)
    tile = k.TABLE[-1].kernel  # the prefill tile the expanded row shares
    want = run_shift(k, x, w13, s13, w2, s2, tw, ids, routed_scaling_factor=1.5, kernel=tile)
    got = run_shift(k, x, w13, s13, w2, s2, tw, ids, routed_scaling_factor=1.5, kernel=expand_of(tile, **extra))
    assert torch.isfinite(want).all() and torch.equal(got, want)
    emulated = ref.moe_int8_emulated(x, w13, s13, w2, s2, tw, ids, scaling=1.5, group=tile.group)
    assert rel(got, emulated.float()) < 1e-2


def test_expand_kernel_writes_each_weight_as_its_shifted_integer(k):
    """`_expand_kernel` (through `expand_experts`, the launch w4a8_moe and the bench use) against the plain-PyTorch
    dequantization (w4a8_moe_ref.dequant_mxfp4): every workspace byte
    is the weight times 2 / 2^(e_ref - 127) (the shift path's integer), row-major [N, K], for an expert share that
    starts past expert 0; the ok map is e_ref where the column is shiftable and 0 where it is not."""
    _, w13, s13, _, _, _, _ = shift_case(3, 7, t=1, top_k=1, seed=92)  # every 7th column unshiftable
    e, n, half_k = w13.shape
    er = k.shift_refs(s13)
    packed = k.repack_mxfp4_for_w4a8(dev(w13.clone())).view(torch.uint8)
    w8 = dev(torch.full((e - 2, n, 2 * half_k), 77, dtype=torch.int8))
    ok = dev(torch.full((e - 2, n), 255, dtype=torch.uint8))
    sb, erd = dev(s13), dev(er)
    k.expand_experts(packed, sb, erd, w8, ok, 2, e - 2, bool(w8.is_cuda and not k.INTERPRETED))
    w8, ok = w8.cpu(), ok.cpu()
    assert torch.equal(ok, er[2:]) and bool((er == 0).any())
    want = ref.dequant_mxfp4(w13, s13).double()[2:] * 2 / torch.exp2(er[2:].double() - 127)[..., None]
    good = er[2:] > 0
    assert torch.equal(w8.double()[good], want[good])


def test_expanded_weights_refuse_loudly(k):
    """An unshiftable column (the map's 0) or a map of other scales gives NaN through the expanded GEMMs, never a
    number; tiles the expanded kernel cannot run, and a call without both shift maps, are refused by name."""
    from dataclasses import replace

    cfg = expand_of(MMA32)
    x, w13, s13, w2, s2, tw, ids = shift_case(3, 7, t=5, top_k=2, seed=90)  # every 7th column unshiftable
    got = run_shift(k, x, w13, s13, w2, s2, tw, ids, kernel=cfg)
    assert bool(torch.isnan(got).any())
    xa, w13a, s13a, w2a, s2a, twa, idsa = shift_case(2, 0, t=3, top_k=2, seed=91)
    e13a, e2a = k.shift_refs(s13a), k.shift_refs(s2a)
    for wrong in ((e13a + 1, e2a), (e13a, e2a + 1)):
        got = run_shift(k, xa, w13a, s13a, w2a, s2a, twa, idsa, erefs=wrong, kernel=cfg)
        assert bool(torch.isnan(got).all()), got
    for bad, why in ((expand_of(MMA16), "block_n a multiple of 64"),
                     (replace(cfg, block_k=96), "block_k a multiple of 64")):
        with pytest.raises(ValueError, match=why):
            run_shift(k, xa, w13a, s13a, w2a, s2a, twa, idsa, kernel=bad)
    with pytest.raises(ValueError, match="both shift maps given"):
        run_kernel(k, xa, w13a, s13a, w2a, s2a, twa, idsa, kernel=cfg)


@pytest.mark.parametrize("name", ["mma32", "mma64"])
def test_shift_path_is_taken_and_a_wrong_map_is_loud(k, name):
    """With every column shiftable, a map off by one binade (shifts -1..2) must give NaN, not a number:
    this shows the shift loop ran for those tiles (the per-group loop ignores the map) and that a map
    of other scales cannot pass silently. A map of zeros (nothing shiftable) gives the per-group result,
    as does the tile without maps."""
    cfg = KERNELS[name]
    x, w13, s13, w2, s2, tw, ids = shift_case(2, 0, t=3, top_k=2, seed=70)
    e13, e2 = k.shift_refs(s13), k.shift_refs(s2)
    assert bool((e13 > 0).all()) and bool((e2 > 0).all())
    for wrong in ((e13 + 1, e2), (e13, e2 + 1)):
        got = run_shift(k, x, w13, s13, w2, s2, tw, ids, erefs=wrong, kernel=cfg)
        assert bool(torch.isnan(got).all()), got
    fallback = run_shift(k, x, w13, s13, w2, s2, tw, ids, erefs=(torch.zeros_like(e13), torch.zeros_like(e2)),
                         kernel=cfg)
    per_group = run_kernel(k, x, w13, s13, w2, s2, tw, ids, kernel=cfg)
    assert torch.equal(fallback, per_group)
    shifted = run_shift(k, x, w13, s13, w2, s2, tw, ids, kernel=cfg)
    assert rel(shifted, per_group) < 1e-2


CENSUS = r"""
import json, sys
sys.path.insert(0, "bench")
import sass_census as sc
out = {}
for name, shift in (("shift", True), ("per_group", False)):
    consts = {"GATED": True, "MUL_WEIGHT": False, "A_GROUP": 0, "BLOCK_M": 64, "BLOCK_N": 128,
              "DECODE_ASM": True, "SHIFT": shift}
    loops = sc.loops(sc.sass(consts, 4))["loops"]
    out[name] = [{"IMMA": c["IMMA"], "I2F": c["I2F"]} for c in loops]
print(json.dumps(out))
"""


def test_shift_loop_has_no_per_group_conversion_in_sm80_sass():
    """The structural point of the shift path, read from the sm_80 machine code (no GPU: Triton's own ptxas
    and nvdisasm): in the prefill gate-up tile the per-group loop converts every 32-deep INT8 dot (4 I2F per
    IMMA, a quarter-rate instruction on SM80), while the shift loop's INT8 dots accumulate in int32 with no
    I2F inside the K loop. A static property of the code, not a timing."""
    from conftest import last_json, run_python

    res = last_json(run_python(CENSUS, TRITON_INTERPRET="0"))
    per_group = max(res["per_group"], key=lambda c: c["IMMA"])
    assert per_group["IMMA"] > 0 and per_group["I2F"] == 4 * per_group["IMMA"], res
    shift_loops = [c for c in res["shift"] if c["I2F"] == 0 and c["IMMA"] > 0]
    assert shift_loops, res  # the kernel holds both loops; one of them has no conversion at all


@pytest.mark.parametrize("name", ["wide", "gemv", "mma16", "expand"])
def test_no_tokens_gives_an_empty_output(k, name):
    """An empty batch (a rank with no tokens this step) returns [0, H] from every kernel family."""
    x, w13, s13, w2, s2, tw, ids = shift_case(2, 0, t=3, top_k=3, seed=1)
    cfg = expand_of(MMA32) if name == "expand" else KERNELS[name]
    cfg = cfg.for_hidden(x.shape[1]) if name == "gemv" else cfg
    a, b = k.repack_mxfp4_for_w4a8(dev(w13.clone())), k.repack_mxfp4_for_w4a8(dev(w2.clone()))
    got = k.w4a8_moe(*dev(x[:0], a, s13, b, s2, tw[:0], ids[:0]), routed_scaling_factor=1.5, kernel=cfg,
                     w13_eref=dev(k.shift_refs(s13)), w2_eref=dev(k.shift_refs(s2)))
    assert got.shape == (0, x.shape[1]) and got.dtype == x.dtype


def test_wide_equals_int8_emulation(k):
    """The one-token kernel (a gate-up program holds a pair's whole K for n columns, rounding the token's row to
    INT8 itself; a down program all of a token's pairs for n2 output columns): held to the INT8 emulation reference
    written from the math, the intermediate rounded per n columns; a hidden size whose K/64 chunks are not a power
    of two (192: the padded chunk reads valid memory and adds 0); other widths; more than one token. The 16x32 MMA
    tile (the same rounding points) agrees to fp32 rounding of the group sums (an INT8 rounding of the intermediate
    may flip: ~1e-3 on a token)."""
    from dataclasses import replace

    for t, h, inter, top_k, extra in ((1, 256, 128, 3, {}), (1, 192, 128, 2, {"n2": 32}), (3, 256, 64, 3, {}),
                                      (2, 128, 128, 4, {"n2": 64, "warps2": 4})):
        x, w13, s13, w2, s2, tw, ids = case(t=t, top_k=top_k, h=h, inter=inter, seed=120 + t + h)
        cfg = replace(KERNELS["wide"], **extra)
        got = run_kernel(k, x, w13, s13, w2, s2, tw, ids, routed_scaling_factor=1.5, kernel=cfg).float()
        want = ref.moe_int8_emulated(x, w13, s13, w2, s2, tw, ids, scaling=1.5, group=cfg.group).float()
        err = per_token(got, want)
        assert float(err.max()) < 1e-2 and int((err > 1e-5).sum()) <= max(1, t // 4), (t, h, extra, err.tolist())
        other = run_kernel(k, x, w13, s13, w2, s2, tw, ids, routed_scaling_factor=1.5, kernel=MMA16)
        assert float(per_token(got, other).max()) < 1e-2


def test_one_token_defaults_to_wide(k):
    """The table at one token (up to 6 pairs): the wide kernel, 32-column gate-up programs of 16 warps (the
    intermediate group 32 of every other decode kernel) and 16-column down programs of 8 warps. The default's
    output is that kernel's."""
    from dsv4_sm80.kernels.w4a8_moe import Wide

    assert k.choose(6, 4096, 512, False) == Wide(n=32, warps=16, n2=16, warps2=8)
    assert not isinstance(k.choose(7, 4096, 512, False), Wide)
    x, w13, s13, w2, s2, tw, ids = case(t=1, top_k=3, h=256, inter=64, seed=170)
    default = run_kernel(k, x, w13, s13, w2, s2, tw, ids, routed_scaling_factor=1.5)
    assert torch.equal(default, run_kernel(k, x, w13, s13, w2, s2, tw, ids, routed_scaling_factor=1.5,
                                           kernel=KERNELS["wide"]))


def test_wide_routed_scaling_once_and_a_missing_expert_adds_nothing(k):
    """The routed scaling multiplies the sum once; a pair of expert -1 (no expert) contributes nothing: the output
    equals the reference with that pair's router weight 0."""
    wide = KERNELS["wide"]
    x, w13, s13, w2, s2, tw, ids = case(t=2, top_k=3, h=128, inter=64, seed=140)
    one = run_kernel(k, x, w13, s13, w2, s2, tw, ids, routed_scaling_factor=1.0, kernel=wide).float()
    two = run_kernel(k, x, w13, s13, w2, s2, tw, ids, routed_scaling_factor=2.0, kernel=wide).float()
    assert torch.allclose(two, 2 * one, rtol=1e-6, atol=0)
    ids_gap, tw_gap = ids.clone(), tw.clone()
    ids_gap[1, 2] = -1
    tw_gap[1, 2] = 0.0
    got = run_kernel(k, x, w13, s13, w2, s2, tw, ids_gap, kernel=wide).float()
    want = ref.moe_int8_emulated(x, w13, s13, w2, s2, tw_gap, ids_gap.clamp_min(0), group=wide.group).float()
    assert rel(got, want) < 1e-2, rel(got, want)


def test_wide_refuses_what_it_cannot_do(k):
    """Widths that do not tile the layer are refused loudly, naming the width."""
    from dataclasses import replace

    x, w13, s13, w2, s2, tw, ids = case(t=1, top_k=2, h=128, inter=64, seed=150)
    for bad, match in (({"n": 48}, "n=48"), ({"n": 16}, "n=16"), ({"n2": 256}, "n2=256")):
        with pytest.raises(ValueError, match=match):
            run_kernel(k, x, w13, s13, w2, s2, tw, ids, kernel=replace(KERNELS["wide"], **bad))


WIDE_COMPILE = r"""
import json, os, re, subprocess, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from dsv4_sm80.kernels import w4a8_moe_wide as k
common = {"b_ptr": "*u8", "bs_ptr": "*u8", "expert_ptr": "*i32", "N": "i32", "stride_be": "i32", "stride_bse": "i32",
          "stride_bsn": "i32", "K": "constexpr", "C": "constexpr", "BLOCK_N": "constexpr", "DECODE_ASM": "constexpr"}
up = dict(common, x_ptr="*bf16", q_ptr="*i8", q_scale_ptr="*fp32", xq_ptr="*i8", a_row_div="i32", limit="fp32",
          stride_xm="i32", stride_qm="i32", q_groups="i32")
down = dict(common, h_ptr="*i8", h_scale_ptr="*fp32", out_ptr="*bf16", topk_w_ptr="*fp32", h_groups="i32",
            scale="fp32", stride_hm="i32", stride_om="i32", TOP_K="constexpr", TOP_K_P="constexpr",
            A_GROUP="constexpr")
# the divisibility the real JIT derives at TP4 shapes (pointers, and the integer arguments that are multiples of 16)
attrs = lambda sig: {(i,): [["tt.divisibility", 16]] for i, p in enumerate(sig)
                     if sig[p].startswith("*") or p.startswith("stride_") or p == "N"}
sigs = {"up": up, "down": down}
out = {}
for name, fn, sig, consts, warps in WIDE_BUILDS:
    fn = getattr(k, fn)
    sig = {n: sigs[sig][n] for n in fn.arg_names}  # in the kernel's argument order
    c = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs(sig)),
                       target=GPUTarget("cuda", 80, 32), options={"num_warps": warps})
    ptx = c.asm["ptx"]
    r = {"sm80": ".target sm_80" in ptx, "dp4a": "dp4a.s32.s32" in ptx, "prmt": "0xF4F8FAFC" in ptx,
         "fp8": "e4m3" in ptx or "e5m2" in ptx, "v4_loads": len(re.findall(r"ld[.]global(?:[.]\w+)*[.]v4[.]b32", ptx))}
    # registers and local-memory stack per thread, as ptxas built them (Triton's own cuobjdump)
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(c.asm["cubin"]); f.flush()
        use = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+).*?STACK:(\d+)", use)
    r["regs"], r["stack"] = (int(m.group(1)), int(m.group(2))) if m else (None, None)
    out[name] = r
print(json.dumps(out))
"""
WIDE_BUILDS = [  # the table's one-token kernel at TP4 per-rank shapes (hidden 4096, intermediate 512)
    ("gate_up-32x16w", "_wide_gate_up_kernel", "up", {"K": 4096, "C": 64, "BLOCK_N": 32, "DECODE_ASM": True}, 16),
    ("down-16x8w", "_wide_down_kernel", "down",
     {"K": 512, "C": 8, "A_GROUP": 32, "BLOCK_N": 16, "DECODE_ASM": True, "TOP_K": 6, "TOP_K_P": 8}, 8),
]


def test_wide_kernels_compile_for_sm80():
    """The wide kernels at TP4 per-rank shapes, compiled for sm_80 without a GPU: DP4A and the PRMT decoder, 16-byte
    code loads, no FP8, and no local-memory stack (ptxas spilled nothing; read with the cuobjdump Triton ships)."""
    from conftest import last_json, run_python

    res = last_json(run_python(WIDE_COMPILE.replace("WIDE_BUILDS", repr(WIDE_BUILDS)), TRITON_INTERPRET="0"))
    for name, r in res.items():
        assert {n: r[n] for n in ("sm80", "dp4a", "prmt", "fp8")} == {"sm80": True, "dp4a": True, "prmt": True,
                                                                     "fp8": False}, (name, r)
        assert r["v4_loads"] > 0, (name, r)
        assert r["stack"] == 0, (name, r)
    print(json.dumps(res))
