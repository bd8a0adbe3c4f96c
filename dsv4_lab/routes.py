"""Lab (vision): the routing trace. With DSV4_SM80_LAB_ROUTE_TRACE=FILE, every MoE top-k call that routes image
rows appends one JSON line: rows, image rows, image rows whose experts are top-k of scores + bias_vl (recomputed
here in float64, as a set per row), image rows where that differs from the text rule, text rows changed. It is
the evidence that image tokens take bias_vl and text tokens do not.

Seams `lab.route_trace_topk` / `lab.route_trace_hash` wrap the vision overlay's own routing seams on the same
targets: the text rule is SGLang's own top-k (`upstream`), run a second time on the same inputs, with the
image rows' token ids clamped as the overlay clamps them. Costs that second top-k and a device sync per layer.
"""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F

from . import knobs


def upstream(fn):
    """SGLang's own function under a chain of seam wrappers (each carries its seam's mark and keeps the one below as
    `__wrapped__`; SGLang's own decorators below that are left in place)."""
    from dsv4_sm80.apply import MARK

    while getattr(fn, MARK, None) is not None and getattr(fn, "__wrapped__", None) is not None:
        fn = fn.__wrapped__
    return fn


def record(path, kind, router_logits, mask, bias_vl, text_ids, got_ids) -> dict:
    k = got_ids.shape[1]
    m = mask.to(torch.bool)
    scores = F.softplus(router_logits.double()).sqrt()
    want = torch.topk(scores + bias_vl.double()[None, :], k, dim=-1).indices.sort(dim=-1).values
    got = got_ids.long().sort(dim=-1).values
    text_rule = text_ids.long().sort(dim=-1).values
    row = {"kind": kind, "rows": int(m.numel()), "image_rows": int(m.sum()),
           "image_rows_bias_vl": int(((got == want).all(-1) & m).sum()),
           "image_rows_differ_from_text_rule": int(((got != text_rule).any(-1) & m).sum()),
           "text_rows_changed": int(((got != text_rule).any(-1) & ~m).sum())}
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
    return row


def _image_rows(self, router_logits):
    from vision_backport.routing import _mask_for

    return _mask_for(router_logits), getattr(self, "correction_bias_vl", None)


def topk(original, self, hidden_states, router_logits, *args, **kwargs):
    """Around TopK.forward_cuda, after the vision overlay's `vision.topk`."""
    out = original(self, hidden_states, router_logits, *args, **kwargs)
    path = knobs.get(knobs.LAB_ROUTE_TRACE)
    mask, bias_vl = _image_rows(self, router_logits)
    if path and mask is not None and bias_vl is not None:
        text = upstream(original)(self, hidden_states, router_logits, *args, **kwargs)
        record(path, "topk", router_logits, mask, bias_vl, text.topk_ids, out.topk_ids)
    return out


def hash_topk(original, self, hidden_states, router_logits, input_ids, *args, **kwargs):
    """Around HashTopK.forward, after the vision overlay's `vision.hash_topk`."""
    out = original(self, hidden_states, router_logits, input_ids, *args, **kwargs)
    path = knobs.get(knobs.LAB_ROUTE_TRACE)
    mask, bias_vl = _image_rows(self, router_logits)
    if path and mask is not None and bias_vl is not None:
        safe_ids = torch.where(mask.to(torch.bool), torch.zeros_like(input_ids), input_ids)
        text = upstream(original)(self, hidden_states, router_logits, safe_ids, *args, **kwargs)
        record(path, "hash", router_logits, mask, bias_vl, text.topk_ids, out.topk_ids)
    return out
