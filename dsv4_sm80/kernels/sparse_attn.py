"""DSV4 sparse attention with a sink over BF16 caches, for SM80 (reference: `sparse_attn_ref.py`).

One index-driven kernel for every forward mode: each query token brings its own index lists (SWA slots
into the SWA cache; optionally C4 top-k or all C128 slots into the compressed cache), so decode, extend,
target-verify, draft-extend and the DSPARK draft block differ only in the lists their metadata builds.
K = V: one 512-wide BF16 row per slot (MQA). Entry j of a list is valid when j < its length and the slot
id is >= 0 (DSPARK and padding write -1). The per-head sink joins the softmax denominator; an empty key
set gives zeros.

Layout of the work: a program owns one query token, a block of 16 heads (tl.dot needs M >= 16) and one
split of the token's lists; it streams BLOCK_N key rows at a time through an online softmax (fp32 running
max and sum, BF16 MMA for q.K and p.K, fp32 accumulation). With splits > 1 the partial (max, sum, acc)
go to a workspace and a second kernel combines them with the sink; with one split the first kernel
finishes in place. Shapes never reach host logic, no autotuning: capture-safe for CUDA graphs.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .common import sm_count

HEAD_DIM = 512
BLOCK_H = 16
COMBINE_D = 128  # columns per program of the split-K combine
# Triton's CPU interpreter (TRITON_INTERPRET=1, the CI) multiplies BF16 tl.dot operands wrongly (Triton
# 3.6, measured); there the kernel casts the operands to fp32 first. Compiled kernels use BF16 MMA.
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _gather_rows(cache_ptr, ids_ptr, j0, hi, D: tl.constexpr, BLOCK_N: tl.constexpr):
    """List entries [j0, j0 + BLOCK_N) below hi: their key rows (zeros where invalid) and validity."""
    offs_j = j0 + tl.arange(0, BLOCK_N)
    in_range = offs_j < hi
    ids = tl.load(ids_ptr + offs_j, mask=in_range, other=-1)
    ok = in_range & (ids >= 0)
    rows = tl.where(ok, ids, 0).to(tl.int64)
    k = tl.load(cache_ptr + rows[:, None] * D + tl.arange(0, D)[None, :], mask=ok[:, None], other=0.0)
    return k, ok


@triton.jit
def _gather_joint(swa_ptr, swa_ids_ptr, n_swa, ext_ptr, ext_ids_ptr, j0, hi, D: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    """`_gather_rows` over the two lists read as one, the SWA list then the extra one: entries [j0, j0 + BLOCK_N)
    below hi; entry j < n_swa is SWA entry j, else extra entry j - n_swa (both id loads at once, then one gather
    whose row pointers pick their cache)."""
    offs_j = j0 + tl.arange(0, BLOCK_N)
    in_range = offs_j < hi
    in_swa = offs_j < n_swa
    ids_s = tl.load(swa_ids_ptr + offs_j, mask=in_range & in_swa, other=-1)
    ids_e = tl.load(ext_ids_ptr + (offs_j - n_swa), mask=in_range & (offs_j >= n_swa), other=-1)
    ids = tl.where(in_swa, ids_s, ids_e)
    ok = in_range & (ids >= 0)
    rows = tl.where(ok, ids, 0).to(tl.int64) * D
    row_ptrs = tl.where(in_swa, swa_ptr + rows, ext_ptr + rows)  # one select per row, not per element
    k = tl.load(row_ptrs[:, None] + tl.arange(0, D)[None, :], mask=ok[:, None], other=0.0)
    return k, ok


@triton.jit
def _fold_step(q, m, l, acc, k, ok, scale, DOT_F32: tl.constexpr):
    """One BLOCK_N step of the online softmax: k [BLOCK_N, D] rows (zeros where not ok) into (m, l, acc)."""
    if DOT_F32:  # Triton's CPU interpreter mis-multiplies BF16 operands; same math in fp32
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32))) * scale
    else:
        s = tl.dot(q, tl.trans(k)) * scale
    s = tl.where(ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # all-invalid so far: keep exp() finite
    alpha = tl.exp(m - m_ref)
    p = tl.exp(s - m_ref[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    if DOT_F32:
        acc = acc * alpha[:, None] + tl.dot(p.to(k.dtype).to(tl.float32), k.to(tl.float32))
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(k.dtype), k)
    return m_new, l, acc


@triton.jit
def _stream_joint(q, m, l, acc, swa_ptr, swa_ids_ptr, n_swa, ext_ptr, ext_ids_ptr, n_ext, split, scale,
                  SPLITS: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr):
    """Fold this split's share of the two lists read as one (`_gather_joint`): a split owns a contiguous range
    of SWA + extra entries, so at one query token each program walks cdiv(n_swa + n_ext, SPLITS) entries in one
    run of steps instead of a share of each list (two runs, each with its partly empty last step)."""
    n = n_swa + n_ext
    chunk = (n + SPLITS - 1) // SPLITS
    lo = split * chunk
    hi = tl.minimum(lo + chunk, n)
    for j0 in range(lo, hi, BLOCK_N):
        k, ok = _gather_joint(swa_ptr, swa_ids_ptr, n_swa, ext_ptr, ext_ids_ptr, j0, hi, D, BLOCK_N)
        m, l, acc = _fold_step(q, m, l, acc, k, ok, scale, DOT_F32)
    return m, l, acc


@triton.jit
def _stream_list(q, m, l, acc, cache_ptr, ids_ptr, n, split, scale,
                 SPLITS: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr):
    """Fold this split's share of one index list into the running (m, l, acc). One step in flight: a second
    [BLOCK_N, 512] step held in registers beside the fp32 accumulator spills on sm_80 (docs/results/README.md)."""
    chunk = (n + SPLITS - 1) // SPLITS
    lo = split * chunk
    hi = tl.minimum(lo + chunk, n)
    for j0 in range(lo, hi, BLOCK_N):
        k, ok = _gather_rows(cache_ptr, ids_ptr, j0, hi, D, BLOCK_N)
        m, l, acc = _fold_step(q, m, l, acc, k, ok, scale, DOT_F32)
    return m, l, acc


@triton.jit
def _sparse_attn_kernel(
    q_ptr, stride_qt, stride_qh,
    swa_ptr, swa_ids_ptr, stride_swa_ids, swa_lens_ptr, swa_width,
    ext_ptr, ext_ids_ptr, stride_ext_ids, ext_lens_ptr, ext_width,
    sink_ptr, o_ptr, stride_ot, stride_oh, ws_acc_ptr, ws_ml_ptr,
    heads, scale,
    HAS_EXTRA: tl.constexpr, HAS_SINK: tl.constexpr, SPLITS: tl.constexpr,
    D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr,
    NORM_PARTIAL: tl.constexpr = False, JOINT: tl.constexpr = False,
):
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    split = tl.program_id(2)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < heads
    offs_d = tl.arange(0, D)
    q = tl.load(q_ptr + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :], mask=h_ok[:, None], other=0.0)

    m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, D), tl.float32)
    n_swa = tl.minimum(tl.load(swa_lens_ptr + t), swa_width)
    if HAS_EXTRA:
        n_ext = tl.minimum(tl.load(ext_lens_ptr + t), ext_width)
    if JOINT and HAS_EXTRA:
        m, l, acc = _stream_joint(q, m, l, acc, swa_ptr, swa_ids_ptr + t * stride_swa_ids, n_swa, ext_ptr,
                                  ext_ids_ptr + t * stride_ext_ids, n_ext, split, scale, SPLITS, D, BLOCK_N, DOT_F32)
    else:
        m, l, acc = _stream_list(q, m, l, acc, swa_ptr, swa_ids_ptr + t * stride_swa_ids, n_swa, split, scale,
                                 SPLITS, D, BLOCK_N, DOT_F32)
        if HAS_EXTRA:
            m, l, acc = _stream_list(q, m, l, acc, ext_ptr, ext_ids_ptr + t * stride_ext_ids, n_ext, split, scale,
                                     SPLITS, D, BLOCK_N, DOT_F32)

    if SPLITS == 1:
        if HAS_SINK:
            sink = tl.load(sink_ptr + offs_h, mask=h_ok, other=0.0)
            top = tl.maximum(m, sink)
            w = tl.exp(m - top)
            l = l * w + tl.exp(sink - top)
            acc = acc * w[:, None]
        o = acc / tl.where(l > 0, l, 1.0)[:, None]
        tl.store(o_ptr + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :], o.to(o_ptr.dtype.element_ty),
                 mask=h_ok[:, None])
    else:
        base = (t * SPLITS + split) * heads
        if NORM_PARTIAL:  # acc / l in the workspace's dtype (BF16: half the bytes); the combine scales by l
            acc = acc / tl.where(l > 0, l, 1.0)[:, None]
        tl.store(ws_acc_ptr + (base + offs_h[:, None]) * D + offs_d[None, :], acc.to(ws_acc_ptr.dtype.element_ty),
                 mask=h_ok[:, None])
        tl.store(ws_ml_ptr + (base + offs_h) * 2, m, mask=h_ok)
        tl.store(ws_ml_ptr + (base + offs_h) * 2 + 1, l, mask=h_ok)


@triton.jit
def _combine_kernel(ws_acc_ptr, ws_ml_ptr, sink_ptr, o_ptr, stride_ot, stride_oh, heads,
                    HAS_SINK: tl.constexpr, SPLITS: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr,
                    BLOCK_D: tl.constexpr, NORM_PARTIAL: tl.constexpr = False):
    """One program per (query token, head block, BLOCK_D columns): at batch 1 the combine would
    otherwise be a handful of programs each reading SPLITS x [16, 512] fp32 partials serially."""
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < heads
    offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    top = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    for s in range(SPLITS):
        ms = tl.load(ws_ml_ptr + ((t * SPLITS + s) * heads + offs_h) * 2, mask=h_ok, other=float("-inf"))
        top = tl.maximum(top, ms)
    if HAS_SINK:
        sink = tl.load(sink_ptr + offs_h, mask=h_ok, other=0.0)
        top = tl.maximum(top, sink)
    top = tl.where(top == float("-inf"), 0.0, top)
    den = tl.zeros((BLOCK_H,), tl.float32)
    num = tl.zeros((BLOCK_H, BLOCK_D), tl.float32)
    for s in range(SPLITS):
        base = (t * SPLITS + s) * heads
        ms = tl.load(ws_ml_ptr + (base + offs_h) * 2, mask=h_ok, other=float("-inf"))
        ls = tl.load(ws_ml_ptr + (base + offs_h) * 2 + 1, mask=h_ok, other=0.0)
        w = tl.exp(ms - top)
        den += ls * w
        part = tl.load(ws_acc_ptr + (base + offs_h[:, None]) * D + offs_d[None, :], mask=h_ok[:, None],
                       other=0.0).to(tl.float32)
        num += part * (ls * w if NORM_PARTIAL else w)[:, None]
    if HAS_SINK:
        den += tl.exp(sink - top)
    o = num / tl.where(den > 0, den, 1.0)[:, None]
    tl.store(o_ptr + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :], o.to(o_ptr.dtype.element_ty),
             mask=h_ok[:, None])


@triton.jit
def _combine_tiles_kernel(ws_acc_ptr, ws_ml_ptr, sink_ptr, o_ptr, stride_ot, stride_oh, heads,
                          HAS_SINK: tl.constexpr, SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr, D: tl.constexpr,
                          BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, NORM_PARTIAL: tl.constexpr = False):
    """`_combine_kernel` with every split's (max, sum) and partial loaded at once as [SPLITS_P2, BLOCK_H(, BLOCK_D)]
    tiles and reduced over the split axis, instead of two loops over the splits whose loads wait on each other
    (2 x SPLITS dependent memory round trips per program: at batch 1 and 10-32 splits, most of the combine)."""
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < heads
    offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_s = tl.arange(0, SPLITS_P2)
    sh_ok = (offs_s < SPLITS)[:, None] & h_ok[None, :]
    sh = (t * SPLITS + offs_s[:, None]) * heads + offs_h[None, :]  # [SPLITS_P2, BLOCK_H] rows of the workspace
    ms = tl.load(ws_ml_ptr + sh * 2, mask=sh_ok, other=float("-inf"))
    ls = tl.load(ws_ml_ptr + sh * 2 + 1, mask=sh_ok, other=0.0)
    part = tl.load(ws_acc_ptr + sh[:, :, None] * D + offs_d[None, None, :], mask=sh_ok[:, :, None],
                   other=0.0).to(tl.float32)
    top = tl.max(ms, axis=0)
    if HAS_SINK:
        sink = tl.load(sink_ptr + offs_h, mask=h_ok, other=0.0)
        top = tl.maximum(top, sink)
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.exp(ms - top[None, :])
    den = tl.sum(ls * w, axis=0)
    num = tl.sum(part * (ls * w if NORM_PARTIAL else w)[:, :, None], axis=0)
    if HAS_SINK:
        den += tl.exp(sink - top)
    o = num / tl.where(den > 0, den, 1.0)[:, None]
    tl.store(o_ptr + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :], o.to(o_ptr.dtype.element_ty),
             mask=h_ok[:, None])


def default_splits(rows: int, heads: int, width: int, device, waves: int = 2, min_keys: int = 64,
                   max_splits: int = 32) -> int:
    """Split-K count from static shapes only (capture-safe): as many programs as fit in `waves` waves of one
    per SM (rounded down: a partly filled extra wave costs a whole one) when few queries carry long lists
    (decode), one split when queries are plenty (prefill); each split keeps at least `min_keys` list entries
    (two BLOCK_N steps), at most `max_splits`. The limits are the fastest of the counts `bench/attention.py
    --variants` timed around them (docs/results/README.md); an A800's 108 SMs may move them."""
    sms = sm_count(device)
    if sms is None:
        return 1
    programs = rows * triton.cdiv(heads, BLOCK_H)
    want = waves * sms // max(programs, 1)
    return int(max(1, min(want, width // min_keys, max_splits)))


SMALL_BATCH_SPLITS = 8  # from this many splits on: the tiled combine, and the two lists read as one where ...
JOINT_MAX_SHARE = 64  # ... a split's share of the list entries is at most this many


def _split_choices(splits: int, width: int) -> dict:
    """joint and combine for a split count over lists `width` entries wide (`decode_plan`'s rule, also sparse_attn's
    default for an explicit split count): from SMALL_BATCH_SPLITS splits on the tiled combine, and joint where a
    split's share is at most JOINT_MAX_SHARE entries (two 32-entry steps; apart: a partly empty step of each list)."""
    few = splits >= SMALL_BATCH_SPLITS
    return {"joint": few and width <= JOINT_MAX_SHARE * splits, "combine": "tiles" if few else "loop"}


def decode_plan(rows: int, heads: int, width: int, device) -> dict:
    """`sparse_attn`'s choices for splits=None, from static shapes only: `default_splits`, twice the splits (a
    program a 32-entry step) while they still fit in one wave of one program per SM (few query tokens: batch 1-8
    decode), and from SMALL_BATCH_SPLITS splits on the lists read as one (joint) with the tiled combine; joint only
    where a split's share is at most JOINT_MAX_SHARE entries (at long lists the lists apart were faster), the loop
    combine below SMALL_BATCH_SPLITS (faster at the 2-4 splits of large batches). Short lists (below 8 splits by
    `default_splits`' 64 entries a split) double their splits by the same one-wave test, then take joint and the
    tiled combine by the same rule where they reach 8. Each rule is the faster side of a timed pair
    (`bench/attention.py`, docs/results/README.md); the SWA-only layers' 128 entries (2 -> 4 splits) follow the rule
    untimed."""
    splits = default_splits(rows, heads, width, device)
    wide = min(2 * splits, max(width // 32, 1), 32)
    if wide > splits and rows * triton.cdiv(heads, BLOCK_H) * wide <= (sm_count(device) or 1):
        splits = wide
    return {"splits": splits, **_split_choices(splits, width)}


def sparse_attn(q, swa_cache, swa_ids, swa_lens, extra_cache=None, extra_ids=None, extra_lens=None, sink=None,
                *, scale: float = HEAD_DIM ** -0.5, heads: int | None = None, splits: int | None = 1,
                block_n: int = 32, partial_dtype: torch.dtype = torch.bfloat16,
                out: torch.Tensor | None = None, num_warps: int = 4, num_stages: int = 2, joint: bool | None = None,
                combine: str | None = None) -> torch.Tensor:
    """o [T, Hpad, 512] (BF16) for q [T, Hpad, 512]; caches [slots, 512] BF16; ids [T, W] int32 slots;
    lens [T] int32; sink [>= heads] fp32. Only the first `heads` heads are computed (default all).
    splits=None picks them with `decode_plan` from the static shapes.
    partial_dtype (splits > 1): the split partials' workspace dtype. bfloat16 (default) stores each split's
    partial normalised (acc / l: a weighted mean of value rows, rounded once to BF16, so off by at most 2^-9 of
    the largest value row, which exceeds the output's own rounding where splits cancel) and halves the workspace
    traffic, which at batch 64 and 640 keys per query is half as many bytes again as the keys themselves in fp32
    with 4 splits of [16, 512] partials; float32 keeps each split's unnormalised sum (BF16 partials time as fast or
    faster at most decode shapes: docs/results/README.md).
    joint (with an extra list): a split owns a contiguous range of the SWA and extra lists read as one, not a share
    of each (`_stream_joint`). combine "tiles": the split-K combine loads every split's partial at once
    (`_combine_tiles_kernel`), "loop": one split after another (`_combine_kernel`). None (default): both from the
    split count by `decode_plan`'s rule (`_split_choices`), which with splits=None also picks the split count."""
    t_total, hpad, dim = q.shape
    if dim != HEAD_DIM or swa_cache.shape[-1] != HEAD_DIM:
        raise ValueError(f"head dim must be {HEAD_DIM}, got q {dim}, cache {swa_cache.shape[-1]}")
    caches = [swa_cache] + ([extra_cache] if extra_cache is not None else [])
    if q.stride(2) != 1 or swa_ids.stride(-1) != 1 or any(c.stride(0) != HEAD_DIM or c.stride(-1) != 1 for c in caches):
        raise ValueError("q and the index lists must be contiguous in their last dimension and the caches [slots, 512]")
    heads = hpad if heads is None else heads
    width = swa_ids.shape[1] + (extra_ids.shape[1] if extra_ids is not None else 0)
    if splits is None:
        splits = decode_plan(t_total, heads, width, q.device)["splits"]
    choices = _split_choices(splits, width)
    joint = choices["joint"] if joint is None else joint
    combine = choices["combine"] if combine is None else combine
    out = torch.empty_like(q) if out is None else out
    has_extra = extra_cache is not None
    if not has_extra:
        extra_cache, extra_ids, extra_lens = swa_cache, swa_ids, swa_lens  # never read
    ws_acc = ws_ml = out
    if combine not in ("loop", "tiles"):
        raise ValueError(f"combine must be 'loop' or 'tiles', got {combine!r}")
    if partial_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"partial_dtype must be float32 or bfloat16, got {partial_dtype}")
    norm_partial = partial_dtype != torch.float32
    if splits > 1:
        ws_acc = torch.empty((t_total, splits, heads, HEAD_DIM), dtype=partial_dtype, device=q.device)
        ws_ml = torch.empty((t_total, splits, heads, 2), dtype=torch.float32, device=q.device)
    sink_arg = sink if sink is not None else q
    grid = (t_total, triton.cdiv(heads, BLOCK_H), splits)
    _sparse_attn_kernel[grid](
        q_ptr=q, stride_qt=q.stride(0), stride_qh=q.stride(1), swa_ptr=swa_cache, swa_ids_ptr=swa_ids,
        stride_swa_ids=swa_ids.stride(0), swa_lens_ptr=swa_lens, swa_width=swa_ids.shape[1], ext_ptr=extra_cache,
        ext_ids_ptr=extra_ids, stride_ext_ids=extra_ids.stride(0), ext_lens_ptr=extra_lens,
        ext_width=extra_ids.shape[1], sink_ptr=sink_arg, o_ptr=out, stride_ot=out.stride(0), stride_oh=out.stride(1),
        ws_acc_ptr=ws_acc, ws_ml_ptr=ws_ml, heads=heads, scale=float(scale), HAS_EXTRA=has_extra,
        HAS_SINK=sink is not None, SPLITS=splits, D=HEAD_DIM, BLOCK_H=BLOCK_H, BLOCK_N=block_n, DOT_F32=_INTERPRETED,
        NORM_PARTIAL=norm_partial and splits > 1, JOINT=joint and has_extra, num_warps=num_warps,
        num_stages=num_stages)
    if splits > 1 and combine == "tiles":
        splits_p2 = triton.next_power_of_2(splits)
        block_d = max(16, min(128, 512 // splits_p2))  # SPLITS_P2 x 16 heads x block_d = 8192 values a program
        _combine_tiles_kernel[(t_total, triton.cdiv(heads, BLOCK_H), HEAD_DIM // block_d)](
            ws_acc, ws_ml, sink_arg, out, out.stride(0), out.stride(1), heads,
            HAS_SINK=sink is not None, SPLITS=splits, SPLITS_P2=splits_p2, D=HEAD_DIM, BLOCK_H=BLOCK_H,
            BLOCK_D=block_d, NORM_PARTIAL=norm_partial, num_warps=4,
        )
    elif splits > 1:
        _combine_kernel[(t_total, triton.cdiv(heads, BLOCK_H), HEAD_DIM // COMBINE_D)](
            ws_acc, ws_ml, sink_arg, out, out.stride(0), out.stride(1), heads,
            HAS_SINK=sink is not None, SPLITS=splits, D=HEAD_DIM, BLOCK_H=BLOCK_H, BLOCK_D=COMBINE_D,
            NORM_PARTIAL=norm_partial, num_warps=4,
        )
    return out
