"""Vision-Exp geometry (vision_backport/image_processing.py, visible_window.py): the resize plan against the
release's worked examples, the token block against an independent traversal oracle,
and the visible window against a brute-force key set."""

import random

import pytest

from vision_backport import image_processing as ip
from vision_backport.visible_window import image_spans, visible_windows

# (input w x h) -> resized (w x h), ViT grid (w x h), LLM grid (h x w), grid tokens (block without alignment pad)
WORKED = [
    ((100, 100), (392, 392), (28, 28), (10, 10), 114),   # anything <= 384^2 (a red swatch): 117 with 3 pads
    ((384, 384), (392, 392), (28, 28), (10, 10), 114),
    ((640, 480), (644, 490), (46, 35), (12, 16), 206),
    ((1024, 1024), (756, 756), (54, 54), (18, 18), 346),  # the largest square
    ((1920, 1080), (1036, 588), (74, 42), (14, 25), 366),
    ((4000, 300), (2016, 252), (144, 18), (6, 48), 298),   # wider than 8:1: clamped, stretched
    ((300, 4000), (168, 2240), (12, 160), (54, 4), 274),   # very tall
]


@pytest.mark.parametrize("size,resized,vit,llm,tokens", WORKED, ids=[f"{w}x{h}" for (w, h), *_ in WORKED])
def test_plan_reproduces_the_reference_examples(size, resized, vit, llm, tokens):
    plan = ip.plan_image(*size)
    assert (plan.width, plan.height) == resized
    assert (plan.n_vit_w, plan.n_vit_h) == vit and (plan.n_llm_h, plan.n_llm_w) == llm
    assert plan.grid_tokens == tokens
    assert plan.stretch == (size[0] >= 8 * size[1])
    for start in range(4):  # with the 0-3 alignment pads the block stays within max_n_token
        assert len(ip.image_block(start, plan.n_llm_h, plan.n_llm_w)) == tokens + 3 - start % 4 <= 384


def test_plan_budget_holds_over_many_sizes():
    rng = random.Random(0)
    for _ in range(500):
        w, h = rng.randint(1, 6000), rng.randint(1, 6000)
        plan = ip.plan_image(w, h)
        assert plan.grid_tokens <= 381, (w, h, plan)
        assert plan.width % 14 == 0 and plan.height % 14 == 0 and plan.n_llm_h >= 1 and plan.n_llm_w >= 1
    with pytest.raises(ValueError, match="both sides must be positive"):
        ip.plan_image(0, 10)


def oracle_block(start_pos, n_h, n_w):
    """Slot types and perm by sorting grid cells on (row pair, column, row within the pair)."""
    rows = n_h + n_h % 2
    cells = []
    for r in range(rows):
        for c in range(n_w + 1):
            kind = ip.IMAGE_PAD if r >= n_h else (ip.IMAGE_NEW_LINE if c == n_w else ip.IMAGE)
            cells.append(((r // 2, c, r % 2), kind, r * n_w + c))
    cells.sort()
    grid = [k for _, k, _ in cells]
    perm = [i for _, k, i in cells if k == ip.IMAGE]
    lead = (3 - start_pos) % 4
    tail = (-len(grid)) % 4
    return [ip.IMAGE_PAD] * lead + [ip.IMAGE_START] + grid + [ip.IMAGE_PAD] * tail + [ip.IMAGE_END], perm


def test_block_layout_against_the_oracle_and_invariants():
    for n_h in range(1, 21):
        for n_w in range(1, 21):
            for start in (0, 1, 2, 3, 17):
                b = ip.image_block(start, n_h, n_w)
                want_types, want_perm = oracle_block(start, n_h, n_w)
                assert list(b.types) == want_types and list(b.perm) == want_perm, (n_h, n_w, start)
                s = start + b.start_offset
                assert s % 4 == 3 and (start + len(b) - 1) % 4 == 0
                assert b.types.count(ip.IMAGE) == len(b.perm) == n_h * n_w
                assert sorted(b.perm) == list(range(n_h * n_w))
                assert len(b) - b.start_offset == ip.grid_block_len(n_h, n_w)


def test_two_by_two_example():
    b = ip.image_block(3, 2, 2)  # START right at position 3: no alignment pad
    P, S, G, N, E = ip.IMAGE_PAD, ip.IMAGE_START, ip.IMAGE, ip.IMAGE_NEW_LINE, ip.IMAGE_END
    assert list(b.types) == [S, G, G, G, G, N, N, P, P, E] and list(b.perm) == [0, 2, 1, 3]


def brute_force_keys(seq_len, spans, window=128):
    out = []
    for i in range(seq_len):
        keys = set(range(max(0, i - window + 1), i + 1))
        for s, e in spans:
            if s <= i <= e:
                keys |= set(range(s, e + 1))
        out.append(keys)
    return out


def stream(rng, n_images):
    """A prompt of text runs and image blocks, as the processor lays it out; per-token types (None = text)."""
    types = []
    for _ in range(n_images):
        types += [None] * rng.randint(0, 300)
        b = ip.image_block(len(types), rng.randint(1, 18), rng.randint(1, 20))
        types += list(b.types)
    types += [None] * rng.randint(1, 200)
    return types


@pytest.mark.parametrize("n_images", [0, 1, 2, 3])
def test_visible_window_against_brute_force(n_images):
    rng = random.Random(n_images)
    for _ in range(4):
        types = stream(rng, n_images)
        spans = image_spans(types)
        assert len(spans) == n_images
        starts, lengths = visible_windows(len(types), spans)
        for i, keys in enumerate(brute_force_keys(len(types), spans)):
            assert set(range(starts[i], starts[i] + lengths[i])) == keys, i
            assert lengths[i] <= 512


def test_pads_before_start_stay_causal_and_partial_blocks_raise():
    b = ip.image_block(0, 2, 2)  # three alignment pads before START
    types = [None] * 5 + list(b.types)
    (s, e), = image_spans(types)
    assert types[s] == ip.IMAGE_START and s == 5 + 3  # the pads are outside the span
    with pytest.raises(ValueError, match="partial image block"):
        image_spans(types[:-1])


def test_image_patches_pad_normalise_and_stretch():
    import torch
    from PIL import Image

    red = Image.new("RGB", (300, 200), (255, 0, 0))  # up-scaled to the minimum, padded to the plan
    patches, plan = ip.image_patches(red)
    assert patches.dtype == torch.bfloat16 and patches.shape == (plan.n_vit_h * plan.n_vit_w, 3, 14, 14)
    assert not plan.stretch and patches.min() >= -1 and patches.max() <= 1
    grey = (127 / 255 - 0.5) / 0.5
    grid = patches.float().reshape(plan.n_vit_h, plan.n_vit_w, 3, 14, 14).permute(2, 0, 3, 1, 4)
    img = grid.reshape(3, plan.height, plan.width)
    assert torch.allclose(img[:, 0, 0], torch.tensor([grey] * 3), atol=1e-2)  # the pad band (top)
    mid = img[:, plan.height // 2, plan.width // 2]
    assert torch.allclose(mid, torch.tensor([1.0, -1.0, -1.0]), atol=1e-2)  # red, normalised
    wide = Image.new("RGB", (4000, 300), (0, 0, 255))  # wider than 8:1: stretched, no grey anywhere
    patches, plan = ip.image_patches(wide)
    assert plan.stretch and (plan.width, plan.height) == (2016, 252)
    assert torch.allclose(patches.float()[:, 2].mean(), torch.tensor(1.0), atol=1e-2)


def test_block_embeddings_place_rows_by_perm_and_sentinels_by_type():
    import torch

    b = ip.image_block(5, 3, 4)
    rows = torch.randn(12, 8)
    vec = {t: torch.full((8,), float(10 + t)) for t in (ip.IMAGE_START, ip.IMAGE_PAD, ip.IMAGE_NEW_LINE, ip.IMAGE_END)}
    emb = ip.block_embeddings(b, rows, vec)
    k = 0
    for slot, t in enumerate(b.types):
        if t == ip.IMAGE:
            assert torch.equal(emb[slot], rows[b.perm[k]])
            k += 1
        else:
            assert torch.equal(emb[slot], vec[t])
    assert k == 12
    with pytest.raises(ValueError, match="11 aligner rows for a block with 12 image slots"):
        ip.block_embeddings(b, rows[:11], vec)


def test_chunking_and_prefix_reuse_never_split_a_span():
    from vision_backport.visible_window import atomic_chunk_end, atomic_prefix_len

    rng = random.Random(5)
    for _ in range(20):
        types = stream(rng, rng.randint(1, 3))
        spans = image_spans(types)
        n = len(types)
        for start in range(0, n, 37):
            if any(s < start <= e for s, e in spans):
                continue  # a chunk never begins inside a span (the previous one was made atomic)
            for budget in (1, 64, 256, 640):
                end = atomic_chunk_end(spans, start, min(start + budget, n))
                assert end > start  # progress, also when a span is longer than the chunk
                assert not any(s < end <= e for s, e in spans)
                if not any(s < min(start + budget, n) <= e for s, e in spans):
                    assert end == min(start + budget, n)  # nothing to move
        for matched in range(0, n + 1, 13):
            cut = atomic_prefix_len(spans, matched)
            assert cut <= matched and not any(s < cut <= e for s, e in spans)
            assert cut == matched or any(s == cut and s < matched <= e for s, e in spans)
