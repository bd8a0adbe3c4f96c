"""On an H200 (SM90): the SM80 hc pre-norm GEMM (dsv4_sm80/kernels/hc_prenorm.py) against DeepGEMM's own
`tf32_hc_prenorm_gemm`, the kernel SGLang's native mhc_pre runs, on the same inputs at DSV4-Flash's shape (K = 4 x
4096) and the split counts SGLang asks for, agreeing at fp32-accumulation level (relative to sum |a| |tf32(b)|, bound
2e-6). With the kernel truncating hc_fn to TF32 (2026-12-01) it found 1.1-3.2e-5 from DeepGEMM, close to what
truncation against round-to-nearest gives on the CPU at these shapes (1.5-3.0e-5), less so to truncation against exact
fp32 products (1.5-2.4e-5). So the kernel now rounds hc_fn to nearest TF32, and this check also prints DeepGEMM's own
distance from both models (products in float64 of rounded and of exact hc_fn): the smaller one says what the H200's
wgmma does with an fp32 operand. On the H200 (2026-12-01): at most 1.9e-6 from DeepGEMM, which sits 1.5e-7-2.4e-6 from
the rounded products and 5e-6-1.2e-5 from the exact ones.

    python -m dsv4_lab.beds.mhc_check [--out mhc_check.json]
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out")
    args = ap.parse_args(argv)

    import deep_gemm
    import torch

    from dsv4_sm80.kernels import hc_prenorm
    from dsv4_sm80.kernels import hc_prenorm_ref as ref

    assert torch.cuda.get_device_capability()[0] == 9, "DeepGEMM's hc pre-norm GEMM is compared on SM90"
    k, rows, worst = 16384, [], 0.0
    g = torch.Generator(device="cuda").manual_seed(0)
    b = torch.randn(24, k, device="cuda", generator=g) * 0.02
    br = ref.tf32_round(b.cpu()).cuda().double()
    bt = br.abs()
    for m, splits in [(1, 64), (16, 64), (100, 54), (130, 44), (2048, 4), (8192, 1)]:
        a = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
        d0, s0 = torch.empty(splits, m, 24, device="cuda"), torch.empty(splits, m, device="cuda")
        d1, s1 = torch.empty_like(d0), torch.empty_like(s0)
        deep_gemm.tf32_hc_prenorm_gemm(a, b, d0, s0, num_splits=splits)
        hc_prenorm.hc_prenorm(a, b, d1, s1, splits)
        scale = a.double().abs() @ bt.t()
        dd = ((d0.double().sum(0) - d1.double().sum(0)).abs() / scale).max().item()
        ds = ((s0.double().sum(0) - s1.double().sum(0)).abs() / s0.double().sum(0)).max().item()
        deep = d0.double().sum(0)
        vs_round = ((deep - a.double() @ br.t()).abs() / scale).max().item()
        vs_exact = ((deep - a.double() @ b.double().t()).abs() / scale).max().item()
        rows.append(dict(tokens=m, splits=splits, mix_rel=dd, sqrsum_rel=ds, deepgemm_vs_round=vs_round,
                         deepgemm_vs_exact=vs_exact))
        worst = max(worst, dd, ds)
        print(f"  tokens {m:5d} splits {splits:3d}: mix {dd:.2e}, sum of squares {ds:.2e} (relative); DeepGEMM "
              f"vs rounded-TF32 products {vs_round:.2e}, vs exact fp32 products {vs_exact:.2e}", flush=True)
    ok = worst < 2e-6
    print(f"mhc_check: {'OK' if ok else 'FAIL'} worst {worst:.2e} (bound 2e-6)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(rows=rows, worst=worst, ok=ok), f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
