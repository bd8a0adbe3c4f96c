"""The committed trained tiny checkpoint: its archive and its training record agree, it passes the gate's
checkpoint checks (every tensor's name, dtype and shape in the official format), the oracle loads it, and it
predicts held-out text far better than chance."""

import hashlib
import json
import os

import pytest
pytest.importorskip("accelerate")  # transformers' FP8 dequantizing loader needs it

from dsv4_lab.train import TRAINED_ARCHIVE, TRAINED_REPORT, check, data  # noqa: E402
from dsv4_lab.train.train import ARCHIVE_LIMIT  # noqa: E402
from dsv4_sm80.gate.report import failures  # noqa: E402


@pytest.fixture(scope="module")
def report():
    with open(TRAINED_REPORT) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return check.unpack(TRAINED_ARCHIVE, str(tmp_path_factory.mktemp("trained")))


def test_archive_is_the_recorded_one_and_small(report):
    with open(TRAINED_ARCHIVE, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    assert digest == report["archive_sha256"]
    assert os.path.getsize(TRAINED_ARCHIVE) == report["archive_bytes"] <= ARCHIVE_LIMIT


def test_gate_checkpoint_checks_pass(ckpt):
    findings = check.gate_findings(ckpt)
    assert not failures(findings), [(f.check, f.found) for f in failures(findings)]
    assert {f.check for f in findings if f.status == "pass"} >= {"model.keys", "model.dense_fp8", "model.experts"}


def test_config_has_the_draft_and_every_layer_kind(ckpt):
    with open(os.path.join(ckpt, "config.json")) as f:
        cfg = json.load(f)
    ratios = cfg["compress_ratios"][:cfg["num_hidden_layers"]]
    assert {0, 4, 128} <= set(ratios) and cfg["num_hash_layers"] >= 1
    assert len(cfg["dspark_target_layer_ids"]) == 3


def test_held_out_text_is_predicted_far_better_than_chance(ckpt):
    """Bits per byte of two 1,024-id windows of held-out text under the oracle (exact arithmetic): chance over
    the 256 bytes is 8; the trained model scores well under 4 (2.94 over 8 windows of 3,000, docs/accuracy.md)."""
    from dsv4_lab.oracle.load import load_reference
    from dsv4_lab.train.score import reference_bpb

    model = load_reference(ckpt)
    assert reference_bpb(model, data.held_out_prompts([1024, 1024]), "cpu") < 3.5


def test_oracle_scores_plain_id_lists_and_compares_its_references(ckpt, tmp_path, capsys):
    """`oracle score` takes the held-out prompts file as its sequences and prints R_x against R_q: on this
    model the two agree at every decided position."""
    from dsv4_lab.oracle.__main__ import main

    seqs = tmp_path / "p.json"
    seqs.write_text(json.dumps(data.held_out_prompts([40, 60])))
    assert main(["score", "--ckpt", ckpt, "--record", str(seqs), "--out", str(tmp_path / "s.json"),
                 "--refs", "R_q,R_x", "--device", "cpu"]) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if "R_x against R_q" in x]
    assert line and "top-1 100.0 %" in line[0]
