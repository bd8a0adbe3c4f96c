"""The hyper-connection pre-norm GEMM on SM80 (reference: `hc_prenorm_ref.py`).

SGLang 0.5.16's DSV4 `mhc_pre` (every decoder layer, twice: before attention and before the MoE; also the
load-time prewarm) computes the mixing logits of the hc_mult residual streams and their sum of squares with
DeepGEMM's `tf32_hc_prenorm_gemm` whenever `SGLANG_OPT_DEEPGEMM_HC_PRENORM` is on (the default). DeepGEMM
ships that kernel for SM90 (wgmma) and SM100 only, so on an A800 the first forward — the prewarm, at load —
would fail. This kernel keeps the contract and the numerics class (TF32 products, fp32 accumulation) on what
SM80 has: `mma.sync` TF32 tensor cores.

    a [m, k] BF16, b [n, k] fp32 -> d [splits, m, n] fp32 partial products, sq [splits, m] fp32 partial
    sums of a^2 (num_splits None: d [m, n], sq [m])

One program per (64- or 16-row block, split); each split takes an equal share of K rounded to BLOCK_K (a
split past K writes zeros: the consumer adds every split); config inner_splits cuts each share again into
programs of their own, added in a fixed order before return. b is rounded to the nearest TF32 value in the
kernel (ties away from zero, `cvt.rna` semantics, in integer ops), as DeepGEMM's wgmma on the H200 reads it
(hc_prenorm_ref.py says how that was measured), so `tl.dot`'s own TF32 input conversion is exact and the
result does not depend on which conversion the compiler or the tensor core applies. No host logic depends
on values: capture-safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_K = 64


def default_config(m: int) -> dict:
    """Tiles by row count: 16-row blocks up to 16 rows (decode), else 64: the fastest of the tiles bench/mhc.py
    --variants times (its figures against DeepGEMM's: docs/results/README.md). Tiles change no result beyond fp32
    summation order."""
    return {"block_m": 16 if m <= 16 else 64, "block_k": BLOCK_K, "num_warps": 4, "num_stages": 3}


@triton.jit
def _hc_prenorm_kernel(a_ptr, b_ptr, d_ptr, s_ptr, M, N, K, outer_share, inner_share, INNER, stride_am, stride_bn,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (row block, split * INNER + j): rows x K in [split * outer_share + j * inner_share, + inner_share),
    clipped to its caller split's range and to K (INNER 1: the caller's splits as they are). A range past K writes
    zeros."""
    pid_m = tl.program_id(0)
    sub = tl.program_id(1)
    split = sub // INNER
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    outer_hi = tl.minimum(split * outer_share + outer_share, K)
    k_lo = split * outer_share + (sub % INNER) * inner_share
    k_hi = tl.minimum(k_lo + inner_share, outer_hi)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ks = k0 + offs_k
        k_ok = ks < k_hi
        a = tl.load(a_ptr + rows[:, None].to(tl.int64) * stride_am + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        b = tl.load(b_ptr + cols[None, :] * stride_bn + ks[:, None], mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        # TF32, nearest (rna); a NaN stays NaN (the add alone can wrap its bits round to a zero)
        b = tl.where(b == b, ((b.to(tl.int32, bitcast=True) + 0x1000) & -8192).to(tl.float32, bitcast=True), b)
        acc = tl.dot(a, b, acc, input_precision="tf32")
        sq += tl.sum(a * a, axis=1)
    out = (sub * M + rows).to(tl.int64)
    tl.store(d_ptr + out[:, None] * N + cols[None, :], acc, mask=row_ok[:, None] & col_ok[None, :])
    tl.store(s_ptr + out, sq, mask=row_ok)


def _check(cond: bool, what: str, found, expected):
    if not cond:
        raise ValueError(f"hc_prenorm: {what}: found {found}, expected {expected} "
                         "(the contract of DeepGEMM's tf32_hc_prenorm_gemm as SGLang 0.5.16 calls it)")


def hc_prenorm(a: torch.Tensor, b: torch.Tensor, d: torch.Tensor, sqrsum: torch.Tensor,
               num_splits: int | None = None, config: dict | None = None) -> None:
    """Fill d and sqrsum in place (shapes in the module docstring); config overrides default_config's tiles
    (block_m, block_k: powers of two >= 16; num_warps, num_stages) and may set inner_splits (default 1): each of
    the caller's splits cut into that many K shares more, as programs of their own, into a scratch buffer whose
    shares are then added in a fixed order (deterministic). For prefill, where mhc_pre asks for one split and 64-row
    blocks leave one program per SM (8192 tokens: 128 on an H200's 132 SMs) with one load stream each."""
    m, k = a.shape
    n = b.shape[0]
    splits = 1 if num_splits is None else int(num_splits)
    _check(splits >= 1, "num_splits", num_splits, ">= 1 or None")
    want_d = (m, n) if num_splits is None else (splits, m, n)
    want_s = (m,) if num_splits is None else (splits, m)
    _check(a.dtype == torch.bfloat16 and a.stride(-1) == 1, "a", f"{a.dtype} stride {a.stride()}",
           "BF16, K contiguous")
    _check(b.dtype == torch.float32 and b.shape[1] == k and b.is_contiguous(), "b", f"{b.dtype} {tuple(b.shape)}",
           f"contiguous fp32 [n, {k}]")
    _check(d.dtype == torch.float32 and tuple(d.shape) == want_d and d.is_contiguous(), "d",
           f"{d.dtype} {tuple(d.shape)}", f"contiguous fp32 {want_d}")
    _check(sqrsum.dtype == torch.float32 and tuple(sqrsum.shape) == want_s and sqrsum.is_contiguous(), "sqrsum",
           f"{sqrsum.dtype} {tuple(sqrsum.shape)}", f"contiguous fp32 {want_s}")
    if m == 0:
        return
    cfg = dict(default_config(m), **(config or {}))
    block_m, block_k = int(cfg["block_m"]), int(cfg["block_k"])
    for key in ("block_m", "block_k"):
        v = int(cfg[key])
        _check(v >= 16 and v & (v - 1) == 0, f"config {key}", v, "a power of two >= 16")
    inner = int(cfg.get("inner_splits", 1))
    _check(inner >= 1, "config inner_splits", inner, ">= 1")
    # the caller's split s covers K blocks [s * share, (s + 1) * share); its inner shares cut that range again,
    # so each of them is a sub-range of exactly one caller split and the fixed-order sum below rebuilds d's layout
    blocks_k = triton.cdiv(k, block_k)
    share = triton.cdiv(blocks_k, splits)
    k_share = triton.cdiv(share, inner) * block_k
    dd, ss = (d, sqrsum) if inner == 1 else (
        torch.empty((splits * inner, m, n), dtype=torch.float32, device=a.device),
        torch.empty((splits * inner, m), dtype=torch.float32, device=a.device))
    launch = dict(BLOCK_M=block_m, BLOCK_N=max(16, triton.next_power_of_2(n)), BLOCK_K=block_k,
                  num_warps=int(cfg["num_warps"]), num_stages=int(cfg["num_stages"]))
    _hc_prenorm_kernel[(triton.cdiv(m, block_m), splits * inner)](
        a_ptr=a, b_ptr=b, d_ptr=dd, s_ptr=ss, M=m, N=n, K=k, outer_share=share * block_k, inner_share=k_share,
        INNER=inner, stride_am=a.stride(0), stride_bn=b.stride(0), **launch)
    if inner == 1:
        return
    torch.sum(dd.view(splits, inner, m, n), dim=1, out=d.view(splits, m, n))
    torch.sum(ss.view(splits, inner, m), dim=1, out=sqrsum.view(splits, m))
