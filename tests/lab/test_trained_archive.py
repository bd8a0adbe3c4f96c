"""The committed trained tiny checkpoint: its archive and its training record agree, it passes the gate's
checkpoint checks (every tensor's name, dtype and shape in the official format), its served shape is one native
SGLang runs at TP1 and computes the same logits, the oracle loads it, and the record's held-out figures hold."""

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


@pytest.fixture(scope="module")
def reference(ckpt):
    from dsv4_lab.oracle.load import load_reference

    return load_reference(ckpt)


def r_q_bpb(model, window):
    from dsv4_lab.oracle.numerics import NUMERICS, applied
    from dsv4_lab.train.score import reference_bpb

    with applied(model, NUMERICS["R_q"]):
        return reference_bpb(model, [window], "cpu")


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


# Native SGLang 0.5.16's shape limits at TP1 (paths under sglang/srt/), each checked on the served config
NATIVE_LIMITS = [
    # FlashMLA's sparse decode takes 64 or 128 query heads; heads are padded only above TP1
    ("num_attention_heads", lambda c: c["num_attention_heads"] in (64, 128), "models/deepseek_v4.py:1109-1115"),
    ("head_dim", lambda c: c["head_dim"] == 512, "layers/attention/deepseek_v4_backend.py:505-507"),
    ("qk_rope_head_dim", lambda c: c["qk_rope_head_dim"] == 64, "mem_cache/deepseek_v4_memory_pool.py:113"),
    ("num_key_value_heads", lambda c: c["num_key_value_heads"] == 1, "models/deepseek_v4.py:433"),
    ("o_groups", lambda c: (c["num_attention_heads"] * 512 // c["o_groups"]) % 128 == 0
     and c["o_lora_rank"] % 128 == 0, "models/deepseek_v4.py:1248-1257, 2560"),
    ("index_n_heads", lambda c: c["index_n_heads"] in (32, 64), "DeepGEMM's SM90 MQA logits (deep_gemm)"),
    ("index_head_dim", lambda c: c["index_head_dim"] == 128, "layers/attention/dsv4/indexer.py:698"),
    ("index_topk", lambda c: c["index_topk"] in (512, 1024), "layers/attention/deepseek_v4_backend.py:359"),
    ("sliding_window", lambda c: c["sliding_window"] == 128, "layers/attention/deepseek_v4_backend.py:88, 1938"),
    ("compress_ratios", lambda c: set(c["compress_ratios"]) <= {0, 4, 128}, "models/deepseek_v4.py:426"),
    ("hidden_size", lambda c: c["hidden_size"] % 128 == 0, "layers/quantization/marlin_utils.py:264-266"),
    ("moe_intermediate_size", lambda c: c["moe_intermediate_size"] % 128 == 0, "layers/quantization/fp8.py:492-501"),
    ("num_experts_per_tok", lambda c: c["num_experts_per_tok"] <= 32, "jit_kernel/csrc/deepseek_v4/hash_topk.cuh:138"),
    ("dspark_noise_token_id", lambda c: c["dspark_noise_token_id"] < c["vocab_size"],
     "speculative/dspark_components/dspark_config.py:114"),
    ("dspark_target_layer_ids", lambda c: all(0 <= i < c["num_hidden_layers"] for i in c["dspark_target_layer_ids"]),
     "models/deepseek_v4.py:2337"),
]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    return check.unpack(TRAINED_ARCHIVE, str(tmp_path_factory.mktemp("served")), served=True)


def test_served_config_is_within_native_limits(served):
    with open(os.path.join(served, "config.json")) as f:
        cfg = json.load(f)
    broken = [(field, where) for field, ok, where in NATIVE_LIMITS if not ok(cfg)]
    assert not broken, broken
    assert not failures(check.gate_findings(served))


def test_widening_keeps_the_logits(ckpt, served, reference):
    """R_x's logits (fp32) and the draft's on held-out text are the same, to fp32 rounding, for the trained 16
    heads and the served 64 (each head copied 4 times, wo_a / 4)."""
    import torch

    from dsv4_lab.oracle.load import load_reference
    from dsv4_lab.train.draft import load_draft

    ids = torch.tensor(data.held_out_prompts([300])[0])[None]
    narrow, wide = reference, load_reference(served)
    with torch.no_grad():
        a, b = narrow(input_ids=ids).logits, wide(input_ids=ids).logits
        diff = float((a - b).abs().max())
        scale = max(1.0, float(a.abs().max()))
        print(f"target logits max |diff| {diff:.2e} (max |logit| {scale:.1f})")
        # exact in real arithmetic; fp32 sums 4x the terms in wo_a and wq_b's consumers in another order, so
        # the bound is a few ulps of the largest logit
        assert diff <= 1e-5 * scale
        assert torch.equal(a.argmax(-1), b.argmax(-1))
        from dsv4_lab.train.draft import capture_features

        anchors = torch.tensor([[0, 40], [0, 200]])
        outs = []
        for model, path in ((narrow, ckpt), (wide, served)):
            draft = load_draft(path)
            outs.append(draft(model, ids, capture_features(model, ids, draft.targets), anchors)[0])
        ddiff = float((outs[0] - outs[1]).abs().max())
        print(f"draft logits max |diff| {ddiff:.2e}")
        assert ddiff <= 1e-5 * max(1.0, float(outs[0].abs().max()))


def test_unpack_leaves_other_checkpoints_alone(tmp_path):
    other = tmp_path / "other-ckpt"
    other.mkdir()
    (other / "config.json").write_text("{}")
    first = check.unpack(TRAINED_ARCHIVE, str(tmp_path))
    again = check.unpack(TRAINED_ARCHIVE, str(tmp_path))  # replaces its own folder
    assert first == again and os.path.isfile(os.path.join(first, "config.json"))
    assert (other / "config.json").read_text() == "{}"
    assert sorted(os.listdir(tmp_path)) == ["dsv4-lab-tiny", "other-ckpt"]


def test_record_beats_gzip_and_xz_on_every_window(report):
    rows = report["record"]["windows"]
    assert len(rows) == 8
    mean = sum(r["R_q"] for r in rows) / len(rows)
    assert mean <= 2.3, mean  # trained on a GPU
    assert all(r["R_q"] < min(r["gzip_9"], r["xz_9e"]) for r in rows), rows


def test_two_record_windows_re_measure_within_a_hundredth(reference, report):
    """Held-out bits per byte under R_q of the record's first two windows, measured again on this machine."""
    from dsv4_lab.train.record import compressed_bpb

    windows = data.held_out_prompts([3000] * 8)[:2]
    for w, row in zip(windows, report["record"]["windows"]):
        assert w[:8] == row["start_ids"]
        got = r_q_bpb(reference, w)
        print(f"window at {row['start_ids'][:3]}: R_q {got:.4f} (record {row['R_q']:.4f})")
        assert abs(got - row["R_q"]) <= 0.01
        assert compressed_bpb(w) == pytest.approx({k: row[k] for k in ("gzip_9", "xz_9e")})


def test_a_foreign_window_re_measures_within_a_hundredth(reference, report):
    """Python the model never saw (the middle of a transformers source file): the record's first foreign window,
    measured again under R_q."""
    name, w = data.foreign_windows()[0]
    row = report["record"]["foreign"][0]
    assert (name, w[:8]) == (row["file"], row["start_ids"])
    got = r_q_bpb(reference, w)
    print(f"{name}: R_q {got:.4f} (record {row['R_q']:.4f}, gzip -9 {row['gzip_9']:.4f})")
    assert abs(got - row["R_q"]) <= 0.01


def test_recorded_greedy_continuations_all_pass_the_degeneracy_check(report):
    """The record's 16 greedy continuations are all recorded as passing; the check, run again on two of them,
    agrees, and the recorded text is their bytes."""
    from dsv4_lab.train.record import as_text, degeneracy

    rows = report["record"]["greedy"]
    assert len(rows) == 16 and all(len(r["ids"]) == 128 for r in rows)
    assert [r["degenerate"] for r in rows] == [[]] * 16
    for r in rows[:2]:
        assert degeneracy(r["ids"]) == [] and as_text(r["ids"]) == r["text"]
    assert degeneracy([20] * 40)


def test_oracle_scores_plain_id_lists_and_compares_its_references(ckpt, tmp_path, capsys):
    """`oracle score` takes the held-out prompts file as its sequences and prints R_x against R_q: on this
    model the two agree at every decided position."""
    from dsv4_lab.oracle.__main__ import main

    seqs = tmp_path / "p.json"
    seqs.write_text(json.dumps(data.held_out_prompts([40, 60])))
    assert main(["score", "--ckpt", ckpt, "--record", str(seqs), "--out", str(tmp_path / "s.json"),
                 "--refs", "R_q,R_x", "--device", "cpu"]) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if "R_x against R_q" in x]
    assert line
    top1 = float(line[0].split("top-1 ")[1].split(" %")[0])
    assert top1 >= 99.0, line[0]
