"""Timing and peak measurements shared by the benchmarks (GPU only)."""

from __future__ import annotations

import torch


def timed(fn, reps: int = 20) -> float:
    """Best seconds per call over 5 replays of a CUDA graph of `reps` calls (no launch overhead); an eager
    loop when fn cannot be captured."""
    fn()
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            for _ in range(reps):
                fn()
        run = graph.replay
    except Exception:
        torch.cuda.synchronize()

        def run():
            for _ in range(reps):
                fn()
    run()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) / 1e3 / reps)
    return best


def copy_gbps(nbytes: int = 2 << 30) -> float:
    """Measured HBM bandwidth: a device-to-device copy, read + write bytes per second / 1e9."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / timed(lambda: dst.copy_(src), 3) / 1e9


def empty_kernel_us() -> float:
    """The launch floor: one trivial kernel, replayed from a graph."""
    tiny = torch.zeros(1, device="cuda")
    return timed(lambda: tiny.add_(0), 100) * 1e6
