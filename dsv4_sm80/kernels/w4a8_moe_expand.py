"""The W4A8 MoE for large prefill batches (the table runs it above 8192 tokens where every column of the layer is
shiftable): each call decodes every expert's codes once into a transient INT8 workspace (the shift loop's integers,
q * 2^(e - e_ref)), a share of the experts at a time, and runs the GEMMs as plain INT8 grouped GEMMs whose K loop
only loads and multiplies (pipelined operand loads, no decode). The 4-bit MMA tile decodes every weight tile again
for each M tile of its expert (about 6 times per expert at 16K tokens, top-6 over 256 experts). The codes stay 4-bit
resident; the workspace is a transient of the call (torch's caching allocator), as SGLang's own intermediate caches
are.

The same int32 sums and fp32 steps as the MMA kernel's shift loop: bit-equal to it; a column the map marks
unshiftable, or a map not of these scales, gives NaN, never a number.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .w4a8_moe_layout import _DECODE_SHIFT_ASM_C, CHUNK, TILE_COLS, _col_base, _e2m1x2, _e8m0, _scale_bytes
from .w4a8_moe_mma import Mma, _moe_epilogue

EXPAND_TOKENS = 8192  # the table's expanded row: above this many tokens a forward (at top-6, 49,152 pairs)


@dataclass(frozen=True)
class Expand:
    """The expanded GEMMs' tile (`tile`: block_m, block_n (gate-up), block_n2 (down), warps, stages; its shift and
    pair_bf16 as the MMA tile's), the gate-up's K step `block_k` (the down launch steps by block_n, its activation
    group), and the workspace, `workspace_mb` MiB of experts at a time."""
    tile: Mma
    block_k: int = 128
    workspace_mb: int = 512

    @property
    def group(self) -> int:
        return self.tile.block_n

    def check(self, h: int, inter: int) -> None:
        self.tile.check(h, inter)
        why = [msg for bad, msg in (
            (self.tile.block_n % CHUNK or self.tile.block_n > 256, f"block_n a multiple of {CHUNK} up to 256 (the "
                                                                   "down launch's K step)"),
            (self.block_k % CHUNK or self.block_k > 256 or h % self.block_k, f"block_k a multiple of {CHUNK} up to "
                                                                             f"256 that divides hidden {h}"),
            (max(h, inter) * 127 * 96 >= 2**31, "int32 sums that cannot overflow (K < 176k)")) if bad]
        if why:
            raise ValueError(f"w4a8_moe {self} needs {'; '.join(why)}")


@triton.jit
def _expand_word_alu(w, m0, m1):
    """One repacked word (8 codes: nibbles 0-3 of the chunk's first scale group, 4-7 of its second) -> two int32
    words of four INT8 each: twice the E2M1 values times m0 (first group) and m1 (second), elementwise (the
    interpreter's form of the shift decoder)."""
    lo = tl.zeros(w.shape, dtype=tl.int32)
    hi = tl.zeros(w.shape, dtype=tl.int32)
    for i in tl.static_range(4):
        lo = lo | (((_e2m1x2((w >> (4 * i)) & 0xF) * m0) & 0xFF) << (8 * i))
        hi = hi | (((_e2m1x2((w >> (16 + 4 * i)) & 0xF) * m1) & 0xFF) << (8 * i))
    return lo, hi


@triton.jit
def _expand_kernel(b_ptr, bs_ptr, eref_ptr, w8_ptr, ok_ptr, K, expert_lo, stride_be, stride_bn, stride_bse,
                   stride_bsn, stride_ere, stride_we, stride_wn, stride_oke,
                   BLOCK_N: tl.constexpr, DECODE_ASM: tl.constexpr):
    """Program (expert e_lo + program_id(1), BLOCK_N columns): every K chunk of those columns' codes times 2^(e - e_ref)
    as INT8, written row-major [N, K] into the workspace (w8 [experts, N, K] as int32 words), and ok [experts, N]:
    the column's e_ref where every shift is in 0..3, else 0 (an unshiftable column, or a map not of these scales: the
    GEMM then gives NaN for it, never a number)."""
    e_loc = tl.program_id(1)
    expert = (expert_lo + e_loc).to(tl.int64)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_q = tl.arange(0, 8)
    er = tl.load(eref_ptr + expert * stride_ere + offs_n).to(tl.int32) & 0xFF
    bad = tl.where(er == 0, 1, 0)
    src = (b_ptr + expert * stride_be + _col_base(offs_n, stride_bn)).to(tl.pointer_type(tl.int32))
    s_ptrs = bs_ptr + expert * stride_bse + offs_n * stride_bsn
    dst = (w8_ptr + e_loc.to(tl.int64) * stride_we).to(tl.pointer_type(tl.int32)) \
        + (offs_n.to(tl.int64) * (stride_wn // 4))[None, :] + offs_q[:, None]
    for k0 in range(0, K, 64):
        words = tl.load(src[None, :] + k0 * 4 + offs_q[:, None])  # [8 words, BLOCK_N] of this K chunk
        e0, e1 = _scale_bytes(s_ptrs + k0 // 32, offs_n >= 0)
        d0 = e0 - er
        d1 = e1 - er
        bad = bad | ((d0 | d1) & ~3)
        m0 = 1 << (d0 & 3)
        m1 = 1 << (d1 & 3)
        if DECODE_ASM:
            mul = tl.broadcast_to((m0 | (m1 << 4))[None, :], words.shape)
            lo, hi = tl.inline_asm_elementwise(_DECODE_SHIFT_ASM_C, "=r,=r,r,r", [words, mul],
                                               dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
        else:
            lo, hi = _expand_word_alu(words, m0[None, :], m1[None, :])
        tl.store(dst + k0 // 4, lo)  # k0 + 4q .. +3
        tl.store(dst + k0 // 4 + 8, hi)  # k0 + 32 + 4q .. +3
    tl.store(ok_ptr + e_loc.to(tl.int64) * stride_oke + offs_n, tl.where(bad == 0, er, 0).to(tl.uint8))


def expand_share(e: int, two_i: int, h: int, expand_mb: int = 512) -> tuple[int, int, int]:
    """The workspace for `e` experts of gate-up [two_i, h] (the larger of the two weights; down [h, two_i / 2] reuses
    it): (experts per share, bytes of the share's INT8 weights, bytes of its per-row map)."""
    share = max(1, min(e, int(expand_mb) * 2**20 // (two_i * h)))
    return share, share * two_i * h, share * max(two_i, h)


def expand_experts(w, scale, eref, w8, ok, e0: int, n_e: int, decode_asm: bool) -> None:
    """`_expand_kernel` for experts e0 .. e0 + n_e - 1 of one weight (uint8 views of the kernel layout's bytes [E, N,
    K/2], its E8M0 scale bytes [E, N, K/32] and shift map [E, N]) into w8 [>= n_e, N, K] int8 and ok [>= n_e, N]."""
    _expand_kernel[(w8.shape[1] // TILE_COLS, n_e)](
        b_ptr=w, bs_ptr=scale, eref_ptr=eref, w8_ptr=w8, ok_ptr=ok, K=w8.shape[2], expert_lo=e0, stride_be=w.stride(0),
        stride_bn=w.stride(1), stride_bse=scale.stride(0), stride_bsn=scale.stride(1), stride_ere=eref.stride(0),
        stride_we=w8.stride(0), stride_wn=w8.stride(1), stride_oke=ok.stride(0), BLOCK_N=TILE_COLS,
        DECODE_ASM=decode_asm, num_warps=2)


@triton.jit
def _w8_moe_kernel(
    a_ptr, a_scale_ptr, w8_ptr, ok_ptr, c_ptr, c_scale_ptr, sorted_ids_ptr, block_expert_ptr, num_padded_ptr,
    topk_w_ptr, N, K, num_pairs, a_row_div, a_scale_groups, limit, expert_lo, expert_hi,
    stride_am, stride_we, stride_wn, stride_oke, stride_cm, c_scale_groups,
    GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr, A_GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """`_w4a8_moe_kernel`'s shift loop on expanded weights (w8 [experts expert_lo.., N (x2 gated), K] INT8, ok the
    columns' e_ref or 0): the same int32 sums (gate-up over the whole K; down per activation group, BLOCK_K =
    A_GROUP) and the same fp32 steps after them; blocks of experts outside [expert_lo, expert_hi) return at once
    (the workspace holds one share of the experts per launch)."""
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BLOCK_N)
    pid_m = pid // n_tiles
    pid_n = pid % n_tiles
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if (expert < expert_lo) | (expert >= expert_hi):
        return
    ids = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = ids < num_pairs
    a_rows = tl.where(row_ok, ids // a_row_div, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    e_loc = expert - expert_lo
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
    b_ptrs = w8_ptr + e_loc * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    up = N * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if A_GROUP == 0:  # one activation scale per row: the whole K in int32
        iacc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        iacc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        for k0 in range(0, K, BLOCK_K):
            a = tl.load(a_ptrs + k0, mask=row_ok[:, None], other=0)
            iacc = tl.dot(a, tl.load(b_ptrs + k0, mask=n_ok[None, :], other=0), iacc, out_dtype=tl.int32)
            if GATED:
                iacc_up = tl.dot(a, tl.load(b_ptrs + up + k0, mask=n_ok[None, :], other=0), iacc_up,
                                 out_dtype=tl.int32)
        acc = iacc.to(tl.float32)
        acc_up = iacc_up.to(tl.float32)
    else:  # one int32 sum per activation group (BLOCK_K = A_GROUP), converted and scaled as the shift loop does
        for k0 in range(0, K, BLOCK_K):
            a = tl.load(a_ptrs + k0, mask=row_ok[:, None], other=0)
            sa = tl.load(a_scale_ptr + a_rows * a_scale_groups + k0 // A_GROUP, mask=row_ok, other=0.0)
            d = tl.dot(a, tl.load(b_ptrs + k0, mask=n_ok[None, :], other=0), out_dtype=tl.int32)
            acc += d.to(tl.float32) * sa[:, None]
            if GATED:
                d = tl.dot(a, tl.load(b_ptrs + up + k0, mask=n_ok[None, :], other=0), out_dtype=tl.int32)
                acc_up += d.to(tl.float32) * sa[:, None]
    ok_base = ok_ptr + e_loc * stride_oke
    er = tl.load(ok_base + offs_n, mask=n_ok, other=1).to(tl.int32) & 0xFF
    acc = tl.where(er[None, :] == 0, float("nan"), acc * _e8m0(er)[None, :])
    if GATED:
        er_up = tl.load(ok_base + N + offs_n, mask=n_ok, other=1).to(tl.int32) & 0xFF
        acc_up = tl.where(er_up[None, :] == 0, float("nan"), acc_up * _e8m0(er_up)[None, :])
    _moe_epilogue(acc, acc_up, ids, row_ok, a_rows, offs_n, n_ok, pid_n, a_scale_ptr, c_ptr, c_scale_ptr, topk_w_ptr,
                  N, limit, stride_cm, c_scale_groups, GATED, MUL_WEIGHT, A_GROUP, True)


def expand_moe(cfg: Expand, xq, xs, w, aligned, topk_w, hq, hs, y, top_k: int, limit: float,
               decode_asm: bool) -> None:
    """`w4a8_moe_mma.mma_moe`'s contract on expanded weights: the experts expanded share by share into the workspace,
    each share's gate-up and down launched on it. w: `w4a8_moe.Experts` with both shift maps."""
    sorted_ids, block_expert, num_padded = aligned
    blocks = block_expert.numel()
    pairs, inter = hq.shape
    e, two_i, _ = w.w13.shape
    h = y.shape[1]
    t = cfg.tile
    share, ws_bytes, ok_bytes = expand_share(e, two_i, h, cfg.workspace_mb)
    ws = torch.empty((ws_bytes,), dtype=torch.int8, device=hq.device)
    ok = torch.empty((ok_bytes,), dtype=torch.uint8, device=hq.device)
    for gated, wb, wsc, er, n, kk in ((True, w.w13, w.w13_scale, w.w13_eref, two_i, h),
                                      (False, w.w2, w.w2_scale, w.w2_eref, h, inter)):
        w8 = ws[:share * n * kk].view(share, n, kk)
        okm = ok[:share * n].view(share, n)
        for e0 in range(0, e, share):
            n_e = min(share, e - e0)
            expand_experts(wb, wsc, er, w8, okm, e0, n_e, decode_asm)
            if gated:
                _w8_moe_kernel[(blocks * triton.cdiv(inter, t.block_n),)](
                    a_ptr=xq, a_scale_ptr=xs, w8_ptr=w8, ok_ptr=okm, c_ptr=hq, c_scale_ptr=hs,
                    sorted_ids_ptr=sorted_ids, block_expert_ptr=block_expert, num_padded_ptr=num_padded,
                    topk_w_ptr=topk_w, N=inter, K=h, num_pairs=pairs, a_row_div=top_k, a_scale_groups=xs.shape[1],
                    limit=float(limit), expert_lo=e0, expert_hi=e0 + n_e, stride_am=xq.stride(0),
                    stride_we=w8.stride(0), stride_wn=w8.stride(1), stride_oke=okm.stride(0), stride_cm=hq.stride(0),
                    c_scale_groups=hs.shape[1], GATED=True, MUL_WEIGHT=False, A_GROUP=0, BLOCK_M=t.block_m,
                    BLOCK_N=t.block_n, BLOCK_K=cfg.block_k, num_warps=t.warps, num_stages=t.stages)
            else:
                _w8_moe_kernel[(blocks * triton.cdiv(h, t.block_n2),)](
                    a_ptr=hq, a_scale_ptr=hs, w8_ptr=w8, ok_ptr=okm, c_ptr=y, c_scale_ptr=y, sorted_ids_ptr=sorted_ids,
                    block_expert_ptr=block_expert, num_padded_ptr=num_padded, topk_w_ptr=topk_w, N=h, K=inter,
                    num_pairs=pairs, a_row_div=1, a_scale_groups=hs.shape[1], limit=0.0, expert_lo=e0,
                    expert_hi=e0 + n_e, stride_am=hq.stride(0), stride_we=w8.stride(0), stride_wn=w8.stride(1),
                    stride_oke=okm.stride(0), stride_cm=y.stride(0), c_scale_groups=0, GATED=False, MUL_WEIGHT=True,
                    A_GROUP=t.block_n, BLOCK_M=t.block_m, BLOCK_N=t.block_n2, BLOCK_K=t.block_n, num_warps=t.warps,
                    num_stages=t.stages)
