"""Teacher-forced reference log-probabilities for token sequences, in the engine bed's record layout.

A reference record holds, per sequence, at every position i (the distribution that predicts token i, from
the prefix 0..i-1; position 0 has none, as in SGLang's `input_*` log-probs):
- `input_logprobs`: the log-probability of the actual token i;
- `top`: the `top` most likely ids as [[id, logprob], ...], best first (every id when top is 0);
- `ids_logprobs`: the log-probabilities of the sequence's support ids (`support[k]`, the same list the engine
  bed asks SGLang for with `--token-ids-logprob`), in that order, so KL is exact on that support;
and per layer the discrete choices (`ChoiceRecorder`). One forward per sequence, batch 1, from an empty cache.
"""

from __future__ import annotations

import math

import torch

from .numerics import NUMERICS, ChoiceRecorder, applied


def _r(x: float) -> float:
    return round(float(x), 6)


def forward_logprobs(model, sequence: list[int]):
    """(log-probs [S-1, V] fp32 on the model's device predicting tokens 1..S-1, the ChoiceRecorder)."""
    device = next(model.parameters()).device
    ids = torch.tensor([sequence], device=device)
    with torch.no_grad(), ChoiceRecorder(model) as rec:
        logits = model(input_ids=ids, use_cache=False).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1), rec


def sequence_record(sequence: list[int], logprobs: torch.Tensor, rec: ChoiceRecorder, top: int,
                    support: list[int] | None) -> dict:
    vocab = logprobs.shape[-1]
    k = vocab if top <= 0 else min(top, vocab)
    vals, idx = logprobs.topk(k, dim=-1)
    actual = logprobs.gather(1, torch.tensor(sequence[1:], device=logprobs.device)[:, None])[:, 0]
    out = {
        "sequence": list(sequence),
        "input_logprobs": [None] + [_r(x) for x in actual.tolist()],
        "top": [[]] + [[[int(i), _r(v)] for i, v in zip(ii, vv)] for ii, vv in zip(idx.tolist(), vals.tolist())],
        "choices": {
            "experts": {str(n): t.tolist() for n, t in rec.experts.items()},
            "expert_gap": {str(n): [_nan(x) for x in t.tolist()] for n, t in rec.expert_gap.items()},
            "indexer_gap": {str(n): [_nan(x) for x in t.tolist()] for n, t in rec.indexer_gap.items()},
        },
    }
    if support is not None:
        sup = logprobs[:, torch.tensor(support, device=logprobs.device)]
        out["ids"] = list(support)
        out["ids_logprobs"] = [None] + [[_r(v) for v in row] for row in sup.tolist()]
    return out


def _nan(x: float):
    return None if math.isnan(x) else _r(x)


def support_ids(logprobs_by_ref: list[torch.Tensor], size: int) -> list[int]:
    """The ids whose log-probabilities both sides record for exact KL on them: the `size` ids with the most
    reference probability summed over the sequence's positions and the references (one list per sequence:
    SGLang's token_ids_logprob takes one id list per request, and a record holds positions x ids values)."""
    mass = sum(lp.exp().sum(0) for lp in logprobs_by_ref)
    return sorted(mass.topk(min(size, mass.shape[0])).indices.tolist())


def support_mass(logprobs: torch.Tensor, support: list[int]) -> float:
    """The mean over positions of the reference probability inside the support (1: KL on it is exact)."""
    return float(logprobs[:, torch.tensor(support, device=logprobs.device)].exp().sum(-1).mean())


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||a|| over the whole tensor (a is the reference)."""
    return float((a.double() - b.double()).norm() / a.double().norm().clamp_min(1e-300))


def choice_flips(a: ChoiceRecorder, b: ChoiceRecorder) -> dict:
    """Per layer, the share of positions whose routed expert set (and on C4 layers, whose indexer choice)
    differs between two forwards of the same sequence."""
    out = {"experts": {}, "indexer": {}}
    for layer, ea in a.experts.items():
        out["experts"][str(layer)] = _r((ea != b.experts[layer]).any(-1).float().mean())
    for layer, ia in a.indexer.items():
        out["indexer"][str(layer)] = _r((ia != b.indexer[layer]).any(-1).float().mean())
    return out


def score(model, sequences: list[list[int]], names=("R_x", "R_q"), top: int = 20, support_size: int = 256,
          tensors_out: str | None = None, log=print) -> dict:
    """Every reference of `names` on every sequence: {"support": [...], "references": {name: {"teacher":
    [...]}}, "hidden_rel_error": {name: [per layer, per sequence]}, "choice_flips": ...} (the last two
    against the first name). With `tensors_out`, also saves per (name, sequence index) every layer's output
    (fp16), routed experts and indexer choices (torch.save)."""
    unknown = [n for n in names if n not in NUMERICS]
    if unknown:
        raise ValueError(f"oracle score: unknown references {unknown}; expected names from {sorted(NUMERICS)}")
    refs = {n: {"numerics": vars(NUMERICS[n]), "teacher": []} for n in names}
    supports, hidden_err, flips, saved = [], {n: [] for n in names[1:]}, {n: [] for n in names[1:]}, {}
    for s_i, seq in enumerate(sequences):
        runs = {}
        for n in names:
            with applied(model, NUMERICS[n]):
                runs[n] = forward_logprobs(model, seq)
        support = support_ids([lp for lp, _ in runs.values()], support_size)
        supports.append(support)
        first = names[0]
        for n, (lp, rec) in runs.items():
            refs[n]["teacher"].append(sequence_record(seq, lp, rec, top, support))
            refs[n]["teacher"][-1]["support_mass"] = _r(support_mass(lp, support))
            if n != first:
                base = runs[first][1]
                hidden_err[n].append([_r(rel_error(base.hidden[k], rec.hidden[k])) for k in sorted(base.hidden)])
                flips[n].append(choice_flips(base, rec))
            if tensors_out:
                saved[(n, s_i)] = {"hidden": {k: h.half() for k, h in rec.hidden.items()},
                                   "experts": rec.experts, "indexer": rec.indexer}
        log(f"oracle score: sequence {s_i} ({len(seq)} tokens) done")
        del runs
    if tensors_out:
        torch.save(saved, tensors_out)
    return {"support": supports, "references": refs, "hidden_rel_error": hidden_err, "choice_flips": flips}
