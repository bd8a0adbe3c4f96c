"""The mHC stage on SM80 (dsv4_sm80/stages/mhc.py): the TF32 hc pre-norm GEMM that replaces DeepGEMM's
(kernels/hc_prenorm.py) against its plain-PyTorch reference in the Triton interpreter, its contract checks,
its seam, its sm_80 build (TF32 mma.sync); and every other mHC kernel SGLang 0.5.16's DSV4 forward runs on
this path — TileLang's fused pre-mix (+ norm) and post-mix, the Triton hc_head — built for sm_80 without a
GPU (TileLang through nvcc; skipped, loudly, where no nvcc is installed). Against DeepGEMM's own kernel on
an H200: dsv4_lab/beds/mhc_check.py."""

import os

import pytest
import torch

from conftest import REPO, dev, last_json, nvcc_home, run_python
from dsv4_sm80.kernels import hc_prenorm_ref as ref


@pytest.fixture(scope="module")
def kern():
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and TRITON_INTERPRET is not 1")
    from dsv4_sm80.kernels import hc_prenorm

    return hc_prenorm


def inputs(m, k, n=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g).to(torch.bfloat16)
    b = torch.randn(n, k, generator=g) * 0.02  # hc_fn scale; its low mantissa bits are not zero
    return a, b


def run(kern, a, b, splits):
    m, n = a.shape[0], b.shape[0]
    d = torch.full((m, n) if splits is None else (splits, m, n), float("nan"))
    s = torch.full((m,) if splits is None else (splits, m), float("nan"))
    d, s = dev(d, s)
    kern.hc_prenorm(*dev(a, b), d, s, splits)
    d, s = d.cpu().double(), s.cpu().double()
    return (d, s) if splits is None else (d.sum(0), s.sum(0))


# (m, k, splits): decode and prefill row counts, 16384 = hc_mult 4 x DSV4-Flash hidden 4096, 2048 = the tiny
# checkpoint's, K not a multiple of 64, more splits than 64-wide K blocks (trailing splits write zeros),
# the split counts mhc_pre asks for (min(SMs / row blocks, K blocks / 4)).
# On an A800's 108 SMs: 54 splits at 65-128 tokens, 36 at 129-192 (an H200's 132 SMs give 64 and 44).
CASES = [(1, 2048, None), (1, 16384, 64), (5, 2048, 8), (16, 1000, 3), (17, 2048, 1), (70, 16384, 16),
         (3, 256, 7), (130, 2048, 2), (100, 16384, 54), (150, 16384, 36)]


@pytest.mark.parametrize("m,k,splits", CASES)
def test_hc_prenorm_against_reference(kern, m, k, splits):
    a, b = inputs(m, k, seed=m + k)
    d, s = run(kern, a, b, splits)
    want_d, want_s = ref.hc_prenorm_ref(a, b)
    scale = a.double().abs() @ ref.tf32_round(b).double().abs().t()  # fp32 accumulation error is relative to this
    # 1e-6: fp32 accumulation in another order (the H200, 2026-12-01, dsv4_lab/beds/mhc_check.py: 5.6e-7 at K 2048
    # in one split)
    assert ((d - want_d).abs() / scale).max() < 1e-6
    assert ((s - want_s).abs() / want_s).max() < 1e-6
    # the reference's rounding of hc_fn to TF32 is visible at this tolerance (not a vacuous check): exact fp32
    # products and truncated TF32 (what a truncating kernel gives) both miss it by 4x the tolerance or more
    for other in (b.double(), ref.tf32_truncate(b).double()):
        assert ((a.double() @ other.t() - want_d).abs() / scale).max() > 4e-6


def test_every_bench_variant_computes_the_same(kern):
    """bench/mhc.py --variants times other tiles (the default may become one of them): each gives the reference
    within fp32 summation order, with a split count that leaves trailing splits empty and K not a multiple of
    the larger K tile; a tile that is not a power of two is refused by name."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_mhc", os.path.join(REPO, "bench", "mhc.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    a, b = inputs(70, 1000, seed=3)
    want_d, want_s = ref.hc_prenorm_ref(a, b)
    scale = a.double().abs() @ ref.tf32_round(b).double().abs().t()
    # In Triton's interpreter num_warps and num_stages are not part of the program (each program runs once, in
    # numpy): variants that differ only there run the identical interpreted computation, so each such class runs
    # once here. Compiled (a GPU), every variant is its own kernel and all of them run.
    ran = set()
    for name, cfg in bench.VARIANTS.items():
        if os.environ.get("TRITON_INTERPRET") == "1":
            same = {n: v for n, v in dict(kern.default_config(70), **cfg).items()
                    if n not in ("num_warps", "num_stages")}
            key = tuple(sorted(dict({"inner_splits": 1}, **same).items()))
            if key in ran:
                continue
            ran.add(key)
        for splits in (None, 3, 12):
            m, n = a.shape[0], b.shape[0]
            d = dev(torch.full((m, n) if splits is None else (splits, m, n), float("nan")))
            s = dev(torch.full((m,) if splits is None else (splits, m), float("nan")))
            kern.hc_prenorm(*dev(a, b), d, s, splits, config=cfg)
            d, s = d.cpu().double(), s.cpu().double()
            if splits is not None:
                assert torch.isfinite(d).all(), (name, splits)
                d, s = d.sum(0), s.sum(0)
            assert ((d - want_d).abs() / scale).max() < 1e-6, (name, splits)
            assert ((s - want_s).abs() / want_s).max() < 1e-6, (name, splits)
    with pytest.raises(ValueError, match="config block_k: found 48, expected a power of two"):
        kern.hc_prenorm(*dev(a, b), *dev(torch.empty(70, 24), torch.empty(70)), None, config={"block_k": 48})


def test_tf32_round_is_nearest_ties_away():
    one, SIGN = 0x3F800000, 0x80000000  # 1.0 (a TF32 ulp at 1.0 is 0x2000), the sign bit
    x = torch.tensor([one + 0x0FFF, one + 0x1000, one + 0x1FFF, SIGN | (one + 0x1000), 0x7F7FFFFF, 0x7F800000],
                     dtype=torch.int64).to(torch.int32).view(torch.float32)
    got = ref.tf32_round(x).view(torch.int32).tolist()
    neg = torch.tensor([SIGN | (one + 0x2000)], dtype=torch.int64).to(torch.int32).item()
    assert got == [one, one + 0x2000, one + 0x2000, neg, 0x7F800000, 0x7F800000]  # ties away; FLT_MAX -> inf
    nans = torch.tensor([0x7FFFFFFF, -1, 0x7FC00000], dtype=torch.int32).view(torch.float32)  # all-ones wraps
    assert torch.isnan(ref.tf32_round(nans)).all()


def test_a_nan_in_hc_fn_reaches_the_output(kern):
    """A NaN weight must not be rounded into a zero (silently hiding a corrupt hc_fn): as DeepGEMM would, the
    kernel's output turns NaN in that column."""
    a, b = inputs(3, 256)
    b[5, 17] = torch.tensor([-1], dtype=torch.int32).view(torch.float32)  # NaN with every bit set
    d, _ = run(kern, a, b, None)
    assert torch.isnan(d[:, 5]).all() and torch.isfinite(torch.cat([d[:, :5], d[:, 6:]], 1)).all()


def test_every_split_is_written_and_rows_are_independent(kern):
    a, b = inputs(9, 512)
    d = dev(torch.full((16, 9, 24), float("nan")))
    s = dev(torch.full((16, 9), float("nan")))
    kern.hc_prenorm(*dev(a, b), d, s, 16)  # 8 K blocks for 16 splits: splits 8..15 are empty
    d, s = d.cpu(), s.cpu()
    assert torch.isfinite(d).all() and torch.isfinite(s).all()
    assert (d[8:] == 0).all() and (s[8:] == 0).all()
    one, _ = run(kern, a[4:5], b, None)
    assert torch.allclose(d.double().sum(0)[4:5], one, rtol=1e-6, atol=1e-6)


def test_no_rows_is_a_no_op(kern):
    a, b = inputs(0, 512)
    d, s = dev(torch.empty(4, 0, 24), torch.empty(4, 0))
    kern.hc_prenorm(*dev(a, b), d, s, 4)


@pytest.mark.parametrize("change,what", [
    (dict(a=torch.zeros(3, 256)), "a"),                                 # fp32 residual, not BF16
    (dict(b=torch.zeros(24, 128)), "b"),                                # K differs from a's
    (dict(d=torch.zeros(3, 24)), "d"),                                  # split dim missing for num_splits=2
    (dict(s=torch.zeros(2, 4)), "sqrsum"),
    (dict(splits=0), "num_splits"),
])
def test_contract_violations_are_named(change, what):
    from dsv4_sm80.kernels import hc_prenorm

    args = dict(a=torch.zeros(3, 256, dtype=torch.bfloat16), b=torch.zeros(24, 256), d=torch.zeros(2, 3, 24),
                s=torch.zeros(2, 3), splits=2)
    args.update(change)
    with pytest.raises(ValueError, match=rf"hc_prenorm: {what}: found .* expected"):
        hc_prenorm.hc_prenorm(args["a"], args["b"], args["d"], args["s"], args["splits"])


SEAM = """
import json, os
import sglang.srt.layers.deep_gemm_wrapper.entrypoint as ep
from sglang.kernels.ops.layernorm import mhc
f = ep.tf32_hc_prenorm_gemm
print(json.dumps({"module": f.__module__, "name": f.__name__}))
"""


@pytest.mark.parametrize("patch,module", [("1", "dsv4_sm80.stages.mhc"),
                                          ("0", "sglang.srt.layers.deep_gemm_wrapper.entrypoint")])
def test_seam_routes_mhc_pre_to_the_sm80_gemm(patch, module):
    pytest.importorskip("sglang")
    out = last_json(run_python(SEAM, ENABLE_SGLANG_DSV4_A100_PATCH=patch))
    assert out["module"] == module, out


TRITON_SM80 = """
import json, sys
from dsv4_sm80.kernels import hc_prenorm as hp
from sglang.kernels.ops.layernorm import mhc_head
sys.path.insert(0, "bench")
import sass_census as sc
build = sc.sm80_build
out = {}
for bm in (16, 64):
    out[f"hc_prenorm BLOCK_M {bm}"] = build(hp._hc_prenorm_kernel, {"a_ptr": "*bf16", "b_ptr": "*fp32",
        "d_ptr": "*fp32", "s_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32", "outer_share": "i32",
        "inner_share": "i32", "INNER": "i32", "stride_am": "i32", "stride_bn": "i32", "BLOCK_M": "constexpr",
        "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"},
        {"BLOCK_M": bm, "BLOCK_N": 32, "BLOCK_K": hp.BLOCK_K})
out["sglang hc_head (Triton)"] = build(mhc_head._hc_head_kernel, {"x_ptr": "*bf16", "fn_ptr": "*fp32",
    "scale_ptr": "*fp32", "base_ptr": "*fp32", "y_ptr": "*bf16", "hidden_size": "constexpr", "HC_MULT": "constexpr",
    "K_TOTAL": "constexpr", "BLOCK_K": "constexpr", "BLOCK_D": "constexpr", "norm_eps": "constexpr",
    "hc_eps": "constexpr"}, {"hidden_size": 4096, "HC_MULT": 4, "K_TOTAL": 16384, "BLOCK_K": 512, "BLOCK_D": 512,
    "norm_eps": 1e-6, "hc_eps": 1e-6})
print(json.dumps(out))
"""


def test_triton_kernels_compile_for_sm80():
    pytest.importorskip("sglang")
    out = last_json(run_python(TRITON_SM80, TRITON_INTERPRET="0"))
    for name, r in out.items():
        assert r["sm80"] and not r["fp8"] and r["shared"] <= 163 * 1024, (name, r)
    assert out["hc_prenorm BLOCK_M 16"]["tf32_mma"] and out["hc_prenorm BLOCK_M 64"]["tf32_mma"], out


# SGLang's own TileLang functions, jitted with their own pass configs and a fixed sm_80 target; shapes as
# mhc_pre / mhc_post pass them (the split-K partials of the GEMM above: gemm_last_dim 24). is_arch_support_pdl
# is resolved for sm_80 (no griddepcontrol). The pip nvcc may be newer than its runtime headers, hence the
# CCCL flag (compile-only evidence; the GPU machine compiles with its own toolkit).
TILELANG_SM80 = """
import inspect, json, time
import torch
from sglang.jit_kernel.utils.arch import override_jit_cuda_arch
from sglang.kernels.ops.layernorm import mhc
real = mhc._load_tilelang()
from tvm.target import Target

def build(wrapper, *args):
    cv = inspect.getclosurevars(wrapper).nonlocals
    kw = dict(mhc._resolve_lazy_tilelang_value(cv.get("jit_kwargs", {})))
    kw.update(target=Target({"kind": "cuda", "arch": "sm_80"}),
              compile_flags=["-DCCCL_DISABLE_CTK_COMPATIBILITY_CHECK"])
    t0 = time.time()
    k = real.jit(**kw)(cv["fn"]).compile(*args)
    src = k.get_kernel_source()
    return {"seconds": round(time.time() - t0, 1), "sm90_only": [w for w in ("wgmma", "griddepcontrol", "cp.async.bulk",
            "setmaxnreg", "fence.proxy.async", "mbarrier.try_wait") if w in src]}

f32, bf16 = torch.float32, torch.bfloat16
out = {}
with override_jit_cuda_arch(8, 0):
    for hidden in (4096, 512):
        n, hc, splits = 4, 4, 16
        e = lambda *s, dt=f32: torch.empty(*s, dtype=dt)
        pre = (e(splits, n, 24), e(splits, n), e(3), e(24), e(n, hc, hidden, dt=bf16), e(n, hc), e(n, hc * hc),
               e(n, hidden, dt=bf16))
        out[f"mhc_pre_big_fuse hidden {hidden}"] = build(mhc.mhc_pre_big_fuse_tilelang, *pre, hidden, 1e-6, 1e-6,
                                                         1e-6, 2.0, 20, splits, hc, 24)
        out[f"mhc_pre_big_fuse_with_norm hidden {hidden}"] = build(mhc.mhc_pre_big_fuse_with_norm_tilelang, *pre,
            e(hidden, dt=bf16), hidden, 1e-6, 1e-6, 1e-6, 2.0, 20, 1e-6, splits, hc, 24)
        out[f"mhc_post hidden {hidden}"] = build(mhc.mhc_post_tilelang, e(n, hc, hc), e(n, hc, hidden, dt=bf16),
                                                 e(n, hc), e(n, hidden, dt=bf16), e(n, hc, hidden, dt=bf16), hc, hidden)
print(json.dumps(out))
"""


def test_tilelang_mhc_kernels_compile_for_sm80():
    pytest.importorskip("sglang")
    pytest.importorskip("tilelang")
    home = nvcc_home()
    if home is None:
        pytest.skip("!!! no nvcc (CUDA_HOME, PATH or the nvidia pip wheels): TileLang's sm_80 build NOT checked !!!")
    out = last_json(run_python(TILELANG_SM80, CUDA_HOME=home, timeout=900))
    assert len(out) == 6, out
    for name, r in out.items():
        assert not r["sm90_only"], (name, r)
