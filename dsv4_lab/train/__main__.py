"""python -m dsv4_lab.train tiny OUT [--steps N --seq LEN --device cuda|cpu --seed S --budget SECONDS --corpus F]
python -m dsv4_lab.train corpus OUT.pt
python -m dsv4_lab.train check ARCHIVE [--windows N --window-len L --device D]
python -m dsv4_lab.train unpack DIR [--archive A] [--as-trained]
python -m dsv4_lab.train prompts OUT.json [--lengths 20,300,1984,3000]
python -m dsv4_lab.train score --ckpt DIR --record NAME=FILE [--dspark NAME=FILE] [--json-out F]"""

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
    t.add_argument("--long-every", type=int, default=4, help="every N-th step is --long-batch long windows")
    t.add_argument("--long-batch", type=int, default=1, help="long windows per long step")
    t.add_argument("--corpus", default=None, help="train on a saved corpus (`train corpus`) instead of this "
                   "machine's Python library")
    t.add_argument("--budget", type=float, default=None, help="seconds of target steps: --steps becomes an "
                   "upper bound, the count is fixed once the warm-up steps are timed")
    t.add_argument("--draft-budget", type=float, default=None, help="the same for the draft's steps")
    t.add_argument("--qat-from", type=float, default=0.0, help="fraction of the target's steps after which the "
                   "simulated roundings are on (0: throughout)")
    t.add_argument("--device", default="cpu")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--stop-after", type=float, default=None, help="stop cleanly after this many seconds of this "
                   "call (state saved, exit 75): the same command continues; for machines lent in short calls")
    t.add_argument("--init", default=None, help="start from this official-format checkpoint's target and draft "
                   "(the target's own phase is skipped)")
    t.add_argument("--ul-steps", type=int, default=0, help="unlikelihood steps after the target's (0: none)")
    t.add_argument("--ul-budget", type=float, default=None, help="seconds of unlikelihood steps, as --budget")
    c = sub.add_parser("check", help="gate checks + oracle load of an archive; optional held-out bits per byte")
    c.add_argument("archive")
    c.add_argument("--windows", type=int, default=0, help="held-out windows to score (trained_bed's default 8)")
    c.add_argument("--window-len", type=int, default=3000)
    c.add_argument("--device", default="cpu")
    u = sub.add_parser("unpack", help="unpack an archive (default: the committed one) into a folder")
    u.add_argument("dir")
    u.add_argument("--archive", default=None)
    u.add_argument("--as-trained", action="store_true", help="the trained shape (16 heads) instead of the served "
                   "one (64, what native SGLang runs at TP1)")
    k = sub.add_parser("corpus", help="save this machine's training and held-out files as one file (`tiny --corpus`)")
    k.add_argument("out")
    p = sub.add_parser("prompts", help="held-out text prompts as a JSON list of id lists (engine_bed --prompts)")
    p.add_argument("out")
    p.add_argument("--lengths", default="20,300,1984,3000")
    s = sub.add_parser("score", help="score trained_bed records against the reference oracle")
    s.add_argument("--ckpt", required=True)
    s.add_argument("--record", action="append", default=[], metavar="NAME=FILE", help="a plain record per path")
    s.add_argument("--dspark", action="append", default=[], metavar="NAME=FILE",
                   help="the same path's DSPARK record")
    s.add_argument("--device", default="cpu")
    s.add_argument("--no-long-reference", action="store_true", help="skip the reference's own long decode")
    s.add_argument("--json-out")
    d = sub.add_parser("accept", help="the reference-side estimate of DSPARK's greedy acceptance (CPU or GPU)")
    d.add_argument("--ckpt", required=True)
    d.add_argument("--prompts", type=int, default=4, help="held-out prompts of --prompt-len ids")
    d.add_argument("--prompt-len", type=int, default=256)
    d.add_argument("--new", type=int, default=64, help="decode positions per prompt")
    d.add_argument("--device", default="cpu")
    r = sub.add_parser("record", help="the record's held-out figures: windows (bits per byte, gzip, xz), greedy "
                       "continuations and their degeneracy check, the draft's acceptance")
    r.add_argument("--ckpt", required=True)
    r.add_argument("--parts", default="windows,foreign,greedy,acceptance")
    r.add_argument("--corpus", default=None, help="the held-out text of a saved corpus instead of this machine's")
    r.add_argument("--windows", type=int, default=8)
    r.add_argument("--window-len", type=int, default=3000)
    r.add_argument("--device", default="cpu")
    r.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    if a.cmd == "record":
        import json

        from .record import measure

        out = measure(a.ckpt, a.device, tuple(a.parts.split(",")), a.corpus, a.windows, a.window_len)
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
        return 0
    if a.cmd == "accept":
        import json

        from dsv4_lab.oracle.load import load_reference

        from .data import held_out_prompts
        from .draft import load_draft
        from .score import draft_acceptance

        model = load_reference(a.ckpt, a.device)
        draft = load_draft(a.ckpt).to(a.device)
        out = draft_acceptance(model, draft, held_out_prompts([a.prompt_len] * a.prompts), a.new, a.device)
        print(f"draft acceptance (reference-side estimate): {json.dumps(out)}")
        return 0
    if a.cmd == "unpack":
        import os

        from . import TRAINED_ARCHIVE
        from .check import unpack

        os.makedirs(a.dir, exist_ok=True)
        print(unpack(a.archive or TRAINED_ARCHIVE, a.dir, served=not a.as_trained))
        return 0
    if a.cmd == "corpus":
        from .data import save_corpus

        print(save_corpus(a.out))
        return 0
    if a.cmd == "prompts":
        import json

        from .data import held_out_prompts

        with open(a.out, "w") as f:
            json.dump(held_out_prompts([int(x) for x in a.lengths.split(",")]), f)
        return 0
    if a.cmd == "score":
        import json

        from dsv4_lab.oracle.__main__ import named

        from .score import score

        out = score(a.ckpt, dict(named(a.record, "train score")), dict(named(a.dspark, "train score")), a.device,
                    not a.no_long_reference)
        if a.json_out:
            with open(a.json_out, "w") as f:
                json.dump(out, f, indent=1)
        return 0
    if a.cmd == "tiny":
        import os

        from .train import Stopped, run

        os.makedirs(a.out, exist_ok=True)
        try:
            run(a.out, preset=a.preset, steps=a.steps, draft_steps=a.draft_steps, seq=a.seq, device=a.device,
                seed=a.seed, short=a.short, short_batch=a.batch, long_every=a.long_every, long_batch=a.long_batch,
                corpus=a.corpus, budget_s=a.budget, draft_budget_s=a.draft_budget, qat_from=a.qat_from,
                command="python -m dsv4_lab.train " + " ".join(sys.argv[1:] if argv is None else argv),
                stop_after_s=a.stop_after, init=a.init, ul_steps=a.ul_steps, ul_budget_s=a.ul_budget)
        except Stopped as e:
            print(f"dsv4-lab train: stopped at {e} after --stop-after {a.stop_after:.0f} s, state saved in "
                  f"{os.path.join(a.out, 'state.pt')}; run the same command again to continue")
            return 75
        return 0
    from .check import check

    return check(a.archive, a.windows, a.window_len, a.device)


if __name__ == "__main__":
    sys.exit(main())
