"""python -m dsv4_lab.vision train OUT [--device cuda --steps N --budget S --batch B --stop-after S]"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsv4_lab.vision")
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train the tiny Vision-Exp on synthetic picture questions, evaluate, export")
    t.add_argument("out")
    t.add_argument("--preset", default="tiny", choices=["tiny", "toy"])
    t.add_argument("--steps", type=int, default=600)
    t.add_argument("--batch", type=int, default=16)
    t.add_argument("--budget", type=float, default=None, help="seconds of steps (the count is fixed after warm-up)")
    t.add_argument("--stop-after", type=float, default=None, help="stop cleanly after this many seconds of this "
                   "call (state saved, exit 75); the same command continues")
    t.add_argument("--eval-per-kind", type=int, default=20)
    t.add_argument("--device", default="cpu")
    t.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    from dsv4_lab.train.train import Stopped

    from .train import run

    os.makedirs(a.out, exist_ok=True)
    try:
        run(a.out, steps=a.steps, batch=a.batch, device=a.device, seed=a.seed, budget_s=a.budget,
            stop_after_s=a.stop_after, eval_per_kind=a.eval_per_kind, preset=a.preset,
            command="python -m dsv4_lab.vision " + " ".join(sys.argv[1:] if argv is None else argv))
    except Stopped as e:
        print(f"dsv4-lab vision: stopped at {e}; run the same command again to continue")
        return 75
    return 0


if __name__ == "__main__":
    sys.exit(main())
