"""bias_vl routing (vision_backport/routing.py) on mixed text/image batches against the model's gate,
transcribed per token from reference 03 §4.1 (float64, one row at a time)."""

import torch
import torch.nn.functional as F

from vision_backport.routing import vl_route


def gate_ref(logits, is_image, k, bias_vl, bias=None, tid2eid=None, token_id=None):
    scores = F.softplus(logits.double()).sqrt()
    if is_image:
        ids = torch.topk(scores + bias_vl.double(), k).indices
    elif tid2eid is not None:
        ids = tid2eid[token_id].long()
    else:
        ids = torch.topk(scores + bias.double(), k).indices
    w = scores[ids]
    return w / w.sum(), ids


def batch(seed, t=24, e=16, v=500):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(t, e, generator=g) * 2
    mask = torch.rand(t, generator=g) < 0.5
    bias, bias_vl = torch.randn(e, generator=g), torch.randn(e, generator=g) * 3
    tid2eid = torch.stack([torch.randperm(e, generator=g)[:6] for _ in range(v)]).to(torch.int32)
    ids = torch.randint(0, v, (t,), generator=g)
    ids[mask] = 1_000_000 + torch.arange(int(mask.sum()))  # image-block pad values, beyond the vocabulary
    return logits, mask, bias, bias_vl, tid2eid, ids


def check(got, want_rows):
    w, ids = got
    for r, (ww, ii) in enumerate(want_rows):
        order, worder = torch.argsort(ids[r].long()), torch.argsort(ii)
        assert torch.equal(ids[r].long()[order], ii[worder]), r
        assert torch.allclose(w[r][order].double(), ww[worder], atol=1e-6), r


def test_non_hash_layer_mixed_batch():
    for seed in range(3):
        logits, mask, bias, bias_vl, _, _ = batch(seed)
        got = vl_route(logits, mask, 6, bias_vl, bias=bias)
        check(got, [gate_ref(logits[r], bool(mask[r]), 6, bias_vl, bias=bias) for r in range(len(mask))])


def test_hash_layer_image_rows_skip_the_table():
    for seed in range(3):
        logits, mask, _, bias_vl, tid2eid, ids = batch(seed + 10)
        got = vl_route(logits, mask, 6, bias_vl, tid2eid=tid2eid, token_ids=ids)
        check(got, [gate_ref(logits[r], bool(mask[r]), 6, bias_vl, tid2eid=tid2eid, token_id=int(ids[r]))
                    for r in range(len(mask))])


def test_bias_vl_steers_only_image_rows():
    logits, mask, bias, _, _, _ = batch(20)
    steer = torch.zeros(16)
    steer[3] = 1e4
    _, ids = vl_route(logits, mask, 6, steer, bias=bias)
    assert all(3 in ids[r].tolist() for r in range(len(mask)) if mask[r])
    text = ~mask
    _, plain = vl_route(logits, torch.zeros_like(mask), 6, steer, bias=bias)
    assert torch.equal(ids[text], plain[text])  # text rows never see bias_vl
