"""The Vision-Exp bidirectional image window in DSV4's attention, on either datapath.

In a prefill whose extend holds image blocks (recorded by the VL forward as `forward_batch.dsv4_image_spans`),
the queries inside a block see the whole block both ways on top of their causal window. Both seams here wrap
`DeepseekV4AttnBackend.forward` (deepseek_v4_backend.py:1600) the same way: the metadata's
`core_attn_metadata.swa_page_indices` / `swa_topk_lengths` are swapped for the widened [T, 512] lists
(`visible_swa_lists`; 512 is a multiple of FlashMLA's 64) for the duration of the call, then restored. Decode,
verify and text-only batches pass through unchanged; the attention stages know nothing of images.

- `vision.sm80_window` (patch on): around the SM80 forward (seam attention.forward), which reads those lists.
- `vision.native_window` (patch off, for A/B): around SGLang's own forward, which hands them to FlashMLA. Its
  sparse-prefill branch (extends over 11673 tokens, or SGLANG_OPT_FLASHMLA_SPARSE_PREFILL=1, its default)
  builds its own SWA indices from the page table: the bootstrap sets that knob to 0 in this mode when it is
  unset, and an image extend that would still take the branch is refused with a message instead of silently
  losing the window.
"""

from __future__ import annotations

import torch

from dsv4_sm80.stages.attention import match_rows

from .visible_window import MAX_IMAGE_TOKENS, WINDOW

VISIBLE_WIDTH = WINDOW + MAX_IMAGE_TOKENS  # 128 causal + up to 384 image-block keys


class NativeWindowUnsupported(RuntimeError):
    pass


def visible_swa_lists(swa_ids, swa_lens, spans_per_req, positions, req_tokens, req_rows, req_to_token,
                      full_to_swa):
    """The bidirectional image window as SWA index lists, for an extend batch: a query inside an image span
    [s, e] (IMAGE_START .. IMAGE_END, absolute positions, wholly in this extend) sees raw keys
    [max(0, min(p - 127, s)), min(that + 511, e)], i.e. the whole block both ways plus the causal window before
    it; every other query keeps its causal list (the same ids, now padded to VISIBLE_WIDTH with -1). The image
    rows are built as the backend builds causal ones: positions -> req_to_token -> full_to_swa
    (deepseek_v4_backend.py:1968). Returns (ids [T, 512] int32, lens [T] int32)."""
    rows = swa_ids.shape[0]
    ids = swa_ids.new_full((rows, max(VISIBLE_WIDTH, swa_ids.shape[1])), -1)
    ids[:, : swa_ids.shape[1]] = swa_ids
    lens = swa_lens.clone()
    start = 0
    for r, (n_tok, spans) in enumerate(zip(req_tokens, spans_per_req)):
        for s, e in spans or ():
            pos = positions[start:start + n_tok].long()
            inside = ((pos >= s) & (pos <= e)).nonzero().flatten()
            if inside.numel() == 0:
                continue
            p = pos[inside]
            lo = torch.clamp(torch.minimum(p - (WINDOW - 1), torch.full_like(p, s)), min=0)
            hi = torch.minimum(lo + VISIBLE_WIDTH - 1, torch.full_like(p, e))
            offs = lo[:, None] + torch.arange(VISIBLE_WIDTH, device=p.device)[None, :]
            valid = offs <= hi[:, None]
            full = req_to_token[req_rows[r], torch.where(valid, offs, 0)]
            slots = full_to_swa[full.long()].to(ids.dtype)
            ids[start + inside] = torch.where(valid, slots, torch.full_like(slots, -1))
            lens[start + inside] = (hi - lo + 1).to(lens.dtype)
        start += n_tok
    return ids, lens


def _forward_with_window(original, native, self, q, k, v, layer, forward_batch, compress_ratio,
                         save_kv_cache=True, attn_sink=None, **kwargs):
    spans = getattr(forward_batch, "dsv4_image_spans", None)
    if not spans or not any(spans) or not forward_batch.forward_mode.is_extend_without_speculative():
        return original(self, q, k, v, layer, forward_batch, compress_ratio, save_kv_cache=save_kv_cache,
                        attn_sink=attn_sink, **kwargs)
    from sglang.srt.layers.attention import deepseek_v4_backend as backend

    core = self.forward_metadata.core_attn_metadata
    if not isinstance(core, backend.DSV4AttnMetadata):
        raise NativeWindowUnsupported("dsv4-sm80 vision: the image window needs DSV4AttnMetadata "
                                      f"(got {type(core).__name__})")
    rows = q.shape[0]
    if native:
        from sglang.srt.environ import envs

        if rows > backend._LARGE_INDEXER_QUERY_THRESHOLD or envs.SGLANG_OPT_FLASHMLA_SPARSE_PREFILL.get():
            raise NativeWindowUnsupported(
                f"dsv4-sm80 vision: an image prefill of {rows} tokens would take SGLang's sparse-prefill branch "
                f"(over {backend._LARGE_INDEXER_QUERY_THRESHOLD} tokens, or SGLANG_OPT_FLASHMLA_SPARSE_PREFILL=1), "
                "which builds its own window without the image block: use --chunked-prefill-size 8192 or less and "
                "leave SGLANG_OPT_FLASHMLA_SPARSE_PREFILL unset for native A/B with images")
    pool = self.token_to_kv_pool
    ids = match_rows(core.swa_page_indices, rows, 0)
    lens = match_rows(core.swa_topk_lengths, rows, 1)
    ids, lens = visible_swa_lists(ids, lens, spans, forward_batch.positions, forward_batch.extend_seq_lens_cpu,
                                  forward_batch.req_pool_indices, self.req_to_token, pool.full_to_swa_index_mapping)
    saved = core.swa_page_indices, core.swa_topk_lengths
    core.swa_page_indices, core.swa_topk_lengths = ids.to(saved[0].dtype), lens.to(saved[1].dtype)
    try:
        return original(self, q, k, v, layer, forward_batch, compress_ratio, save_kv_cache=save_kv_cache,
                        attn_sink=attn_sink, **kwargs)
    finally:
        core.swa_page_indices, core.swa_topk_lengths = saved


def sm80_forward_with_window(original, self, *args, **kwargs):
    """Around the SM80 DeepseekV4AttnBackend.forward (patch on)."""
    return _forward_with_window(original, False, self, *args, **kwargs)


def native_forward_with_window(original, self, *args, **kwargs):
    """Around SGLang's own DeepseekV4AttnBackend.forward (patch off)."""
    return _forward_with_window(original, True, self, *args, **kwargs)
