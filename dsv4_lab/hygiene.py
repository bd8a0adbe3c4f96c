"""Lab: page hygiene. With DSV4_SM80_LAB_POISON=1, every time SGLang's scheduler flushes its cache (all
pages free: `Scheduler.flush_cache` succeeds only when idle), every byte of the KV pools is overwritten with
0xFF before any new request runs: the SWA, C4 and C128 KV rows (BF16 0xFFFF is a NaN), the INT8 indexer
pages (their fp32 row scales become NaN), the compressors' state rings, for the target and the draft
(DSPARK / NextN) pool alike. A request after the flush that reads any byte it did not write itself (a
recycled page's stale rows, the tail of a partly filled page, padding slots, an uninitialised state)
gets NaN into its attention or its compression; `dsv4_lab/beds/hygiene.py` runs the same requests with and
without the poison and requires identical, finite outputs.

Never for serving: it is a lab knob (README "Environment"), and the fill costs one pass over the pool.
"""

from __future__ import annotations

import sys

import torch

from . import knobs


def kv_buffers(pool) -> list[tuple[str, torch.Tensor]]:
    """The named device buffers of a DSV4 token-to-KV pool (sglang 0.5.16 deepseek_v4_memory_pool.py:455,
    the attributes its get_contiguous_buf_infos reads, plus the SWA pool and the state rings)."""
    out = []

    def add(name, tensors):
        for i, t in enumerate(tensors or []):
            if isinstance(t, torch.Tensor) and t.numel():
                out.append((f"{name}[{i}]", t))

    for name in ("swa_kv_pool", "c4_kv_pool", "c128_kv_pool", "unified_kv_pool"):
        sub = getattr(pool, name, None)
        if sub is not None:
            add(f"{name}.kv_buffer", getattr(sub, "kv_buffer", None))
    indexer = getattr(pool, "c4_indexer_kv_pool", None)
    if indexer is not None:
        add("c4_indexer_kv_pool.index_k_with_scale_buffer", getattr(indexer, "index_k_with_scale_buffer", None))
    for name in ("compress_state_pools", "indexer_compress_state_pools"):
        for j, sp in enumerate(getattr(pool, name, None) or []):
            buf = getattr(sp, "kv_score_buffer", None) if sp is not None else None
            if buf is not None:
                add(f"{name}[{j}].kv_score", [getattr(buf, "kv_score", None)])
    return out


def poison(pool) -> tuple[int, int]:
    """Fill every buffer of `pool` with 0xFF bytes; (buffers, bytes)."""
    n = total = 0
    seen = set()
    for _, t in kv_buffers(pool):
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        (t if t.dtype == torch.uint8 else t.view(torch.uint8)).fill_(0xFF)
        n += 1
        total += t.numel() * t.element_size()
    return n, total


def _draft_pool(scheduler):
    worker = getattr(scheduler, "draft_worker", None)
    for path in (("model_runner",), ("draft_runner",), ("draft_worker", "model_runner"), ("draft_model_runner",)):
        obj = worker
        for name in path:
            obj = getattr(obj, name, None)
        pool = getattr(obj, "token_to_kv_pool", None) if obj is not None else None
        if pool is not None:
            return pool
    return None


def poison_after_flush(result, scheduler, *args, **kwargs):
    """After Scheduler.flush_cache (sglang/srt/managers/scheduler.py:3846): when it flushed (all pages
    free) and DSV4_SM80_LAB_POISON=1, poison the target's and the draft's pools."""
    if not result or knobs.get(knobs.LAB_POISON) != "1":
        return None
    target = scheduler.token_to_kv_pool_allocator.get_kvcache()
    draft = _draft_pool(scheduler)
    parts = []
    for role, pool in (("target", target), ("draft", draft)):
        if pool is None or (role == "draft" and pool is target):
            continue
        n, nbytes = poison(pool)
        parts.append(f"{role} {n} buffers {nbytes / 2**30:.2f} GiB")
    torch.cuda.synchronize()
    rank = getattr(scheduler, "tp_rank", 0)
    print(f"[rank {rank}] dsv4-sm80 lab poison: after flush_cache, 0xFF over " + ", ".join(parts),
          file=sys.stderr, flush=True)
    return None
