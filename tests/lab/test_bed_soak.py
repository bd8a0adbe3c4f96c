"""dsv4_lab/beds/soak.py's memory accounting, on the CPU: the server's own processes (a GPU shared with other jobs
must not count them) and the stability rule."""

import os
import subprocess
import sys
import time
import types

import pytest

from dsv4_lab.beds import soak


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


# a soak on the H200 (2026-12-01, `steps.sh soak` at 754a739, patched, 4 minutes): (seconds, MiB of the GPU) every 10 s;
# flat for 100 s, then a 74 MiB step and ~37 MiB/min. The first-vs-last-minute rule alone passed it.
CLIMBING_SOAK = [(0.3, 107614), (10.4, 107616), (20.4, 107616), (30.5, 107616), (40.5, 107616), (50.6, 107616),
             (60.6, 107616), (70.7, 107616), (80.7, 107616), (90.8, 107616), (100.8, 107620), (110.9, 107694),
             (121.0, 107702), (131.1, 107708), (141.1, 107716), (151.1, 107720), (161.2, 107728), (171.3, 107732),
             (181.3, 107736), (191.4, 107744), (201.4, 107750), (211.5, 107756), (221.5, 107764), (231.6, 107770)]


def test_growth_over_the_second_half_catches_a_steady_climb():
    mib = [m for _, m in CLIMBING_SOAK]
    assert soak.memory_stable(mib[:6], mib[-6:])  # the old rule: passed
    slope = soak.growth_mib_per_min(CLIMBING_SOAK)
    assert 30 < slope < 45, slope  # second half (116-232 s): 107702 -> 107770, ~37 MiB/min
    assert slope >= soak.GROWTH_LIMIT
    flat = [(t, 107616 + (2 if i % 3 == 0 else 0)) for i, (t, _) in enumerate(CLIMBING_SOAK)]  # nvidia-smi's jitter
    assert abs(soak.growth_mib_per_min(flat)) < soak.GROWTH_LIMIT
    warmup = [(t, 100000 + min(t, 60) * 10) for t, _ in CLIMBING_SOAK]  # grows in the first minute, then flat
    assert soak.growth_mib_per_min(warmup) == 0.0
    assert soak.growth_mib_per_min(CLIMBING_SOAK[:5]) is None  # too short a run to tell: not "stable"
    assert soak.growth_mib_per_min([(t, None) for t, _ in CLIMBING_SOAK]) is None


def test_memlog_lines_and_what_grew(tmp_path):
    from dsv4_lab import memlog as lab_memlog

    path = str(tmp_path / "m.jsonl")
    state = {"n": 0}

    def sample():  # the allocator's cache grows by 64 MiB a sample, nothing outside it
        state["n"] += 1
        r = (1000 + 64 * state["n"]) * lab_memlog.MIB
        return {"used": r + 500 * lab_memlog.MIB, "reserved": r, "allocated": r // 2, "segments": state["n"],
                "retries": 0}

    t = lab_memlog.start(path, 0, "target", interval=0.01, sample=sample)
    assert lab_memlog.start(path, 0, "target", interval=0.01, sample=sample) is None  # one per process and role
    import time
    deadline = time.time() + 10
    while time.time() < deadline and (not os.path.exists(path) or len(open(path).read().splitlines()) < 5):
        time.sleep(0.01)
    lines = lab_memlog.read(path)[:5]
    assert t.daemon and len(lines) == 5 and lines[0]["role"] == "target" and lines[0]["pid"] == os.getpid()
    (row,) = lab_memlog.summarize(lines).values()
    assert row["reserved_growth"] == 256.0 and row["outside_growth"] == 0.0 and row["where"] == "reserved"
    assert row["outside"] == [500.0, 500.0]
    later = lab_memlog.summarize(lines, since=lines[3]["t"])
    assert list(later.values())[0]["samples"] == 2
    broken = str(tmp_path / "b.jsonl")

    def fails():
        raise RuntimeError("no device")

    lab_memlog.start(broken, 1, "draft", interval=0.01, sample=fails).join(5)
    (line,) = lab_memlog.read(broken)  # said once, then the thread ends
    assert "no device" in line["error"] and lab_memlog.summarize([line]) == {}


def test_the_memory_log_says_whether_the_flush_gave_the_growth_back():
    """The H200 soaks' shape (2026-12-01: native and patched both +25 MiB/min, inside the allocator's live tensors):
    summarize's `released` compares the live tensors at the first line after the flush with the run's start."""
    from dsv4_lab import memlog as lab_memlog

    M = lab_memlog.MIB

    def line(t, alloc, outside=2924):
        return {"t": t, "pid": 7, "rank": 0, "role": "target", "used": (104758 + alloc + outside) * M,
                "reserved": (104758 + alloc) * M, "allocated": (104364 + alloc) * M, "segments": 1, "retries": 0}

    run = [line(t, 25 * t // 60) for t in range(0, 240, 10)]
    released = lab_memlog.summarize(run + [line(245, 3)], since=0, flushed=241)
    (row,) = released.values()
    assert row["allocated_growth"] == 95.0 and row["allocated_after_flush"] == 104367.0 and row["released"]
    kept = lab_memlog.summarize(run + [line(245, 90)], since=0, flushed=241)
    assert not list(kept.values())[0]["released"]
    outside = lab_memlog.summarize(run[:-1] + [line(235, 95, outside=3000), line(245, 3, outside=3000)],
                                   since=0, flushed=241)
    assert list(outside.values())[0]["released"] and list(outside.values())[0]["outside_growth"] == 76.0
    (no_line_after,) = lab_memlog.summarize(run, since=0, flushed=241).values()
    assert no_line_after["allocated_after_flush"] is None and not no_line_after["released"]


def test_leak_check_holds_live_tensors_after_a_collection_to_before_the_load():
    """On the H200 (2026-12-01) the growth sat in the flushed radix tree until a collection; the check compares the live
    bytes after a full GC before the load and after the flush, within LEAK_SLACK_MIB."""
    M = 1 << 20
    before = {"7 target": {"allocated": 1000 * M, "allocated_before_gc": 1000 * M}}
    freed = {"7 target": {"allocated": 1010 * M, "allocated_before_gc": 1137 * M}}
    (row,) = soak.leak_check(before, freed).values()
    assert row == {"allocated_mib_before": 1000.0, "allocated_mib_after": 1010.0, "grew_mib": 10.0,
                   "freed_by_gc_mib": 127.0, "released": True}
    kept = {"7 target": {"allocated": 1100 * M, "allocated_before_gc": 1100 * M}}
    assert not soak.leak_check(before, kept)["7 target"]["released"]
    assert soak.leak_check(before, {"7 target": {"allocated": None}}) == {}  # no allocator figure: no verdict
    assert soak.leak_check({}, freed) == {}  # a process that did not answer before the load
    # without a collection asked for, the answer has no before-GC figure
    assert soak.leak_check(before, {"7 target": {"allocated": 1000 * M}})["7 target"]["freed_by_gc_mib"] is None


def test_memlog_caught_up_waits_for_every_process_and_role():
    from dsv4_lab import memlog as lab_memlog

    target = [{"t": t, "pid": 1, "role": "target"} for t in (0, 10, 20)]
    draft = [{"t": t, "pid": 1, "role": "draft"} for t in (5, 15)]
    assert lab_memlog.logged_since(target + draft, 12)
    assert not lab_memlog.logged_since(target + draft, 18)  # the draft's next line is still to come
    assert lab_memlog.logged_since(target + draft + [{"error": "x", "pid": 2, "role": "target"}], 12)


def _snapshot(blocks, device=0):
    """A `torch.cuda.memory._snapshot()`-shaped dict (segments of blocks; frames innermost first)."""
    return {"device": device, "segments": [{"device": device, "blocks": blocks},
                                           {"device": device + 1, "blocks": [dict(blocks[0], size=1 << 40)]}]}


def _frame(filename, line, name):
    return {"filename": filename, "line": line, "name": name}


TORCH = _frame("/venv/lib/python3.12/site-packages/torch/utils/_device.py", 104, "__torch_function__")
RADIX = _frame("/sgl/python/sglang/srt/mem_cache/radix_cache.py", 321, "insert")
SCHED = _frame("/venv/lib/python3.12/site-packages/sglang/srt/managers/scheduler.py", 900, "run_batch")
OURS = _frame("/work/dsv4_sm80/stages/attention.py", 77, "init_forward_metadata")


def test_allocation_sites_name_the_code_outside_torch():
    from dsv4_lab import memlog as lab_memlog

    assert lab_memlog.site_of([TORCH, RADIX, SCHED]) == (
        "sglang/srt/mem_cache/radix_cache.py:321 insert < sglang/srt/managers/scheduler.py:900 run_batch")
    assert lab_memlog.site_of([TORCH, OURS], depth=1) == "dsv4_sm80/stages/attention.py:77 init_forward_metadata"
    assert lab_memlog.site_of([TORCH]).startswith("torch/utils/_device.py:104")  # nothing else: torch's own
    snap = _snapshot([
        {"size": 512, "state": "active_allocated", "frames": []},  # before the recording: untracked
        {"size": 1024, "state": "active_allocated", "frames": [TORCH, RADIX, SCHED]},
        {"size": 2048, "state": "active_allocated", "frames": [RADIX, SCHED]},
        {"size": 4096, "state": "inactive", "frames": [OURS]},  # free in the cache: not live
        {"size": 8192, "state": "active_allocated", "frames": [OURS]},
    ])
    got = lab_memlog.sites(snap)  # the snapshot's own device only
    radix = "sglang/srt/mem_cache/radix_cache.py:321 insert < sglang/srt/managers/scheduler.py:900 run_batch"
    assert got == {"untracked": {"bytes": 512, "blocks": 1}, radix: {"bytes": 3072, "blocks": 2},
                   "dsv4_sm80/stages/attention.py:77 init_forward_metadata": {"bytes": 8192, "blocks": 1}}
    later = {**got, radix: {"bytes": 3072 + 5 * lab_memlog.MIB, "blocks": 40}, "untracked": {"bytes": 0, "blocks": 0}}
    rows = lab_memlog.sites_growth(got, later)
    assert rows[0] == (radix, 5.0, 38) and rows[-1] == ("untracked", 0.0, -1)
    assert len(rows) == 2  # unchanged sites are left out


def test_site_requests_are_answered_once_per_process_and_tag(tmp_path, monkeypatch):
    from dsv4_lab import memlog as lab_memlog

    path = str(tmp_path / "m.jsonl")
    blocks = [{"size": 1024, "state": "active_allocated", "frames": [RADIX]}]
    sample = lambda: {"used": 3, "reserved": 2, "allocated": 1, "segments": 1, "retries": 0}  # noqa: E731
    taken = []

    def snapshot():
        taken.append(1)
        return _snapshot(blocks)

    lab_memlog._started.discard((os.getpid(), "sitetest"))
    lab_memlog.start(path, 0, "sitetest", interval=0.05, sample=sample, snapshot=snapshot)
    # wait for the thread's first line: a server has logged long before the soak asks, and ask_sites reads a
    # missing log as a server that keeps none (native)
    for _ in range(100):
        if os.path.exists(path) and lab_memlog.read(path):
            break
        time.sleep(0.05)
    with pytest.raises(ValueError, match="letters, digits"):
        lab_memlog.request_sites(path, "../x")
    assert soak.ask_sites(path + ".absent", "before") == {}  # no memory log (native): nothing asked
    collected = []
    monkeypatch.setattr(lab_memlog.gc, "collect", lambda: collected.append(1) or 5)
    before = soak.ask_sites(path, "before", timeout=10)  # the soak asks after a collection
    blocks.append({"size": 3 * lab_memlog.MIB, "state": "active_allocated", "frames": [OURS]})
    after = soak.ask_sites(path, "after", timeout=10)
    plain = soak.ask_sites(path, "plain", timeout=10, collect=False)
    key = f"{os.getpid()} sitetest"
    assert set(before) == set(after) == set(plain) == {key}
    assert lab_memlog.sites_growth(before[key]["sites"], after[key]["sites"]) == [
        ("dsv4_sm80/stages/attention.py:77 init_forward_metadata", 3.0, 1)]
    assert len(collected) == 2 and after[key]["gc_unreachable"] == 5 and "gc_unreachable" not in plain[key]
    assert after[key]["allocated"] == after[key]["allocated_before_gc"] == 1 and plain[key]["allocated"] == 1
    time.sleep(0.3)
    assert len(taken) == 3  # each tag answered once, however often the thread looks


def test_memlog_runs_when_the_sites_cannot_be_recorded(tmp_path, monkeypatch, capsys):
    """DSV4_SM80_LAB_MEMSITES=1 where PyTorch's memory history cannot start (here: it raises): the memory log
    still runs and says why there are no sites."""
    from dsv4_lab import memlog as lab_memlog

    path = str(tmp_path / "m.jsonl")
    monkeypatch.setenv("DSV4_SM80_LAB_MEMLOG", path)
    monkeypatch.setenv("DSV4_SM80_LAB_MEMSITES", "1")
    monkeypatch.setattr(lab_memlog, "cuda_sampler",
                        lambda: lambda: {"used": 1, "reserved": 1, "allocated": 1, "segments": 1, "retries": 0})

    def no_history():
        raise RuntimeError("no memory history here")

    monkeypatch.setattr(lab_memlog, "_record_sites", no_history)
    lab_memlog._started.discard((os.getpid(), "draft"))
    lab_memlog.maybe_start(types.SimpleNamespace(is_draft_worker=True, tp_rank=1))
    for _ in range(50):
        if os.path.exists(path) and lab_memlog.read(path):
            break
        time.sleep(0.05)
    (line,) = lab_memlog.read(path)[:1]
    assert line["role"] == "draft" and line["rank"] == 1 and "error" not in line
    assert "allocation sites not recorded (RuntimeError: no memory history here)" in capsys.readouterr().err
