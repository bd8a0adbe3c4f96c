"""DSV4 sparse attention with a sink (dsv4_sm80/kernels/sparse_attn.py) in the Triton interpreter at small
sizes, against the plain-PyTorch reference written from the math (dsv4_sm80/kernels/sparse_attn_ref.py):
odd lengths, -1 slots, empty lists, sink on and off, SWA only (compress ratio 0) and SWA + extra list
(C4 top-k, C128 all), one split and several."""

import os

import pytest
import torch

from conftest import dev
from dsv4_sm80.kernels.sparse_attn_ref import sparse_attn_ref

D = 512


@pytest.fixture(scope="module")
def k():
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and TRITON_INTERPRET is not 1")
    import dsv4_sm80.kernels.sparse_attn as mod

    return mod


def lists(t, width, slots, g, lens=None, holes=0.15):
    ids = torch.randint(0, slots, (t, width), generator=g, dtype=torch.int32)
    ids[torch.rand(t, width, generator=g) < holes] = -1
    if lens is None:
        lens = torch.randint(0, width + 1, (t,), generator=g, dtype=torch.int32)
    return ids, torch.as_tensor(lens, dtype=torch.int32)


def setup(t=5, hpad=32, slots=300, swa_w=128, ext_w=0, seed=0, lens=None, ext_lens=None):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, hpad, D, generator=g).to(torch.bfloat16)
    swa = torch.randn(slots, D, generator=g).to(torch.bfloat16)
    swa_ids, swa_lens = lists(t, swa_w, slots, g, lens)
    extra = None
    if ext_w:
        extra = torch.randn(slots // 2, D, generator=g).to(torch.bfloat16)
        ext_ids, ext_lens = lists(t, ext_w, slots // 2, g, ext_lens)
    sink = torch.randn(hpad, generator=g) * 2
    return q, swa, swa_ids, swa_lens, extra, (ext_ids if ext_w else None), (ext_lens if ext_w else None), sink


def check(k, args, heads, use_sink, splits, block_n=32, **kw):
    q, swa, swa_ids, swa_lens, extra, ext_ids, ext_lens, sink = args
    out = dev(torch.full_like(q, 7.0))  # rows past `heads` must stay untouched
    k.sparse_attn(*dev(q, swa, swa_ids, swa_lens, extra, ext_ids, ext_lens, sink if use_sink else None),
                  heads=heads, splits=splits, block_n=block_n, out=out, **kw)
    out = out.cpu()
    want = sparse_attn_ref(q[:, :heads], swa, swa_ids, swa_lens, extra, ext_ids, ext_lens,
                           sink[:heads] if use_sink else None)
    err = (out[:, :heads].double() - want).abs().max().item()
    tol = 1e-2 * max(want.abs().max().item(), 1e-3)
    if splits != 1 and kw.get("partial_dtype", k.sparse_attn.__kwdefaults__["partial_dtype"]) == torch.bfloat16:
        # each split's partial is a weighted mean of value rows rounded once to BF16 (the default workspace): up
        # to 2^-9 of the largest value, which can exceed the output where splits cancel, so that term is added
        tol += 2.0 ** -9 * max(float(c.abs().max()) for c in (swa, extra) if c is not None)
    assert err <= tol, (err, tol)
    assert (out[:, heads:] == 7.0).all()
    return out, want


@pytest.mark.parametrize("ext_w", [0, 40, 77], ids=["ratio0-swa-only", "c4-topk", "c128-all"])
@pytest.mark.parametrize("use_sink", [True, False], ids=["sink", "nosink"])
@pytest.mark.parametrize("splits", [1, 3])
def test_matches_reference(k, ext_w, use_sink, splits):
    check(k, setup(t=4, ext_w=ext_w, seed=ext_w + splits), heads=20, use_sink=use_sink, splits=splits)


@pytest.mark.parametrize("ext_w", [0, 40, 77], ids=["ratio0-swa-only", "c4-topk", "c128-all"])
@pytest.mark.parametrize("splits", [1, 3])
def test_fp32_partials_variant_matches_reference(k, ext_w, splits):
    """The other split-partial workspace (fp32, each split's unnormalised sum; the default keeps
    them normalised in BF16, half the bytes, and runs in every other test here): the same tolerance, with the
    sink, odd and empty lists (the empty ones in test_fp32_partials_variant_on_empty_lists); one split never
    uses a workspace."""
    check(k, setup(t=4, ext_w=ext_w, seed=21 + ext_w + splits), heads=20, use_sink=True, splits=splits,
          partial_dtype=torch.float32)


@pytest.mark.parametrize("splits", [1, 3])
def test_fp32_partials_variant_on_empty_lists(k, splits):
    """The fp32-partials variant's empty-list case and the dtype refusal, once per split count (neither depends
    on the list widths test_fp32_partials_variant_matches_reference varies)."""
    args = setup(t=3, ext_w=16, lens=[0, 5, 0], ext_lens=[0, 0, 3], seed=3)
    out, _ = check(k, args, heads=16, use_sink=False, splits=splits, partial_dtype=torch.float32)
    assert (out[0, :16] == 0).all()  # an empty key set: zeros, not NaN from 0 / 0
    with pytest.raises(ValueError, match="partial_dtype"):
        check(k, args, heads=16, use_sink=False, splits=splits, partial_dtype=torch.float16)


@pytest.mark.parametrize("ext_w", [40, 77], ids=["c4-topk", "c128-all"])
@pytest.mark.parametrize("splits", [1, 3, 7])
def test_joint_lists_variant_matches_reference(k, ext_w, splits):
    """joint: a split owns a contiguous range of the SWA and extra lists read as one (steps that straddle the two
    lists pick each row's cache); odd lengths, -1 slots, the sink, with the tiled combine as well."""
    args = setup(t=4, ext_w=ext_w, seed=31 + ext_w + splits)
    check(k, args, heads=20, use_sink=True, splits=splits, block_n=16, joint=True)
    check(k, args, heads=20, use_sink=True, splits=splits, block_n=16, joint=True, combine="tiles")


@pytest.mark.parametrize("splits", [3, 5, 17])
@pytest.mark.parametrize("partial_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_tiles_combine_variant_matches_reference(k, splits, partial_dtype):
    """combine "tiles": every split's partial loaded at once and reduced over the split axis (split counts not a
    power of two, so the padded split rows are masked; more splits than list steps, so some splits are empty);
    both workspaces, with and without the sink, and key sets that are empty or all -1 slots give zeros."""
    args = setup(t=4, ext_w=40, lens=[0, 5, 90, 128], ext_lens=[0, 0, 3, 40], seed=41 + splits)
    args[2][1, :5] = -1  # token 1: its five SWA entries are all -1 slots
    for use_sink in (True, False):
        out, _ = check(k, args, heads=20, use_sink=use_sink, splits=splits, combine="tiles",
                       partial_dtype=partial_dtype)
        assert (out[:2, :20] == 0).all()
    with pytest.raises(ValueError, match="combine"):
        check(k, args, heads=20, use_sink=True, splits=splits, combine="tree")


def test_empty_key_sets_give_zero(k):
    args = setup(t=3, ext_w=16, lens=[0, 5, 0], ext_lens=[0, 0, 3], seed=3)
    args[2][1, :5] = -1  # token 1: its five SWA entries are all -1 slots
    for use_sink in (True, False):
        for splits in (1, 4):
            out, want = check(k, args, heads=16, use_sink=use_sink, splits=splits)
            assert (out[:2, :16] == 0).all() and (want[:2] == 0).all()
            assert out[2, :16].abs().sum() > 0


def test_lengths_beyond_the_list_width_are_clamped(k):
    args = setup(t=2, swa_w=48, lens=[1000, 47], seed=5)
    check(k, args, heads=16, use_sink=True, splits=2, block_n=16)


def test_bad_shapes_refused(k):
    q = torch.zeros(2, 16, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="head dim must be 512"):
        k.sparse_attn(q, torch.zeros(4, 256, dtype=torch.bfloat16), torch.zeros(2, 4, dtype=torch.int32),
                      torch.ones(2, dtype=torch.int32))


COMPILE = """
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from dsv4_sm80.kernels import sparse_attn as k
import sys
sys.path.insert(0, "bench")
import sass_census as sc
def spills(cubin):  # local-memory loads and stores in the SASS
    census = sc.loops(sc.disassemble(cubin))
    return census["LDL"] + census["STL"]
P = lambda t: "*" + t
main_sig = {"q_ptr": "*bf16", "stride_qt": "i32", "stride_qh": "i32",
            "swa_ptr": "*bf16", "swa_ids_ptr": "*i32", "stride_swa_ids": "i32", "swa_lens_ptr": "*i32",
            "swa_width": "i32",
            "ext_ptr": "*bf16", "ext_ids_ptr": "*i32", "stride_ext_ids": "i32", "ext_lens_ptr": "*i32",
            "ext_width": "i32",
            "sink_ptr": "*fp32", "o_ptr": "*bf16", "stride_ot": "i32", "stride_oh": "i32", "ws_acc_ptr": "*fp32",
            "ws_ml_ptr": "*fp32", "heads": "i32", "scale": "fp32", "HAS_EXTRA": "constexpr", "HAS_SINK": "constexpr",
            "SPLITS": "constexpr", "D": "constexpr", "BLOCK_H": "constexpr", "BLOCK_N": "constexpr",
            "DOT_F32": "constexpr",
            "NORM_PARTIAL": "constexpr", "JOINT": "constexpr"}
comb_sig = {"ws_acc_ptr": "*fp32", "ws_ml_ptr": "*fp32", "sink_ptr": "*fp32", "o_ptr": "*bf16", "stride_ot": "i32",
            "stride_oh": "i32", "heads": "i32", "HAS_SINK": "constexpr", "SPLITS": "constexpr", "D": "constexpr",
            "BLOCK_H": "constexpr", "BLOCK_D": "constexpr", "NORM_PARTIAL": "constexpr"}
out = {}
target = GPUTarget("cuda", 80, 32)
for splits, norm, joint in ((1, False, False), (8, False, False), (8, True, False), (20, True, True)):
    c = dict(HAS_EXTRA=True, HAS_SINK=True, SPLITS=splits, D=512, BLOCK_H=16, BLOCK_N=32, DOT_F32=False,
             NORM_PARTIAL=norm, JOINT=joint)
    sig = dict(main_sig, ws_acc_ptr="*bf16") if norm else main_sig
    r = triton.compile(ASTSource(fn=k._sparse_attn_kernel, signature=sig, constexprs=c), target=target,
                       options={"num_warps": 4, "num_stages": 2})
    ptx = r.asm["ptx"]
    name = f"main-splits{splits}" + ("-bf16-partials" if norm else "") + ("-joint" if joint else "")
    out[name] = {"sm80": ".target sm_80" in ptx, "bf16_mma": "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
                 in ptx, "fp8": "e4m3" in ptx or "e5m2" in ptx, "shared": r.metadata.shared,
                 "spills": spills(r.asm["cubin"])}
for norm in (False, True):
    sig = dict(comb_sig, ws_acc_ptr="*bf16") if norm else comb_sig
    r = triton.compile(ASTSource(fn=k._combine_kernel, signature=sig,
                                 constexprs=dict(HAS_SINK=True, SPLITS=8, D=512, BLOCK_H=16, BLOCK_D=k.COMBINE_D,
                                                 NORM_PARTIAL=norm)), target=target,
                       options={"num_warps": 4})
    out["combine" + ("-bf16-partials" if norm else "")] = {"sm80": ".target sm_80" in r.asm["ptx"], "bf16_mma": True,
                                                            "fp8": False, "shared": r.metadata.shared}
for norm, splits in ((False, 8), (True, 20), (True, 64)):
    sig = dict(comb_sig, SPLITS_P2="constexpr", ws_acc_ptr="*bf16" if norm else "*fp32")
    p2 = triton.next_power_of_2(splits)
    r = triton.compile(ASTSource(fn=k._combine_tiles_kernel, signature=sig,
                                 constexprs=dict(HAS_SINK=True, SPLITS=splits, SPLITS_P2=p2, D=512, BLOCK_H=16,
                                                 BLOCK_D=max(16, min(128, 512 // p2)), NORM_PARTIAL=norm)),
                       target=target, options={"num_warps": 4})
    out[f"combine-tiles{splits}" + ("-bf16-partials" if norm else "")] = {
        "sm80": ".target sm_80" in r.asm["ptx"], "bf16_mma": True, "fp8": False, "shared": r.metadata.shared,
        "spills": spills(r.asm["cubin"])}
print(json.dumps(out))
"""


def test_compiles_for_sm80():
    """Compiled for sm_80 without a GPU (interpreter off in that process): BF16 tensor-core MMA, no FP8
    type, shared memory within an A800's 163 KiB per block."""
    from conftest import last_json, run_python

    out = last_json(run_python(COMPILE, TRITON_INTERPRET="0"))
    assert set(out) == {"main-splits1", "main-splits8", "main-splits8-bf16-partials",
                        "main-splits20-bf16-partials-joint", "combine", "combine-bf16-partials", "combine-tiles8",
                        "combine-tiles20-bf16-partials", "combine-tiles64-bf16-partials"}
    for name, r in out.items():
        assert r["sm80"] and r["bf16_mma"] and not r["fp8"], (name, r)
        assert not r.get("spills"), (name, r)  # no local-memory traffic (LDL/STL) in the sm_80 SASS
        assert r["shared"] <= 163 * 1024, (name, r)


def test_default_splits_depend_on_static_shapes_only(k):
    assert k.default_splits(4, 16, 640, "cpu") == 1  # the interpreter: one split
    assert k.default_splits(4, 16, 640, torch.device("cpu")) == 1


def test_default_splits_on_a_gpu_shape(k, monkeypatch):
    """With a GPU's SM count (132: an H200; an A800 has 108): about two waves of programs, at least 64
    list entries per split, at most 32 splits (the counts the H200 bench of 2026-11-30 measured fastest)."""
    monkeypatch.setattr(k, "sm_count", lambda device: 132)
    cuda = torch.device("cuda", 0)  # a device object only
    assert k.default_splits(1, 16, 640, cuda) == 10  # batch-1 decode, C4 layer: 640 // 64
    assert k.default_splits(8, 16, 640, cuda) == 10
    assert k.default_splits(64, 16, 640, cuda) == 4  # floor(2 * 132 / 64): one wave of 256 at two per SM
    assert k.default_splits(1, 16, 4224, cuda) == 32  # C128 at 512K: capped
    assert k.default_splits(64, 16, 160, cuda) == 2  # C128 at 4K: 160 // 64
    assert k.default_splits(8192, 16, 640, cuda) == 1  # prefill
    assert k.default_splits(1, 16, 16, cuda) == 1  # a list shorter than one step


def test_decode_plan_on_gpu_shapes(k, monkeypatch):
    """decode_plan (sparse_attn's splits=None): few query tokens take a program per 32-entry step while one wave holds
    them (short lists too), and from 8 splits on the tiled combine, reading the two lists as one where a
    split's share is at most 64 entries; batch 64 keeps the plan of 4 splits (the loop combine, lists apart)."""
    monkeypatch.setattr(k, "sm_count", lambda device: 132)
    cuda = torch.device("cuda", 0)
    assert k.decode_plan(1, 16, 640, cuda) == {"splits": 20, "joint": True, "combine": "tiles"}
    assert k.decode_plan(8, 16, 640, cuda) == {"splits": 10, "joint": True, "combine": "tiles"}  # 160 > 132
    assert k.decode_plan(64, 16, 640, cuda) == {"splits": 4, "joint": False, "combine": "loop"}
    assert k.decode_plan(1, 16, 4224, cuda) == {"splits": 32, "joint": False, "combine": "tiles"}  # 132 a split
    assert k.decode_plan(1, 16, 160, cuda) == {"splits": 4, "joint": False, "combine": "loop"}
    assert k.decode_plan(8, 16, 256, cuda) == {"splits": 8, "joint": True, "combine": "tiles"}
    assert k.decode_plan(1, 16, 384, cuda) == {"splits": 12, "joint": True, "combine": "tiles"}
    assert k.decode_plan(64, 16, 160, cuda) == {"splits": 2, "joint": False, "combine": "loop"}  # 64 x 4 > 132
    assert k.decode_plan(1, 16, 16, cuda)["splits"] == 1  # a list shorter than one step


def test_default_plan_matches_reference(k, monkeypatch):
    """splits=None with a GPU's SM count: the plan's split count, joint lists and tiled combine, against the
    reference (the interpreter reports no SM count; the plan is taken as on an H200)."""
    monkeypatch.setattr(k, "sm_count", lambda device: 132)
    args = setup(t=1, ext_w=400, lens=[100], ext_lens=[350], seed=61)
    assert k.decode_plan(1, 16, 128 + 400, "cuda") == {"splits": 16, "joint": True, "combine": "tiles"}
    check(k, args, heads=16, use_sink=True, splits=None)
    # short lists doubled: an SWA-only layer's 128 entries in 4 splits (loop combine), and 128 + 256
    # in 12 (joint, tiles), shorter lengths than the widths
    assert k.decode_plan(1, 16, 128, "cuda") == {"splits": 4, "joint": False, "combine": "loop"}
    check(k, setup(t=1, lens=[90], seed=62), heads=16, use_sink=True, splits=None)
    assert k.decode_plan(1, 16, 128 + 256, "cuda") == {"splits": 12, "joint": True, "combine": "tiles"}
    check(k, setup(t=1, ext_w=256, lens=[128], ext_lens=[201], seed=63), heads=16, use_sink=False, splits=None)
