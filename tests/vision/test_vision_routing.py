"""bias_vl routing (vision_backport/routing.py) on mixed text/image batches against the model's gate,
transcribed per token from the routing rule (float64, one row at a time)."""

import pytest
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


HOOKS = """
import json, os, sys
import torch
sys.path.insert(0, {root!r})
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler
set_global_server_args_for_scheduler(ServerArgs(model_path={ckpt!r}, device="cpu", skip_tokenizer_init=True))
from sglang.srt.layers.moe.topk import TopK, TopKOutputFormat
from sglang.srt.layers.moe.hash_topk import HashTopK
from vision_backport import routing as R
from dsv4_lab import routes as L
from dsv4_lab.seams import LAB_SEAMS
from dsv4_sm80 import apply
from dsv4_sm80.seams import SEAMS
from vision_backport.seams import VISION_SEAMS

def stacked(target, *hooks):  # target wrapped by the named seams' hooks in table order, as the applier stacks them
    fn = target
    for name, hook in hooks:
        fn = apply._wrap(next(s for s in (*SEAMS, *VISION_SEAMS, *LAB_SEAMS) if s.name == name), fn, hook)
    return fn

TOPK = stacked(TopK.forward_native, ("vision.topk", R.topk_with_vl), ("lab.route_trace_topk", L.topk))
HASH = stacked(HashTopK.forward, ("vision.hash_topk", R.hash_topk_with_vl), ("lab.route_trace_hash", L.hash_topk))
g = torch.Generator().manual_seed(5)
T, E, K, V = 11, 16, 6, 1000
logits = torch.randn(T, E, generator=g)
bias, bias_vl = torch.randn(E, generator=g) * 0.3, torch.randn(E, generator=g) * 0.3
mask = torch.tensor([0, 1, 1, 0, 1, 1, 1, 0, 0, 1, 0], dtype=torch.bool)
ids_tok = torch.randint(0, V, (T,), generator=g)
ids_tok[mask] = 1_000_000 + torch.arange(int(mask.sum()))  # SGLang's pad values: past the vocabulary
hidden = torch.zeros(T, 8)
out = {{}}
trace = os.path.join({tmp!r}, "route.jsonl")
os.environ["DSV4_SM80_LAB_ROUTE_TRACE"] = trace

def rows(w, i):
    o = i.long().argsort(1)
    return w.gather(1, o).double(), i.long().gather(1, o)

for scaled in (False,):  # SGLang's torch-native TopK (the CPU path) does not scale on output
    tk = TopK(top_k=K, layer_id=3, renormalize=True, use_grouped_topk=False, scoring_func="sqrtsoftplus",
              correction_bias=bias, routed_scaling_factor=1.5, apply_routed_scaling_factor_on_output=scaled,
              output_format=TopKOutputFormat.STANDARD)
    tk.correction_bias_vl = bias_vl
    plain = TopK.forward_native(tk, hidden, logits)
    with R.image_rows(mask):
        got = TOPK(tk, hidden, logits)
    with R.image_rows(None):
        untouched = TOPK(tk, hidden, logits)
    want_w, want_i = R.vl_route(logits, mask, K, bias_vl, bias=bias)
    gw, gi = rows(got.topk_weights, got.topk_ids)
    ww, wi = rows(want_w * (1.5 if scaled else 1.0), want_i)
    pw, pi = rows(plain.topk_weights, plain.topk_ids)
    out["topk_differ"] = int(((wi != pi).any(-1) & mask).sum())
    out[f"topk{{int(scaled)}}"] = dict(ids=torch.equal(gi, wi), w=float((gw - ww).abs().max()),
                                       text_same=(torch.equal(gi[~mask], pi[~mask])
                                                  and torch.equal(gw[~mask], pw[~mask])),
                                       no_mask_same=torch.equal(untouched.topk_ids, plain.topk_ids))
os.environ["SGLANG_OPT_USE_FUSED_HASH_TOPK"] = "0"
hk = HashTopK(topk=K, num_experts=E, num_fused_shared_experts=0, vocab_size=V, scoring_func="sqrtsoftplus",
              routed_scaling_factor=1.5)
tid2eid = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(V)]).to(torch.int32)
hk.tid2eid.data.copy_(tid2eid)
hk.correction_bias_vl = bias_vl
with R.image_rows(mask):
    got = HASH(hk, hidden, logits, ids_tok)
want_w, want_i = R.vl_route(logits, mask, K, bias_vl, tid2eid=tid2eid, token_ids=ids_tok)
gw, gi = rows(got.topk_weights, got.topk_ids)
ww, wi = rows(want_w, want_i)
out["hash"] = dict(ids=torch.equal(gi, wi), w=float((gw - ww).abs().max()))
try:
    HashTopK.forward(hk, hidden, logits, ids_tok)
    out["hash_unpatched"] = "ran"
except Exception as e:
    out["hash_unpatched"] = type(e).__name__
out["trace"] = [json.loads(x) for x in open(trace)]
print(json.dumps(out))
"""


@pytest.mark.sglang
def test_hooks_route_image_rows_by_bias_vl_in_sglangs_topk(unit_ckpt, tmp_path):
    """SGLang's own TopK (DSV4 settings: ungrouped sqrtsoftplus with the correction bias) and HashTopK, run
    through the hooks on a mixed text/image batch: image rows equal the bias_vl reference (vl_route), text
    rows stay SGLang's own, the routed scaling applied exactly where the layer applies it; hash layers
    never index their token table with an image pad value (which, unpatched, is out of range)."""
    pytest.importorskip("sglang", reason="CI installs sglang==0.5.16; this check needs it")

    from conftest import REPO as root
    from conftest import last_json, run_python
    out = last_json(run_python(HOOKS.format(root=root, ckpt=unit_ckpt, tmp=str(tmp_path)), TORCHDYNAMO_DISABLE="1"))
    for key in ("topk0",):
        r = out[key]
        assert r["ids"] and r["text_same"] and r["no_mask_same"] and r["w"] < 1e-6, (key, r)
    assert out["hash"]["ids"] and out["hash"]["w"] < 1e-6, out["hash"]
    assert out["hash_unpatched"] in ("IndexError", "RuntimeError"), out
    # DSV4_SM80_LAB_ROUTE_TRACE (the lab's seams on the vision hooks): one line per call that had image rows (the
    # no-mask call writes none)
    topk, hashed = out["trace"]
    assert topk == {"kind": "topk", "rows": 11, "image_rows": 6, "image_rows_bias_vl": 6,
                    "image_rows_differ_from_text_rule": out["topk_differ"], "text_rows_changed": 0}, out
    assert out["topk_differ"] > 0
    assert hashed["kind"] == "hash" and hashed["image_rows"] == hashed["image_rows_bias_vl"] == 6, hashed
    assert hashed["text_rows_changed"] == 0 and hashed["image_rows_differ_from_text_rule"] > 0, hashed


def test_with_image_rows_scales_only_where_the_layer_does():
    from vision_backport.routing import with_image_rows

    g = torch.Generator().manual_seed(2)
    logits, bias_vl = torch.randn(4, 8, generator=g), torch.randn(8, generator=g)
    ids = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]], dtype=torch.int32)
    w = torch.full((4, 2), 0.5)
    mask = torch.tensor([False, True, False, True])
    w1, i1 = with_image_rows(w, ids, logits, mask, bias_vl, True, 1.0)
    w2, i2 = with_image_rows(w, ids, logits, mask, bias_vl, True, 1.5)
    assert torch.equal(i1, i2) and torch.equal(w2[mask], w1[mask] * 1.5) and torch.equal(w2[~mask], w[~mask])
    assert torch.equal(i1[~mask], ids[~mask]) and torch.allclose(w1[mask].sum(1), torch.ones(2))
