"""SM80 writers of the main KV caches (BF16 `[slots, 512]`), replacing the FP8 FlashMLA store of 0.5.16's
JIT `fused_k_norm_rope_flashmla` (reference: `kv_store_ref.py`, `block_rounding_ref.py`).

For each new token: RMSNorm with the `kv_norm` weight (fp32), RoPE on the last 64 dims as interleaved
pairs, one rounding to BF16, stored at its cache slot; slot < 0 (out-of-window or padding rows) is
skipped. The input row may be a strided slice (`qkv_a[..., q_lora_rank:]`).

With `fp8_sim` (SGLANG_DSV4_A100_KV_ROUNDING=fp8_sim) every stored row also gets the model's own FP8
simulation of its 448 nope dims (blocks of 64, power-of-two scale, e4m3; `block_rounding.py`), applied to
the BF16 row as the model's `act_quant(kv[..., :-64], 64, inplace=True)` applies it to its BF16 tensor; the
result is exact in BF16, so the cache layout does not change. `round_planned_rows_` does the same in place
for the compressed rows SGLang's own JIT stored from a compress plan.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .block_rounding import fp8_block_exp, fp8_sim
from .common import rope_table
from .compress_plan import planned_slot

HEAD_DIM = 512
ROPE_DIM = 64


@triton.jit
def _fp8_sim_row_blocks(x):
    """x [8, 64] fp32 (a 512-wide row by blocks of 64): the 7 nope blocks FP8-simulated, the last (rope) as is."""
    e = fp8_block_exp(tl.max(tl.abs(x), axis=1))
    nope = tl.arange(0, x.shape[0]) < x.shape[0] - 1
    return tl.where(nope[:, None], fp8_sim(x, e[:, None]), x)


@triton.jit
def _k_norm_rope_store_kernel(kv_ptr, stride_kv, w_ptr, freqs_ptr, pos_ptr, loc_ptr, cache_ptr, eps,
                              HALF: tl.constexpr, ROPE_PAIRS: tl.constexpr, FP8_SIM: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    loc = tl.load(loc_ptr + row).to(tl.int64)
    if loc < 0:
        return
    # pair index i (dims 2i, 2i+1) as [HALF / 32, 32]: row b of the tile is the 64-dim block b of the row
    i = tl.arange(0, HALF // 32)[:, None] * 32 + tl.arange(0, 32)[None, :]
    base = kv_ptr + row * stride_kv
    x0 = tl.load(base + 2 * i).to(tl.float32)
    x1 = tl.load(base + 2 * i + 1).to(tl.float32)
    w0 = tl.load(w_ptr + 2 * i).to(tl.float32)
    w1 = tl.load(w_ptr + 2 * i + 1).to(tl.float32)
    ss = tl.sum(tl.sum(x0 * x0, axis=1), axis=0) + tl.sum(tl.sum(x1 * x1, axis=1), axis=0)
    r = 1.0 / tl.sqrt(ss / (2 * HALF) + eps)
    y0 = x0 * r * w0
    y1 = x1 * r * w1
    pos = tl.load(pos_ptr + row).to(tl.int64)
    rp = i - (HALF - ROPE_PAIRS)
    is_rope = rp >= 0
    rp = tl.where(is_rope, rp, 0)
    fr = tl.load(freqs_ptr + pos * (2 * ROPE_PAIRS) + 2 * rp, mask=is_rope, other=1.0)
    fi = tl.load(freqs_ptr + pos * (2 * ROPE_PAIRS) + 2 * rp + 1, mask=is_rope, other=0.0)
    out0 = (y0 * fr - y1 * fi).to(cache_ptr.dtype.element_ty)
    out1 = (y0 * fi + y1 * fr).to(cache_ptr.dtype.element_ty)
    if FP8_SIM:  # on the stored (BF16) values, as the model rounds its BF16 row
        v0 = out0.to(tl.float32)
        v1 = out1.to(tl.float32)
        e = fp8_block_exp(tl.maximum(tl.max(tl.abs(v0), axis=1), tl.max(tl.abs(v1), axis=1)))
        nope = tl.arange(0, HALF // 32) < (HALF - ROPE_PAIRS) // 32
        out0 = tl.where(nope[:, None], fp8_sim(v0, e[:, None]), v0).to(cache_ptr.dtype.element_ty)
        out1 = tl.where(nope[:, None], fp8_sim(v1, e[:, None]), v1).to(cache_ptr.dtype.element_ty)
    out = cache_ptr + loc * (2 * HALF)
    tl.store(out + 2 * i, out0)
    tl.store(out + 2 * i + 1, out1)


def k_norm_rope_store(kv: torch.Tensor, weight: torch.Tensor, eps: float, freqs_cis: torch.Tensor,
                      positions: torch.Tensor, out_loc: torch.Tensor, cache: torch.Tensor,
                      fp8_sim: bool = False) -> None:
    """kv [N, 512] (row stride free), weight [512], freqs_cis complex64 [max_pos, 32], positions [N],
    out_loc [N] (-1 = skip), cache BF16 [slots, 512] (a page buffer viewed flat is fine); fp8_sim: the
    model's FP8 simulation of the nope dims on the stored row."""
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
                                    float(eps), HALF=HEAD_DIM // 2, ROPE_PAIRS=ROPE_DIM // 2, FP8_SIM=bool(fp8_sim))


@triton.jit
def _scatter_rows_kernel(src_ptr, stride_src, loc_ptr, dst_ptr, D: tl.constexpr, FP8_SIM: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    loc = tl.load(loc_ptr + row).to(tl.int64)
    if loc < 0:
        return
    if FP8_SIM:  # D = 512: the row as [8, 64] blocks, rounded to the cache dtype first
        d2 = tl.arange(0, D // 64)[:, None] * 64 + tl.arange(0, 64)[None, :]
        x = tl.load(src_ptr + row * stride_src + d2).to(dst_ptr.dtype.element_ty).to(tl.float32)
        tl.store(dst_ptr + loc * D + d2, _fp8_sim_row_blocks(x).to(dst_ptr.dtype.element_ty))
    else:
        d = tl.arange(0, D)
        tl.store(dst_ptr + loc * D + d, tl.load(src_ptr + row * stride_src + d).to(dst_ptr.dtype.element_ty))


def scatter_rows(src: torch.Tensor, loc: torch.Tensor, cache: torch.Tensor, fp8_sim: bool = False) -> None:
    """cache.view(-1, D)[loc[i]] = src[i] for loc[i] >= 0; rows with loc < 0 are skipped. No host sync
    (unlike boolean indexing), so it is capture-safe. fp8_sim (512-wide key rows only): each row as the
    model stores it, its nope dims FP8-simulated on the cache-dtype row."""
    d = src.shape[-1]
    if src.stride(-1) != 1 or d & (d - 1):
        raise ValueError(f"rows must have unit stride and a power-of-two width, got {tuple(src.shape)}")
    if fp8_sim and d != HEAD_DIM:
        raise ValueError(f"the FP8 simulation rounds {HEAD_DIM}-wide key rows, got width {d}")
    if src.shape[0]:
        _scatter_rows_kernel[(src.shape[0],)](src, src.stride(0), loc, cache.view(-1, d), D=d,
                                              FP8_SIM=bool(fp8_sim))


@triton.jit
def _round_planned_rows_kernel(cache_ptr, plan_ptr, out_loc_ptr, IS_DECODE: tl.constexpr, RATIO: tl.constexpr):
    r = tl.program_id(0)
    stores, slot, _ = planned_slot(plan_ptr, r, True, out_loc_ptr, IS_DECODE, RATIO)
    if stores:
        d2 = tl.arange(0, 8)[:, None] * 64 + tl.arange(0, 64)[None, :]
        ptr = cache_ptr + slot.to(tl.int64) * 512 + d2
        x = tl.load(ptr).to(tl.float32)
        tl.store(ptr, _fp8_sim_row_blocks(x).to(cache_ptr.dtype.element_ty))


def round_planned_rows_(cache: torch.Tensor, plan_rows: torch.Tensor, n_rows: int, is_decode: bool,
                        out_loc: torch.Tensor, ratio: int) -> None:
    """The model's FP8 simulation, in place, on the BF16 key rows [slots, 512] of `cache` that a compress
    plan's first n_rows rows stored (`compress_plan.py`): one program per plan row, each slot written once
    per plan, so no two programs touch a row; capture-safe."""
    if n_rows == 0:
        return
    plan = plan_rows.contiguous().view(torch.int32).reshape(-1, 4)
    if plan.shape[0] < n_rows:
        raise ValueError(f"the plan has {plan.shape[0]} rows for {n_rows} compressed rows")
    _round_planned_rows_kernel[(n_rows,)](cache.view(-1, HEAD_DIM), plan, out_loc, IS_DECODE=bool(is_decode),
                                          RATIO=int(ratio))
