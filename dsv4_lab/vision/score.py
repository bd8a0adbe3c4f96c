"""Score trained-Vision-Exp serving records (`dsv4_lab/beds/vision_trained.py`) against the vision oracle: answer
accuracy per question kind, and the accuracy rule (`dsv4_lab.oracle.metrics`: KL and confident top-1 agreement
against R_q, the path against native) on the teacher-forced answer positions; each mutant is caught when it fails
the rule or drops the accuracy of a question kind it can affect by more than 10 points.

    python -m dsv4_lab.vision score --ckpt TRAINED_DIR --record native=vision-native.json \\
        --record sm80=vision-sm80.json [--record chunked=vision-chunked.json] --json-out vision-trained.json
"""

from __future__ import annotations

import torch

from dsv4_lab.oracle import metrics

from . import data
from .image import Geometry

TOP = 20
AFFECTS = {"image_patches_transposed": ("split", "shape"), "image_window_one_short": ("split", "shape", "two"),
           "bias_vl_on_text_rows": data.KINDS}
ACCURACY_DROP = 0.10
NAMES = {"colour": "color"}  # the record's field names (color_accuracy)


@torch.no_grad()
def oracle_teacher(model, tower, examples, device: str = "cpu") -> dict:
    """The oracle's record (R_q) at each example's answer positions, in the serving record's shape."""
    from .train import encode_example, rq_logits

    g = Geometry.from_config(model.config)
    out = []
    for ex in examples:
        ids, labels, rows, spans = encode_example(ex, tower, g, device)
        a = next(i for i, x in enumerate(labels) if x != -100)
        lp = torch.log_softmax(rq_logits(model, ids, rows, spans).float(), -1)
        entry = {"sequence": ids[a - 1:], "input_logprobs": [None], "top": [[]]}
        for pos in range(a - 1, len(ids) - 1):
            v, i = lp[pos].topk(TOP)
            entry["top"].append([[int(x), float(y)] for x, y in zip(i, v)])
            entry["input_logprobs"].append(float(lp[pos, ids[pos + 1]]))
        out.append(entry)
    return {"teacher": out}


def _rule(ref, path, native) -> dict:
    p = metrics.compare_records(ref, path)["pooled"]
    n = metrics.compare_records(ref, native)["pooled"]
    return {"path": p, "native": n, "verdict": metrics.verdict(p, n)}


def score(ckpt: str, records: dict, device: str = "cpu") -> dict:
    """records: {name: serving record}; one must be `native`."""
    from .load import load_vl_reference

    if "native" not in records:
        raise ValueError("vision score: a record named native is needed (the rule judges a path against it)")
    per_kind = {r["per_kind"] for r in records.values()}
    if len(per_kind) != 1:
        raise ValueError(f"vision score: records asked different question sets (per_kind {sorted(per_kind)})")
    examples = data.held_out(per_kind.pop())
    model, tower = load_vl_reference(ckpt, device)
    ref = oracle_teacher(model, tower, examples, device)
    native = records["native"]
    out = {"examples": len(examples), "paths": {}, "mutants": {}}
    for name, rec in records.items():
        row = {f"{NAMES.get(k, k)}_accuracy": v for k, v in rec["accuracy"].items()}
        row["rule"] = _rule(ref, rec, native)
        out["paths"][name] = row
        for m, mrec in (rec.get("mutants") or {}).items():
            kinds = AFFECTS.get(m, data.KINDS)
            drop = {k: rec["accuracy"][k] - mrec["accuracy"][k] for k in kinds}
            rule = _rule(ref, mrec, native)
            out["mutants"][m] = {"on": name, "accuracy": mrec["accuracy"], "drop": drop, "rule": rule,
                                 "caught": (not rule["verdict"]["passes"]) or max(drop.values()) > ACCURACY_DROP}
    return out
