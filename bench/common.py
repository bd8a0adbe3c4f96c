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
    return best_seconds(run) / reps


def best_seconds(run, tries: int = 5) -> float:
    """Best seconds of one run() over `tries` (CUDA events), after a first run that is not counted."""
    run()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(tries):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) / 1e3)
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


PROFILE_CALLS = 10


def kernel_profile(fn, calls: int = PROFILE_CALLS) -> dict:
    """Device microseconds per call of each CUDA kernel fn launches (torch.profiler over `calls` eager calls),
    largest first. A kernel launched more than once per call (the W4A8 gate-up and down launches share one
    Triton kernel) is split by launch order into "name #1", "name #2", ...; names are shortened to ~40 chars."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()

    def dev_total(ev):
        t = getattr(ev, "device_time_total", None)
        return float(t if t is not None else getattr(ev, "cuda_time_total", 0) or 0)

    def is_kernel(ev):
        kind = str(getattr(ev, "device_type", ""))
        if kind:  # DeviceType.CUDA for kernels, memsets and memcpys
            return kind.endswith("CUDA")
        return not ev.key.startswith(("aten::", "cuda", "cuLaunch", "ProfilerStep"))  # an older event type

    totals = {}  # full name -> (device us over all calls, launches)
    for ev in prof.key_averages():
        if dev_total(ev) > 0 and is_kernel(ev):
            totals[ev.key] = (dev_total(ev), ev.count)
    split = {}
    try:  # the per-launch split of kernels launched several times per call
        events = sorted((ev for ev in prof.events() if ev.name in totals and is_kernel(ev)),
                        key=lambda ev: ev.time_range.start)
        for name, (_, count) in totals.items():
            per_call = count // calls
            if per_call > 1 and count % calls == 0:
                mine = [dev_total(ev) for ev in events if ev.name == name]
                if len(mine) == count:
                    split[name] = [sum(mine[i::per_call]) for i in range(per_call)]
    except Exception as err:
        print(f"  profile: per-launch split failed ({type(err).__name__}: {err})"[:200])

    def short(name):
        name = name[5:] if name.startswith("void ") else name
        cut = min([i for i in (name.find("<"), name.find("(")) if i > 0] or [len(name)])
        return name[:cut][:40]

    out = {}
    for name, (total, _) in totals.items():
        parts = split.get(name, [total])
        for i, part in enumerate(parts):
            key = short(name) + (f" #{i + 1}" if len(parts) > 1 else "")
            while key in out:  # two template instances with one short name
                key += "'"
            out[key] = part / calls
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))
