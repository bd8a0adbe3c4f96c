"""Routed-expert MoE at DeepSeek-V4-Flash TP4 per-rank shapes (256 experts, hidden 4096, intermediate 512
per rank, top-6), both SM80 backends in one run:

  mxfp4_int8  dsv4_sm80.kernels.w4a8_moe: MXFP4 resident, W4A8 on INT8 (the table's kernel per size)
  marlin      SGLang 0.5.16's fused_marlin_moe on MXFP4 (W4A16, BF16 MMA): what the `marlin` backend
              runs, and on an H200 also the native path (native SM90 DSV4 uses this kernel; the only
              native difference is the Python check the overlay lifts)

Printed per token count: microseconds; decode (1-64 tokens): GB/s of expert bytes touched against the
measured HBM (device copy) peak, and the floor = empty-kernel time + bytes / peak; prefill (512-16384):
TOP/s against the measured INT8 and BF16 tensor-core peaks. Plus the relative difference between the two
backends' outputs (the accuracy of each against an exact reference is in tests/kernels/test_w4a8_moe.py).

Each timed call routes its tokens afresh (one of ROUTINGS random routings, in turn): the experts one call reads
at decode (6 at one token: 19 MB at TP4 shapes) fit in an H200's 50 MB L2 (an A800's 40 MB), so calls that all
read the same experts (`--same-routing`) measure L2, not HBM, at the smallest sizes; in a model each layer's
experts are different weights.

    python bench/moe.py --out moe.json              (an H200 prints H200 numbers, not A800 ones)
    python bench/moe.py --variants --out moe.json   (every row's kernel of the W4A8 table at every size)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.dirname(os.path.abspath(__file__))]

E, H, I_PP, TOP_K = 256, 4096, 512, 6
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import common  # noqa: E402
from common import PROFILE_CALLS, kernel_profile, timed  # noqa: E402

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
    """The expanded kernel's fixed cost: `_expand_kernel` over every expert of gate-up and of down into
    one workspace each (the expanded kernel with a workspace of all experts), in a CUDA graph: microseconds and GB/s
    (codes + scale bytes read, INT8 written) against the copy peak."""
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


def alternatives() -> dict:
    """--variants: every row's kernel of the W4A8 table (`w4a8_moe_table.TABLE`), by row name, timed at every size
    beside the default: the switch points between rows are the tuning choices an A800 run re-measures."""
    from dsv4_sm80.kernels.w4a8_moe_table import TABLE

    out = {}
    for row in TABLE:
        if row.kernel not in out.values():  # (rows sharing a kernel: timed once, under the first one's name)
            out[row.name] = row.kernel
    return out


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
                    help="with --variants: only the table rows whose name contains this (alternatives joined by |)")
    ap.add_argument("--variants", action="store_true",
                    help="also time every W4A8 table row's kernel at every size (the switch points)")
    ap.add_argument("--profile", action="store_true",
                    help=f"per size, also each CUDA kernel's device time per call (torch.profiler, {PROFILE_CALLS} "
                         "eager calls) for the W4A8 default and Marlin")
    ap.add_argument("--profile-only", default="",
                    help="with --variants and --profile: also profile the table rows whose name contains this "
                         "(alternatives joined by |)")
    ap.add_argument("--same-routing", action="store_true",
                    help="every call the same routing (the experts stay in L2 between calls at decode sizes)")
    ap.add_argument("--once", default="",
                    help="for Nsight Compute: at the first --tokens size, two eager calls of this table row "
                         "('default': the table's choice) and nothing else (ncu -k regex:_w4a8 --launch-skip 2: the "
                         "second call's launches)")
    ap.add_argument("--no-marlin", action="store_true",
                    help="the W4A8 kernel alone, without SGLang (no Marlin column): a quick timing on a GPU host "
                         "with only torch and Triton")
    args = ap.parse_args(argv)

    import torch

    from dsv4_sm80.kernels.w4a8_moe import repack_mxfp4_for_w4a8, shift_refs, w4a8_moe
    from dsv4_sm80.kernels.w4a8_moe_table import select

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
    variants = alternatives()
    if args.once not in ("", "default", *variants):
        raise SystemExit(f"bench/moe.py --once {args.once!r}: not a W4A8 table row; 'default' or one of "
                         f"{sorted(variants)}")
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
    # A800 has); Marlin issues mma.sync either way. The peaks above are cuBLAS's (wgmma on SM90):
    # bench/mma_peak.py measures mma.sync's.
    record["triton_mma"] = "mma.sync only (DISABLE_MMA_V3=1)" if os.environ.get("DISABLE_MMA_V3") == "1" else (
        "wgmma allowed" if torch.cuda.get_device_capability(0)[0] >= 9 else "mma.sync")
    print(f"moe bench on {record['gpu']}: Triton MMA {record['triton_mma']}")
    if not args.once and min(shiftable) == 1.0 and max(int(x) for x in args.tokens.split(",")) > 8192:
        record["expand"] = xp = expand_us(torch, ours, erefs)  # what the expanded path pays per call before its GEMMs
        print(f"moe bench: every expert expanded to INT8 (the expanded kernel's decode, gate-up and down): "
              f"{xp['us']:.1f} us, {xp['gbps']:.0f} GB/s ({100 * xp['gbps'] / pk['copy_gbps']:.0f} % of copy)")
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

        def run_int8(kernel=None, r=None):
            """The W4A8 call: the table's kernel, or a row's (`alternatives`)."""
            tw, ids, _ = route(r)
            return w4a8_moe(x, *ours, tw, ids, swiglu_limit=10.0, routed_scaling_factor=1.0, kernel=kernel,
                            expand_ok=min(shiftable) == 1.0, **erefs)  # (as dsv4_sm80/stages/moe.py decides)

        def run_marlin(r=None):
            if fused_marlin_moe is None:
                raise RuntimeError("--no-marlin")
            tw, ids, logits = route(r)
            return fused_marlin_moe(x, layer.w13_weight, layer.w2_weight, layer.w13_weight_scale,
                                    layer.w2_weight_scale, logits, tw, ids, global_num_experts=e,
                                    workspace=workspace, num_bits=4, clamp_limit=10.0)

        if args.once:
            for _ in range(2):
                run_int8(None if args.once == "default" else variants[args.once])
            torch.cuda.synchronize()
            print(f"moe bench --once: two calls of {args.once!r} at {m} tokens")
            return 0
        row = {"tokens": m, "table_row": select(m * TOP_K, inter, min(shiftable) == 1.0).name}
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
        print(f"        W4A8 table row: {row['table_row']}")
        for k in ("int8_error", "marlin_error"):
            if k in row:
                print("  ", k, row[k])
        if "read_floor_us" in row:
            print(f"        read floor: {row['read_floor_us']:.1f} us (two launches reading only the pairs' expert "
                  f"codes, gate-up then down, {READ_CHUNK // 1024} KiB a program)")
        if args.variants:
            row["variants"], row["variant_rel"] = {}, {}
            base = run_int8(r=routes[0]).float() if "int8_s" in row else None
            for name, kernel in variants.items():
                if not any(o in name for o in args.only.split("|")):
                    continue
                try:
                    row["variants"][name] = timed(lambda: run_int8(kernel)) * 1e6
                    if base is not None:  # the same routing as the default's: a variant that computes another MoE shows
                        got = run_int8(kernel, r=routes[0]).float()
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
            for name, kernel in variants.items() if args.variants and args.profile_only else ():
                if any(o in name for o in args.profile_only.split("|")):
                    runs.append((name, lambda kernel=kernel: run_int8(kernel)))
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
