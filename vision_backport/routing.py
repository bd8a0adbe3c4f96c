"""bias_vl routing of Vision-Exp (reference 03 §4.1): which experts an image-block token selects.

scores = sqrt(softplus(logits)) in fp32. Text rows: non-hash layers choose top-k of scores + bias (the
correction bias), hash layers take tid2eid[token id]. Image rows (every position of an image block, its
pads and sentinels included): top-k of scores + bias_vl, on hash layers too (the token-id table is skipped).
Weights: the unbiased scores at the chosen experts, normalized; the routed scaling factor is applied by the
MoE, not here. Decode tokens are text, so decode routing is unchanged.

This module is the routing function; wiring it into SGLang's TopK / HashTopK call sites (with the image
mask taken from the ids before SGLang clamps them) is part of the VL wrapper.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def vl_route(logits: torch.Tensor, image_mask: torch.Tensor, top_k: int, bias_vl: torch.Tensor,
             bias: torch.Tensor | None = None, tid2eid: torch.Tensor | None = None,
             token_ids: torch.Tensor | None = None, renormalize: bool = True):
    """logits [T, E]; image_mask [T] bool. Non-hash layer: pass `bias`. Hash layer: pass `tid2eid` [V, k] and
    `token_ids` [T] (image rows' ids may be out of the table: they are not looked up).
    Returns (weights fp32 [T, k], ids int32 [T, k])."""
    scores = F.softplus(logits.float()).sqrt()
    mask = image_mask.to(torch.bool)[:, None]
    vl_ids = torch.topk(scores + bias_vl.float()[None, :], top_k, dim=-1).indices
    if tid2eid is not None:
        if token_ids is None:
            raise ValueError("a hash layer needs the token ids")
        safe = torch.where(image_mask.to(torch.bool), 0, token_ids.long())
        text_ids = tid2eid[safe].long()
    else:
        if bias is None:
            raise ValueError("a non-hash layer needs its correction bias")
        text_ids = torch.topk(scores + bias.float()[None, :], top_k, dim=-1).indices
    ids = torch.where(mask, vl_ids, text_ids)
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)
