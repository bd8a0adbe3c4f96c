"""Every W4A8 alternative bench/moe.py --variants times, computed on the CPU (Triton interpreter) against the INT8
emulation reference: in its own file so that CI's workers (`-n 2 --dist loadfile`) run it beside the other kernel
tests of tests/test_w4a8_moe.py, not after them (it interprets ~100 configurations)."""

import os

import torch

from conftest import dev
from dsv4_sm80.kernels import w4a8_moe_ref as ref
from test_w4a8_moe import case, k  # noqa: F401  (k: the kernel module fixture)


def test_every_bench_variant_computes_the_moe(k):
    """bench/moe.py --variants times alternatives any of which may become a default (session 11's fused io did):
    each one, on a case its tiles divide, against the INT8 emulation reference written from the math (its
    intermediate group is the variant's block_n), with the shift maps given as the layer gives them."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_moe", os.path.join(os.path.dirname(__file__), "..",
                                                                            "bench", "moe.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    # 256 wide (a 256-wide down tile and up to 4 K shares of 64 divide it; a variant with more shares, 8, runs on
    # a 512-wide case), intermediate 128 (a 128-wide gate-up tile divides it), spreads of 2 binades per row (every
    # column shiftable: the shift path runs where a variant asks)
    cases, want = {}, {}

    def at(h, inter):
        if (h, inter) not in cases:
            # 2 tokens, top-2 of 2 experts: both experts hit (aligned tiles with 2 rows each), 4 pairs for gemv (the
            # interpreter's time is per program: a third less than 3 experts and 6 pairs)
            x, w13, s13, w2, s2, tw, ids = case(t=2, h=h, inter=inter, e=2, top_k=2, seed=53, exp_lo=121, exp_hi=124)
            a, b = k.repack_mxfp4_for_w4a8(dev(w13.clone())), k.repack_mxfp4_for_w4a8(dev(w2.clone()))
            maps = {"w13_eref": k.shift_refs(dev(s13)), "w2_eref": k.shift_refs(dev(s2))}
            cases[h, inter] = ((x, w13, s13, w2, s2, tw, ids), (a, b), maps,
                               {n: torch.zeros_like(m) for n, m in maps.items()})
        return cases[h, inter]

    # In Triton's interpreter num_warps and num_stages are not part of the program (each program runs once, in
    # numpy) and the decode is the ALU one unless a config asks otherwise: variants that differ only there run
    # the identical interpreted computation, so each such class runs once here. Compiled (a GPU), every variant
    # is its own kernel and all of them run.
    ran = set()
    for name, cfg in bench.VARIANTS.items():
        cfg = dict(cfg)
        eref0 = cfg.pop("_eref0", False)
        if k._INTERPRETED:
            # (and the expanded path's workspace share and K step, gemv's loads issued ahead, the gate-up's K steps
            # unrolled: bit-equal to the plain forms by test_expanded_weights_equal_the_shift_loop_bit_for_bit,
            # test_gemv_equals_the_pair_block_mma_bit_for_bit, test_unrolled_k_steps_equal_the_plain_loop_bit_for_bit)
            same = {n: v for n, v in dict(k.default_config(2 * 2), **cfg).items()
                    if n not in ("num_warps", "num_stages", "expand_mb", "block_k", "gemv_prefetch", "unroll",
                                 "wide_warps", "wide_warps2")}
            same.setdefault("decode", "alu")
            key = (eref0, tuple(sorted(same.items())))
            if key in ran:
                continue
            ran.add(key)
        h = max(256, 64 * cfg.get("split_k", 1))  # a whole 64-deep step per K share
        full = dict(k.default_config(2 * 2), **cfg)
        # (the wide path has its own intermediate group; its widths tile every case here)
        group = full["wide_n"] if k.takes_wide(cfg, full, h, 128) else full["block_n"]
        inter = max(128, group)  # (a 256-wide gate-up tile: intermediate 256)
        (x, w13, s13, w2, s2, tw, ids), (a, b), maps, zero = at(h, inter)
        if (h, inter, group) not in want:
            want[h, inter, group] = ref.moe_int8_emulated(x, w13, s13, w2, s2, tw, ids, scaling=1.5,
                                                          group=group).float()
        out = k.w4a8_moe(*dev(x, a, s13, b, s2, tw, ids), routed_scaling_factor=1.5, config=cfg,
                         out=dev(torch.empty(x.shape, dtype=torch.float32)), **(zero if eref0 else maps)).cpu()
        err = (out - want[h, inter, group]).norm(dim=-1) / want[h, inter, group].norm(dim=-1).clamp_min(1e-30)
        assert float(err.max()) < 1e-2, (name, h, inter, err.tolist())
