"""The C4 indexer's logits and top-k in query chunks (dsv4_sm80/stages/attention.py: indexer_logits_int8,
indexer_topk_by_chunks): the same top-k indices as one unchunked pass, bit for bit, with the budget forced small;
the chunk sizes the budget gives at long contexts; and the seams that route SGLang's indexer through them."""

import os

import pytest
import torch

from conftest import dev, last_json, run_python
from dsv4_sm80.stages import attention as stage

N_PAGES = 8
MAX_LEN = N_PAGES * 64
TOPK = 64  # SGLang's is 512; a smaller top-k lets rows of at most 512 entries take the real selection path
LENS = [512, 300, 1, 64, 129, 511, 450]  # 7 rows: 3 + 3 + 1 at 3 rows a chunk


@pytest.fixture(scope="module")
def case():
    """An INT8 index cache written by the store kernel and 7 query rows over shuffled page tables."""
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and TRITON_INTERPRET is not 1")
    from dsv4_sm80.kernels import indexer_int8 as idx

    g = torch.Generator().manual_seed(11)
    cache = dev(torch.zeros(N_PAGES, 64 * 132, dtype=torch.uint8))
    x = torch.randn(N_PAGES * 64, 128, generator=g) * torch.rand(N_PAGES * 64, 1, generator=g) * 4
    idx.store_index_k_int8(*dev(x, torch.arange(N_PAGES * 64, dtype=torch.int32), cache))
    t = len(LENS)
    q8 = torch.randint(-127, 128, (t, 1, 64, 128), generator=g, dtype=torch.int32).to(torch.int8)
    w = torch.randn(t, 64, generator=g)
    page_table = torch.stack([torch.randperm(N_PAGES, generator=g) for _ in range(t)]).to(torch.int32)
    seq = torch.tensor(LENS, dtype=torch.int32)
    return dev(q8, cache, w, seq, page_table)


def topk_outputs(t):
    """Page indices and raw indices, prefilled with a value the top-k never writes."""
    return dev(torch.full((t, TOPK), -7, dtype=torch.int32), torch.full((t, TOPK), -7, dtype=torch.int32))


def test_chunked_topk_equals_one_pass(case):
    """Budget of 3 rows: the deferred logits are scored 3 + 3 + 1 rows at a time into one buffer, and SGLang's own
    top-k (its torch fallback, which runs on CPU) writes each chunk's rows; indices and raw indices equal one
    unchunked pass exactly."""
    from sglang.srt.layers.attention.dsv4.indexer import topk_transform_512_pytorch_vectorized as topk

    q8, cache, w, seq, page_table = case
    t = len(LENS)
    budget = 3 * MAX_LEN * 4
    assert stage.logits_rows_per_chunk(MAX_LEN, budget) == 3

    full = stage.indexer_logits_int8(None, q8, cache, w, seq.view(-1, 1), page_table, None, MAX_LEN)
    assert isinstance(full, torch.Tensor) and full.shape == (t, MAX_LEN)
    want_pages, want_raw = topk_outputs(t)
    stage.indexer_topk_by_chunks(topk, full, seq, page_table, want_pages, 64, want_raw)  # a tensor passes through

    deferred = stage.indexer_logits_int8(None, q8, cache, w, seq.view(-1, 1), page_table, None, MAX_LEN,
                                         budget=budget)
    assert isinstance(deferred, stage.ChunkedIndexerLogits) and deferred.rows_per_chunk == 3
    seen = []

    def recording_topk(scores, lens, pages, out, page_size, raw):
        start = sum(shape[0] for shape, _ in seen)
        seen.append((tuple(scores.shape), scores.data_ptr()))
        for r, n in enumerate(lens.tolist()):  # each chunk's logits are the unchunked rows' own values
            assert torch.equal(scores[r, :n], full[start + r, :n]), (start, r)
        return topk(scores, lens, pages, out, page_size, raw)

    got_pages, got_raw = topk_outputs(t)
    assert stage.indexer_topk_by_chunks(recording_topk, deferred, seq, page_table, got_pages, 64, got_raw) is None
    assert [s for s, _ in seen] == [(3, MAX_LEN), (3, MAX_LEN), (1, MAX_LEN)]
    assert len({p for _, p in seen}) == 1  # one buffer, reused by every chunk
    assert (want_pages != -7).all() and (want_raw >= 0).sum() > 0
    assert torch.equal(got_pages.cpu(), want_pages.cpu()) and torch.equal(got_raw.cpu(), want_raw.cpu())
    got_pages.fill_(-7)
    stage.indexer_topk_by_chunks(topk, deferred, seq, page_table, got_pages, 64)  # no raw indices (decode)
    assert torch.equal(got_pages.cpu(), want_pages.cpu())


def test_chunked_topk_refuses_misaligned_rows(case):
    q8, cache, w, seq, page_table = case
    deferred = stage.indexer_logits_int8(None, q8, cache, w, seq.view(-1, 1), page_table, None, MAX_LEN,
                                         budget=MAX_LEN * 4)
    pages = torch.zeros(len(LENS) - 1, TOPK, dtype=torch.int32)
    with pytest.raises(ValueError, match="attention.indexer_topk: found 7 scored query rows for 6 top-k rows"):
        stage.indexer_topk_by_chunks(None, deferred, seq[:-1], page_table[:-1], pages, 64)


@pytest.mark.parametrize("context,rows,chunks", [(128 << 10, 2048, 4), (256 << 10, 1024, 8), (512 << 10, 512, 16)])
def test_budget_bounds_the_logits_at_long_contexts(context, rows, chunks):
    """An 8192-token prefill chunk (SGLang's chunked_prefill_size on an 80 GB GPU) over L/4 C4 entries: unchunked
    T x L bytes (1, 2, 4 GiB); in chunks at most the 256 MiB budget."""
    entries = context // 4
    got = stage.logits_rows_per_chunk(entries)
    assert got == rows and -(-8192 // got) == chunks
    assert got * entries * 4 <= stage.LOGITS_BUDGET_BYTES == 256 << 20
    assert 8192 * entries * 4 == (context >> 17) << 30  # what one pass would hold
    # decode batches below the row count keep the one-pass path (and its single kernel launch)
    assert 256 <= stage.logits_rows_per_chunk((512 << 10) // 4)


SEAMS = """
import json
import sglang.srt.layers.attention.dsv4.indexer as idx
mark = lambda f: getattr(f, "__dsv4_sm80_seam__", None)
print(json.dumps([mark(idx.topk_transform_512), mark(idx.topk_transform_512_pytorch_vectorized)]))
"""


def test_seams_route_both_topk_paths():
    assert last_json(run_python(SEAMS, ENABLE_SGLANG_DSV4_A100_PATCH="1")) == ["attention.indexer_topk",
                                                                               "attention.indexer_topk_torch"]
