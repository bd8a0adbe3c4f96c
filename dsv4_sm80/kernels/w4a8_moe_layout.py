"""The W4A8 MoE's weight side: the repacked MXFP4 layout, the shift maps, and the device code that turns 4-bit codes
into INT8 operands (shared by every kernel family of `w4a8_moe`).

- An MXFP4 weight is an E2M1 code c (1 sign, 2 exponent, 1 mantissa bits) times 2^(e-127) per 32 consecutive K.
  Twice an E2M1 value is an integer in {0, +-1, +-2, +-3, +-4, +-6, +-8, +-12}, so each code decodes to that INT8
  integer q, and w = q * 2^(e-127) / 2 exactly. Each 32-wide K group's INT8 dot is exact in int32.
- Layout (`repack_mxfp4_for_w4a8`, in place on the GPU at load, 4 bits per weight): per expert [N, K/2] bytes where,
  in each 64-wide K chunk (32 bytes), the little-endian 32-bit word q holds as nibbles 0..3 the codes of
  k = 4q..4q+3 and as nibbles 4..7 those of k = 32+4q..32+4q+3, so one word gives four operands of each of the
  chunk's two scale groups. Chunks are stored tile-major, [N/32, K/64, 32 rows, 32 bytes] per expert: one K step of
  a 32-row column tile is one contiguous 1 KiB block. Scales stay the checkpoint's E8M0 bytes [N, K/32].
- Decoding: inline PTX widens four codes per 32-bit register (`PTX_DECODE`: three PRMTs and one LOP3 per four
  codes); Triton's CPU interpreter cannot run inline PTX, so there the same mapping is computed elementwise.
- Shift maps (`shift_refs`, 1 byte per expert and output row): UE8M0 scales are powers of two, so a column whose
  group exponents span at most 3 binades decodes to q * 2^(e - e_ref) (|q * 2^s| <= 96, still INT8) and its dots can
  accumulate in int32 over the whole K (`PTX_DECODE_SHIFT`).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"  # inline PTX does not run in the interpreter

GROUP = 32  # MXFP4 scale group along K
CHUNK = 64  # K per byte tile: two groups, low and high nibbles
TILE_COLS = 32  # output rows whose chunks sit side by side: one 1 KiB block per 32 rows and K chunk


def decode_asm(x: torch.Tensor) -> bool:
    """Whether launches for x's device take the PTX decoders (a GPU) or the elementwise ones (the interpreter)."""
    return x.is_cuda and not INTERPRETED


def repack_mxfp4_for_w4a8(packed: torch.Tensor, experts_per_step: int = 16) -> torch.Tensor:
    """Checkpoint MXFP4 bytes [E, N, K/2] (low nibble = even k) -> the kernel's layout, in place.

    Per 64-wide K chunk (32 bytes) of a row: the 32-bit little-endian word q (bytes 4q..4q+3) holds, as
    nibbles 0..3, the codes of k = 4q..4q+3 (the chunk's first scale group) and, as nibbles 4..7, those of
    k = 32+4q..32+4q+3 (its second), i.e. byte 4q+b holds nibbles 2b (low) and 2b+1 (high). One word then
    decodes to four INT8 operands of each group's dot with a single PRMT selector per group.
    Chunks are stored tile-major: per expert [N/32, K/64, 32 rows, 32 bytes], so the 32 rows' bytes of one
    K chunk are one contiguous 1 KiB block. Byte (n, chunk c, j) is at
    (n // 32) * 16K + c * 1024 + (n % 32) * 32 + j (`_col_base`).
    Works expert slice by expert slice so the transient is a few experts' codes, not the layer's."""
    e_total, n, half_k = packed.shape
    k = half_k * 2
    if k % CHUNK or n % TILE_COLS:
        raise ValueError(f"K={k} must be a multiple of {CHUNK} and N={n} of {TILE_COLS}")
    raw = packed.view(torch.uint8)
    for e0 in range(0, e_total, experts_per_step):
        b = raw[e0:e0 + experts_per_step]
        # [.., chunk, group, q, i]: k = 64*chunk + 32*group + 4*q + i
        codes = torch.stack((b & 0xF, b >> 4), dim=-1).reshape(b.shape[0], n, k // CHUNK, 2, 8, 4)
        nib = codes.permute(0, 1, 2, 4, 3, 5).reshape(b.shape[0], n, k // CHUNK, 8, 4, 2)  # [q, b, nibble]
        words = (nib[..., 0] | (nib[..., 1] << 4)).reshape(b.shape[0], n // TILE_COLS, TILE_COLS, k // CHUNK, 32)
        b.copy_(words.permute(0, 1, 3, 2, 4).reshape(b.shape))  # tile-major: [N/32, K/64, 32 rows, 32 B]
    return packed


def shift_refs(scale: torch.Tensor, experts_per_step: int = 16) -> torch.Tensor:
    """E8M0 scale bytes [E, N, K/32] -> the shift map `eref` uint8 [E, N] the shift loop reads.

    A column (one output row of the weight, all its K groups) is shiftable when its exponents span at most
    3 binades and none is 0 (E8M0 0 flushes to zero in the per-group path): then every group's codes times
    2^(e - e_ref), e_ref = the column's smallest exponent, are integers of |q| <= 12 * 8 = 96, exact in
    INT8, and the whole K of INT8 dots can accumulate in int32 with one conversion and one 2^(e_ref-127).
    eref[e, n] = e_ref for a shiftable column, 0 for one that is not (the per-group path serves it)."""
    s = scale.view(torch.uint8)
    out = torch.empty(s.shape[:2], dtype=torch.uint8, device=s.device)
    for e0 in range(0, s.shape[0], experts_per_step):
        part = s[e0:e0 + experts_per_step]
        lo, hi = part.amin(dim=-1), part.amax(dim=-1)
        out[e0:e0 + experts_per_step] = torch.where((hi - lo <= 3) & (lo > 0), lo, torch.zeros_like(lo))
    return out


@triton.jit
def _e2m1x2(c):
    """4-bit E2M1 code (int32 0..15) -> twice its value, an integer in [-12, 12]."""
    m = c & 7
    big = (2 + (m & 1)) << tl.maximum((m >> 1) - 1, 0)
    v = tl.where(m < 4, m, big)
    return tl.where(c >= 8, -v, v)


@triton.jit
def _e8m0(e):
    """E8M0 byte (int32) -> 2^(e-127) in fp32 (e=0 flushes to 0, as Marlin's MXFP4 path does)."""
    return (e << 23).to(tl.float32, bitcast=True)


# E2M1 codes -> twice their value as INT8, four bytes per 32-bit register (SWAR), for the repacked layout: one
# 32-bit word x holds 4 codes of the chunk's first scale group (nibbles 0..3, bits 0-15) and the 4 codes 32 further
# (nibbles 4..7). PRMT's default mode reads its selector's low 16 bits: result byte i = byte (nibble i of c) & 7 of
# {b:a} (a = bytes 0..3), and if bit 3 of that nibble is set, that byte's msb replicated (sign-replicate). So
# x & 0x77777777 is the selector of group 0's four magnitudes, >> 16 that of group 1's; two 8-byte tables
# (0,1,2,3,4,6,8,12 and their negatives) give the positive and negative values; a third PRMT in sign-replicate mode
# builds the mask 0xFF per byte whose code is negative (x << 4 brings the even nibbles' sign bits to byte msbs, x has
# the odd nibbles'); one LOP3 (0xD8: c ? b : a) blends. 11 instructions per word = 8 codes. Emulated instruction by
# instruction in tests/kernels/test_w4a8_moe.py (test_swar_decode_algorithm).
#
# Relies on the 4 bytes Triton packs into one register (pack=4) being 4 consecutive k of one column, aligned to 4:
# true in the INT8 MMA operand layout the decode runs in (the m16n8k32 B fragment holds exactly such words; the
# compile test checks that the decode runs in that layout).
_DECODE_HEAD = ("{\n.reg .b32 sel, selh, sx, sg, pos, neg, lp, hp, ln, hn;\n"
                "mov.b32 lp, 0x03020100;\nmov.b32 hp, 0x0C080604;\n"
                "and.b32 sel, $2, 0x77777777;\nshr.b32 selh, sel, 16;\nshl.b32 sx, $2, 4;\n")
PTX_DECODE = (_DECODE_HEAD + "mov.b32 ln, 0xFDFEFF00;\nmov.b32 hn, 0xF4F8FAFC;\n"
              + "".join(f"prmt.b32 pos, lp, hp, {s};\nprmt.b32 neg, ln, hn, {s};\n"
                        f"prmt.b32 sg, $2, sx, {m};\nlop3.b32 {o}, pos, neg, sg, 0xD8;\n"
                        for s, m, o in (("sel", "0x9D8C", "$0"), ("selh", "0xBFAE", "$1")))
              + "}")
# The shift loop's decoder: codes times 2^s, s = 0..3 per column and group, given as the multiplier m = 2^s (operand
# $3: each byte m0 | m1 << 4 for the low and high group). After the positive lookup P (bytes <= 12), v = P * m + M
# with M = 0x7F where the code is negative (else 0): bytes P*m <= 96, so neither the multiply nor the add carries
# across bytes (<= 96 + 127 < 256); then v ^ M is P*m where M = 0 and (0x7F + q) ^ 0x7F = 256 - q = -q mod 256 where
# M = 0x7F (0 <= q <= 0x80). 15 per word.
PTX_DECODE_SHIFT = (_DECODE_HEAD.replace("lp, hp, ln, hn", "lp, hp, m0, m1, v")
                    + "and.b32 m0, $3, 15;\nbfe.u32 m1, $3, 4, 4;\n"
                    + "".join(f"prmt.b32 pos, lp, hp, {s};\nprmt.b32 sg, $2, sx, {m};\n"
                              f"and.b32 sg, sg, 0x7F7F7F7F;\nmad.lo.u32 v, pos, {mm}, sg;\n"
                              f"xor.b32 {o}, v, sg;\n"
                              for s, m, mm, o in (("sel", "0x9D8C", "m0", "$0"), ("selh", "0xBFAE", "m1", "$1")))
                    + "}")
_DECODE_ASM_C = tl.constexpr(PTX_DECODE)
_DECODE_SHIFT_ASM_C = tl.constexpr(PTX_DECODE_SHIFT)
_DP4A_ASM_C = tl.constexpr("dp4a.s32.s32 $0, $1, $2, $3;")  # four INT8 products summed into int32 (sm_61+)


@triton.jit
def _col_base(offs_n, stride_bn):
    """Byte offset of column (output row) n's first K chunk in the tile-major layout (stride_bn = K/2, the
    bytes of one row): 32-row tiles of 16K bytes, each row's chunk 32 bytes into its tile's 1 KiB block.
    Chunk c of the row is 1024 * c further."""
    return (offs_n // 32) * (stride_bn * 32) + (offs_n % 32) * 32


@triton.jit
def _load_codes(b_ptrs, n_ok, mul, DECODE_ASM: tl.constexpr, SHIFT: tl.constexpr):
    """b_ptrs [32, BLOCK_N]: the 32 bytes of one 64-wide K chunk per column (row j = byte j). Returns
    (lo, hi) INT8 [32, BLOCK_N]: lo[j] = twice the E2M1 value of code k0+j, hi[j] = of code k0+32+j; with
    SHIFT, times the column's 2^s per group, mul [BLOCK_N] = m0 | m1 << 4 (m = 2^s, 1..8)."""
    if DECODE_ASM:
        byte = tl.load(b_ptrs, mask=n_ok[None, :], other=0)
        if SHIFT:
            m = tl.broadcast_to(mul.to(tl.uint8)[None, :], byte.shape)
            lo, hi = tl.inline_asm_elementwise(_DECODE_SHIFT_ASM_C, "=r,=r,r,r", [byte, m],
                                               dtype=(tl.int8, tl.int8), is_pure=True, pack=4)
        else:
            lo, hi = tl.inline_asm_elementwise(_DECODE_ASM_C, "=r,=r,r", [byte], dtype=(tl.int8, tl.int8),
                                               is_pure=True, pack=4)
    else:  # elementwise (interpreter): gather code k0+j from byte 4*(j//4) + (j%4)//2, nibble j%2 (+2: k0+32+j)
        j = tl.arange(0, 32)
        delta = ((j // 4) * 4 + (j % 4) // 2 - j)[:, None]
        nib = ((j % 2) * 4)[:, None]
        blo = tl.load(b_ptrs + delta, mask=n_ok[None, :], other=0).to(tl.int32) & 0xFF
        bhi = tl.load(b_ptrs + delta + 2, mask=n_ok[None, :], other=0).to(tl.int32) & 0xFF
        vlo = _e2m1x2((blo >> nib) & 0xF)
        vhi = _e2m1x2((bhi >> nib) & 0xF)
        if SHIFT:
            vlo = vlo * (mul & 15)[None, :]
            vhi = vhi * (mul >> 4)[None, :]
        lo = vlo.to(tl.int8)
        hi = vhi.to(tl.int8)
    return lo, hi


@triton.jit
def _scale_word(s_ptrs, n_ok):
    """A 64-deep K step's two E8M0 bytes per column (groups k0/32 and k0/32 + 1: adjacent, the pair 2-aligned
    as K/32 is even) in one 16-bit load, as int32 (low byte the first group); 0 where n_ok is false."""
    return tl.load(s_ptrs.to(tl.pointer_type(tl.uint16)), mask=n_ok, other=0).to(tl.int32)


@triton.jit
def _word_scales(sw):
    """A `_scale_word` as its two groups' fp32 weight scales (s0, s1)."""
    return _e8m0(sw & 0xFF), _e8m0(sw >> 8)


@triton.jit
def _scale_bytes(s_ptrs, n_ok):
    """`_scale_word` split into (e0, e1)."""
    v = _scale_word(s_ptrs, n_ok)
    return v & 0xFF, v >> 8


@triton.jit
def _word_products(words, x_lo, x_hi, DECODE_ASM: tl.constexpr):
    """Per word of the repacked layout (the codes of k0+4q'..k0+4q'+3 as nibbles 0-3 and of k0+32+4q'.. as nibbles
    4-7), the exact int32 dot of its first group's four codes (twice the E2M1 values) with x_lo and of its second
    group's with x_hi (each four INT8 activations in one int32, in k order; broadcastable to words' shape).
    DECODE_ASM: the PRMT decoder (a word in, each group's four INT8 values out; ptxas hoists its table constants) and
    DP4A; else the same integers elementwise (interpreter)."""
    if DECODE_ASM:
        lo, hi = tl.inline_asm_elementwise(_DECODE_ASM_C, "=r,=r,r", [words], dtype=(tl.int32, tl.int32),
                                           is_pure=True, pack=1)
        z = tl.zeros(words.shape, dtype=tl.int32)
        p_lo = tl.inline_asm_elementwise(_DP4A_ASM_C, "=r,r,r,r", [lo, tl.broadcast_to(x_lo, words.shape), z],
                                         dtype=tl.int32, is_pure=True, pack=1)
        p_hi = tl.inline_asm_elementwise(_DP4A_ASM_C, "=r,r,r,r", [hi, tl.broadcast_to(x_hi, words.shape), z],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:
        p_lo = tl.zeros(words.shape, dtype=tl.int32)
        p_hi = tl.zeros(words.shape, dtype=tl.int32)
        for i in tl.static_range(4):  # byte i of the activation word, sign-extended (arithmetic shift of int32)
            p_lo += _e2m1x2((words >> (4 * i)) & 0xF) * ((x_lo << (24 - 8 * i)) >> 24)
            p_hi += _e2m1x2((words >> (16 + 4 * i)) & 0xF) * ((x_hi << (24 - 8 * i)) >> 24)
    return p_lo, p_hi


@triton.jit
def _pair_tile(expert_ptr, N, a_row_div, BLOCK_N: tl.constexpr):
    """A pair-block program's (pair, BLOCK_N-column tile) from its program id: the pair p, the tile's index, the
    pair's expert (int64; < 0: nothing to do), its activation row (p // a_row_div) and the tile's columns."""
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BLOCK_N)
    p = pid // n_tiles
    pid_n = pid % n_tiles
    expert = tl.load(expert_ptr + p).to(tl.int64)
    return p, pid_n, expert, (p // a_row_div).to(tl.int64), pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
