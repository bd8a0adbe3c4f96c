"""Lab (soak): GPU memory inside a serving process, over time. With DSV4_SM80_LAB_MEMLOG=FILE each model
runner (after its CUDA graphs; footprint.log_startup starts it) appends one JSON line every INTERVAL seconds:

    {"t": unix time, "pid", "rank", "role", "used": bytes this process holds on its GPU (NVML's per-process
     figure; the device's whole use where NVML does not list the process, e.g. another PID namespace),
     "reserved": PyTorch's caching allocator, "allocated": live tensors, "segments", "retries"}

used - reserved is what PyTorch's allocator does not hold (CUDA context, loaded kernel modules, cuBLAS and NCCL
workspaces). A server whose `used` grows under a steady load either caches more in the allocator (reserved grows
with it: its working set has not been seen whole yet, or it fragments) or loads or leaks outside it (reserved
flat): `summarize` says which. The sampling thread makes no CUDA runtime call (NVML and the allocator's own
counters only): a draft model may be capturing CUDA graphs in global capture mode while it runs. Never for
serving.
"""

from __future__ import annotations

import json
import os
import threading
import time

ENV = "DSV4_SM80_LAB_MEMLOG"
MIB = 1 << 20
_started = set()


def cuda_sampler():
    """sample() for this process's current CUDA device, resolved here (the caller's thread); the sample itself
    reads NVML and the caching allocator's counters only."""
    import pynvml
    import torch

    device = torch.cuda.current_device()
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else "GPU-" + uuid)
    pid = os.getpid()

    def sample() -> dict:
        mine = [p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
                if p.pid == pid and p.usedGpuMemory is not None]
        used = sum(mine) if mine else pynvml.nvmlDeviceGetMemoryInfo(handle).used
        st = torch.cuda.memory_stats(device)
        return {"used": int(used), "used_is": "process" if mine else "device",
                "reserved": int(st.get("reserved_bytes.all.current", 0)),
                "allocated": int(st.get("allocated_bytes.all.current", 0)),
                "segments": int(st.get("segment.all.current", 0)), "retries": int(st.get("num_alloc_retries", 0))}

    return sample


def start(path: str, rank: int, role: str, interval: float = 10.0, sample=None) -> threading.Thread | None:
    """One daemon thread per (process, role) appending a line to `path` every `interval` s; its first line at
    once. sample(): the figures (default: `cuda_sampler()` for the current device)."""
    key = (os.getpid(), role)
    if key in _started:
        return None
    _started.add(key)
    if sample is None:
        sample = cuda_sampler()

    def loop():
        while True:
            line = {"t": round(time.time(), 2), "pid": os.getpid(), "rank": rank, "role": role}
            try:
                line.update(sample())
            except Exception as e:  # diagnostics only: say so once and stop
                line["error"] = f"{type(e).__name__}: {e}"
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


def logged_since(lines: list, t: float) -> bool:
    """Every (process, role) in the log has a line at or after t (each thread keeps its own 10 s cadence)."""
    live = [x for x in lines if "error" not in x]
    keys = {(x["pid"], x["role"]) for x in live}
    return all(any(x["t"] >= t for x in live if (x["pid"], x["role"]) == k) for k in keys)


def summarize(lines: list, since: float | None = None, flushed: float | None = None) -> dict:
    """Per (pid, role): MiB of used / reserved / allocated / outside the allocator at the first and last line
    at or after `since` (unix time; e.g. the load's start) and before `flushed` (when the load ended and the
    cache was flushed), and their growth; `where` names what grew. With `flushed`: `allocated_after_flush`, the
    live tensors at the first line after it, and `released`: whether the flush gave the growth of live
    tensors back (within 16 MiB of the start). A prefix cache holds GPU index tensors per cached token (its
    size bounded by the KV pool): growth it releases is cache state, growth that stays is a leak."""
    groups = {}
    for x in lines:
        if "error" in x or (since is not None and x["t"] < since):
            continue
        groups.setdefault((x["pid"], x["role"]), []).append(x)
    out = {}
    for (pid, role), xs in groups.items():
        xs.sort(key=lambda x: x["t"])
        during = [x for x in xs if flushed is None or x["t"] < flushed]
        if not during:
            continue
        a, b = during[0], during[-1]

        def mib(x, k):
            return round((x["used"] - x["reserved"]) / MIB, 1) if k == "outside" else round(x[k] / MIB, 1)

        row = {"rank": a["rank"], "seconds": round(b["t"] - a["t"], 1), "samples": len(during)}
        for k in ("used", "reserved", "allocated", "outside"):
            row[k] = [mib(a, k), mib(b, k)]
            row[k + "_growth"] = round(mib(b, k) - mib(a, k), 1)
        row["retries"] = b["retries"]
        grew = [k for k in ("reserved", "outside") if row[k + "_growth"] > 16]
        row["where"] = " and ".join(grew) if grew else "nothing over 16 MiB"
        if flushed is not None:
            after = [x for x in xs if x["t"] >= flushed]
            row["allocated_after_flush"] = mib(after[0], "allocated") if after else None
            row["released"] = bool(after) and row["allocated_after_flush"] <= row["allocated"][0] + 16
        out[f"{role} rank {a['rank']} pid {pid}"] = row
    return out
