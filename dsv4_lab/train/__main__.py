"""python -m dsv4_lab.train tiny OUT [--steps N --seq LEN --device cuda|cpu --seed S]
python -m dsv4_lab.train check ARCHIVE [--bpb-files N --max-len L --device D]"""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsv4_lab.train")
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("tiny", help="train the tiny target and its DSPARK draft, write the checkpoint and archive")
    t.add_argument("out")
    t.add_argument("--preset", default="tiny", choices=["tiny", "toy"])
    t.add_argument("--steps", type=int, default=2000)
    t.add_argument("--draft-steps", type=int, default=None, help="default: steps / 4")
    t.add_argument("--seq", type=int, default=4096, help="the long windows' length (> 2048: the C4 indexer selects)")
    t.add_argument("--short", type=int, default=512, help="the short windows' length")
    t.add_argument("--batch", type=int, default=16, help="short windows per step")
    t.add_argument("--long-every", type=int, default=4, help="every N-th step is one long window")
    t.add_argument("--device", default="cpu")
    t.add_argument("--seed", type=int, default=0)
    c = sub.add_parser("check", help="gate checks + oracle load of an archive; optional held-out bits per byte")
    c.add_argument("archive")
    c.add_argument("--bpb-files", type=int, default=0)
    c.add_argument("--max-len", type=int, default=4096)
    c.add_argument("--device", default="cpu")
    a = ap.parse_args(argv)
    if a.cmd == "tiny":
        import os

        from .train import run

        os.makedirs(a.out, exist_ok=True)
        run(a.out, preset=a.preset, steps=a.steps, draft_steps=a.draft_steps, seq=a.seq, device=a.device,
            seed=a.seed, short=a.short, short_batch=a.batch, long_every=a.long_every)
        return 0
    from .check import check

    return check(a.archive, a.bpb_files, a.max_len, a.device)


if __name__ == "__main__":
    sys.exit(main())
