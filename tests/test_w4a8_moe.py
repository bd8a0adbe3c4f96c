"""The W4A8 MoE kernels (dsv4_sm80/kernels/w4a8_moe.py) in the Triton interpreter at tiny sizes,
against plain-PyTorch references written from the math (dsv4_sm80/kernels/w4a8_moe_ref.py)."""

import os

import pytest
import torch

from conftest import dev
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
    w, _ = experts(3, 5, 128, 1)
    out = k.repack_mxfp4_for_w4a8(dev(w.clone())).cpu()
    assert out.dtype == torch.uint8 and out.shape == w.shape  # same bytes: 4 bits per weight
    codes = torch.stack((w & 0xF, w >> 4), dim=-1).flatten(-2)  # checkpoint: low nibble = even k
    chunks = codes.view(3, 5, 2, 2, 32)  # [.., chunk, half, j]: k = 64*chunk + 32*half + j
    assert torch.equal(out.view(3, 5, 2, 32) & 0xF, chunks[..., 0, :])
    assert torch.equal(out.view(3, 5, 2, 32) >> 4, chunks[..., 1, :])


def test_repack_is_in_place(k):
    """The parameter object and its storage survive the repack: no second copy of the experts."""
    p = torch.nn.Parameter(dev(torch.randint(-128, 127, (4, 8, 64), dtype=torch.int8)), requires_grad=False)
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


DECODE = {"block_m": 16, "block_n": 32, "block_n2": 64, "num_warps": 4, "num_stages": 3}
PREFILL = {"block_m": 32, "block_n": 64, "block_n2": 128, "num_warps": 4, "num_stages": 3}


@pytest.mark.parametrize("seed,t,top_k,input_group,cfg", [
    (0, 5, 3, 0, DECODE), (4, 1, 2, 0, DECODE), (9, 19, 6, 0, PREFILL), (5, 6, 2, 64, PREFILL),
    (6, 3, 4, 32, DECODE)])
def test_kernel_equals_int8_emulation(k, seed, t, top_k, input_group, cfg):
    """Weight side exact: with scale groups 12 binades apart, the kernel equals the reference that
    rounds only the activations to INT8, at the same points (the intermediate per pair and block_n
    columns), up to fp32 accumulation order. Both tile configurations (decode, prefill).

    Accumulation order (and the GPU's exp in SiLU) can move an intermediate value across a rounding
    boundary of the INT8 re-quantization: one code step in one element, which shows as ~1e-3 on the
    token that holds it (measured on the H200: 2.0e-3 on one case of five). So: nearly every token
    exact, and at most one token in four off by no more than such a flip."""
    x, w13, s13, w2, s2, tw, ids = case(t=t, top_k=top_k, seed=seed)
    got = run_kernel(k, x, w13, s13, w2, s2, tw, ids, routed_scaling_factor=1.5, input_group=input_group,
                     config=cfg).float().cpu()
    want = ref.moe_int8_emulated(x, w13, s13, w2, s2, tw, ids, scaling=1.5, group=cfg["block_n"],
                                 input_group=input_group).float().cpu()
    per_token = (got - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-30)
    off = per_token > 1e-5
    assert int(off.sum()) <= max(1, t // 4) and float(per_token.max()) < 1e-2, per_token.tolist()


@pytest.mark.parametrize("rows,cols,group", [(3, 256, 0), (5, 256, 64), (1, 4096, 0), (4, 96, 32), (0, 128, 0)])
def test_fused_quantize_equals_the_reference_rounding(k, rows, cols, group):
    """The one-launch activation quantizer (fused_io) against the reference's INT8 round trip written from
    the math: the same q * s bit for bit (IEEE division in the kernel), zero rows and huge values included."""
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(cols + group)) * 3
    if rows > 1:
        x[1] = 0.0
        x[0, :5] = torch.tensor([1e30, -1e30, 65504.0, 1e-30, -0.0])
    x = x.to(torch.bfloat16)
    q, s = k.quantize_rows_int8_fused(dev(x), group)
    q, s = q.cpu(), s.cpu()
    assert q.dtype == torch.int8 and s.shape == (rows, cols // (group or cols))
    back = (q.float().view(rows, cols // (group or cols), group or cols) * s.unsqueeze(-1)).view(rows, cols)
    assert torch.equal(back, ref.int8_round_trip(x.float(), group or None))
    assert q.abs().max() <= 127 if rows else True
    if group:
        with pytest.raises(ValueError, match="not a whole number of groups"):
            k.quantize_rows_int8_fused(dev(torch.zeros(1, cols + group // 2, dtype=torch.bfloat16)), group)


@pytest.mark.parametrize("cfg", [DECODE, PREFILL])
def test_fused_io_moe_equals_the_torch_io(k, cfg):
    """fused_io (one-launch quantize, one-launch top-k sum x scaling x cast) gives the unfused result."""
    x, w13, s13, w2, s2, tw, ids = case(t=6, top_k=3, seed=31)
    a, b = k.repack_mxfp4_for_w4a8(dev(w13.clone())), k.repack_mxfp4_for_w4a8(dev(w2.clone()))
    args = dev(x, a, s13, b, s2, tw, ids)
    plain = k.w4a8_moe(*args, routed_scaling_factor=1.5, config=cfg).float().cpu()
    fused = k.w4a8_moe(*args, routed_scaling_factor=1.5, config=dict(cfg, fused_io=True))
    assert fused.dtype == x.dtype
    assert rel(fused.float().cpu(), plain) < 1e-2  # the same fp32 sums, rounded to BF16 once each
    # and against the reference written from the math, as test_kernel_equals_int8_emulation holds the unfused path
    want = ref.moe_int8_emulated(x, w13, s13, w2, s2, tw, ids, scaling=1.5, group=cfg["block_n"]).float()
    per_token = (fused.float().cpu() - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-30)
    assert float(per_token.max()) < 1e-2, per_token.tolist()
    into, plain_into = dev(torch.empty(x.shape, dtype=torch.float32)), dev(torch.empty(x.shape, dtype=torch.float32))
    k.w4a8_moe(*args, routed_scaling_factor=1.5, config=dict(cfg, fused_io=True), out=into)
    k.w4a8_moe(*args, routed_scaling_factor=1.5, config=cfg, out=plain_into)
    assert rel(into.cpu(), plain_into.cpu()) < 1e-6  # fp32 out: only the summation order may differ


def test_default_configs_are_valid(k):
    for pairs in (1, 64, 65, 4096, 4097, 100000):
        cfg = k.default_config(pairs)
        assert cfg["block_n"] % 32 == 0 and 512 % cfg["block_n"] == 0 and 4096 % cfg["block_n2"] == 0, cfg


def test_error_against_exact_is_bounded(k):
    """W4A8 against the float64 exact reference (what W4A16 Marlin approximates): the activation
    rounding, measured as ||err|| / ||ref|| with scale groups spread over 5 binades."""
    errs = []
    for seed in range(3):
        x, w13, s13, w2, s2, tw, ids = case(t=7, seed=10 + seed, exp_lo=120, exp_hi=125)
        got = run_kernel(k, x, w13, s13, w2, s2, tw, ids)
        want = ref.moe_exact(x, w13, s13, w2, s2, tw, ids)
        errs.append(float((got.double() - want).norm() / want.norm()))
    print(f"W4A8 vs exact, relative error per case: {['%.2e' % e for e in errs]}")
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
    assert rel(got, ref.moe_int8_emulated(x, w13, s13, w2, s2, tw, ids)) < 2e-3
    unclamped = ref.moe_int8_emulated(x, w13, s13, w2, s2, tw, ids, limit=0.0)
    assert rel(got, unclamped) > 0.05


def test_bad_shapes_refused(k):
    x, w13, s13, w2, s2, tw, ids = case(h=96)  # 96 is not a multiple of 64
    with pytest.raises(ValueError, match="multiples of 64"):
        k.w4a8_moe(x, w13, s13, w2, s2, tw, ids)



COMPILE = """
import json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from dsv4_sm80.kernels import w4a8_moe as k
from dsv4_sm80.kernels.w4a8_moe import _w4a8_moe_kernel as fn
SIG = {
    "a_ptr": "*i8", "a_scale_ptr": "*fp32", "b_ptr": "*u8", "bs_ptr": "*u8", "c_ptr": "*i8", "c_scale_ptr": "*fp32",
    "sorted_ids_ptr": "*i32", "block_expert_ptr": "*i32", "num_padded_ptr": "*i32", "topk_w_ptr": "*fp32",
    "N": "i32", "K": "i32", "num_pairs": "i32", "a_row_div": "i32", "a_scale_groups": "i32", "limit": "fp32",
    "stride_am": "i32", "stride_be": "i32", "stride_bn": "i32", "stride_bse": "i32", "stride_bsn": "i32",
    "stride_cm": "i32", "c_scale_groups": "i32", "GATED": "constexpr", "MUL_WEIGHT": "constexpr",
    "A_GROUP": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "SPAN": "constexpr",
    "DECODE_ASM": "constexpr",
}
out = {}
for name, cfg in CONFIGS.items():
    for gated in (True, False):
        a_group = 0 if gated else cfg["block_n"]
        for span in sorted({32, 128 if gated else cfg["block_n"]}):
            for asm in (True, False):
                sig = dict(SIG, c_ptr="*i8" if gated else "*fp32")
                consts = {"GATED": gated, "MUL_WEIGHT": not gated, "A_GROUP": a_group, "BLOCK_M": cfg["block_m"],
                          "BLOCK_N": cfg["block_n"] if gated else cfg["block_n2"], "SPAN": span, "DECODE_ASM": asm}
                ptx = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts),
                                     target=GPUTarget("cuda", 80, 32),
                                     options={"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}).asm["ptx"]
                out[f"{name}-{'gate_up' if gated else 'down'}-span{span}-{'asm' if asm else 'alu'}"] = {
                    "sm80": ".target sm_80" in ptx,
                    "int8_mma": bool(re.search(r"mma[.]sync[.]aligned[.]\\S+[.]s32[.]s8[.]s8[.]s32", ptx)),
                    "prmt": "0xF4F8FAFC" in ptx,  # the negative table of the inline decoder
                    "fp8": "e4m3" in ptx or "e5m2" in ptx}
io = {}  # the fused_io kernels: plain sm_80 code, IEEE division in the quantizer
for fn, sig, consts in (
        (k._quantize_rows_kernel, {"x_ptr": "*bf16", "stride_x": "i32", "q_ptr": "*i8", "s_ptr": "*fp32", "cols": "i32",
                                   "groups": "i32", "GCOLS": "constexpr", "BLOCK": "constexpr"},
         {"GCOLS": 4096, "BLOCK": 4096}),
        (k._sum_pairs_kernel, {"y_ptr": "*fp32", "out_ptr": "*bf16", "h": "i32", "scale": "fp32",
                               "TOP_K": "constexpr", "BLOCK": "constexpr"}, {"TOP_K": 6, "BLOCK": 1024})):
    ptx = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 80, 32),
                         options={"num_warps": 8}).asm["ptx"]
    io[fn.__name__] = {"sm80": ".target sm_80" in ptx, "fp8": "e4m3" in ptx or "e5m2" in ptx,
                       "div_rn": "div.rn.f32" in ptx}
print(json.dumps({"gemm": out, "io": io}))
"""


def test_compiles_for_sm80_with_int8_mma():
    """Both kernels, both tile configurations, per-group and int32-merged spans, PRMT and ALU code
    decoding, compiled for sm_80 without a GPU (in a process where Triton's interpreter is off): INT8
    tensor-core MMA, the PRMT table lookup where selected, no FP8 type anywhere."""
    from conftest import last_json, run_python

    code = COMPILE.replace("CONFIGS", repr({"decode": DECODE, "prefill": PREFILL}))
    res = last_json(run_python(code, TRITON_INTERPRET="0"))
    out = res["gemm"]
    assert len(out) == 14  # decode down has only span 32 (block_n 32)
    for name, r in out.items():
        assert r == {"sm80": True, "int8_mma": True, "prmt": name.endswith("-asm"), "fp8": False}, (name, r)
    assert res["io"]["_quantize_rows_kernel"] == {"sm80": True, "fp8": False, "div_rn": True}, res["io"]
    assert res["io"]["_sum_pairs_kernel"]["sm80"] and not res["io"]["_sum_pairs_kernel"]["fp8"], res["io"]


E2M1X2 = [0, 1, 2, 3, 4, 6, 8, 12]


def _prmt(a, b, c):
    """PTX prmt.b32 (default mode): byte i of the result = byte (selector nibble i) of {b, a}."""
    src, out = (b << 32) | a, 0
    for i in range(4):
        sel = (c >> (4 * i)) & 0xF
        assert sel < 8  # the sign-replicate mode is never used
        out |= ((src >> (8 * sel)) & 0xFF) << (8 * i)
    return out


def _swar_nibbles(x):
    """kernels/w4a8_moe.py _SWAR_NIBBLE, instruction by instruction, on one 32-bit register."""
    m = x & 0x07070707
    t = (m >> 4) | m
    sel = _prmt(t, 0, 0x4420)
    pos = _prmt(0x03020100, 0x0C080604, sel)
    neg = _prmt(0xFDFEFF00, 0xF4F8FAFC, sel)
    sg = ((x & 0x08080808) >> 3) * 255
    return ((pos & ~sg) | (neg & sg)) & 0xFFFFFFFF


def test_swar_decode_algorithm():
    """The PTX decoder's algorithm (four codes per register, two table lookups, a sign blend), emulated
    on every byte value in every position, against the E2M1 table. The kernel's PTX text is checked to
    be these instructions with these constants; a GPU run checks the compiled kernel against the
    reference."""
    from dsv4_sm80.kernels import w4a8_moe as mod

    for const in ("0x07070707", "0x08080808", "0x4420", "0x03020100", "0x0C080604", "0xFDFEFF00", "0xF4F8FAFC"):
        assert const in mod._DECODE_ASM, const
    want = lambda c: (-E2M1X2[c & 7] if c & 8 else E2M1X2[c & 7]) & 0xFF  # noqa: E731
    g = torch.Generator().manual_seed(0)
    words = torch.randint(0, 256, (4096, 4), generator=g).tolist() + [[b, (b + 1) % 256, 255 - b, b ^ 0x88] for b in range(256)]
    for bs in words:
        w = sum(b << (8 * i) for i, b in enumerate(bs))
        lo, hi = _swar_nibbles(w), _swar_nibbles(w >> 4)
        assert [(lo >> (8 * i)) & 0xFF for i in range(4)] == [want(b & 0xF) for b in bs], bs
        assert [(hi >> (8 * i)) & 0xFF for i in range(4)] == [want(b >> 4) for b in bs], bs


def test_span_merge_exact_up_to_13_binades_and_bounded_beyond(k):
    """Scale groups merged over a 128-deep span in int32 are exact while a span's exponents stay within
    13 binades (the tests above use 12); beyond, a group more than 13 below the span's largest is
    dropped (each of its products is below 2^-13 of the largest group's scale), a perturbation the INT8
    re-quantization of the intermediate can turn into a rounding flip: bounded, measured here with
    exponents drawn over 30 binades (real checkpoints: a few binades per 128 columns)."""
    x, w13, s13, w2, s2, tw, ids = case(t=4, seed=41, exp_lo=100, exp_hi=131)  # spreads up to 30 binades
    merged = run_kernel(k, x, w13, s13, w2, s2, tw, ids, config=dict(PREFILL, merge=True))
    per_group = run_kernel(k, x, w13, s13, w2, s2, tw, ids, config=dict(PREFILL, merge=False))
    err = rel(merged, per_group)
    print(f"span merge with exponent spreads up to 30 binades: max relative difference {err:.1e}")
    assert 0 < err < 1e-2
    x, w13, s13, w2, s2, tw, ids = case(t=4, seed=42, exp_lo=118, exp_hi=132)  # spreads up to 13
    merged = run_kernel(k, x, w13, s13, w2, s2, tw, ids, config=dict(PREFILL, merge=True))
    per_group = run_kernel(k, x, w13, s13, w2, s2, tw, ids, config=dict(PREFILL, merge=False))
    assert rel(merged, per_group) < 1e-6
