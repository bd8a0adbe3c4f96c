"""bench/a800_projection.py: it runs, writes the record the docs cite (labelled a projection, the unmeasured keys
null), and its arithmetic on one stage and one collective is the hand computation."""

import importlib.util
import json
import os

import pytest

from conftest import REPO

spec = importlib.util.spec_from_file_location("a800_projection", os.path.join(REPO, "bench", "a800_projection.py"))
proj = importlib.util.module_from_spec(spec)
spec.loader.exec_module(proj)


def test_projection_runs_and_writes_the_record(tmp_path, capsys):
    out = tmp_path / "performance.json"
    assert proj.main(["--out", str(out)]) == 0
    assert "PROJECTION" in capsys.readouterr().out
    rec = json.loads(out.read_text())
    assert "PROJECTION" in rec["note"] and "not a measurement" in rec["note"]
    assert set(rec["a800_projection"]) == {"1", "16", "64"}
    for row in rec["a800_projection"].values():
        assert row["without_dspark"] > 0 and set(row["with_dspark"]) == {"tau 2.0", "tau 2.5"}
        assert row["with_dspark"]["tau 2.5"] > row["with_dspark"]["tau 2.0"]
    assert rec["h200_full_depth"] is None and rec["ttft_ms"] is None and "not yet measured" in rec["not_yet_measured"]
    b1 = rec["rules"]["fraction/nvlink"]["1"]
    assert b1["plain"] == pytest.approx(1e6 / sum(b1["step_us"].values()), rel=1e-3)
    assert rec["rules"]["fraction/pcie"]["64"]["plain"] < rec["rules"]["fraction/nvlink"]["64"]["plain"]


def test_routed_experts_at_one_token_by_hand():
    """43 layers x 16.7 us (H200, copy 2,667 GB/s) at the same fraction of an A800's 0.88 x 2,039 GB/s."""
    stages = proj.forward_stages(1, "fraction", "nvlink")
    assert stages["routed experts"] == pytest.approx(43 * 16.7 * 2667 / (0.88 * 2039), rel=1e-9)
    # the clock rule: bytes at the A800's copy, the H200's excess over its bytes time x 1.98 / 1.41
    nbytes = 6 * 3 * 512 * 4096 * (0.5 + 1 / 32)
    excess = 16.7 - nbytes / 2667e3
    by_clock = proj.forward_stages(1, "clock", "nvlink")["routed experts"]
    assert by_clock == pytest.approx(43 * (excess * 1.98 / 1.41 + nbytes / (0.88 * 2039e3)), rel=1e-9)


def test_allreduce_and_interpolation_by_hand():
    # 8 us + 2 x 3/4 of 8,192 bytes at 200 GB/s one way
    assert proj.allreduce_us(1, "nvlink") == pytest.approx(8.0 + 1.5 * 8192 / 200e3)
    assert proj.allreduce_us(1, "pcie") == pytest.approx(20.0 + 1.5 * 8192 / 25e3)
    assert proj.interp({4: 39.3, 8: 68.1}, 6) == pytest.approx(53.7)
    assert proj.interp({1: 7.7, 16: 8.3}, 31) == pytest.approx(8.9)  # the last two points' slope
