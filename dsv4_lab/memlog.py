"""Lab (soak): GPU memory inside a serving process, over time. With DSV4_SM80_LAB_MEMLOG=FILE each model
runner (after its CUDA graphs: seam lab.memlog) appends one JSON line every INTERVAL seconds:

    {"t": unix time, "pid", "rank", "role", "used": bytes this process holds on its GPU (NVML's per-process
     figure; the device's whole use where NVML does not list the process, e.g. another PID namespace),
     "reserved": PyTorch's caching allocator, "allocated": live tensors, "segments", "retries"}

used - reserved is what PyTorch's allocator does not hold (CUDA context, loaded kernel modules, cuBLAS and NCCL
workspaces). A server whose `used` grows under a steady load either caches more in the allocator (reserved grows
with it: its working set has not been seen whole yet, or it fragments) or loads or leaks outside it (reserved
flat): `summarize` says which. The sampling thread makes no CUDA runtime call (NVML and the allocator's own
counters only): a draft model may be capturing CUDA graphs in global capture mode while it runs. Never for
serving.

With DSV4_SM80_LAB_MEMSITES=1 as well, PyTorch's allocator records the Python stack of every block allocated from the
end of start-up on (`torch.cuda.memory._record_memory_history(enabled="state")`: live blocks only, no event trace),
and the log's thread answers requests (`request_sites(path, tag)`, e.g. before a load and after it) with the live
bytes per allocating site (`sites`): the growth between two tags names the code that holds it (`sites_growth`). A
request is answered between samples; taking the snapshot reads the allocator's own tables. A request may ask for a
full garbage collection first (`collect=True`), so that objects only reference cycles keep alive (SGLang's radix tree
links parents and children both ways) do not count as held: the answer then carries the live bytes before and after
`gc.collect()`. (On the H200, 2026-12-01, `steps.sh soak` at 2bcd0a3 and 8ce119d: what a flush kept was the radix
cache's GPU index tensors; the collection freed none of it, so cycles were not what kept it.)
"""

from __future__ import annotations

import gc
import json
import os
import sys
import threading
import time

from . import knobs

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


def start(path: str, rank: int, role: str, interval: float = 10.0, sample=None,
          snapshot=None) -> threading.Thread | None:
    """One daemon thread per (process, role) appending a line to `path` every `interval` s; its first line at
    once. sample(): the figures (default: `cuda_sampler()` for the current device). snapshot(): the allocator's
    snapshot (`torch.cuda.memory._snapshot` shape) for answering site requests; None: requests go unanswered."""
    key = (os.getpid(), role)
    if key in _started:
        return None
    _started.add(key)
    if sample is None:
        sample = cuda_sampler()
    answered = set()

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
            until = time.time() + interval
            while True:
                if snapshot is not None:
                    _answer_requests(path, rank, role, snapshot, answered, sample)
                left = until - time.time()
                if left <= 0:
                    break
                time.sleep(min(left, 0.5))

    t = threading.Thread(target=loop, name="dsv4-sm80-memlog", daemon=True)
    t.start()
    return t


def start_after_graphs(result, runner, *args, **kwargs):
    """After ModelRunner.init_cuda_graphs (seam lab.memlog): start this runner's log. Diagnostics: a failure is
    printed, never raised."""
    try:
        maybe_start(runner)
    except Exception as e:
        print(f"dsv4-sm80 memlog: not started ({type(e).__name__}: {e})", file=sys.stderr, flush=True)
    return None


def maybe_start(runner) -> None:
    """Start the log for this runner when DSV4_SM80_LAB_MEMLOG names a file."""
    path = knobs.get(knobs.LAB_MEMLOG).strip()
    if not path:
        return
    role = "draft" if getattr(runner, "is_draft_worker", False) else "target"
    rank = getattr(getattr(runner, "ps", None), "tp_rank", getattr(runner, "tp_rank", 0))
    snapshot = None
    if knobs.get(knobs.LAB_MEMSITES) == "1":
        try:
            snapshot = _record_sites()
        except Exception as e:  # the memory log itself still runs
            print(f"dsv4-sm80 memlog: allocation sites not recorded ({type(e).__name__}: {e})", file=sys.stderr,
                  flush=True)
    start(path, int(rank or 0), role, snapshot=snapshot)


def _record_sites():
    """Start PyTorch's memory history for live blocks only ("state"), each with the Python stack that allocated
    it (blocks from before this point, weights, pools and CUDA graphs, carry none); returns the snapshot taker."""
    import torch

    torch.cuda.memory._record_memory_history(enabled="state", context="alloc", stacks="python")
    device = torch.cuda.current_device()

    def snapshot():
        return {"device": device, **torch.cuda.memory._snapshot()}

    return snapshot


# frames of these files are where memory is allocated, not who holds it: a site is the first frame outside them
_PLUMBING = ("/torch/", "/contextlib.py", "/functools.py", "/threading.py", "/dsv4_lab/memlog.py")


def _short(filename: str) -> str:
    """A frame's file from its package on (an installed package, a checkout of ours or of SGLang)."""
    for anchor in ("/site-packages/", "/dist-packages/"):
        if anchor in filename:
            return filename.split(anchor, 1)[1]
    for pkg in ("dsv4_sm80", "vision_backport", "sglang"):
        if f"/{pkg}/" in filename:
            return f"{pkg}/" + filename.rsplit(f"/{pkg}/", 1)[1]
    return os.path.basename(filename)


def site_of(frames: list, depth: int = 2) -> str:
    """A block's allocating site: its innermost frame outside PyTorch and the standard library's plumbing, and
    the `depth` - 1 frames that called it ("file:line function < caller ..."). Frames come innermost first."""
    own = [f for f in frames if not any(p in f.get("filename", "") for p in _PLUMBING)] or frames
    return " < ".join(f"{_short(f.get('filename', '?'))}:{f.get('line', '?')} {f.get('name', '?')}"
                      for f in own[:depth]) or "?"


def sites(snapshot: dict, device: int | None = None) -> dict:
    """Live (allocated) bytes and blocks per allocating site of a `torch.cuda.memory._snapshot()` (on `device`,
    default the snapshot's own "device" or every device); blocks without a recorded stack (allocated before
    the recording began) are summed under "untracked"."""
    device = snapshot.get("device") if device is None else device
    out = {"untracked": {"bytes": 0, "blocks": 0}}
    for seg in snapshot.get("segments", []):
        if device is not None and seg.get("device", device) != device:
            continue
        for b in seg.get("blocks", []):
            if b.get("state") != "active_allocated":
                continue
            frames = b.get("frames") or (b.get("history") or [{}])[0].get("frames") or []  # (torch < 2.1: history)
            key = site_of(frames) if frames else "untracked"
            row = out.setdefault(key, {"bytes": 0, "blocks": 0})
            row["bytes"] += int(b.get("size", 0))
            row["blocks"] += 1
    return out


def sites_growth(before: dict, after: dict, top: int = 10) -> list:
    """[(site, MiB grown, blocks grown)] between two `sites` answers, largest growth first (shrinking sites
    after it, at most `top` rows in all)."""
    keys = set(before) | set(after)
    rows = [(k, round((after.get(k, {}).get("bytes", 0) - before.get(k, {}).get("bytes", 0)) / MIB, 2),
             after.get(k, {}).get("blocks", 0) - before.get(k, {}).get("blocks", 0)) for k in keys]
    rows = [r for r in rows if r[1] or r[2]]
    rows.sort(key=lambda r: -r[1])
    return rows[:top]


def request_sites(path: str, tag: str, collect: bool = False) -> None:
    """Ask every process logging to `path` (with DSV4_SM80_LAB_MEMSITES=1) for its live bytes per site now,
    under `tag` (letters, digits, - and _); each answers into `sites_file(path, tag, pid, role)`, with its
    allocator's live bytes (`allocated`). collect: a full `gc.collect()` first, the live bytes before it in
    `allocated_before_gc` (what only unreachable Python objects still held)."""
    if not tag or not all(c.isalnum() or c in "-_" for c in tag):
        raise ValueError(f"site request tag {tag!r}: letters, digits, - and _ only")
    with open(path + ".sites-requests", "a") as f:
        f.write(tag + (" gc" if collect else "") + "\n")


def sites_file(path: str, tag: str, pid: int, role: str) -> str:
    return f"{path}.sites-{tag}-{pid}-{role}.json"


def read_sites(path: str, tag: str) -> dict:
    """{"pid role": sites answer} for every process that answered the request `tag`."""
    import glob

    out = {}
    for f in sorted(glob.glob(glob.escape(path) + f".sites-{tag}-*.json")):
        try:
            with open(f) as fh:
                got = json.load(fh)
        except (OSError, ValueError):  # being written: the caller waits and reads again
            continue
        out[process_key(got)] = got
    return out


def process_key(x: dict) -> str:
    """"pid role" of a memory-log line or a sites answer: one logging thread."""
    return f"{x['pid']} {x['role']}"


def _answer_requests(path: str, rank: int, role: str, snapshot, answered: set, sample) -> None:
    try:
        with open(path + ".sites-requests") as f:
            asked = [t.split() for t in f if t.endswith("\n") and t.strip()]
    except OSError:
        return
    for tag, *how in asked:
        if tag in answered:
            continue
        answered.add(tag)
        got = {"tag": tag, "pid": os.getpid(), "rank": rank, "role": role, "t": round(time.time(), 2)}
        try:
            if "gc" in how:
                got["allocated_before_gc"] = sample()["allocated"]
                got["gc_unreachable"] = gc.collect()
            got["allocated"] = sample()["allocated"]
            got["sites"] = sites(snapshot())
        except Exception as e:  # diagnostics only
            got["error"] = f"{type(e).__name__}: {e}"
        final = sites_file(path, tag, os.getpid(), role)
        with open(final + ".part", "w") as f:
            json.dump(got, f)
        os.replace(final + ".part", final)  # whole or absent for the reader


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
