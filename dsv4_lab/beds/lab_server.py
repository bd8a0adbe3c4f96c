"""The patched server for the GPU scripts: `python -m dsv4_sm80 serve` on loopback in lab mode (the lab switch
DSV4_SM80_LAB=1 set here, the gate's overrides from the caller's environment), started, waited for, stopped."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def descendants(pid: int) -> list[int]:
    """Every process below pid (by /proc ppid): a server's scheduler and detokenizer processes."""
    children = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                children.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(d))
        except (OSError, ValueError, IndexError):
            continue
    out, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


@contextlib.contextmanager
def lab_server(port: int, args: list, log_path: str, extra_env: dict | None = None, timeout: float = 500,
               native: bool = False):
    """Yields (process, seconds to healthy). Raises if it exits or is not healthy within `timeout`.
    native=True: SGLang's own launch_server with the patch off (for A/B; the overlay on the path still
    applies what extra_env switches on, e.g. DSV4_SM80_VISION=1)."""
    env = dict(os.environ, DSV4_SM80_LAB="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               **(extra_env or {}))
    entry = ["sglang.launch_server"] if native else ["dsv4_sm80", "serve"]
    if native:
        env["ENABLE_SGLANG_DSV4_A100_PATCH"] = "0"
    cmd = [sys.executable, "-m", *entry, "--host", "127.0.0.1", "--port", str(port), *args]
    with open(log_path, "w") as log:
        server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        try:
            t0 = time.time()
            while True:
                if server.poll() is not None:
                    raise RuntimeError(f"server exited with {server.returncode} before it was healthy ({log_path})")
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                        if r.status == 200:
                            break
                except Exception:
                    pass
                if time.time() - t0 > timeout:
                    raise RuntimeError(f"server not healthy in {timeout:.0f} s ({log_path})")
                time.sleep(2)
            yield server, time.time() - t0
        finally:
            server.terminate()
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()
