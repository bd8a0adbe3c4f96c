"""dsv4_lab.train at toy size on the CPU: a few QAT steps lower the loss on a fixed batch of real text, the
DSPARK draft trains against the frozen target, the written checkpoint passes the gate's checkpoint checks and
loads in the oracle with the trained weights (within FP8 / MXFP4 / BF16 rounding), the held-out split is
deterministic, bits per byte on a hand-made case, byte ids as the stand-in tokenizer's."""

import json
import math
import os
import zlib

import pytest
import torch

pytest.importorskip("accelerate")  # transformers' FP8 dequantizing loader needs it

from dsv4_lab.train import data  # noqa: E402
from dsv4_lab.train.draft import Draft, init_draft  # noqa: E402
from dsv4_lab.train.model import build, official_config, official_names, official_weights  # noqa: E402
from dsv4_lab.train.train import train_draft, train_target, write_checkpoint  # noqa: E402


def test_held_out_split_is_deterministic_by_file():
    train, held = data.split()
    assert (train, held) == data.split()
    assert held and train and not set(train) & set(held)
    assert all(data.is_held_out(f) for f in held) and not any(data.is_held_out(f) for f in train)
    # the rule is a function of the relative path alone
    assert data.is_held_out("json/decoder.py") == (zlib.crc32(b"json/decoder.py") % 100 < data.HELD_OUT_PERCENT)


def test_bits_per_byte_hand_case():
    # two predicted bytes at p = 1/2 and 1/4, a BOS target ignored: (1 + 2) bits over 2 bytes
    b0, b1 = data.BYTE_BASE + ord("a"), data.BYTE_BASE + ord("b")
    ids = torch.tensor([data.BOS, b0, b1, data.BOS])
    logits = torch.full((4, 300), -1e9)
    logits[0, b0] = logits[0, 7] = 0.0            # p(b0) = 1/2
    logits[1, b1] = 0.0
    logits[1, 8:11] = 0.0                          # p(b1) = 1/4
    logits[2, data.BOS] = 0.0
    nll, n = data.sequence_nll(logits, ids)
    assert n == 2
    assert data.bits_per_byte(nll, n) == pytest.approx(1.5, abs=1e-9)
    with pytest.raises(ValueError, match="bits per byte"):
        data.bits_per_byte(1.0, 0)


def test_byte_ids_are_the_stand_in_tokenizers(tmp_path):
    from tokenizers import Tokenizer

    from dsv4_sm80.tiny.tokenizer import write_tokenizer

    write_tokenizer(str(tmp_path), 272)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    text = "def f(x):\n    return 'é' * 2\n"
    assert tok.encode(text).ids == data.encode(text.encode())[1:].tolist()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    torch.manual_seed(0)
    cfg = official_config("toy")
    _, held = data.split()
    ids = data.token_stream(held[:1])[:129]
    batch = torch.stack([ids[:64], ids[64:128]])
    target = build(cfg, seed=0)
    losses = train_target(target, lambda step: batch, 5, "cpu", peak_lr=3e-3, log=lambda *_: None)["losses"]
    draft = Draft(cfg)
    init_draft(draft, 0)
    dl = train_draft(draft, target, lambda step: batch, 2, "cpu", anchors_per_row=8, log=lambda *_: None)["losses"]
    out = str(tmp_path_factory.mktemp("train") / "ckpt")
    write_checkpoint(out, cfg, target, draft, 0, log=lambda *_: None)
    return cfg, target, draft, losses, dl, out, batch


def test_qat_steps_lower_the_loss_on_a_fixed_batch(trained):
    _, _, _, losses, draft_losses, _, _ = trained
    assert all(math.isfinite(x) for x in losses + draft_losses)
    assert losses[-1] < losses[0] - 0.3, losses


def test_written_checkpoint_passes_the_gate_and_loads_trained_weights_in_the_oracle(trained):
    from dsv4_lab.oracle.load import load_reference
    from dsv4_lab.train.check import gate_findings
    from dsv4_sm80.gate.report import failures

    cfg, target, _, _, _, out, batch = trained
    findings = gate_findings(out)
    assert not failures(findings), failures(findings)
    assert {f.check for f in findings} >= {"model.keys", "model.dense_fp8", "model.experts", "model.tokenizer"}
    ref = load_reference(out)
    got, want = ref.state_dict(), target.state_dict()
    quantized = {n for n, pairs in official_names(target).items()
                 if any(o.endswith(".weight") and (".experts." in o or _fp8(cfg, o)) for o, _ in pairs)}
    for name, w in want.items():
        g = got[name].float()
        err = float((g - w.float()).norm() / w.float().norm().clamp_min(1e-12))
        bound = 0.2 if ".experts." in name else 0.05 if name in quantized else 5e-3  # MXFP4, FP8, BF16
        assert err < bound, (name, err)
    with torch.no_grad():
        a = ref(input_ids=batch).logits
        b = target(input_ids=batch).logits
    assert torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1] > 0.99


def _fp8(cfg, name):
    from dsv4_sm80.checkpoint import format as fmt

    return any(s.name == name and s.init == "fp8" for s in fmt.inventory(cfg))


def test_draft_tensors_are_written_under_the_official_names(trained):
    _, target, draft, _, _, out, _ = trained
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        names = set(json.load(f)["weight_map"])
    mtp = {n for n in names if n.startswith("mtp.")}
    assert mtp and "mtp.0.main_proj.weight" in mtp and "mtp.2.markov_head.markov_w2.weight" in mtp
    assert len(draft.official_weights(target)) == len([n for n in mtp if not n.endswith(".scale")])


def test_draft_block_sees_a_128_entry_window_and_itself_in_any_order(trained):
    """The draft attention facts taken from SGLang: block queries see the last 128 context positions (not
    earlier ones) and every block entry, later ones included; the first position's prediction is the
    token after the bonus token."""
    cfg, target, draft, _, _, _, _ = trained
    g = draft.gamma
    torch.manual_seed(1)
    S = 200
    ids = torch.randint(data.BYTE_BASE, 270, (1, S))
    feats = torch.randn(1, S, draft.n, int(cfg["hidden_size"]))
    anchors = torch.tensor([[0, 150]])
    with torch.no_grad():
        base, _, labels = draft(target, ids, feats, anchors)
        far = feats.clone()
        far[:, :150 - 128] += 5.0                     # context older than the window: no effect
        assert torch.equal(draft(target, ids, far, anchors)[0], base)
        near = feats.clone()
        near[:, 150 - 1] += 5.0                       # the newest context entry: every block position moves
        moved = (draft(target, ids, near, anchors)[0] - base).abs().amax(-1)[0]
        assert bool((moved > 0).all())
    assert labels[0].tolist() == ids[0, 151:151 + g].tolist()
    # no causal order inside the block: position 0 depends on block entries after it (the noise rows)
    blocks = []
    orig = target.model.embed_tokens.forward

    def embed(x):
        e = orig(x)
        if x.shape[-1] == g:
            e = e.clone()
            e[:, -1] += 1.0
        blocks.append(e)
        return e
    target.model.embed_tokens.forward = embed
    try:
        with torch.no_grad():
            late = draft(target, ids, feats, anchors)[0]
    finally:
        del target.model.embed_tokens.forward
    assert blocks and float((late[0, 0] - base[0, 0]).abs().amax()) > 0


def test_batches_are_seeded_and_mix_short_and_long_windows():
    stream = torch.arange(10_000)
    b = data.Batches(stream, seed=3, short_len=16, short_batch=4, long_len=2100, long_every=4)
    shapes = [tuple(b(i).shape) for i in range(8)]
    assert shapes == [(4, 16)] * 3 + [(1, 2100)] + [(4, 16)] * 3 + [(1, 2100)]
    assert torch.equal(b(5), data.Batches(stream, 3, 16, 4, 2100, 4)(5))
    assert not torch.equal(b(5), data.Batches(stream, 4, 16, 4, 2100, 4)(5))
    with pytest.raises(ValueError, match="lower --seq"):
        data.Batches(torch.arange(100), 0, 16, 4, 2100, 4)


def test_writer_refuses_weights_that_do_not_match_the_inventory(trained, tmp_path):
    from dsv4_sm80.tiny.generate import TinyConfigError, generate

    cfg, target, draft, _, _, _, _ = trained
    weights = {**official_weights(target), **draft.official_weights(target)}
    del weights["embed.weight"]
    with pytest.raises(TinyConfigError, match=r"given weights: 1 missing \['embed.weight'\]"):
        generate(str(tmp_path / "ckpt"), cfg, weights=weights, log=lambda *_: None)
    assert not (tmp_path / "ckpt").exists()  # refused before anything is written


def test_only_the_distillation_loss_reaches_the_indexer(trained):
    from dsv4_lab.train.model import indexer_distillation, qat

    cfg, target, _, _, _, _, batch = trained
    indexer = target.model.layers[2].self_attn.compressor.indexer
    for p in target.parameters():  # the draft's training froze the target
        p.requires_grad_(True)
    with qat(target), indexer_distillation(target) as kl:
        lm = target(input_ids=batch, labels=batch).loss
    assert len(kl) == cfg["compress_ratios"][: cfg["num_hidden_layers"]].count(4)
    assert all(bool(torch.isfinite(x)) for x in kl)
    lm_grads = torch.autograd.grad(lm, list(indexer.parameters()), allow_unused=True, retain_graph=True)
    assert all(g is None or not bool(g.any()) for g in lm_grads)
    kl_grads = torch.autograd.grad(torch.stack(kl).sum(), list(indexer.parameters()), allow_unused=True)
    assert any(g is not None and bool(g.any()) for g in kl_grads)


def test_training_attention_is_the_library_eager_attention():
    """Training reads the one shared KV head once for all query heads; the logits equal the library's eager
    attention's (its masks, sink and compressed entries included) at a length where the C4 indexer selects."""
    cfg = official_config("toy")
    model = build(cfg, seed=0)
    assert model.config._attn_implementation == "dsv4_lab_mqa"
    _, held = data.split()
    ids = data.token_stream(held[:3])[:2200][None]
    with torch.no_grad():
        fast = model(input_ids=ids).logits
        model.config._attn_implementation = "eager"
        eager = model(input_ids=ids).logits
    torch.testing.assert_close(fast, eager, rtol=1e-5, atol=1e-5)


def test_draft_loads_back_from_the_written_checkpoint(trained):
    """load_draft inverts the export: every draft tensor comes back, BF16/F32 ones to BF16 rounding, FP8 and MXFP4
    ones to their quantization."""
    from dsv4_lab.train.draft import load_draft

    _, _, draft, _, _, out, _ = trained
    loaded = dict(load_draft(out).named_parameters())
    for name, p in draft.named_parameters():
        q = loaded[name].detach()
        err = float((q - p.detach()).norm() / p.detach().norm().clamp_min(1e-30))
        assert err < 0.2, (name, err)
    torch.testing.assert_close(loaded["markov_w1.weight"], draft.markov_w1.weight.detach().bfloat16().float())


def test_draft_acceptance_estimate_is_bounded_by_its_per_position_hits(trained):
    from dsv4_lab.oracle.load import load_reference
    from dsv4_lab.train.draft import load_draft
    from dsv4_lab.train.score import draft_acceptance

    _, _, draft, _, _, out, _ = trained
    model = load_reference(out)
    got = draft_acceptance(model, load_draft(out), data.held_out_prompts([24, 24]), 6)
    assert got["positions"] == 12 and len(got["block_top1"]) == draft.gamma
    assert 1.0 <= got["accept_length_mean"] <= 1.0 + sum(got["block_top1"]) + 1e-9


def test_degeneracy_leaves_runs_to_the_run_check():
    """A deep indent is a run (judged by its length), not a 16-space string repeated at every offset; a phrase
    repeated with a period under 16 bytes, or a line repeated four times, is a loop."""
    from dsv4_lab.train.data import encode
    from dsv4_lab.train.record import degeneracy

    def ids(text):
        return encode(text.encode())[1:].tolist()

    nested = "if x:\n" + " " * 20 + "return self._run(a, b)\n" + " " * 16 + "y = 2\n"
    assert degeneracy(ids(nested)) == []
    loop = "self.assertEqual(a, 1)\n" * 4
    assert degeneracy(ids(loop)) == ["a 16-id string 4 times (at most 3)"]
    assert "2 distinct ids (at least 12)" in degeneracy(ids("ab" * 40))
    assert any("16-id string" in r for r in degeneracy(ids("x = the command by the command by the command by the "
                                                            "command by the end\n")))


def test_loop_positions_mark_repeats_and_long_runs_only():
    from dsv4_lab.train.train import LOOP_RUN, loop_positions

    ids = [1, 2, 3, 1, 2, 3, 1, 2, 3]
    # 3-id strings: (1,2,3) first ends at 2, again at 5 and 8; (2,3,1), (3,1,2) first at 3, 4, again at 6, 7
    assert loop_positions(ids, 3) == [5, 6, 7, 8]
    assert loop_positions([7] * (LOOP_RUN + 3), 3) == [LOOP_RUN, LOOP_RUN + 1, LOOP_RUN + 2]
    assert loop_positions([1, 2, 3, 4, 5, 6], 3) == []


def test_an_unlikelihood_step_lowers_the_marked_ids_probability(trained):
    """One step of train_unlikelihood (toy, 32 greedy ids a prompt) makes the loop ids of its own continuations
    less likely, measured under the same roundings."""
    import copy

    from dsv4_lab.train.model import qat
    from dsv4_lab.train.score import greedy
    from dsv4_lab.train.train import loop_positions, train_unlikelihood

    cfg, target, _, _, _, _, batch = trained
    model = copy.deepcopy(target)
    # prompts that end inside a loop, so the continuation repeats and is marked
    heads = torch.tensor([[data.BYTE_BASE + b for b in b"abcdabcdabcdabcd"]] * 2)
    with torch.no_grad(), qat(model):
        conts = greedy(model, heads.tolist(), 32, "cpu")

    def marked_p(m):
        seqs = torch.cat([heads, torch.tensor(conts)], 1)
        with torch.no_grad(), qat(m):
            p = torch.softmax(m(input_ids=seqs).logits[:, heads.shape[1] - 1:-1].float(), -1)
        p = p.gather(-1, seqs[:, heads.shape[1]:, None])[..., 0]
        mask = torch.zeros_like(p)
        for r, c in enumerate(conts):
            mask[r, loop_positions(c, 4)] = 1
        return float((p * mask).sum() / mask.sum().clamp(min=1)), int(mask.sum())

    before, n = marked_p(model)
    if n == 0:
        pytest.skip(f"the toy's continuations {conts} hold no loop")
    train_unlikelihood(model, lambda step: batch, lambda step: heads, 1, "cpu", new=32, alpha=10.0, peak_lr=3e-3,
                       log=lambda *_: None, repeat_len=4)
    after, _ = marked_p(model)
    assert after < before, (before, after)
