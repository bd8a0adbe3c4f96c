"""The hyper-connection pre-norm GEMM (dsv4_sm80/kernels/hc_prenorm.py) against DeepGEMM's
`tf32_hc_prenorm_gemm` (the native path on SM90), in one run, at DeepSeek-V4-Flash's shape: the 4 residual
streams of hidden 4096 flattened (K = 16384, BF16) times hc_fn [24, 16384] fp32, with the split count SGLang's
`mhc_pre` asks for at each token count (`_compute_num_split_for_mhc_pre`: min(SMs / 64-row blocks,
K blocks / 4)). mHC is replicated across TP ranks, so these are per-GPU shapes at any TP.

Each row: microseconds (CUDA-graph replays, enough input copies to defeat the L2 cache), GB/s (residual +
hc_fn read, partials written) and its share of the measured copy bandwidth, the launch + bytes floor, and
ours / native. Twice per layer (before attention and before the MoE), 43 layers: a row's time x 86 is its
share of one forward.

    python bench/mhc.py --out mhc.json

On an H200 these are H200 numbers; an A800 has no DeepGEMM (the native column is then absent).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.dirname(os.path.abspath(__file__))]

K, N = 4 * 4096, 24
TOKENS = (1, 4, 16, 64, 256, 1024, 2048, 8192)
L2_DEFEAT_BYTES = 256 << 20
# --variants: tiles against default_config (H200, 2026-12-01, `steps.sh mhc-bench` at 83c84a6: 32 % of copy
# from 256 tokens on, 3-4.5x DeepGEMM's time in prefill): smaller row blocks (more programs per SM when SGLang
# asks for one split), longer K steps and deeper pipelines (more bytes in flight per program), more warps. Each is
# config keys of hc_prenorm.
VARIANTS = {
    "block_m 32": {"block_m": 32},
    "block_m 16": {"block_m": 16},
    "block_k 128": {"block_k": 128},
    "stages 4": {"num_stages": 4},
    "stages 5": {"num_stages": 5},
    "warps 8": {"num_warps": 8},
    "block_m 32, stages 4": {"block_m": 32, "num_stages": 4},
    "block_m 32, block_k 128, stages 3": {"block_m": 32, "block_k": 128, "num_stages": 3},
    "block_m 64, block_k 128, warps 8, stages 3": {"block_m": 64, "block_k": 128, "num_warps": 8, "num_stages": 3},
    "block_m 128, warps 8": {"block_m": 128, "num_warps": 8},
    # each split cut again into programs of their own (deterministic sum after): more load streams per SM
    "inner 2": {"inner_splits": 2},
    "inner 4": {"inner_splits": 4},
    "block_m 32, inner 2": {"block_m": 32, "inner_splits": 2},
    "block_m 16, block_k 128, inner 2": {"block_m": 16, "block_k": 128, "inner_splits": 2},
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--out")
    ap.add_argument("--variants", action="store_true", help="also time VARIANTS (other tiles) at each size")
    args = ap.parse_args(argv)

    import torch

    import common
    from dsv4_sm80.kernels.hc_prenorm import hc_prenorm

    try:
        import deep_gemm

        native = deep_gemm.tf32_hc_prenorm_gemm if torch.cuda.get_device_capability()[0] >= 9 else None
    except ImportError:
        native = None
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    peak = common.copy_gbps()
    empty = common.empty_kernel_us()
    name = torch.cuda.get_device_name()
    print(f"mhc bench on {name}: copy {peak:.0f} GB/s, empty kernel {empty:.1f} us, {sms} SMs")
    print(f"{'tokens':>7} {'splits':>6} {'ours us':>8} {'GB/s (%pk)':>12} {'native us':>9} {'ours/native':>11}"
          f" {'floor us':>8}")
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    b = torch.randn(N, K, device="cuda", generator=g) * 0.02
    for m in map(int, args.tokens.split(",")):
        grid = (m + 63) // 64
        splits = max(1, min(sms // max(grid, 1), (K // 64) // 4))
        copies = max(1, L2_DEFEAT_BYTES // (m * K * 2))
        a = [torch.randn(m, K, device="cuda", generator=g).to(torch.bfloat16) for _ in range(copies)]
        d = torch.empty(splits, m, N, device="cuda")
        s = torch.empty(splits, m, device="cuda")
        it = iter(range(1 << 62))

        def ours():
            hc_prenorm(a[next(it) % copies], b, d, s, splits)

        t_ours = common.timed(ours)
        t_native = None
        if native is not None:
            def nat():
                native(a[next(it) % copies], b, d, s, num_splits=splits)

            t_native = common.timed(nat)
        nbytes = m * K * 2 + N * K * 4 + splits * m * (N + 1) * 4
        floor = empty + nbytes / (peak * 1e3)
        row = dict(tokens=m, splits=splits, ours_us=t_ours * 1e6, gbps=nbytes / t_ours / 1e9,
                   native_us=None if t_native is None else t_native * 1e6, floor_us=floor)
        rows.append(row)
        nat_s = "-" if t_native is None else f"{t_native * 1e6:9.1f}"
        ratio = "-" if t_native is None else f"{t_ours / t_native:11.2f}"
        print(f"{m:>7} {splits:>6} {t_ours * 1e6:8.1f} {row['gbps']:6.0f} ({row['gbps'] / peak:4.0%}) {nat_s:>9}"
              f" {ratio:>11} {floor:8.1f}")
        if args.variants:
            row["variants"] = {}
            for vname, cfg in VARIANTS.items():
                def var(cfg=cfg):
                    hc_prenorm(a[next(it) % copies], b, d, s, splits, config=cfg)

                try:
                    row["variants"][vname] = common.timed(var) * 1e6
                except Exception as e:  # e.g. out of shared memory for a tile on this GPU: named, not fatal
                    row["variants"][vname] = None
                    print(f"        {vname}: {type(e).__name__}: {str(e)[:120]}")
            print("        variants (us): " + "  ".join(f"{k} {v:.1f}" for k, v in row["variants"].items()
                                                     if v is not None))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(gpu=name, copy_gbps=peak, empty_us=empty, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
