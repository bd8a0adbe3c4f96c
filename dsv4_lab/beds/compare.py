"""Compare two engine_bed.py records position by position (teacher-forced logprobs).

    python -m dsv4_lab.beds.compare native.json other.json [--margin 0.5]

Metrics per sequence (the measure "same output as native" is judged by, see ../shared/device/README.md):
- mean / max KL(a || b) per position over the union of the two top-k lists; a token missing from one
  list gets that list's smallest listed logprob (an upper bound), then both are renormalised on the union;
- top-1 disagreement over all positions, and over confident positions (a's top-1/top-2 margin > --margin);
- max |delta logprob| of the input token.
The records must hold the same sequences (run the second with --teacher-from the first).

With --floor NATIVE2 (a second native run on the same sequences: another process, machine or batch
composition; repeatable, the widest per sequence counts), the native path's own noise is measured the same
way and printed beside each figure, and
the confident-position margin is calibrated on it: the smallest margin (nats, top-1 minus top-2 of the
first record) at which the two native runs agree on at least --agree (99 %) of the top-1s, over at least
--min-positions positions. The other record's top-1 agreement is then reported at that margin.

    python -m dsv4_lab.beds.compare native.json patched.json --floor native2.json
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


def _margins_and_agreement(a: dict, b: dict):
    """Per position of every sequence: (a's top-1/top-2 margin, a and b agree on the top-1)."""
    out = []
    for x, y in zip(a["teacher"], b["teacher"]):
        if x["sequence"] != y["sequence"]:
            raise ValueError("the records hold different sequences: run the second with --teacher-from the first")
        for ta, tb in zip(x["top"], y["top"]):
            if len(ta) > 1 and tb:
                out.append((ta[0][1] - ta[1][1], ta[0][0] == tb[0][0]))
    return out


def calibrate_margin(a: dict, floor, agree: float = 0.99, min_positions: int = 20):
    """The smallest margin at which `a` and `floor` (two runs of the same path; or a list of such runs,
    their positions pooled) agree on >= `agree` of the top-1s at positions whose margin exceeds it, with
    at least `min_positions` such positions. Returns (margin, agreement, positions), or None when no
    margin qualifies."""
    floors = floor if isinstance(floor, list) else [floor]
    pts = sorted((p for f in floors for p in _margins_and_agreement(a, f)), reverse=True)  # largest margin first
    best, agreeing = None, 0
    for i, (m, same) in enumerate(pts):
        agreeing += same
        n = i + 1
        last_of_tie = i + 1 == len(pts) or pts[i + 1][0] < m
        if last_of_tie and n >= min_positions and agreeing / n >= agree:
            nxt = pts[i + 1][0] if i + 1 < len(pts) else 0.0
            best = (nxt, agreeing / n, n)  # positions with margin > nxt are exactly these n
    return best


def floor_rows(a: dict, floors: list, margin: float) -> list[dict]:
    """Per sequence, the widest of several floors (each a run of a's path on the same sequences: another
    batch composition, another machine): every metric at its maximum over them."""
    rows = [compare(a, f, margin) for f in floors]
    return [{k: (max(r[k] for r in per_seq) if isinstance(per_seq[0][k], float) else per_seq[0][k])
             for k in per_seq[0]} for per_seq in zip(*rows)]


def agreement_above(a: dict, b, margin: float):
    """(top-1 agreement, positions) of a with b (a record, or a list of them, their positions pooled) where
    a's margin exceeds `margin`."""
    pts = [same for r in (b if isinstance(b, list) else [b]) for m, same in _margins_and_agreement(a, r) if m > margin]
    return (sum(pts) / len(pts) if pts else float("nan")), len(pts)


def agreement_curve(a: dict, b: dict, floors: list, margins) -> list[tuple]:
    """(margin, floor agreement, floor positions, b's agreement, b's positions) at each margin: whether b's
    shortfall at the calibrated margin closes at larger ones (read beside the verdict, never instead of it)."""
    return [(m, *agreement_above(a, floors, m), *agreement_above(a, b, m)) for m in margins]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--margin", type=float, default=0.5)
    ap.add_argument("--floor", action="append",
                    help="a second run of a's path on the same sequences: the noise floor; repeat it for several "
                         "(another batch composition, another machine): the widest counts, per sequence")
    ap.add_argument("--agree", type=float, default=0.99)
    ap.add_argument("--min-positions", type=int, default=20)
    args = ap.parse_args(argv)
    a, b = json.load(open(args.a)), json.load(open(args.b))
    if args.floor:
        fl = [json.load(open(p)) for p in args.floor]
        cal = calibrate_margin(a, fl, args.agree, args.min_positions)
        if cal is None:
            print(f"floor: no margin gives {100 * args.agree:.0f}% native-vs-native top-1 agreement over "
                  f">= {args.min_positions} positions")
        else:
            m, agree_floor, n_floor = cal
            agree_b, n_b = agreement_above(a, b, m)
            print(f"confident positions: margin > {m:.3f} nats (native vs native agree {100 * agree_floor:.2f}% "
                  f"of {n_floor}); this record agrees {100 * agree_b:.2f}% of {n_b}")
            for mm, af, nf, ab, nb in agreement_curve(a, b, fl, [x for x in (1.0, 1.5, 2.0, 3.0) if x > m]):
                print(f"  at margin > {mm:.1f}: native vs native {100 * af:.2f}% of {nf}; this record "
                      f"{100 * ab:.2f}% of {nb}")
        ratios = []
        for r, f in zip(compare(a, b, args.margin), floor_rows(a, fl, args.margin)):
            ratios.append(r["kl_mean"] / f["kl_mean"] if f["kl_mean"] > 0 else float("inf") if r["kl_mean"] else 1.0)
            print(f"seq {r['length']:5d}: KL mean {r['kl_mean']:.4f} (floor {f['kl_mean']:.4f}) max {r['kl_max']:.4f} "
                  f"(floor {f['kl_max']:.4f}); top-1 disagree {100 * r['top1_disagree']:.1f}% (floor "
                  f"{100 * f['top1_disagree']:.1f}%); max |dlogprob| {r['max_abs_dlogprob']:.3f} (floor "
                  f"{f['max_abs_dlogprob']:.3f})")
        within = sum(x <= 1.0 for x in ratios)
        agree_ok = cal is not None and agree_b >= args.agree
        print(f"verdict: KL mean within the floor on {within} of {len(ratios)} sequences (ratio to the floor "
              f"{min(ratios, default=0):.1f}-{max(ratios, default=0):.1f}); confident agreement "
              f"{'%.2f%%' % (100 * agree_b) if cal else 'n/a'} (needs {100 * args.agree:.0f}%) -> "
              f"{'within the floor' if within == len(ratios) and agree_ok else 'NOT within the floor'}")
    for r in compare(a, b, args.margin):
        print(f"seq {r['length']:5d}: KL mean {r['kl_mean']:.4f} max {r['kl_max']:.4f} nats; top-1 disagree "
              f"{100 * r['top1_disagree']:.1f}% ({100 * r['confident_disagree']:.1f}% of {r['confident_positions']} "
              f"positions with margin > {args.margin}); max |dlogprob| {r['max_abs_dlogprob']:.3f}")
    for pa, pb in zip(a["prompts"], b["prompts"]):
        ia, ib = pa["batched"]["output_ids"], pb["batched"]["output_ids"]
        same = sum(x == y for x, y in zip(ia, ib))
        # decode-path logprobs where the two generations still share their prefix (CUDA graphs vs eager)
        k = next((i for i, (x, y) in enumerate(zip(ia, ib)) if x != y), min(len(ia), len(ib)))
        dlp = max((abs(x - y) for x, y in zip(pa["batched"]["logprobs"][:k], pb["batched"]["logprobs"][:k])),
                  default=0.0)
        spec = pb.get("spec") or {}
        acc = (" ; " + ", ".join(f"{k} {v}" for k, v in sorted(spec.items()))) if spec else ""
        print(f"prompt {pa['length']:5d}: greedy tokens agree {same}/{len(ia)}; first {k} identical, "
              f"max |dlogprob| over them {dlp:.2e}{acc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
