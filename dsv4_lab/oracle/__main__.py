"""python -m dsv4_lab.oracle score|compare (see README.md beside this file)."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

from . import metrics

PRIMARY = "R_q"


def _load(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise SystemExit(f"oracle: cannot read record {path!r} ({e}); expected an engine_bed.py or "
                         "`oracle score` JSON record") from None


def _finite(obj):
    """NaN (no position to judge) and infinity (a ratio to a zero KL) as JSON null: strict readers refuse them."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _write(path: str, obj) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(_finite(obj), f, allow_nan=False)
    os.replace(path + ".tmp", path)


def cmd_score(args) -> int:
    import torch

    from .load import load_reference
    from .score import score

    record = _load(args.record)
    if isinstance(record, list):  # id lists (`python -m dsv4_lab.train prompts`): the sequences themselves
        seqs = [[int(x) for x in s] for s in record]
    else:
        seqs = [t["sequence"] for t in record.get("teacher") or []]
    if not seqs:
        raise SystemExit(f"oracle score: {args.record} holds no teacher sequences (`teacher[*].sequence`); "
                         "expected an engine_bed.py record made without --speculative-algorithm, or a JSON list "
                         "of id lists")
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    model = load_reference(args.ckpt, device)
    out = score(model, seqs, names=tuple(args.refs.split(",")), top=args.top, support_size=args.support_size,
                tensors_out=args.tensors_out, log=lambda m: print(m, file=sys.stderr))
    out.update(ckpt=os.path.abspath(args.ckpt), record=os.path.abspath(args.record), device=device,
               torch=torch.__version__, top=args.top, support_size=args.support_size)
    _write(args.out, out)
    if args.support_out:
        _write(args.support_out, out["support"])
    print(f"oracle score: {len(seqs)} sequences x {list(out['references'])} -> {args.out}")
    for name, ref in out["references"].items():
        print(f"  {name}: reference mass inside the support ids, mean per sequence "
              f"{[t['support_mass'] for t in ref['teacher']]}")
    names = list(out["references"])
    for name in names[1:]:
        pooled = metrics.compare_records(out["references"][names[0]], out["references"][name])["pooled"]
        print(f"  {name} against {names[0]}: mean KL {pooled['kl_mean']:.5f} (max {pooled['kl_max']:.5f}), top-1 "
              f"{pooled['top1_at_1nat']:.1f} % at {pooled['positions_at_1nat']} of {pooled['positions']} positions "
              f"above a 1-nat margin, dNLL {pooled['dnll']:+.5f}")
    for name, errs in out["hidden_rel_error"].items():
        for s_i, e in enumerate(errs):
            print(f"  {name} vs {args.refs.split(',')[0]} seq {s_i}: hidden rel. error per layer {e}; "
                  f"choice flips {out['choice_flips'][name][s_i]}")
    return 0


def named(items, command: str = "oracle compare") -> list[tuple[str, str]]:
    """NAME=FILE options as (name, file) pairs; anything else ends `command` with the reason."""
    out = []
    for item in items or []:
        name, sep, path = item.partition("=")
        if not sep:
            raise SystemExit(f"{command}: {item!r} is not NAME=FILE")
        out.append((name, path))
    return out


def _fmt(x, spec=".4f") -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def cmd_compare(args) -> int:
    ref_doc = _load(args.ref)
    refs = ref_doc["references"]
    native = _load(args.native)
    groups = {"path": named(args.path), "mutant": named(args.mutant), "control": named(args.control)}
    records = {name: _load(p) for g in groups.values() for name, p in g}
    rule = {"kl_ratio_max": metrics.KL_RATIO_MAX, "agree_drop_max_points": metrics.AGREE_DROP_MAX_POINTS,
            "rule_margin_nats": metrics.RULE_MARGIN, "primary_reference": PRIMARY}
    result = {"rule": rule, "references": {}}
    header = (f"{'path':24} {'ref':6} {'KL mean':>9} {'xnative':>8} {'top1>0.5':>9} {'top1>1':>8} {'top1>2':>8} "
              f"{'dNLL':>8}  verdict")
    print(header)
    print("-" * len(header))
    for ref_name in sorted(refs, key=lambda n: n != PRIMARY):
        ref = refs[ref_name]
        nat = metrics.compare_records(ref, native)
        entry = {"native": _row(nat, ref, native), "paths": {}, "mutants": {}, "controls": {}}
        _print(args.native_name, ref_name, nat["pooled"], None)
        for group, key in (("path", "paths"), ("mutant", "mutants"), ("control", "controls")):
            for name, _ in groups[group]:
                cmp = metrics.compare_records(ref, records[name])
                # native on the positions this record holds (all, or the second halves of a --prefix-hit run)
                bar = metrics.compare_records(ref, native, only=records[name])
                v = metrics.verdict(cmp["pooled"], bar["pooled"])
                row = _row(cmp, ref, records[name])
                row.update(passes=v["passes"], kl_ratio=v["kl_ratio"], agree_drop_points=v["agree_drop_points"],
                           reasons=v["reasons"])
                if group == "mutant":
                    row["caught"] = not v["passes"]
                entry[key][name] = row
                _print(f"{group[0]}:{name}", ref_name, cmp["pooled"], v, group)
        result["references"][ref_name] = entry
    if args.json_out:
        _write(args.json_out, result)
        print(f"oracle compare -> {args.json_out}")
    primary = result["references"].get(PRIMARY, {})
    bad = [n for n, r in primary.get("controls", {}).items() if not r["passes"]]
    missed = [n for n, r in primary.get("mutants", {}).items() if not r["caught"]]
    if bad:
        print(f"oracle compare: negative control(s) {bad} FAIL the rule against {PRIMARY}: the rule or the bed "
              "is too tight to trust its verdicts")
    if missed:
        print(f"oracle compare: mutant(s) {missed} NOT caught against {PRIMARY}")
    return 1 if bad or missed else 0


def _row(cmp: dict, ref: dict, path: dict) -> dict:
    p = cmp["pooled"]
    return {"kl_mean": p["kl_mean"], "kl_max": p["kl_max"], "kl_method": p["kl_method"],
            "top1_at_1nat": p["top1_at_1nat"], "top1_at_0p5nat": p["top1_at_0p5nat"],
            "top1_at_2nat": p["top1_at_2nat"], "positions_at_1nat": p["positions_at_1nat"], "dnll": p["dnll"],
            "sequences": cmp["sequences"],
            "near_tie": [metrics.near_tie_disagreements(r, x) for r, x in zip(ref["teacher"], path["teacher"])]}


def _print(name, ref_name, p, v, group="native"):
    if v is None:
        verdict = "(the bar)"
    elif group == "mutant":
        verdict = "caught" if not v["passes"] else "NOT caught"
    else:
        verdict = ("pass" if v["passes"] else "FAIL") + ("".join(f"; {r}" for r in v["reasons"]))
    ratio = "1.00" if v is None else _fmt(v["kl_ratio"], ".2f")
    agree = [_fmt(p[f"top1_at_{k}nat"], ".2f") for k in ("0p5", "1", "2")]
    print(f"{name[:24]:24} {ref_name:6} {_fmt(p['kl_mean'], '.5f'):>9} {ratio:>8} {agree[0]:>9} {agree[1]:>8} "
          f"{agree[2]:>8} {_fmt(p['dnll'], '.4f'):>8}  {verdict}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsv4_lab.oracle", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("score", help="reference log-probs for the teacher sequences of an engine-bed record")
    s.add_argument("--ckpt", required=True, help="the official-format checkpoint the engines served")
    s.add_argument("--record", required=True, help="an engine_bed.py record (its teacher[*].sequence), or a JSON "
                   "list of id lists (python -m dsv4_lab.train prompts)")
    s.add_argument("--out", required=True)
    s.add_argument("--refs", default="R_x,R_q", help="references to score (dsv4_lab.oracle.numerics.NUMERICS)")
    s.add_argument("--device", default="auto")
    s.add_argument("--top", type=int, default=20, help="top ids kept per position (0: the whole vocabulary)")
    s.add_argument("--support-size", type=int, default=256,
                   help="ids per sequence both sides record log-probs of (KL exact on them): the most probable "
                        "under the references, summed over positions")
    s.add_argument("--support-out", help="also write the support ids (for engine_bed.py --token-ids-logprob)")
    s.add_argument("--tensors-out", help="also save, per reference and sequence, every layer's output (fp16), the "
                   "routed experts and the indexer's choices (torch.save)")
    s.set_defaults(func=cmd_score)
    c = sub.add_parser("compare", help="reference record vs engine records -> table and JSON")
    c.add_argument("--ref", required=True, help="an `oracle score` output")
    c.add_argument("--native", required=True, help="native SGLang's record: the bar every path is held to")
    c.add_argument("--native-name", default="native")
    c.add_argument("--path", action="append", help="NAME=FILE, a serving path's record (repeatable)")
    c.add_argument("--mutant", action="append", help="NAME=FILE, a fault-injection run: must fail the rule")
    c.add_argument("--control", action="append", help="NAME=FILE, a negative control: must pass the rule")
    c.add_argument("--json-out")
    c.set_defaults(func=cmd_compare)
    args = ap.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
