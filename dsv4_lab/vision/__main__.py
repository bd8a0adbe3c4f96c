"""python -m dsv4_lab.vision train OUT [--device cuda --steps N --budget S --batch B --stop-after S]
python -m dsv4_lab.vision unpack DIR [--archive A] [--as-trained]
python -m dsv4_lab.vision score --ckpt DIR --record native=F --record sm80=F [--json-out F]"""

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
    u = sub.add_parser("unpack", help="unpack the trained Vision-Exp archive (served shape unless --as-trained)")
    u.add_argument("dir")
    u.add_argument("--archive", default=None)
    u.add_argument("--as-trained", action="store_true")
    s = sub.add_parser("score", help="score vision_trained records against the vision oracle")
    s.add_argument("--ckpt", required=True, help="the trained-shape checkpoint (unpack --as-trained)")
    s.add_argument("--record", action="append", default=[], metavar="NAME=FILE")
    s.add_argument("--device", default="cpu")
    s.add_argument("--json-out")
    a = ap.parse_args(argv)
    if a.cmd == "unpack":
        from dsv4_lab.train.check import unpack

        from . import TRAINED_ARCHIVE

        archive = a.archive or TRAINED_ARCHIVE
        if not os.path.isfile(archive):
            print(f"dsv4-lab vision unpack: no archive at {archive}; train one on a GPU: python -m dsv4_lab.vision "
                  "train OUT --device cuda --batch 32 --steps 100000 --budget 400 (then OUT/dsv4-lab-tiny-vl.tar.xz "
                  "and OUT/train-vl.json are the archive and its record)", file=sys.stderr)
            return 2
        os.makedirs(a.dir, exist_ok=True)
        print(unpack(archive, a.dir, served=not a.as_trained))
        return 0
    if a.cmd == "score":
        import json

        from dsv4_lab.oracle.__main__ import named

        from .score import score

        records = {}
        for name, path in named(a.record, "vision score"):
            with open(path) as f:
                records[name] = json.load(f)
        out = score(a.ckpt, records, a.device)
        for name, row in out["paths"].items():
            print(f"vision score {name}: " + " ".join(f"{k} {v:.3f}" for k, v in row.items() if k.endswith("accuracy"))
                  + f" rule {'PASS' if row['rule']['verdict']['passes'] else 'FAIL'}")
        for name, row in out["mutants"].items():
            print(f"vision score mutant {name}: {'caught' if row['caught'] else 'NOT caught'}")
        if a.json_out:
            with open(a.json_out, "w") as f:
                json.dump(out, f, indent=1)
        return 0
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
