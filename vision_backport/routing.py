"""bias_vl routing of Vision-Exp: which experts an image-block token selects.

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


# --- the hooks for SGLang's TopK / HashTopK (seams vision.topk, vision.hash_topk) -----------------------

_IMAGE_MASK = None  # bool [T] of the batch being forwarded, or None: set by the VL text forward


class image_rows:
    """Context: the image mask of the tokens this forward routes (None or all-False: nothing changes)."""

    def __init__(self, mask):
        self.mask = mask if mask is not None and bool(mask.any()) else None

    def __enter__(self):
        global _IMAGE_MASK
        self._prev, _IMAGE_MASK = _IMAGE_MASK, self.mask
        return self

    def __exit__(self, *exc):
        global _IMAGE_MASK
        _IMAGE_MASK = self._prev
        return False


def with_image_rows(weights, ids, router_logits, mask, bias_vl, renormalize: bool, scale: float):
    """(weights, ids) of SGLang's top-k for every row, with the image rows re-chosen by bias_vl: top-k of
    sqrt(softplus(logits)) + bias_vl, weights the unbiased scores there (renormalized as the layer does),
    times `scale` where the layer applies the routed scaling factor in its top-k. Text rows untouched."""
    k = ids.shape[1]
    scores = F.softplus(router_logits.float()).sqrt()
    vl_ids = torch.topk(scores + bias_vl.float()[None, :], k, dim=-1).indices
    vl_w = scores.gather(1, vl_ids)
    if renormalize:
        vl_w = vl_w / vl_w.sum(dim=-1, keepdim=True)
    vl_w = vl_w * scale
    m = mask.to(torch.bool)[:, None]
    return torch.where(m, vl_w.to(weights.dtype), weights), torch.where(m, vl_ids.to(ids.dtype), ids)


def _mask_for(router_logits):
    mask = _IMAGE_MASK
    if mask is None or mask.shape[0] != router_logits.shape[0]:
        return None  # no images, or a padded / captured batch the mask does not describe
    return mask


def topk_with_vl(original, self, hidden_states, router_logits, *args, **kwargs):
    """Around TopK.forward_*: non-hash layers; `self.correction_bias_vl` is the gate's bias_vl."""
    out = original(self, hidden_states, router_logits, *args, **kwargs)
    mask, bias_vl = _mask_for(router_logits), getattr(self, "correction_bias_vl", None)
    if mask is None or bias_vl is None:
        return out
    c = self.topk_config
    scale = c.routed_scaling_factor if (c.apply_routed_scaling_factor_on_output and c.routed_scaling_factor) else 1.0
    w, i = with_image_rows(out.topk_weights, out.topk_ids, router_logits, mask, bias_vl, c.renormalize, scale)
    return out._replace(topk_weights=w, topk_ids=i)


def hash_topk_with_vl(original, self, hidden_states, router_logits, input_ids, *args, **kwargs):
    """Around HashTopK.forward: hash layers; image rows skip the token-id table (their ids, pad values past the
    vocabulary, are clamped so the table gather stays in range) and take top-k of scores + bias_vl."""
    mask, bias_vl = _mask_for(router_logits), getattr(self, "correction_bias_vl", None)
    if mask is None or bias_vl is None:
        return original(self, hidden_states, router_logits, input_ids, *args, **kwargs)
    safe_ids = torch.where(mask.to(torch.bool), torch.zeros_like(input_ids), input_ids)
    out = original(self, hidden_states, router_logits, safe_ids, *args, **kwargs)
    scale = self.routed_scaling_factor if getattr(self, "apply_routed_scaling_factor_on_output", False) else 1.0
    w, i = with_image_rows(out.topk_weights, out.topk_ids, router_logits, mask, bias_vl, True, scale)
    return out._replace(topk_weights=w, topk_ids=i)
