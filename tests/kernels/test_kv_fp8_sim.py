"""The model's FP8 KV simulation (SGLANG_DSV4_A100_KV_ROUNDING=fp8_sim): the float64 reference
(dsv4_sm80/kernels/block_rounding_ref.py) against hand-computed blocks and torch's own e4m3 cast; the Triton
helpers and the three KV writers (dsv4_sm80/kernels/kv_store.py) bit-exact against the reference in the
interpreter; and the attention stage routing every stored key row through them, in real SGLang."""

import math
import os

import pytest
import torch
import triton
import triton.language as tl

from conftest import REPO, dev, last_json, run_python
from dsv4_sm80.kernels import block_rounding_ref as br
from dsv4_sm80.kernels.block_rounding import fp8_sim


@triton.jit
def _apply_fp8_sim(x_ptr, e_ptr, o_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(o_ptr + i, fp8_sim(tl.load(x_ptr + i), tl.load(e_ptr + i)))


def bf16(values):
    return torch.tensor(values, dtype=torch.float32).to(torch.bfloat16)


def block_of(*head, fill=0.0):
    """A 64-value block: the given values first, then `fill`."""
    return torch.tensor(list(head) + [fill] * (64 - len(head)), dtype=torch.float64)


# --- the reference against blocks computed by hand -----------------------------------------------------

def test_reference_scale_rule_and_ties():
    # amax 448: scale 2^0. 17 is the midpoint of 16 and 18 (step 2 in [16, 32)): ties to 16 (even mantissa);
    # 19 is the midpoint of 18 and 20: ties to 20; 2^-7 sits on the subnormal grid (4 * 2^-9); 2^-11 is below
    # half the smallest subnormal 2^-9: 0
    v, e = br.fp8_sim_ref(block_of(448, 17, 19, 2 ** -7, 2 ** -11, -3 * 2 ** -10))
    assert e.tolist() == [0]
    assert v[:6].tolist() == [448, 16, 20, 2 ** -7, 0.0, -2 * 2 ** -9]  # -1.5 * 2^-9 ties to the even 2 * 2^-9
    # amax 449 (just above 448): scale 2^1; 449 / 2 = 224.5 rounds to 224 (step 16 in [128, 256)) -> 448
    v, e = br.fp8_sim_ref(block_of(449, 1.0))
    assert e.tolist() == [1] and v[:2].tolist() == [448, 1.0]
    # amax 0.75: 0.75 / 448 = 2^-9.22 -> scale 2^-9; 0.75 * 512 = 384 (on the grid)
    v, e = br.fp8_sim_ref(block_of(0.75, 0.1))
    assert e.tolist() == [-9]
    assert v[1].item() == 52 / 512  # 0.1 * 512 = 51.2 -> 52 (step 4 in [32, 64))


def test_reference_saturates_at_448():
    grid = br.e4m3_grid()
    assert grid.max().item() == 448 and grid.numel() == 127  # 0 .. 448, the code 0x7F (NaN) left out
    v = torch.tensor([448.0, 463.9, 464.0, 1e6, -1e6], dtype=torch.float64)
    assert br.round_to_grid(v.clamp(-448, 448), grid).tolist() == [448, 448, 448, 448, -448]


def test_reference_amax_floor():
    # every block value below 1e-4: the scale comes from the floor, 2^ceil(log2(1e-4 / 448)) = 2^-22
    v, e = br.fp8_sim_ref(block_of(1e-6, -3e-7))
    assert e.tolist() == [-22]
    assert v[0].item() == 4.0 * 2 ** -22  # 1e-6 * 2^22 = 4.19: step 0.5 in [4, 8) -> 4.0
    assert v[1].item() == -1.25 * 2 ** -22  # 0.126 * 2^22 ... = 1.258 -> 1.25 (step 0.125 in [1, 2))
    v, e = br.fp8_sim_ref(torch.zeros(64, dtype=torch.float64))
    assert e.tolist() == [-22] and (v == 0).all()


def test_reference_blocks_many_binades_apart_and_rope_untouched():
    g = torch.Generator().manual_seed(0)
    mags = [2.0 ** k for k in (-30, -12, -1, 0, 5, 17, 40)]  # the 7 nope blocks, 70 binades apart at most
    row = torch.cat([torch.randn(64, generator=g) * m for m in mags] + [torch.randn(64, generator=g) * 1e3])
    row = row.to(torch.bfloat16)[None]
    got = br.kv_fp8_sim_ref(row)
    _, e = br.fp8_sim_ref(row[:, :448])
    amax = row[0, :448].double().view(7, 64).abs().amax(-1)
    assert e[0].tolist() == [math.ceil(math.log2(max(a, 1e-4) / 448)) for a in amax.tolist()]
    assert e[0, 0].item() == -22  # the 2^-30 block sits under the amax floor
    assert torch.equal(got[:, 448:].view(torch.int16), row[:, 448:].view(torch.int16))  # rope: bit for bit
    for b in range(7):  # each block on its own e4m3 grid times its own scale
        scaled = got[0, 64 * b:64 * (b + 1)].double() / 2.0 ** e[0, b].item()
        assert torch.isin(scaled.abs(), br.e4m3_grid()).all()


def test_reference_matches_torch_e4m3_cast():
    """An independent implementation: torch's float8_e4m3fn cast (nearest, ties to even) of the clamped block."""
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(64, 448, generator=g) * torch.logspace(-20, 20, 64)[:, None]).to(torch.bfloat16)
    want, e = br.fp8_sim_ref(x)
    s = torch.ldexp(torch.ones(64, 7, dtype=torch.float64), e)[..., None]
    t = (x.double().view(64, 7, 64) / s).clamp(-448, 448).float().to(torch.float8_e4m3fn).double() * s
    assert torch.equal(t.view(64, 448), want)


# --- the Triton helpers and writers, bit-exact -----------------------------------------------------------

@pytest.fixture(scope="module")
def kern():
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and TRITON_INTERPRET is not 1")
    from dsv4_sm80.kernels import kv_store

    return kv_store


def test_e4m3_helper_on_every_grid_point_and_midpoint(kern):
    """block_rounding.fp8_sim with a given exponent, on every e4m3 value, every midpoint between neighbours,
    values just off the midpoints and values past 448, for three scales: equal to the reference grid rounding."""
    grid = br.e4m3_grid()
    mids = (grid[1:] + grid[:-1]) / 2
    base = torch.cat([grid, mids, mids * (1 + 2 ** -20), mids * (1 - 2 ** -20), torch.tensor([449.0, 470, 1e4])])
    base = torch.cat([base, -base])
    xs, es = [], []
    for e in (-9, 0, 13):
        xs.append(base * 2.0 ** e)
        es.append(torch.full_like(base, e, dtype=torch.int32))
    x, e = torch.cat(xs).float(), torch.cat(es)
    n = triton.next_power_of_2(x.numel())
    xp = torch.zeros(n)
    xp[:x.numel()] = x
    ep = torch.zeros(n, dtype=torch.int32)
    ep[:e.numel()] = e
    out = dev(torch.empty(n))
    _apply_fp8_sim[(1,)](*dev(xp, ep), out, N=n)
    s = torch.ldexp(torch.ones(x.numel(), dtype=torch.float64), e.long())
    want = br.round_to_grid((x.double() / s).clamp(-448, 448), grid) * s
    assert torch.equal(out.cpu()[:x.numel()].double(), want)


def spread_rows(n, seed):
    """BF16 key rows whose 64-blocks lie many binades apart, ties and small blocks included."""
    g = torch.Generator().manual_seed(seed)
    mags = 2.0 ** torch.randint(-40, 40, (n, 8), generator=g).double()
    rows = torch.randn(n, 8, 64, generator=g, dtype=torch.float64) * mags[..., None]
    rows[0, 1] = 0  # an all-zero block
    rows[1, 2] = 1e-6  # a block under the amax floor
    rows[2, 0, :4] = torch.tensor([448, 17, 19, -3 * 2 ** -10])  # ties on the grid of scale 2^0
    return rows.view(n, 512).to(torch.bfloat16)


def test_scatter_rows_fp8_sim_bit_exact(kern):
    rows = spread_rows(6, seed=2)
    loc = torch.tensor([3, -1, 0, 9, 4, 7], dtype=torch.int64)
    cache = dev(torch.full((12, 512), 5.0, dtype=torch.bfloat16))
    kern.scatter_rows(*dev(rows, loc), cache, fp8_sim=True)
    cache = cache.cpu()
    keep = loc >= 0
    want = br.kv_fp8_sim_ref(rows[keep])
    assert torch.equal(cache[loc[keep]].view(torch.int16), want.view(torch.int16))
    others = [s for s in range(12) if s not in loc.tolist()]
    assert (cache[others] == 5.0).all()
    with pytest.raises(ValueError, match="rounds 512-wide key rows"):
        kern.scatter_rows(dev(torch.zeros(2, 128, dtype=torch.bfloat16)), *dev(loc[:2], torch.zeros(4, 128)),
                          fp8_sim=True)


def test_k_norm_rope_store_fp8_sim_rounds_the_stored_bf16_row(kern):
    """With fp8_sim the store writes exactly the reference rounding of the row it writes without it (the model
    rounds its BF16 row, not the fp32 value)."""
    g = torch.Generator().manual_seed(3)
    n = 5
    kv = (torch.randn(n, 512, generator=g) * 2.0 ** torch.randint(-20, 20, (n, 1), generator=g)).to(torch.bfloat16)
    w = (torch.rand(512, generator=g) * 8).to(torch.bfloat16)
    f = torch.polar(torch.ones(64, 32), torch.rand(64, 32, generator=g) * 6.28)
    pos = torch.randint(0, 64, (n,), generator=g)
    loc = torch.tensor([3, -1, 0, 9, 4], dtype=torch.int32)

    def store(fp8_sim):
        cache = dev(torch.full((12, 512), 5.0, dtype=torch.bfloat16))
        kern.k_norm_rope_store(*dev(kv, w), 1e-6, *dev(f, pos, loc), cache, fp8_sim=fp8_sim)
        return cache.cpu()

    plain, rounded = store(False), store(True)
    keep = loc[loc >= 0].long()
    assert torch.equal(rounded[keep].view(torch.int16), br.kv_fp8_sim_ref(plain[keep]).view(torch.int16))
    assert not torch.equal(rounded[keep], plain[keep])
    others = [s for s in range(12) if s not in keep.tolist()]
    assert (rounded[others] == 5.0).all()


def plan_rows(rows):
    """16-byte plan rows as SGLang's planners write them: u32 seq_len, then (prefill) u16 ragged_id."""
    out = torch.zeros(len(rows), 4, dtype=torch.int32)
    for i, (seq, ragged) in enumerate(rows):
        out[i, 0], out[i, 1] = seq, ragged
    return out


@pytest.mark.parametrize("decode", [True, False], ids=["decode-plan", "prefill-plan"])
def test_round_planned_rows_rounds_exactly_the_planned_slots(kern, decode):
    if decode:  # one row per request: only seq % ratio == 0 stored, at out_loc[row]
        rows, out_loc, slots = [(8, 0), (9, 0), (4, 0), (13, 0)], [10, 11, 3, 9], [10, 3]
    else:  # one row per compress event at out_loc[ragged]; seq -1 pads
        rows, out_loc, slots = [(8, 5), (-1, 0), (4, 1), (12, 2)], [0, 9, 13, 0, 0, 6], [6, 9, 13]
    cache = spread_rows(16, seed=4)
    work = dev(cache.clone())
    kern.round_planned_rows_(work, dev(plan_rows(rows)), len(rows), decode,
                             dev(torch.tensor(out_loc, dtype=torch.int64)), ratio=4)
    work = work.cpu()
    assert torch.equal(work[slots].view(torch.int16), br.kv_fp8_sim_ref(cache[slots]).view(torch.int16))
    others = [s for s in range(16) if s not in slots]
    assert torch.equal(work[others].view(torch.int16), cache[others].view(torch.int16))


def test_rounding_is_idempotent(kern):
    """A row rounded twice is the row rounded once (a block whose amax rounds to 224 * s halves its scale on
    the second pass, and every value is still on the finer grid)."""
    rows = spread_rows(8, seed=5)
    once = br.kv_fp8_sim_ref(rows)
    assert torch.equal(br.kv_fp8_sim_ref(once), once)
    cache = dev(once.clone())
    kern.scatter_rows(cache.clone(), dev(torch.arange(8)), cache, fp8_sim=True)
    assert torch.equal(cache.cpu().view(torch.int16), once.view(torch.int16))


# --- the stage routes every stored row through them ------------------------------------------------------

def test_stage_stores_round_with_the_option(monkeypatch):
    """attention.py's SWA store, plain row store and compressed-row store: with fp8_sim the stored rows are the
    option-off rows rounded by the reference; other slots untouched; without it, nothing rounds."""
    from types import SimpleNamespace as NS

    from sglang.jit_kernel.dsv4.compress import CompressorDecodePlan

    from dsv4_sm80.stages import attention

    g = torch.Generator().manual_seed(6)
    n = 5
    kv = (torch.randn(n, 512, generator=g) * 3).to(torch.bfloat16)
    w = (torch.rand(512, generator=g) + 0.5).to(torch.bfloat16)
    f = torch.polar(torch.ones(64, 32), torch.rand(64, 32, generator=g) * 6.28)
    pos = torch.randint(0, 64, (n,), generator=g)
    loc = torch.tensor([4, -1, 0, 9, 2], dtype=torch.int64)

    def option(value):
        monkeypatch.setenv("SGLANG_DSV4_A100_KV_ROUNDING", value)
        attention.kv_fp8_sim.cache_clear()

    def swa_store(value):
        option(value)
        pool = NS(swa_kv_pool=NS(kv_buffer=[dev(torch.zeros(2, 8 * 512, dtype=torch.bfloat16))]),
                  _swa_local_layer_id=lambda layer: layer)
        attention.bf16_swa_norm_rope_store(pool, 0, *dev(loc, kv, w), 1e-6, *dev(f, pos))
        return pool.swa_kv_pool.kv_buffer[0].view(-1, 512).cpu()

    def row_store(value):
        option(value)
        pool = NS(kv_buffer=[dev(torch.zeros(16, 512, dtype=torch.bfloat16))], qk_nope_head_dim=448,
                  qk_rope_head_dim=64)
        attention.bf16_set_key_buffer_fused(pool, 0, *dev(loc, kv))
        return pool.kv_buffer[0].cpu()

    def compress_store(value):
        """The main compressor's store: SGLang's CUDA JIT writes the BF16 rows (it cannot run on the CPU; its
        stand-in writes kv at the decode plan's slots), then the stage rounds what the plan stored."""
        option(value)
        cache = dev(torch.zeros(16, 512, dtype=torch.bfloat16))
        plan = CompressorDecodePlan(4, dev(plan_rows([(8, 0), (9, 0), (4, 0), (12, 0), (16, 0)]).view(torch.uint8)))
        out_loc = dev(torch.tensor([4, 5, 0, 9, 2], dtype=torch.int64))

        def jit_bf16_store(kv_, plan_, *, kvcache, out_loc, **_):
            stored = torch.tensor([0, 2, 3, 4])  # seq % 4 == 0
            kvcache.view(torch.bfloat16).view(-1, 512)[out_loc[stored]] = dev(kv)[stored]

        attention.compress_store(jit_bf16_store, dev(kv.float()), plan, norm_weight=None, norm_eps=1e-6,
                                 freq_cis=None, out_loc=out_loc, kvcache=cache, page_size=64)
        return cache.cpu()

    for store, written in ((swa_store, loc[loc >= 0]), (row_store, loc[loc >= 0]),
                           (compress_store, torch.tensor([4, 0, 9, 2]))):
        off, on = store("none"), store("fp8_sim")
        assert torch.equal(on[written].view(torch.int16), br.kv_fp8_sim_ref(off[written]).view(torch.int16)), \
            store.__name__
        assert not torch.equal(on[written], off[written])
        others = [s for s in range(on.shape[0]) if s not in written.tolist()]
        assert torch.equal(on[others], off[others]), store.__name__
    option("none")


POOL = """
import json, os, sys, torch
from types import SimpleNamespace as NS
from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4SingleKVPool, DeepSeekV4TokenToKVPool
sys.path.insert(0, {root!r})
from dsv4_sm80.stages import attention
from dsv4_sm80.kernels.block_rounding_ref import kv_fp8_sim_ref
from dsv4_sm80.kernels.kv_store import k_norm_rope_store
g = torch.Generator().manual_seed(7)
rows = (torch.randn(3, 512, generator=g) * 5).to(torch.bfloat16)
w = (torch.rand(512, generator=g) + 0.5).to(torch.bfloat16)
f = torch.polar(torch.ones(16, 32), torch.rand(16, 32, generator=g) * 6.28)
pos, loc = torch.tensor([1, 7, 3]), torch.tensor([2, -1, 6])
plain = torch.zeros(8, 512, dtype=torch.bfloat16)  # the SWA store's kernel without the rounding
k_norm_rope_store(rows, w, 1e-6, f, pos, loc, plain)
def stores():
    pool = DeepSeekV4SingleKVPool(size=300, page_size=64, dtype=torch.bfloat16, qk_nope_head_dim=448,
                                  qk_rope_head_dim=64, layer_num=1, device="cpu", enable_memory_saver=False)
    pool.set_key_buffer_fused(0, loc, rows)  # SGLang's own (patched) pool method
    flat = pool.get_key_buffer(0).view(-1, 512)
    swa = NS(swa_kv_pool=NS(kv_buffer=[torch.zeros(1, 8 * 512, dtype=torch.bfloat16)]), _swa_local_layer_id=lambda l: l)
    DeepSeekV4TokenToKVPool.set_swa_key_buffer_radix_fused_norm_rope(swa, 0, loc, rows, w, 1e-6, f, pos)
    got = swa.swa_kv_pool.kv_buffer[0].view(-1, 512)
    return {{"rows_rounded": bool(torch.equal(flat[[2, 6]], kv_fp8_sim_ref(rows[[0, 2]]))),
            "rows_plain": bool(torch.equal(flat[[2, 6]], rows[[0, 2]])),
            "swa_rounded": bool(torch.equal(got[[2, 6]], kv_fp8_sim_ref(plain[[2, 6]]))),
            "swa_plain": bool(torch.equal(got[[2, 6]], plain[[2, 6]]))}}
out = {{"fp8_sim": stores()}}
os.environ["SGLANG_DSV4_A100_KV_ROUNDING"] = "none"
attention.kv_fp8_sim.cache_clear()
out["none"] = stores()
print(json.dumps(out))
"""


@pytest.mark.sglang
def test_real_sglang_pool_rounds_with_the_option():
    """SGLang's own DeepSeekV4SingleKVPool row store and SWA store method, patched, started with
    SGLANG_DSV4_A100_KV_ROUNDING=fp8_sim: the stored rows are rounded; set to none, they are not."""
    root = os.path.dirname(REPO)
    out = last_json(run_python(POOL.format(root=root), ENABLE_SGLANG_DSV4_A100_PATCH="1",
                               SGLANG_DSV4_A100_KV_ROUNDING="fp8_sim", TRITON_INTERPRET="1"))
    assert out["fp8_sim"] == {"rows_rounded": True, "rows_plain": False, "swa_rounded": True, "swa_plain": False}
    assert out["none"] == {"rows_rounded": False, "rows_plain": True, "swa_rounded": False, "swa_plain": True}


COMPILE = """
import json, sys
from dsv4_sm80.kernels import kv_store as ks
sys.path.insert(0, "bench")
import sass_census as sc
build = sc.sm80_build
out = {
  "k_norm_rope_store fp8_sim": build(ks._k_norm_rope_store_kernel, {"kv_ptr": "*bf16", "stride_kv": "i32",
      "w_ptr": "*bf16", "freqs_ptr": "*fp32", "pos_ptr": "*i64", "loc_ptr": "*i32", "cache_ptr": "*bf16",
      "eps": "fp32", "HALF": "constexpr", "ROPE_PAIRS": "constexpr", "FP8_SIM": "constexpr"},
      {"HALF": 256, "ROPE_PAIRS": 32, "FP8_SIM": True}),
  "scatter_rows fp8_sim": build(ks._scatter_rows_kernel, {"src_ptr": "*bf16", "stride_src": "i32", "loc_ptr": "*i64",
      "dst_ptr": "*bf16", "D": "constexpr", "FP8_SIM": "constexpr"}, {"D": 512, "FP8_SIM": True}),
  "round_planned_rows": build(ks._round_planned_rows_kernel, {"cache_ptr": "*bf16", "plan_ptr": "*i32",
      "out_loc_ptr": "*i64", "IS_DECODE": "constexpr", "RATIO": "constexpr"}, {"IS_DECODE": True, "RATIO": 128}),
}
print(json.dumps(out))
"""


def test_compile_for_sm80():
    """The fp8_sim writers build for sm_80 with no FP8 type and no local-memory spill."""
    out = last_json(run_python(COMPILE, TRITON_INTERPRET="0"))
    for name, r in out.items():
        assert r["sm80"] and not r["fp8"] and r["spills"] == 0, (name, r)
