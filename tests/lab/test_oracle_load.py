"""The lab oracle loads the official-format `unit` checkpoint into transformers' DeepSeek-V4 with exact
weights (against tests/reference.py's float64 decode of the formats), and a forward gives finite
log-probabilities; `python -m dsv4_lab.oracle score` writes a reference record in the engine bed's layout."""

import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("accelerate")  # transformers' FP8 dequantizing loader needs it

from conftest import REPO  # noqa: E402
from dsv4_lab.oracle.load import ReferenceLoadError, load_reference  # noqa: E402
from dsv4_lab.oracle.score import forward_logprobs, score  # noqa: E402
from reference import dequant_fp8, dequant_mxfp4, load_raw  # noqa: E402


@pytest.fixture(scope="module")
def ref_model(unit_ckpt):
    return load_reference(unit_ckpt)


def _fp8(ckpt, name):
    return dequant_fp8(load_raw(ckpt, name + ".weight")[1], load_raw(ckpt, name + ".scale")[1])


def _mxfp4(ckpt, name):
    return dequant_mxfp4(load_raw(ckpt, name + ".weight")[1], load_raw(ckpt, name + ".scale")[1])


def _equal(param, expected):
    got = param.detach().double().numpy()
    assert got.shape == expected.shape
    assert np.array_equal(got, expected), f"max |diff| {np.abs(got - expected).max()}"


def test_weights_are_the_exact_decode(ref_model, unit_ckpt):
    m = ref_model.model
    assert all(p.dtype == torch.float32 for p in ref_model.parameters())
    _equal(m.layers[0].self_attn.q_a_proj.weight, _fp8(unit_ckpt, "layers.0.attn.wq_a"))
    _equal(m.layers[3].self_attn.o_b_proj.weight, _fp8(unit_ckpt, "layers.3.attn.wo_b"))
    _equal(m.layers[2].self_attn.compressor.indexer.q_b_proj.weight, _fp8(unit_ckpt, "layers.2.attn.indexer.wq_b"))
    _equal(m.layers[4].mlp.shared_experts.down_proj.weight, _fp8(unit_ckpt, "layers.4.ffn.shared_experts.w2"))
    # one routed expert: gate_up_proj stacks w1 over w3, down_proj is w2 (MXFP4 in the checkpoint)
    experts = m.layers[3].mlp.experts
    inter = experts.down_proj.shape[-1]
    _equal(experts.gate_up_proj[5][:inter], _mxfp4(unit_ckpt, "layers.3.ffn.experts.5.w1"))
    _equal(experts.gate_up_proj[5][inter:], _mxfp4(unit_ckpt, "layers.3.ffn.experts.5.w3"))
    _equal(experts.down_proj[5], _mxfp4(unit_ckpt, "layers.3.ffn.experts.5.w2"))
    # BF16 and fp32 tensors widen exactly; the hash layers' table is the checkpoint's
    _equal(ref_model.lm_head.weight, load_raw(unit_ckpt, "head.weight")[1].astype(np.float64))
    _equal(m.layers[2].self_attn.compressor.kv_proj.weight,
           load_raw(unit_ckpt, "layers.2.attn.compressor.wkv.weight")[1].astype(np.float64))
    _equal(m.layers[2].self_attn.compressor.position_bias,
           load_raw(unit_ckpt, "layers.2.attn.compressor.ape")[1].astype(np.float64))
    assert np.array_equal(m.layers[0].mlp.gate.tid2eid.numpy(), load_raw(unit_ckpt, "layers.0.ffn.gate.tid2eid")[1])


def test_layer_schedule_follows_the_checkpoint(ref_model, unit_ckpt):
    cfg = json.load(open(f"{unit_ckpt}/config.json"))
    kinds = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
    assert ref_model.config.layer_types == [kinds[r] for r in cfg["compress_ratios"][: cfg["num_hidden_layers"]]]
    assert ref_model.config.mlp_layer_types[: cfg["num_hash_layers"]] == ["hash_moe"] * cfg["num_hash_layers"]


def test_forward_gives_finite_logprobs(ref_model):
    seq = [(37 * i + 11) % 1000 + 2 for i in range(24)]
    lp, rec = forward_logprobs(ref_model, seq)
    assert lp.shape == (23, ref_model.config.vocab_size)
    assert torch.isfinite(lp).all()
    assert torch.allclose(lp.exp().sum(-1), torch.ones(23), atol=1e-5)
    assert sorted(rec.hidden) == list(range(ref_model.config.num_hidden_layers))
    assert rec.experts[3].shape == (24, ref_model.config.num_experts_per_tok)
    assert sorted(rec.indexer) == [2, 4]  # the C4 layers


def test_score_record_layout(ref_model):
    seqs = [[(13 * i + 5) % 1000 + 2 for i in range(n)] for n in (9, 17)]
    out = score(ref_model, seqs, names=("R_x", "R_q"), top=4, support_size=1024, log=lambda *_: None)
    assert sorted(out["references"]) == ["R_q", "R_x"]
    for ref in out["references"].values():
        for seq, sup, t in zip(seqs, out["support"], ref["teacher"]):
            assert t["sequence"] == seq and t["ids"] == sup == list(range(1024))  # the whole vocabulary
            assert t["support_mass"] == pytest.approx(1.0, abs=1e-5)
            assert t["input_logprobs"][0] is None and t["top"][0] == [] and t["ids_logprobs"][0] is None
            assert len(t["top"]) == len(seq) == len(t["ids_logprobs"]) == len(t["input_logprobs"])
            for i in range(1, len(seq)):
                by_id = dict(zip(t["ids"], t["ids_logprobs"][i]))
                assert by_id[seq[i]] == pytest.approx(t["input_logprobs"][i], abs=2e-6)
                for tok, lp in t["top"][i]:
                    assert by_id[tok] == pytest.approx(lp, abs=2e-6)
    assert len(out["hidden_rel_error"]["R_q"][0]) == ref_model.config.num_hidden_layers
    assert all(e > 0 for e in out["hidden_rel_error"]["R_q"][0])


def test_cli_score_writes_the_record(unit_ckpt, tmp_path):
    bed = tmp_path / "bed.json"
    bed.write_text(json.dumps({"teacher": [{"sequence": [5, 9, 200, 17, 3, 88, 41]}]}))
    out, ids = tmp_path / "ref.json", tmp_path / "ids.json"
    proc = subprocess.run([sys.executable, "-m", "dsv4_lab.oracle", "score", "--ckpt", unit_ckpt,
                           "--record", str(bed), "--out", str(out), "--support-out", str(ids), "--device", "cpu"],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert json.loads(ids.read_text()) == doc["support"]
    lps = [x for x in doc["references"]["R_q"]["teacher"][0]["input_logprobs"] if x is not None]
    assert len(lps) == 6 and all(math.isfinite(x) for x in lps)


def test_missing_checkpoint_is_one_clear_error(tmp_path):
    with pytest.raises(ReferenceLoadError, match="no config.json"):
        load_reference(str(tmp_path))
