"""tests/gpu/soak.py's memory accounting, on the CPU: the server's own processes (a GPU shared with other jobs
must not count them) and the stability rule."""

import os
import subprocess
import sys
import types

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "gpu"))
import soak  # noqa: E402


def test_process_tree_finds_children_and_grandchildren():
    child = subprocess.Popen([sys.executable, "-c",
                              "import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', "
                              "'import time; time.sleep(30)']); print(p.pid, flush=True); time.sleep(30)"],
                             stdout=subprocess.PIPE, text=True)
    try:
        grandchild = int(child.stdout.readline())
        tree = soak.process_tree(os.getpid())
        assert {os.getpid(), child.pid, grandchild} <= tree
        assert os.getppid() not in tree  # only downwards
        assert soak.process_tree(child.pid) == {child.pid, grandchild}
    finally:
        child.kill()
        subprocess.run(["pkill", "-P", str(child.pid)], check=False)


def test_server_memory_counts_only_the_servers_processes(monkeypatch):
    mine = os.getpid()
    table = f"{mine}, 70000\n999999, 50000\n[N/A], 3\n"  # another job's process on the same GPU; a junk row
    monkeypatch.setattr(soak.subprocess, "run", lambda *a, **k: types.SimpleNamespace(stdout=table))
    assert soak.server_gpu_mib(mine) == 70000
    monkeypatch.setattr(soak.subprocess, "run", lambda *a, **k: types.SimpleNamespace(stdout="999999, 5\n"))
    assert soak.server_gpu_mib(mine) is None  # nothing of ours on the GPU: no figure, not zero

    def broken(*a, **k):
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(soak.subprocess, "run", broken)
    assert soak.server_gpu_mib(mine) is None


def test_memory_stable_rule():
    assert soak.memory_stable([70000, 70100], [70200, 70300])
    assert soak.memory_stable([70000], [73500 + 500])  # 5 % + 512 MiB
    assert not soak.memory_stable([70000], [75000])
    assert not soak.memory_stable([], [1]) and not soak.memory_stable([1], [])
