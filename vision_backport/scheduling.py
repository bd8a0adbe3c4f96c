"""Image blocks stay whole across prefill chunks.

Inside an image block every token attends to the whole block both ways, so one forward must compute all
of the block's queries with all of its keys. SGLang 0.5.16 cuts a long prompt into chunks wherever its
token budget ends (`PrefillAdder.add_one_req` / `add_chunked_req`), and each cut goes through one method,
`Req.set_extend_range(start, end)` (schedule_batch.py:1153). The seam `vision.whole_image_blocks` wraps it:

- a cut that would fall inside an image block moves back to the last page edge (a multiple of the KV page
  size: SGLang's own cuts are page-aligned, `schedule_policy.py:1145-1164`, and DSV4's page is 256 tokens)
  that splits no block and still leaves this chunk some tokens; the block goes whole into the next chunk;
- when there is no such edge (the block starts in this chunk's first page, or is longer than the chunk
  budget: an image bigger than the chunk), the cut moves forward to the first page edge past the block's
  end that splits no block (or to the prompt's end), so the request makes progress instead of stalling;
  this chunk is then longer than --chunked-prefill-size by at most a block and a page (the KV pages are
  allocated for the real length; the prefill budget of that round is the only thing under-counted);
- a range that ends at the prompt's end, or a cut outside every block, is left as SGLang made it.

Page-aligned ends keep the one invariant of chunked prefill this seam could otherwise break.

Because chunk ends never fall inside a block, the prefix SGLang caches for a chunked request never ends
inside one either, and a block's pad ids (one hash per image for the whole block, `processor.block_hash`)
make two different images diverge at the block's first token; a radix match therefore ends at a block
edge. The forward keeps its check (`model.extend_image_spans` raises `PartialImageBlock`) as the guard.
"""

from __future__ import annotations


def image_spans(req) -> list[tuple[int, int]]:
    """The [start, end] (inclusive) positions of each image item of a request, as SGLang's offsets."""
    mm = getattr(req, "multimodal_inputs", None)
    spans = []
    for item in getattr(mm, "mm_items", None) or []:
        if getattr(item, "types", None) is None:  # only our VL blocks (ExpandedImage-derived items)
            continue
        for s, e in getattr(item, "offsets", None) or []:
            spans.append((int(s), int(e)))
    return sorted(spans)


def _splits(pos: int, spans):
    """The block a cut at pos would split (tokens pos-1 and pos in one block), or None."""
    return next(((s, e) for s, e in spans if s < pos <= e), None)


def whole_block_end(start: int, end: int, full_len: int, spans, page: int = 1) -> int:
    """The extend end that keeps every image block whole and, short of the prompt's end, on a page edge
    (a multiple of `page`, as SGLang's own cuts are); see the module docstring."""
    if end >= full_len or _splits(end, spans) is None:
        return end
    edge = (end - 1) // page * page  # back: the last page edge before the cut that splits no block
    while edge > start:
        blk = _splits(edge, spans)
        if blk is None:
            return edge
        edge = blk[0] // page * page  # a cut at the block's own start splits nothing
    edge = -(-end // page) * page  # forward: the first page edge past the cut that splits no block
    while edge < full_len:
        blk = _splits(edge, spans)
        if blk is None:
            return edge
        edge = -(-(blk[1] + 1) // page) * page
    return full_len


def _page_size() -> int:
    try:
        from sglang.srt.server_args import get_global_server_args

        return max(1, int(get_global_server_args().page_size or 1))
    except (ImportError, ValueError, AttributeError):
        return 1


def set_extend_range_whole_blocks(original, req, start: int, end: int):
    """Around Req.set_extend_range (sglang/srt/managers/schedule_batch.py:1153)."""
    spans = image_spans(req)
    if spans:
        end = whole_block_end(int(start), int(end), len(req.full_untruncated_fill_ids), spans, _page_size())
    return original(req, start, end)


def _prefilled_whole(req) -> bool:
    """Whether the request's extend range, as the whole-block rule may have moved it, reaches its prompt's end."""
    return int(req.extend_range.end) >= len(req.full_untruncated_fill_ids)


def add_req_unchunked_when_whole(original, adder, req, *args, **kwargs):
    """Around PrefillAdder.add_one_req / add_one_req_ignore_eos (schedule_policy.py:1001, 887). SGLang marks a
    request chunked (`new_chunked_req`) from its own cut before `set_extend_range`; when the whole-block rule
    moved that cut forward to the prompt's end (an image block across the cut and past it), the request is
    prefilled whole this round and must not stay the chunked request: the next round would schedule it again
    with an empty extend, which SGLang's compressor plan refuses (`c_plan.cuh:507 batch_size <= num_q_tokens`:
    a chunked vision run dies there)."""
    res = original(adder, req, *args, **kwargs)
    if adder.new_chunked_req is req and _prefilled_whole(req):
        adder.new_chunked_req = None
    return res


def add_chunked_req_unchunked_when_whole(original, adder, req):
    """Around PrefillAdder.add_chunked_req (schedule_policy.py:830): the same for a later chunk, which SGLang
    returns as still chunked when its own cut fell short of the prompt's end."""
    res = original(adder, req)
    if res is req and _prefilled_whole(req):
        return None
    return res
