"""The W4A8 MoE on INT8 tensor cores: (token, expert) pairs sorted by expert into M blocks, each block a grouped
GEMM tile whose 4-bit codes are decoded to INT8 operands in the K loop (`tl.dot` on int8 lowers to
`mma.sync ... s8.s8.s32` on SM80). The table (`w4a8_moe_table.py`) runs it from 33 tokens on.

Two K loops, chosen per tile at run time:
- per group: each 32-deep INT8 dot is exact in int32, converted to fp32 and scaled by its own group's power of two
  (exact on the weight side, no condition);
- shift (`Mma.shift` and the layer's shift maps, `shift_refs`): a tile whose columns (gate and up rows) are all
  shiftable decodes q * 2^(e - e_ref) and accumulates in int32 over the whole K (gate-up: one activation scale per
  token) or over each activation group (down: the gate-up tile width, a multiple of 64), then one int32 -> fp32
  conversion times 2^(e_ref - 127) (|sum| <= 127 * 96 * K < 2^31 for K < 176k). A map that does not belong to the
  scales (a shift outside 0..3) gives NaN, never a silent number. Fewer instructions per IMMA and no I2F in the
  gate-up loop (sm_80 SASS, `bench/sass_census.py`), which pays in the prefill tiles only.

Gate-up computes the gate (rows [0, I)) and up (rows [I, 2I)) tiles of the same columns together and runs the GLU
epilogue (`w4a8_moe_io._glu_quant`); the down kernel multiplies by the router weight and stores per-pair rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from .w4a8_moe_io import _add_groups, _glu_quant
from .w4a8_moe_layout import CHUNK, GROUP, _col_base, _e8m0, _load_codes, _scale_bytes, _scale_word, _word_scales


@dataclass(frozen=True)
class Mma:
    """One tile configuration of `_w4a8_moe_kernel`: block_m x block_n (gate-up; block_n is also the intermediate's
    INT8 group) and block_m x block_n2 (down), warps and pipeline stages, the shift loop where the maps allow it,
    and the per-pair outputs kept in BF16 before the fp32 top-k sum (Marlin's way: half the bytes of the largest
    prefill buffer, one BF16 rounding per pair)."""
    block_m: int
    block_n: int
    block_n2: int
    warps: int
    stages: int
    shift: bool = False
    pair_bf16: bool = False

    @property
    def group(self) -> int:
        return self.block_n

    def check(self, h: int, inter: int) -> None:
        if self.block_n % GROUP or self.block_n > 256 or inter % self.block_n:
            raise ValueError(f"w4a8_moe {self}: block_n must be a multiple of {GROUP} up to 256 that divides the "
                             f"intermediate {inter}; pick another tile")


@triton.jit
def _shift_step(a0, a1, b_ptrs, s_ptrs, eref, n_ok, iacc, bad, DECODE_ASM: tl.constexpr):
    """Shift loop, one 64-deep K step: both groups' codes times 2^(e - eref) (the column's reference exponent), INT8
    dots accumulated straight into the int32 `iacc`. `bad` collects, per column, any shift outside 0..3 (a map that
    does not belong to these scales): the result is made NaN there, never silently wrong."""
    e0, e1 = _scale_bytes(s_ptrs, n_ok)
    d0 = e0 - eref
    d1 = e1 - eref
    bad = bad | tl.where(n_ok, (d0 | d1) & ~3, 0)
    mul = (1 << (d0 & 3)) | ((1 << (d1 & 3)) << 4)
    lo, hi = _load_codes(b_ptrs, n_ok, mul, DECODE_ASM, True)
    iacc = tl.dot(a0, lo, iacc, out_dtype=tl.int32)
    iacc = tl.dot(a1, hi, iacc, out_dtype=tl.int32)
    return iacc, bad


@triton.jit
def _shift_chunk(k0, a_ptr, a_rows, row_ok, stride_am, b_base, bs_base, offs_n, n_ok, er, er_up, N, stride_bn,
                 stride_bsn, iacc, iacc_up, bad, GATED: tl.constexpr, DECODE_ASM: tl.constexpr):
    """The 64-deep K step at k0 of the shift loop: activation loads shared by the gate and up tiles."""
    offs_j = tl.arange(0, 32)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + (k0 + offs_j)[None, :]
    a0 = tl.load(a_ptrs, mask=row_ok[:, None], other=0)
    a1 = tl.load(a_ptrs + 32, mask=row_ok[:, None], other=0)
    b_ptrs = b_base + _col_base(offs_n, stride_bn)[None, :] + (k0 * 16 + offs_j)[:, None]
    s_ptrs = bs_base + offs_n * stride_bsn + k0 // 32
    iacc, bad = _shift_step(a0, a1, b_ptrs, s_ptrs, er, n_ok, iacc, bad, DECODE_ASM)
    if GATED:  # the up rows of the same columns sit N rows further
        iacc_up, bad = _shift_step(a0, a1, b_ptrs + N * stride_bn, s_ptrs + N * stride_bsn, er_up, n_ok, iacc_up,
                                   bad, DECODE_ASM)
    return iacc, iacc_up, bad


@triton.jit
def _shift_loop(a_ptr, a_scale_ptr, a_rows, row_ok, stride_am, a_scale_groups, b_base, bs_base, offs_n, n_ok,
                er, er_up, N, K, stride_bn, stride_bsn,
                GATED: tl.constexpr, A_GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                DECODE_ASM: tl.constexpr):
    """The whole K for a tile whose columns are all shiftable: int32 accumulation, one int32 -> fp32 conversion per
    activation-scale change (A_GROUP = 0: once at the end; else per A_GROUP columns of K, a multiple of 64 up to
    256), times 2^(eref - 127) per column at the end. Returns fp32 (gate, up) as the per-group loop does: the
    per-row activation scale for A_GROUP = 0 is still to be applied."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    bad = tl.zeros((BLOCK_N,), dtype=tl.int32)
    iacc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    iacc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    if A_GROUP == 0:  # one activation scale per row: the whole K in int32
        for k0 in range(0, K, 64):
            iacc, iacc_up, bad = _shift_chunk(k0, a_ptr, a_rows, row_ok, stride_am, b_base, bs_base, offs_n, n_ok,
                                              er, er_up, N, stride_bn, stride_bsn, iacc, iacc_up, bad,
                                              GATED, DECODE_ASM)
        acc = iacc.to(tl.float32)
        acc_up = iacc_up.to(tl.float32)
    else:  # one conversion per A_GROUP columns of K, times that group's activation scale
        for kg in range(0, K, A_GROUP):
            iacc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
            iacc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
            for kk in tl.static_range(0, A_GROUP, 64):
                iacc, iacc_up, bad = _shift_chunk(kg + kk, a_ptr, a_rows, row_ok, stride_am, b_base, bs_base,
                                                  offs_n, n_ok, er, er_up, N, stride_bn, stride_bsn, iacc,
                                                  iacc_up, bad, GATED, DECODE_ASM)
            sa = tl.load(a_scale_ptr + a_rows * a_scale_groups + kg // A_GROUP, mask=row_ok, other=0.0)
            acc += iacc.to(tl.float32) * sa[:, None]
            acc_up += iacc_up.to(tl.float32) * sa[:, None]
    acc = tl.where(bad[None, :] != 0, float("nan"), acc * _e8m0(er)[None, :])
    if GATED:
        acc_up = tl.where(bad[None, :] != 0, float("nan"), acc_up * _e8m0(er_up)[None, :])
    return acc, acc_up


@triton.jit
def _w4_dots(a0, a1, b_ptrs, s_ptrs, n_ok, DECODE_ASM: tl.constexpr):
    """One 64-deep K step against one byte tile, per group: the two 32-deep INT8 dots (k0..k0+31 and
    k0+32..k0+63) as exact fp32 values, and their groups' E8M0 weight scales."""
    s0, s1 = _word_scales(_scale_word(s_ptrs, n_ok))
    lo, hi = _load_codes(b_ptrs, n_ok, 0, DECODE_ASM, False)
    d0 = tl.dot(a0, lo, out_dtype=tl.int32).to(tl.float32)
    d1 = tl.dot(a1, hi, out_dtype=tl.int32).to(tl.float32)
    return d0, d1, s0, s1


@triton.jit
def _group_loop(a_ptr, a_scale_ptr, a_rows, row_ok, stride_am, a_scale_groups, b_base, bs_base, offs_n, n_ok,
                N, K, stride_bn, stride_bsn, GATED: tl.constexpr, A_GROUP: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DECODE_ASM: tl.constexpr):
    """The exact per-group loop over K: each 32-deep dot converted to fp32 and scaled by its own group's power of
    two. Returns fp32 (gate, up); the per-row activation scale for A_GROUP = 0 is still to be applied."""
    offs_j = tl.arange(0, 32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, 64):
        a_ptrs = a_ptr + a_rows[:, None] * stride_am + (k0 + offs_j)[None, :]
        a0 = tl.load(a_ptrs, mask=row_ok[:, None], other=0)
        a1 = tl.load(a_ptrs + 32, mask=row_ok[:, None], other=0)
        sa0 = 0.0  # (per-row activation scale: applied after the loop)
        sa1 = 0.0
        if A_GROUP:  # activation scale per (row, group of A_GROUP columns of K; a multiple of 32)
            sa0 = tl.load(a_scale_ptr + a_rows * a_scale_groups + k0 // A_GROUP, mask=row_ok, other=0.0)
            sa1 = tl.load(a_scale_ptr + a_rows * a_scale_groups + (k0 + 32) // A_GROUP, mask=row_ok, other=0.0)
        b_ptrs = b_base + _col_base(offs_n, stride_bn)[None, :] + (k0 * 16 + offs_j)[:, None]
        s_ptrs = bs_base + offs_n * stride_bsn + k0 // 32
        d0, d1, s0, s1 = _w4_dots(a0, a1, b_ptrs, s_ptrs, n_ok, DECODE_ASM)
        acc = _add_groups(acc, d0, d1, s0, s1, sa0, sa1, A_GROUP, True)
        if GATED:  # the up rows of the same columns sit N rows further
            d0, d1, s0, s1 = _w4_dots(a0, a1, b_ptrs + N * stride_bn, s_ptrs + N * stride_bsn, n_ok, DECODE_ASM)
            acc_up = _add_groups(acc_up, d0, d1, s0, s1, sa0, sa1, A_GROUP, True)
    return acc, acc_up


@triton.jit
def _moe_epilogue(acc, acc_up, ids, row_ok, a_rows, offs_n, n_ok, pid_n, a_scale_ptr, c_ptr, c_scale_ptr, topk_w_ptr,
                  N, limit, stride_cm, c_scale_groups, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr,
                  A_GROUP: tl.constexpr, SHIFT: tl.constexpr):
    """An MMA tile's (gate, up) or down sums [BLOCK_M, BLOCK_N] of twice the E2M1 values to its outputs: the per-row
    activation scale (A_GROUP 0), the halving, then the clamped SiLU-GLU and the intermediate's INT8 quantization per
    BLOCK_N columns (gate-up), or the top-k weight and the pair rows (down)."""
    if not A_GROUP:  # one activation scale per row
        sa = tl.load(a_scale_ptr + a_rows, mask=row_ok, other=0.0)
        acc = acc * sa[:, None]
        acc_up = acc_up * sa[:, None]
    acc = acc * 0.5  # the codes were twice the E2M1 values
    out_rows = tl.where(row_ok, ids, 0).to(tl.int64)
    if GATED:
        q, s = _glu_quant(acc, acc_up, n_ok, limit, SHIFT)
        tl.store(c_ptr + out_rows[:, None] * stride_cm + offs_n[None, :], q,
                 mask=row_ok[:, None] & n_ok[None, :])
        tl.store(c_scale_ptr + out_rows * c_scale_groups + pid_n, s, mask=row_ok)
    else:
        if MUL_WEIGHT:
            w = tl.load(topk_w_ptr + out_rows, mask=row_ok, other=0.0)
            acc = acc * w[:, None]
        tl.store(c_ptr + out_rows[:, None] * stride_cm + offs_n[None, :], acc.to(c_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _w4a8_moe_kernel(
    a_ptr, a_scale_ptr, b_ptr, bs_ptr, c_ptr, c_scale_ptr,
    sorted_ids_ptr, block_expert_ptr, num_padded_ptr, topk_w_ptr, eref_ptr,
    N, K, num_pairs, a_row_div, a_scale_groups, limit,
    stride_am, stride_be, stride_bn, stride_bse, stride_bsn, stride_cm, c_scale_groups, stride_ere,
    GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr, A_GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DECODE_ASM: tl.constexpr = False, SHIFT: tl.constexpr = False,
):
    """Program (M block of one expert's sorted pairs, BLOCK_N columns). SHIFT: eref_ptr is the shift map [E, N (x2
    gated: gate rows, then up rows)]; a tile whose columns are all shiftable runs `_shift_loop` (A_GROUP must then be
    0 or a multiple of 64), any other the per-group loop."""
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BLOCK_N)
    pid_m = pid // n_tiles
    pid_n = pid % n_tiles
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    ids = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    row_ok = ids < num_pairs
    a_rows = tl.where(row_ok, ids // a_row_div, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N

    b_base = b_ptr + expert * stride_be
    bs_base = bs_ptr + expert * stride_bse
    if SHIFT:  # the tile's columns (gate and up rows) all shiftable: int32 accumulation, else per group
        er = tl.load(eref_ptr + expert * stride_ere + offs_n, mask=n_ok, other=1).to(tl.int32) & 0xFF
        er_up = er
        tile_ok = tl.min(er, axis=0) > 0
        if GATED:
            er_up = tl.load(eref_ptr + expert * stride_ere + N + offs_n, mask=n_ok, other=1).to(tl.int32) & 0xFF
            tile_ok = tile_ok & (tl.min(er_up, axis=0) > 0)
        if tile_ok:
            acc, acc_up = _shift_loop(a_ptr, a_scale_ptr, a_rows, row_ok, stride_am, a_scale_groups, b_base, bs_base,
                                      offs_n, n_ok, er, er_up, N, K, stride_bn, stride_bsn,
                                      GATED, A_GROUP, BLOCK_M, BLOCK_N, DECODE_ASM)
        else:
            acc, acc_up = _group_loop(a_ptr, a_scale_ptr, a_rows, row_ok, stride_am, a_scale_groups, b_base, bs_base,
                                      offs_n, n_ok, N, K, stride_bn, stride_bsn,
                                      GATED, A_GROUP, BLOCK_M, BLOCK_N, DECODE_ASM)
    else:
        acc, acc_up = _group_loop(a_ptr, a_scale_ptr, a_rows, row_ok, stride_am, a_scale_groups, b_base, bs_base,
                                  offs_n, n_ok, N, K, stride_bn, stride_bsn,
                                  GATED, A_GROUP, BLOCK_M, BLOCK_N, DECODE_ASM)
    _moe_epilogue(acc, acc_up, ids, row_ok, a_rows, offs_n, n_ok, pid_n, a_scale_ptr, c_ptr, c_scale_ptr, topk_w_ptr,
                  N, limit, stride_cm, c_scale_groups, GATED, MUL_WEIGHT, A_GROUP, SHIFT)


def mma_moe(cfg: Mma, xq, xs, w, aligned, topk_w, hq, hs, y, top_k: int, limit: float, decode_asm: bool) -> None:
    """Gate-up then down for the pairs of `aligned` (sorted_ids, block_expert, num_padded: `w4a8_moe._align` with
    block_m): the INT8 input xq [T, H] with its scales xs [T, 1] -> the intermediate hq [pairs, I] and its scales
    hs -> the per-pair outputs y [pairs, H] times their router weights. w: `w4a8_moe.Experts`."""
    sorted_ids, block_expert, num_padded = aligned
    blocks = block_expert.numel()
    inter, h = hq.shape[1], y.shape[1]
    pairs = hq.shape[0]
    shift_up = cfg.shift and w.w13_eref is not None and h * 127 * 96 < 2**31
    shift_down = cfg.shift and w.w2_eref is not None and cfg.block_n % CHUNK == 0 and inter * 127 * 96 < 2**31
    _w4a8_moe_kernel[(blocks * triton.cdiv(inter, cfg.block_n),)](
        a_ptr=xq, a_scale_ptr=xs, b_ptr=w.w13, bs_ptr=w.w13_scale, c_ptr=hq, c_scale_ptr=hs, sorted_ids_ptr=sorted_ids,
        block_expert_ptr=block_expert, num_padded_ptr=num_padded, topk_w_ptr=topk_w,
        eref_ptr=w.w13_eref if shift_up else w.w13_scale, N=inter, K=h, num_pairs=pairs, a_row_div=top_k,
        a_scale_groups=xs.shape[1], limit=float(limit), stride_am=xq.stride(0), stride_be=w.w13.stride(0),
        stride_bn=w.w13.stride(1), stride_bse=w.w13_scale.stride(0), stride_bsn=w.w13_scale.stride(1),
        stride_cm=hq.stride(0), c_scale_groups=hs.shape[1], stride_ere=w.w13_eref.stride(0) if shift_up else 0,
        GATED=True, MUL_WEIGHT=False, A_GROUP=0, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, DECODE_ASM=decode_asm,
        SHIFT=shift_up, num_warps=cfg.warps, num_stages=cfg.stages)
    _w4a8_moe_kernel[(blocks * triton.cdiv(h, cfg.block_n2),)](
        a_ptr=hq, a_scale_ptr=hs, b_ptr=w.w2, bs_ptr=w.w2_scale, c_ptr=y, c_scale_ptr=y, sorted_ids_ptr=sorted_ids,
        block_expert_ptr=block_expert, num_padded_ptr=num_padded, topk_w_ptr=topk_w,
        eref_ptr=w.w2_eref if shift_down else w.w2_scale, N=h, K=inter, num_pairs=pairs, a_row_div=1,
        a_scale_groups=hs.shape[1], limit=0.0, stride_am=hq.stride(0), stride_be=w.w2.stride(0),
        stride_bn=w.w2.stride(1), stride_bse=w.w2_scale.stride(0), stride_bsn=w.w2_scale.stride(1),
        stride_cm=y.stride(0), c_scale_groups=0, stride_ere=w.w2_eref.stride(0) if shift_down else 0, GATED=False,
        MUL_WEIGHT=True, A_GROUP=cfg.block_n, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n2, DECODE_ASM=decode_asm,
        SHIFT=shift_down, num_warps=cfg.warps, num_stages=cfg.stages)
