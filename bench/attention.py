"""DSV4 sparse attention at DSV4-Flash TP4 per-rank shapes (16 query heads per rank, padded to 64; head dim
512; SWA window 128; C4 top-512; all C128 entries), the SM80 Triton kernel over BF16 caches, and, where
it runs, SGLang's native FlashMLA sparse decode over the FP8 cache (584-byte rows, same index lists), in
one run:

  decode   batch 1, 8, 64 at 4K, 64K and 512K context, for a C4 layer (128 SWA + 512 top-k keys) and a
           C128 layer (128 SWA + context/128 keys), and once an SWA-only layer (its 128 window keys; the
           SM80 kernel alone): microseconds, GB/s of key bytes gathered against the measured HBM peak
           (device copy), and the floor = empty-kernel time + bytes / peak
  prefill  8K and 32K query tokens of one request, C4 layer: microseconds and TFLOP/s

    python bench/attention.py --out attention.json      (an H200 prints H200 numbers, not A800 ones)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import triton
import triton.language as tl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.dirname(os.path.abspath(__file__))]

HEADS, HPAD, D, WINDOW, TOPK = 16, 64, 512, 128, 512
FP8_ROW = 584  # SGLang's DSV4 FP8 KV row: 448 FP8 nope + 64 BF16 rope + 7 scales + 1 pad (memory_pool.py:98-123)
PAGE = 256  # the pool's page (tokens); FlashMLA sees SWA blocks of WINDOW rows, C4/C128 blocks of PAGE // ratio


def _fp8_blocks(slots: int, block: int, dev):
    """A zeroed FP8 cache as the native backend hands it to FlashMLA (deepseek_v4_backend.py:1636-1655):
    [pages, padded page bytes] uint8, viewed [pages, block, 1, 584]."""
    import torch

    pages = -(-slots // block) + 1
    padded = -(-block * FP8_ROW // 576) * 576
    buf = torch.zeros(pages, padded, dtype=torch.uint8, device=dev)
    return buf[:, : block * FP8_ROW].view(pages, block, 1, FP8_ROW)


def native_decode(native, q, swa_ids, lens_s, ext_ids, lens_e, sink, ratio, dev):
    """SGLang 0.5.16's native decode call (FlashMLA sparse, FP8 cache) on the same lists: a callable."""
    import torch.nn.functional as F

    flash, get_meta = native
    swa_kc = _fp8_blocks(int(swa_ids.max()) + 1, WINDOW, dev)
    ext_kc = _fp8_blocks(int(ext_ids.max()) + 1, PAGE // ratio, dev)
    pad = (-ext_ids.shape[1]) % 64  # FlashMLA takes index widths in multiples of 64 (the backend pads with -1)
    eidx = F.pad(ext_ids, (0, pad), value=-1).unsqueeze(1).contiguous()
    idx, q4 = swa_ids.unsqueeze(1).contiguous(), q.unsqueeze(1)
    meta = get_meta()[0]
    return lambda: flash(q=q4, k_cache=swa_kc, head_dim_v=D, block_table=None, cache_seqlens=None,
                         tile_scheduler_metadata=meta, softmax_scale=D ** -0.5, is_fp8_kvcache=True, indices=idx,
                         topk_length=lens_s, attn_sink=sink, extra_k_cache=ext_kc, extra_indices_in_kvcache=eidx,
                         extra_topk_length=lens_e)


@triton.jit
def _gather_chain_kernel(cache_ptr, ids_ptr, part_ptr, D: tl.constexpr, BLOCK_N: tl.constexpr):
    """Only what any split-K sparse decode of one query must do in order (`chain_us`): an index load, the
    dependent gather of the BLOCK_N rows it names, one store per program."""
    pid = tl.program_id(0)
    ids = tl.load(ids_ptr + pid * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rows = tl.load(cache_ptr + ids[:, None] * D + tl.arange(0, D)[None, :])
    tl.store(part_ptr + pid * D + tl.arange(0, D), tl.sum(rows.to(tl.float32), axis=0))


@triton.jit
def _read_parts_kernel(part_ptr, out_ptr, PARTS: tl.constexpr, PARTS_P2: tl.constexpr, D: tl.constexpr):
    """... then a second launch reading every program's store (the split-K combine's part of the chain)."""
    offs = tl.arange(0, PARTS_P2)
    vals = tl.load(part_ptr + offs[:, None] * D + tl.arange(0, D)[None, :], mask=(offs < PARTS)[:, None], other=0.0)
    tl.store(out_ptr + tl.arange(0, D), tl.sum(vals, axis=0))


@triton.jit
def _gather_chain_ticket_kernel(cache_ptr, ids_ptr, part_ptr, count_ptr, out_ptr, PARTS: tl.constexpr,
                                PARTS_P2: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr):
    """The same chain in one launch: each program's gather and store, then a ticket (an acquire-release atomic on
    a counter); the program drawing the last ticket reads every partial (a split-K combine done by the
    last-arriving split) and sets the counter back to 0 for the next call."""
    pid = tl.program_id(0)
    ids = tl.load(ids_ptr + pid * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rows = tl.load(cache_ptr + ids[:, None] * D + tl.arange(0, D)[None, :])
    tl.store(part_ptr + pid * D + tl.arange(0, D), tl.sum(rows.to(tl.float32), axis=0))
    tl.debug_barrier()  # every thread's stores before the one thread's release (Triton issues a scalar atomic once)
    ticket = tl.atomic_add(count_ptr, 1, sem="acq_rel")
    if ticket == PARTS - 1:
        offs = tl.arange(0, PARTS_P2)
        vals = tl.load(part_ptr + offs[:, None] * D + tl.arange(0, D)[None, :], mask=(offs < PARTS)[:, None],
                       other=0.0, cache_modifier=".cg")
        tl.store(out_ptr + tl.arange(0, D), tl.sum(vals, axis=0))
        tl.atomic_xchg(count_ptr, 0)


def chain_us(cache, ids, block_n: int = 32, one_launch: bool = False) -> float:
    """Microseconds (CUDA-graph replays) of the chain over ids [entries] into cache [slots, 512]: one program per
    block_n entries, then one program reading their partials, as a second launch or (one_launch) by the program
    that finishes last. A latency floor the launch + bytes floor leaves out: no sparse decode of one query built
    that way can be shorter than this chain."""
    import torch

    from common import timed

    programs = ids.numel() // block_n
    parts = torch.empty(programs, D, dtype=torch.float32, device=cache.device)
    out = torch.empty(D, dtype=torch.float32, device=cache.device)
    count = torch.zeros(1, dtype=torch.int32, device=cache.device)
    p2 = triton.next_power_of_2(programs)

    def run():
        if one_launch:
            _gather_chain_ticket_kernel[(programs,)](cache, ids, parts, count, out, PARTS=programs, PARTS_P2=p2, D=D,
                                                     BLOCK_N=block_n)
            return
        _gather_chain_kernel[(programs,)](cache, ids, parts, D=D, BLOCK_N=block_n)
        _read_parts_kernel[(1,)](parts, out, PARTS=programs, PARTS_P2=p2, D=D)

    return timed(run) * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--contexts", default="4096,65536,524288")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--prefill", default="8192,32768", help="prefill token counts ('' for none)")
    ap.add_argument("--no-native", action="store_true")
    ap.add_argument("--variants", action="store_true",
                    help="also time other split counts, BLOCK_N 64, 8 warps, 3 stages, fp32 split "
                         "partials, the tiled combine and joint lists per decode shape")
    ap.add_argument("--profile", default="",
                    help="comma-separated batch sizes whose default decode call is also profiled per CUDA kernel "
                         "(device us per call, eager: the main kernel against the split-K combine)")
    ap.add_argument("--only", default="", help="with --variants: only the variants whose name contains one of these "
                                               "'|'-separated strings")
    args = ap.parse_args(argv)

    import torch

    import common
    from common import kernel_profile, timed
    from dsv4_sm80.kernels.sparse_attn import decode_plan, default_splits, sparse_attn

    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    copy_gbps, empty_us = common.copy_gbps(), common.empty_kernel_us()
    record = {"gpu": torch.cuda.get_device_name(0), "copy_gbps": copy_gbps, "empty_kernel_us": empty_us,
              "decode": [], "prefill": []}
    print(f"attention bench on {record['gpu']}: copy {copy_gbps:.0f} GB/s, empty kernel {empty_us:.1f} us")
    # batch 1's 640 entries (C4: 128 SWA + 512 top-k) as 20 programs of 32: the dependent chain alone
    cache = torch.randn(1 << 16, D, device=dev, generator=gen).to(torch.bfloat16)
    ids = torch.randperm(1 << 16, device=dev, generator=gen)[:640].to(torch.int32)
    record["chain_us"] = chain_us(cache, ids)
    record["chain_one_launch_us"] = chain_us(cache, ids, one_launch=True)
    print(f"latency floor: index load -> dependent 32-row gather -> store in 20 programs, then one program reading "
          f"their 20 partials: {record['chain_us']:.1f} us as two launches, {record['chain_one_launch_us']:.1f} us "
          f"in one (the last program to finish reads them) (the launch + bytes floor of 640 keys: "
          f"{empty_us + 640 * D * 2 / (copy_gbps * 1e3):.1f} us)")
    del cache

    native = None
    if not args.no_native:
        try:
            from sgl_kernel.flash_mla import flash_mla_with_kvcache, get_mla_metadata

            native = (flash_mla_with_kvcache, get_mla_metadata)
        except Exception as e:
            record["native_error"] = f"{type(e).__name__}: {e}"[:300]

    print(f"{'layer':6s} {'ctx':>7s} {'batch':>5s} {'keys/q':>7s} {'splits':>6s} {'us':>8s} {'GB/s (%pk)':>14s} "
          f"{'floor us':>8s} {'x floor':>7s} {'native us':>9s} {'native GB/s':>11s} {'sm80/native':>11s}")
    for i, ctx in enumerate(int(x) for x in args.contexts.split(",")):
        # an SWA-only layer (its 128 window entries, no extra list; any context) once, with the first context
        for layer in ("swa", "c4", "c128")[0 if i == 0 else 1:]:
            extra_n = {"swa": 0, "c4": TOPK}.get(layer, ctx // 128)
            for b in [int(x) for x in args.batches.split(",")]:
                swa_slots, extra_slots = b * WINDOW, max(b * extra_n, 1)
                swa = torch.randn(swa_slots, D, device=dev, generator=gen).to(torch.bfloat16)
                extra = torch.randn(extra_slots, D, device=dev, generator=gen).to(torch.bfloat16)
                swa_ids = torch.arange(swa_slots, device=dev, dtype=torch.int32).view(b, WINDOW)
                ext_ids = torch.randperm(extra_slots, device=dev, generator=gen)[:b * extra_n].to(torch.int32).view(
                    b, extra_n)
                lens_s = torch.full((b,), WINDOW, device=dev, dtype=torch.int32)
                lens_e = torch.full((b,), extra_n, device=dev, dtype=torch.int32)
                lists = (extra, ext_ids, lens_e) if extra_n else (None, None, None)  # (the extra list, if any)
                q = torch.randn(b, HPAD, D, device=dev, generator=gen).to(torch.bfloat16)
                sink = torch.randn(HPAD, device=dev, generator=gen)
                plan = decode_plan(b, HEADS, WINDOW + extra_n, q.device)  # sparse_attn's own choice
                splits = plan["splits"]
                sec = timed(lambda: sparse_attn(q, swa, swa_ids, lens_s, *lists, sink, heads=HEADS, splits=None))
                nbytes = b * (WINDOW + extra_n) * D * 2
                floor = empty_us / 1e6 + nbytes / (copy_gbps * 1e9)
                row = {"layer": layer, "context": ctx, "batch": b, "keys_per_query": WINDOW + extra_n,
                       "splits": splits, "joint": plan["joint"], "combine": plan["combine"], "us": sec * 1e6,
                       "gbps": nbytes / sec / 1e9, "floor_us": floor * 1e6}
                record["decode"].append(row)
                nat = ""
                if native is not None and extra_n:  # (FlashMLA's call here passes an extra cache: C4 / C128 only)
                    try:  # the native path's own bytes: 584 per key
                        nsec = timed(native_decode(native, q, swa_ids, lens_s, ext_ids, lens_e, sink,
                                                   4 if layer == "c4" else 128, dev))
                        row.update(native_us=nsec * 1e6, native_gbps=b * (WINDOW + extra_n) * FP8_ROW / nsec / 1e9)
                        nat = f" {nsec * 1e6:9.1f} {row['native_gbps']:11.0f} {sec / nsec:11.2f}"
                    except Exception as err:  # report once, then time the SM80 kernel alone
                        record["native_error"] = f"{type(err).__name__}: {err}"[:300]
                        print(f"native FlashMLA failed, not measured further: {record['native_error']}")
                        native = None
                print(f"{layer:6s} {ctx:7d} {b:5d} {WINDOW + extra_n:7d} {splits:3d}{'j' if plan['joint'] else ' '}"
                      f"{'t' if plan['combine'] == 'tiles' else ' '} {sec * 1e6:8.1f} "
                      f"{row['gbps']:8.0f} ({100 * row['gbps'] / copy_gbps:3.0f}%) {floor * 1e6:8.1f} "
                      f"{sec / floor:7.2f}{nat}")
                if str(b) in args.profile.split(","):
                    prof = row["profile"] = kernel_profile(lambda: sparse_attn(
                        q, swa, swa_ids, lens_s, *lists, sink, heads=HEADS, splits=None))
                    print(f"        profile (us/call, sum {sum(prof.values()):.1f}):",
                          "  ".join(f"{n} {v:.1f}" for n, v in prof.items()))
                if args.variants:
                    old = default_splits(b, HEADS, WINDOW + extra_n, q.device)
                    alts = {f"earlier plan (splits {old}, lists apart, loop combine)": dict(
                                splits=old, joint=False, combine="loop"),
                            f"splits {max(1, splits // 2)}": dict(splits=max(1, splits // 2)),
                            f"splits {min(64, splits * 2)}": dict(splits=min(64, splits * 2)),
                            "block_n 64": dict(splits=splits, block_n=64),
                            "8 warps": dict(splits=splits, num_warps=8),
                            "stages 3": dict(splits=splits, num_stages=3),
                            # the split partials unnormalised in fp32 (the earlier default; normalised BF16 now:
                            # at batch 64 and 640 keys the fp32 ones were half as many bytes again as the keys,
                            # written by the main kernel and read back by the combine)
                            "fp32 partials": dict(splits=splits, partial_dtype=torch.float32),
                            # for batch 1 (9-11x its floor: each program a serial chain of dependent loads): the
                            # combine's loads all at once, and splits over the two lists read as one
                            # (one run of steps per program), with more splits; decode_plan takes them from 8
                            # splits on; here each the other way round
                            "tiles" if plan["combine"] == "loop" else "loop combine": dict(
                                splits=splits, combine="loop" if plan["combine"] == "tiles" else "tiles"),
                            "joint" if not plan["joint"] else "lists apart": dict(splits=splits,
                                                                                  joint=not plan["joint"]),
                            f"joint, tiles, splits {min(64, splits * 2)}": dict(
                                splits=min(64, splits * 2), joint=True, combine="tiles"),
                            f"joint, tiles, splits {min(64, splits * 4)}, block_n 16": dict(
                                splits=min(64, splits * 4), joint=True, combine="tiles", block_n=16)}
                    # 3, 4, 6 and 8 splits at batch 64 (default_splits once rounded two waves up to 5 at 640
                    # keys: 320 programs on 132 SMs; 4 was 24.5 us against 27.9 on the H200): the neighbours
                    for n in sorted({3, 4, 6, 8} - {splits}):
                        if n * 64 <= WINDOW + extra_n:
                            alts.setdefault(f"splits {n}", dict(splits=n))
                    row["variants_us"] = {}
                    keep = [x for x in args.only.split("|") if x]
                    for name, kw in alts.items():
                        if keep and not any(x in name for x in keep):
                            continue
                        try:
                            row["variants_us"][name] = timed(lambda: sparse_attn(
                                q, swa, swa_ids, lens_s, *lists, sink, heads=HEADS, **kw)) * 1e6
                        except Exception as err:
                            row["variants_us"][name] = f"{type(err).__name__}: {err}"[:200]
                    print("        variants (us):", "  ".join(
                        f"{n} {v:.1f}" if isinstance(v, float) else f"{n} ERR" for n, v in row["variants_us"].items()))
                del swa, extra
            torch.cuda.empty_cache()

    for t in [int(x) for x in args.prefill.split(",") if x]:
        n_c4 = max(t // 4, 1)
        swa = torch.randn(t, D, device=dev, generator=gen).to(torch.bfloat16)
        extra = torch.randn(n_c4, D, device=dev, generator=gen).to(torch.bfloat16)
        pos = torch.arange(t, device=dev)
        off = torch.arange(WINDOW, device=dev)
        swa_ids = (pos[:, None] - off[None, :]).clamp(min=-1).to(torch.int32)  # newest first, -1 before 0
        lens_s = torch.clamp(pos + 1, max=WINDOW).to(torch.int32)
        ext_ids = torch.randint(0, n_c4, (t, TOPK), device=dev, generator=gen, dtype=torch.int32)
        lens_e = torch.clamp((pos + 1) // 4, min=1, max=TOPK).to(torch.int32)
        q = torch.randn(t, HPAD, D, device=dev, generator=gen).to(torch.bfloat16)
        sink = torch.randn(HPAD, device=dev, generator=gen)
        sec = timed(lambda: sparse_attn(q, swa, swa_ids, lens_s, extra, ext_ids, lens_e, sink, heads=HEADS,
                                              splits=1), reps=3)
        keys = float((lens_s + lens_e).sum())
        flops = 4 * HEADS * D * keys
        row = {"tokens": t, "us": sec * 1e6, "tflops": flops / sec / 1e12}
        record["prefill"].append(row)
        print(f"prefill C4 {t:6d} tokens: {sec * 1e3:8.2f} ms, {row['tflops']:6.1f} TFLOP/s")
    if "native_error" in record:
        print(f"native FlashMLA: not (fully) measured ({record['native_error']})")
    elif native is not None:
        print("native FlashMLA: decode timed on a zeroed FP8 cache of the native layout, same index lists "
              "(its prefill branch is not timed here)")
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
