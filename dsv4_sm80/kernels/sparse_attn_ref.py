"""Plain-PyTorch reference for DSV4's sparse attention with a sink, written
from the math for the Triton kernel's tests; per query, no paging tricks.

For query token t and head h, the key set is the multiset of cache rows named by the valid entries of
its index lists (entry j of a list is valid when j < its length and the id is >= 0): the SWA list into
the SWA cache and the extra list (C4 top-k or all C128 entries) into the compressed cache. K = V (MQA,
one 512-wide vector per slot):

    s_k = (q_h . K_k) * scale
    o_h = sum_k exp(s_k) K_k / (sum_k exp(s_k) + exp(sink_h)),      o_h = 0 when the set is empty
"""

from __future__ import annotations

import torch


def valid_ids(ids: torch.Tensor, length) -> torch.Tensor:
    n = min(int(length), ids.numel())
    row = ids[:n].to(torch.int64)
    return row[row >= 0]


def sparse_attn_ref(q, swa_cache, swa_ids, swa_lens, extra_cache=None, extra_ids=None, extra_lens=None,
                    sink=None, scale=512 ** -0.5):
    """q [T, H, D]; caches [slots, D]; ids [T, W] int; lens [T]; sink [H] fp32 or None -> [T, H, D] fp64."""
    t_total, heads, dim = q.shape
    out = torch.zeros(t_total, heads, dim, dtype=torch.float64)
    for t in range(t_total):
        keys = [swa_cache[valid_ids(swa_ids[t], swa_lens[t])]]
        if extra_cache is not None:
            keys.append(extra_cache[valid_ids(extra_ids[t], extra_lens[t])])
        k = torch.cat(keys).to(torch.float64)
        if k.shape[0] == 0:
            continue
        s = (q[t].to(torch.float64) @ k.T) * scale  # [H, N]
        if sink is not None:
            s = torch.cat([s, sink.to(torch.float64)[:, None]], dim=1)
        p = torch.softmax(s, dim=1)[:, : k.shape[0]]
        out[t] = p @ k
    return out
