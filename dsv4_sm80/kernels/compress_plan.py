"""SGLang's compress plans as the compressor stores read them (jit_kernel/dsv4 `compress_norm_rope_store`),
shared by the SM80 stores that follow a plan: which plan rows store an entry, and at which cache slot.

A plan row is 16 bytes: u32 seq_len (0xFFFFFFFF marks a padding row), then, in a prefill CompressPlan, a u16
ragged id. DecodePlan: one row per request; only a token that completes a block of RATIO stores, at
out_loc[row]. CompressPlan: one row per compress event, stored at out_loc[ragged id]. A slot < 0 stores
nothing. The entry's RoPE position is seq_len - RATIO.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def planned_slot(plan_ptr, r, in_range, out_loc_ptr, IS_DECODE: tl.constexpr, RATIO: tl.constexpr):
    """For plan rows r (int32 view of the plan, 4 words a row; in_range masks r): (stores, slot, seq_len)."""
    seq = tl.load(plan_ptr + r * 4, mask=in_range, other=-1)
    if IS_DECODE:
        valid = in_range & (seq > 0) & (seq % RATIO == 0)
        slot = tl.load(out_loc_ptr + r, mask=valid, other=-1)
    else:
        valid = in_range & (seq != -1)
        ragged = tl.load(plan_ptr + r * 4 + 1, mask=valid, other=0) & 0xFFFF
        slot = tl.load(out_loc_ptr + ragged, mask=valid, other=-1)
    return valid & (slot >= 0), slot, seq
