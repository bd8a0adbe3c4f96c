"""DSV4 attention on SM80: BF16 main KV caches, an INT8 indexer cache, Triton sparse attention.

The replacements for the `attention.*` seams (dsv4_sm80/seams.py; docs/attention.md):

- launch: the KV cache dtype resolves to `bfloat16` (SGLang's DSV4 default is FP8 e4m3, which SM80
  cannot run): this stage's rule in `seams.SERVER_ARGS`, set by the launch stage; HiSparse, whose pool is not
  adapted to it, is refused by the gate's server.modes check.
- pools: `DeepSeekV4SingleKVPool` (SWA, C4, C128 pools of the target and of the DSPARK/NextN draft) holds
  `bf16 [pages, page_size * 512]`, i.e. one 512-wide row per flat slot id, which is the id space every
  index SGLang builds already uses; its writers scatter rows and skip slot < 0. The pool configurator
  sizes tokens with 1024 bytes per KV row instead of the FP8 layout's 584 (the indexer stays at 132).
- writers: the main K (RMSNorm + RoPE) goes through `kernels/kv_store.py`; the main compressor's store uses
  SGLang's own JIT `compress_norm_rope_store` in its `bf16_store` mode; the indexer compressor's store is
  `kernels/indexer_int8.compress_store_index_k_int8` (same math, INT8 + fp32 scale in the 132-byte pages).
- indexer: Q quantization and the paged logits are the INT8 kernels of `kernels/indexer_int8.py`
  (`SGLANG_FP8_PAGED_MQA_LOGITS_TORCH=1` makes SGLang call the logits function these replace and skip
  DeepGEMM metadata; top-k stays SGLang's JIT v1). Where one pass's logits [T, L/4] fp32 would pass 256 MiB
  (long prompts), they and their top-k go a chunk of query rows at a time (`indexer_topk_by_chunks`).
- attention: `DeepseekV4AttnBackend.forward` maps the backend's per-query metadata (flat slot ids, -1
  invalid, lengths) onto `kernels/sparse_attn.py` in every mode, plain extend included, so neither FlashMLA
  path (decode or sparse prefill) is reached; the FlashMLA scheduling metadata is never built.
- the model's own roundings (docs/attention.md), off by default: SGLANG_DSV4_A100_KV_ROUNDING=fp8_sim
  gives every stored SWA and compressed key row the FP8 simulation DeepSeek-V4 was trained with;
  SGLANG_DSV4_A100_INDEXER_ROUNDING=fp4_sim the indexer's FP4 simulation of its query and keys.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .. import env

HEAD_DIM = 512


@functools.cache
def kv_fp8_sim() -> bool:
    """SGLANG_DSV4_A100_KV_ROUNDING=fp8_sim, read once per process (the stores call this per layer)."""
    return env.get(env.KV_ROUNDING) == "fp8_sim"


@functools.cache
def indexer_fp4_sim() -> bool:
    """SGLANG_DSV4_A100_INDEXER_ROUNDING=fp4_sim, read once per process."""
    return env.get(env.INDEXER_ROUNDING) == "fp4_sim"


# --- pools ----------------------------------------------------------------------------------------

def _row_dim(pool) -> int:
    return pool.qk_nope_head_dim + pool.qk_rope_head_dim


def bf16_bytes_per_token(self) -> int:
    """DeepSeekV4SingleKVPool.get_bytes_per_token: one BF16 row of nope + rope dims."""
    return _row_dim(self) * 2


def bf16_create_buffer(self, *, num_pages: int):
    """DeepSeekV4SingleKVPool.create_buffer: BF16 [num_pages, page_size * 512]; row = flat slot id."""
    dim = _row_dim(self)
    if self.dtype != torch.bfloat16:
        raise ValueError(
            f"dsv4-sm80 attention.kv_pool: found KV cache dtype {self.dtype}; expected torch.bfloat16 (the SM80 "
            "datapath's BF16 KV layout); fix: launch through SGLang's Engine/launch_server with the patch on "
            "(it sets --kv-cache-dtype bfloat16), or pass --kv-cache-dtype bfloat16"
        )
    self.kv_cache_total_dim = dim
    self.bytes_per_page_padded = self.page_size * dim * 2
    return torch.zeros(num_pages, self.page_size * dim, dtype=torch.bfloat16, device=self.device)


def bf16_set_key_buffer_fused(self, layer_id: int, loc: torch.Tensor, cache_k: torch.Tensor) -> None:
    """DeepSeekV4SingleKVPool.set_key_buffer_fused: BF16 rows to their slots, slot < 0 skipped."""
    from ..kernels.kv_store import scatter_rows

    if cache_k.dtype != torch.bfloat16:
        raise TypeError(f"dsv4-sm80 attention: the BF16 KV pool takes bfloat16 rows, got {cache_k.dtype}")
    rows = cache_k.reshape(-1, _row_dim(self))
    scatter_rows(rows, loc, self.kv_buffer[layer_id], fp8_sim=kv_fp8_sim() and rows.shape[-1] == HEAD_DIM)


def bf16_set_key_buffer(self, layer_id: int, loc: torch.Tensor, cache_k) -> None:
    """DeepSeekV4SingleKVPool.set_key_buffer: only BF16 rows exist on this path (no FP8 pack)."""
    if not isinstance(cache_k, torch.Tensor):
        raise TypeError("dsv4-sm80 attention: an FP8 nope/rope pack reached the BF16 KV pool; "
                        "only the FP8 datapath builds those")
    bf16_set_key_buffer_fused(self, layer_id, loc, cache_k)


def bf16_swa_norm_rope_store(self, layer_id, swa_loc, kv, kv_weight, eps, freqs_cis, positions) -> None:
    """DeepSeekV4TokenToKVPool.set_swa_key_buffer_radix_fused_norm_rope: RMSNorm + RoPE + BF16 store."""
    from ..kernels.kv_store import k_norm_rope_store

    buf = self.swa_kv_pool.kv_buffer[self._swa_local_layer_id(layer_id)]
    k_norm_rope_store(kv, kv_weight, eps, freqs_cis, positions, swa_loc, buf, fp8_sim=kv_fp8_sim())


def bf16_bytes_per_full_token(original, self) -> float:
    """Around DSV4PoolConfigurator._get_bytes_per_full_token: the same formula with a 1024-byte KV row
    (BF16) where it hard-codes the FP8 layout's 584; the indexer's 132 bytes per entry are unchanged."""
    fp8_row = self.qk_nope_head_dim + self.qk_rope_head_dim * 2 + 8
    bf16_row = (self.qk_nope_head_dim + self.qk_rope_head_dim) * 2
    rows_per_token = (self.swa_ratio * self.num_layers_total
                      + self.num_layers_ca4 / (4 * self.c4_shrink_factor)
                      + self.num_layers_ca128 / 128)
    return original(self) + (bf16_row - fp8_row) * rows_per_token


# --- compressor stores ----------------------------------------------------------------------------

def compress_store(original, kv, plan, *, norm_weight, norm_eps, freq_cis, out_loc, kvcache, page_size,
                   use_fp4=False, bf16_store=False):
    """Around compressor_v2.compress_norm_rope_store: the main compressor (512-wide rows) through SGLang's
    JIT in its bf16_store mode into the flat BF16 rows; the indexer compressor (128-wide) through the INT8
    epilogue+store."""
    if kv.shape[-1] == HEAD_DIM:
        flat = kvcache.reshape(-1, HEAD_DIM * 2)  # bytes of [slots, 512] BF16: one "page" per slot
        out = original(kv, plan, norm_weight=norm_weight, norm_eps=norm_eps, freq_cis=freq_cis, out_loc=out_loc,
                       kvcache=flat, page_size=1, use_fp4=False, bf16_store=True)
        if kv_fp8_sim():  # the rows the JIT just stored, as the model rounds its BF16 compressed rows
            from ..kernels.kv_store import round_planned_rows_

            round_planned_rows_(kvcache.view(torch.bfloat16), plan[1], kv.shape[0], bool(plan.is_decode), out_loc,
                                int(plan.compress_ratio))
        return out
    if use_fp4:
        raise ValueError("dsv4-sm80 attention: the FP4 indexer (--enable-deepseek-v4-fp4-indexer, SM100) is not "
                         "part of the SM80 datapath; drop that flag")
    from ..kernels.indexer_int8 import compress_store_index_k_int8

    compress_store_index_k_int8(kv, plan[1], bool(plan.is_decode), out_loc, norm_weight, norm_eps, freq_cis,
                                kvcache, ratio=int(plan.compress_ratio), fp4_sim=indexer_fp4_sim())
    return None


# --- indexer ----------------------------------------------------------------------------------------

def indexer_q_int8(original, q, weight, weight_scale, freqs_cis, positions):
    """indexer.fused_q_indexer_rope_hadamard_quant: the INT8 variant (same arguments and returns)."""
    from ..kernels.indexer_int8 import q_rope_hadamard_int8

    return q_rope_hadamard_int8(q, weight, weight_scale, freqs_cis, positions, fp4_sim=indexer_fp4_sim())


# The C4 indexer's logits are [query tokens, max compressed entries] fp32: T x L bytes for a context of L
# tokens, 4 GiB per layer call for an 8192-token prefill chunk at 512K. SGLang computes them for every query of
# the forward at once and takes the top-k from them afterwards (srt/layers/attention/dsv4/indexer.py:702-761);
# above this budget the logits and their top-k go in query chunks instead (`indexer_topk_by_chunks`).
LOGITS_BUDGET_BYTES = 256 << 20


def logits_rows_per_chunk(max_seq_len: int, budget: int = LOGITS_BUDGET_BYTES) -> int:
    """Query rows whose fp32 logits over max_seq_len compressed entries fit the budget (at least one)."""
    return max(1, budget // (max(int(max_seq_len), 1) * 4))


@dataclass(frozen=True, eq=False)
class ChunkedIndexerLogits:
    """The logits call's arguments, kept for `indexer_topk_by_chunks` where all rows' logits at once would pass
    LOGITS_BUDGET_BYTES; it scores `rows_per_chunk` query rows at a time."""
    q: torch.Tensor
    kv_cache: torch.Tensor
    weights: torch.Tensor
    seq_lens: torch.Tensor
    page_table: torch.Tensor
    max_seq_len: int
    rows_per_chunk: int
    fp4_sim: bool

    def rows(self, start: int, end: int, out: torch.Tensor) -> torch.Tensor:
        from ..kernels.indexer_int8 import paged_mqa_logits_int8

        return paged_mqa_logits_int8(self.q[start:end], self.kv_cache, self.weights[start:end],
                                     self.seq_lens[start:end], self.page_table[start:end], self.max_seq_len,
                                     out=out[: end - start], fp4_sim=self.fp4_sim)


def indexer_logits_int8(original, q, kv_cache, weights, seq_lens, page_table, deep_gemm_metadata, max_seq_len,
                        clean_logits=False, budget: int = LOGITS_BUDGET_BYTES):
    """indexer.fp8_paged_mqa_logits_torch (selected by SGLANG_FP8_PAGED_MQA_LOGITS_TORCH=1): INT8 logits
    on INT8 tensor cores over the paged INT8 index cache. Where the rows' logits would pass the budget, the
    arguments come back unscored (`ChunkedIndexerLogits`) and the top-k seam scores them chunk by chunk. The
    choice depends on the shapes only (T, max_seq_len), never on values: a CUDA graph captures either path."""
    from ..kernels.indexer_int8 import paged_mqa_logits_int8

    max_seq_len = int(max_seq_len)
    rows = logits_rows_per_chunk(max_seq_len, budget)
    if q.shape[0] > rows:
        return ChunkedIndexerLogits(q, kv_cache, weights, seq_lens, page_table, max_seq_len, rows, indexer_fp4_sim())
    return paged_mqa_logits_int8(q, kv_cache, weights, seq_lens, page_table, max_seq_len, fp4_sim=indexer_fp4_sim())


def indexer_topk_by_chunks(original, scores, seq_lens, page_tables, out_page_indices, page_size,
                           out_raw_indices=None):
    """Around indexer.topk_transform_512 (SGLang's JIT top-k v1, one thread block per query row) and its
    torch fallback topk_transform_512_pytorch_vectorized (SGLANG_TOPK_TRANSFORM_512_TORCH=1): logits
    deferred by `indexer_logits_int8` are scored `rows_per_chunk` query rows at a time into one reused buffer,
    each chunk's top-k written to its rows of the outputs. Rows are independent in both kernels, so the indices
    equal the unchunked ones exactly; the largest logits allocation is rows_per_chunk x max_seq_len fp32."""
    if not isinstance(scores, ChunkedIndexerLogits):
        return original(scores, seq_lens, page_tables, out_page_indices, page_size, out_raw_indices)
    total = out_page_indices.shape[0]
    if scores.q.shape[0] != total:
        raise ValueError(f"dsv4-sm80 attention.indexer_topk: found {scores.q.shape[0]} scored query rows for "
                         f"{total} top-k rows; expected one per row, as SGLang's match_num_queries aligns them (an "
                         "upstream change to forward_c4_indexer; report it)")
    step = scores.rows_per_chunk
    buf = torch.empty((min(step, total), scores.max_seq_len), dtype=torch.float32, device=scores.q.device)
    for start in range(0, total, step):
        end = min(start + step, total)
        raw = None if out_raw_indices is None else out_raw_indices[start:end]
        original(scores.rows(start, end, buf), seq_lens[start:end], page_tables[start:end],
                 out_page_indices[start:end], page_size, raw)
    return None


# --- the attention backend ----------------------------------------------------------------------------

def no_flashmla_metadata():
    """deepseek_v4_backend._create_flashmla_metadata: FlashMLA's scheduler state is never needed."""
    return None


def refuse_sparse_prefill(self, *args, **kwargs):
    """DeepseekV4AttnBackend._forward_prefill_sparse: unreachable with the SM80 forward (FlashMLA sparse
    prefill over an FP8 workspace); raising keeps it that way."""
    raise RuntimeError("dsv4-sm80 attention: FlashMLA sparse prefill was reached; the SM80 forward serves "
                       "extend itself - this is a bug in the seam table")


def match_rows(x, rows: int, fill: int):
    """The backend's match_num_queries (deepseek_v4_backend.py:1662-1672): trim, or pad with `fill`."""
    if x is None or x.shape[0] == rows:
        return x
    if x.shape[0] > rows:
        return x[:rows]
    return torch.cat([x, x.new_full((rows - x.shape[0], *x.shape[1:]), fill)], dim=0)


def sm80_forward(self, q, k, v, layer, forward_batch, compress_ratio, save_kv_cache=True, attn_sink=None, **kwargs):
    """DeepseekV4AttnBackend.forward on SM80, every forward mode: the same key sets FlashMLA gets (SWA
    list + C4 top-k or all C128 entries per query; valid = j < len and id >= 0; the sink in the
    denominator; empty = 0), over the BF16 caches, by kernels/sparse_attn.py. Returns a new
    [T, Hpad, 512] BF16 tensor, as the original does."""
    from sglang.srt.layers.attention import deepseek_v4_backend as backend

    from ..kernels.sparse_attn import sparse_attn

    if self.mtp_enabled and forward_batch.forward_mode.is_idle():
        return q.new_empty(q.shape[0], q.shape[1], layer.v_head_dim)
    if attn_sink is None:
        raise ValueError("dsv4-sm80 attention: DSV4 attention needs its per-head sink")
    core = self.forward_metadata.core_attn_metadata
    if not isinstance(core, backend.DSV4AttnMetadata):
        raise NotImplementedError("dsv4-sm80 attention: ragged attention metadata is not supported")
    layer_id = layer.layer_id
    if save_kv_cache:
        self.store_cache(layer_id, k, forward_batch)
    pool = self.token_to_kv_pool
    swa_cache = pool.get_swa_key_buffer_radix(layer_id).view(-1, HEAD_DIM)
    extra_cache = extra_ids = extra_lens = None
    if compress_ratio == 4:
        extra_ids, extra_lens = core.c4_sparse_page_indices, core.c4_sparse_topk_lengths
    elif compress_ratio == 128:
        extra_ids, extra_lens = core.c128_page_indices, core.c128_topk_lengths_clamp1
    if compress_ratio and extra_ids is None:
        raise RuntimeError(f"dsv4-sm80 attention: no compressed-attention metadata for a ratio-{compress_ratio} layer")
    if extra_ids is not None:
        extra_cache = pool.get_extra_key_buffer(layer_id).view(-1, HEAD_DIM)
    if q.dim() == 4:
        q = q.squeeze(1)
    rows = q.shape[0]
    swa_ids = match_rows(core.swa_page_indices, rows, 0)
    swa_lens = match_rows(core.swa_topk_lengths, rows, 1)
    extra_ids, extra_lens = match_rows(extra_ids, rows, -1), match_rows(extra_lens, rows, 1)
    return sparse_attn(q.contiguous(), swa_cache, swa_ids, swa_lens, extra_cache, extra_ids, extra_lens,
                       attn_sink, scale=self.softmax_scale, heads=layer.tp_q_head_num, splits=None)
