"""Compare two engine_bed.py records position by position (teacher-forced logprobs).

    python tests/gpu/compare.py native.json other.json [--margin 0.5]

Metrics per sequence (the measure "same output as native" is judged by, see ../shared/device/README.md):
- mean / max KL(a || b) per position over the union of the two top-k lists; a token missing from one
  list gets that list's smallest listed logprob (an upper bound), then both are renormalised on the union;
- top-1 disagreement over all positions, and over confident positions (a's top-1/top-2 margin > --margin);
- max |delta logprob| of the input token.
The records must hold the same sequences (run the second with --teacher-from the first).
"""

from __future__ import annotations

import argparse
import json
import math
import sys


def _union_kl(ta, tb) -> float:
    da, db = dict(map(tuple, ta)), dict(map(tuple, tb))
    floor_a, floor_b = min(da.values()), min(db.values())
    union = sorted(set(da) | set(db))
    la = [da.get(t, floor_a) for t in union]
    lb = [db.get(t, floor_b) for t in union]
    za, zb = math.log(sum(math.exp(x) for x in la)), math.log(sum(math.exp(x) for x in lb))
    return sum(math.exp(x - za) * ((x - za) - (y - zb)) for x, y in zip(la, lb))


def compare_sequence(a: dict, b: dict, margin: float) -> dict:
    if a["sequence"] != b["sequence"]:
        raise ValueError("the records hold different sequences: run the second with --teacher-from the first")
    kls, top1_diff, confident, confident_diff, dlp = [], 0, 0, 0, 0.0
    for ta, tb, la, lb in zip(a["top"], b["top"], a["input_logprobs"], b["input_logprobs"]):
        if la is not None and lb is not None:
            dlp = max(dlp, abs(la - lb))
        if not ta or not tb:
            continue
        kls.append(_union_kl(ta, tb))
        differ = ta[0][0] != tb[0][0]
        top1_diff += differ
        if len(ta) > 1 and ta[0][1] - ta[1][1] > margin:
            confident += 1
            confident_diff += differ
    n = len(kls)
    return {"length": len(a["sequence"]), "positions": n, "kl_mean": sum(kls) / n, "kl_max": max(kls),
            "top1_disagree": top1_diff / n, "confident_positions": confident,
            "confident_disagree": confident_diff / confident if confident else 0.0, "max_abs_dlogprob": dlp}


def compare(a: dict, b: dict, margin: float = 0.5) -> list[dict]:
    return [compare_sequence(x, y, margin) for x, y in zip(a["teacher"], b["teacher"])]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--margin", type=float, default=0.5)
    args = ap.parse_args(argv)
    a, b = json.load(open(args.a)), json.load(open(args.b))
    for r in compare(a, b, args.margin):
        print(f"seq {r['length']:5d}: KL mean {r['kl_mean']:.4f} max {r['kl_max']:.4f} nats; top-1 disagree "
              f"{100 * r['top1_disagree']:.1f}% ({100 * r['confident_disagree']:.1f}% of {r['confident_positions']} "
              f"positions with margin > {args.margin}); max |dlogprob| {r['max_abs_dlogprob']:.3f}")
    for pa, pb in zip(a["prompts"], b["prompts"]):
        same = sum(x == y for x, y in zip(pa["batched"]["output_ids"], pb["batched"]["output_ids"]))
        print(f"prompt {pa['length']:5d}: greedy tokens agree {same}/{len(pa['batched']['output_ids'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
