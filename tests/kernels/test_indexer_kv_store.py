"""The SM80 cache writers and the INT8 indexer (dsv4_sm80/kernels/kv_store.py, indexer_int8.py) in the
Triton interpreter, against the plain-PyTorch references of dsv4_sm80/kernels/kv_store_ref.py; and their
compilation for sm_80 (no FP8 types; INT8 MMA for the logits)."""

import os

import pytest
import torch

from conftest import dev
from dsv4_sm80.kernels import kv_store_ref as ref


@pytest.fixture(scope="module")
def kern():
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and TRITON_INTERPRET is not 1")
    from dsv4_sm80.kernels import indexer_int8, kv_store

    return kv_store, indexer_int8


def freqs(max_pos, pairs, seed=0):
    g = torch.Generator().manual_seed(seed)
    theta = torch.rand(max_pos, pairs, generator=g) * 6.28
    return torch.polar(torch.ones_like(theta), theta)  # complex64 unit rotations


def test_k_norm_rope_store_bf16(kern):
    kv_store, _ = kern
    g = torch.Generator().manual_seed(1)
    n = 7
    qkv = torch.randn(n, 256 + 512, generator=g).to(torch.bfloat16)
    kv = qkv[:, 256:]  # a strided slice, as SGLang passes qkv_a[..., q_lora_rank:]
    w = (torch.rand(512, generator=g) + 0.5).to(torch.bfloat16)
    f = freqs(100, 32)
    pos = torch.randint(0, 100, (n,), generator=g)
    loc = torch.tensor([3, -1, 0, 9, 4, -1, 7], dtype=torch.int32)
    cache = dev(torch.full((12, 512), 5.0, dtype=torch.bfloat16))
    kv_store.k_norm_rope_store(*dev(kv, w), 1e-6, *dev(f, pos, loc, cache))
    cache = cache.cpu()
    want = ref.k_norm_rope_ref(kv, w, 1e-6, f, pos)
    for r in range(n):
        if loc[r] >= 0:
            got = cache[loc[r]].double()
            assert (got - want[r]).abs().max() <= 2 ** -7 * want[r].abs().max(), r  # one BF16 rounding
    untouched = [s for s in range(12) if s not in loc.tolist()]
    assert (cache[untouched] == 5.0).all()  # -1 rows wrote nothing


@pytest.mark.parametrize("h", [64, 48, 16])  # two programs of 32 heads; the second one part-masked; 16 a program
def test_q_rope_hadamard_int8(kern, h):
    _, idx = kern
    g = torch.Generator().manual_seed(2)
    t = 3
    q = torch.randn(t, h, 128, generator=g).to(torch.bfloat16)
    w = torch.randn(t, h, generator=g).to(torch.bfloat16)
    f = freqs(50, 32, seed=3)
    pos = torch.tensor([0, 17, 49])
    q8, wo = (t.cpu() for t in idx.q_rope_hadamard_int8(*dev(q, w), (128 * 64) ** -0.5, *dev(f, pos)))
    want_q, want_w = ref.q_indexer_ref(q, w, (128 * 64) ** -0.5, f, pos)
    assert q8.dtype == torch.int8 and wo.shape == (t, h, 1)
    assert (q8.int() - want_q.int()).abs().max() <= 1  # a rounding tie may land one step apart
    assert (q8 != want_q).float().mean() < 0.01
    assert torch.allclose(wo, want_w, rtol=1e-5, atol=0)


def pages_with(kern, n_pages, entries, seed):
    _, idx = kern
    g = torch.Generator().manual_seed(seed)
    cache = dev(torch.zeros(n_pages, 64 * 132, dtype=torch.uint8))
    x = torch.randn(len(entries), 128, generator=g) * torch.rand(len(entries), 1, generator=g) * 4
    loc = torch.tensor(entries, dtype=torch.int32)
    idx.store_index_k_int8(*dev(x, loc, cache))
    return cache.cpu(), x, loc


def test_store_index_k_int8_page_layout(kern):
    cache, x, loc = pages_with(kern, 3, [0, 63, 64, -1, 130], seed=4)
    keep = loc >= 0
    vals, scales = ref.index_pages_read(cache, loc[keep].long())
    want_q, want_s = ref.int8_rows(x[keep].double())
    assert torch.equal(vals, want_q) and torch.allclose(scales.double(), want_s, rtol=1e-6)
    # the -1 row wrote nothing: everything outside the four entries is still zero
    mask = torch.zeros_like(cache, dtype=torch.bool).view(-1, 64 * 132)
    for s in loc[keep].tolist():
        p, o = divmod(s, 64)
        mask[p, o * 128:(o + 1) * 128] = True
        mask[p, 64 * 128 + 4 * o: 64 * 128 + 4 * o + 4] = True
    assert (cache.view(-1, 64 * 132)[~mask] == 0).all()


@pytest.fixture(scope="module")
def logits_pages(kern):
    """Eight full pages written by the INT8 store, built once: every logits case reads the same cache (read only)."""
    cache, _, _ = pages_with(kern, 8, list(range(8 * 64)), seed=5)
    return cache


@pytest.mark.parametrize("lens,splits,prefetch", [([130, 5, 0, 64], None, False), ([1, 192, 65, 3], None, False),
                                                  ([250, 129, 0, 64], 1, False), ([250, 129, 0, 64], 3, False),
                                                  ([250, 129, 0, 64], 1, True), ([250, 129, 0, 64], 3, True)])
def test_paged_mqa_logits_int8(kern, logits_pages, lens, splits, prefetch):
    """splits 1 and 3: each program walks several pages of its token (stride 3 over 4 pages: 0 and 3, 1, 2);
    prefetch: the next page loaded before the current one's product (masked past the token's pages)."""
    _, idx = kern
    n_pages = 8
    cache = logits_pages
    g = torch.Generator().manual_seed(6)
    t = len(lens)
    q8 = torch.randint(-127, 128, (t, 1, 64, 128), generator=g, dtype=torch.int32).to(torch.int8)
    w = torch.randn(t, 64, generator=g)
    page_table = torch.stack([torch.randperm(n_pages, generator=g)[:4] for _ in range(t)]).to(torch.int32)
    seq = torch.tensor(lens, dtype=torch.int32)
    max_len = 250  # not a multiple of 64: the last page is cut
    out = idx.paged_mqa_logits_int8(*dev(q8, cache, w, seq.view(-1, 1), page_table), max_len, splits=splits,
                                    prefetch=prefetch).cpu()
    want, mag = ref.logits_ref(q8[:, 0], cache, w, seq, page_table, max_len, magnitude=True)
    for r, n in ((r, n) for r, n in enumerate(lens) if n):
        # the kernel sums 64 fp32 products: its error is bounded by about 64 * 2^-24 (3.8e-6) of the sum of their
        # magnitudes, not of the logit, which cancellation can make far smaller; a wrong key or page is off by ~1
        err = (out[r, :n].double() - want[r, :n]).abs() / mag[r, :n].clamp_min(1e-30)
        assert err.max() <= 1e-5, (r, err.max().item(), err.argmax().item())


COMPILE = """
import json, sys
from dsv4_sm80.kernels import indexer_int8 as ix, kv_store as ks
LOGITS_SIG = {"q_ptr": "*i8", "kv_ptr": "*i8", "kv_f32_ptr": "*fp32", "w_ptr": "*fp32", "lens_ptr": "*i32",
    "pt_ptr": "*i32", "stride_pt": "i32", "out_ptr": "*fp32", "stride_out": "i32", "max_len": "i32", "splits": "i32",
    "HEADS": "constexpr", "PREFETCH": "constexpr"}
sys.path.insert(0, "bench")
import sass_census as sc
build = sc.sm80_build
out = {
  "k_norm_rope_store": build(ks._k_norm_rope_store_kernel, {"kv_ptr": "*bf16", "stride_kv": "i32", "w_ptr": "*bf16",
      "freqs_ptr": "*fp32", "pos_ptr": "*i64", "loc_ptr": "*i32", "cache_ptr": "*bf16", "eps": "fp32",
      "HALF": "constexpr", "ROPE_PAIRS": "constexpr"}, {"HALF": 256, "ROPE_PAIRS": 32}),
  "q_rope_hadamard_int8": build(ix._q_rope_hadamard_int8_kernel, {"q_ptr": "*bf16", "stride_qt": "i32",
      "stride_qh": "i32", "w_ptr": "*bf16", "stride_wt": "i32", "freqs_ptr": "*fp32", "pos_ptr": "*i64",
      "he_ptr": "*bf16", "ho_ptr": "*bf16", "qo_ptr": "*i8", "wo_ptr": "*fp32", "heads": "i32",
      "weight_scale": "fp32", "BLOCK_H": "constexpr", "DOT_F32": "constexpr"}, {"BLOCK_H": 32, "DOT_F32": False}),
  "compress_store_index_k": build(ix._compress_store_index_k_kernel, {"kv_ptr": "*fp32", "plan_ptr": "*i32",
      "n_rows": "i32", "out_loc_ptr": "*i64", "w_ptr": "*fp32", "eps": "fp32", "freqs_ptr": "*fp32", "he_ptr": "*bf16",
      "ho_ptr": "*bf16", "cache_ptr": "*i8", "cache_f32_ptr": "*fp32", "IS_DECODE": "constexpr", "RATIO": "constexpr",
      "BLOCK_R": "constexpr", "DOT_F32": "constexpr"},
      {"IS_DECODE": True, "RATIO": 4, "BLOCK_R": 16, "DOT_F32": False}),
  "store_index_k": build(ix._store_index_k_kernel, {"x_ptr": "*fp32", "stride_x": "i32", "loc_ptr": "*i32",
      "cache_ptr": "*i8", "cache_f32_ptr": "*fp32"}, {}),
  "logits": build(ix._logits_int8_kernel, LOGITS_SIG, {"HEADS": 64, "PREFETCH": False}),
  "logits prefetch": build(ix._logits_int8_kernel, LOGITS_SIG, {"HEADS": 64, "PREFETCH": True}),
}
print(json.dumps(out))
"""


def test_compile_for_sm80():
    from conftest import last_json, run_python

    out = last_json(run_python(COMPILE, TRITON_INTERPRET="0"))
    for name, r in out.items():
        # no local-memory spills in any (LDL/STL in the sm_80 SASS; the fp32 Hadamard products spilled thousands)
        assert r["sm80"] and not r["fp8"] and r["shared"] <= 163 * 1024 and r["spills"] == 0, (name, r)
    assert out["logits"]["int8_mma"] and out["logits prefetch"]["int8_mma"], out
    # the Hadamard on tensor cores (BF16 MMA, three parts), not an fp32 product on CUDA cores (208 us on the H200,
    # 2026-12-01)
    for name in ("q_rope_hadamard_int8", "compress_store_index_k"):
        assert out[name]["bf16_mma"], (name, out[name])


def test_logits_grid_is_bounded_by_the_device_not_the_max_length():
    """Programs per token: about 4 per SM over the batch (8 SMs stand in on the CPU) and enough that none walks
    more than 16 pages, at least one, never more than the pages of the static max length (H200, 2026-12-01: a program
    per page of 262,144 entries, 16 x 4097 programs, 40 us per decode step on the H200)."""
    from dsv4_sm80.kernels.indexer_int8 import LOGITS_PAGES_PER_PROGRAM, logits_splits

    assert LOGITS_PAGES_PER_PROGRAM == 16
    assert logits_splits(1, 262144, "cpu") == 256  # 4096 pages: 256 programs of at most 16 pages
    assert logits_splits(16, 262144, "cpu") == 256 and logits_splits(64, 262144, "cpu") == 256
    assert logits_splits(1, 1024, "cpu") == 16  # 16 pages, 32 wanted: one program a page
    assert logits_splits(1, 100, "cpu") == 2
    assert logits_splits(8192, 16384, "cpu") == 16  # a 64K-context prefill chunk: 256 pages, 16 a program
    assert logits_splits(0, 0, "cpu") == 1
