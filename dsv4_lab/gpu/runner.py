"""Runs the suite's jobs on a GPU host inside a time budget, and resumes where a cut run stopped.

The results folder (default /tmp/dsv4-gpu: it must outlive one device call, so not the folder a call hands
back) holds every job's record, its log and `state.json`: per job its status, the key it ran under (the
source tree's digest and the job's own command and environment), seconds, exit code and, when it failed, the
error line taken from its log. A job whose key still matches and that ended (passed or failed) is not run
again; one cut by the budget or by the end of a call (status `running` or `cut`) runs again from its start.

Jobs start in declaration order once the jobs they need have ended, side by side while their `gpu_share`s
fit in one GPU, and only when their estimate (the last measured time of the job, else the declared one)
fits the budget left. When the budget runs out the jobs in flight are killed and marked `cut`. After every
job that ends, `export` writes the summary, the state and a tarball of the records to the folder the device
call hands back, so a call cut by its limit still returns what finished.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from . import suite

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_RESULTS = Path(os.environ.get("DSV4_GPU_RESULTS", "/tmp/dsv4-gpu"))
CKPT_NAME = "dsv4-lab-tiny"  # what `python -m dsv4_lab.train unpack RES` writes
# what the key of a job covers: the code that runs (not docs, not the CPU-only tests)
DIGEST_PARTS = ("sitecustomize.py", "dsv4_sm80", "dsv4_lab", "vision_backport", "bench", "tests/kernels",
                "tests/gpu", "tests/conftest.py", "tests/reference.py")
DONE = ("passed", "failed")
ERROR_LINE = re.compile(r"^\s*([\w.]*(Error|Exception|Exit|Interrupt)\b.*|.*\b(FAILED|out of memory|watchdog timeout)"
                        r"\b.*)$")


def tree_digest(root: Path = ROOT) -> str:
    h = hashlib.sha256()
    for part in DIGEST_PARTS:
        p = root / part
        files = [p] if p.is_file() else sorted(q for q in p.rglob("*") if q.is_file() and "__pycache__" not in q.parts
                                               and q.suffix in (".py", ".sh", ".json", ".xz", ".toml"))
        for f in files:
            h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def job_key(job: suite.Job, digest: str) -> str:
    text = json.dumps([job.name, list(job.argv), sorted(job.env.items()), digest])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def error_line(log_text: str, rc: int | None) -> str:
    """The line that says why a job failed: the last exception or failure line of its log, else its last line;
    a kill by signal is named (SGLang kills its own process tree with SIGKILL when a child process dies, so the
    child's exception above it is the reason, where the log has one)."""
    lines = [ln.rstrip() for ln in log_text.splitlines() if ln.strip()]
    hits = [ln.strip() for ln in lines if ERROR_LINE.match(ln) and not ln.strip().startswith("Traceback")]
    why = hits[-1] if hits else (lines[-1].strip() if lines else "no output")
    if rc is not None and rc < 0:
        why = f"killed by signal {-rc} ({signal.Signals(-rc).name}); last error line: {why}"
    elif rc == 137:
        why = f"exit 137 (SIGKILL: the OOM killer or a process-tree kill); last error line: {why}"
    return why[:400]


def makespan(jobs: list[suite.Job], estimate=lambda j: float(j.estimate_s)) -> float:
    """Seconds the jobs take under the runner's rules (declaration order, needs first, GPU shares summed to at
    most one), each taking its estimate: the planning figure of a tier."""
    t, todo, running, ended = 0.0, list(jobs), {}, set()
    names = {j.name for j in jobs}
    while todo or running:
        for job in list(todo):
            if all(n in ended or n not in names for n in job.needs) and \
                    sum(j.gpu_share for j, _ in running.values()) + job.gpu_share <= 1.0 + 1e-9:
                todo.remove(job)
                running[job.name] = (job, t + estimate(job))
        if not running:
            raise ValueError(f"gpu suite: {', '.join(j.name for j in todo)} can never start")
        name, (_, t) = min(running.items(), key=lambda kv: kv[1][1])
        del running[name]
        ended.add(name)
    return t


class Runner:
    def __init__(self, res: Path = DEFAULT_RESULTS, jobs: list[suite.Job] | None = None, root: Path = ROOT,
                 export: Path | None = None, log=print, poll_s: float = 2.0):
        self.res, self.root, self.export_dir, self.log, self.poll_s = Path(res), Path(root), export, log, poll_s
        self.jobs = list(jobs if jobs is not None else suite.tier("core"))
        self.res.mkdir(parents=True, exist_ok=True)
        self.digest = tree_digest(self.root)
        self.state = self._load()

    # --- state
    def _load(self) -> dict:
        p = self.res / "state.json"
        return json.loads(p.read_text()) if p.is_file() else {"jobs": {}}

    def save(self) -> None:
        p = self.res / "state.json"
        p.with_suffix(".tmp").write_text(json.dumps(self.state, indent=1))
        p.with_suffix(".tmp").replace(p)

    def entry(self, name: str) -> dict:
        return self.state["jobs"].get(name, {})

    def done(self, job: suite.Job) -> bool:
        e = self.entry(job.name)
        return e.get("status") in DONE and e.get("key") == job_key(job, self.digest)

    def estimate(self, job: suite.Job) -> float:
        e = self.entry(job.name)
        return float(e["seconds"]) if e.get("status") == "passed" and "seconds" in e else float(job.estimate_s)

    def pending(self, retry_failed: bool = False) -> list[suite.Job]:
        return [j for j in self.jobs if not self.done(j)
                or (retry_failed and self.entry(j.name).get("status") == "failed")]

    # --- running
    def _start(self, job: suite.Job, limit: float, running: dict) -> None:
        ckpt = self.res / CKPT_NAME
        log_path = self.res / f"{job.name}.log"
        env = {**os.environ, **job.env}
        env["PYTHONPATH"] = os.pathsep.join([str(self.root), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                                               if p]])
        env.setdefault("SGLANG_JIT_DEEPGEMM_PRECOMPILE", "0")  # else DeepGEMM warms 16,384 M values per shape
        f = open(log_path, "w")
        proc = subprocess.Popen(job.command(self.res, ckpt), cwd=self.root, env=env, stdout=f,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        running[job.name] = (job, proc, time.monotonic(), limit, f)
        self.state["jobs"][job.name] = {"status": "running", "key": job_key(job, self.digest), "started": time.time(),
                                        "limit_s": round(limit), "overlap": sorted(n for n in running if n != job.name)}
        for other in running:
            if other != job.name:
                self.state["jobs"][other].setdefault("overlap", []).append(job.name)
        self.save()

    def _end(self, name: str, running: dict, status: str, rc: int | None, why: str | None = None) -> None:
        job, proc, t0, _, f = running.pop(name)
        f.close()
        e = self.state["jobs"][name]
        e.update(status=status, rc=rc, seconds=round(time.monotonic() - t0, 1))
        if status != "passed":
            e["error"] = why or error_line((self.res / f"{name}.log").read_text(errors="replace"), rc)
        self.save()

    @staticmethod
    def _kill(proc) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()

    def run(self, budget_s: float, retry_failed: bool = False) -> dict:
        """Run what is pending within budget_s seconds; returns the state."""
        t_start = time.monotonic()
        deadline = t_start + budget_s
        todo = self.pending(retry_failed)
        names = {j.name for j in self.jobs}
        running: dict = {}
        deferred: set[str] = set()
        self.log(f"gpu suite: {len(todo)} of {len(self.jobs)} jobs to run, budget {budget_s:.0f} s, tree {self.digest}"
                 + (f"; done already: {', '.join(j.name for j in self.jobs if j not in todo)}"
                    if len(todo) < len(self.jobs) else ""))
        while todo or running:
            now = time.monotonic()
            left = deadline - now
            waiting_on = {j.name for j in todo} | set(running)
            started = False
            for job in list(todo):
                if any(n in waiting_on for n in job.needs if n in names):
                    continue
                if sum(r[0].gpu_share for r in running.values()) + job.gpu_share > 1.0 + 1e-9:
                    continue
                if self.estimate(job) > left:
                    if job.name not in deferred:
                        deferred.add(job.name)
                        self.log(f"[{now - t_start:5.0f} s] {job.name}: not started, estimate "
                                 f"{self.estimate(job):.0f} s > {left:.0f} s left (next call)")
                    continue
                todo.remove(job)
                self._start(job, min(job.timeout_s, left), running)
                started = True
                self.log(f"[{now - t_start:5.0f} s] {job.name}: started (estimate {self.estimate(job):.0f} s; "
                         f"{job.what})")
            ended = False
            for name in list(running):
                job, proc, t0, limit, _ = running[name]
                rc = proc.poll()
                if rc is None and time.monotonic() - t0 > limit:
                    self._kill(proc)
                    cut = limit < job.timeout_s
                    self._end(name, running, "cut" if cut else "failed", None,
                              None if cut else f"timed out after {limit:.0f} s; last error line: "
                              + error_line((self.res / f"{name}.log").read_text(errors="replace"), None))
                elif rc is not None:
                    self._end(name, running, "passed" if rc == 0 else "failed", rc)
                else:
                    continue
                ended = True
                e = self.entry(name)
                self.log(f"[{time.monotonic() - t_start:5.0f} s] {name}: {e['status'].upper()} in {e['seconds']:.0f} s"
                         + (f": {e['error']}" if e.get("error") else ""))
                self.export()
            if not running and not started and not ended:
                break  # what is left does not fit this budget
            if running:
                time.sleep(self.poll_s)
        self.export()
        return self.state

    # --- reporting
    def status_lines(self) -> list[str]:
        out = []
        for j in self.jobs:
            e = self.entry(j.name)
            st = e.get("status", "pending")
            if st in DONE and e.get("key") != job_key(j, self.digest):
                st = f"pending (last {st} on another tree)"
            elif st == "running":
                st = "pending (cut in flight)"
            line = f"  {j.name:22s} {st:9s}"
            if "seconds" in e:
                line += f" {e['seconds']:7.1f} s"
            if e.get("overlap"):
                line += f"  beside {','.join(sorted(set(e['overlap'])))}"
            if e.get("error") and not st.startswith("passed"):
                line += f"\n      why: {e['error']}"
            out.append(line)
        return out

    def export(self) -> None:
        """Summary, state and records into the folder the device call hands back (at most a few files)."""
        if self.export_dir is None:
            return
        from . import verdicts

        d = Path(self.export_dir)
        d.mkdir(parents=True, exist_ok=True)
        lines = [f"gpu suite, tree {self.digest}, {time.strftime('%Y-%m-%d %H:%M:%S')}", *self.status_lines(),
                 "verdicts:", *[f"  {v}" for v in verdicts.collect(self.res, self.state)]]
        (d / "gpu-summary.txt").write_text("\n".join(lines) + "\n")
        (d / "gpu-state.json").write_text(json.dumps(self.state, indent=1))
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:xz") as tar:
            for f in sorted(self.res.iterdir()):
                if f.is_file() and f.suffix in (".json", ".xml", ".log") and f.stat().st_size < (32 << 20):
                    tar.add(f, arcname=f.name)
        (d / "gpu-results.tar.xz").write_bytes(buf.getvalue())


JIT_DIRS = (".cache/tvm-ffi", ".cache/deep_gemm", ".cache/flashinfer", ".triton", ".tilelang")


def jit_restore(parts: list[Path], log=print) -> None:
    """An earlier host's JIT caches (jit_save's parts, in order) into $HOME, once per host."""
    marker = Path.home() / ".dsv4-jit-restored"
    if marker.exists() or not parts:
        return
    t0 = time.monotonic()
    data = b"".join(Path(p).read_bytes() for p in sorted(parts))
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:xz") as tar:
        tar.extractall(Path.home(), filter="tar")
    marker.touch()
    log(f"gpu suite: JIT caches restored from {len(parts)} part(s), {len(data) >> 20} MiB, "
        f"{time.monotonic() - t0:.0f} s")


def jit_save(out: Path, part_mb: int = 15, log=print) -> None:
    """This host's JIT caches as jit.tar.xz parts of at most part_mb MiB (a device call returns files of at most
    16 MiB): the next cold host restores them instead of compiling for minutes."""
    home = Path.home()
    dirs = [d for d in JIT_DIRS if (home / d).is_dir()]
    r = subprocess.run(f"tar -C {home} -cf - {' '.join(dirs)} | xz -T0 -6", shell=True, capture_output=True)
    if r.returncode != 0:
        log(f"gpu suite: JIT caches not saved: {r.stderr.decode(errors='replace')[-200:]}")
        return
    out.mkdir(parents=True, exist_ok=True)
    size = part_mb << 20
    for i in range(0, len(r.stdout), size):
        (out / f"jit.tar.xz.{i // size:02d}").write_bytes(r.stdout[i:i + size])
    log(f"gpu suite: JIT caches saved ({', '.join(dirs)}): {len(r.stdout) >> 20} MiB in "
        f"{(len(r.stdout) + size - 1) // size} part(s) under {out}")


def gpu_host() -> str | None:
    """Why this host cannot run the suite, or None when it can (a CUDA GPU and SGLang 0.5.16)."""
    try:
        import torch
    except ImportError:
        return "no torch"
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    try:
        import sglang
    except ImportError:
        return "no SGLang importable"
    if sglang.__version__ != "0.5.16":
        return f"SGLang {sglang.__version__}, expected 0.5.16"
    return None


if __name__ == "__main__":
    sys.exit("use python -m dsv4_lab.gpu")
