"""The trained-checkpoint scorer on the CPU at toy size: a record made of the reference's own numbers scores
as the reference (same bits per byte, full greedy match, DSPARK twin identical), and a record with one
greedy id changed loses exactly the ids after it; the hand cases of its helpers."""

import json

import pytest
import torch

pytest.importorskip("accelerate")  # transformers' FP8 dequantizing loader needs it

from dsv4_lab.train import data, score  # noqa: E402
from dsv4_lab.train.model import build, official_config  # noqa: E402
from dsv4_lab.train.train import write_checkpoint  # noqa: E402


def test_common_prefix_and_segments():
    assert score.common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert score.common_prefix([], [1]) == 0
    assert score.segments([1.0] * 3 + [4.0] * 2, size=3) == [1.0, 4.0]


def test_record_bpb_counts_byte_targets_only():
    b = data.BYTE_BASE
    w = {"ids": [data.BOS, b + 1, b + 2, data.BOS], "logprobs": [None, -0.5, -1.0, -9.0]}
    assert score.record_bpb([w]) == pytest.approx(1.5 / 2 / 0.6931471805599453)


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    from dsv4_lab.oracle.load import load_reference
    from dsv4_lab.oracle.numerics import NUMERICS, applied
    from dsv4_lab.train.draft import Draft, init_draft

    cfg = official_config("toy")
    target = build(cfg, seed=0)
    draft = Draft(cfg)
    init_draft(draft, 0)
    root = tmp_path_factory.mktemp("score")
    ckpt = str(root / "ckpt")
    write_checkpoint(ckpt, cfg, target, draft, 0, log=lambda *_: None)
    model = load_reference(ckpt)
    prompts = data.held_out_prompts([64, 64, 16, 16, 16, 24])
    windows, greedy_p, long_p = prompts[:2], prompts[2:5], prompts[5]
    with torch.no_grad(), applied(model, NUMERICS["R_q"]):
        rows = []
        for w in windows:
            logp = torch.log_softmax(model(input_ids=torch.tensor(w)[None]).logits[0].double(), -1)
            rows.append({"ids": w, "logprobs": [None] + logp[torch.arange(len(w) - 1), torch.tensor(w[1:])].tolist()})
        outs = score.greedy(model, greedy_p, 6, "cpu")
        long_out = score.greedy(model, [long_p], 10, "cpu")[0]
    record = {"windows": rows, "greedy": [{"prompt": p, "output_ids": o, "spec": {}} for p, o in zip(greedy_p, outs)],
              "long": [{"temperature": 0.0, "prompt": long_p, "output_ids": long_out}],
              "speed": {"batch1_decode_ids_per_s": 100.0}}
    spec = dict(record, greedy=[dict(g, spec={"spec_accept_length": 2.5}) for g in record["greedy"]],
                speed={"batch1_decode_ids_per_s": 180.0})
    paths = {}
    for name, rec in (("plain", record), ("spec", spec)):
        paths[name] = str(root / f"{name}.json")
        json.dump(rec, open(paths[name], "w"))
    bad = json.loads(json.dumps(record))
    bad["greedy"][0]["output_ids"][3] += 1
    paths["bad"] = str(root / "bad.json")
    json.dump(bad, open(paths["bad"], "w"))
    return ckpt, paths


def test_a_record_of_the_references_own_numbers_scores_as_the_reference(toy):
    ckpt, paths = toy
    out = score.score(ckpt, {"ref-copy": paths["plain"], "bad": paths["bad"]}, {"ref-copy": paths["spec"]},
                      log=lambda *_: None)
    row = out["paths"]["ref-copy"]
    assert row["bits_per_byte"] == pytest.approx(out["reference"]["R_q"]["bits_per_byte"], rel=1e-6)
    assert row["greedy_match_mean"] == 6
    assert row["dspark_accept_len"] == 2.5 and row["dspark_speedup"] == pytest.approx(1.8)
    assert row["dspark_greedy_identical"] is True
    assert row["long_decode_nll"]["0.0"]["segments"] == pytest.approx(
        out["reference"]["R_q"]["long_decode_nll"]["0.0"]["segments"])
    assert out["paths"]["bad"]["greedy_match_mean"] == pytest.approx((3 + 6 + 6) / 3)


def test_held_out_prompts_are_disjoint_windows_of_held_out_text(tmp_path):
    from dsv4_lab.train.__main__ import main

    out = tmp_path / "p.json"
    assert main(["prompts", str(out), "--lengths", "20,300,50"]) == 0
    prompts = json.load(open(out))
    assert [len(p) for p in prompts] == [20, 300, 50]
    _, held = data.split()
    stream = data.token_stream(held).tolist()
    step = len(stream) // 3
    assert [stream[k * step:k * step + n] for k, n in enumerate((20, 300, 50))] == prompts
    with pytest.raises(ValueError, match="held-out prompts"):
        data.held_out_prompts([len(stream)] * 2)


def test_score_refuses_a_record_option_without_a_name():
    from dsv4_lab.train.__main__ import main

    with pytest.raises(SystemExit, match="train score: 'native.json' is not NAME=FILE"):
        main(["score", "--ckpt", "unused", "--record", "native.json"])
