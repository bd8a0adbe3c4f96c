"""Dense linears at DeepSeek-V4-Flash TP4 per-rank shapes, three ways in one run:

  bf16        the SM80 design: FP8 blocks dequantized exactly to BF16 at load, BF16 GEMM (cuBLAS)
  fp8_marlin  SGLang 0.5.16's FP8-Marlin W8A16 (1 byte/weight, BF16 MMA), what SGLang itself picks on SM80
  native_fp8  SGLang's native block-FP8 W8A8 GEMM on this GPU (DeepGEMM on SM90): the reference; an
              A800 cannot run it

Each method is SGLang's real linear method on a real `ReplicatedLinear` loaded with the same random
FP8 block weight. Times are CUDA-graph replays (no launch overhead) over enough weight copies to
defeat the L2 cache. Printed per shape and token count: microseconds, TFLOP/s and GB/s (weight +
activations in and out) with their share of this GPU's measured peaks (BF16 dense GEMM, FP8 GEMM,
device-to-device copy), and the ratio to native_fp8. Then the load-time conversion throughput
(FP8 blocks -> BF16 on the GPU).

    python bench/dense_linear.py --out dense_linear.json

Run it with ENABLE_SGLANG_DSV4_A100_PATCH=0 (or unset) so SGLang's native method is the native one;
the SM80 methods are built directly from dsv4_sm80.stages.dense. On an H200 these are H200 numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.dirname(os.path.abspath(__file__))]

# per-rank (out N, in K) at TP4 (DeepSeek-V4-Flash's config.json split as SGLang 0.5.16 shards it): attention TP = 4,
# shared expert TP, no DP-attention
SHAPES = (
    ("wqkv_a (replicated)", 1536, 4096),
    ("wq_b / indexer wq_b", 8192, 1024),
    ("wo_b", 4096, 2048),
    ("shared gate_up", 1024, 4096),
    ("shared down", 4096, 512),
)
TOKENS = (1, 4, 16, 64, 256, 1024, 4096, 8192)
METHODS = ("bf16", "fp8_marlin", "native_fp8")
L2_DEFEAT_BYTES = 256 << 20


def measure_peaks(torch):
    """Best of a few: BF16 GEMM 8192^3, FP8 GEMM 8192^3 (torch._scaled_mm, where supported), and
    device-to-device copy bandwidth (read + write bytes)."""
    import common

    dev = "cuda"
    out = {}

    def best(fn, iters=10):
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(iters):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e) / 1e3)
        return min(times)

    def gemm_peaks(n=8192):
        a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
        b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
        out["bf16_tflops"] = 2 * n**3 / best(lambda: torch.mm(a, b)) / 1e12
        try:
            a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()
            one = torch.ones((), device=dev)
            sec = best(lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16))
            out["fp8_tflops"] = 2 * n**3 / sec / 1e12
        except Exception as e:  # no FP8 tensor cores (an A800), or an older torch
            out["fp8_tflops"] = None
            out["fp8_note"] = f"{type(e).__name__}: {e}"[:200]

    gemm_peaks()
    out["copy_gbps"] = common.copy_gbps()
    torch.cuda.empty_cache()
    return out


def init_sglang_tp1(port: int):
    from sglang.srt.distributed import init_distributed_environment, initialize_model_parallel

    init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                 local_rank=0, backend="nccl")
    initialize_model_parallel(1)


def random_fp8_block_weight(torch, n, k, gen):
    """A weight as the checkpoint holds it: e4m3 codes and a power-of-two scale per 128x128 block."""
    w = (torch.randn(n, k, generator=gen, device="cuda") * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    exps = torch.randint(-14, -6, (-(-n // 128), -(-k // 128)), generator=gen, device="cuda")
    return w, torch.exp2(exps.float())


def build_layer(method_name, n, k, weight, scale):
    import torch
    from sglang.srt.layers.linear import ReplicatedLinear
    from sglang.srt.layers.quantization.fp8 import Fp8Config, Fp8LinearMethod

    from dsv4_sm80.stages import dense as linear

    qc = Fp8Config(is_checkpoint_fp8_serialized=True, activation_scheme="dynamic", weight_block_size=[128, 128])
    with torch.device("cuda"):
        layer = ReplicatedLinear(k, n, bias=False, quant_config=qc, params_dtype=torch.bfloat16)
    if method_name == "bf16":
        method = linear.sm80_bf16_method(qc)
    else:
        method = Fp8LinearMethod(qc)
        if method_name == "fp8_marlin":  # as dsv4_sm80.stages.dense.select_quant_method sets it up
            method.use_marlin, method.w8a8_block_fp8_linear = True, None
    layer.quant_method = method
    layer.weight.data.copy_(weight)
    layer.weight_scale_inv.data.copy_(scale)
    method.process_weights_after_loading(layer)
    return layer


def resident_bytes(layer):
    import torch

    return sum(t.numel() * t.element_size() for name in ("weight", "weight_scale_inv", "weight_scale")
               if isinstance(t := getattr(layer, name, None), torch.Tensor))


def time_graph(torch, fn_list, reps: int):
    """Seconds per call: a CUDA graph of `reps` calls cycling over fn_list, replayed and timed."""
    for fn in fn_list:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            for i in range(reps):
                fn_list[i % len(fn_list)]()
    graph.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        e.synchronize()
        best = min(best, s.elapsed_time(e) / 1e3 / reps)
    del graph
    return best


def bench_conversion(torch, gen):
    """Load-time FP8-block -> BF16 conversion on the GPU (dsv4_sm80.stages.dense.to_bf16_blocks)."""
    from dsv4_sm80.stages.dense import to_bf16_blocks

    rows = []
    for n, k in ((8192, 1024), (4096, 2048), (32768, 4096)):
        w, s = random_fp8_block_weight(torch, n, k, gen)
        to_bf16_blocks(w, s)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            to_bf16_blocks(w, s)
        torch.cuda.synchronize()
        sec = (time.perf_counter() - t0) / 10
        moved = n * k * (1 + 2) + s.numel() * 4
        rows.append({"n": n, "k": k, "seconds": sec, "gbps": moved / sec / 1e9})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--port", type=int, default=29517)
    args = ap.parse_args(argv)
    tokens = [int(x) for x in args.tokens.split(",")]
    methods = args.methods.split(",")

    import torch

    from dsv4_sm80 import env

    if env.patch_enabled():
        print("dense_linear: note: the patch is on in this process; the methods are built directly, so the "
              "figures are the same, but run with ENABLE_SGLANG_DSV4_A100_PATCH=0 for a clean native run")
    init_sglang_tp1(args.port)
    gen = torch.Generator(device="cuda").manual_seed(0)
    record = {"gpu": torch.cuda.get_device_name(0), "capability": list(torch.cuda.get_device_capability(0)),
              "torch": torch.__version__, "peaks": measure_peaks(torch), "rows": [], "errors": []}
    peaks = record["peaks"]
    print(f"dense_linear on {record['gpu']} (sm{''.join(map(str, record['capability']))}); measured peaks: "
          f"BF16 {peaks['bf16_tflops']:.0f} TFLOP/s, FP8 {peaks['fp8_tflops'] or 0:.0f} TFLOP/s, "
          f"copy {peaks['copy_gbps']:.0f} GB/s")

    def save():
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)

    for shape_name, n, k in SHAPES:
        w, s = random_fp8_block_weight(torch, n, k, gen)
        for method in methods:
            t0 = time.perf_counter()
            try:
                first = build_layer(method, n, k, w, s)
            except Exception as e:
                record["errors"].append(f"{shape_name} {method}: build: {type(e).__name__}: {e}"[:400])
                continue
            wbytes = resident_bytes(first)
            copies = [first] + [build_layer(method, n, k, w, s) for _ in range(max(0, L2_DEFEAT_BYTES // wbytes))]
            build_s = time.perf_counter() - t0
            for m in tokens:
                xs = [torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(2)]
                fns = [(lambda lay=lay, x=xs[i % 2]: lay.quant_method.apply(lay, x)) for i, lay in enumerate(copies)]
                try:
                    sec = time_graph(torch, fns, max(args.reps, len(fns)))
                except Exception as e:
                    record["errors"].append(f"{shape_name} {method} M={m}: {type(e).__name__}: {e}"[:400])
                    continue
                flops = 2 * m * n * k
                moved = wbytes + 2 * m * k + 2 * m * n
                record["rows"].append({"shape": shape_name, "n": n, "k": k, "method": method, "tokens": m,
                                       "us": sec * 1e6, "tflops": flops / sec / 1e12, "gbps": moved / sec / 1e9,
                                       "weight_bytes": wbytes, "build_s": round(build_s, 2)})
            del copies, first
            torch.cuda.empty_cache()
            save()

    record["conversion"] = bench_conversion(torch, gen)
    save()
    by = {(r["shape"], r["method"], r["tokens"]): r for r in record["rows"]}
    print(f"{'shape':22s} {'tokens':>6s} " + " ".join(f"{m:>34s}" for m in methods))
    print(f"{'':22s} {'':6s} " + " ".join(f"{'us  TFLOP/s(%pk)  GB/s(%pk)  x nat':>34s}" for _ in methods))
    for shape_name, _, _ in SHAPES:
        for m in tokens:
            cells = []
            nat = by.get((shape_name, "native_fp8", m))
            for method in methods:
                r = by.get((shape_name, method, m))
                if r is None:
                    cells.append(f"{'-':>34s}")
                    continue
                pk = peaks["bf16_tflops"] if method != "native_fp8" else (peaks["fp8_tflops"] or peaks["bf16_tflops"])
                ratio = f"{nat['us'] / r['us']:.2f}" if nat else "-"
                cells.append(f"{r['us']:8.1f} {r['tflops']:6.1f}({100 * r['tflops'] / pk:3.0f}%) "
                             f"{r['gbps']:6.0f}({100 * r['gbps'] / peaks['copy_gbps']:3.0f}%) {ratio:>5s}")
            print(f"{shape_name:22s} {m:6d} " + " ".join(cells))
    print("x nat = native_fp8 time / this time (>1: faster than the native FP8 path)")
    for c in record["conversion"]:
        print(f"load-time FP8->BF16 conversion {c['n']}x{c['k']}: {c['seconds'] * 1e3:.2f} ms, {c['gbps']:.0f} GB/s "
              f"({100 * c['gbps'] / peaks['copy_gbps']:.0f}% of copy)")
    per_rank = 1.44e9  # FP8 dense parameters per rank at TP4 (`python -m dsv4_sm80 footprint --tp 4`)
    gbps = record["conversion"][-1]["gbps"]
    print(f"  -> the ~{per_rank / 1e9:.2f} B FP8 dense parameters of one TP4 rank convert in about "
          f"{per_rank * 3 / gbps / 1e9:.2f} s of GPU time")
    for e in record["errors"]:
        print("ERROR", e)
    save()
    return 0 if not record["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
