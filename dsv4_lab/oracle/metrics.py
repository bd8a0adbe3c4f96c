"""Distance metrics between a reference record and a serving path's record, and the acceptance rule.

Pure functions over the records' lists (no model, no torch). A record's `teacher` entry holds, per position
i (position 0 empty, as SGLang's `input_*` log-probs): `input_logprobs[i]`, `top[i]` ([[id, logprob], ...],
best first) and, when both sides asked for the same ids, `ids` and `ids_logprobs[i]`.

KL(R || X) per position, by what the two records hold:
- `support` (both record log-probs of the same id list S): exact KL of the two distributions coarsened to
  S plus one bucket for everything else, sum_{v in S} R(v) log(R(v)/X(v)) + R(rest) log(R(rest)/X(rest)).
  By the log-sum inequality it never exceeds the full KL, and equals it when S holds the mass (the oracle's S
  is the sequence's 256 ids of most reference probability summed over positions; `oracle score` prints the
  mean reference mass inside S, and the whole vocabulary is S on small-vocabulary checkpoints).
- `union` (only top-k lists, as SGLang returns): both lists on the union of their ids, an id missing from a
  list given that list's smallest listed log-prob (an upper bound of its true value), then each side
  renormalised on the union; the approximation dsv4_lab/beds/compare.py uses. When both lists hold the whole
  vocabulary this is the exact full-vocabulary KL.

Top-1 agreement is counted where R's top-1/top-2 margin exceeds a threshold (0.5, 1, 2 nats): where the
reference itself is nearly tied, a flipped top-1 says nothing. dNLL is the mean over positions of
NLL_X(actual token) - NLL_R(actual token).
"""

from __future__ import annotations

import math

MARGINS = (0.5, 1.0, 2.0)

# The acceptance rule, fixed before any measurement: a path passes against a reference when its mean KL is at
# most KL_RATIO_MAX times native SGLang's, and its top-1 agreement where the reference's margin exceeds
# RULE_MARGIN nats is at most AGREE_DROP_MAX_POINTS percentage points below native's.
KL_RATIO_MAX = 1.1
AGREE_DROP_MAX_POINTS = 0.3
RULE_MARGIN = 1.0
REST_FLOOR = 1e-12  # a coarsened bucket below this mass counts as empty


# --- per position -----------------------------------------------------------------------------------------


def kl_full(ref_logprobs, path_logprobs) -> float:
    """KL(R || X) for two full log-probability vectors over the same ids."""
    return sum(math.exp(r) * (r - x) for r, x in zip(ref_logprobs, path_logprobs) if r > -math.inf)


def kl_support(ref_logprobs, path_logprobs) -> float:
    """KL(R || X) on a shared id list plus one bucket for the rest of each distribution."""
    kl = kl_full(ref_logprobs, path_logprobs)
    r_rest = 1.0 - sum(math.exp(r) for r in ref_logprobs)
    if r_rest > REST_FLOOR:
        x_rest = max(1.0 - sum(math.exp(x) for x in path_logprobs), REST_FLOOR)
        kl += r_rest * (math.log(r_rest) - math.log(x_rest))
    return kl


def kl_union(ref_top, path_top) -> float:
    """KL(R || X) on the union of two top-k lists ([[id, logprob], ...]), missing ids at their list's floor,
    both renormalised on the union."""
    dr, dx = {int(i): v for i, v in ref_top}, {int(i): v for i, v in path_top}
    floor_r, floor_x = min(dr.values()), min(dx.values())
    union = sorted(set(dr) | set(dx))
    lr = [dr.get(t, floor_r) for t in union]
    lx = [dx.get(t, floor_x) for t in union]
    zr, zx = _logsumexp(lr), _logsumexp(lx)
    return sum(math.exp(r - zr) * ((r - zr) - (x - zx)) for r, x in zip(lr, lx))


def _logsumexp(xs) -> float:
    m = max(xs)
    return m + math.log(sum(math.exp(x - m) for x in xs))


def margin(top) -> float:
    """Top-1 minus top-2 log-prob of a top list (inf when it holds one id)."""
    return top[0][1] - top[1][1] if len(top) > 1 else math.inf


# --- per sequence -----------------------------------------------------------------------------------------


def kl_method(ref: dict, path: dict) -> str:
    if ref.get("ids") is not None and path.get("ids") is not None and list(ref["ids"]) == list(path["ids"]):
        return "support"
    return "union"


def sequence_metrics(ref: dict, path: dict, margins=MARGINS, only: dict | None = None) -> dict:
    """Per-position lists and their sums for one sequence (the pooled figures add these up); with `only`
    (another record's entry for the sequence), just the positions that record holds."""
    if list(ref["sequence"]) != list(path["sequence"]):
        raise ValueError("oracle metrics: the two records hold different sequences; run the engine bed with "
                         "--teacher-from the record the reference was scored on")
    method = kl_method(ref, path)
    kls, dnll = [], []
    agree = {m: [0, 0] for m in margins}
    for i, (rt, xt) in enumerate(zip(ref["top"], path["top"])):
        if not rt or not xt or (only is not None and not only["top"][i]):
            continue
        if method == "support":
            kls.append(kl_support(ref["ids_logprobs"][i], path["ids_logprobs"][i]))
        else:
            kls.append(kl_union(rt, xt))
        same = int(rt[0][0]) == int(xt[0][0])
        m = margin(rt)
        for t in margins:
            if m > t:
                agree[t][0] += same
                agree[t][1] += 1
        lr, lx = ref["input_logprobs"][i], path["input_logprobs"][i]
        if lr is not None and lx is not None:
            dnll.append(lr - lx)
    return {"length": len(ref["sequence"]), "kl_method": method, "positions": len(kls),
            "kl_sum": sum(kls), "kl_max": max(kls, default=0.0), "dnll_sum": sum(dnll), "dnll_n": len(dnll),
            "agree": {str(t): a for t, a in agree.items()}}


def summarize(rows: list[dict]) -> dict:
    """A sequence's (or, given several, the pooled) figures: kl_mean, kl_max, top-1 agreement in % at each
    margin with its position count, dnll."""
    n = sum(r["positions"] for r in rows)
    out = {"positions": n, "kl_mean": sum(r["kl_sum"] for r in rows) / n if n else math.nan,
           "kl_max": max((r["kl_max"] for r in rows), default=math.nan),
           "dnll": (sum(r["dnll_sum"] for r in rows) / sum(r["dnll_n"] for r in rows)
                    if sum(r["dnll_n"] for r in rows) else math.nan),
           "kl_method": sorted({r["kl_method"] for r in rows})}
    for t in rows[0]["agree"] if rows else ():
        same, cnt = sum(r["agree"][t][0] for r in rows), sum(r["agree"][t][1] for r in rows)
        out[f"top1_at_{_label(t)}"] = 100.0 * same / cnt if cnt else math.nan
        out[f"positions_at_{_label(t)}"] = cnt
    return out


def _label(t: str) -> str:
    return f"{float(t):g}nat".replace(".", "p")


def compare_records(ref: dict, path: dict, margins=MARGINS, only: dict | None = None) -> dict:
    """{"sequences": [summary per sequence], "pooled": summary over all positions} of a path's record
    against a reference record (both with `teacher` lists over the same sequences); with `only` (a third
    record), over the positions that record holds (native measured where a --prefix-hit path is)."""
    for other in (path, only):
        if other is not None and len(ref["teacher"]) != len(other["teacher"]):
            raise ValueError(f"oracle metrics: the reference holds {len(ref['teacher'])} sequences, a path "
                             f"{len(other['teacher'])}; both must be scored on the same teacher sequences")
    masks = only["teacher"] if only is not None else [None] * len(ref["teacher"])
    rows = [sequence_metrics(r, x, margins, m) for r, x, m in zip(ref["teacher"], path["teacher"], masks)]
    return {"sequences": [dict(summarize([r]), length=r["length"]) for r in rows], "pooled": summarize(rows)}


# --- hidden states and discrete choices ------------------------------------------------------------------


def relative_error(ref, other) -> float:
    """||ref - other|| / ||ref|| of two equally long flat sequences of numbers."""
    num = math.fsum((a - b) ** 2 for a, b in zip(ref, other))
    den = math.fsum(a * a for a in ref)
    return math.sqrt(num / den) if den else (0.0 if num == 0 else math.inf)


def per_layer_relative_error(ref_layers: dict, other_layers: dict) -> dict:
    """{layer: relative_error} of two {layer: flat values} maps (hidden states of one sequence)."""
    return {layer: relative_error(ref_layers[layer], other_layers[layer]) for layer in ref_layers}


def near_tie_disagreements(ref: dict, path: dict, margin_nats: float = RULE_MARGIN, tie_gap: float = 1e-3) -> dict:
    """Confident top-1 disagreements (R's margin > margin_nats) split by whether the reference itself was
    near a discrete tie at that position (a routed-expert or indexer selection gap below tie_gap in some
    layer): a flip of a near-tied choice, not an arithmetic error, can explain those."""
    gaps = [v for kind in ("expert_gap", "indexer_gap") for v in (ref.get("choices") or {}).get(kind, {}).values()]
    tied, other = 0, 0
    for i, (rt, xt) in enumerate(zip(ref["top"], path["top"])):
        if not rt or not xt or margin(rt) <= margin_nats or int(rt[0][0]) == int(xt[0][0]):
            continue
        # the recorded gaps are per position of the forward, which predicts token i from position i - 1
        near = any(g[i - 1] is not None and g[i - 1] < tie_gap for g in gaps if i - 1 < len(g))
        tied += near
        other += not near
    return {"near_tie": tied, "other": other}


# --- the acceptance rule ----------------------------------------------------------------------------------


def verdict(path: dict, native: dict) -> dict:
    """The acceptance rule on two pooled summaries against the same reference."""
    key = f"top1_at_{_label(str(RULE_MARGIN))}"
    kl_limit = KL_RATIO_MAX * native["kl_mean"]
    agree_limit = native[key] - AGREE_DROP_MAX_POINTS
    kl_ok = path["kl_mean"] <= kl_limit
    reasons = []
    if math.isnan(native[key]):
        # no reference position is that confident: the agreement half cannot be judged, only KL is
        agree_ok = True
        reasons.append(f"top-1 agreement not judged: no position with a reference margin above {RULE_MARGIN:g} nat")
    else:
        agree_ok = not math.isnan(path[key]) and path[key] >= agree_limit
    if not kl_ok:
        reasons.insert(0, f"KL mean {path['kl_mean']:.4g} > {KL_RATIO_MAX} x native's {native['kl_mean']:.4g}")
    if not agree_ok:
        reasons.insert(0, f"top-1 agreement at {RULE_MARGIN:g} nat {path[key]:.2f}% < native's "
                       f"{native[key]:.2f}% - {AGREE_DROP_MAX_POINTS}")
    if native["kl_mean"]:
        ratio = path["kl_mean"] / native["kl_mean"]
    else:
        ratio = 1.0 if path["kl_mean"] == 0 else math.inf
    return {"passes": kl_ok and agree_ok, "kl_ratio": ratio,
            "agree_drop_points": native[key] - path[key], "agreement_judged": not math.isnan(native[key]),
            "reasons": reasons}


def caught(mutant: dict, native: dict) -> bool:
    """A fault-injection mutant is caught when it fails the acceptance rule."""
    return not verdict(mutant, native)["passes"]
