"""The C4 lightning indexer's SM80 kernels (dsv4_sm80/kernels/indexer_int8.py) at decode shapes: 64 index
heads of 128 dims, the INT8 cache of 132-byte entries, one C4 entry per 4 tokens of context.

  q        q_rope_hadamard_int8 for 1, 16, 64 tokens: RoPE, Hadamard (BF16 tensor cores, three parts), rounding
  compress compress_store_index_k_int8 for a decode plan of 1, 16, 64 rows (every row completes a block)
  logits   paged_mqa_logits_int8 for 1, 16, 64 tokens at 4K, 64K and 512K context, with the static max length
           a serving engine captures its graphs with (--max-len, 1M context: 262,144 entries): the default
           grid (logits_splits programs per token), the grid with at most 4 / 16 / 64 pages a program, the
           default with the next page prefetched, and one program per page of the max length (a grid whose
           mostly-empty programs cost 40 us a decode step on the H200)

Each of the three for every indexer rounding in --roundings (SGLANG_DSV4_A100_INDEXER_ROUNDING): int8 (the
default: per-row INT8, one K = 128 MMA chain per page) and fp4_sim (the model's FP4 simulation: INT8 codes
with per-32 exponents, four K = 32 MMAs per page each scaled by its block pair; docs/attention.md).
The logits variants (caps, prefetch, per page) are timed for int8 only.

Each row: microseconds, GB/s of bytes read and written against the measured copy peak, and the floor =
empty-kernel time + bytes / peak. Native's counterpart (DeepGEMM's fp8_paged_mqa_logits and the FP8 Q
path) is not called here: bench/e2e.py --profile lists it per decode step beside ours.

    python bench/indexer.py --out indexer.json [--roundings int8,fp4_sim]   (an H200 prints H200 numbers)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.dirname(os.path.abspath(__file__))]

HEADS, DIM, RATIO, ENTRY = 64, 128, 4, 132
ROUNDINGS = ("int8", "fp4_sim")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", default="1,16,64")
    ap.add_argument("--contexts", default="4096,65536,524288")
    ap.add_argument("--max-len", type=int, default=262144, help="the static C4 length of the captured graphs")
    ap.add_argument("--roundings", default="int8", help=f"comma-joined, of {', '.join(ROUNDINGS)}")
    args = ap.parse_args(argv)
    roundings = [r for r in args.roundings.split(",") if r]
    if not roundings or set(roundings) - set(ROUNDINGS):
        ap.error(f"--roundings {args.roundings!r}: expected a comma-joined subset of {', '.join(ROUNDINGS)}")

    import torch

    import common
    from common import timed
    from dsv4_sm80.kernels import indexer_int8 as ix

    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    peak, empty_us = common.copy_gbps(), common.empty_kernel_us()
    record = {"gpu": torch.cuda.get_device_name(0), "copy_gbps": peak, "empty_kernel_us": empty_us,
              "q": [], "compress": [], "logits": []}
    print(f"indexer bench on {record['gpu']}: copy {peak:.0f} GB/s, empty kernel {empty_us:.1f} us")

    def row(kind, sec, nbytes, **keys):
        floor = empty_us / 1e6 + nbytes / (peak * 1e9)
        r = dict(keys, us=sec * 1e6, gbps=nbytes / sec / 1e9, floor_us=floor * 1e6)
        record[kind].append(r)
        return r, (f"{sec * 1e6:8.1f} us {r['gbps']:7.0f} GB/s ({100 * r['gbps'] / peak:3.0f}%) "
                   f"floor {floor * 1e6:6.1f} us x{sec / floor:5.2f}")

    freqs = torch.polar(torch.ones(1 << 20, 32, device=dev), torch.rand(1 << 20, 32, device=dev, generator=gen) * 6.28)
    tokens = [int(x) for x in args.tokens.split(",")]
    for rounding in roundings:
        fp4 = rounding == "fp4_sim"
        q_row = ENTRY if fp4 else DIM
        for t in tokens:
            q = torch.randn(t, HEADS, DIM, device=dev, generator=gen).to(torch.bfloat16)
            w = torch.randn(t, HEADS, device=dev, generator=gen).to(torch.bfloat16)
            pos = torch.randint(0, 1 << 20, (t,), device=dev, generator=gen)
            sec = timed(lambda: ix.q_rope_hadamard_int8(q, w, (DIM * HEADS) ** -0.5, freqs, pos, fp4_sim=fp4))
            _, line = row("q", sec, t * HEADS * (DIM * 2 + q_row + 2 + 4), tokens=t, rounding=rounding)
            print(f"q        {rounding:7s} {t:5d} tokens        {line}")
        for t in tokens:
            kv = torch.randn(t, DIM, device=dev, generator=gen)
            plan = torch.zeros(t, 4, dtype=torch.int32, device=dev)
            plan[:, 0] = RATIO * torch.arange(1, t + 1, device=dev, dtype=torch.int32)  # every row completes a block
            out_loc = torch.arange(t, device=dev, dtype=torch.int64)
            cache = torch.zeros(-(-t // 64), 64 * ENTRY, dtype=torch.uint8, device=dev)
            nw = torch.ones(DIM, device=dev)
            sec = timed(lambda: ix.compress_store_index_k_int8(kv, plan, True, out_loc, nw, 1e-6, freqs, cache,
                                                               fp4_sim=fp4))
            _, line = row("compress", sec, t * (DIM * 4 + ENTRY), rows=t, rounding=rounding)
            print(f"compress {rounding:7s} {t:5d} rows          {line}")
    max_len = args.max_len
    for ctx, t, rounding in [(int(c), t, r) for c in args.contexts.split(",") for t in tokens for r in roundings]:
        n = ctx // RATIO
        pages = -(-n // 64)
        fp4 = rounding == "fp4_sim"
        # the bytes, not their values, are timed: INT8 scales 0.0; FP4 codes in [-12, 12], exponents 0
        lim = 13 if fp4 else 128
        cache = torch.randint(1 - lim, lim, (t * pages, 64 * ENTRY), device=dev, generator=gen,
                              dtype=torch.int16).to(torch.uint8)
        cache.view(-1, 64 * ENTRY)[:, 64 * DIM:] = 0
        q8 = torch.randint(1 - lim, lim, (t, HEADS, ENTRY if fp4 else DIM), device=dev, generator=gen,
                           dtype=torch.int16).to(torch.int8)
        q8[..., DIM:] = 0
        w = torch.randn(t, HEADS, device=dev, generator=gen)
        lens = torch.full((t,), n, device=dev, dtype=torch.int32)
        table = torch.zeros(t, -(-max_len // 64), device=dev, dtype=torch.int32)
        table[:, :pages] = torch.randperm(t * pages, device=dev, generator=gen).to(torch.int32).view(t, pages)
        out = torch.empty(t, max_len, device=dev)
        nbytes = t * n * (ENTRY + 4)  # entries read, logits written
        sec = timed(lambda: ix.paged_mqa_logits_int8(q8, cache, w, lens, table, max_len, out=out, fp4_sim=fp4))
        r, line = row("logits", sec, nbytes, context=ctx, tokens=t, splits=ix.logits_splits(t, max_len, dev),
                      rounding=rounding)
        if not fp4:  # the grid and prefetch variants: INT8 only
            r["variants_us"] = {}
            for cap in (4, 16, 64):  # logits_splits with another cap on the pages a program walks
                sp = ix.logits_splits(t, max_len, dev, pages_per_program=cap)
                r["variants_us"][f"{cap} pages a program"] = timed(lambda: ix.paged_mqa_logits_int8(
                    q8, cache, w, lens, table, max_len, out=out, splits=sp)) * 1e6
            r["variants_us"]["prefetch"] = timed(lambda: ix.paged_mqa_logits_int8(
                q8, cache, w, lens, table, max_len, out=out, prefetch=True)) * 1e6
            r["per_page_us"] = timed(lambda: ix.paged_mqa_logits_int8(q8, cache, w, lens, table, max_len, out=out,
                                                                      splits=-(-max_len // 64))) * 1e6
            alts = "  ".join(f"{k} {v:.1f}" for k, v in r["variants_us"].items())
            line += f"  (a program per page: {r['per_page_us']:8.1f} us; {alts})"
        print(f"logits   {rounding:7s} {t:5d} tokens {ctx:7d} ctx {line}")
        cache = table = out = None  # freed before the next context
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
