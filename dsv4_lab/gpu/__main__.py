"""python -m dsv4_lab.gpu run|status|score: the GPU suite on a GPU host with SGLang 0.5.16.

    python -m dsv4_lab.gpu run --tier core --budget 540 --export "$OUT"   # as much as fits; again to resume
    python -m dsv4_lab.gpu status                                          # done, pending, failed; verdicts

Each call of `run` stays inside --budget seconds (a job is started only when its estimate fits what is left,
and jobs still running at the end are cut and run again by the next call), prints progress as jobs end, and
writes the summary, the state and the records to --export after every job. --jit-restore takes the parts
an earlier host's --jit-save wrote, so a cold host skips minutes of JIT compiles.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import runner, suite, verdicts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsv4_lab.gpu", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("run", "status"):
        p = sub.add_parser(name)
        p.add_argument("--tier", default="core", choices=("core", "full"))
        p.add_argument("--res", type=Path, default=runner.DEFAULT_RESULTS, help="results folder (outlives a call)")
        p.add_argument("--only", help="comma-separated job names (with the jobs they need)")
    r = sub.choices["run"]
    r.add_argument("--budget", type=float, default=540, help="seconds this call may spend")
    r.add_argument("--export", type=Path, help="where the summary, state and records go after every job ($OUT)")
    r.add_argument("--retry-failed", action="store_true", help="run failed jobs again (else only new or cut ones)")
    r.add_argument("--jit-restore", type=Path, nargs="*", default=[], help="jit.tar.xz.NN parts of an earlier host")
    r.add_argument("--jit-save", action="store_true", help="this host's JIT caches into --export afterwards")
    s = sub.add_parser("score", help="the trained records in RES against the oracle -> RES/trained.json")
    s.add_argument("--res", type=Path, default=runner.DEFAULT_RESULTS)
    s.add_argument("--ckpt", type=Path, required=True)
    s.add_argument("--device", default="cuda")
    args = ap.parse_args(argv)

    if args.cmd == "score":
        return score(args.res, args.ckpt, args.device)
    jobs = suite.tier(args.tier)
    if args.only:
        jobs = select(jobs, args.only.split(","))
    run = runner.Runner(args.res, jobs, export=getattr(args, "export", None))
    if args.cmd == "run":
        why = runner.gpu_host()
        if why:
            print(f"gpu suite: this host cannot run it: {why}")
            return 2
        runner.jit_restore(args.jit_restore)
        run.run(args.budget, retry_failed=args.retry_failed)
        if args.jit_save and args.export:
            runner.jit_save(args.export)
    found = verdicts.collect(args.res, run.state)
    print("\n".join(["jobs:", *run.status_lines(), "verdicts:", *[f"  {v}" for v in found]]))
    done = all(run.done(j) for j in jobs)
    failed = any(v.ok is False for v in found)
    return 1 if failed else (0 if done else 3)


def select(jobs: list[suite.Job], names: list[str]) -> list[suite.Job]:
    """The named jobs and, transitively, those they need, in declaration order."""
    by = {j.name: j for j in jobs}
    unknown = [n for n in names if n not in by]
    if unknown:
        raise SystemExit(f"gpu suite: unknown job(s) {', '.join(unknown)}; expected some of {', '.join(by)}")
    want, stack = set(), list(names)
    while stack:
        n = stack.pop()
        if n not in want:
            want.add(n)
            stack += [m for m in by[n].needs if m in by]
    return [j for j in jobs if j.name in want]


def score(res: Path, ckpt: Path, device: str) -> int:
    """trained.json from the trained records present (a path whose plain record is absent is left out)."""
    import json

    from dsv4_lab.train.score import score as score_records

    records = {p: res / f"trained-{p}.json" for p in suite.PATHS if (res / f"trained-{p}.json").is_file()}
    specs = {p: res / f"trained-{p}-dspark.json" for p in records if (res / f"trained-{p}-dspark.json").is_file()}
    if not records:
        print(f"gpu score: no trained-<path>.json in {res}; the trained beds must run first")
        return 1
    out = score_records(str(ckpt), {k: str(v) for k, v in records.items()}, {k: str(v) for k, v in specs.items()},
                        device=device)
    (res / "trained.json").write_text(json.dumps(out, indent=1))
    for v in verdicts.trained(out):
        print(f"  {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
