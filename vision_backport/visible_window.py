"""The Vision-Exp visible window: torch-free.

In prefill, a token inside an image span (IMAGE_START .. IMAGE_END inclusive; the alignment pads before
START are outside) sees the whole span both ways, on top of the causal raw-key window of `window` tokens
(128); every other token keeps the causal window. Compressed attention, decode and verify stay causal.
The result per query is one contiguous raw-key range [start, start + length), at most window +
max_image_tokens (512) long, which becomes that query's SWA index list.
"""

from __future__ import annotations

from .image_processing import IMAGE_END, IMAGE_START

WINDOW = 128
MAX_IMAGE_TOKENS = 384


def image_spans(types) -> list[tuple[int, int]]:
    """(start, end) positions (inclusive) of each IMAGE_START .. IMAGE_END span in a per-token type list
    (None, or any value other than the block types, for text)."""
    spans, start = [], None
    for pos, t in enumerate(types):
        if t == IMAGE_START:
            if start is not None:
                raise ValueError(f"image span opened at {start} and again at {pos} without IMAGE_END")
            start = pos
        elif t == IMAGE_END:
            if start is None:
                raise ValueError(f"IMAGE_END at {pos} without IMAGE_START")
            spans.append((start, pos))
            start = None
    if start is not None:
        raise ValueError(f"image span opened at {start} is not closed: a partial image block")
    return spans


def visible_windows(seq_len: int, spans, window: int = WINDOW, max_image_tokens: int = MAX_IMAGE_TOKENS):
    """Per query position: (starts, lengths) of its raw-key range. Text: the last `window` positions up to
    itself. Inside a span: from min(causal start, span start) to the span's end, within
    window + max_image_tokens keys."""
    starts = [max(0, i - window + 1) for i in range(seq_len)]
    ends = list(range(seq_len))  # inclusive
    width = window + max_image_tokens
    for s, e in spans:
        if not 0 <= s <= e < seq_len:
            raise ValueError(f"image span ({s}, {e}) outside a sequence of {seq_len}")
        if e - s + 1 > max_image_tokens:
            raise ValueError(f"image span of {e - s + 1} tokens exceeds max_image_tokens={max_image_tokens}")
        for i in range(s, e + 1):
            starts[i] = max(0, min(i - window + 1, s))
            ends[i] = min(starts[i] + width - 1, e)
    return starts, [e - s + 1 for s, e in zip(starts, ends)]


def _cut(spans, pos: int):
    """The span [s, e] that a boundary at `pos` (tokens before pos on one side) would split: s < pos <= e."""
    for s, e in spans:
        if s < pos <= e:
            return s, e
    return None


def atomic_chunk_end(spans, start: int, proposed_end: int) -> int:
    """The end (exclusive) of a prefill chunk that begins at `start`, moved so no image span is split: back
    to the span's start when that still makes progress, otherwise forward past the span's end (a span longer
    than the chunk is prefilled whole rather than stalled)."""
    if proposed_end <= start:
        raise ValueError(f"chunk [{start}, {proposed_end}) is empty")
    hit = _cut(spans, proposed_end)
    if hit is None:
        return proposed_end
    s, e = hit
    return s if s > start else e + 1


def atomic_prefix_len(spans, matched: int) -> int:
    """A reused cached prefix of `matched` tokens, cut back so it never ends strictly inside an image span
    (image queries need the whole span's keys, computed in one forward)."""
    hit = _cut(spans, matched)
    return matched if hit is None else hit[0]
