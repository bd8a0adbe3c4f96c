"""SM80 writer of the main KV caches (BF16 `[slots, 512]`), replacing the FP8 FlashMLA store of 0.5.16's
JIT `fused_k_norm_rope_flashmla` (reference 02 §8 S2.1; reference: `kv_store_ref.py`).

For each new token: RMSNorm with the `kv_norm` weight (fp32), RoPE on the last 64 dims as interleaved
pairs, one rounding to BF16, stored at its cache slot; slot < 0 (out-of-window or padding rows) is
skipped. The input row may be a strided slice (`qkv_a[..., q_lora_rank:]`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import rope_table

HEAD_DIM = 512
ROPE_DIM = 64


@triton.jit
def _k_norm_rope_store_kernel(kv_ptr, stride_kv, w_ptr, freqs_ptr, pos_ptr, loc_ptr, cache_ptr, eps,
                              HALF: tl.constexpr, ROPE_PAIRS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    loc = tl.load(loc_ptr + row).to(tl.int64)
    if loc < 0:
        return
    i = tl.arange(0, HALF)
    base = kv_ptr + row * stride_kv
    x0 = tl.load(base + 2 * i).to(tl.float32)
    x1 = tl.load(base + 2 * i + 1).to(tl.float32)
    w0 = tl.load(w_ptr + 2 * i).to(tl.float32)
    w1 = tl.load(w_ptr + 2 * i + 1).to(tl.float32)
    r = 1.0 / tl.sqrt((tl.sum(x0 * x0, axis=0) + tl.sum(x1 * x1, axis=0)) / (2 * HALF) + eps)
    y0 = x0 * r * w0
    y1 = x1 * r * w1
    pos = tl.load(pos_ptr + row).to(tl.int64)
    rp = i - (HALF - ROPE_PAIRS)
    is_rope = rp >= 0
    rp = tl.where(is_rope, rp, 0)
    fr = tl.load(freqs_ptr + pos * (2 * ROPE_PAIRS) + 2 * rp, mask=is_rope, other=1.0)
    fi = tl.load(freqs_ptr + pos * (2 * ROPE_PAIRS) + 2 * rp + 1, mask=is_rope, other=0.0)
    out = cache_ptr + loc * (2 * HALF)
    tl.store(out + 2 * i, (y0 * fr - y1 * fi).to(cache_ptr.dtype.element_ty))
    tl.store(out + 2 * i + 1, (y0 * fi + y1 * fr).to(cache_ptr.dtype.element_ty))


def k_norm_rope_store(kv: torch.Tensor, weight: torch.Tensor, eps: float, freqs_cis: torch.Tensor,
                      positions: torch.Tensor, out_loc: torch.Tensor, cache: torch.Tensor) -> None:
    """kv [N, 512] (row stride free), weight [512], freqs_cis complex64 [max_pos, 32], positions [N],
    out_loc [N] (-1 = skip), cache BF16 [slots, 512] (a page buffer viewed flat is fine)."""
    n = kv.shape[0]
    if kv.shape[-1] != HEAD_DIM or kv.stride(-1) != 1:
        raise ValueError(f"kv must be [N, {HEAD_DIM}] with unit stride in its last dim, got {tuple(kv.shape)}")
    flat = cache.view(-1, HEAD_DIM)
    freqs = rope_table(freqs_cis)
    if freqs.shape[-1] != 2 or freqs.shape[-2] != ROPE_DIM // 2:
        raise ValueError(f"freqs_cis must be complex [max_pos, {ROPE_DIM // 2}], got {tuple(freqs_cis.shape)}")
    if n == 0:
        return
    _k_norm_rope_store_kernel[(n,)](kv, kv.stride(0), weight, freqs.contiguous(), positions, out_loc, flat,
                                    float(eps), HALF=HEAD_DIM // 2, ROPE_PAIRS=ROPE_DIM // 2)


@triton.jit
def _scatter_rows_kernel(src_ptr, stride_src, loc_ptr, dst_ptr, D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    loc = tl.load(loc_ptr + row).to(tl.int64)
    if loc < 0:
        return
    d = tl.arange(0, D)
    tl.store(dst_ptr + loc * D + d, tl.load(src_ptr + row * stride_src + d).to(dst_ptr.dtype.element_ty))


def scatter_rows(src: torch.Tensor, loc: torch.Tensor, cache: torch.Tensor) -> None:
    """cache.view(-1, D)[loc[i]] = src[i] for loc[i] >= 0; rows with loc < 0 are skipped. No host sync
    (unlike boolean indexing), so it is capture-safe."""
    d = src.shape[-1]
    if src.stride(-1) != 1 or d & (d - 1):
        raise ValueError(f"rows must have unit stride and a power-of-two width, got {tuple(src.shape)}")
    if src.shape[0]:
        _scatter_rows_kernel[(src.shape[0],)](src, src.stride(0), loc, cache.view(-1, d), D=d)
