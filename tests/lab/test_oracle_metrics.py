"""The oracle's metric functions on hand-made distributions, the acceptance rule, and `compare` end to end
on hand-made records (no model)."""

import importlib
import json
import math
import subprocess
import sys

import pytest

from conftest import REPO
from dsv4_lab.oracle import metrics as M

LN = math.log


def test_kl_of_equal_is_zero_and_known_values():
    p = [LN(0.5), LN(0.3), LN(0.2)]
    assert M.kl_full(p, p) == 0.0
    assert M.kl_support(p, p) == pytest.approx(0.0, abs=1e-15)
    assert M.kl_union([[1, p[0]], [2, p[1]]], [[1, p[0]], [2, p[1]]]) == pytest.approx(0.0, abs=1e-15)
    # KL((.5, .5) || (.25, .75)) = .5 ln 2 + .5 ln(2/3) = .5 ln(4/3)
    assert M.kl_full([LN(0.5)] * 2, [LN(0.25), LN(0.75)]) == pytest.approx(0.5 * LN(4 / 3), rel=1e-12)


def test_kl_support_coarsens_the_rest_into_one_bucket():
    r, x = [0.5, 0.3, 0.2], [0.4, 0.4, 0.2]
    full = M.kl_full([LN(v) for v in r], [LN(v) for v in x])
    # the whole vocabulary as support: exact
    assert M.kl_support([LN(v) for v in r], [LN(v) for v in x]) == pytest.approx(full, rel=1e-12)
    # support {0}: .5 ln(.5/.4) + .5 ln(.5/.6), never above the full KL
    part = M.kl_support([LN(0.5)], [LN(0.4)])
    assert part == pytest.approx(0.5 * LN(0.5 / 0.4) + 0.5 * LN(0.5 / 0.6), rel=1e-12)
    assert part <= full


def test_kl_union_fills_missing_ids_at_the_list_floor():
    ref, path = [[1, LN(0.6)], [2, LN(0.3)]], [[1, LN(0.5)], [3, LN(0.4)]]
    # union {1, 2, 3}: ref (.6, .3, .3) / 1.2, path (.5, .4, .4) / 1.3
    r = [0.5, 0.25, 0.25]
    x = [0.5 / 1.3, 0.4 / 1.3, 0.4 / 1.3]
    want = sum(a * LN(a / b) for a, b in zip(r, x))
    assert M.kl_union(ref, path) == pytest.approx(want, rel=1e-12)
    # whole-vocabulary lists: the exact KL
    full_r, full_x = [[0, LN(0.5)], [1, LN(0.5)]], [[1, LN(0.75)], [0, LN(0.25)]]
    assert M.kl_union(full_r, full_x) == pytest.approx(0.5 * LN(4 / 3), rel=1e-12)


def _entry(seq, tops, actual_lps, ids=None, ids_lps=None):
    e = {"sequence": seq, "top": [[]] + tops, "input_logprobs": [None] + actual_lps}
    if ids is not None:
        e.update(ids=ids, ids_logprobs=[None] + ids_lps)
    return e


def _two(top1, second, margin):
    """A two-id top list with top-1 `top1` leading `second` by `margin` nats."""
    a = -0.1
    return [[top1, a], [second, a - margin]]


SEQ = [0, 1, 2, 3, 4]
# reference margins per position 1..4: 0.3, 0.7, 1.5, 2.5 nats
REF = _entry(SEQ, [_two(1, 2, 0.3), _two(2, 3, 0.7), _two(3, 4, 1.5), _two(4, 1, 2.5)], [-0.1, -0.1, -0.1, -0.1])


def test_top1_agreement_by_margin_and_dnll():
    # the path flips the top-1 at the 0.7- and 2.5-nat positions; its actual-token log-probs are 0.2 lower
    path = _entry(SEQ, [_two(1, 2, 0.1), _two(3, 2, 0.1), _two(3, 4, 1.0), _two(1, 4, 0.1)], [-0.3] * 4)
    s = M.compare_records({"teacher": [REF]}, {"teacher": [path]})["pooled"]
    assert s["positions"] == 4
    assert (s["top1_at_0p5nat"], s["positions_at_0p5nat"]) == (pytest.approx(100 / 3), 3)
    assert (s["top1_at_1nat"], s["positions_at_1nat"]) == (50.0, 2)
    assert (s["top1_at_2nat"], s["positions_at_2nat"]) == (0.0, 1)
    assert s["dnll"] == pytest.approx(0.2)
    assert s["kl_method"] == ["union"]


def test_support_method_when_both_hold_the_same_ids():
    ids = [1, 2]
    ref = _entry([0, 1], [[[1, LN(0.5)], [2, LN(0.3)]]], [LN(0.5)], ids, [[LN(0.5), LN(0.3)]])
    path = _entry([0, 1], [[[1, LN(0.4)], [2, LN(0.4)]]], [LN(0.4)], ids, [[LN(0.4), LN(0.4)]])
    s = M.compare_records({"teacher": [ref]}, {"teacher": [path]})["pooled"]
    assert s["kl_method"] == ["support"]
    assert s["kl_mean"] == pytest.approx(M.kl_full([LN(0.5), LN(0.3), LN(0.2)], [LN(0.4), LN(0.4), LN(0.2)]))


def test_records_over_different_sequences_are_refused():
    other = dict(REF, sequence=[0, 1, 2, 3, 9])
    with pytest.raises(ValueError, match="different sequences"):
        M.compare_records({"teacher": [REF]}, {"teacher": [other]})
    with pytest.raises(ValueError, match="same teacher sequences"):
        M.compare_records({"teacher": [REF]}, {"teacher": [REF, REF]})


def test_relative_error_per_layer():
    assert M.relative_error([3.0, 4.0], [3.0, 4.0]) == 0.0
    assert M.relative_error([3.0, 4.0], [3.0, 3.0]) == pytest.approx(0.2)
    assert M.per_layer_relative_error({0: [1.0, 0.0], 1: [0.0, 2.0]}, {0: [1.0, 0.0], 1: [0.0, 1.0]}) == \
        {0: 0.0, 1: pytest.approx(0.5)}


def test_near_tie_disagreements():
    ref = dict(REF, choices={"expert_gap": {"3": [0.5, 1e-4, 0.5, 0.5, 0.5]}, "indexer_gap": {"2": [None] * 5}})
    # flips at the 1.5- and 2.5-nat positions (3 and 4); position 3 is predicted from forward position 2
    path = _entry(SEQ, [_two(1, 2, 1), _two(2, 3, 1), _two(4, 3, 1), _two(2, 1, 1)], [-0.1] * 4)
    ref["choices"]["expert_gap"]["3"][2] = 1e-5
    assert M.near_tie_disagreements(ref, path) == {"near_tie": 1, "other": 1}


def _pooled(kl, agree):
    return {"kl_mean": kl, "top1_at_1nat": agree}


def test_acceptance_rule():
    native = _pooled(0.010, 99.0)
    assert M.KL_RATIO_MAX == 1.1 and M.AGREE_DROP_MAX_POINTS == 0.3 and M.RULE_MARGIN == 1.0
    assert M.verdict(_pooled(0.0109, 98.8), native)["passes"]
    assert M.verdict(_pooled(0.0110, 98.7), native)["passes"]  # both limits inclusive
    v = M.verdict(_pooled(0.0111, 99.5), native)
    assert not v["passes"] and "KL mean" in v["reasons"][0]
    v = M.verdict(_pooled(0.005, 98.6), native)
    assert not v["passes"] and "top-1 agreement" in v["reasons"][0]
    assert M.caught(_pooled(0.02, 99.0), native) and not M.caught(_pooled(0.01, 99.0), native)
    # no confident reference position: only KL is judged, and the verdict says so
    v = M.verdict(_pooled(0.01, math.nan), _pooled(0.01, math.nan))
    assert v["passes"] and not v["agreement_judged"]


def _record(tops_per_seq, seqs):
    return {"teacher": [_entry(s, t, [-0.1] * (len(s) - 1)) for s, t in zip(seqs, tops_per_seq)]}


def test_cli_compare_table_and_json(tmp_path):
    seqs = [SEQ]
    ref_tops = [[[[i, -0.05], [(i + 1) % 5, -3.0], [(i + 2) % 5, -4.0]] for i in (1, 2, 3, 4)]]
    near = [[[[i, -0.06], [(i + 1) % 5, -2.9], [(i + 2) % 5, -4.0]] for i in (1, 2, 3, 4)]]
    far = [[[[(i + 1) % 5, -0.05], [i, -3.0], [(i + 2) % 5, -4.0]] for i in (1, 2, 3, 4)]]
    refs = {"R_q": _record(ref_tops, seqs), "R_x": _record(ref_tops, seqs)}
    files = {}
    for name, obj in (("ref", {"references": refs}), ("native", _record(near, seqs)), ("sm80", _record(near, seqs)),
                      ("mut", _record(far, seqs)), ("ctl", _record(near, seqs))):
        files[name] = tmp_path / f"{name}.json"
        files[name].write_text(json.dumps(obj))
    out = tmp_path / "cmp.json"
    proc = subprocess.run([sys.executable, "-m", "dsv4_lab.oracle", "compare", "--ref", str(files["ref"]),
                           "--native", str(files["native"]), "--path", f"sm80={files['sm80']}",
                           "--mutant", f"swap={files['mut']}", "--control", f"twin={files['ctl']}",
                           "--json-out", str(out)], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "caught" in proc.stdout and "pass" in proc.stdout
    doc = json.loads(out.read_text())
    assert doc["rule"]["kl_ratio_max"] == 1.1
    for ref_name in ("R_q", "R_x"):
        r = doc["references"][ref_name]
        assert set(r["paths"]["sm80"]) >= {"kl_mean", "top1_at_1nat", "dnll", "passes"}
        assert r["paths"]["sm80"]["passes"] and r["controls"]["twin"]["passes"]
        assert r["mutants"]["swap"]["caught"] and r["mutants"]["swap"]["top1_at_1nat"] == 0.0


def test_accuracy_script_steps_use_existing_options(tmp_path):
    import os
    import re

    proc = subprocess.run(["bash", "dsv4_lab/oracle/accuracy.sh", str(tmp_path)], capture_output=True, text=True,
                          timeout=60, cwd=REPO, env=dict(os.environ, DRY="1", MUTANTS="m1 m2"))
    assert proc.returncode == 0, proc.stderr
    steps = [line[2:] for line in proc.stdout.splitlines() if line.startswith("+ ")]
    beds = [s for s in steps if "-m dsv4_lab.beds.engine_bed " in s]
    # sequences, native x2, four modes, the KV/indexer roundings (alone, both), alone/chunked/prefix-hit, mutants
    assert len(beds) == 1 + 2 + 4 + 3 + 3 + 2
    bed_src = open(os.path.join(REPO, "dsv4_lab/beds/engine_bed.py")).read()
    for flag in {f for s in beds for f in re.findall(r"(--[a-z][a-z-]+)", s)}:
        assert f'"{flag}"' in bed_src, flag
    assert any("DSV4_SM80_LAB_MUTANT=m2" in s for s in beds)
    assert sum("SGLANG_DSV4_A100_KV_ROUNDING=fp8_sim SGLANG_DSV4_A100_INDEXER_ROUNDING=fp4_sim" in s for s in beds) == 1
    assert sum("SGLANG_DSV4_A100_DENSE=fp8_marlin SGLANG_DSV4_MXFP4_MOE_BACKEND=marlin" in s for s in beds) == 1
    assert any("dsv4_lab.oracle score" in s for s in steps) and "dsv4_lab.oracle compare" in steps[-1]


def test_engine_bed_token_ids_logprob_rows(tmp_path):
    bed = importlib.import_module("dsv4_lab.beds.engine_bed")
    assert bed.logprob_ids(None, 10, 2) is None
    assert bed.logprob_ids("all", 3, 2) == [[0, 1, 2], [0, 1, 2]]
    one, per_seq = tmp_path / "one.json", tmp_path / "per.json"
    one.write_text("[7, 3]")
    per_seq.write_text("[[4, 1], [2]]")
    assert bed.logprob_ids(str(one), 10, 2) == [[3, 7], [3, 7]]
    assert bed.logprob_ids(str(per_seq), 10, 2) == [[1, 4], [2]]
    with pytest.raises(SystemExit, match="one per sequence"):
        bed.logprob_ids(str(per_seq), 10, 3)
    # SGLang's (logprob, id, text) entries, in whatever order, as rows in the ids' order
    assert bed._ids_rows([1, 4], [None, [(-2.0, 4, None), (-0.5, 1, None)]]) == [None, [-0.5, -2.0]]
