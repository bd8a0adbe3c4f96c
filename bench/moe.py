"""Routed-expert MoE at DeepSeek-V4-Flash TP4 per-rank shapes (256 experts, hidden 4096, intermediate 512
per rank, top-6), both SM80 backends in one run:

  mxfp4_int8  dsv4_sm80.kernels.w4a8_moe: MXFP4 resident, W4A8 on INT8 tensor cores
  marlin      SGLang 0.5.16's fused_marlin_moe on MXFP4 (W4A16, BF16 MMA): what the `marlin` backend
              runs, and on an H200 also the native path (native SM90 DSV4 uses this kernel; the only
              native difference is the Python check the overlay lifts)

Printed per token count: microseconds; decode (1-64 tokens): GB/s of expert bytes touched against the
measured HBM (device copy) peak, and the floor = empty-kernel time + bytes / peak; prefill (512-16384):
TOP/s against the measured INT8 and BF16 tensor-core peaks. Plus the relative difference between the two
backends' outputs (the accuracy of each against an exact reference is in tests/test_w4a8_moe.py).

Each timed call routes its tokens afresh (one of ROUTINGS random routings, in turn): the experts one call reads
at decode (6 at one token: 19 MB at TP4 shapes) fit in an H200's 50 MB L2 (an A800's 40 MB), so calls that all
read the same experts (`--same-routing`, the way sessions 4-15 timed) measure L2, not HBM, at the smallest
sizes; in a model each layer's experts are different weights.

    python bench/moe.py --out moe.json        (an H200 prints H200 numbers, not A800 ones)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.dirname(os.path.abspath(__file__))]

E, H, I_PP, TOP_K = 256, 4096, 512, 6
import common  # noqa: E402
from common import PROFILE_CALLS, kernel_profile, timed  # noqa: E402

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

READ_CHUNK = 16384  # bytes per program of the read floor's kernel


@triton.jit
def _read_experts_kernel(w_ptr, ids_ptr, out_ptr, expert_bytes, CHUNK: tl.constexpr):
    """Program (pair, chunk) reads CHUNK bytes of its pair's expert (16-byte loads, 4 warps) and stores a sum of
    them: the routed experts' bytes read and nothing else (`read_floor_us`)."""
    p = tl.program_id(0)
    c = tl.program_id(1)
    e = tl.load(ids_ptr + p).to(tl.int64)
    words = (w_ptr + e * expert_bytes + c * CHUNK).to(tl.pointer_type(tl.int32))
    v = tl.load(words + tl.arange(0, CHUNK // 4))
    tl.store(out_ptr + p * tl.num_programs(1) + c, tl.sum(v & 0xFF, axis=0))  # (each word's low byte: no overflow)


def read_floor_us(torch, w13, w2, routes) -> float:
    """Microseconds (CUDA-graph replays over the routings, in turn) of two launches that only read the routed
    experts' codes, per pair: the gate-up bytes, then the down bytes, each pair's expert in READ_CHUNK pieces.
    What any two-GEMM MoE with these bytes takes before its arithmetic; the launch + bytes floor counts one launch
    and no ramp."""
    turn = [0]
    outs = {}

    def run():
        ids = routes[turn[0] % len(routes)][1].reshape(-1)
        turn[0] += 1
        for w in (w13, w2):
            per = w[0].numel()  # int8 bytes per expert
            chunks = per // READ_CHUNK
            key = (w.data_ptr(), ids.numel())
            if key not in outs:
                outs[key] = torch.empty(ids.numel() * chunks, dtype=torch.int32, device=w.device)
            out = outs[key]
            _read_experts_kernel[(ids.numel(), chunks)](w, ids, out, per, CHUNK=READ_CHUNK, num_warps=4)

    return timed(run) * 1e6


def expand_us(torch, ours, erefs) -> dict:
    """The expanded path's fixed cost (config expand): `_expand_kernel` over every expert of gate-up and of down into
    one workspace each (as default_config's expand with a workspace of all experts), in a CUDA graph: microseconds
    and GB/s (codes + scale bytes read, INT8 written) against the copy peak. Session 22: the two-point fit put the
    decode at ~1.2 ms a call at TP4 shapes."""
    from dsv4_sm80.kernels.w4a8_moe import expand_experts

    w13, s13, w2, s2 = ours
    jobs = []
    for wb, wsc, er in ((w13, s13, erefs["w13_eref"]), (w2, s2, erefs["w2_eref"])):
        e, n, half_k = wb.shape
        w8 = torch.empty((e, n, 2 * half_k), dtype=torch.int8, device=wb.device)
        ok = torch.empty((e, n), dtype=torch.uint8, device=wb.device)
        jobs.append((wb.view(torch.uint8), wsc.view(torch.uint8), er.view(torch.uint8), w8, ok))

    def run():
        for wb, wsc, er, w8, ok in jobs:
            expand_experts(wb, wsc, er, w8, ok, 0, w8.shape[0], True)

    sec = timed(run, 3)
    nbytes = sum(j[0].numel() + j[1].numel() + j[3].numel() + j[4].numel() for j in jobs)
    return {"us": sec * 1e6, "bytes": nbytes, "gbps": nbytes / sec / 1e9}


ROUTINGS = 20  # distinct routings per size, cycled call by call (common.timed captures 20 calls per replay)
DECODE = (1, 2, 4, 8, 16, 32, 64)
PREFILL = (512, 2048, 8192, 16384)


def peaks(torch):
    out = {}
    n = 8192
    a = torch.randint(-100, 100, (n, n), dtype=torch.int8, device="cuda")
    b = torch.randint(-100, 100, (n, n), dtype=torch.int8, device="cuda").t()
    out["int8_tops"] = 2 * n**3 / timed(lambda: torch._int_mm(a, b), 3) / 1e12
    x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    out["bf16_tflops"] = 2 * n**3 / timed(lambda: x @ x, 3) / 1e12
    out["copy_gbps"], out["empty_kernel_us"] = common.copy_gbps(), common.empty_kernel_us()
    return out


# W4A8 alternatives timed with --variants (config keys of w4a8_moe), each against the default: the PTX
# table decoder with default_config's tiles and its per-size choice of the shift path (per group at decode,
# shift above 4096 pairs). Every variant names its shift setting, so the rows compare like with like.
VARIANTS = {
    # the shift path (int32 accumulation for columns whose exponents span <= 3 binades) against the
    # per-group loop; "eref 0" passes all-zero shift maps: the shift kernel's per-tile check, then the
    # per-group fallback everywhere (what the check and the bigger kernel cost)
    "shift on": {"shift": True},
    "shift off": {"shift": False},
    "shift, eref 0 (fallback)": {"shift": True, "_eref0": True},
    "shift, decode block_n 64": {"block_n": 64, "shift": True},  # the down kernel's activation group 64
    "fused io": {"fused_io": True},  # one-launch activation quantizer and top-k combine (~12 + 3 launches fewer)
    # per-pair outputs in BF16 before the top-k sum (as Marlin's intermediate cache): the [pairs, H] buffer is
    # the largest prefill traffic (1.6 GB fp32 at 16K tokens, written and read once)
    "pair bf16": {"pair_bf16": True},
    "fused io, pair bf16": {"fused_io": True, "pair_bf16": True},
    "alu-decode": {"decode": "alu"},
    "span-merge": {"merge": True, "shift": False},
    "block_n2 128": {"block_n2": 128},
    "block_m 128, warps 8, shift off": {"block_m": 128, "num_warps": 8, "shift": False},
    # tiles ranked by the sm_80 SASS census (bench/sass_census.py; instructions per IMMA): fewer warps
    # sharing one weight tile decode it fewer times
    "shift, tile 64x128, warps 4": {"block_m": 64, "block_n": 128, "block_n2": 128, "num_warps": 4, "shift": True},
    "shift, tile 32x128, warps 4": {"block_m": 32, "block_n": 128, "block_n2": 128, "num_warps": 4, "shift": True},
    "shift, tile 64x64, warps 8": {"block_m": 64, "block_n": 64, "block_n2": 128, "num_warps": 8, "shift": True},
    "shift off, tile 64x128, warps 4": {"block_m": 64, "block_n": 128, "block_n2": 128, "num_warps": 4,
                                        "shift": False},
    "shift off, tile 32x128, warps 4": {"block_m": 32, "block_n": 128, "block_n2": 128, "num_warps": 4,
                                        "shift": False},
    "shift off, tile 16x32, warps 4": {"block_m": 16, "block_n": 32, "block_n2": 64, "num_warps": 4, "shift": False},
}
# The prefill sweep (--only prefill-): session 21's H200 run had W4A8 at Marlin's time from 2048 tokens on (1.04 /
# 1.00 / 0.99 at 2048 / 8192 / 16384), i.e. 16-21 % of the mma.sync INT8 peak, while an H200's mma.sync INT8 runs at
# 2.26x its BF16 (bench/mma_peak.py) and Marlin reached 39-48 % of that BF16 rate. The sm_80 SASS census
# (bench/sass_census.py) of the >4096-pair tile (64x128, 4 warps, shift) counts 9.3 instructions per IMMA, within an
# SM80 or H200 scheduler's issue budget, but 45 spilled words; with 8 warps 10.8 and no spill (more warps to hide
# latency with, each holding half the accumulators). The rest of the [pairs, H] traffic: pair_bf16 (half the bytes of
# the largest buffer) and fused_io (one-launch quantizer and combine; 763 -> 698 us at 512 tokens, session 21). Each
# entry names its shift setting and tiles; the down tile is block_n2 wide with the gate-up's block_m and warps.
PREFILL_TILE = {"block_m": 64, "block_n": 128, "block_n2": 128, "num_warps": 4, "num_stages": 3, "shift": True}
VARIANTS.update({f"prefill-{name}": dict(PREFILL_TILE, **cfg) for name, cfg in {
    "64x128, warps 4, fused io": {"fused_io": True},
    "64x128, warps 4, fused io, pair bf16": {"fused_io": True, "pair_bf16": True},
    "64x128, warps 4, stages 4": {"num_stages": 4},
    "64x128, warps 8": {"num_warps": 8},
    "64x128, warps 8, stages 4": {"num_warps": 8, "num_stages": 4},
    "64x128, warps 8, fused io, pair bf16": {"num_warps": 8, "fused_io": True, "pair_bf16": True},
    "64x256, warps 8": {"block_n": 256, "num_warps": 8},  # (block_n 256: the intermediate's INT8 group is 256)
    "32x128, warps 4": {"block_m": 32},
    "32x128, warps 8": {"block_m": 32, "num_warps": 8},
    # 769-1500 tokens (session 22: Marlin 1.01-1.09x ahead there; 16-24 rows an expert): shorter tiles with the shift path
    "32x64, warps 4": {"block_m": 32, "block_n": 64},
    "16x128, warps 4": {"block_m": 16},
    # ... and with the default's fused io and BF16 pair outputs (the glue is ~1/6 of the time at 1024 tokens: the
    # 64x128 tile 893 -> 751 us with them, session 22), so that the tile alone is what differs from the default
    "32x128, warps 4, fused io, pair bf16": {"block_m": 32, "fused_io": True, "pair_bf16": True},
    "32x64, warps 4, fused io, pair bf16": {"block_m": 32, "block_n": 64, "fused_io": True, "pair_bf16": True},
    "16x128, warps 4, fused io, pair bf16": {"block_m": 16, "fused_io": True, "pair_bf16": True},
    "32x128, warps 4, shift only, fused io, pair bf16": {"block_m": 32, "shift_only": True, "fused_io": True,
                                                         "pair_bf16": True},
    "32x64, warps 2, stages 4, fused io, pair bf16": {"block_m": 32, "block_n": 64, "num_warps": 2, "num_stages": 4,
                                                      "fused_io": True, "pair_bf16": True},
    "128x32, warps 2": {"block_m": 128, "block_n": 32, "block_n2": 64, "num_warps": 2},  # one warp's tile 64 rows tall
    "64x32, warps 1": {"block_m": 64, "block_n": 32, "block_n2": 64, "num_warps": 1},
    # the shift loop alone (no per-group fallback compiled beside it): the census's 4-warp in-loop spills, 8 -> 0 (the
    # bench's maps are all shiftable; a real checkpoint's fraction is printed at start-up)
    "64x128, warps 4, shift only": {"shift_only": True},
    "64x128, warps 8, shift only": {"num_warps": 8, "shift_only": True},
    # config expand: every expert decoded once per call into an INT8 workspace (expand_mb at a time), then plain INT8
    # grouped GEMMs whose loop only loads and multiplies (the 4-bit tile decodes each weight tile once per M tile:
    # ~6 times per expert at 16K tokens); the decode's ~2.4 GB of traffic (TP4, 4-bit in, INT8 out) against that
    "expand 64x128, k 128, warps 4": {"expand": True},
    "expand 64x128, k 128, warps 4, stages 4": {"expand": True, "num_stages": 4},
    "expand 64x128, k 64, warps 4, stages 4": {"expand": True, "block_k": 64, "num_stages": 4},
    "expand 128x128, k 128, warps 8": {"expand": True, "block_m": 128, "num_warps": 8},
    "expand 128x128, k 64, warps 8, stages 4": {"expand": True, "block_m": 128, "block_k": 64, "num_warps": 8,
                                                "num_stages": 4},
    "expand 64x128, k 128, warps 4, all experts": {"expand": True, "expand_mb": 4096},
    "expand 64x128, k 128, warps 4, fused io, pair bf16": {"expand": True, "fused_io": True, "pair_bf16": True},
    "expand 64x128, k 64, warps 4, stages 4, fused io, pair bf16": {"expand": True, "block_k": 64, "num_stages": 4,
                                                                    "fused_io": True, "pair_bf16": True},
    "expand 64x128, k 128, warps 4, fused io": {"expand": True, "fused_io": True},
    "expand 64x128, k 128, warps 4, pair bf16": {"expand": True, "pair_bf16": True},
    "64x128, warps 4, shift only, fused io, pair bf16": {"shift_only": True, "fused_io": True, "pair_bf16": True},
}.items()})
# The decode sweep (--only decode-): which tile, warp count and pipeline depth reach HBM bandwidth at 1-64 tokens
# on this GPU (session 7's decode tile moved 35-45 % of the copy peak on the H200, Marlin 70-78 %); each entry is
# that tile (pinned here, shift off) with the keys it names changed. Session 8's H200 sweep put 2 warps, the
# 128-wide down tile and 4 stages into default_config from 5 tokens on; to be re-run on an A800.
DECODE_TILE = {"block_m": 16, "block_n": 32, "block_n2": 64, "num_warps": 4, "num_stages": 3, "shift": False}
VARIANTS.update({f"decode-{name}": dict(DECODE_TILE, **cfg) for name, cfg in {
    "16x32x64, warps 4, stages 3 (session 7 default)": {},
    "stages 2": {"num_stages": 2},
    "stages 4": {"num_stages": 4},
    "stages 5": {"num_stages": 5},
    "stages 6": {"num_stages": 6},
    "warps 2, stages 3": {"num_warps": 2, "num_stages": 3},
    "warps 2, stages 4": {"num_warps": 2, "num_stages": 4},
    "warps 2, stages 6": {"num_warps": 2, "num_stages": 6},
    "warps 8, stages 3": {"num_warps": 8, "num_stages": 3},
    "block_n 64, stages 4": {"block_n": 64, "num_stages": 4},
    "block_n 64, warps 2, stages 4": {"block_n": 64, "num_warps": 2, "num_stages": 4},
    "block_n2 32": {"block_n2": 32},
    "block_n2 128": {"block_n2": 128},
    "block_n2 128, warps 2, stages 4": {"block_n2": 128, "num_warps": 2, "num_stages": 4},
    "16x32x128, warps 2, stages 5": {"block_m": 16, "block_n": 32, "block_n2": 128, "num_warps": 2,
                                     "num_stages": 5},
    # session 8's profile: ~25-40 us per call of small torch kernels around the two GEMMs (the activation
    # quantizer, the top-k combine); fused_io makes them one Triton launch each
    "fused io": {"fused_io": True},
    "warps 2, stages 4, fused io": {"num_warps": 2, "num_stages": 4, "fused_io": True},
    "block_n2 128, warps 2, stages 4, fused io": {"block_n2": 128, "num_warps": 2, "num_stages": 4,
                                                  "fused_io": True},
    # the down kernel moved 57 % of copy bandwidth at 64 tokens against gate-up's 70 % (session 8's profile):
    # 8 K steps per program at K = 512, so a wider tile spreads each program's fixed cost over more bytes
    "block_n2 256, warps 2, stages 4": {"block_n2": 256, "num_warps": 2, "num_stages": 4},
    "block_n2 256, warps 4, stages 4": {"block_n2": 256, "num_warps": 4, "num_stages": 4},
    # at 1 token the gate-up launch has 6 experts x 16 column tiles = 96 programs for the whole GPU: split-K
    # gives each K share its own program (fp32 partials, a deterministic finishing kernel)
    "split_k 2": {"split_k": 2},
    "split_k 4": {"split_k": 4},
    "warps 2, stages 4, split_k 4": {"num_warps": 2, "num_stages": 4, "split_k": 4},
    "block_n2 128, warps 2, stages 4, split_k 8": {"block_n2": 128, "num_warps": 2, "num_stages": 4, "split_k": 8},
    # session 16: 16 tokens at 65 % of copy bandwidth with fresh routings (goal 70 %): the 5-64 token default
    # (the next entry but one above) with a wider gate-up tile, a deeper pipeline, a wider down tile, 4 warps
    "block_n 64, block_n2 128, warps 2, stages 4, fused io": {"block_n": 64, "block_n2": 128, "num_warps": 2,
                                                              "num_stages": 4, "fused_io": True},
    "block_n2 128, warps 2, stages 5, fused io": {"block_n2": 128, "num_warps": 2, "num_stages": 5, "fused_io": True},
    "block_n2 128, warps 2, stages 6, fused io": {"block_n2": 128, "num_warps": 2, "num_stages": 6, "fused_io": True},
    "block_n2 256, warps 2, stages 4, fused io": {"block_n2": 256, "num_warps": 2, "num_stages": 4, "fused_io": True},
    "block_n2 128, warps 4, stages 4, fused io": {"block_n2": 128, "num_warps": 4, "num_stages": 4, "fused_io": True},
    # session 11 made fused io the decode default: split-K on top of it (the one-token gate-up had 96 programs)
    "fused io, split_k 2": {"fused_io": True, "split_k": 2},
    "fused io, split_k 4": {"fused_io": True, "split_k": 4},
    "fused io, split_k 8": {"fused_io": True, "split_k": 8},
    "block_n2 128, warps 2, stages 4, fused io, split_k 4": {"block_n2": 128, "num_warps": 2, "num_stages": 4,
                                                             "fused_io": True, "split_k": 4},
    # session 11's one-token profile: ~8 us of the 32 in launches around the two GEMMs, 3.7 of them SGLang's
    # alignment (moe_align_block_size: two kernels); pair_blocks drops it (one pair per M block)
    "pair blocks, fused io": {"pair_blocks": True, "fused_io": True},
    "pair blocks, fused io, split_k 2": {"pair_blocks": True, "fused_io": True, "split_k": 2},
    "pair blocks, fused io, split_k 4": {"pair_blocks": True, "fused_io": True, "split_k": 4},
    "pair blocks, fused io, stages 5": {"pair_blocks": True, "fused_io": True, "num_stages": 5},
    # the one-token gate-up moves ~27 % of copy bandwidth with 96 programs: latency-bound, and pipeline depth
    # barely moved it (session 8), so the weight loads of several K steps per iteration (unrolled)
    "pair blocks, fused io, unroll 2": {"pair_blocks": True, "fused_io": True, "unroll": 2},
    "pair blocks, fused io, unroll 4": {"pair_blocks": True, "fused_io": True, "unroll": 4},
    "pair blocks, fused io, unroll 8": {"pair_blocks": True, "fused_io": True, "unroll": 8},
    "pair blocks, fused io, split_k 2, unroll 4": {"pair_blocks": True, "fused_io": True, "split_k": 2, "unroll": 4},
    "fused io, unroll 4": {"fused_io": True, "unroll": 4},
    # session 15's sweep: pair blocks + split_k 4 best at 1 and 4 tokens (21.4 / 60.1 us); unroll helped without
    # split-K (25.5 against 27.7) and hurt with it: the down launch unrolled alone, and the neighbours
    "pair blocks, fused io, split_k 4, unroll_down 2": {"pair_blocks": True, "fused_io": True, "split_k": 4,
                                                        "unroll_down": 2},
    "pair blocks, fused io, split_k 4, unroll_down 4": {"pair_blocks": True, "fused_io": True, "split_k": 4,
                                                        "unroll_down": 4},
    "pair blocks, fused io, split_k 8": {"pair_blocks": True, "fused_io": True, "split_k": 8},
    "pair blocks, fused io, split_k 4, block_n2 32": {"pair_blocks": True, "fused_io": True, "split_k": 4,
                                                      "block_n2": 32},
    "pair blocks, fused io, split_k 4, block_n2 128": {"pair_blocks": True, "fused_io": True, "split_k": 4,
                                                       "block_n2": 128},
    "pair blocks, fused io, split_k 4, warps 2, stages 4": {"pair_blocks": True, "fused_io": True, "split_k": 4,
                                                            "num_warps": 2, "num_stages": 4},
    "block_n2 128, warps 2, stages 4, fused io, unroll 4": {"block_n2": 128, "num_warps": 2, "num_stages": 4,
                                                            "fused_io": True, "unroll": 4},
    # (session 18's config prefetch, the scale loads carried one or two K steps ahead in registers, lost at every
    # size on the H200 in session 19: 25.4-36.4 us against the default's 24.4 at one token, 55.8-72.5 against 59.5
    # at 4; removed)
    # ... or the issue rate: the per-group loop converts every 32-deep dot of all 16 tile rows (one real at one token)
    # with I2F at quarter rate; the shift path accumulates in int32 instead (no I2F; no split-K: shift takes K whole;
    # block_n 64 also gives the down launch the 64-column activation group its shift path needs)
    "pair blocks, fused io, shift": {"pair_blocks": True, "fused_io": True, "shift": True},
    "pair blocks, fused io, shift, block_n 64": {"pair_blocks": True, "fused_io": True, "shift": True, "block_n": 64},
    # ... or without the MMA: gemv multiplies the pair's one row on CUDA cores (PRMT decode + DP4A), one column per
    # thread, ~2.7 SASS instructions per code in the gate-up loop against ~5.9 (+16 quarter-rate I2F) per step of
    # the 16-row MMA tile (sm_80 SASS, session 18); more K shares for more programs (96 at split_k 4, tile 128)
    "pair blocks, fused io, gemv, split_k 4": {"pair_blocks": True, "fused_io": True, "gemv": True, "split_k": 4},
    "pair blocks, fused io, gemv, split_k 8": {"pair_blocks": True, "fused_io": True, "gemv": True, "split_k": 8},
    "pair blocks, fused io, gemv, split_k 16": {"pair_blocks": True, "fused_io": True, "gemv": True, "split_k": 16},
    "pair blocks, fused io, gemv, split_k 8, gemv_n 64": {"pair_blocks": True, "fused_io": True, "gemv": True,
                                                          "split_k": 8, "gemv_n": 64},
    "pair blocks, fused io, gemv, split_k 8, block_n2 128": {"pair_blocks": True, "fused_io": True, "gemv": True,
                                                             "split_k": 8, "block_n2": 128},
    "pair blocks, fused io, gemv, split_k 1": {"pair_blocks": True, "fused_io": True, "gemv": True, "split_k": 1},
    # session 19 (H200, TP4 shapes): gemv won from 2 to 32 tokens (35.4 / 43.3 / 78.0 / 120.0 / 211.2 us at 2 / 4 /
    # 8 / 16 / 32 against the MMA configs' 39.4 / 61.0 / 96.8 / 150.4 / 231.4) and is their default now (to 16
    # tokens above 512 intermediate per rank); the two "mma" entries below are the configs it replaced, to keep the
    # switch points measured (a Triton pipeline over the gemv loop, tl.range with cp.async, was slower at every
    # size, 28.4-31.1 us at one token, 65.7-74.2 at 4: removed)
    # the gemv loop's warps wait on their loads (H200 profile at one token: 4.5-5.3 cycles of long-scoreboard stall
    # per issued instruction, 18-22 % of issue slots used; the MMA loop uses 59 %): the loads issued 1 or 2 K
    # steps ahead, carried in registers
    "pair blocks, fused io, gemv, split_k 8, block_n2 128, prefetch 1": {
        "pair_blocks": True, "fused_io": True, "gemv": True, "split_k": 8, "block_n2": 128, "gemv_prefetch": 1},
    "pair blocks, fused io, gemv, split_k 8, block_n2 128, prefetch 2": {
        "pair_blocks": True, "fused_io": True, "gemv": True, "split_k": 8, "block_n2": 128, "gemv_prefetch": 2},
    "pair blocks, fused io, gemv, split_k 4, prefetch 2": {
        "pair_blocks": True, "fused_io": True, "gemv": True, "split_k": 4, "gemv_prefetch": 2},
    "pair blocks, fused io, gemv, split_k 16, prefetch 2": {
        "pair_blocks": True, "fused_io": True, "gemv": True, "split_k": 16, "gemv_prefetch": 2},
    # (session 20, H200, TP4 shapes: prefetch 1 the fastest gemv at 2-32 tokens, 29.7 / 41.0 / 71.2 / 113.5 / 200.9 us
    # at 2 / 4 / 8 / 16 / 32 against the plain loop's 33.4 / 42.6 / 76.9 / 119.2 / 207.8, and default_config's since;
    # 24.7 at one token against the MMA tile's 24.6; prefetch 2 ahead of 1 only at 8 tokens, 70.9 against 71.2)
    # ... with more warps per scheduler as well (gemv had 1.45 at one token; the MMA launches 2.7)
    "pair blocks, fused io, gemv, split_k 16, gemv_n 64, prefetch 2": {
        "pair_blocks": True, "fused_io": True, "gemv": True, "split_k": 16, "gemv_n": 64, "gemv_prefetch": 2},
    "pair blocks, fused io, gemv, split_k 8, block_n2 32, prefetch 2": {
        "pair_blocks": True, "fused_io": True, "gemv": True, "split_k": 8, "block_n2": 32, "gemv_prefetch": 2},
    "pair blocks, fused io, split_k 4, mma": {"pair_blocks": True, "fused_io": True, "split_k": 4, "gemv": False,
                                              "block_n2": 64},
    "block_n2 128, warps 2, stages 4, fused io, mma": {"block_n2": 128, "num_warps": 2, "num_stages": 4,
                                                       "fused_io": True, "gemv": False, "pair_blocks": False,
                                                       "split_k": 1},
}.items()})
for _cfg in VARIANTS.values():  # the MMA kernel unless a variant names gemv (default_config's choice at 2-32 tokens),
    _cfg.setdefault("gemv", False)  # and gemv's plain loop unless it names a prefetch depth (default_config's is 1)
    _cfg.setdefault("gemv_prefetch", 0)
# session 29: config wide, the one-token path without split-K or a top-k launch: a gate-up program holds its pair's
# whole K for wide_n columns (every load issued at once, the K sum across the program's threads, the GLU in its
# epilogue), a down program all of a token's pairs for wide_n2 output columns (their sum and the routed scaling applied
# there); the intermediate's INT8 group is wide_n. Sizes: gate-up wide_n x wide_warps, down wide_n2 x wide_warps2
# (sizes whose codes fit the registers). First H200 run (three launches with the quantizer's): 17.4 us at one token
# for 16 x 8 warps / 16 x 8 warps, against the MMA default's 24.3-24.9; default_config's at one token since is
# "wide 32x16w, down 16x8w, quant in" (16.5-16.9 us)
VARIANTS.update({f"wide {a}x{aw}w, down {b}x{bw}w{', quant in' if q else ''}": {
    "wide": True, "wide_n": a, "wide_warps": aw, "wide_n2": b, "wide_warps2": bw, "wide_quant": q}
    for a, aw, b, bw, q in ((16, 8, 16, 8, False), (16, 8, 16, 16, False), (16, 16, 16, 8, False),
                            (32, 16, 16, 8, False), (32, 32, 16, 16, False), (16, 8, 16, 8, True),
                            (16, 16, 16, 8, True), (32, 16, 16, 8, True), (32, 32, 16, 8, True))})


def mxfp4_like_scales(torch, e, n, k, gen):
    """E8M0 bytes [e, n, k/32] as MXFP4 quantization of Gaussian rows gives them: each group's exponent is
    floor(log2(amax of its 32 values)) (minus a constant), so a row's groups share its scale and differ by
    how the amax of 32 normal samples varies: spreads of 1-3 binades within a row of 16-128 groups (so all
    columns shiftable; the shiftable fraction is printed; a real checkpoint's is printed at start-up by
    dsv4_sm80/stages/moe.py). Rows get their own base exponent (118..125) as real weight rows have different norms."""
    base = torch.randint(118, 126, (e, n, 1), generator=gen, device=gen.device, dtype=torch.int32)
    amax = torch.randn(e, n, k // 32, 32, generator=gen, device=gen.device).abs().amax(dim=-1)
    off = torch.floor(torch.log2(amax)).to(torch.int32)  # about -1..2 for 32 samples
    return (base + off - off.amin(dim=-1, keepdim=True)).clamp(1, 254).to(torch.uint8)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", default=",".join(map(str, DECODE + PREFILL)))
    ap.add_argument("--experts", type=int, default=E)
    ap.add_argument("--inter", type=int, default=I_PP,
                    help="expert intermediate width per rank: 512 at TP4 (the default), 2048 at TP1 (bench/e2e.py's "
                         "full-width checkpoint on one GPU)")
    ap.add_argument("--only", default="",
                    help="with --variants: only the variants whose name contains this (alternatives joined by |)")
    ap.add_argument("--variants", action="store_true",
                    help="also time the W4A8 kernel's alternatives per size (decoder, span merge, tiles)")
    ap.add_argument("--profile", action="store_true",
                    help=f"per size, also each CUDA kernel's device time per call (torch.profiler, {PROFILE_CALLS} "
                         "eager calls) for the W4A8 default and Marlin")
    ap.add_argument("--profile-only", default="",
                    help="with --variants and --profile: also profile the variants whose name contains this "
                         "(alternatives joined by |)")
    ap.add_argument("--same-routing", action="store_true",
                    help="every call the same routing (the experts stay in L2 between calls at decode sizes; "
                         "sessions 4-15 timed this way)")
    ap.add_argument("--once", default="",
                    help="for Nsight Compute: at the first --tokens size, two eager calls of this variant ('default': "
                         "default_config) and nothing else (ncu -k regex:_w4a8 --launch-skip 2: the second call's "
                         "launches)")
    ap.add_argument("--no-marlin", action="store_true",
                    help="the W4A8 kernel alone, without SGLang (no Marlin column): a quick timing on a GPU host "
                         "with only torch and Triton")
    args = ap.parse_args(argv)

    import torch

    from dsv4_sm80.kernels.w4a8_moe import repack_mxfp4_for_w4a8, shift_refs, w4a8_moe

    e, inter = args.experts, args.inter
    gen = torch.Generator(device="cuda").manual_seed(0)
    dev = "cuda"

    def experts(n, k):
        w = torch.randint(0, 256, (e, n, k // 2), generator=gen, device=dev, dtype=torch.int32).to(torch.int8)
        return w, mxfp4_like_scales(torch, e, n, k, gen).view(torch.float8_e8m0fnu)

    w13, s13 = experts(2 * inter, H)
    w2, s2 = experts(H, inter)
    ours = [repack_mxfp4_for_w4a8(w13.clone()), s13, repack_mxfp4_for_w4a8(w2.clone()), s2]
    erefs = {"w13_eref": shift_refs(s13), "w2_eref": shift_refs(s2)}
    no_shift = {"w13_eref": torch.zeros_like(erefs["w13_eref"]), "w2_eref": torch.zeros_like(erefs["w2_eref"])}
    shiftable = [float((m > 0).float().mean()) for m in erefs.values()]
    print(f"shiftable columns (exponent spread <= 3 binades): gate-up {100 * shiftable[0]:.1f} %, "
          f"down {100 * shiftable[1]:.1f} %")
    layer = torch.nn.Module()
    if args.no_marlin:
        fused_marlin_moe = workspace = None
    else:
        from sglang.srt.layers.moe.fused_moe_triton.fused_marlin_moe import fused_marlin_moe
        from sglang.srt.layers.quantization.marlin_utils import marlin_make_workspace
        from sglang.srt.layers.quantization.marlin_utils_fp4 import prepare_moe_mxfp4_layer_for_marlin

        for name, t in (("w13_weight", w13), ("w2_weight", w2), ("w13_weight_scale_inv", s13),
                        ("w2_weight_scale_inv", s2)):
            layer.register_parameter(name, torch.nn.Parameter(t.clone(), requires_grad=False))
        prepare_moe_mxfp4_layer_for_marlin(layer)
        workspace = marlin_make_workspace(torch.device(dev), max_blocks_per_sm=4)
    bytes_per_expert = (2 * inter * H + H * inter) * (1 / 2 + 1 / 32)

    record = {"gpu": torch.cuda.get_device_name(0), "capability": list(torch.cuda.get_device_capability(0)),
              "shapes": {"experts": e, "hidden": H, "intermediate_per_rank": inter, "top_k": TOP_K},
              "peaks": peaks(torch), "rows": []}
    pk = record["peaks"]
    print(f"moe bench on {record['gpu']}: {e} experts, hidden {H}, intermediate {inter} per rank, top-{TOP_K}")
    print(f"moe bench on {record['gpu']}: peaks INT8 {pk['int8_tops']:.0f} TOP/s, BF16 {pk['bf16_tflops']:.0f} "
          f"TFLOP/s, copy {pk['copy_gbps']:.0f} GB/s, empty kernel {pk['empty_kernel_us']:.1f} us")
    # On SM90 Triton lowers the 64-row tiles' tl.dot to wgmma unless DISABLE_MMA_V3=1 (then mma.sync, the only MMA an
    # A800 has; session 22); Marlin issues mma.sync either way. The peaks above are cuBLAS's (wgmma on SM90):
    # bench/mma_peak.py measures mma.sync's.
    record["triton_mma"] = "mma.sync only (DISABLE_MMA_V3=1)" if os.environ.get("DISABLE_MMA_V3") == "1" else (
        "wgmma allowed" if torch.cuda.get_device_capability(0)[0] >= 9 else "mma.sync")
    print(f"moe bench on {record['gpu']}: Triton MMA {record['triton_mma']}")
    if not args.once and min(shiftable) == 1.0 and max(int(x) for x in args.tokens.split(",")) > 8192:
        record["expand"] = xp = expand_us(torch, ours, erefs)  # what the expanded path pays per call before its GEMMs
        print(f"moe bench: every expert expanded to INT8 (config expand's decode, gate-up and down): {xp['us']:.1f} us, "
              f"{xp['gbps']:.0f} GB/s ({100 * xp['gbps'] / pk['copy_gbps']:.0f} % of copy)")
    print(f"{'tokens':>6s} {'experts':>7s} {'int8 us':>9s} {'marlin us':>9s} {'int8/marlin':>11s}  "
          f"{'GB/s int8 (%pk)':>16s} {'GB/s marlin (%pk)':>17s} {'floor us':>8s}  {'TOP/s int8 (%int8pk)':>20s} "
          f"{'TFLOP/s marlin (%bf16pk)':>24s} {'rel diff':>8s}")
    record["routings_per_size"] = 1 if args.same_routing else ROUTINGS
    for m in [int(x) for x in args.tokens.split(",")]:
        x = torch.randn(m, H, generator=gen, device=dev).to(torch.bfloat16)
        routes = []
        for _ in range(record["routings_per_size"]):
            scores = torch.rand(m, e, generator=gen, device=dev)
            tw, ids = torch.topk(scores, TOP_K, dim=1)
            routes.append(((tw / tw.sum(1, keepdim=True)).float(), ids.to(torch.int32), scores.to(torch.bfloat16)))
        turn = [0]

        def route(r):
            """The given routing, or the next one in turn (a captured graph of calls reads them in order)."""
            if r is None:
                r = routes[turn[0] % len(routes)]
                turn[0] += 1
            return r

        def run_int8(config=None, r=None):
            """The W4A8 call with config: default_config's, or a VARIANTS entry (its `_eref0`: all-zero shift maps)."""
            cfg = dict(config or {})
            maps = no_shift if cfg.pop("_eref0", False) else erefs
            tw, ids, _ = route(r)
            return w4a8_moe(x, *ours, tw, ids, swiglu_limit=10.0, routed_scaling_factor=1.0, config=cfg,
                            expand_ok=maps is erefs and min(shiftable) == 1.0, **maps)  # (as dsv4_sm80/stages/moe.py decides)

        def run_marlin(r=None):
            if fused_marlin_moe is None:
                raise RuntimeError("--no-marlin")
            tw, ids, logits = route(r)
            return fused_marlin_moe(x, layer.w13_weight, layer.w2_weight, layer.w13_weight_scale,
                                    layer.w2_weight_scale, logits, tw, ids, global_num_experts=e,
                                    workspace=workspace, num_bits=4, clamp_limit=10.0)

        if args.once:
            for _ in range(2):
                run_int8(None if args.once == "default" else VARIANTS[args.once])
            torch.cuda.synchronize()
            print(f"moe bench --once: two calls of {args.once!r} at {m} tokens")
            return 0
        row = {"tokens": m}
        try:
            row["int8_s"] = timed(run_int8)
        except Exception as err:
            row["int8_error"] = f"{type(err).__name__}: {err}"[:300]
        try:
            row["marlin_s"] = timed(run_marlin)
        except Exception as err:
            row["marlin_error"] = f"{type(err).__name__}: {err}"[:300]
        if "int8_s" in row and "marlin_s" in row:
            a, b = run_int8(r=routes[0]).float(), run_marlin(r=routes[0]).float()
            row["rel_diff"] = float((a - b).norm() / b.norm())
        # experts one call reads (the mean over the routings): its bytes, the floor's
        touched = round(sum(int(torch.unique(r[1]).numel()) for r in routes) / len(routes))
        nbytes = touched * bytes_per_expert + m * H * 2 * 2
        flops = 2 * m * TOP_K * (2 * inter * H + H * inter)
        row.update(experts_touched=touched, bytes=nbytes, flops=flops,
                   floor_s=pk["empty_kernel_us"] / 1e6 + nbytes / (pk["copy_gbps"] * 1e9))
        if m <= 8:  # decode sizes where nearly every pair has its own expert (the read is per pair)
            row["read_floor_us"] = read_floor_us(torch, ours[0], ours[2], routes)
        record["rows"].append(row)

        def cell(key, peak, unit_div, width):
            if key not in row:
                return f"{'ERR':>{width}s}"
            rate = (nbytes if unit_div == 1e9 else flops) / row[key] / unit_div
            return f"{rate:8.0f} ({100 * rate / peak:3.0f}%)".rjust(width)

        i8, mr = row.get("int8_s"), row.get("marlin_s")
        print(f"{m:6d} {touched:7d} {i8 * 1e6 if i8 else float('nan'):9.1f} {mr * 1e6 if mr else float('nan'):9.1f} "
              f"{(i8 / mr) if i8 and mr else float('nan'):11.2f}  "
              f"{cell('int8_s', pk['copy_gbps'], 1e9, 16)} {cell('marlin_s', pk['copy_gbps'], 1e9, 17)} "
              f"{row['floor_s'] * 1e6:8.1f}  {cell('int8_s', pk['int8_tops'], 1e12, 20)} "
              f"{cell('marlin_s', pk['bf16_tflops'], 1e12, 24)} {row.get('rel_diff', float('nan')):8.2e}")
        for k in ("int8_error", "marlin_error"):
            if k in row:
                print("  ", k, row[k])
        if "read_floor_us" in row:
            print(f"        read floor: {row['read_floor_us']:.1f} us (two launches reading only the pairs' expert "
                  f"codes, gate-up then down, {READ_CHUNK // 1024} KiB a program)")
        if args.variants:
            row["variants"], row["variant_rel"] = {}, {}
            base = run_int8(r=routes[0]).float() if "int8_s" in row else None
            for name, cfg in VARIANTS.items():
                if not any(o in name for o in args.only.split("|")):
                    continue
                try:
                    row["variants"][name] = timed(lambda: run_int8(cfg)) * 1e6
                    if base is not None:  # the same routing as the default's: a variant that computes another MoE shows
                        got = run_int8(cfg, r=routes[0]).float()
                        row["variant_rel"][name] = float((got - base).norm() / base.norm())
                except Exception as err:
                    row["variants"][name] = f"{type(err).__name__}: {err}"[:200]
            print("        variants (us; relative difference to the default's output):", "  ".join(
                f"{n} {v:.1f} ({row['variant_rel'].get(n, float('nan')):.1e})" if isinstance(v, float) else f"{n} ERR"
                for n, v in row["variants"].items()))
        if args.profile:
            # eager calls (timed() replays a CUDA graph): the sum is device time only, launch gaps excluded
            row["profile"] = {}
            runs = [("int8", run_int8), ("marlin", run_marlin)]
            for name, cfg in VARIANTS.items() if args.variants and args.profile_only else ():
                if any(o in name for o in args.profile_only.split("|")) and not cfg.get("_eref0"):
                    runs.append((name, lambda cfg=cfg: run_int8(cfg)))
            for backend, fn in runs:
                try:
                    prof = row["profile"][backend] = kernel_profile(fn)
                    print(f"  profile {backend} (us/call, sum {sum(prof.values()):.1f}):", "  ".join(
                        f"{n} {us:.1f}" for n, us in prof.items()))
                except Exception as err:
                    row["profile"][backend] = f"{type(err).__name__}: {err}"[:300]
                    print(f"  profile {backend} failed: {row['profile'][backend]}")
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
