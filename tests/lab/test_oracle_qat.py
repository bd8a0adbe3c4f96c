"""R_q's roundings against hand-computed blocks (scale rule, saturation, round-half-even ties, the amax
floors, rope dims untouched), and the hooks change the reference's output only where they should."""

import pytest
import torch
import torch.nn.functional as F

from dsv4_lab.oracle import numerics, rounding
from dsv4_lab.oracle.numerics import NUMERICS, Numerics, applied
from dsv4_lab.oracle.rounding import fp4_e2m1_simulate, fp8_e4m3_simulate, hadamard, pow2_scale


def _block(values, n, fill=0.0):
    return torch.tensor(list(values) + [fill] * (n - len(values)), dtype=torch.float32)


# --- the rounding functions ------------------------------------------------------------------------------


def test_scale_is_the_next_power_of_two_of_amax_over_max():
    amax = torch.tensor([448.0, 449.0, 224.0, 1000.0, 6.0, 0.0])
    assert pow2_scale(amax[:4], 448.0, 1e-4).tolist() == [1.0, 2.0, 0.5, 4.0]
    assert pow2_scale(torch.tensor([6.0, 6.5, 2.9]), 6.0, 6 * 2.0 ** -126).tolist() == [1.0, 2.0, 0.5]
    # the amax floors: 1e-4 / 448 = 2^-22.09 -> 2^-22; 6 * 2^-126 / 6 -> 2^-126
    assert pow2_scale(torch.tensor([0.0, 1e-9]), 448.0, 1e-4).tolist() == [2.0 ** -22] * 2
    assert pow2_scale(torch.tensor([0.0]), 6.0, 6 * 2.0 ** -126).tolist() == [2.0 ** -126]


def test_fp8_block_values_ties_and_scale():
    # scale 1 (amax 448): e4m3 spacing 1/8 in [1, 2): 1.0625 ties to 1.0 (even), 1.1875 to 1.25 (even);
    # 250 lies in [128, 256) with spacing 16 -> 256; subnormal tie 1.5 * 2^-9 -> 2^-8
    x = _block([448.0, 1.0625, 1.1875, -1.0625, 250.0, 1.5 * 2 ** -9, 3.0], 64)
    want = _block([448.0, 1.0, 1.25, -1.0, 256.0, 2.0 ** -8, 3.0], 64)
    assert torch.equal(fp8_e4m3_simulate(x, 64), want)
    # the same block scaled by 2^5: same codes, scale 32
    assert torch.equal(fp8_e4m3_simulate(x * 32, 64), want * 32)
    # blocks are independent: a second block of small values gets its own scale
    two = torch.cat([x, _block([0.001], 64)])
    got = fp8_e4m3_simulate(two, 64)
    # 0.001 / 2^-18 (amax 0.001 / 448 -> 2^-18.77 -> 2^-18) = 262.1 -> 256 (spacing 16)
    assert got[64].item() == 256 * 2.0 ** -18 and torch.equal(got[:64], want)


def test_fp8_amax_floor_and_saturation(monkeypatch):
    assert torch.equal(fp8_e4m3_simulate(torch.zeros(2, 64)), torch.zeros(2, 64))
    # 1e-6 under the floor's scale 2^-22: 1e-6 * 2^22 = 4.19 -> 4 (spacing .5 in [4, 8))
    assert fp8_e4m3_simulate(_block([1e-6], 64))[0].item() == 4.0 * 2.0 ** -22
    big = fp8_e4m3_simulate(_block([3e38, -1.0], 64))
    assert torch.isfinite(big).all()
    # saturating, not NaN: with a scale too small for the block, the values clamp at +-448
    monkeypatch.setattr(rounding, "pow2_scale", lambda amax, *_: torch.ones_like(amax))
    assert fp8_e4m3_simulate(_block([1000.0, -600.0, 5.0], 64))[:3].tolist() == [448.0, -448.0, 5.0]
    assert fp4_e2m1_simulate(_block([9.0, -7.0, 2.5], 32))[:3].tolist() == [6.0, -6.0, 2.0]


def test_fp4_block_values_ties_and_floor():
    # scale 1 (amax 6): ties to even on the grid 0 .5 1 1.5 2 3 4 6
    x = _block([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -2.5, -0.3, 4.9], 32)
    want = _block([6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -2.0, -0.5, 4.0], 32)
    assert torch.equal(fp4_e2m1_simulate(x), want)
    assert torch.equal(fp4_e2m1_simulate(x / 8), want / 8)  # scale 2^-3
    # amax 6.5 -> scale 2: 6.5 / 2 = 3.25 -> 3 -> 6
    assert fp4_e2m1_simulate(_block([6.5], 32))[0].item() == 6.0
    # the floor 6 * 2^-126: scale 2^-126; 2^-127 is .5 of it (kept), 2^-128 a tie at .25 (to 0)
    tiny = fp4_e2m1_simulate(_block([2.0 ** -127, 2.0 ** -128], 32))
    assert tiny[:2].tolist() == [2.0 ** -127, 0.0]
    assert torch.equal(fp4_e2m1_simulate(torch.zeros(32)), torch.zeros(32))


def _nearest_even(v, grid, mantissa_even):
    """The grid value nearest to v, ties to the one with an even mantissa (written from the definition)."""
    best = min(abs(v - g) for g in grid)
    near = [g for g in grid if abs(v - g) == best]
    return near[0] if len(near) == 1 else next(g for g in near if mantissa_even(g))


def test_rounding_primitives_match_the_format_tables():
    import numpy as np

    from reference import e2m1_table, e4m3_table

    e4m3 = sorted({float(x) for x in e4m3_table() if np.isfinite(x)})
    e2m1 = sorted({float(x) for x in e2m1_table()})
    codes4 = {float(v): c for c, v in enumerate(e4m3_table()) if np.isfinite(v) and c < 128}
    codes2 = {float(v): c for c, v in enumerate(e2m1_table()) if c < 8}
    g = torch.Generator().manual_seed(3)
    # every midpoint between neighbours (the ties), and random values across the range
    mids8 = [(a + b) / 2 for a, b in zip(e4m3, e4m3[1:])]
    mids4 = [(a + b) / 2 for a, b in zip(e2m1, e2m1[1:])]
    vals8 = torch.tensor(mids8 + (torch.rand(2000, generator=g) * 896 - 448).tolist())
    vals4 = torch.tensor(mids4 + (torch.rand(500, generator=g) * 12 - 6).tolist())
    got8, got4 = rounding.round_e4m3(vals8).tolist(), rounding.round_e2m1(vals4).tolist()
    for v, r in zip(vals8.tolist(), got8):
        assert r == _nearest_even(v, e4m3, lambda x: codes4[abs(x)] % 2 == 0), v
    for v, r in zip(vals4.tolist(), got4):
        assert r == _nearest_even(v, e2m1, lambda x: codes2[abs(x)] % 2 == 0), v


def test_hadamard_is_the_normalised_sylvester_matrix():
    h4 = torch.tensor([[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]], dtype=torch.float32) / 2
    assert torch.allclose(hadamard(torch.eye(4)), h4)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(hadamard(hadamard(x)), x, atol=1e-5)
    with pytest.raises(ValueError, match="power of two"):
        hadamard(torch.ones(3, 96))


# --- the hooks on the reference model --------------------------------------------------------------------


@pytest.fixture(scope="module")
def ref_model(unit_ckpt):
    pytest.importorskip("accelerate")
    from dsv4_lab.oracle.load import load_reference

    return load_reference(unit_ckpt)


SEQ = [(29 * i + 7) % 1000 + 2 for i in range(24)]  # 6 C4 entries: the indexer (top-512) keeps them all


def _logits(model, seq=SEQ):
    with torch.no_grad():
        return model(input_ids=torch.tensor([seq]), use_cache=False).logits


def _capture(module, pre=True):
    seen = []
    if pre:
        h = module.register_forward_pre_hook(lambda _m, a: seen.append([t.clone() for t in a]))
    else:
        h = module.register_forward_hook(lambda _m, _a, o: seen.append(o.clone()))
    return seen, h


def test_r_x_is_unchanged_after_the_hooks_and_r_q_differs(ref_model):
    before = _logits(ref_model)
    with applied(ref_model, NUMERICS["R_q"]):
        rq = _logits(ref_model)
    after = _logits(ref_model)
    assert torch.equal(before, after)
    assert not torch.allclose(before, rq, atol=1e-4)
    assert all("forward" not in vars(layer.mlp.experts) for layer in ref_model.model.layers)
    for name in ("kv", "activations"):
        with applied(ref_model, Numerics(**{name: True})):
            assert not torch.allclose(before, _logits(ref_model), atol=1e-5), name


def test_kv_rounding_leaves_rope_dims_untouched(ref_model):
    attn = ref_model.model.layers[2].self_attn  # a C4 layer: window KV and compressed KV
    nope = ref_model.config.head_dim - numerics.rope_dim(ref_model.config)
    assert nope == 448
    norms = (attn.kv_norm, attn.compressor.kv_norm)
    with applied(ref_model, Numerics(kv=True)):
        # registered after the rounding hooks, so they see their results
        seen = [(_capture(n), _capture(n, pre=False)) for n in norms]
        _logits(ref_model)
        for (_, h_in), (_, h_out) in seen:
            h_in.remove()
            h_out.remove()
    for norm, ((inputs, _), (outputs, _)) in zip(norms, seen):
        with torch.no_grad():
            exact = norm(inputs[0][0])
        rounded = outputs[0]
        assert torch.equal(rounded[..., nope:], exact[..., nope:])
        assert torch.equal(rounded[..., :nope], fp8_e4m3_simulate(exact[..., :nope], 64))
        assert not torch.equal(rounded, exact)


def test_indexer_rounds_its_query_and_keys_only(ref_model):
    scorer = ref_model.model.layers[2].self_attn.compressor.indexer.scorer
    exact, h = _capture(scorer)
    base = _logits(ref_model)
    h.remove()
    with applied(ref_model, Numerics(indexer=True)):
        rounded, h = _capture(scorer)  # after the rounding pre-hook: sees its result
        hooked = _logits(ref_model)
        h.remove()
    (q, k, hid), (q_r, k_r, hid_r) = exact[0], rounded[0]
    assert torch.equal(q_r, fp4_e2m1_simulate(hadamard(q), 32)) and torch.equal(k_r, fp4_e2m1_simulate(hadamard(k), 32))
    assert torch.equal(hid_r, hid)
    # where the indexer keeps every visible entry its rounding changes no choice, so nothing downstream
    assert torch.equal(base, hooked)


def test_indexer_rounding_can_change_a_sparse_choice(ref_model):
    from dsv4_lab.oracle.numerics import ChoiceRecorder

    indexer = ref_model.model.layers[2].self_attn.compressor.indexer
    keep = indexer.index_topk
    indexer.index_topk = 1  # select sparsely at 24 tokens
    try:
        runs = []
        for n in (NUMERICS["R_x"], Numerics(indexer=True)):
            with applied(ref_model, n), torch.no_grad(), ChoiceRecorder(ref_model) as rec:
                ref_model(input_ids=torch.tensor([SEQ]), use_cache=False)
            runs.append(rec)
    finally:
        indexer.index_topk = keep
    gaps = runs[0].indexer_gap[2]
    assert torch.isnan(gaps[:7]).all() and (gaps[7:] >= 0).all()  # selects once 2+ entries are visible
    assert runs[0].indexer[2].shape == (len(SEQ), 1)
    assert not torch.equal(runs[0].indexer[2], runs[1].indexer[2])


def test_activation_rounding_on_the_fp8_linears(ref_model):
    attn = ref_model.model.layers[0].self_attn
    lins = (attn.q_a_proj, attn.o_a_proj)
    exact = [_capture(m) for m in lins]
    _logits(ref_model)
    for _, h in exact:
        h.remove()
    with applied(ref_model, Numerics(activations=True)):
        hooked = [_capture(m) for m in lins]
        _logits(ref_model)
        for _, h in hooked:
            h.remove()
    (q_exact, q_hooked), (o_hooked,) = (exact[0][0][0][0], hooked[0][0][0][0]), hooked[1][0][0]
    # the first linear: its input precedes every rounding
    assert torch.equal(q_hooked, fp8_e4m3_simulate(q_exact, 128))
    # wo_a is a BF16 einsum in the official code: its input is never rounded (only changed upstream)
    assert not torch.equal(o_hooked, fp8_e4m3_simulate(o_hooked, 128))


def test_routed_experts_follow_the_official_order(ref_model):
    experts = ref_model.model.layers[3].mlp.experts
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, ref_model.config.hidden_size, generator=g)
    idx = torch.tensor([[0, 2, 5, 1, 3, 4], [5, 6, 7, 0, 1, 2], [7, 2, 3, 4, 5, 6]])
    w = torch.rand(3, 6, generator=g)
    with applied(ref_model, Numerics(activations=True)):
        got = experts(x, idx, w)
    want = torch.zeros_like(x)
    xq = fp8_e4m3_simulate(x, 128)
    inter = experts.down_proj.shape[-1]
    for t in range(3):
        for s in range(6):
            e = int(idx[t, s])
            gate, up = F.linear(xq[t], experts.gate_up_proj[e]).split(inter)
            act = F.silu(gate.clamp(max=10.0)) * up.clamp(-10.0, 10.0) * w[t, s]
            want[t] += F.linear(fp8_e4m3_simulate(act, 128), experts.down_proj[e])
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(experts(x, idx, w), got, rtol=1e-4)  # unhooked: exact activations
