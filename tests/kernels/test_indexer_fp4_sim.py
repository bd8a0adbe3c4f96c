"""The model's FP4 indexer simulation (SGLANG_DSV4_A100_INDEXER_ROUNDING=fp4_sim): the float64 reference
(dsv4_sm80/kernels/block_rounding_ref.py) against hand-computed blocks; the INT8-code kernels of
dsv4_sm80/kernels/indexer_int8.py against it in the interpreter (quantizers bit-exact, logits to fp32
accumulation); and SGLang's own indexer functions, patched, routing through them with the option on."""

import os

import pytest
import torch
import triton
import triton.language as tl

from conftest import REPO, dev, last_json, run_python
from dsv4_sm80.kernels import block_rounding_ref as br
from dsv4_sm80.kernels import kv_store_ref as ref
from dsv4_sm80.kernels.block_rounding import fp4_codes


@triton.jit
def _apply_fp4_codes(x_ptr, e_ptr, o_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(o_ptr + i, fp4_codes(tl.load(x_ptr + i), tl.load(e_ptr + i)))


def block_of(*head, fill=0.0):
    return torch.tensor(list(head) + [fill] * (32 - len(head)), dtype=torch.float64)


# --- the reference against blocks computed by hand -----------------------------------------------------

def test_reference_scale_rule_saturation_and_ties():
    # amax 6: scale 2^0, every value on or between e2m1 points; ties go to the even code:
    # 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4
    v, codes, e = br.fp4_sim_ref(block_of(6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -5, -0.25, 2.4, 2.6))
    assert e.tolist() == [0]
    assert v[:12].tolist() == [6, 0, 1, 1, 2, 2, 4, 4, -4, -0.0, 2, 3]
    assert codes[:12].tolist() == [12, 0, 2, 2, 4, 4, 8, 8, -8, 0, 4, 6]
    # amax 6.5: scale 2^1 (6.5 / 6 > 1); 6.5 / 2 = 3.25 -> 3 -> 6: the block saturates at 6 * s at most
    # 1.0 / 2 = 0.5 is on the grid (code 1); 0.5 / 2 = 0.25 ties between 0 and 0.5: the even code, 0
    v, codes, e = br.fp4_sim_ref(block_of(6.5, 1.0, 0.5))
    assert e.tolist() == [1] and v[:3].tolist() == [6, 1, 0] and codes[:3].tolist() == [6, 1, 0]
    # amax 12: exactly 6 * 2^1 -> scale 2^1, 12 -> code 12
    v, codes, e = br.fp4_sim_ref(block_of(-12, 3))
    assert e.tolist() == [1] and v[:2].tolist() == [-12, 3] and codes[:2].tolist() == [-12, 3]  # 3 / 2 = 1.5 exact
    grid = br.e2m1_grid()
    assert br.round_to_grid(torch.tensor([6.0, 7.0, 100.0]).double().clamp(-6, 6), grid).tolist() == [6, 6, 6]


def test_reference_amax_floor_and_zero_block():
    v, codes, e = br.fp4_sim_ref(torch.zeros(32, dtype=torch.float64))
    assert e.tolist() == [-126] and (v == 0).all() and (codes == 0).all()
    tiny = 2.0 ** -127  # under the floor 6 * 2^-126: scale 2^-126; 2^-127 / 2^-126 = 0.5 -> code 1
    v, codes, e = br.fp4_sim_ref(block_of(tiny, 3 * tiny))
    assert e.tolist() == [-126] and codes[:2].tolist() == [1, 3] and v[:2].tolist() == [tiny, 3 * tiny]


def test_reference_blocks_many_binades_apart():
    x = torch.cat([torch.full((32,), 2.0 ** k) * torch.linspace(-1, 1, 32) for k in (-60, -3, 9, 70)])
    _, codes, e = br.fp4_sim_ref(x)
    assert e.tolist() == [-62, -5, 7, 68]  # amax 2^k: ceil(log2(2^k / 6)) = k - 2
    assert codes.abs().max() == 8 and (codes.view(4, 32) == codes.view(4, 32)[0]).all()  # same pattern, scaled
    back = br.fp4_dequant(codes, e)
    err = (back - x.double()).abs().view(4, 32)
    assert (err <= torch.ldexp(torch.ones(4, 1, dtype=torch.float64), e[:, None])).all()  # half the widest step


def test_dequant_of_codes_is_exact_in_bf16():
    """Each simulated value, code / 2 * 2^e, is a BF16 value: what the model's in-place quantizer leaves."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(8, 128, generator=g) * 2.0 ** torch.randint(-30, 30, (8, 4), generator=g).repeat_interleave(32, 1))
    v, codes, e = br.fp4_sim_ref(x.to(torch.bfloat16))
    assert torch.equal(v, br.fp4_dequant(codes, e))
    assert torch.equal(v.to(torch.bfloat16).double(), v)


# --- the kernels ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def idx():
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and TRITON_INTERPRET is not 1")
    from dsv4_sm80.kernels import indexer_int8

    return indexer_int8


def test_e2m1_helper_on_every_grid_point_and_midpoint(idx):
    grid = br.e2m1_grid()
    mids = (grid[1:] + grid[:-1]) / 2
    base = torch.cat([grid, mids, mids * (1 + 2 ** -20), mids * (1 - 2 ** -20), torch.tensor([6.5, 7.0, 1e3])])
    base = torch.cat([base, -base])
    x = torch.cat([base * 2.0 ** e for e in (-126, -1, 0, 60)]).float()
    e = torch.cat([torch.full_like(base, k, dtype=torch.int32) for k in (-126, -1, 0, 60)])
    n = triton.next_power_of_2(x.numel())
    xp, ep = torch.zeros(n), torch.zeros(n, dtype=torch.int32)
    xp[:x.numel()], ep[:e.numel()] = x, e
    out = dev(torch.empty(n))
    _apply_fp4_codes[(1,)](*dev(xp, ep), out, N=n)
    s = torch.ldexp(torch.ones(x.numel(), dtype=torch.float64), e.long())
    want = 2 * br.round_to_grid((x.double() / s).clamp(-6, 6), grid)
    assert torch.equal(out.cpu()[:x.numel()].double(), want)


def spread_keys(n, seed):
    """Index K rows (fp32) whose 32-blocks lie many binades apart, with exact ties after the BF16 rounding."""
    g = torch.Generator().manual_seed(seed)
    mags = 2.0 ** torch.randint(-40, 40, (n, 4), generator=g).float()
    x = torch.randn(n, 4, 32, generator=g) * mags[..., None]
    x[0, 0, :8] = torch.tensor([6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5])  # the ties of scale 2^0
    x[1, 1] = 0  # an all-zero block
    return x.view(n, 128)


def test_store_index_k_fp4_sim_bit_exact(idx):
    x = spread_keys(5, seed=1)
    loc = torch.tensor([0, 63, 64, -1, 130], dtype=torch.int32)
    cache = dev(torch.zeros(3, 64 * 132, dtype=torch.uint8))
    idx.store_index_k_int8(*dev(x, loc), cache, fp4_sim=True)
    cache = cache.cpu()
    keep = loc >= 0
    codes, exps = br.index_fp4_pages_read(cache, loc[keep].long())
    want_codes, want_exps = br.index_k_fp4_ref(x[keep])
    assert torch.equal(codes, want_codes) and torch.equal(exps.long(), want_exps)
    vals, _ = ref.index_pages_read(cache, torch.tensor([s for s in range(3 * 64) if s not in loc.tolist()]))
    assert (vals == 0).all()


@pytest.mark.parametrize("h", [64, 48])  # two programs of 32 heads; the second one part-masked
def test_q_rope_hadamard_fp4_sim(idx, h):
    """Codes and exponents equal the reference (the rotation in fp32 against float64 may put a BF16 rounding on
    the other side of a tie: none in these shapes, at most one code step if it happens)."""
    g = torch.Generator().manual_seed(2)
    t = 3
    q = (torch.randn(t, h, 128, generator=g) * 2.0 ** torch.randint(-20, 20, (t, h, 1), generator=g)).to(torch.bfloat16)
    w = torch.randn(t, h, generator=g).to(torch.bfloat16)
    f = torch.polar(torch.ones(50, 32), torch.rand(50, 32, generator=g) * 6.28)
    pos = torch.tensor([0, 17, 49])
    rows, wo = (x.cpu() for x in idx.q_rope_hadamard_int8(*dev(q, w), (128 * 64) ** -0.5, *dev(f, pos), fp4_sim=True))
    want_rows, want_w = br.q_indexer_fp4_ref(q, w, (128 * 64) ** -0.5, f, pos)
    assert rows.dtype == torch.int8 and rows.shape == (t, h, 132) and wo.shape == (t, h, 1)
    assert torch.equal(rows[..., 128:], want_rows[..., 128:])
    assert (rows[..., :128].int() - want_rows[..., :128].int()).abs().max() <= 2
    assert (rows != want_rows).float().mean() < 1e-3
    assert torch.allclose(wo, want_w, rtol=1e-6, atol=0)


@pytest.mark.parametrize("decode", [True, False], ids=["decode-plan", "prefill-plan"])
def test_compress_store_index_k_fp4_sim_follows_the_plan(idx, decode):
    g = torch.Generator().manual_seed(3)
    if decode:
        rows, out_loc, slots = [(8, 0), (9, 0), (4, 0), (13, 0)], [70, 71, 3, 99], [70, None, 3, None]
    else:
        rows, out_loc, slots = [(8, 5), (-1, 0), (4, 1), (12, 2)], [0, 9, 130, 0, 0, 64], [64, None, 9, 130]
    plan = torch.zeros(len(rows), 4, dtype=torch.int32)
    for i, (seq, ragged) in enumerate(rows):
        plan[i, 0], plan[i, 1] = seq, ragged
    kv = torch.randn(len(rows), 128, generator=g) * 3
    w = torch.rand(128, generator=g) + 0.5
    f = torch.polar(torch.ones(64, 32), torch.rand(64, 32, generator=g) * 6.28)
    cache = dev(torch.zeros(3, 64 * 132, dtype=torch.uint8))
    idx.compress_store_index_k_int8(*dev(kv, plan), decode, dev(torch.tensor(out_loc, dtype=torch.int64)),
                                    dev(w), 1e-6, dev(f), cache, fp4_sim=True)
    cache = cache.cpu()
    for r, slot in enumerate(slots):
        if slot is None:
            continue
        y = ref.k_norm_rope_ref(kv[r:r + 1], w, 1e-6, f, torch.tensor([rows[r][0] - 4]))
        _, want_codes, want_exps = br.fp4_sim_ref((y @ ref.hadamard128().T / 128 ** 0.5).to(torch.bfloat16))
        codes, exps = br.index_fp4_pages_read(cache, torch.tensor([slot]))
        assert torch.equal(exps.long(), want_exps), r
        assert (codes.int() - want_codes.int()).abs().max() <= 2 and (codes != want_codes).sum() <= 1, r
    written = [s for s in slots if s is not None]
    vals, _ = ref.index_pages_read(cache, torch.tensor([s for s in range(3 * 64) if s not in written]))
    assert (vals == 0).all()


@pytest.fixture(scope="module")
def fp4_pages():
    """Eight full pages of FP4-simulated keys (the reference's codes and exponents in the 132-byte layout), their
    blocks up to 12 binades apart; built once, read only."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(8 * 64, 4, 32, generator=g) * 2.0 ** torch.randint(-6, 6, (8 * 64, 4, 1), generator=g).float()
    codes, exps = br.index_k_fp4_ref(x.view(-1, 128))
    pages = torch.zeros(8, 64, 132, dtype=torch.int8)
    pages[:, :, :128] = codes.view(8, 64, 128)
    flat = pages.view(8, 64 * 132)
    flat[:, 64 * 128:] = exps.to(torch.int8).view(8, 64 * 4)
    return flat.view(torch.uint8).clone()


@pytest.mark.parametrize("lens,splits", [([130, 5, 0, 64], None), ([250, 129, 0, 64], 3), ([1, 192, 65, 3], 1)])
def test_logits_fp4_sim(idx, fp4_pages, lens, splits):
    """Per-block INT8 products, each scaled by its two powers of two, against the float64 dot of the dequantized
    values: equal up to the fp32 sums (4 blocks, 64 heads)."""
    g = torch.Generator().manual_seed(6)
    t, h = len(lens), 64
    q = torch.randn(t, h, 128, generator=g).to(torch.bfloat16)
    w = torch.randn(t, h, generator=g).to(torch.bfloat16)
    f = torch.polar(torch.ones(8, 32), torch.rand(8, 32, generator=g) * 6.28)
    q_rows, wo = br.q_indexer_fp4_ref(q, w, (128 * 64) ** -0.5, f, torch.arange(t))
    max_len = 256
    table = torch.stack([torch.randperm(8, generator=g)[:4] for _ in range(t)]).to(torch.int32)
    seq = torch.tensor(lens, dtype=torch.int32)
    out = idx.paged_mqa_logits_int8(*dev(q_rows.unsqueeze(1), fp4_pages, wo, seq.unsqueeze(-1), table), max_len,
                                    splits=splits, fp4_sim=True).cpu()
    want = br.logits_fp4_ref(q_rows, fp4_pages, wo, seq, table, max_len)
    for r, n in enumerate(lens):
        if n == 0:
            continue
        assert torch.allclose(out[r, :n].double(), want[r, :n], rtol=1e-5, atol=1e-6 * want[r, :n].abs().max()), r
        assert (out[r, n:((n + 63) // 64) * 64] == 0).all()


def test_logits_refuse_mixed_roundings(idx):
    q_int8 = dev(torch.zeros(2, 64, 128, dtype=torch.int8))
    cache = dev(torch.zeros(1, 64 * 132, dtype=torch.uint8))
    args = (cache, dev(torch.zeros(2, 64)), dev(torch.ones(2, dtype=torch.int32)),
            dev(torch.zeros(2, 1, dtype=torch.int32)), 64)
    with pytest.raises(ValueError, match=r"indexer logits \(fp4_sim\): found queries torch.int8 \(2, 64, 128\); "
                                         "expected int8 rows of 132"):
        idx.paged_mqa_logits_int8(q_int8, *args, fp4_sim=True)
    with pytest.raises(ValueError, match=r"indexer logits \(int8\)"):
        idx.paged_mqa_logits_int8(dev(torch.zeros(2, 64, 132, dtype=torch.int8)), *args)


# --- SGLang's own indexer functions, patched, with the option on -----------------------------------------

INDEXER = """
import json, sys, torch
sys.path.insert(0, {root!r})
import sglang.srt.layers.attention.dsv4.indexer as idx
import sglang.srt.layers.attention.dsv4.compressor_v2 as cmp
from sglang.jit_kernel.dsv4.compress import CompressorDecodePlan
from dsv4_sm80.kernels import block_rounding_ref as br
g = torch.Generator().manual_seed(8)
T, H = 3, 64
q = torch.randn(T, H, 128, generator=g).to(torch.bfloat16)
w = torch.randn(T, H, generator=g).to(torch.bfloat16)
f = torch.polar(torch.ones(300, 32), torch.rand(300, 32, generator=g) * 6.28)
pos = torch.tensor([3, 100, 299])
rows, wo = idx.fused_q_indexer_rope_hadamard_quant(q, w, 0.01, f, pos)
out = {{"q": [list(rows.shape), str(rows.dtype)], "q_rows": bool((rows == br.q_indexer_fp4_ref(q, w, 0.01, f, pos)[0])
       .float().mean() > 0.999)}}
# the indexer compressor's store (128-wide rows) from a decode plan: 4 requests, 3 complete a block of 4
plan_d = torch.zeros(4, 4, dtype=torch.int32)
plan_d[:, 0] = torch.tensor([8, 4, 7, 12])
cache = torch.zeros(2, 64 * 132, dtype=torch.uint8)
kv = torch.randn(4, 128, generator=g)
out_loc = torch.tensor([5, 64, 9, 70])
cmp.compress_norm_rope_store(kv, CompressorDecodePlan(4, plan_d.view(torch.uint8)), norm_weight=torch.ones(128),
                             norm_eps=1e-6, freq_cis=f, out_loc=out_loc, kvcache=cache, page_size=64)
codes, exps = br.index_fp4_pages_read(cache, torch.tensor([5, 64, 70, 9]))
out["stored"] = [bool((codes[i] != 0).any()) for i in range(4)]
out["exps_small"] = bool((exps[:3].abs() < 10).all())
table = torch.tensor([[0, 1]] * T, dtype=torch.int32)
lens = torch.tensor([[71], [65], [6]], dtype=torch.int32)
logits = idx.fp8_paged_mqa_logits_torch(rows.unsqueeze(1), cache.view(2, 64, 1, 132), wo.squeeze(2), lens, table,
                                        None, 128, False)
want = br.logits_fp4_ref(rows, cache, wo, lens, table, 128)
live = torch.arange(128)[None, :] < lens  # past a row's length the kernel leaves unvisited pages unwritten
out["logits"] = [list(logits.shape), bool(torch.allclose(logits.double()[live], want[live], rtol=1e-5,
                                                           atol=1e-6 * want.abs().max().item()))]
print(json.dumps(out))
"""


@pytest.mark.sglang
def test_real_sglang_indexer_routes_through_fp4_sim():
    """With the patch on and the option set: SGLang's indexer Q function returns 132-byte rows equal to the
    reference, its compressor store writes FP4 codes and exponents where the plan stores, and its paged-logits
    function scores them as the reference does."""
    root = os.path.dirname(REPO)
    out = last_json(run_python(INDEXER.format(root=root), ENABLE_SGLANG_DSV4_A100_PATCH="1", TRITON_INTERPRET="1",
                               SGLANG_DSV4_A100_INDEXER_ROUNDING="fp4_sim"))
    assert out["q"] == [[3, 64, 132], "torch.int8"] and out["q_rows"], out
    assert out["stored"] == [True, True, True, False] and out["exps_small"], out
    assert out["logits"] == [[3, 128], True], out


COMPILE = """
import json, sys
from dsv4_sm80.kernels import indexer_int8 as ix
sys.path.insert(0, "bench")
import sass_census as sc
build = sc.sm80_build
out = {
  "q fp4_sim": build(ix._q_rope_hadamard_int8_kernel, {"q_ptr": "*bf16", "stride_qt": "i32", "stride_qh": "i32",
      "w_ptr": "*bf16", "stride_wt": "i32", "freqs_ptr": "*fp32", "pos_ptr": "*i64", "he_ptr": "*bf16",
      "ho_ptr": "*bf16", "qo_ptr": "*i8", "wo_ptr": "*fp32", "heads": "i32", "weight_scale": "fp32",
      "BLOCK_H": "constexpr", "DOT_F32": "constexpr", "FP4_SIM": "constexpr"},
      {"BLOCK_H": 32, "DOT_F32": False, "FP4_SIM": True}),
  "compress fp4_sim": build(ix._compress_store_index_k_kernel, {"kv_ptr": "*fp32", "plan_ptr": "*i32",
      "n_rows": "i32", "out_loc_ptr": "*i64", "w_ptr": "*fp32", "eps": "fp32", "freqs_ptr": "*fp32", "he_ptr": "*bf16",
      "ho_ptr": "*bf16", "cache_ptr": "*i8", "cache_f32_ptr": "*fp32", "IS_DECODE": "constexpr", "RATIO": "constexpr",
      "BLOCK_R": "constexpr", "DOT_F32": "constexpr", "FP4_SIM": "constexpr"},
      {"IS_DECODE": False, "RATIO": 4, "BLOCK_R": 16, "DOT_F32": False, "FP4_SIM": True}),
  "logits fp4_sim": build(ix._logits_fp4_sim_kernel, {"q_ptr": "*i8", "kv_ptr": "*i8", "w_ptr": "*fp32",
      "lens_ptr": "*i32", "pt_ptr": "*i32", "stride_pt": "i32", "out_ptr": "*fp32", "stride_out": "i32",
      "max_len": "i32", "splits": "i32", "HEADS": "constexpr"}, {"HEADS": 64}),
}
print(json.dumps(out))
"""


def test_compile_for_sm80():
    """The fp4_sim kernels build for sm_80 with no FP8/FP4 type, no local-memory spill, the Hadamard on BF16
    tensor cores and the logits on INT8 ones (mma.sync m16n8k32)."""
    out = last_json(run_python(COMPILE, TRITON_INTERPRET="0"))
    for name, r in out.items():
        assert r["sm80"] and not r["fp8"] and r["shared"] <= 163 * 1024 and r["spills"] == 0, (name, r)
    assert out["logits fp4_sim"]["int8_mma"], out
    assert out["q fp4_sim"]["bf16_mma"] and out["compress fp4_sim"]["bf16_mma"], out
