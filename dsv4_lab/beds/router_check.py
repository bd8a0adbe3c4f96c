"""Two servers behind SGLang's router (smg) on one GPU, lab mode: requests reach both; one server killed, the router
keeps answering from the other and says which worker it dropped.

    DSV4_SM80_LAB_GPU_COUNT=1 DSV4_SM80_LAB_CC=9.0 python -m dsv4_lab.beds.router_check --out router.json

Each server is `python -m dsv4_sm80 serve` on loopback (the embedded tiny checkpoint, each KV pool capped); the
router is `python -m smg launch` with round-robin routing and health checks every 2 s. Which server answered is read
from each server's own access log. Exit 1 unless both servers answered before the kill and no request failed after
it beyond --allowed-errors (requests the router sent before its health check caught the dead worker).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

from dsv4_lab.beds.http_check import KEY
from dsv4_lab.beds.lab_server import descendants, lab_server
from dsv4_lab.beds.tools_check import post

WORKERS = (30141, 30142)
ROUTER = 30140


def served(log_path: str) -> int:
    with open(log_path, errors="replace") as f:
        return sum('"POST /v1/chat/completions' in line and " 200" in line for line in f)


def ask(n: int) -> list[int]:
    return [post(ROUTER, "/v1/chat/completions", {"model": "default", "max_tokens": 8, "temperature": 0.0,
                                                  "messages": [{"role": "user", "content": f"Count to {i}."}]})[0]
            for i in range(n)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--allowed-errors", type=int, default=2)
    args = ap.parse_args(argv)
    # a capped pool under a high fraction: the second server keeps room beside the first (see http_check)
    serve = ["--api-key", KEY, "--context-length", "4096", "--mem-fraction-static", "0.85", "--max-total-tokens",
             "65536", "--disable-cuda-graph"]
    logs = [args.out.removesuffix(".json") + f".server{i}.log" for i in range(2)]
    router_log = args.out.removesuffix(".json") + ".router.log"
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(lab_server(p, serve, log))[0] for p, log in zip(WORKERS, logs)]
        rlog = stack.enter_context(open(router_log, "w"))
        router = subprocess.Popen([sys.executable, "-m", "smg", "launch", "--host", "127.0.0.1", "--port",
                                   str(ROUTER), "--worker-urls", *(f"http://127.0.0.1:{p}" for p in WORKERS),
                                   "--policy", "round_robin", "--api-key", KEY, "--health-check-interval-secs", "2",
                                   "--health-failure-threshold", "2"], stdout=rlog, stderr=subprocess.STDOUT)
        stack.callback(router.terminate)
        for _ in range(60):
            with contextlib.suppress(Exception), urllib.request.urlopen(f"http://127.0.0.1:{ROUTER}/health", timeout=5):
                break
            time.sleep(2)
        before = ask(args.requests)
        per_worker = [served(log) for log in logs]
        for pid in [servers[1].pid, *descendants(servers[1].pid)]:  # the server and its scheduler processes
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        t_kill = time.time()
        time.sleep(1)
        after = ask(args.requests)
        record = {"before": {"statuses": before, "per_worker": per_worker},
                  "after_kill": {"statuses": after, "seconds_from_kill": round(time.time() - t_kill, 1),
                                 "survivor_served": served(logs[0]) - per_worker[0]}}
    with open(router_log, errors="replace") as f:
        record["router_lines_on_the_dead_worker"] = [ln.strip()[:300] for ln in f if str(WORKERS[1]) in ln][-5:]
    errors = sum(s != 200 for s in after)
    ok = all(s == 200 for s in before) and min(per_worker) > 0 and errors <= args.allowed_errors
    record["ok"] = ok
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    print(f"router_check: before the kill {before.count(200)}/{len(before)} answered, per worker {per_worker}; "
          f"after {after.count(200)}/{len(after)}; router on the dead worker: "
          f"{record['router_lines_on_the_dead_worker'][-1:] or 'nothing'}")
    print("router_check:", "OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
