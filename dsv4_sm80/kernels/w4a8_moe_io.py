"""The W4A8 MoE's activation side, shared by its kernel families: the layer input's INT8 rounding (one launch), the
gate-up epilogue (clamped SiLU-GLU, the intermediate's INT8 rounding), split-K's finishing launch, and the top-k
combine (one launch).

Activations are quantized to INT8 dynamically, one fp32 scale per row (or row and group of columns), s = max|x| / 127
by IEEE division, half away from zero: the layer input per token, the intermediate per (token, expert) pair and
gate-up tile width, computed in the gate-up epilogue (no extra pass). The intermediate's rounding dominates the
error (silu(gate) * up is heavy-tailed); measured in tests/kernels/test_w4a8_moe.py against `w4a8_moe_ref.py`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import round_int8


@triton.jit
def _int8_scale(amax):
    """The INT8 scale of a group with max|x| = amax: amax / 127 by IEEE division, 1 for an all-zero group."""
    s = tl.math.div_rn(amax, 127.0)
    return tl.where(s > 0, s, 1.0)


@triton.jit
def _quantize_rows_kernel(x_ptr, stride_x, q_ptr, s_ptr, cols, BLOCK: tl.constexpr):
    """One row per program: its INT8 codes and its scale (IEEE division: bit-equal to the reference's round trip,
    `w4a8_moe_ref.int8_round_trip`)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < cols
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    s = _int8_scale(tl.max(tl.abs(x), axis=0))
    tl.store(q_ptr + row * cols + offs, round_int8(tl.math.div_rn(x, s)), mask=ok)
    tl.store(s_ptr + row, s)


def quantize_rows_int8(x: torch.Tensor):
    """x [rows, cols] -> (q int8 [rows, cols], s fp32 [rows, 1]) with x ~ q * s per row, in one launch."""
    rows, cols = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    q = torch.empty((rows, cols), dtype=torch.int8, device=x.device)
    s = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows:
        _quantize_rows_kernel[(rows,)](x, x.stride(0), q, s, cols, BLOCK=triton.next_power_of_2(cols),
                                       num_warps=4 if cols <= 1024 else 8)
    return q, s


@triton.jit
def _sum_pairs_kernel(y_ptr, out_ptr, h, scale, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    """out[t, cols] = (sum over the token's TOP_K pair rows of y) * scale, cast to out's dtype."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < h
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        acc += tl.load(y_ptr + (t * TOP_K + k) * h + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * h + offs, (acc * scale).to(out_ptr.dtype.element_ty), mask=ok)


def sum_pairs(y: torch.Tensor, res: torch.Tensor, top_k: int, scale: float) -> None:
    """res [T, H] = the sum of y's [T * top_k, H] pair rows per token, times the routed scaling (applied once)."""
    t, h = res.shape
    if t:
        _sum_pairs_kernel[(t, triton.cdiv(h, 1024))](y, res, h, float(scale), TOP_K=top_k, BLOCK=1024, num_warps=4)


@triton.jit
def _add_groups(acc, d0, d1, s0, s1, sa0, sa1, A_GROUP: tl.constexpr, ROWS: tl.constexpr):
    """acc plus one 64-deep K step's two group dots (d0, d1: exact, fp32) times their weight scales (s0, s1 per
    column), and times their activation scales (sa0, sa1) when those are per group (A_GROUP; else unused): the one
    order of fp32 operations every per-group loop keeps (the MMA and gemv kernels agree bit for bit in the
    interpreter). ROWS: acc, d0, d1 are [rows, columns] and sa per row; else [columns] and sa one value."""
    if ROWS:
        s0 = s0[None, :]
        s1 = s1[None, :]
        if A_GROUP:
            sa0 = sa0[:, None]
            sa1 = sa1[:, None]
    if A_GROUP:
        acc = acc + ((d0 * s0) * sa0 + (d1 * s1) * sa1)
    else:
        acc = acc + d0 * s0
        acc = acc + d1 * s1
    return acc


@triton.jit
def _glu_quant(acc, acc_up, n_ok, limit, SHIFT: tl.constexpr):
    """The gate-up epilogue: acc = the gate (already halved), acc_up = the up rows (still twice their value);
    the clamped SiLU-GLU (gate <= limit, |up| <= limit, silu(gate) * up), then INT8 per row over these columns
    (the scale the down kernel reads per K group). Returns (q int8, s fp32 per row)."""
    gate = tl.minimum(acc, limit)
    up = tl.minimum(tl.maximum(acc_up * 0.5, -limit), limit)
    h = gate * tl.sigmoid(gate) * up
    h = tl.where(n_ok[None, :], h, 0.0)
    s = tl.max(tl.abs(h), axis=1) / 127.0
    s = tl.where(s > 0, s, 1.0)
    if SHIFT:  # a NaN column (shift map not of these scales) must not vanish in the INT8 rounding
        s = tl.where(tl.max(((acc != acc) | (acc_up != acc_up)).to(tl.int32), axis=1) > 0, float("nan"), s)
    return round_int8(h / s[:, None]), s


@triton.jit
def _glu_finish_kernel(part_ptr, q_ptr, s_ptr, pairs, N, groups, limit,
                       SPLIT_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """Split-K gate-up: the SPLIT_K partial sums of BLOCK_R pair rows and one activation group of BLOCK_N
    columns added in share order (the same order every run), then the epilogue of the unsplit kernel."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    g = tl.program_id(1)
    offs_n = g * BLOCK_N + tl.arange(0, BLOCK_N)
    r_ok = r < pairs
    n_ok = offs_n < N
    ok = r_ok[:, None] & n_ok[None, :]
    acc = tl.zeros((BLOCK_R, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_R, BLOCK_N), dtype=tl.float32)
    for sk in tl.static_range(SPLIT_K):
        base = part_ptr + (sk * pairs + r[:, None].to(tl.int64)) * (2 * N) + offs_n[None, :]
        acc += tl.load(base, mask=ok, other=0.0)
        acc_up += tl.load(base + N, mask=ok, other=0.0)
    q, s = _glu_quant(acc, acc_up, n_ok, limit, False)
    tl.store(q_ptr + r[:, None].to(tl.int64) * N + offs_n[None, :], q, mask=ok)
    tl.store(s_ptr + r.to(tl.int64) * groups + g, s, mask=r_ok)


def glu_finish(part: torch.Tensor, hq: torch.Tensor, hs: torch.Tensor, limit: float, group: int) -> None:
    """Adds split-K's fp32 partials part [shares, pairs, 2, I] in share order into the intermediate hq [pairs, I]
    (INT8) and its scales hs [pairs, I / group]."""
    shares, pairs, _, inter = part.shape
    if pairs:
        _glu_finish_kernel[(triton.cdiv(pairs, 16), inter // group)](
            part, hq, hs, pairs, inter, inter // group, float(limit), SPLIT_K=shares, BLOCK_R=16, BLOCK_N=group,
            num_warps=4)
