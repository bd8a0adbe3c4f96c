"""Score trained-checkpoint records (`dsv4_lab/beds/trained_bed.py`) against the reference oracle.

Per path (one record, plus its DSPARK twin when given):
- bits_per_byte: held-out windows teacher-forced, byte targets only (`data.sequence_nll`'s rule);
- greedy_match_mean: mean over prompts of the length of the common prefix of the path's greedy continuation and
  the reference's (R_q, decoded by full forwards);
- long_decode_nll: the reference's (R_q) mean NLL of the path's long decode, per segment of `SEGMENT` ids, and its
  drift (last segment's mean less the first's), at each temperature;
- dspark_accept_len: mean accepted ids per verify step over the greedy prompts (SGLang's spec_accept_length);
- dspark_speedup: batch-1 decode ids/s with DSPARK over without, same path;
- dspark_greedy_identical: the DSPARK record's greedy continuations equal the plain record's.
The references get the same figures where they apply (bits per byte under R_q and R_x; the reference's own long
greedy decode's NLL drift)."""

from __future__ import annotations

import json
import math

import torch

from . import data

SEGMENT = 500


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def record_bpb(windows: list[dict]) -> float:
    """Bits per byte from SGLang's teacher-forced log-probs: entry i is log p(ids[i] | ids[:i]) (entry 0, no
    prediction, is None); BOS and special-token targets are left out as in `data.sequence_nll`."""
    nll, n = 0.0, 0
    for w in windows:
        for tok, lp in zip(w["ids"][1:], w["logprobs"][1:]):
            if tok >= data.BYTE_BASE:
                nll, n = nll - lp, n + 1
    return data.bits_per_byte(nll, n)


def segments(nll: list[float], size: int = SEGMENT) -> list[float]:
    return [sum(nll[i:i + size]) / len(nll[i:i + size]) for i in range(0, len(nll), size)]


@torch.no_grad()
def token_nll(model, prompt: list[int], generated: list[int], device: str) -> list[float]:
    """The model's NLL of each generated id after prompt + the ids before it (one teacher-forced forward)."""
    ids = torch.tensor(prompt + generated, device=device)[None]
    logp = torch.log_softmax(model(input_ids=ids).logits[0].double(), dim=-1)
    pos = torch.arange(len(prompt) - 1, len(prompt) + len(generated) - 1, device=device)
    return (-logp[pos, ids[0, len(prompt):]]).tolist()


@torch.no_grad()
def greedy(model, prompts: list[list[int]], new: int, device: str) -> list[list[int]]:
    """Greedy continuations by full forwards (no cache: the reference's exact prefill at every step); prompts of
    one length run as one batch."""
    out = [None] * len(prompts)
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(i)
    for idx in by_len.values():
        ids = torch.tensor([prompts[i] for i in idx], device=device)
        for _ in range(new):
            nxt = model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
        for row, i in enumerate(idx):
            out[i] = ids[row, len(prompts[i]):].tolist()
    return out


def reference_bpb(model, windows: list[list[int]], device: str) -> float:
    nll, n = 0.0, 0
    with torch.no_grad():
        for w in windows:
            a, b = data.sequence_nll(model(input_ids=torch.tensor(w, device=device)[None]).logits[0].float().cpu(),
                                     torch.tensor(w))
            nll, n = nll + a, n + b
    return data.bits_per_byte(nll, n)


def reference_bpbs(model, windows: list[list[int]], device: str) -> dict:
    """{"R_x": bits per byte, "R_q": bits per byte} of the reference on the windows."""
    from dsv4_lab.oracle.numerics import NUMERICS, applied

    out = {}
    for numerics in ("R_x", "R_q"):
        with applied(model, NUMERICS[numerics]):
            out[numerics] = reference_bpb(model, windows, device)
    return out


def score(ckpt: str, records: dict[str, str], spec_records: dict[str, str], device: str = "cpu",
          long_reference: bool = True, log=print) -> dict:
    from dsv4_lab.oracle.load import load_reference
    from dsv4_lab.oracle.numerics import NUMERICS, applied

    recs = {k: json.load(open(v)) for k, v in records.items()}
    specs = {k: json.load(open(v)) for k, v in spec_records.items()}
    first = next(iter(recs.values()))
    windows = [w["ids"] for w in first["windows"]]
    g_prompts = [g["prompt"] for g in first["greedy"]]
    g_new = len(first["greedy"][0]["output_ids"])
    for name, r in recs.items():
        if [w["ids"] for w in r["windows"]] != windows or [g["prompt"] for g in r["greedy"]] != g_prompts:
            raise ValueError(f"trained score: record {name} holds other prompts than {next(iter(recs))}; expected "
                             "records of one machine (the prompts are its Python library's held-out text)")
    model = load_reference(ckpt, device)
    out: dict = {"reference": {}, "paths": {}}
    for numerics, bpb in reference_bpbs(model, windows, device).items():
        out["reference"][numerics] = {"bits_per_byte": bpb}
        log(f"reference {numerics}: bits per byte {bpb:.4f}")
    with applied(model, NUMERICS["R_q"]):
        ref_greedy = greedy(model, g_prompts, g_new, device)
        if long_reference:
            lp = first["long"][0]["prompt"]
            n_long = len(first["long"][0]["output_ids"])
            own = greedy(model, [lp], n_long, device)[0]
            seg = segments(token_nll(model, lp, own, device))
            out["reference"]["R_q"]["long_decode_nll"] = {"0.0": {"segments": seg, "drift": seg[-1] - seg[0]}}
        for name, r in recs.items():
            row = {"bits_per_byte": record_bpb(r["windows"]),
                   "greedy_match_mean": sum(common_prefix(g["output_ids"], ref) for g, ref in
                                            zip(r["greedy"], ref_greedy)) / len(ref_greedy),
                   "greedy_new": g_new, "long_decode_nll": {},
                   "batch1_decode_ids_per_s": r["speed"]["batch1_decode_ids_per_s"]}
            for lo in r["long"]:
                seg = segments(token_nll(model, lo["prompt"], lo["output_ids"], device))
                row["long_decode_nll"][str(lo["temperature"])] = {"segments": seg, "drift": seg[-1] - seg[0]}
            if name in specs:
                s = specs[name]
                acc = [g["spec"]["spec_accept_length"] for g in s["greedy"] if "spec_accept_length" in g["spec"]]
                row["dspark_accept_len"] = sum(acc) / len(acc) if acc else None
                row["dspark_speedup"] = s["speed"]["batch1_decode_ids_per_s"] / row["batch1_decode_ids_per_s"]
                row["dspark_greedy_identical"] = all(a["output_ids"] == b["output_ids"]
                                                     for a, b in zip(s["greedy"], r["greedy"]))
            out["paths"][name] = row
            log(f"{name}: " + ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                                        for k, v in row.items() if k != "long_decode_nll")
                + "; long-decode NLL drift " + ", ".join(f"T={t}: {v['drift']:+.3f}"
                                                         for t, v in row["long_decode_nll"].items()))
    for name, row in out["paths"].items():
        for k in ("bits_per_byte",):
            if not math.isfinite(row[k]):
                raise ValueError(f"trained score: {name} {k} is {row[k]}; expected a finite figure")
    return out


@torch.no_grad()
def draft_acceptance(model, draft, prompts: list[list[int]], new: int, device: str = "cpu", conts=None) -> dict:
    """A reference-side estimate of DSPARK's greedy acceptance (not an engine measurement): the target (R_q)
    continues each prompt greedily; at every decode position p after the prompt the draft's block (bonus id at p,
    then the mask id) predicts p+1..p+gamma, and the accept length there is 1 + the number of leading block
    positions whose argmax is the target's greedy id. Teacher-forcing the draft's Markov bias with the target's
    ids is exact up to the first miss, where counting stops anyway. Averaged over every position (a real
    decode visits one position per verify step). conts: the continuations to count against (new + gamma ids
    each), e.g. sampled ones, instead of the target's greedy ones; against a sampled continuation the count is
    the draft's top-1 agreement with it, a lower bound of what speculative sampling accepts."""
    from dsv4_lab.oracle.numerics import NUMERICS, applied

    from .draft import capture_features

    g = draft.gamma
    lengths, per_position = [], []
    if conts is None:
        with applied(model, NUMERICS["R_q"]):
            conts = greedy(model, prompts, new + g, device)
    for prompt, cont in zip(prompts, conts):
        cont = list(cont)[:new + g]
        ids = torch.tensor(prompt + cont, device=device)[None]
        with applied(model, NUMERICS["R_q"]):
            feats = capture_features(model, ids, draft.targets)
        pos = torch.arange(len(prompt), len(prompt) + new, device=device)
        anchors = torch.stack([torch.zeros_like(pos), pos], dim=1)
        with applied(model, NUMERICS["R_q"], layers=draft.stages, fp8_inputs=[draft.main_proj]):
            logits, _, labels = draft(model, ids, feats, anchors)
        hit = (logits.argmax(-1) == labels).long()
        lengths += (1 + hit.cumprod(dim=1).sum(dim=1)).tolist()
        per_position.append(hit.float().mean(dim=0))
    return {"accept_length_mean": sum(lengths) / len(lengths), "positions": len(lengths), "gamma": g,
            "block_top1": torch.stack(per_position).mean(dim=0).tolist()}
