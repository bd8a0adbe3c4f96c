"""The Vision-Exp bidirectional image window on SGLang's native DSV4 attention (patch off, for A/B).

With the SM80 patch on, `dsv4_sm80.stages.attention.sm80_forward` widens the SWA lists of image-block queries
itself (`visible_swa_lists`) before its Triton kernel. With the patch off and DSV4_SM80_VISION=1, the seam
`vision.native_window` wraps `DeepseekV4AttnBackend.forward` (deepseek_v4_backend.py:1600) and hands the
same widened lists to FlashMLA: for a prefill whose extend holds image blocks (recorded by the VL forward
as `forward_batch.dsv4_image_spans`), `core_attn_metadata.swa_page_indices` / `swa_topk_lengths` are
swapped for the widened [T, 512] lists (512 is a multiple of FlashMLA's 64) for the duration of the call,
then restored. Decode, verify and text-only batches pass through unchanged.

The native sparse-prefill branch (extends over 11673 tokens, or SGLANG_OPT_FLASHMLA_SPARSE_PREFILL=1, its
default) builds its own SWA indices from the page table: the bootstrap sets that knob to 0 in this mode
when it is unset, and an image extend that would still take the branch is refused with a message instead
of silently losing the window.
"""

from __future__ import annotations


class NativeWindowUnsupported(RuntimeError):
    pass


def native_forward_with_window(original, self, q, k, v, layer, forward_batch, compress_ratio,
                               save_kv_cache=True, attn_sink=None, **kwargs):
    """Around DeepseekV4AttnBackend.forward (native path)."""
    spans = getattr(forward_batch, "dsv4_image_spans", None)
    if not spans or not any(spans) or not forward_batch.forward_mode.is_extend_without_speculative():
        return original(self, q, k, v, layer, forward_batch, compress_ratio, save_kv_cache=save_kv_cache,
                        attn_sink=attn_sink, **kwargs)
    from sglang.srt.environ import envs
    from sglang.srt.layers.attention import deepseek_v4_backend as backend

    from dsv4_sm80.stages.attention import _match_rows, visible_swa_lists

    core = self.forward_metadata.core_attn_metadata
    if not isinstance(core, backend.DSV4AttnMetadata):
        raise NativeWindowUnsupported("dsv4-sm80 vision: the native image window needs DSV4AttnMetadata "
                                      f"(got {type(core).__name__})")
    rows = q.shape[0]
    if rows > backend._LARGE_INDEXER_QUERY_THRESHOLD or envs.SGLANG_OPT_FLASHMLA_SPARSE_PREFILL.get():
        raise NativeWindowUnsupported(
            f"dsv4-sm80 vision: an image prefill of {rows} tokens would take SGLang's sparse-prefill branch "
            f"(over {backend._LARGE_INDEXER_QUERY_THRESHOLD} tokens, or SGLANG_OPT_FLASHMLA_SPARSE_PREFILL=1), "
            "which builds its own window without the image block: use --chunked-prefill-size 8192 or less and "
            "leave SGLANG_OPT_FLASHMLA_SPARSE_PREFILL unset for native A/B with images")
    pool = self.token_to_kv_pool
    ids = _match_rows(core.swa_page_indices, rows, 0)
    lens = _match_rows(core.swa_topk_lengths, rows, 1)
    ids, lens = visible_swa_lists(ids, lens, spans, forward_batch.positions, forward_batch.extend_seq_lens_cpu,
                                  forward_batch.req_pool_indices, self.req_to_token, pool.full_to_swa_index_mapping)
    saved = core.swa_page_indices, core.swa_topk_lengths
    core.swa_page_indices, core.swa_topk_lengths = ids.to(saved[0].dtype), lens.to(saved[1].dtype)
    try:
        return original(self, q, k, v, layer, forward_batch, compress_ratio, save_kv_cache=save_kv_cache,
                        attn_sink=attn_sink, **kwargs)
    finally:
        core.swa_page_indices, core.swa_topk_lengths = saved
