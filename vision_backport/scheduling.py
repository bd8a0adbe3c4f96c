"""Image blocks stay whole across prefill chunks (reference 03 §5.4; issue 7 deliverable 4).

Inside an image block every token attends to the whole block both ways, so one forward must compute all
of the block's queries with all of its keys. SGLang 0.5.16 cuts a long prompt into chunks wherever its
token budget ends (`PrefillAdder.add_one_req` / `add_chunked_req`), and each cut goes through one method,
`Req.set_extend_range(start, end)` (schedule_batch.py:1153). The seam `vision.whole_image_blocks` wraps it:

- a cut that would fall inside an image block moves back to the block's first token, when the block starts
  after this chunk's start (the block goes whole into the next chunk);
- when the block starts at or before the chunk's start (the block is longer than what is left of the chunk
  budget: an image bigger than the chunk), the cut moves forward past the block's end, so the request makes
  progress instead of stalling; this chunk is then longer than --chunked-prefill-size by at most one block
  (at most vision_max_n_token + its rows' newlines + 2 tokens; the KV pages are allocated for the real
  length, the prefill budget of that round is the only thing under-counted);
- a range that ends at the prompt's end, or a cut outside every block, is left as SGLang made it.

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


def whole_block_end(start: int, end: int, full_len: int, spans) -> int:
    """The extend end that keeps every image block whole; see the module docstring."""
    if end >= full_len:
        return end
    for s, e in spans:
        if s < end <= e:  # the cut falls inside [s, e]: tokens s..end-1 in, end..e out
            if s > start:
                return s
            if e + 1 < full_len:
                return e + 1
            return end  # a prompt that ends inside its last block: the forward's guard refuses it
    return end


def set_extend_range_whole_blocks(original, req, start: int, end: int):
    """Around Req.set_extend_range (sglang/srt/managers/schedule_batch.py:1153)."""
    spans = image_spans(req)
    if spans:
        end = whole_block_end(int(start), int(end), len(req.full_untruncated_fill_ids), spans)
    return original(req, start, end)
