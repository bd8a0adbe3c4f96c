"""Fault: a TP worker (SGLang scheduler process) killed mid-request makes the patched server exit non-zero
with a message, and the client's request ends (error or closed stream) instead of hanging.

    ENABLE_SGLANG_DSV4_A100_PATCH=1 DSV4_SM80_LAB_GPU_COUNT=1 DSV4_SM80_LAB_CC=9.0 \
        python -m dsv4_lab.beds.fault_kill --out fault.json [--tp 2 --rank 1]

The server is `python -m dsv4_sm80 serve` on loopback (dsv4_lab/beds/lab_server.py); while a long streaming
request decodes, the scheduler process of that rank (titled `sglang::scheduler`, `..._TP<rank>` at TP > 1)
gets SIGKILL. Recorded: seconds until the
server process exits, its exit code, how the client's stream ended, and the server log's last lines (SGLang
0.5.16's SubprocessWatchdog names the dead process).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import threading
import time
import urllib.request

from dsv4_lab.beds.lab_server import descendants, lab_server


def title(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--ckpt", default="/tmp/dsv4-tiny")
    ap.add_argument("--port", type=int, default=30017)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--rank", type=int, default=0, help="the TP rank whose scheduler is killed")
    ap.add_argument("--exit-within", type=float, default=120.0, help="seconds the server may take to exit")
    args = ap.parse_args(argv)
    from dsv4_sm80.tiny.generate import ensure

    ensure(args.ckpt, head_scale=12.0)
    log_path = os.path.splitext(args.out)[0] + ".server.log"
    report = {"tp": args.tp, "rank": args.rank}
    serve_args = ["--model-path", args.ckpt, "--tp-size", str(args.tp), "--mem-fraction-static", "0.5",
                  "--disable-cuda-graph", "--skip-server-warmup"]
    with lab_server(args.port, serve_args, log_path) as (server, start_s):
        report["start_s"] = round(start_s, 1)
        stream_end = {}

        def client():
            body = json.dumps({"input_ids": list(range(1000, 1300)), "stream": True,
                               "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{args.port}/generate", data=body,
                                         headers={"Content-Type": "application/json"})
            chunks, t0 = 0, time.time()
            try:
                with urllib.request.urlopen(req, timeout=args.exit_within + 60) as r:
                    for raw in r:
                        if raw.strip().startswith(b"data:"):
                            chunks += 1
                            stream_end.setdefault("first_chunk_s", time.time() - t0)
                stream_end["how"] = "stream closed"
            except Exception as e:
                stream_end["how"] = f"{type(e).__name__}: {str(e)[:200]}"
            stream_end.update(chunks=chunks, ended_s=round(time.time() - t0, 1))

        th = threading.Thread(target=client, daemon=True)
        th.start()
        while "first_chunk_s" not in stream_end and th.is_alive():
            time.sleep(0.2)
        # the title is sglang::scheduler, plus _TP<rank> when TP > 1 (scheduler.py:4548-4554)
        want = re.compile(rf"^sglang::scheduler(_.*)?_TP{args.rank}(_|$)" if args.tp > 1 else r"^sglang::scheduler")
        victims = [p for p in descendants(server.pid) if want.match(title(p))]
        report["schedulers"] = {p: title(p) for p in descendants(server.pid) if title(p).startswith("sglang::")}
        if not victims:
            report["error"] = "no scheduler process found for that rank"
        else:
            os.kill(victims[0], signal.SIGKILL)
            report["killed"] = {"pid": victims[0], "title": title(victims[0])}
            t_kill = time.time()
            try:
                server.wait(args.exit_within)
                report["server_exit_s"] = round(time.time() - t_kill, 1)
            except Exception:
                report["server_exit_s"] = None
            report["server_exit_code"] = server.poll()
            th.join(30)
            report["client"] = dict(stream_end, alive_after=th.is_alive())
    report["log_tail"] = open(log_path, errors="replace").read().splitlines()[-15:]
    ok = (report.get("server_exit_s") is not None and report.get("server_exit_code") not in (0, None)
          and not report.get("client", {}).get("alive_after", True))
    report["ok"] = ok
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"fault_kill: TP{args.tp}, killed {report.get('killed')}; server exited after "
          f"{report.get('server_exit_s')} s with code {report.get('server_exit_code')}; client: "
          f"{report.get('client')} -> {'OK' if ok else 'FAILED'}")
    for line in report["log_tail"][-6:]:
        print("   ", line[:200])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
