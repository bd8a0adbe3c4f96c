"""The `full` generated-checkpoint preset: DeepSeek-V4-Flash's depth and layer pattern at one TP4 rank's widths,
checked from its config alone (nothing is written but a config.json): the gate's config checks, the release's
inventory rules, one real TP4 rank's bytes at TP1, and the commands that take it."""

import importlib.util
import json
import os

import pytest

from conftest import REPO
from dsv4_sm80 import cli
from dsv4_sm80.checkpoint import format as fmt
from dsv4_sm80.footprint import GIB, weights
from dsv4_sm80.gate.model_checks import config_type_problems, config_value_problems
from dsv4_sm80.tiny.generate import FAST_EXPERT_PRESETS, PEAKED_HEAD_SCALE, PRESETS, tiny_config

RELEASE = fmt.flash_0731_config()


@pytest.fixture(scope="module")
def config():
    return tiny_config(PRESETS["full"])


def test_full_preset_has_the_release_depth_and_layer_pattern(config):
    assert config["num_hidden_layers"] == 43 == RELEASE["num_hidden_layers"]
    assert config["compress_ratios"] == RELEASE["compress_ratios"]  # SWA 0-1, C4/C128 alternating, C4 at 42
    ratios = config["compress_ratios"][:43]
    assert (ratios.count(0), ratios.count(4), ratios.count(128)) == (2, 21, 20)
    assert config["num_hash_layers"] == 3 and ratios[2] == 4  # the third hash layer is a C4 layer
    assert config["dspark_target_layer_ids"] == [40, 41, 42] == RELEASE["dspark_target_layer_ids"]
    assert config_type_problems(config) == [] and config_value_problems(config) == []
    assert "full" in FAST_EXPERT_PRESETS and PEAKED_HEAD_SCALE["full"] == PEAKED_HEAD_SCALE["wide"]


def test_full_preset_is_one_tp4_rank(config):
    """At TP1 it holds, category by category, what a real TP4 rank holds; only the replicated tables indexed by
    token id (tid2eid, DSPARK's markov embeddings) are smaller, since the vocabulary is a rank's share."""
    specs = fmt.inventory(config)
    assert len(specs) == len(fmt.inventory(RELEASE)) == 72317
    ours, rank = weights(config, tp=1, dense="bf16"), weights(RELEASE, tp=4, dense="bf16")
    for part in ("main", "draft"):
        for cat in set(ours[part]) | set(rank[part]):
            a, b = ours[part].get(cat, 0.0), rank[part].get(cat, 0.0)
            if (part, cat) in (("main", "router"), ("draft", "DSPARK heads")):
                assert 0 < b - a < 0.1 * GIB, (part, cat, a, b)
            else:
                assert a == pytest.approx(b, rel=1e-12), (part, cat, a, b)
    main, draft = (sum(ours[p].values()) / GIB for p in ("main", "draft"))
    assert 38.8 < main < 39.0 and main + draft < 42  # of a 141 GB H200: the rest is KV and reserves


def test_footprint_command_reads_the_preset(config, tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert cli.main(["footprint", "--model-path", str(tmp_path), "--tp", "1", "--gpu-gib", "141"]) == 0
    out = capsys.readouterr().out
    assert "main    38.91 GiB" in out and "DOES NOT FIT" not in out


def test_make_tiny_and_e2e_offer_the_preset():
    assert cli.parser().parse_args(["make-tiny", "/nowhere", "--preset", "full"]).preset == "full"
    spec = importlib.util.spec_from_file_location("bench_e2e_full", os.path.join(REPO, "bench", "e2e.py"))
    e2e = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(e2e)
    full = tiny_config(PRESETS["full"])
    assert "16 query heads at TP1" in e2e.native_refusal(full, 1)
    assert e2e.native_refusal(tiny_config(PRESETS["wide"]), 1) is None
    assert e2e.step_bytes(full, 1, "patched", 1) == pytest.approx(e2e.step_bytes(RELEASE, 4, "patched", 1), rel=2e-3)
