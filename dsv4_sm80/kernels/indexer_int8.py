"""The C4 lightning indexer on SM80 with an INT8 cache (reference: `kv_store_ref.py`, `block_rounding_ref.py`).
0.5.16 keeps this cache in FP8 and scores it with DeepGEMM's `fp8_paged_mqa_logits` (SM90+); here the same
132-byte-per-entry page layout holds INT8 values and their scale, and the logits run on INT8 tensor cores.

Two roundings (SGLANG_DSV4_A100_INDEXER_ROUNDING; docs/attention.md):
- int8 (default): per row INT8 with an fp32 scale amax / 127 (the entry's last 4 bytes); the query's scale is
  folded into the head weights (weights_out = w * weight_scale * s_q), as the FP8 kernel does.
- fp4_sim: the model's own FP4 simulation of the rotated query and keys (blocks of 32, power-of-two scales,
  e2m1; `block_rounding.py`), of the BF16 rotation output as the model quantizes it. Each value is an INT8
  code (2 * e2m1, |code| <= 12) times 2^e / 2: the 4 block exponents take the scale's 4 bytes, and a query
  row is 132 bytes in the same layout. The logits kernel takes one INT8 MMA (K = 32) per block pair and
  scales each exact partial product by its two powers of two; the codes' 1/4 is folded into the weights.

- `q_rope_hadamard_int8`: indexer Q: RoPE on dims 64..127, Hadamard/sqrt(128), then the rounding.
- `store_index_k_int8`: an already normed+roped+Hadamard'ed index K row -> its entry at its slot (slot < 0
  skipped).
- `compress_store_index_k_int8`: the indexer compressor's epilogue (RMSNorm, RoPE on dims 64..127 at the
  block's first position, Hadamard/sqrt(128)) fused with the store; rows and their slots come from SGLang's
  compress plan (`compress_plan.py`), as its JIT `compress_norm_rope_store` takes them (FP8 there).
- `paged_mqa_logits_int8`: logits[t, j] = sum_h ReLU(q[t,h] . k[j]) * weights[t,h], j < seq_len[t]: all 64
  heads as the MMA's M, a page of 64 keys as its N; each token gets `logits_splits` programs that walk its
  pages with that stride up to its own length (causal skipping). The grid depends on the token count and
  the static max length only, so the kernel is capture-safe.

The Hadamard products run on BF16 tensor cores at fp32 accuracy (`_bf16x3_dot`); SM80 has no FP8.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from .block_rounding import fp4_block_exp, fp4_codes, pow2, round_bf16
from .common import rope_table, round_int8, sm_count
from .compress_plan import planned_slot

PAGE = 64
IDX_DIM = 128
ENTRY = IDX_DIM + 4  # bytes of an entry (and, with fp4_sim, of a query row): 128 codes, 4 scale bytes
PAGE_BYTES = PAGE * ENTRY
# Triton's CPU interpreter (TRITON_INTERPRET=1, the CI) mis-multiplies BF16 tl.dot operands (as in
# sparse_attn.py); there the three BF16 parts are widened to fp32 before the product (same sums: they are exact)
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def _hadamard_halves(device: str):
    """H128 (entries +-1, exact in BF16) split by the input's even and odd dims, transposed: [64, 128] BF16
    each; the kernels apply the 1/sqrt(128) in fp32 after the product."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < IDX_DIM:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    h = h.to(torch.bfloat16)
    return h[:, 0::2].t().contiguous().to(device), h[:, 1::2].t().contiguous().to(device)


@triton.jit
def _bf16x3_dot(y, h, acc, DOT_F32: tl.constexpr):
    """acc + y @ h for fp32 y and a BF16 h of +-1 entries, on BF16 tensor cores at fp32 accuracy: y is cut into
    three BF16 parts (hi + mid + lo = y to 24 bits), each product with +-1 is exact and the MMA accumulates in
    fp32. (An fp32 `ieee` tl.dot runs on CUDA cores: the Q kernel took 208 us per call for 16 tokens x 64 heads
    on the H200, 6 % of a batch-16 decode step.)"""
    hi = y.to(tl.bfloat16)
    r = y - hi.to(tl.float32)
    mid = r.to(tl.bfloat16)
    lo = (r - mid.to(tl.float32)).to(tl.bfloat16)
    if DOT_F32:
        hf = h.to(tl.float32)
        acc = tl.dot(lo.to(tl.float32), hf, acc)
        acc = tl.dot(mid.to(tl.float32), hf, acc)
        return tl.dot(hi.to(tl.float32), hf, acc)
    acc = tl.dot(lo, h, acc)
    acc = tl.dot(mid, h, acc)
    return tl.dot(hi, h, acc)


@triton.jit
def _hadamard128(y0, y1, he_ptr, ho_ptr, DOT_F32: tl.constexpr):
    """[R, 128] = interleave(y0, y1) @ H128.T / sqrt(128) for y0, y1 [R, 64] fp32 (the even and odd dims)."""
    i = tl.arange(0, 64)
    j = tl.arange(0, 128)
    he = tl.load(he_ptr + i[:, None] * 128 + j[None, :])
    ho = tl.load(ho_ptr + i[:, None] * 128 + j[None, :])
    acc = tl.zeros([y0.shape[0], 128], dtype=tl.float32)
    acc = _bf16x3_dot(y0, he, acc, DOT_F32)
    acc = _bf16x3_dot(y1, ho, acc, DOT_F32)
    return acc * 0.08838834764831845  # 1 / sqrt(128)


@triton.jit
def _fp4_sim_rows(z):
    """z [R, 128] fp32 rotated rows -> (INT8 codes [R, 128], block exponents e0..e3 [R] int32): the model's FP4
    simulation of the BF16 rounding of z (its rotation returns BF16) per 32 dims."""
    zb = round_bf16(z)
    a = tl.abs(zb)
    blk = (tl.arange(0, 128) // 32)[None, :]
    e0 = fp4_block_exp(tl.max(tl.where(blk == 0, a, 0.0), axis=1))
    e1 = fp4_block_exp(tl.max(tl.where(blk == 1, a, 0.0), axis=1))
    e2 = fp4_block_exp(tl.max(tl.where(blk == 2, a, 0.0), axis=1))
    e3 = fp4_block_exp(tl.max(tl.where(blk == 3, a, 0.0), axis=1))
    e = tl.where(blk == 0, e0[:, None], tl.where(blk == 1, e1[:, None], tl.where(blk == 2, e2[:, None], e3[:, None])))
    return fp4_codes(zb, e).to(tl.int8), e0, e1, e2, e3


@triton.jit
def _store_fp4_exps(ptr, e0, e1, e2, e3, mask):
    """The 4 block exponents of rows at ptr (int8 pointers [R]) as 4 INT8 bytes."""
    tl.store(ptr, e0.to(tl.int8), mask=mask)
    tl.store(ptr + 1, e1.to(tl.int8), mask=mask)
    tl.store(ptr + 2, e2.to(tl.int8), mask=mask)
    tl.store(ptr + 3, e3.to(tl.int8), mask=mask)


@triton.jit
def _q_rope_hadamard_int8_kernel(q_ptr, stride_qt, stride_qh, w_ptr, stride_wt, freqs_ptr, pos_ptr, he_ptr, ho_ptr,
                                 qo_ptr, wo_ptr, heads, weight_scale, BLOCK_H: tl.constexpr,
                                 DOT_F32: tl.constexpr, FP4_SIM: tl.constexpr = False):
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < heads
    i = tl.arange(0, 64)  # pair index: dims 2i, 2i+1
    base = q_ptr + t * stride_qt + offs_h[:, None] * stride_qh
    x0 = tl.load(base + 2 * i[None, :], mask=h_ok[:, None], other=0.0).to(tl.float32)
    x1 = tl.load(base + 2 * i[None, :] + 1, mask=h_ok[:, None], other=0.0).to(tl.float32)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    rp = i - 32
    is_rope = rp >= 0
    rp = tl.where(is_rope, rp, 0)
    fr = tl.load(freqs_ptr + pos * 64 + 2 * rp, mask=is_rope, other=1.0)
    fi = tl.load(freqs_ptr + pos * 64 + 2 * rp + 1, mask=is_rope, other=0.0)
    y0 = x0 * fr[None, :] - x1 * fi[None, :]
    y1 = x0 * fi[None, :] + x1 * fr[None, :]
    j = tl.arange(0, 128)
    z = _hadamard128(y0, y1, he_ptr, ho_ptr, DOT_F32)  # [BLOCK_H, 128]
    w = tl.load(w_ptr + t * stride_wt + offs_h, mask=h_ok, other=0.0).to(tl.float32)
    if FP4_SIM:  # 132-byte rows: codes, then the block exponents; the codes' 1/2 (squared) in the weights
        codes, e0, e1, e2, e3 = _fp4_sim_rows(z)
        row = qo_ptr + (t * heads + offs_h) * 132
        tl.store(row[:, None] + j[None, :], codes, mask=h_ok[:, None])
        _store_fp4_exps(row + 128, e0, e1, e2, e3, h_ok)
        tl.store(wo_ptr + t * heads + offs_h, w * weight_scale * 0.25, mask=h_ok)
    else:
        s = tl.maximum(tl.max(tl.abs(z), axis=1), 1e-4) / 127.0
        q = round_int8(z / s[:, None])
        tl.store(qo_ptr + (t * heads + offs_h[:, None]) * 128 + j[None, :], q, mask=h_ok[:, None])
        tl.store(wo_ptr + t * heads + offs_h, w * weight_scale * s, mask=h_ok)


def q_rope_hadamard_int8(q: torch.Tensor, weight: torch.Tensor, weight_scale: float, freqs_cis: torch.Tensor,
                         positions: torch.Tensor, fp4_sim: bool = False):
    """q [T, H, 128] (BF16), weight [T, H] -> (q_int8 [T, H, 128], weights_out fp32 [T, H, 1]); with fp4_sim
    q rows [T, H, 132] INT8 (128 codes, 4 block exponents) and weights_out = w * weight_scale / 4."""
    t_total, heads, dim = q.shape
    if dim != IDX_DIM or q.stride(-1) != 1:
        raise ValueError(f"indexer q must be [T, H, {IDX_DIM}] with unit stride, got {tuple(q.shape)}")
    freqs = rope_table(freqs_cis)
    he, ho = _hadamard_halves(str(q.device))
    q_out = torch.empty((t_total, heads, ENTRY if fp4_sim else IDX_DIM), dtype=torch.int8, device=q.device)
    w_out = torch.empty((t_total, heads, 1), dtype=torch.float32, device=q.device)
    if t_total:
        # 32 heads a program: at 64, sm_80's build spills the fp32 accumulator and the three BF16 parts to local
        # memory (455 LDL / 353 STL in its SASS, Triton 3.6); at 32 none (tests/kernels/test_indexer_kv_store.py)
        block_h = 32 if heads >= 32 else 16
        _q_rope_hadamard_int8_kernel[(t_total, triton.cdiv(heads, block_h))](
            q_ptr=q, stride_qt=q.stride(0), stride_qh=q.stride(1), w_ptr=weight, stride_wt=weight.stride(0),
            freqs_ptr=freqs, pos_ptr=positions, he_ptr=he, ho_ptr=ho, qo_ptr=q_out, wo_ptr=w_out, heads=heads,
            weight_scale=float(weight_scale), BLOCK_H=block_h, DOT_F32=_INTERPRETED, FP4_SIM=bool(fp4_sim))
    return q_out, w_out


@triton.jit
def _store_index_k_kernel(x_ptr, stride_x, loc_ptr, cache_ptr, cache_f32_ptr, FP4_SIM: tl.constexpr = False):
    row = tl.program_id(0).to(tl.int64)
    loc = tl.load(loc_ptr + row).to(tl.int64)
    if loc < 0:
        return
    d = tl.arange(0, 128)
    page = loc // 64
    off = loc % 64
    if FP4_SIM:
        x = tl.load(x_ptr + row * stride_x + d[None, :]).to(tl.float32)  # one row as [1, 128]
        codes, e0, e1, e2, e3 = _fp4_sim_rows(x)
        tl.store(cache_ptr + page * (64 * 132) + off * 128 + d[None, :], codes)
        _store_fp4_exps(cache_ptr + page * (64 * 132) + 64 * 128 + off * 4 + tl.arange(0, 1), e0, e1, e2, e3, True)
    else:
        x = tl.load(x_ptr + row * stride_x + d).to(tl.float32)
        s = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-4) / 127.0
        tl.store(cache_ptr + page * (64 * 132) + off * 128 + d, round_int8(x / s))
        tl.store(cache_f32_ptr + page * (64 * 33) + 64 * 32 + off, s)


def store_index_k_int8(x: torch.Tensor, out_loc: torch.Tensor, cache: torch.Tensor, fp4_sim: bool = False) -> None:
    """x [N, 128] (fp32/BF16, final index K values), out_loc [N] (-1 = skip), cache: the page buffer,
    any dtype view of [pages, 64 * 132] bytes; fp4_sim: the model's FP4 simulation (codes + block exponents)."""
    raw = cache.view(torch.uint8).view(-1)
    if raw.numel() % PAGE_BYTES:
        raise ValueError(f"index cache of {raw.numel()} bytes is not whole pages of {PAGE_BYTES}")
    if x.shape[0]:
        _store_index_k_kernel[(x.shape[0],)](x, x.stride(0), out_loc, raw.view(torch.int8), raw.view(torch.float32),
                                             FP4_SIM=bool(fp4_sim))


@triton.jit
def _page_keys(kv_ptr, kv_f32_ptr, pt_ptr, row, jb, ok):
    """One page of a token's INT8 keys [64, 128] and their fp32 scales [64] (zeros where not ok)."""
    j = tl.arange(0, 64)
    d = tl.arange(0, 128)
    page = tl.load(pt_ptr + row + jb, mask=ok, other=0).to(tl.int64)
    k = tl.load(kv_ptr + page * (64 * 132) + j[:, None] * 128 + d[None, :], mask=ok, other=0)
    sk = tl.load(kv_f32_ptr + page * (64 * 33) + 64 * 32 + j, mask=ok, other=0.0)
    return k, sk


@triton.jit
def _logits_int8_kernel(q_ptr, kv_ptr, kv_f32_ptr, w_ptr, lens_ptr, pt_ptr, stride_pt, out_ptr, stride_out,
                        max_len, splits, HEADS: tl.constexpr, PREFETCH: tl.constexpr = False):
    t = tl.program_id(0).to(tl.int64)
    n = tl.load(lens_ptr + t)
    n_pages = tl.cdiv(n, 64)
    # the grid is sized by the static max length (capture-safe), so most programs of a short row have no page:
    # they leave before loading the token's 8 KB of Q (on the H200 at 16 tokens and 4K context the empty
    # programs' Q loads made 16 pages a program 1.9x slower than 64)
    if tl.program_id(1) < n_pages:
        j = tl.arange(0, 64)
        d = tl.arange(0, 128)
        h = tl.arange(0, HEADS)
        q = tl.load(q_ptr + (t * HEADS + h[:, None]) * 128 + d[None, :])
        w = tl.load(w_ptr + t * HEADS + h)
        row = t * stride_pt
        if PREFETCH:  # the next page's loads issued before this page's product: two in flight per program
            k_next, sk_next = _page_keys(kv_ptr, kv_f32_ptr, pt_ptr, row, tl.program_id(1), True)
        for jb in range(tl.program_id(1), n_pages, splits):  # this program's pages of the token's keys
            if PREFETCH:
                k, sk = k_next, sk_next
                k_next, sk_next = _page_keys(kv_ptr, kv_f32_ptr, pt_ptr, row, jb + splits, jb + splits < n_pages)
            else:
                k, sk = _page_keys(kv_ptr, kv_f32_ptr, pt_ptr, row, jb, True)
            dots = tl.dot(q, tl.trans(k), out_dtype=tl.int32).to(tl.float32)  # [HEADS, 64]
            score = tl.sum(tl.maximum(dots, 0.0) * w[:, None], axis=0)
            col = jb * 64 + j
            tl.store(out_ptr + t * stride_out + col, tl.where(col < n, score * sk, 0.0), mask=col < max_len)


@triton.jit
def _logits_fp4_sim_kernel(q_ptr, kv_ptr, w_ptr, lens_ptr, pt_ptr, stride_pt, out_ptr, stride_out, max_len, splits,
                           HEADS: tl.constexpr):
    """The fp4_sim logits: per block of 32 dims one INT8 MMA (K = 32, exact int32: |sum| <= 32 * 12 * 12), scaled
    by the query's and the key's block powers of two (exact), the four partial products summed in fp32."""
    t = tl.program_id(0).to(tl.int64)
    n = tl.load(lens_ptr + t)
    n_pages = tl.cdiv(n, 64)
    if tl.program_id(1) < n_pages:  # as in the INT8 kernel: empty programs leave before loading Q
        j = tl.arange(0, 64)
        c = tl.arange(0, 32)
        h = tl.arange(0, HEADS)
        qrow = q_ptr + (t * HEADS + h) * 132
        q0 = tl.load(qrow[:, None] + c[None, :])
        q1 = tl.load(qrow[:, None] + 32 + c[None, :])
        q2 = tl.load(qrow[:, None] + 64 + c[None, :])
        q3 = tl.load(qrow[:, None] + 96 + c[None, :])
        sq0 = pow2(tl.load(qrow + 128).to(tl.int32))
        sq1 = pow2(tl.load(qrow + 129).to(tl.int32))
        sq2 = pow2(tl.load(qrow + 130).to(tl.int32))
        sq3 = pow2(tl.load(qrow + 131).to(tl.int32))
        w = tl.load(w_ptr + t * HEADS + h)
        for jb in range(tl.program_id(1), n_pages, splits):  # this program's pages of the token's keys
            page = tl.load(pt_ptr + t * stride_pt + jb).to(tl.int64)
            k = kv_ptr + page * (64 * 132) + j[:, None] * 128 + c[None, :]
            ke = kv_ptr + page * (64 * 132) + 64 * 128 + j * 4
            acc = tl.dot(q0, tl.trans(tl.load(k)), out_dtype=tl.int32).to(tl.float32) * sq0[:, None] \
                * pow2(tl.load(ke).to(tl.int32))[None, :]
            acc += tl.dot(q1, tl.trans(tl.load(k + 32)), out_dtype=tl.int32).to(tl.float32) * sq1[:, None] \
                * pow2(tl.load(ke + 1).to(tl.int32))[None, :]
            acc += tl.dot(q2, tl.trans(tl.load(k + 64)), out_dtype=tl.int32).to(tl.float32) * sq2[:, None] \
                * pow2(tl.load(ke + 2).to(tl.int32))[None, :]
            acc += tl.dot(q3, tl.trans(tl.load(k + 96)), out_dtype=tl.int32).to(tl.float32) * sq3[:, None] \
                * pow2(tl.load(ke + 3).to(tl.int32))[None, :]
            score = tl.sum(tl.maximum(acc, 0.0) * w[:, None], axis=0)
            col = jb * 64 + j
            tl.store(out_ptr + t * stride_out + col, tl.where(col < n, score, 0.0), mask=col < max_len)


# at most this many pages of the static max length walked by one program: its loop is not software-pipelined
# (no cp.async in the sm_80 SASS), so a program has one page load in flight; one token whose 2,048 pages (512K
# context) fill the max length gets 128 programs at 16 a program, 32 at 64. bench/indexer.py times 4 / 16 / 64.
LOGITS_PAGES_PER_PROGRAM = 16


def logits_splits(t_total: int, max_seq_len: int, device: str,
                  pages_per_program: int = LOGITS_PAGES_PER_PROGRAM) -> int:
    """Programs per token of the logits grid: about four per SM over the batch, and enough that none walks more
    than `pages_per_program` pages (a long prefill's last tokens; bench/indexer.py times other caps), never more
    than the pages of the longest key row. The grid is a function of (tokens, max length) only: capture-safe,
    while the work follows each token's real length (a program per page of the static max length, 16 x 4097
    programs that mostly exit at once, cost 40 us per decode step on the H200)."""
    pages = triton.cdiv(max_seq_len, PAGE)
    sms = sm_count(device) or 8  # the interpreter's stand-in: 8
    want = max(triton.cdiv(4 * sms, max(t_total, 1)), triton.cdiv(pages, pages_per_program))
    return max(1, min(pages, want))


def paged_mqa_logits_int8(q_int8: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor,
                          seq_lens: torch.Tensor, page_table: torch.Tensor, max_seq_len: int,
                          out: torch.Tensor | None = None, splits: int | None = None,
                          prefetch: bool = False, fp4_sim: bool = False) -> torch.Tensor:
    """q_int8 [T, 64, 128] (or [T, 1, 64, 128]); kv_cache the page buffer (any view); weights [T, 64]
    (or [T, 64, 1]) fp32; seq_lens [T] (or [T, 1]); page_table int32 [T, max_pages] -> logits fp32
    [T, max_seq_len]; entries at j >= seq_len are 0 in pages the kernel visits, unspecified past them.
    splits: programs per token (default `logits_splits`); prefetch: each program loads its next page before
    multiplying the current one (a bench variant until a GPU run times it; INT8 only). fp4_sim: q rows and
    cache entries as `q_rope_hadamard_int8` / the stores write them with fp4_sim ([T, 64, 132] queries)."""
    width = ENTRY if fp4_sim else IDX_DIM
    if q_int8.shape[-1] != width or q_int8.dtype != torch.int8:
        raise ValueError(f"indexer logits ({'fp4_sim' if fp4_sim else 'int8'}): found queries {q_int8.dtype} "
                         f"{tuple(q_int8.shape)}; expected int8 rows of {width} (the Q kernel and the logits must "
                         "take the same SGLANG_DSV4_A100_INDEXER_ROUNDING)")
    if fp4_sim and prefetch:
        raise ValueError("the prefetch variant is INT8 only")
    q = q_int8.reshape(q_int8.shape[0], -1, width)
    t_total, heads, _ = q.shape
    if heads < 16 or heads & (heads - 1):
        raise ValueError(f"the logits kernel takes the heads as MMA rows: a power of two >= 16, got {heads}")
    raw = kv_cache.view(torch.uint8).view(-1)
    out = torch.empty((t_total, max_seq_len), dtype=torch.float32, device=q.device) if out is None else out
    if t_total and max_seq_len:
        splits = splits or logits_splits(t_total, max_seq_len, str(q.device))
        if fp4_sim:
            _logits_fp4_sim_kernel[(t_total, splits)](
                q_ptr=q, kv_ptr=raw.view(torch.int8), w_ptr=weights.reshape(t_total, heads).float(),
                lens_ptr=seq_lens.reshape(-1), pt_ptr=page_table, stride_pt=page_table.stride(0), out_ptr=out,
                stride_out=out.stride(0), max_len=max_seq_len, splits=splits, HEADS=heads)
            return out
        _logits_int8_kernel[(t_total, splits)](
            q_ptr=q, kv_ptr=raw.view(torch.int8), kv_f32_ptr=raw.view(torch.float32),
            w_ptr=weights.reshape(t_total, heads).float(), lens_ptr=seq_lens.reshape(-1), pt_ptr=page_table,
            stride_pt=page_table.stride(0), out_ptr=out, stride_out=out.stride(0), max_len=max_seq_len, splits=splits,
            HEADS=heads, PREFETCH=bool(prefetch))
    return out


@triton.jit
def _compress_store_index_k_kernel(kv_ptr, plan_ptr, n_rows, out_loc_ptr, w_ptr, eps, freqs_ptr, he_ptr, ho_ptr,
                                   cache_ptr, cache_f32_ptr, IS_DECODE: tl.constexpr, RATIO: tl.constexpr,
                                   BLOCK_R: tl.constexpr, DOT_F32: tl.constexpr, FP4_SIM: tl.constexpr = False):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    valid, slot, seq = planned_slot(plan_ptr, r, r < n_rows, out_loc_ptr, IS_DECODE, RATIO)
    pos = tl.where(valid, seq - RATIO, 0).to(tl.int64)
    i = tl.arange(0, 64)
    rows = tl.where(valid, r, 0).to(tl.int64)
    x0 = tl.load(kv_ptr + rows[:, None] * 128 + 2 * i[None, :], mask=valid[:, None], other=0.0)
    x1 = tl.load(kv_ptr + rows[:, None] * 128 + 2 * i[None, :] + 1, mask=valid[:, None], other=0.0)
    nf = 1.0 / tl.sqrt((tl.sum(x0 * x0, axis=1) + tl.sum(x1 * x1, axis=1)) / 128 + eps)
    y0 = x0 * nf[:, None] * tl.load(w_ptr + 2 * i)[None, :]
    y1 = x1 * nf[:, None] * tl.load(w_ptr + 2 * i + 1)[None, :]
    rp = i - 32
    is_rope = (rp >= 0)[None, :] & valid[:, None]
    rp = tl.where(rp >= 0, rp, 0)
    fr = tl.load(freqs_ptr + pos[:, None] * 64 + 2 * rp[None, :], mask=is_rope, other=1.0)
    fi = tl.load(freqs_ptr + pos[:, None] * 64 + 2 * rp[None, :] + 1, mask=is_rope, other=0.0)
    z0 = y0 * fr - y1 * fi
    z1 = y0 * fi + y1 * fr
    j = tl.arange(0, 128)
    h = _hadamard128(z0, z1, he_ptr, ho_ptr, DOT_F32)  # [BLOCK_R, 128]
    slot64 = tl.where(valid, slot, 0).to(tl.int64)
    page = slot64 // 64
    off = slot64 % 64
    if FP4_SIM:
        codes, e0, e1, e2, e3 = _fp4_sim_rows(h)
        tl.store(cache_ptr + page[:, None] * (64 * 132) + off[:, None] * 128 + j[None, :], codes, mask=valid[:, None])
        _store_fp4_exps(cache_ptr + page * (64 * 132) + 64 * 128 + off * 4, e0, e1, e2, e3, valid)
    else:
        s = tl.maximum(tl.max(tl.abs(h), axis=1), 1e-4) / 127.0
        tl.store(cache_ptr + page[:, None] * (64 * 132) + off[:, None] * 128 + j[None, :],
                 round_int8(h / s[:, None]), mask=valid[:, None])
        tl.store(cache_f32_ptr + page * (64 * 33) + 64 * 32 + off, s, mask=valid)


def compress_store_index_k_int8(kv: torch.Tensor, plan_rows: torch.Tensor, is_decode: bool, out_loc: torch.Tensor,
                                norm_weight: torch.Tensor, eps: float, freqs_cis: torch.Tensor, cache: torch.Tensor,
                                ratio: int = 4, fp4_sim: bool = False) -> None:
    """kv fp32 [N, 128] (compress_forward's output, one row per plan row); plan_rows: the plan's 16-byte
    rows (any dtype view, [N, ...]); out_loc int64 [tokens] (decode: per request); norm_weight fp32 [128];
    freqs_cis complex64 [max_pos, 32]; cache: the index page buffer (any view of [pages, 64 * 132] bytes);
    fp4_sim: the model's FP4 simulation (codes + block exponents) instead of INT8 + an fp32 scale."""
    n = kv.shape[0]
    if n == 0:
        return
    if kv.shape[-1] != IDX_DIM or kv.dtype != torch.float32 or not kv.is_contiguous():
        raise ValueError(f"index K rows must be contiguous fp32 [N, {IDX_DIM}], got {kv.dtype} {tuple(kv.shape)}")
    plan = plan_rows.contiguous().view(torch.int32).reshape(-1, 4)
    if plan.shape[0] < n:
        raise ValueError(f"the plan has {plan.shape[0]} rows for {n} compressed rows")
    raw = cache.view(torch.uint8).view(-1)
    freqs = rope_table(freqs_cis)
    he, ho = _hadamard_halves(str(kv.device))
    block_r = 16
    _compress_store_index_k_kernel[(triton.cdiv(n, block_r),)](
        kv_ptr=kv, plan_ptr=plan, n_rows=n, out_loc_ptr=out_loc, w_ptr=norm_weight.float(), eps=float(eps),
        freqs_ptr=freqs, he_ptr=he, ho_ptr=ho, cache_ptr=raw.view(torch.int8), cache_f32_ptr=raw.view(torch.float32),
        IS_DECODE=bool(is_decode), RATIO=ratio, BLOCK_R=block_r, DOT_F32=_INTERPRETED, FP4_SIM=bool(fp4_sim))
