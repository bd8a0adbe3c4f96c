"""The tiny Vision-Exp training (dsv4_lab/vision/train.py, data.py) at toy size: its chat encoding is SGLang's and
the stand-in tokenizer's, a step lowers the loss, and what it writes is an official-format Vision-Exp checkpoint
that passes the gate served-widened and that the vision oracle loads back."""

import random

import pytest
import torch

from dsv4_lab.vision import data

pytestmark = pytest.mark.sglang


def test_chat_encoding_is_sglangs_and_the_tokenizers(tmp_path):
    from sglang.srt.entrypoints.openai import encoding_dsv4
    from tokenizers import Tokenizer

    from dsv4_sm80.tiny.tokenizer import write_tokenizer

    write_tokenizer(str(tmp_path), 129280)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    rng = random.Random(0)
    for kind in data.KINDS:
        ex = data.make(rng, kind)
        msgs = [{"role": "user", "content": ex.user_text(data.PLACEHOLDER)},
                {"role": "assistant", "content": ex.answer}]
        text = encoding_dsv4.encode_messages(msgs, thinking_mode="chat")
        assert text == data.chat_text(ex, with_answer=True)
        assert data.encode(text) == tok.encode(text, add_special_tokens=False).ids
        assert data.encode(text).count(data.PLACEHOLDER_ID) == len(ex.images)


def test_judge_wants_the_word_and_no_other_of_its_class():
    ex = data.Example("split", question="What colour is the left half?", answer="red")
    assert data.judge("Red.", ex) and data.judge("it is red", ex)
    assert not data.judge("red and blue", ex) and not data.judge("reddish", ex) and not data.judge("", ex)
    side = data.Example("shape", question="Where is the red square?", answer="left")
    assert data.judge("left", side) and data.judge("the red one is left", side) and not data.judge("top left", side)


def test_examples_vary_the_grid_and_are_seeded():
    from dsv4_lab.vision.image import Geometry, plan

    a, b = data.held_out(6), data.held_out(6)
    assert [(e.question, e.answer, [i.size for i in e.images]) for e in a] == \
           [(e.question, e.answer, [i.size for i in e.images]) for e in b]
    grids = {(p.n_llm_h, p.n_llm_w) for e in a for i in e.images for p in [plan(*i.size, Geometry())]}
    assert len(grids) >= 3
    assert {e.kind for e in a} == set(data.KINDS) and all(len(e.images) == (2 if e.kind == "two" else 1) for e in a)


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    from dsv4_lab.vision.train import build_vl, vl_config

    torch.manual_seed(0)
    cfg = vl_config("toy")
    model, tower = build_vl(cfg, 0, "cpu")
    return cfg, model, tower, tmp_path_factory.mktemp("vl")


def test_a_step_lowers_the_loss_and_reaches_the_tower(toy):
    from dsv4_lab.vision.image import Geometry
    from dsv4_lab.vision.train import USED_IDS, forward

    cfg, model, tower, _ = toy
    g = Geometry.from_config(cfg)
    examples = [data.make(random.Random(3), k) for k in data.KINDS]
    params = [p for p in model.parameters() if p.requires_grad] + list(tower.parameters())
    opt = torch.optim.AdamW(params, lr=3e-3)
    losses = []
    for _ in range(3):
        loss, n = forward(model, tower, examples, g, "cpu")
        opt.zero_grad()
        loss.backward()
        assert tower.vision.blocks[0].attn.wqkv.weight.grad.abs().sum() > 0 and tower.image_start.grad is not None
        opt.step()
        losses.append(loss.item())
    assert n == sum(len(data.encode(e.answer)) + 1 for e in examples)  # the answers and their end of sentence
    assert losses[-1] < losses[0]
    assert not model.lm_head.weight[USED_IDS:].any() and not model.model.embed_tokens.weight[USED_IDS:].any()


def test_export_is_a_vision_exp_checkpoint_the_gate_passes_and_the_oracle_loads(toy):
    from dsv4_lab.train.check import gate_findings
    from dsv4_lab.train.widen import widen
    from dsv4_lab.vision.load import load_vl_reference
    from dsv4_lab.vision.text import bias_vl_weights
    from dsv4_lab.vision.train import export_weights
    from dsv4_sm80.tiny.generate import generate

    cfg, model, tower, tmp = toy
    generate(str(tmp / "ck"), cfg, weights=export_weights(model, tower, cfg), log=lambda *_: None)
    widen(str(tmp / "ck"), str(tmp / "served"))
    failed = [f for f in gate_findings(str(tmp / "served")) if f.status == "fail"]
    assert not failed, failed
    ref, ref_tower = load_vl_reference(str(tmp / "ck"))
    for name, p in tower.state_dict().items():
        assert torch.equal(ref_tower.state_dict()[name], p.to(torch.bfloat16).float()), name
    theirs = bias_vl_weights(ref)
    for name, p in bias_vl_weights(model).items():
        assert torch.equal(theirs[name], p), name


def test_score_judges_a_path_by_the_rule_and_catches_a_mutant(toy, monkeypatch):
    """score() against records shaped like the bed's: the oracle's own answers pass; a path whose answer
    distributions are shifted fails the rule; the mutant run on it is caught."""
    import copy

    from dsv4_lab.beds.vision_trained import accuracy
    from dsv4_lab.vision import score as S

    cfg, model, tower, tmp = toy
    if not (tmp / "ck").is_dir():
        from dsv4_lab.vision.train import export_weights
        from dsv4_sm80.tiny.generate import generate

        generate(str(tmp / "ck"), cfg, weights=export_weights(model, tower, cfg), log=lambda *_: None)
    two = data.held_out(1)[::2]  # a colour and a shape question
    monkeypatch.setattr(S.data, "held_out", lambda n: two)
    from dsv4_lab.vision.load import load_vl_reference

    ref_model, ref_tower = load_vl_reference(str(tmp / "ck"))
    exact = S.oracle_teacher(ref_model, ref_tower, two)
    answers = [{"kind": ex.kind, "right": True} for ex in two]
    native = {"per_kind": 1, "accuracy": accuracy(answers), **copy.deepcopy(exact)}
    shifted = copy.deepcopy(exact)
    for entry in shifted["teacher"]:
        entry["top"] = [[[i, lp - (3.0 if k == 0 else 0.0)] for k, (i, lp) in enumerate(top)] for top in entry["top"]]
    wrong = [dict(a, right=False) for a in answers]
    sm80 = {"per_kind": 1, "accuracy": accuracy(answers), **copy.deepcopy(exact),
            "mutants": {"image_patches_transposed": {"accuracy": accuracy(wrong), **shifted}}}
    out = S.score(str(tmp / "ck"), {"native": native, "sm80": sm80})
    assert out["paths"]["sm80"]["rule"]["verdict"]["passes"]
    assert out["paths"]["sm80"]["color_accuracy"] == 1.0
    m = out["mutants"]["image_patches_transposed"]
    assert m["caught"] and not m["rule"]["verdict"]["passes"] and m["drop"]["shape"] == 1.0


def test_bed_record_keeps_the_answer_positions():
    from dsv4_lab.beds.vision_trained import teacher_entry

    # input positions: ... </think>(5) r(128) e(115) d(114) EOS(1); top lists as SGLang returns them
    toks = [[None, 0, None], [-0.1, 5, None], [-0.2, 128, None], [-0.3, 115, None], [-0.4, 114, None],
            [-0.5, 1, None]]
    tops = [None] + [[[-0.1, 7, None], [-2.0, 9, None]]] * 5
    e = teacher_entry({"input_token_logprobs": toks, "input_top_logprobs": tops}, n_answer=4)
    assert e["sequence"] == [5, 128, 115, 114, 1]
    assert e["input_logprobs"] == [None, -0.2, -0.3, -0.4, -0.5]
    assert e["top"][0] == [] and e["top"][1] == [[7, -0.1], [9, -2.0]]


def test_training_never_draws_the_held_out_stream():
    import random

    held = random.Random("held-out 0").random()
    assert data.held_out(1)[0].images[0].size == data.make(random.Random("held-out 0"), "colour").images[0].size
    assert all(data.training_rng(seed, step).random() != held for seed in range(4) for step in range(2000))
