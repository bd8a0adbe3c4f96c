"""dsv4_lab.vision.text on the CPU at toy size (top-2 of 6 experts so that a routing choice exists): no image rows
is the plain model bit for bit; image rows route by top-k of scores + bias_vl on every layer, hash layers
included, with unbiased weights, and text rows keep the library's choice; the visible window is bidirectional
inside [IMAGE_START, IMAGE_END] and causal elsewhere (alignment pads included), in the attention's own weights
too, with the compressed entries causal; the window against a brute force of its rule and of the reference's
(left, right, width) formula; gradients reach image rows, never bias_vl; bias_vl under its official names."""

import copy

import pytest
import torch

from dsv4_lab.train.model import build, official_config, official_names
from dsv4_lab.vision.text import (
    VisionText,
    add_bias_vl,
    bias_vl_weights,
    image_spans,
    load_bias_vl,
    visible_window,
    vision_forward,
)

V, S, H, E, K = 272, 160, 128, 6, 2
PAD_AT, START, END = 50, 51, 76  # one block: an alignment pad, then the span [START, END]
PINNED = {layer: 2 + layer for layer in range(4)}  # never in tid2eid[0] = {0, 1} (the table of an image row)


@pytest.fixture(scope="module")
def model():
    cfg = official_config("toy")
    cfg["num_experts_per_tok"] = K
    m = build(cfg, seed=0)
    g = torch.Generator().manual_seed(1)
    load_bias_vl(m, {f"layers.{i}.ffn.gate.bias_vl": torch.randn(E, generator=g) * 0.1 for i in range(4)})
    return m


def prompt(seed=0):
    """Reference-convention ids (vocab_size + type at image positions) and one embedding row per image position."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (1, S), generator=g)
    ids[0, PAD_AT], ids[0, START], ids[0, END] = V + 1, V + 0, V + 4
    ids[0, START + 1:END] = V + 2
    ids[0, START + 6:END:6] = V + 3  # a few NEW_LINE slots
    rows = torch.randn(END - PAD_AT + 1, H, generator=g) * 0.05
    return ids, rows


class Recorder:
    """Per layer: the router's output as the library made it and as the experts received it, and the attention's
    weights [B, H, S, S + compressed]."""

    def __init__(self, model):
        self.model, self.lib, self.final, self.probs, self.handles = model, {}, {}, {}, []

    def __enter__(self):
        for i, layer in enumerate(self.model.model.layers):
            gate = layer.mlp.gate
            # prepended after VisionText's own: runs before it, so it sees the library's routing
            self.handles.append(gate.register_forward_hook(
                lambda _m, _a, out, i=i: self.lib.__setitem__(i, [t.detach() for t in out]), prepend=True))
            self.handles.append(gate.register_forward_hook(
                lambda _m, _a, out, i=i: self.final.__setitem__(i, [t.detach() for t in out])))
            self.handles.append(layer.self_attn.register_forward_hook(
                lambda _m, _a, out, i=i: self.probs.__setitem__(i, out[1].detach())))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


def sorted_choice(idx, w):
    order = idx.argsort(dim=-1)
    return idx.gather(-1, order), w.gather(-1, order)


# (a) -----------------------------------------------------------------------------------------------------------

def test_no_image_rows_is_the_plain_model_bit_for_bit(model):
    ids, _ = prompt()
    ids = ids.clamp(max=V - 1)
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        wrapped = vision_forward(model, ids).logits
    assert torch.equal(plain, wrapped)


# (b) -----------------------------------------------------------------------------------------------------------

def test_image_rows_route_by_bias_vl_on_every_layer_and_text_rows_keep_theirs(model):
    m = copy.deepcopy(model)
    with torch.no_grad():
        for i, p in enumerate(bias_vl_weights(m).values()):
            p[PINNED[i]] = 1e4
    ids, rows = prompt()
    img = ids[0] >= V
    # entered after VisionText: the recorder's prepended hook runs before VisionText's, its appended one after
    with torch.no_grad(), VisionText(m, img[None], image_spans(ids, V), rows=rows), Recorder(m) as rec:
        m(input_ids=ids)
    for i, layer in enumerate(m.model.layers):
        gate = layer.mlp.gate
        logits, w, idx = rec.final[i]
        _, lib_w, lib_idx = rec.lib[i]
        # every image row, sentinels and the alignment pad included, picks the pinned expert, hash layers too
        assert bool((idx[img] == PINNED[i]).any(-1).all()), i
        # text rows: the library's ids and weights, bit for bit; on hash layers, the table's
        assert torch.equal(idx[~img], lib_idx[~img]) and torch.equal(w[~img], lib_w[~img]), i
        if hasattr(gate, "tid2eid"):
            assert torch.equal(idx[~img], gate.tid2eid[ids[0][~img]]), i
            assert not bool((lib_idx[img] == PINNED[i]).any()), i  # the table alone would never have chosen it
        # image rows: top-k of scores + bias_vl, weights from the unbiased scores (normalised, scaled)
        scores = gate.score_fn(logits[img])
        want = torch.topk(scores + gate.bias_vl, K, dim=-1).indices
        got_i, got_w = sorted_choice(idx[img], w[img])
        want_i = want.sort(dim=-1).values
        assert torch.equal(got_i, want_i), i
        unbiased = scores.gather(1, want_i)
        unbiased = unbiased / (unbiased.sum(-1, keepdim=True) + 1e-20) * gate.routed_scaling_factor
        assert torch.equal(got_w, unbiased), i
        biased = (scores + gate.bias_vl).gather(1, want_i)
        assert not torch.allclose(got_w, biased / biased.sum(-1, keepdim=True) * gate.routed_scaling_factor)


# (c) -----------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pinned(model):
    """The model with every routing choice fixed (image rows by bias_vl, text rows on the top-k layer by its
    correction bias, both onto the same two experts): each expert then sees the same rows under any
    perturbation, so bit-for-bit comparisons test causality, not the matmul's blocking of a changed row count."""
    m = copy.deepcopy(model)
    with torch.no_grad():
        for p in bias_vl_weights(m).values():
            p[:2] = 1e4
        m.model.layers[3].mlp.gate.e_score_correction_bias[:2] = 1e4
    return m


def test_window_is_bidirectional_inside_the_span_only(pinned):
    ids, rows = prompt(1)
    mask = ids >= V
    with torch.no_grad():
        base = vision_forward(pinned, ids, rows).logits[0]
        # the same forward given explicitly: mask, spans, rows by position, in-vocab ids at image positions
        by_pos = {PAD_AT + k: rows[k] for k in range(len(rows))}
        with VisionText(pinned, mask, [(START, END)], rows=by_pos):
            explicit = pinned(input_ids=ids.clamp(max=V - 1)).logits[0]
        assert torch.equal(base, explicit)
        moved = rows.clone()
        moved[-1] += 0.5  # the last image row: IMAGE_END's vector
        after = vision_forward(pinned, ids, moved).logits[0]
    assert not torch.equal(after[START], base[START])  # the span's first row sees its last
    assert torch.equal(after[:START], base[:START])  # before the span, the alignment pad included: untouched
    assert not torch.equal(after[END + 1:], base[END + 1:])


def test_text_only_prompt_stays_causal(pinned):
    ids, _ = prompt(2)
    ids = ids.clamp(max=V - 1)
    other = ids.clone()
    other[0, 100] = (other[0, 100] + 1) % V
    with torch.no_grad():
        a = vision_forward(pinned, ids).logits[0]
        b = vision_forward(pinned, other).logits[0]
    assert torch.equal(a[:100], b[:100]) and not torch.equal(a[100], b[100])


# (d) -----------------------------------------------------------------------------------------------------------

def union_rule(seq_len, spans, window):
    """Position by position, as documented: the causal window, plus the whole span for a query inside one."""
    out = torch.zeros(seq_len, seq_len, dtype=torch.bool)
    j = torch.arange(seq_len)
    for i in range(seq_len):
        span = next(((s, e) for s, e in spans if s <= i <= e), None)
        out[i] = (j > i - window) & (j <= i)
        if span is not None:
            out[i] |= (j >= span[0]) & (j <= span[1])
    return out


def reference_rule(seq_len, spans, window, max_image_tokens):
    """The note's 5.1 definitions per position: left/right counts clamped, row start, row width, keys <= i + right."""
    out = torch.zeros(seq_len, seq_len, dtype=torch.bool)
    width = min(seq_len, window + max_image_tokens)
    for i in range(seq_len):
        span = next(((s, e) for s, e in spans if s <= i <= e), None)
        left = min(i - span[0], max_image_tokens - 1) if span else 0
        right = min(span[1] - i, max_image_tokens) if span else 0
        start = max(0, i - (window - 1) - max(0, left - (window - 1)))
        idx = torch.arange(start, start + width)  # the row's `width` slots, -1 past i + right
        out[i, idx[(idx <= i + right) & (idx < seq_len)]] = True
    return out


@pytest.mark.parametrize("seq_len,spans", [
    (40, [(3, 30)]),                                   # shorter than the window
    (700, [(0, 4), (6, 40), (150, 500), (520, 530), (600, 699)]),  # a span of 351 reaching far past the window
    (300, []),
])
def test_visible_window_against_brute_force(seq_len, spans):
    got = visible_window(seq_len, spans, 128, 384)
    assert torch.equal(got, union_rule(seq_len, spans, 128))
    assert torch.equal(got, reference_rule(seq_len, spans, 128, 384))


def test_window_refuses_what_a_block_cannot_be():
    with pytest.raises(ValueError, match="exceeds"):
        visible_window(600, [(10, 394)], 128, 384)  # 385 positions: the reference's clamps would bind
    with pytest.raises(ValueError, match="overlaps"):
        visible_window(100, [(10, 20), (20, 30)], 128, 384)
    with pytest.raises(ValueError, match="never closed"):
        image_spans(torch.tensor([[1, V, V + 2]]), V)


def test_image_rows_without_a_span_are_refused(model):
    mask = torch.zeros(1, S, dtype=torch.bool)
    mask[0, 40:60] = True
    rows = torch.zeros(20, H)
    with pytest.raises(ValueError, match="neither in a span"):
        VisionText(model, mask, [], rows=rows)  # image rows, no span: the window would silently stay causal
    with pytest.raises(ValueError, match="neither in a span"):
        VisionText(model, mask, [(44, 58)], rows=rows)  # 4 leading pads, one trailing position
    VisionText(model, mask, [(43, 59)], rows=rows)  # 3 alignment pads, then START .. END


def test_attention_sees_the_window_and_compressed_entries_stay_causal(model):
    ids, rows = prompt(3)
    with torch.no_grad():
        with Recorder(model) as vis:
            vision_forward(model, ids, rows)
        with Recorder(model) as plain:
            model(input_ids=ids.clamp(max=V - 1))
    rule = visible_window(S, [(START, END)], 128)
    causal = visible_window(S, [], 128)
    for i, probs in vis.probs.items():
        seen = (probs[0] > 0).all(0)  # every head: no weight underflows to zero at these scales
        assert torch.equal(seen[:, :S], rule), i
        assert torch.equal((plain.probs[i][0] > 0).all(0)[:, :S], causal), i  # the library's own window
        # compressed entries (C4 via the indexer, C128): the same causal support as the plain model's
        assert torch.equal(seen[:, S:], (plain.probs[i][0] > 0).all(0)[:, S:]), i


# (e) -----------------------------------------------------------------------------------------------------------

def test_gradients_reach_image_rows_not_bias_vl(model):
    m = copy.deepcopy(model)
    for p in bias_vl_weights(m).values():
        p.requires_grad_(True)  # even when asked for, none arrives: bias_vl only moves a top-k choice
    ids, rows = prompt(4)
    rows = rows.clone().requires_grad_(True)
    labels = ids.clamp(max=V - 1)
    out = vision_forward(m, ids, rows, labels=labels)
    out.loss.backward()
    assert rows.grad is not None and bool((rows.grad.abs().sum(-1) > 0).all())
    assert all(p.grad is None for p in bias_vl_weights(m).values())
    assert m.model.layers[3].mlp.gate.weight.grad.abs().sum() > 0  # the router still learns through the weights


def test_bias_vl_official_names(model):
    params = bias_vl_weights(model)
    assert list(params) == [f"layers.{i}.ffn.gate.bias_vl" for i in range(4)]
    names = official_names(model)
    for i in range(4):
        assert names[f"model.layers.{i}.mlp.gate.bias_vl"] == [(f"layers.{i}.ffn.gate.bias_vl", None)]
        assert params[f"layers.{i}.ffn.gate.bias_vl"].dtype == torch.float32
    assert not any(p.requires_grad for p in params.values())
    from dsv4_lab.train.draft import Draft

    draft = Draft(official_config("toy"))
    got = add_bias_vl(draft)
    assert list(got) == [f"mtp.{j}.ffn.gate.bias_vl" for j in range(draft.n)]
    exported = draft.official_weights(model)
    assert all(name in exported for name in got)
