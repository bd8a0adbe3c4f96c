"""Lab (soak): GPU memory inside a serving process, over time. With DSV4_SM80_LAB_MEMLOG=FILE each model
runner (after its CUDA graphs; footprint.log_startup starts it) appends one JSON line every INTERVAL seconds:

    {"t": unix time, "pid", "rank", "role", "used": device bytes in use (cudaMemGetInfo),
     "reserved": PyTorch's caching allocator, "allocated": live tensors, "segments", "retries"}

used - reserved is what PyTorch's allocator does not hold (CUDA context, loaded kernel modules, cuBLAS and NCCL
workspaces, other processes on the same GPU). A server whose `used` grows under a steady load either caches
more in the allocator (reserved grows with it: its working set has not been seen whole yet, or it fragments)
or loads or leaks outside it (reserved flat): `summarize` says which. Never for serving.
"""

from __future__ import annotations

import json
import os
import threading
import time

ENV = "DSV4_SM80_LAB_MEMLOG"
MIB = 1 << 20
_started = set()


def cuda_sample() -> dict:
    import torch

    free, total = torch.cuda.mem_get_info()
    st = torch.cuda.memory_stats()
    return {"used": total - free, "reserved": torch.cuda.memory_reserved(), "allocated": torch.cuda.memory_allocated(),
            "segments": int(st.get("segment.all.current", 0)), "retries": int(st.get("num_alloc_retries", 0))}


def start(path: str, rank: int, role: str, interval: float = 10.0, sample=cuda_sample) -> threading.Thread | None:
    """One daemon thread per (process, role) appending a line to `path` every `interval` s; its first line at
    once. sample(): the figures (a CUDA device is made current in the thread first, the caller's)."""
    key = (os.getpid(), role)
    if key in _started:
        return None
    _started.add(key)
    device = None
    if sample is cuda_sample:
        import torch

        device = torch.cuda.current_device()

    def loop():
        if device is not None:
            import torch

            torch.cuda.set_device(device)
        while True:
            try:
                line = {"t": round(time.time(), 2), "pid": os.getpid(), "rank": rank, "role": role, **sample()}
            except Exception as e:  # diagnostics only: say so once and stop
                line = {"t": round(time.time(), 2), "pid": os.getpid(), "rank": rank, "role": role,
                        "error": f"{type(e).__name__}: {e}"}
            with open(path, "a") as f:
                f.write(json.dumps(line) + "\n")
            if "error" in line:
                return
            time.sleep(interval)

    t = threading.Thread(target=loop, name="dsv4-sm80-memlog", daemon=True)
    t.start()
    return t


def maybe_start(runner) -> None:
    """From footprint.log_startup: start the log for this runner when DSV4_SM80_LAB_MEMLOG names a file."""
    path = os.environ.get(ENV, "").strip()
    if not path:
        return
    role = "draft" if getattr(runner, "is_draft_worker", False) else "target"
    rank = getattr(getattr(runner, "ps", None), "tp_rank", getattr(runner, "tp_rank", 0))
    start(path, int(rank or 0), role)


def read(path: str) -> list:
    """The complete lines of a log (a line the server is writing now, without its newline yet, is left out)."""
    out = []
    with open(path) as f:
        for line in f:
            if line.endswith("\n") and line.strip():
                out.append(json.loads(line))
    return out


def summarize(lines: list, since: float | None = None) -> dict:
    """Per (pid, role): MiB of used / reserved / allocated / outside the allocator at the first and last line
    at or after `since` (unix time; e.g. the load's start), and their growth; `where` names what grew."""
    groups = {}
    for x in lines:
        if "error" in x or (since is not None and x["t"] < since):
            continue
        groups.setdefault((x["pid"], x["role"]), []).append(x)
    out = {}
    for (pid, role), xs in groups.items():
        xs.sort(key=lambda x: x["t"])
        a, b = xs[0], xs[-1]

        def mib(x, k):
            return round((x["used"] - x["reserved"]) / MIB, 1) if k == "outside" else round(x[k] / MIB, 1)

        row = {"rank": a["rank"], "seconds": round(b["t"] - a["t"], 1), "samples": len(xs)}
        for k in ("used", "reserved", "allocated", "outside"):
            row[k] = [mib(a, k), mib(b, k)]
            row[k + "_growth"] = round(mib(b, k) - mib(a, k), 1)
        row["retries"] = b["retries"]
        grew = [k for k in ("reserved", "outside") if row[k + "_growth"] > 16]
        row["where"] = " and ".join(grew) if grew else "nothing over 16 MiB"
        out[f"{role} rank {a['rank']} pid {pid}"] = row
    return out
