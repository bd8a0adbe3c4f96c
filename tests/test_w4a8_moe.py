"""The W4A8 MoE kernels (dsv4_sm80/kernels/w4a8_moe.py) in the Triton interpreter at tiny sizes,
against plain-PyTorch references written from the math (dsv4_sm80/kernels/w4a8_moe_ref.py)."""

import json
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


# the MMA kernel's tiles (default_config takes gemv from 2 to 32 tokens; these name the MMA kernel at any size)
DECODE = {"block_m": 16, "block_n": 32, "block_n2": 64, "num_warps": 4, "num_stages": 3, "gemv": False}
DECODE2 = {"block_m": 16, "block_n": 32, "block_n2": 128, "num_warps": 2, "num_stages": 4, "gemv": False}  # 33-64
PREFILL = {"block_m": 32, "block_n": 64, "block_n2": 128, "num_warps": 4, "num_stages": 3, "gemv": False}


@pytest.mark.parametrize("seed,t,top_k,input_group,cfg", [
    (0, 5, 3, 0, DECODE), (4, 1, 2, 0, DECODE), (9, 19, 6, 0, PREFILL), (5, 6, 2, 64, PREFILL),
    (6, 3, 4, 32, DECODE), (7, 9, 6, 0, DECODE2), (8, 2, 6, 0, dict(DECODE, split_k=2))])
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


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("rows,cols,group", [(3, 256, 0), (5, 256, 64), (1, 4096, 0), (4, 96, 32), (0, 128, 0),
                                             (7, 128, 0)])
def test_quantizers_equal_the_reference_rounding(k, rows, cols, group, fused):
    """Both activation quantizers (the one-launch kernel of fused_io, the torch one of the prefill tiles)
    against the reference's INT8 round trip written from the math: the same q * s bit for bit (IEEE division
    in both), zero rows and huge values included. (7, 128, 0) is the row set whose scale came out one ulp off
    on the H200 when the torch quantizer divided by the Python scalar 127 (CUDA multiplies by its reciprocal)
    and so flipped a code: session 14, test_bf16_pair_outputs_stay_within_their_rounding's case."""
    if (rows, cols) == (7, 128):
        x = case(t=7, top_k=3, seed=37)[0].float()
    else:
        x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(cols + group)) * 3
    if rows > 1 and cols != 128:
        x[1] = 0.0
        x[0, :5] = torch.tensor([1e30, -1e30, 65504.0, 1e-30, -0.0])
    x = x.to(torch.bfloat16)
    q, s = (k.quantize_rows_int8_fused if fused else k.quantize_rows_int8)(dev(x), group)
    q, s = q.cpu(), s.cpu()
    assert q.dtype == torch.int8 and s.shape == (rows, cols // (group or cols))
    back = (q.float().view(rows, cols // (group or cols), group or cols) * s.unsqueeze(-1)).view(rows, cols)
    assert torch.equal(back, ref.int8_round_trip(x.float(), group or None))
    assert q.abs().max() <= 127 if rows else True
    if group:
        with pytest.raises(ValueError, match="not a whole number of groups"):
            (k.quantize_rows_int8_fused if fused else k.quantize_rows_int8)(dev(torch.zeros(1, cols + group // 2, dtype=torch.bfloat16)), group)


@pytest.mark.parametrize("cfg", [DECODE, PREFILL])
def test_fused_io_moe_equals_the_torch_io(k, cfg):
    """fused_io (one-launch quantize, one-launch top-k sum x scaling x cast) gives the unfused result."""
    x, w13, s13, w2, s2, tw, ids = case(t=6, top_k=3, e=4, seed=31)
    a, b = k.repack_mxfp4_for_w4a8(dev(w13.clone())), k.repack_mxfp4_for_w4a8(dev(w2.clone()))
    args = dev(x, a, s13, b, s2, tw, ids)
    plain = k.w4a8_moe(*args, routed_scaling_factor=1.5, config=dict(cfg, fused_io=False)).float().cpu()
    fused = k.w4a8_moe(*args, routed_scaling_factor=1.5, config=dict(cfg, fused_io=True))
    assert fused.dtype == x.dtype
    assert rel(fused.float().cpu(), plain) < 1e-2  # the same fp32 sums, rounded to BF16 once each
    # and against the reference written from the math, as test_kernel_equals_int8_emulation holds the unfused path
    want = ref.moe_int8_emulated(x, w13, s13, w2, s2, tw, ids, scaling=1.5, group=cfg["block_n"]).float()
    per_token = (fused.float().cpu() - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-30)
    assert float(per_token.max()) < 1e-2, per_token.tolist()
    into, plain_into = dev(torch.empty(x.shape, dtype=torch.float32)), dev(torch.empty(x.shape, dtype=torch.float32))
    k.w4a8_moe(*args, routed_scaling_factor=1.5, config=dict(cfg, fused_io=True), out=into)
    k.w4a8_moe(*args, routed_scaling_factor=1.5, config=dict(cfg, fused_io=False), out=plain_into)
    assert rel(into.cpu(), plain_into.cpu()) < 1e-6  # fp32 out: only the summation order may differ


@pytest.mark.parametrize("fused", [False, True])
def test_bf16_pair_outputs_stay_within_their_rounding(k, fused):
    """pair_bf16 keeps each (token, expert) output in BF16 before the top-k sum: within a BF16 rounding of the
    fp32-pair result, and held to the reference written from the math as the fp32 path is."""
    x, w13, s13, w2, s2, tw, ids = case(t=7, top_k=3, seed=37)
    a, b = k.repack_mxfp4_for_w4a8(dev(w13.clone())), k.repack_mxfp4_for_w4a8(dev(w2.clone()))
    args = dev(x, a, s13, b, s2, tw, ids)
    for cfg in (DECODE, PREFILL):
        base = dict(cfg, fused_io=fused)
        out32 = dev(torch.empty(x.shape, dtype=torch.float32))
        out16 = dev(torch.empty(x.shape, dtype=torch.float32))
        k.w4a8_moe(*args, routed_scaling_factor=1.5, config=base, out=out32)
        k.w4a8_moe(*args, routed_scaling_factor=1.5, config=dict(base, pair_bf16=True), out=out16)
        per_token = (out16.cpu() - out32.cpu()).norm(dim=-1) / out32.cpu().norm(dim=-1).clamp_min(1e-30)
        assert float(per_token.max()) < 4e-3 and float(per_token.max()) > 0, per_token.tolist()  # 2^-9 per pair
        want = ref.moe_int8_emulated(x, w13, s13, w2, s2, tw, ids, scaling=1.5, group=cfg["block_n"]).float()
        err = (out16.cpu() - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-30)
        assert float(err.max()) < 1e-2, err.tolist()


def test_split_k_equals_the_unsplit_kernel_and_is_deterministic(k):
    """Gate-up in 4 K shares (more programs at batch 1): the same output as one share up to fp32 summation
    order (and the rare INT8 re-quantization flip that order can cause, as in the emulation test), bit-equal
    from run to run (the shares are added in a fixed order, no atomics); a share count that does not divide
    K into 64-wide steps, or with span merging, is refused."""
    # 512 wide: two 64-wide K steps per share; 20 pairs: two row blocks of the finishing kernel, the second part-masked;
    # intermediate 64 (two 32-wide gate-up tiles: the interpreter's time is per program)
    x, w13, s13, w2, s2, tw, ids = case(t=5, top_k=4, h=512, inter=64, e=4, seed=41)
    one = run_kernel(k, x, w13, s13, w2, s2, tw, ids, config=dict(DECODE, split_k=1)).float().cpu()
    four = run_kernel(k, x, w13, s13, w2, s2, tw, ids, config=dict(DECODE, split_k=4)).float().cpu()
    again = run_kernel(k, x, w13, s13, w2, s2, tw, ids, config=dict(DECODE, split_k=4)).float().cpu()
    assert torch.equal(four, again)
    per_token = (four - one).norm(dim=-1) / one.norm(dim=-1).clamp_min(1e-30)
    assert int((per_token > 1e-5).sum()) <= 1 and float(per_token.max()) < 1e-2, per_token.tolist()
    for bad in (dict(DECODE, split_k=3), dict(DECODE, split_k=2, merge=True), dict(DECODE, split_k=0)):
        with pytest.raises(ValueError, match="split_k"):
            run_kernel(k, x, w13, s13, w2, s2, tw, ids, config=bad)


def test_default_configs_are_valid(k):
    for pairs in (1, 24, 25, 64, 384, 385, 3072, 3073, 4096, 4097, 7680, 7681, 49152, 49153, 100000):
        for expand_ok in (False, True):
            cfg = k.default_config(pairs, 512, expand_ok)
            assert cfg["block_n"] % 32 == 0 and 512 % cfg["block_n"] == 0 and 4096 % cfg["block_n2"] == 0, cfg
            # every size takes the one-launch quantizer and combine (decode: session 11; prefill: session 22); the
            # 16-row tile to 682 tokens at top-6 (session 22, 23), the 32-row tile to 1280 (session 23), per-pair
            # BF16 outputs above 512 tokens, the expanded path above 8192 tokens where the caller says every column is
            # shiftable
            assert cfg["fused_io"], (pairs, cfg)
            assert cfg["block_m"] == (16 if pairs <= 4096 else 32 if pairs <= 7680 else 64), (pairs, cfg)
            assert cfg.get("pair_bf16", False) == (pairs > 3072), (pairs, cfg)
            assert cfg.get("expand", False) == (expand_ok and pairs > 49152), (pairs, cfg)


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
from dsv4_sm80.kernels import w4a8_moe as k
from dsv4_sm80.kernels.w4a8_moe import _w4a8_moe_kernel as fn
SIG = {
    "a_ptr": "*i8", "a_scale_ptr": "*fp32", "b_ptr": "*u8", "bs_ptr": "*u8", "c_ptr": "*i8", "c_scale_ptr": "*fp32",
    "sorted_ids_ptr": "*i32", "block_expert_ptr": "*i32", "num_padded_ptr": "*i32", "topk_w_ptr": "*fp32",
    "eref_ptr": "*u8", "N": "i32", "K": "i32", "num_pairs": "i32", "a_row_div": "i32", "a_scale_groups": "i32",
    "limit": "fp32", "stride_am": "i32", "stride_be": "i32", "stride_bn": "i32", "stride_bse": "i32",
    "stride_bsn": "i32", "stride_cm": "i32", "c_scale_groups": "i32", "stride_ere": "i32",
    "GATED": "constexpr", "MUL_WEIGHT": "constexpr", "A_GROUP": "constexpr", "BLOCK_M": "constexpr",
    "BLOCK_N": "constexpr", "SPAN": "constexpr", "DECODE_ASM": "constexpr", "SHIFT": "constexpr", "SPLIT_K": "constexpr",
    "PAIR_BLOCKS": "constexpr", "UNROLL": "constexpr",
}


def asm_layouts(ttgir):  # the layouts of every inline-asm decoder's operands and results
    out = set()
    for line in ttgir.splitlines():
        if "tt.elementwise_inline_asm" in line:
            out |= set(re.findall(r"tensor<[^>]*?(#[^<]*<[^>]*>)", line.split('"')[-1]))
    return out


out = {}
for name, cfg in CONFIGS.items():
    for gated in (True, False):
        variants = [(span, asm, False) for span in sorted({32, 128 if gated else cfg["block_n"]})
                    for asm in (True, False)] + [(32, asm, True) for asm in (True, False)]
        for span, asm, shift in variants:
            # the shift path needs the down kernel's activation group a multiple of 64
            a_group = 0 if gated else (cfg["block_n"] if not shift else max(64, cfg["block_n"]))
            sig = dict(SIG, c_ptr="*i8" if gated else "*fp32")
            consts = {"GATED": gated, "MUL_WEIGHT": not gated, "A_GROUP": a_group, "BLOCK_M": cfg["block_m"],
                      "BLOCK_N": cfg["block_n"] if gated else cfg["block_n2"], "SPAN": span, "DECODE_ASM": asm,
                      "SHIFT": shift, "SPLIT_K": 1, "PAIR_BLOCKS": False, "UNROLL": 1}
            c = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 80, 32),
                               options={"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]})
            ptx = c.asm["ptx"]
            layouts = asm_layouts(c.asm["ttgir"])
            out[f"{name}-{'gate_up' if gated else 'down'}-{'shift' if shift else 'span%d' % span}-{'asm' if asm else 'alu'}"] = {
                "sm80": ".target sm_80" in ptx,
                "int8_mma": bool(re.search(r"mma[.]sync[.]aligned[.]\S+[.]s32[.]s8[.]s8[.]s32", ptx)),
                "prmt": "0xF4F8FAFC" in ptx,  # the negative table of the inline decoder
                "prmt_shift": "0x7F7F7F7F" in ptx,  # the shift decoder's sign mask
                # the decoders' words must be 4 consecutive k of one column: the INT8 MMA B operand layout
                "asm_in_mma_b_layout": bool(layouts) and all("dot_op<{opIdx = 1" in l for l in layouts),
                "fp8": "e4m3" in ptx or "e5m2" in ptx}
def extra(name, sig, consts):  # one more decode-tile build, its PTX checked as above
    c = triton.compile(ASTSource(fn=fn, signature=dict(SIG, **sig), constexprs=dict(
        {"MUL_WEIGHT": not consts["GATED"], "BLOCK_M": 16, "SPAN": 32, "DECODE_ASM": True, "SHIFT": False,
         "SPLIT_K": 1, "PAIR_BLOCKS": False, "UNROLL": 1}, **consts)),
        target=GPUTarget("cuda", 80, 32), options={"num_warps": 4, "num_stages": 3})
    ptx, layouts = c.asm["ptx"], asm_layouts(c.asm["ttgir"])
    out[name] = {
        "sm80": ".target sm_80" in ptx, "int8_mma": bool(re.search(r"mma[.]sync[.]aligned[.]\S+[.]s32[.]s8[.]s8[.]s32", ptx)),
        "prmt": "0xF4F8FAFC" in ptx, "prmt_shift": False,
        "asm_in_mma_b_layout": bool(layouts) and all("dot_op<{opIdx = 1" in l for l in layouts),
        "fp8": "e4m3" in ptx or "e5m2" in ptx}


# split-K gate-up at the decode tile (fp32 partials out; its finishing kernel is among the io kernels below)
extra("decode-gate_up-split4-asm", {"c_ptr": "*fp32"},
      {"GATED": True, "A_GROUP": 0, "BLOCK_N": 32, "SPLIT_K": 4})
# pair blocks (no alignment) with 4 K steps per iteration at the decode tile: gate-up and down; and the gate-up
# in 4 K shares as default_config runs it up to 4 tokens
extra("decode-gate_up-pairs-unroll4-asm", {"c_ptr": "*i8"},
      {"GATED": True, "A_GROUP": 0, "BLOCK_N": 32, "PAIR_BLOCKS": True, "UNROLL": 4})
extra("decode-down-pairs-unroll4-asm", {"c_ptr": "*fp32"},
      {"GATED": False, "A_GROUP": 32, "BLOCK_N": 64, "PAIR_BLOCKS": True, "UNROLL": 4})
extra("decode-gate_up-pairs-split4-asm", {"c_ptr": "*fp32"},
      {"GATED": True, "A_GROUP": 0, "BLOCK_N": 32, "SPLIT_K": 4, "PAIR_BLOCKS": True})
io = {}  # the fused_io kernels: plain sm_80 code, IEEE division in the quantizer
for fn, sig, consts in (
        (k._quantize_rows_kernel, {"x_ptr": "*bf16", "stride_x": "i32", "q_ptr": "*i8", "s_ptr": "*fp32", "cols": "i32",
                                   "groups": "i32", "GCOLS": "constexpr", "BLOCK": "constexpr"},
         {"GCOLS": 4096, "BLOCK": 4096}),
        (k._sum_pairs_kernel, {"y_ptr": "*fp32", "out_ptr": "*bf16", "h": "i32", "scale": "fp32",
                               "TOP_K": "constexpr", "BLOCK": "constexpr"}, {"TOP_K": 6, "BLOCK": 1024}),
        (k._glu_finish_kernel, {"part_ptr": "*fp32", "q_ptr": "*i8", "s_ptr": "*fp32", "pairs": "i32", "N": "i32",
                                "groups": "i32", "limit": "fp32", "SPLIT_K": "constexpr", "BLOCK_R": "constexpr",
                                "BLOCK_N": "constexpr"}, {"SPLIT_K": 4, "BLOCK_R": 16, "BLOCK_N": 32})):
    ptx = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 80, 32),
                         options={"num_warps": 8}).asm["ptx"]
    io[fn.__name__] = {"sm80": ".target sm_80" in ptx, "fp8": "e4m3" in ptx or "e5m2" in ptx,
                       "div_rn": "div.rn.f32" in ptx}
gemv = {}  # the CUDA-core pair-block kernel: gate-up in K shares (tile 128), gate-up with its GLU epilogue, down
gsig = {"a_ptr": "*i8", "a_scale_ptr": "*fp32", "b_ptr": "*u8", "bs_ptr": "*u8", "c_ptr": "*fp32",
        "c_scale_ptr": "*fp32", "expert_ptr": "*i32", "topk_w_ptr": "*fp32", "N": "i32", "K": "i32",
        "num_pairs": "i32", "a_row_div": "i32", "a_scale_groups": "i32", "limit": "fp32", "stride_am": "i32",
        "stride_be": "i32", "stride_bn": "i32", "stride_bse": "i32", "stride_bsn": "i32", "stride_cm": "i32",
        "c_scale_groups": "i32", "GATED": "constexpr", "MUL_WEIGHT": "constexpr", "A_GROUP": "constexpr",
        "BLOCK_N": "constexpr", "DECODE_ASM": "constexpr", "SPLIT_K": "constexpr", "PREFETCH": "constexpr"}
for name, c_ptr, consts, warps in (("gate_up-split4", "*fp32", {"GATED": True, "BLOCK_N": 128, "SPLIT_K": 4}, 4),
                                   ("gate_up-split8-prefetch2", "*fp32", {"GATED": True, "BLOCK_N": 128, "SPLIT_K": 8,
                                                                          "PREFETCH": 2}, 4),
                                   ("down-prefetch1", "*fp32", {"GATED": False, "MUL_WEIGHT": True, "A_GROUP": 32,
                                                                "BLOCK_N": 64, "PREFETCH": 1}, 2),
                                   ("gate_up-glu", "*i8", {"GATED": True, "BLOCK_N": 32, "SPLIT_K": 1}, 1),
                                   ("down", "*fp32", {"GATED": False, "MUL_WEIGHT": True, "A_GROUP": 32,
                                                      "BLOCK_N": 64, "SPLIT_K": 1}, 2)):
    consts = dict({"MUL_WEIGHT": False, "A_GROUP": 0, "DECODE_ASM": True, "SPLIT_K": 1, "PREFETCH": 0}, **consts)
    ptx = triton.compile(ASTSource(fn=k._w4a8_gemv_kernel, signature=dict(gsig, c_ptr=c_ptr), constexprs=consts),
                         target=GPUTarget("cuda", 80, 32), options={"num_warps": warps, "num_stages": 3}).asm["ptx"]
    gemv[name] = {"sm80": ".target sm_80" in ptx, "dp4a": "dp4a.s32.s32" in ptx, "prmt": "0xF4F8FAFC" in ptx,
                  "fp8": "e4m3" in ptx or "e5m2" in ptx}
expanded = {}  # config expand: the decode into the INT8 workspace (PRMT shift decoder) and the plain INT8 GEMMs
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
for name, c_ptr, consts, warps in (("gate_up-64x128x128", "*i8", {"GATED": True, "MUL_WEIGHT": False, "A_GROUP": 0,
                                                                   "BLOCK_M": 64, "BLOCK_K": 128}, 4),
                                   ("down-128x128x128", "*fp32", {"GATED": False, "MUL_WEIGHT": True, "A_GROUP": 128,
                                                                  "BLOCK_M": 128, "BLOCK_K": 128}, 8)):
    # the divisibility the real JIT derives (pointers, N, K, strides multiples of 16): what vectorized, pipelined
    # operand loads need
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(wsig)
             if wsig[p].startswith("*") or p in ("N", "K") or p.startswith("stride_")}
    c = triton.compile(ASTSource(fn=k._w8_moe_kernel, signature=dict(wsig, c_ptr=c_ptr),
                                 constexprs=dict(consts, BLOCK_N=128), attrs=attrs), target=GPUTarget("cuda", 80, 32),
                       options={"num_warps": warps, "num_stages": 3})
    ptx = c.asm["ptx"]
    expanded[name] = {"sm80": ".target sm_80" in ptx, "fp8": "e4m3" in ptx or "e5m2" in ptx,
                      "int8_mma": bool(re.search(r"mma[.]sync[.]aligned[.]\S+[.]s32[.]s8[.]s8[.]s32", ptx)),
                      "cp_async": "cp.async" in ptx}
print(json.dumps({"gemm": out, "io": io, "gemv": gemv, "expanded": expanded}))
"""


def test_compiles_for_sm80_with_int8_mma():
    """Both kernels, both tile configurations, per-group and int32-merged spans, the shift path (with its
    per-group fallback), PRMT and ALU code decoding, compiled for sm_80 without a GPU (in a process where
    Triton's interpreter is off): INT8 tensor-core MMA, the PRMT decoders where selected, running in the
    MMA B-operand layout (what their word layout assumes), no FP8 type anywhere; and the CUDA-core gemv kernel
    (split-K gate-up, with its loads prefetched 2 steps ahead, the GLU epilogue, the down launch plain and
    prefetched 1 step ahead) with DP4A and the PRMT decoder."""
    from conftest import last_json, run_python

    code = COMPILE.replace("CONFIGS", repr({"decode": DECODE, "decode2": DECODE2, "prefill": PREFILL}))
    res = last_json(run_python(code, TRITON_INTERPRET="0"))
    out = res["gemm"]
    assert len(out) == 36  # decode tiles' down has only span 32 (block_n 32); shift: 2 per kernel and config;
    # plus the split-K gate-up, the pair-block unrolled gate-up and down, the pair-block gate-up in 4 K shares
    # (the default at one token)
    for name, r in out.items():
        asm = name.endswith("-asm")
        assert r == {"sm80": True, "int8_mma": True, "prmt": asm, "prmt_shift": asm and "-shift-" in name,
                     "asm_in_mma_b_layout": asm, "fp8": False}, (name, r)
    assert res["io"]["_quantize_rows_kernel"] == {"sm80": True, "fp8": False, "div_rn": True}, res["io"]
    assert res["gemv"] == {n: {"sm80": True, "dp4a": True, "prmt": True, "fp8": False}
                           for n in ("gate_up-split4", "gate_up-split8-prefetch2", "down-prefetch1", "gate_up-glu",
                                     "down")}, res["gemv"]
    assert res["io"]["_sum_pairs_kernel"]["sm80"] and not res["io"]["_sum_pairs_kernel"]["fp8"], res["io"]
    assert res["io"]["_glu_finish_kernel"]["sm80"] and not res["io"]["_glu_finish_kernel"]["fp8"], res["io"]
    # the expanded path: the shift decoder into the workspace; GEMMs on INT8 MMA fed by asynchronous copies (pipelined)
    assert res["expanded"] == {"expand": {"sm80": True, "prmt_shift": True, "fp8": False},
                               **{n: {"sm80": True, "fp8": False, "int8_mma": True, "cp_async": True}
                                  for n in ("gate_up-64x128x128", "down-128x128x128")}}, res["expanded"]


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
    """kernels/w4a8_moe.py _DECODE_ASM, instruction by instruction, on one 32-bit word: (lo, hi)."""
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
    """_DECODE_SHIFT_ASM instruction by instruction: x the codes, mb the operand register (4 identical
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
    from dsv4_sm80.kernels import w4a8_moe as mod

    for const in ("0x77777777", "0x9D8C", "0xBFAE", "0x03020100", "0x0C080604", "0xFDFEFF00", "0xF4F8FAFC",
                  "0xD8", "shr.b32 selh, sel, 16", "shl.b32 sx, $2, 4"):
        assert const in mod._DECODE_ASM, const
    for const in ("0x77777777", "0x9D8C", "0xBFAE", "0x03020100", "0x0C080604", "0x7F7F7F7F",
                  "and.b32 m0, $3, 15", "bfe.u32 m1, $3, 4, 4", "mad.lo.u32 v, pos, m0, sg", "xor.b32 $0, v, sg"):
        assert const in mod._DECODE_SHIFT_ASM, const
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
        s.scatter_(2, grp[..., None], torch.where(cols, base[..., 0] + jump, s.gather(2, grp[..., None])[..., 0])[..., None])
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


DECODE64 = dict(DECODE, block_n=64)  # the down kernel's activation group a multiple of 64: shift there too


@pytest.mark.parametrize("spread,bad_every", [(3, 0), (4, 3), (3, 7)])  # all, none, some columns shiftable
@pytest.mark.parametrize("cfg,t,top_k,input_group", [(DECODE, 4, 3, 0), (DECODE64, 2, 2, 0), (PREFILL, 11, 6, 0),
                                                      (PREFILL, 6, 2, 64)])
def test_shift_path_equals_int8_emulation(k, spread, bad_every, cfg, t, top_k, input_group):
    """The shift path (int32 accumulation over K, one conversion per activation-scale change) against the
    reference written from the math, with the same tolerance rule as test_kernel_equals_int8_emulation:
    all columns shiftable (spread <= 3), none (a group 4..6 binades up in every 3rd column: every tile
    falls back), and mixed columns within a tile (every 7th: fallback for those tiles only)."""
    x, w13, s13, w2, s2, tw, ids = shift_case(spread, bad_every, t=t, top_k=top_k, seed=60 + t)
    got = run_shift(k, x, w13, s13, w2, s2, tw, ids, routed_scaling_factor=1.5, input_group=input_group,
                    config=dict(cfg, shift=True)).float()
    want = ref.moe_int8_emulated(x, w13, s13, w2, s2, tw, ids, scaling=1.5, group=cfg["block_n"],
                                 input_group=input_group).float()
    per_token = (got - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-30)
    off = per_token > 1e-5
    assert int(off.sum()) <= max(1, t // 4) and float(per_token.max()) < 1e-2, per_token.tolist()
    frac = float((k.shift_refs(s13) > 0).float().mean())
    assert (frac == 1.0) if not bad_every else (frac < 1.0)


def test_shift_only_is_the_shift_loop_and_an_unshiftable_column_is_loud(k):
    """config shift_only compiles the shift loop alone: with every column shiftable it is the shift path's result
    bit for bit; with a map that marks columns unshiftable (zeros; the per-tile fallback would take them) the
    output is NaN, not a number; asked where a launch has no shift path, it is refused by name."""
    cfg = dict(PREFILL, split_k=1, shift=True)
    x, w13, s13, w2, s2, tw, ids = shift_case(2, 0, t=5, top_k=2, seed=71)
    e13, e2 = k.shift_refs(s13), k.shift_refs(s2)
    shifted = run_shift(k, x, w13, s13, w2, s2, tw, ids, config=cfg)
    assert torch.equal(run_shift(k, x, w13, s13, w2, s2, tw, ids, config=dict(cfg, shift_only=True)), shifted)
    for zeros in ((torch.zeros_like(e13), e2), (e13, torch.zeros_like(e2))):
        got = run_shift(k, x, w13, s13, w2, s2, tw, ids, erefs=zeros, config=dict(cfg, shift_only=True))
        assert bool(torch.isnan(got).all()), got
    for bad in (dict(cfg, shift=False, shift_only=True), dict(cfg, block_n=32, shift_only=True)):
        with pytest.raises(ValueError, match="shift_only needs the shift path in both launches"):
            run_shift(k, x, w13, s13, w2, s2, tw, ids, config=bad)


EXPAND = dict(PREFILL, block_n=64, split_k=1, shift=True)  # block_n: the down launch's K step, a multiple of 64


@pytest.mark.parametrize("extra,t,top_k,input_group", [({}, 9, 3, 0), ({"expand_mb": 0}, 5, 2, 0),
                                                        ({"block_k": 64, "num_warps": 2}, 4, 2, 0), ({}, 4, 2, 64)])
def test_expanded_weights_equal_the_shift_loop_bit_for_bit(k, extra, t, top_k, input_group):
    """config expand (codes decoded once per call into an INT8 workspace, then plain INT8 GEMMs) computes the shift
    path's int32 sums and fp32 steps: with every column shiftable, the shift loop's result (shift_only) bit for bit,
    whether the workspace holds every expert or one at a time (expand_mb 0), whatever its K step."""
    x, w13, s13, w2, s2, tw, ids = shift_case(2, 0, t=t, top_k=top_k, seed=80 + t)
    kw = dict(routed_scaling_factor=1.5, input_group=input_group)
    want = run_shift(k, x, w13, s13, w2, s2, tw, ids, config=dict(EXPAND, shift_only=True), **kw)
    got = run_shift(k, x, w13, s13, w2, s2, tw, ids, config=dict(EXPAND, expand=True, **extra), **kw)
    assert torch.isfinite(want).all() and torch.equal(got, want)
    emulated = ref.moe_int8_emulated(x, w13, s13, w2, s2, tw, ids, scaling=1.5, group=64, input_group=input_group)
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
    k.expand_experts(packed, sb, erd, w8, ok, 2, e - 2, bool(w8.is_cuda and not k._INTERPRETED))
    w8, ok = w8.cpu(), ok.cpu()
    assert torch.equal(ok, er[2:]) and bool((er == 0).any())
    want = ref.dequant_mxfp4(w13, s13).double()[2:] * 2 / torch.exp2(er[2:].double() - 127)[..., None]
    good = er[2:] > 0
    assert torch.equal(w8.double()[good], want[good])


def test_expanded_weights_refuse_loudly(k):
    """An unshiftable column (the map's 0) or a map of other scales gives NaN through the expanded GEMMs, never a
    number; configurations the expanded path cannot run are refused by name."""
    x, w13, s13, w2, s2, tw, ids = shift_case(3, 7, t=5, top_k=2, seed=90)  # every 7th column unshiftable
    e13, e2 = k.shift_refs(s13), k.shift_refs(s2)
    cfg = dict(EXPAND, expand=True)
    got = run_shift(k, x, w13, s13, w2, s2, tw, ids, config=cfg)
    assert bool(torch.isnan(got).any())
    xa, w13a, s13a, w2a, s2a, twa, idsa = shift_case(2, 0, t=3, top_k=2, seed=91)
    e13a, e2a = k.shift_refs(s13a), k.shift_refs(s2a)
    for wrong in ((e13a + 1, e2a), (e13a, e2a + 1)):
        got = run_shift(k, xa, w13a, s13a, w2a, s2a, twa, idsa, erefs=wrong, config=cfg)
        assert bool(torch.isnan(got).all()), got
    for bad, why in ((dict(cfg, block_n=32), "block_n a multiple of 64"), (dict(cfg, split_k=2), "split_k 1"),
                     (dict(cfg, block_k=96), "block_k / input_group a multiple of 64"),
                     (dict(cfg, pair_blocks=True), "pair_blocks off")):
        with pytest.raises(ValueError, match=why):
            run_shift(k, xa, w13a, s13a, w2a, s2a, twa, idsa, config=bad)
    with pytest.raises(ValueError, match="both shift maps given"):
        run_kernel(k, xa, w13a, s13a, w2a, s2a, twa, idsa, config=cfg)


@pytest.mark.parametrize("cfg", [DECODE64, PREFILL])
def test_shift_path_is_taken_and_a_wrong_map_is_loud(k, cfg):
    """With every column shiftable, a map off by one binade (shifts -1..2) must give NaN, not a number:
    this shows the shift loop ran for those tiles (the per-group loop ignores the map) and that a map
    of other scales cannot pass silently. A map of zeros (nothing shiftable) gives the per-group result.
    (Unsplit throughout: the shift path runs the whole K in one program, and default_config splits the
    gate-up K of small batches in 4, another summation order.)"""
    cfg = dict(cfg, split_k=1)
    x, w13, s13, w2, s2, tw, ids = shift_case(2, 0, t=3, top_k=2, seed=70)
    e13, e2 = k.shift_refs(s13), k.shift_refs(s2)
    assert bool((e13 > 0).all()) and bool((e2 > 0).all())
    for wrong in ((e13 + 1, e2), (e13, e2 + 1)):
        got = run_shift(k, x, w13, s13, w2, s2, tw, ids, erefs=wrong, config=dict(cfg, shift=True))
        assert bool(torch.isnan(got).all()), got
    fallback = run_shift(k, x, w13, s13, w2, s2, tw, ids, erefs=(torch.zeros_like(e13), torch.zeros_like(e2)),
                         config=dict(cfg, shift=True))
    per_group = run_kernel(k, x, w13, s13, w2, s2, tw, ids, config=cfg)
    assert torch.equal(fallback, per_group)
    shifted = run_shift(k, x, w13, s13, w2, s2, tw, ids, config=dict(cfg, shift=True))
    off = run_shift(k, x, w13, s13, w2, s2, tw, ids, config=dict(cfg, shift=False))
    assert torch.equal(off, per_group) and rel(shifted, per_group) < 1e-2


CENSUS = r"""
import json, sys
sys.path.insert(0, "bench")
import sass_census as sc
out = {}
for name, shift in (("shift", True), ("per_group", False)):
    consts = {"GATED": True, "MUL_WEIGHT": False, "A_GROUP": 0, "BLOCK_M": 64, "BLOCK_N": 128, "SPAN": 32,
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


@pytest.mark.parametrize("cfg", [DECODE, PREFILL, dict(PREFILL, fused_io=False), dict(DECODE, fused_io=True),
                                 dict(DECODE, pair_blocks=True)])
def test_no_tokens_gives_an_empty_output(k, cfg):
    """An empty batch (a rank with no tokens this step) returns [0, H], with either activation quantizer (the
    torch one failed its 0-row view before session 14)."""
    x, w13, s13, w2, s2, tw, ids = case(t=3, top_k=3, seed=1)
    a, b = k.repack_mxfp4_for_w4a8(dev(w13.clone())), k.repack_mxfp4_for_w4a8(dev(w2.clone()))
    got = k.w4a8_moe(*dev(x[:0], a, s13, b, s2, tw[:0], ids[:0]), routed_scaling_factor=1.5, config=cfg)
    assert got.shape == (0, x.shape[1]) and got.dtype == x.dtype


@pytest.mark.parametrize("t,extra", [(1, {"fused_io": True}), (4, {"fused_io": False, "split_k": 2})])
def test_pair_blocks_equal_the_aligned_kernel_bit_for_bit(k, t, extra):
    """pair_blocks (no sorting by expert: each pair its own M block, for tiny decode batches) computes each pair
    with the same operations as the aligned launch, so the output is bit-equal to it, and held to the INT8
    emulation reference written from the math as the aligned kernel is; 4 tokens over 8 experts at top-3
    repeat experts across tokens (each pair reads its expert itself)."""
    x, w13, s13, w2, s2, tw, ids = case(t=t, top_k=3, h=256, seed=61 + t)
    if t > 1:
        assert len(set(ids.flatten().tolist())) < ids.numel()  # a repeated expert
    cfg = dict(DECODE, **extra)  # (default_config takes pair blocks up to 24 pairs: the aligned run says no)
    aligned = run_kernel(k, x, w13, s13, w2, s2, tw, ids, routed_scaling_factor=1.5, config=dict(cfg, pair_blocks=False))
    paired = run_kernel(k, x, w13, s13, w2, s2, tw, ids, routed_scaling_factor=1.5, config=dict(cfg, pair_blocks=True))
    assert torch.equal(paired, aligned)
    want = ref.moe_int8_emulated(x, w13, s13, w2, s2, tw, ids, scaling=1.5, group=cfg["block_n"]).float()
    per_token = (paired.float() - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-30)
    assert float(per_token.max()) < 1e-2, per_token.tolist()


def test_unrolled_k_steps_equal_the_plain_loop_bit_for_bit(k):
    """config unroll: several 64-deep K steps per loop iteration (more weight loads in flight), the same
    operations in the same order: bit-equal to unroll 1, also where K is not a multiple of the unrolled span
    (hidden 192 = 3 steps, unroll 2 and 4: the missing steps add nothing) and with split-K and pair blocks."""
    x, w13, s13, w2, s2, tw, ids = case(t=2, top_k=3, h=192, inter=64, seed=67)
    plain = run_kernel(k, x, w13, s13, w2, s2, tw, ids, routed_scaling_factor=1.5, config=DECODE)
    for extra in ({"unroll": 2}, {"unroll": 4, "pair_blocks": True, "fused_io": True}):
        got = run_kernel(k, x, w13, s13, w2, s2, tw, ids, routed_scaling_factor=1.5, config=dict(DECODE, **extra))
        assert torch.equal(got, plain), extra
    x, w13, s13, w2, s2, tw, ids = case(t=1, top_k=3, h=256, inter=64, seed=68)
    split = run_kernel(k, x, w13, s13, w2, s2, tw, ids, config=dict(DECODE, split_k=2))
    assert torch.equal(run_kernel(k, x, w13, s13, w2, s2, tw, ids, config=dict(DECODE, split_k=2, unroll=2)), split)
    with pytest.raises(ValueError, match="unroll"):
        run_kernel(k, x, w13, s13, w2, s2, tw, ids, config=dict(DECODE, unroll=2, merge=True, split_k=1))


def test_default_config_takes_gemv_from_2_to_32_tokens(k):
    """default_config at top-6 (session 19's H200 sweeps): the 16-row MMA tile with pair blocks at one token, gemv
    (pair blocks, gate-up K in 8 shares) from 2 to 32 tokens at TP4's intermediate (512 per rank; to 16 tokens
    at a wider one), the aligned MMA tiles beyond; w4a8_moe
    lets an MMA-loop option asked for (merge, shift, unroll, aligned blocks) override the default's gemv,
    as it does its split-K; asked for together with gemv, they are refused. The default's output at 4 tokens equals
    the gemv config's and holds to the INT8 emulation reference written from the math."""
    kinds = {t: (k.default_config(6 * t).get("gemv", False), k.default_config(6 * t).get("pair_blocks", False))
             for t in (1, 2, 4, 16, 32, 33, 64)}
    assert kinds == {1: (False, True), 2: (True, True), 4: (True, True), 16: (True, True), 32: (True, True),
                     33: (False, False), 64: (False, False)}, kinds
    for pairs in (12, 192):  # session 20: the loads one K step ahead, the 128-wide down tile
        assert {n: k.default_config(pairs)[n] for n in ("split_k", "block_n2", "gemv_prefetch")} == {
            "split_k": 8, "block_n2": 128, "gemv_prefetch": 1}
    # at a wider intermediate (TP1 full width, 2048 per rank) the aligned MMA tile takes over above 16 tokens
    assert k.default_config(96, 2048)["gemv"] and not k.default_config(97, 2048).get("gemv", False)
    x, w13, s13, w2, s2, tw, ids = case(t=4, top_k=3, h=512, inter=64, seed=83)
    default = run_kernel(k, x, w13, s13, w2, s2, tw, ids, routed_scaling_factor=1.5)
    gemv = run_kernel(k, x, w13, s13, w2, s2, tw, ids, routed_scaling_factor=1.5,
                      config=dict(k.default_config(12), gemv=True))
    assert torch.equal(default, gemv)
    want = ref.moe_int8_emulated(x, w13, s13, w2, s2, tw, ids, scaling=1.5, group=32).float()
    err = (default.float() - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-30)
    assert float(err.max()) < 1e-2, err.tolist()
    mma = run_kernel(k, x, w13, s13, w2, s2, tw, ids, routed_scaling_factor=1.5, config={"unroll": 2})
    assert torch.equal(mma, run_kernel(k, x, w13, s13, w2, s2, tw, ids, routed_scaling_factor=1.5,
                                       config={"unroll": 2, "gemv": False}))
    with pytest.raises(ValueError, match="gemv"):
        run_kernel(k, x, w13, s13, w2, s2, tw, ids, config={"unroll": 2, "gemv": True})


def test_unknown_config_options_are_refused(k):
    """A config option w4a8_moe does not read (misspelt, or retired like session 18's `prefetch`) is refused by
    name, not ignored: a bench variant or test carrying it would otherwise run the default in its place; every key
    default_config sets and every bench variant uses is one it knows."""
    x, w13, s13, w2, s2, tw, ids = case(t=1, top_k=2, h=128, inter=64, seed=5)
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['prefetch'\]"):
        run_kernel(k, x, w13, s13, w2, s2, tw, ids, config={"prefetch": 1})
    for pairs in (6, 12, 300, 1000, 9000):
        assert set(k.default_config(pairs)) <= k.CONFIG_KEYS
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_moe_keys", os.path.join(os.path.dirname(__file__), "..",
                                                                               "bench", "moe.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    for name, cfg in bench.VARIANTS.items():
        assert set(cfg) - {"_eref0"} <= k.CONFIG_KEYS, name


def test_gemv_equals_the_pair_block_mma_bit_for_bit(k):
    """config gemv: each pair's one row on CUDA cores (the codes decoded once, multiplied by DP4A on the GPU,
    elementwise here) instead of the 16-row INT8 MMA tile: the same exact int32 group dots and the same fp32
    steps, so bit-equal to the pair-block MMA kernel (in the interpreter; compiled, within fp32 rounding: FMA
    contraction may differ): with split-K partials and with the in-kernel GLU epilogue
    (split 1), per-token and per-32 input scales, a 64-wide gate-up tile, BF16 pair outputs, hidden 192 (three K
    steps); held to the INT8 emulation reference written from the math; its loads prefetched 1 or 2 K steps ahead
    (gemv_prefetch, past the end of K too) bit-equal to the plain loop; refused without pair blocks."""
    # (each input-scale form on two of the four cases: per-token with split-K 4 and with BF16 pair outputs, per-32 with
    # split 1 and 2; the interpreter takes ~10 s per kernel run here)
    for t, h, extra, groups in ((1, 256, {"split_k": 4}, (0,)), (3, 192, {"split_k": 1}, (32,)),
                                (2, 256, {"split_k": 2, "block_n": 64}, (32,)),
                                (4, 256, {"split_k": 1, "pair_bf16": True, "block_n2": 128}, (0,))):
        x, w13, s13, w2, s2, tw, ids = case(t=t, top_k=3, h=h, inter=128, seed=80 + t)
        for group in groups:
            cfg = dict(DECODE, pair_blocks=True, fused_io=True, **extra)
            mma = run_kernel(k, x, w13, s13, w2, s2, tw, ids, routed_scaling_factor=1.5, input_group=group, config=cfg)
            gemv = run_kernel(k, x, w13, s13, w2, s2, tw, ids, routed_scaling_factor=1.5, input_group=group,
                              config=dict(cfg, gemv=True))
            if k._INTERPRETED:
                assert torch.equal(gemv, mma), (t, h, extra, group)
            else:  # compiled, the two kernels' fp32 scaling may contract into FMAs differently (an fp32 rounding, which
                # can flip a BF16 pair output's or the intermediate's INT8 rounding); a wrong decode would be O(1)
                rel = float((gemv.float() - mma.float()).norm() / mma.float().norm().clamp_min(1e-30))
                assert rel < 1e-3, (t, h, extra, group, rel)
        want = ref.moe_int8_emulated(x, w13, s13, w2, s2, tw, ids, scaling=1.5, group=cfg["block_n"],
                                     input_group=group).float()
        err = (gemv.float() - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-30)
        assert float(err.max()) < 1e-2, (t, extra, err.tolist())
    for t, h, extra in ((2, 192, {"split_k": 1}), (1, 256, {"split_k": 2})):  # gemv_prefetch: 3 steps, 2 shares of 2
        x, w13, s13, w2, s2, tw, ids = case(t=t, top_k=3, h=h, inter=128, seed=90 + t)
        cfg = dict(DECODE, pair_blocks=True, fused_io=True, gemv=True, **extra)
        plain = run_kernel(k, x, w13, s13, w2, s2, tw, ids, routed_scaling_factor=1.5, input_group=32, config=cfg)
        for pf in (1, 2):
            got = run_kernel(k, x, w13, s13, w2, s2, tw, ids, routed_scaling_factor=1.5, input_group=32,
                             config=dict(cfg, gemv_prefetch=pf))
            if k._INTERPRETED:
                assert torch.equal(got, plain), (t, h, pf)
            else:  # (FMA contraction may differ between the two loops' compiled code: an fp32 rounding)
                assert float((got.float() - plain.float()).norm() / plain.float().norm()) < 1e-3, (t, h, pf)
            want = ref.moe_int8_emulated(x, w13, s13, w2, s2, tw, ids, scaling=1.5, group=cfg["block_n"],
                                         input_group=32).float()
            err = (got.float() - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-30)
            assert float(err.max()) < 1e-2, (t, h, pf, err.tolist())
    with pytest.raises(ValueError, match="gemv_prefetch=3"):
        run_kernel(k, x, w13, s13, w2, s2, tw, ids, config=dict(cfg, gemv_prefetch=3))
    # a prefetch depth asked for where the MMA kernel runs would time or test the MMA kernel under gemv's name
    not_asked = {n: v for n, v in cfg.items() if n != "gemv"}  # gemv left to default_config (and merge asked)
    for mma in (dict(cfg, gemv=False), dict(not_asked, merge=True, split_k=1)):
        with pytest.raises(ValueError, match="gemv_prefetch=1 asked for, but this call runs the MMA kernel"):
            run_kernel(k, x, w13, s13, w2, s2, tw, ids, config=dict(mma, gemv_prefetch=1))
    run_kernel(k, x, w13, s13, w2, s2, tw, ids, config=dict(cfg, gemv=False, gemv_prefetch=0))  # 0: nothing asked
    with pytest.raises(ValueError, match="gemv"):
        run_kernel(k, x, w13, s13, w2, s2, tw, ids, config=dict(DECODE, gemv=True, pair_blocks=False))
    with pytest.raises(ValueError, match="gemv"):
        run_kernel(k, x, w13, s13, w2, s2, tw, ids, config=dict(DECODE, gemv=True, pair_blocks=True, unroll=2))


WIDE = {"wide": True, "wide_n": 16, "wide_n2": 16, "wide_warps": 8, "wide_warps2": 8}


def test_wide_equals_int8_emulation(k):
    """config wide (the one-token path: a gate-up program holds a pair's whole K for wide_n columns, a down program
    all of a token's pairs for wide_n2 output columns): held to the INT8 emulation reference written from the math,
    the intermediate rounded per wide_n columns; per-token and per-group input scales (32, 64); a hidden size whose
    K/64 chunks are not a power of two (192: the padded chunk reads valid memory and adds 0); 16- and 32-wide tiles;
    more than one token."""
    for t, h, inter, top_k, group, extra in ((1, 256, 128, 3, 0, {}), (1, 192, 128, 2, 32, {"wide_n2": 32}),
                                             (3, 256, 64, 3, 64, {"wide_n": 32}), (2, 128, 128, 4, 0,
                                                                                   {"wide_n": 32, "wide_n2": 64})):
        x, w13, s13, w2, s2, tw, ids = case(t=t, top_k=top_k, h=h, inter=inter, seed=120 + t + h)
        cfg = dict(WIDE, **extra)
        got = run_kernel(k, x, w13, s13, w2, s2, tw, ids, routed_scaling_factor=1.5, input_group=group,
                         config=cfg).float()
        want = ref.moe_int8_emulated(x, w13, s13, w2, s2, tw, ids, scaling=1.5, group=cfg["wide_n"],
                                     input_group=group).float()
        per_token = (got - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-30)
        assert float(per_token.max()) < 1e-2 and int((per_token > 1e-5).sum()) <= max(1, t // 4), \
            (t, h, group, extra, per_token.tolist())
        # the default path at the same rounding points (block_n = wide_n's group where it can be) agrees to fp32
        # rounding of the group sums (an INT8 rounding of the intermediate may flip: ~1e-3 on a token)
        if cfg["wide_n"] % 32 == 0:
            other = run_kernel(k, x, w13, s13, w2, s2, tw, ids, routed_scaling_factor=1.5, input_group=group,
                               config=dict(DECODE, block_n=cfg["wide_n"], pair_blocks=True, fused_io=True))
            assert float(((got - other.float()).norm(dim=-1) / other.float().norm(dim=-1)).max()) < 1e-2


def test_wide_quant_is_the_quantizer_launch_inside_the_gate_up(k):
    """wide_quant: each gate-up program rounds its token's row to INT8 itself, with the quantizer launch's operations:
    bit-equal to the quantizer launch, padded K included; refused with a per-group input scale."""
    for t, h in ((1, 256), (2, 192)):
        x, w13, s13, w2, s2, tw, ids = case(t=t, top_k=3, h=h, inter=64, seed=160 + t)
        on = run_kernel(k, x, w13, s13, w2, s2, tw, ids, config=dict(WIDE, wide_quant=True))
        off = run_kernel(k, x, w13, s13, w2, s2, tw, ids, config=WIDE)
        assert torch.equal(on, off), (t, h)
    with pytest.raises(ValueError, match="wide_quant"):
        run_kernel(k, x, w13, s13, w2, s2, tw, ids, input_group=32, config=dict(WIDE, wide_quant=True))


def test_one_token_defaults_to_wide_and_yields_to_other_kernels_options(k):
    """default_config at one token (up to 6 pairs): the wide path with the input's rounding inside the gate-up launch,
    32-column gate-up programs (the intermediate group 32 of every other decode config) and 16-column down programs
    (session 29's H200 bench). The default's output is that config's; a per-group input scale takes the quantizer
    launch instead (no refusal); an MMA tile or loop option asked for runs that kernel (bit-equal to asking wide off)."""
    cfg = k.default_config(6)
    assert {n: cfg[n] for n in ("wide", "wide_n", "wide_warps", "wide_n2", "wide_warps2", "wide_quant")} == {
        "wide": True, "wide_n": 32, "wide_warps": 16, "wide_n2": 16, "wide_warps2": 8, "wide_quant": True}
    assert not k.default_config(7).get("wide", False)
    x, w13, s13, w2, s2, tw, ids = case(t=1, top_k=3, h=256, inter=64, seed=170)
    wide = {n: v for n, v in cfg.items() if n in k.WIDE_OWN}
    default = run_kernel(k, x, w13, s13, w2, s2, tw, ids, routed_scaling_factor=1.5)
    assert torch.equal(default, run_kernel(k, x, w13, s13, w2, s2, tw, ids, routed_scaling_factor=1.5, config=wide))
    grouped = run_kernel(k, x, w13, s13, w2, s2, tw, ids, input_group=64)
    assert torch.equal(grouped, run_kernel(k, x, w13, s13, w2, s2, tw, ids, input_group=64,
                                           config=dict(wide, wide_quant=False)))
    mma = run_kernel(k, x, w13, s13, w2, s2, tw, ids, config=DECODE)
    assert torch.equal(mma, run_kernel(k, x, w13, s13, w2, s2, tw, ids, config=dict(DECODE, wide=False)))


def test_wide_routed_scaling_once_and_a_missing_expert_adds_nothing(k):
    """The routed scaling multiplies the sum once; a pair of expert -1 (no expert) contributes nothing: the output
    equals the reference with that pair's router weight 0."""
    x, w13, s13, w2, s2, tw, ids = case(t=2, top_k=3, h=128, inter=64, seed=140)
    one = run_kernel(k, x, w13, s13, w2, s2, tw, ids, routed_scaling_factor=1.0, config=WIDE).float()
    two = run_kernel(k, x, w13, s13, w2, s2, tw, ids, routed_scaling_factor=2.0, config=WIDE).float()
    assert torch.allclose(two, 2 * one, rtol=1e-6, atol=0)
    ids_gap, tw_gap = ids.clone(), tw.clone()
    ids_gap[1, 2] = -1
    tw_gap[1, 2] = 0.0
    got = run_kernel(k, x, w13, s13, w2, s2, tw, ids_gap, config=WIDE).float()
    ids_ref = ids_gap.clamp_min(0)
    want = ref.moe_int8_emulated(x, w13, s13, w2, s2, tw_gap, ids_ref, group=16).float()
    assert rel(got, want) < 1e-2, rel(got, want)


def test_wide_refuses_what_it_cannot_do(k):
    """Widths that do not tile the layer, and another kernel's options asked for beside wide, are refused loudly (left
    to the default, wide yields instead: test_one_token_defaults_to_wide_and_yields_to_other_kernels_options)."""
    x, w13, s13, w2, s2, tw, ids = case(t=1, top_k=2, h=128, inter=64, seed=150)
    for bad, match in (({"wide_n": 48}, "wide_n=48"), ({"wide_n2": 256}, "wide_n2=256"),
                       ({"split_k": 2}, "split_k"), ({"gemv": True}, "gemv")):
        with pytest.raises(ValueError, match=match):
            run_kernel(k, x, w13, s13, w2, s2, tw, ids, config=dict(WIDE, **bad))


WIDE_COMPILE = r"""
import json, os, re, subprocess, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from dsv4_sm80.kernels import w4a8_moe as k
common = {"b_ptr": "*u8", "bs_ptr": "*u8", "expert_ptr": "*i32", "N": "i32", "stride_be": "i32", "stride_bse": "i32",
          "stride_bsn": "i32", "K": "constexpr", "C": "constexpr", "A_GROUP": "constexpr", "BLOCK_N": "constexpr",
          "DECODE_ASM": "constexpr"}
up = dict(common, a_ptr="*i8", a_scale_ptr="*fp32", q_ptr="*i8", q_scale_ptr="*fp32", a_row_div="i32",
          a_scale_groups="i32", limit="fp32", stride_am="i32", stride_qm="i32", q_groups="i32", QUANT="constexpr",
          xq_ptr="*i8")
up_bf16 = dict(up, a_ptr="*bf16")
down = dict(common, h_ptr="*i8", h_scale_ptr="*fp32", out_ptr="*bf16", topk_w_ptr="*fp32", h_groups="i32",
            scale="fp32", stride_hm="i32", stride_om="i32", TOP_K="constexpr", TOP_K_P="constexpr")
# the divisibility the real JIT derives at TP4 shapes (pointers, and the integer arguments that are multiples of 16)
attrs = lambda sig: {(i,): [["tt.divisibility", 16]] for i, p in enumerate(sig)
                     if sig[p].startswith("*") or p.startswith("stride_") or p == "N"}
sigs = {"up": up, "up_bf16": up_bf16, "down": down}
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
WIDE_BUILDS = [  # TP4 per-rank shapes (hidden 4096, intermediate 512)
    ("gate_up-16x8w", "_wide_gate_up_kernel", "up",
     {"K": 4096, "C": 64, "A_GROUP": 0, "BLOCK_N": 16, "DECODE_ASM": True}, 8),
    ("gate_up-32x16w", "_wide_gate_up_kernel", "up",
     {"K": 4096, "C": 64, "A_GROUP": 0, "BLOCK_N": 32, "DECODE_ASM": True}, 16),
    ("gate_up-32x16w-quant", "_wide_gate_up_kernel", "up_bf16",  # the default's
     {"K": 4096, "C": 64, "A_GROUP": 0, "BLOCK_N": 32, "DECODE_ASM": True, "QUANT": True}, 16),
    ("gate_up-16x8w-quant", "_wide_gate_up_kernel", "up_bf16",
     {"K": 4096, "C": 64, "A_GROUP": 0, "BLOCK_N": 16, "DECODE_ASM": True, "QUANT": True}, 8),
    ("down-16x8w", "_wide_down_kernel", "down",  # the default's (the intermediate group 32)
     {"K": 512, "C": 8, "A_GROUP": 32, "BLOCK_N": 16, "DECODE_ASM": True, "TOP_K": 6, "TOP_K_P": 8}, 8),
    ("down-16x8w-group16", "_wide_down_kernel", "down",
     {"K": 512, "C": 8, "A_GROUP": 16, "BLOCK_N": 16, "DECODE_ASM": True, "TOP_K": 6, "TOP_K_P": 8}, 8),
    ("down-32x8w-group32", "_wide_down_kernel", "down",
     {"K": 512, "C": 8, "A_GROUP": 32, "BLOCK_N": 32, "DECODE_ASM": True, "TOP_K": 6, "TOP_K_P": 8}, 8),
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
