"""Soak the patched server (lab mode, tiny checkpoint, loopback only), bounded in time and count.

    DSV4_SM80_LAB_GPU_COUNT=1 DSV4_SM80_LAB_CC=9.0 python -m dsv4_lab.beds.soak --minutes 5 --out soak.json [--dspark]
    python -m dsv4_lab.beds.soak --native --minutes 5 --out soak-native.json     (the same load on native SGLang)

64 concurrent streams of `/generate` (streaming, with logprobs): random prompt lengths up to the context
limit, random max_tokens, a third of the prompts sharing long prefixes (radix-cache hits), one in ten
cancelled mid-stream by closing the connection, small chunked-prefill chunks so long prompts span several
batches. The KV pool is capped (--max-total-tokens, 2^20 by default; SGLang would size it to the GPU: 83
million tokens for the tiny model on an H200) so that the prefix cache fills within the first minute and
evicts from then on: the steady state a production server lives in. Reported: requests done, errors
(anything but a deliberate cancellation; must be 0), NaN/Inf in the returned logprobs (must be 0), the KV
pool's used tokens after the run and a cache flush (must be the idle value: no leaked pages), and the
server's GPU memory over the run: stable when the last minute's peak is within 5 % + 512 MiB of the first
minute's AND its growth over the second half of the run is under GROWTH_LIMIT MiB/min (2026-12-01: 107.6 ->
107.8 GB in 4 minutes passed the first rule while it grew steadily, ~37 MiB/min); and, on the patched
server, no leak: its live tensors after the flush and a full garbage collection back within 16 MiB of
before the load (`leak_check`).

The memory history (H200, 2026-12-01, `steps.sh soak` / `soak-native` at 754a739, 4d41091 and 2bcd0a3): with SGLang's
own pool size, native and patched both grew ~25-35 MiB/min, inside the allocator's live tensors (DSV4_SM80_LAB_MEMLOG,
dsv4_lab/memlog.py). The flush did not give it back. Recording each block's allocating Python stack
(DSV4_SM80_LAB_MEMSITES) showed all of the growth (+127 MiB) was the radix cache's per-node GPU index tensors
(unified_radix_cache._split_node / _add_new_node; 8 bytes per cached token per component), i.e. cache
state bounded by the pool (83 M tokens: ~1.3 GB), still live after the flush. Hence the capped pool, and a
full collection before each site snapshot (lab_memlog.request_sites(collect=True)), whose answer says how much
the collection freed (with the capped pool: 8.5 MiB kept after the flush, none of it freed by the collection;
what holds it is not identified).
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import random
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

from dsv4_lab import memlog as lab_memlog
from dsv4_lab.beds.lab_server import descendants, lab_server

KEY = "soak-key"
GROWTH_LIMIT = 4.0  # MiB/min over the run's second half: ~5.6 GiB a day, a leak that ends an A800 server in days


def post(port, path, body, timeout=600):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(), method="POST")
    req.add_header("Content-Type", "application/json")
    req.add_header("Authorization", f"Bearer {KEY}")
    return urllib.request.urlopen(req, timeout=timeout)


def get_json(port, path):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}")
    req.add_header("Authorization", f"Bearer {KEY}")
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read().decode())


def find(obj, key):
    """Every value of `key` anywhere in a JSON value."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k == key:
                yield v
            yield from find(v, key)
    elif isinstance(obj, list):
        for v in obj:
            yield from find(v, key)


def gpu_used_mib():
    """MiB used on the GPUs this server sees (CUDA_VISIBLE_DEVICES; nvidia-smi itself ignores it, so on a
    shared host another job's GPU would otherwise count: the first recorded soak summed both GPUs)."""
    cmd = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if visible:
        cmd.insert(1, "--id=" + visible)
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.split()
        return sum(int(x) for x in out)
    except Exception:
        return None


def process_tree(root: int) -> set:
    """root and every process below it (lab_server.descendants)."""
    return {root, *descendants(root)}


def server_gpu_mib(root: int):
    """MiB of GPU memory held by the server's own processes (nvidia-smi's per-process accounting): valid on a
    GPU that other jobs share too, where gpu_used_mib counts them."""
    cmd = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout
    except Exception:
        return None
    tree = process_tree(root)
    total, seen = 0, False
    for line in out.splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and int(parts[0]) in tree and parts[1].isdigit():
            total += int(parts[1])
            seen = True
    return total if seen else None


def read_memlog(path: str) -> list:
    return lab_memlog.read(path) if os.path.exists(path) else []


LEAK_SLACK_MIB = 16


def leak_check(before: dict, after: dict) -> dict:
    """Per logging process ("pid role"), from two `ask_sites` answers taken after a full garbage collection
    (before the load; after it and the cache flush): the allocator's live MiB then and now, what the
    collection freed at the second one, and `released`: the live tensors back within LEAK_SLACK_MIB of
    before the load (what stays is held by reachable objects: a leak)."""
    out = {}
    for who, a in after.items():
        b = before.get(who, {})
        if a.get("allocated") is None or b.get("allocated") is None:
            continue
        mib = lambda x: round(x / lab_memlog.MIB, 1)  # noqa: E731
        freed = a.get("allocated_before_gc")
        out[who] = {"allocated_mib_before": mib(b["allocated"]), "allocated_mib_after": mib(a["allocated"]),
                    "grew_mib": mib(a["allocated"] - b["allocated"]),
                    "freed_by_gc_mib": None if freed is None else mib(freed - a["allocated"]),
                    "released": a["allocated"] - b["allocated"] <= LEAK_SLACK_MIB * lab_memlog.MIB}
    return out


def ask_sites(memlog: str, tag: str, timeout: float = 30.0, collect: bool = True) -> dict:
    """Every logging process's live GPU bytes per allocating site now, after a full garbage collection
    (lab_memlog.request_sites; the server records stacks with DSV4_SM80_LAB_MEMSITES=1): waits until each
    (pid, role) in the memory log has answered, or `timeout`. Native SGLang logs nothing: {}."""
    if not os.path.exists(memlog):
        return {}
    lab_memlog.request_sites(memlog, tag, collect=collect)
    end = time.time() + timeout
    while True:
        got = lab_memlog.read_sites(memlog, tag)
        logging = {lab_memlog.process_key(x) for x in read_memlog(memlog) if "error" not in x}
        if (got and logging <= set(got)) or time.time() > end:
            return got
        time.sleep(0.5)


def memory_stable(first: list, last: list, slack_mib: int = 512, ratio: float = 1.05) -> bool:
    """The last minute's peak within 5 % (+ 512 MiB) of the first minute's: SGLang allocates its pools at start,
    so a server that keeps growing under a steady load leaks."""
    if not first or not last:
        return False
    return max(last) <= max(first) * ratio + slack_mib


def growth_mib_per_min(samples: list) -> float | None:
    """Least-squares slope (MiB/min) of (seconds, MiB) samples over the second half of the run; None with
    fewer than 4 samples there (too short a run to tell)."""
    pts = [(t, m) for t, m in samples if m is not None]
    if not pts:
        return None
    half = pts[0][0] + (pts[-1][0] - pts[0][0]) / 2
    pts = [(t, m) for t, m in pts if t >= half]
    if len(pts) < 4:
        return None
    n = len(pts)
    mt = sum(t for t, _ in pts) / n
    mm = sum(m for _, m in pts) / n
    var = sum((t - mt) ** 2 for t, _ in pts)
    if var == 0:
        return None
    return 60.0 * sum((t - mt) * (m - mm) for t, m in pts) / var


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--max-requests", type=int, default=5000)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--port", type=int, default=30131)
    ap.add_argument("--max-total-tokens", type=int, default=1 << 20,
                    help="the KV pool's size in tokens (0: SGLang sizes it to the GPU); small enough that the prefix "
                         "cache fills and evicts during the run")
    ap.add_argument("--dspark", action="store_true")
    ap.add_argument("--native", action="store_true", help="the same load on native SGLang (patch off): the A/B")
    args = ap.parse_args(argv)

    serve_args = ["--api-key", KEY, "--context-length", str(args.context), "--chunked-prefill-size", "1024",
                  "--max-running-requests", "64", "--moe-runner-backend", "marlin", "--mem-fraction-static", "0.7"]
    if args.max_total_tokens:
        serve_args += ["--max-total-tokens", str(args.max_total_tokens)]
    if args.dspark:
        serve_args += ["--speculative-algorithm", "DSPARK"]
    if args.native:  # SGLang's own launch_server: the model lab mode's serve would pick, named
        from dsv4_sm80.tiny.generate import lab_checkpoint

        serve_args += ["--model-path", lab_checkpoint()]
    memlog = os.path.splitext(os.path.abspath(args.out))[0] + ".memlog.jsonl"
    for old in glob.glob(glob.escape(memlog) + "*"):  # the log, its site requests and answers
        os.remove(old)
    stats = {"done": 0, "cancelled": 0, "errors": [], "nonfinite": 0, "tokens": 0}
    lock = threading.Lock()
    mem = []
    log_path = os.path.splitext(os.path.abspath(args.out))[0] + ".server.log"  # soak and soak-dspark each keep theirs
    lab_env = {"DSV4_SM80_LAB_MEMLOG": memlog, "DSV4_SM80_LAB_MEMSITES": "1"}
    with lab_server(args.port, serve_args, log_path, lab_env, native=args.native) as (server, _):
        t0 = time.time()
        post(args.port, "/flush_cache", {}).read()
        idle = list(find(get_json(args.port, "/v1/loads"), "num_used_tokens"))
        sites_before = ask_sites(memlog, "before")
        prefixes = [[random.Random(p).randrange(1000, 120000) for _ in range(2048)] for p in range(4)]
        deadline = time.time() + 60 * args.minutes
        issued = [0]

        def worker(seed):
            rng = random.Random(seed)
            while time.time() < deadline:
                with lock:
                    if issued[0] >= args.max_requests:
                        return
                    issued[0] += 1
                max_new = rng.randint(1, 256)
                n = rng.randint(1, args.context - max_new - 1)
                ids = (prefixes[rng.randrange(4)][:n] if rng.random() < 0.33 else []) + \
                      [rng.randrange(1000, 120000) for _ in range(n)]
                ids = ids[:n]
                cancel_after = rng.randint(1, 5) if rng.random() < 0.1 else None
                # DSPARK in SGLang 0.5.16 aborts requests that ask for logprobs: with --dspark the non-finite
                # check has no logprobs to read, and the run counts errors, pages and memory only
                body = {"input_ids": ids, "stream": True, "return_logprob": not args.dspark,
                        "sampling_params": {"max_new_tokens": max_new, "temperature": rng.choice([0.0, 0.7])}}
                try:
                    with post(args.port, "/generate", body) as r:
                        chunks = 0
                        for raw in r:
                            line = raw.decode(errors="replace").strip()
                            if not line.startswith("data:") or line == "data: [DONE]":
                                continue
                            chunks += 1
                            msg = json.loads(line[5:])
                            lps = [e[0] for e in msg.get("meta_info", {}).get("output_token_logprobs", []) if e]
                            bad = sum(1 for x in lps if x is None or not math.isfinite(x))
                            if bad:
                                with lock:
                                    stats["nonfinite"] += bad
                            if cancel_after and chunks >= cancel_after:
                                break
                    with lock:
                        if cancel_after and chunks >= cancel_after:
                            stats["cancelled"] += 1
                        else:
                            stats["done"] += 1
                            stats["tokens"] += max_new
                except Exception as e:
                    with lock:
                        stats["errors"].append(f"{type(e).__name__}: {str(e)[:200]}")

        threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(args.streams)]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            mem.append((round(time.time() - t0, 1), server_gpu_mib(server.pid), gpu_used_mib()))
            time.sleep(10)
        time.sleep(5)
        for _ in range(60):  # let cancelled requests drain
            loads = get_json(args.port, "/v1/loads")
            if sum(x or 0 for x in find(loads, "num_running_reqs")) == 0:
                break
            time.sleep(2)
        post(args.port, "/flush_cache", {}).read()
        t_flush = time.time()  # the memory log's lines from here on see the flushed cache
        time.sleep(2)
        after = list(find(get_json(args.port, "/v1/loads"), "num_used_tokens"))
        for _ in range(30):  # each process's first memory-log line after the flush (one every 10 s each)
            if not os.path.exists(memlog) or lab_memlog.logged_since(read_memlog(memlog), t_flush):
                break
            time.sleep(1)
        sites_after = ask_sites(memlog, "after")
        alive = server.poll() is None
    own = [m for t, m, _ in mem if m is not None]
    first, last = own[:6], own[-6:]
    slope = growth_mib_per_min([(t, m) for t, m, _ in mem])
    inside = None
    if os.path.exists(memlog):  # the patched server's own view (lab_memlog); native SGLang writes none
        inside = lab_memlog.summarize(read_memlog(memlog), since=t0, flushed=t_flush)
    leaks = leak_check(sites_before, sites_after)
    if leaks:
        leak_free = all(r["released"] for r in leaks.values())
    elif os.path.exists(memlog):  # the patched server keeps a memory log: its leak check must have run
        leak_free = False
    else:  # native SGLang: no log, no check
        leak_free = None
    growth_sites = {who: lab_memlog.sites_growth(sites_before[who]["sites"], got["sites"])
                    for who, got in sites_after.items() if "sites" in got and "sites" in sites_before.get(who, {})}
    stable = memory_stable(first, last) and slope is not None and slope < GROWTH_LIMIT
    report = {"minutes": args.minutes, "dspark": args.dspark, "native": args.native,
              "done": stats["done"], "cancelled": stats["cancelled"],
              "errors": len(stats["errors"]), "error_samples": stats["errors"][:10],
              "nonfinite_logprobs": stats["nonfinite"],
              "tokens_requested": stats["tokens"], "used_tokens_idle": idle, "used_tokens_after_flush": after,
              "server_gpu_mib_first_minute": first, "server_gpu_mib_last_minute": last,
              "growth_mib_per_min_second_half": None if slope is None else round(slope, 1),
              "growth_limit_mib_per_min": GROWTH_LIMIT, "memory_stable": stable,
              "max_total_tokens": args.max_total_tokens, "leak_check": leaks, "leak_free": leak_free,
              "server_gpu_mib": [(t, m) for t, m, _ in mem], "device_gpu_mib": [(t, d) for t, _, d in mem],
              "inside_server": inside, "growth_sites": growth_sites, "server_alive": alive}
    ok = (report["errors"] == 0 and report["nonfinite_logprobs"] == 0 and after == idle and alive
          and report["done"] > 0 and stable and leak_free is not False)
    rate = "too short to tell" if slope is None else f"{slope:+.1f} MiB/min"
    print(f"soak: {'native ' if args.native else ''}{args.minutes} min{' DSPARK' if args.dspark else ''}: "
          f"{report['done']} done, {report['cancelled']} "
          f"cancelled, {report['errors']} errors, {report['nonfinite_logprobs']} non-finite logprobs; KV used tokens "
          f"idle {idle} -> after flush {after}; server GPU MiB peak first minute {max(first, default=None)}, last "
          f"minute {max(last, default=None)}, second half {rate} (limit {GROWTH_LIMIT}; stable {stable}); "
          f"KV pool {args.max_total_tokens or 'sized by SGLang'} tokens; alive {alive}")
    for who, row in leaks.items():
        print(f"soak: leak check, {who}: live tensors after a full GC {row['allocated_mib_before']} MiB before the "
              f"load -> {row['allocated_mib_after']} after it and the flush ({row['grew_mib']:+.1f}; the GC freed "
              f"{row['freed_by_gc_mib']} MiB); released {row['released']}")
    if leak_free is False and not leaks:
        print("soak: leak check: the server keeps a memory log but answered no site request")
    for who, row in (inside or {}).items():
        print(f"soak: inside the server, {who}: MiB used {row['used'][0]} -> {row['used'][1]}, allocator reserved "
              f"{row['reserved'][0]} -> {row['reserved'][1]}, allocated {row['allocated'][0]} -> {row['allocated'][1]}"
              f", outside the allocator {row['outside'][0]} -> {row['outside'][1]} (grew: {row['where']}; "
              f"alloc retries {row['retries']}); allocated after the flush {row.get('allocated_after_flush')} "
              f"(released: {row.get('released')})")
    for who, rows in growth_sites.items():  # what holds the growth, from the load's start to after the flush
        print(f"soak: live GPU memory by allocating site, {who}, before the load -> after the flush:")
        for site, mib, blocks in rows[:8]:
            print(f"soak:   {mib:+10.2f} MiB {blocks:+6d} blocks  {site[:160]}")
    for e in report["error_samples"]:
        print("  error:", e)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print("soak:", "OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
