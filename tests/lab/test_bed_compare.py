"""dsv4_lab/beds/compare.py: the teacher-forced comparison, on hand-made records."""

import math

import pytest

from dsv4_lab.beds import compare


def record(tops, seq=(1, 2, 3)):
    return {"sequence": list(seq), "input_logprobs": [None] + [t[0][1] for t in tops[1:]], "top": tops}


def test_identical_records_agree_exactly():
    tops = [[], [[5, -0.1], [6, -2.5]], [[7, -1.0], [8, -1.2]]]
    r = compare.compare_sequence(record(tops), record(tops), margin=0.5)
    assert r["kl_mean"] == pytest.approx(0, abs=1e-12) and r["top1_disagree"] == 0 and r["max_abs_dlogprob"] == 0
    assert r["confident_positions"] == 1


def test_swapped_top1_and_kl_against_a_direct_computation():
    a = [[], [[5, -0.1], [6, -2.5]]]
    b = [[], [[6, -0.1], [5, -2.5]]]
    r = compare.compare_sequence(record(a, (1, 2)), record(b, (1, 2)), margin=0.5)
    assert r["top1_disagree"] == 1.0 and r["confident_disagree"] == 1.0
    p = [math.exp(-0.1), math.exp(-2.5)]
    p = [x / sum(p) for x in p]
    kl = p[0] * math.log(p[0] / p[1]) + p[1] * math.log(p[1] / p[0])
    assert r["kl_mean"] == pytest.approx(kl)


def test_different_sequences_are_refused():
    with pytest.raises(ValueError, match="--teacher-from"):
        compare.compare_sequence(record([[]], (1,)), record([[]], (2,)), margin=0.5)


def _run(top1_margins, agree):
    """A record whose positions have the given top-1/top-2 margins; `agree` says per position whether
    the other record keeps the same top-1."""
    tops = [[]] + [[[5, -0.01], [6, -0.01 - m]] for m in top1_margins]
    other = [[]] + [([[5, -0.01], [6, -0.01 - m]] if same else [[6, -0.01], [5, -0.01 - m]])
                    for m, same in zip(top1_margins, agree)]
    seq = list(range(len(tops)))
    return {"teacher": [record(tops, seq)]}, {"teacher": [record(other, seq)]}


def test_margin_calibrated_on_the_native_floor():
    # 100 positions; the native rerun flips the 5 with the smallest margins (0.0-0.4) and one at 1.0
    margins = [i / 10 for i in range(100)]
    a, floor = _run(margins, [m > 0.45 and m != 1.0 for m in margins])
    m, agree, n = compare.calibrate_margin(a, floor, agree=0.99, min_positions=20)
    # above 1.0: 89 positions, all agree; above 0.9 the 1.0 flip is in: 1/90 > 1% -> not enough
    assert (m, agree, n) == (1.0, 1.0, 89)
    assert compare.calibrate_margin(a, floor, agree=0.98, min_positions=20)[0] == 0.4  # 95 positions, 1 flip
    _, patched = _run(margins, [m != 5.0 for m in margins])
    assert compare.agreement_above(a, patched, 1.0) == (88 / 89, 89)
    assert compare.calibrate_margin(a, floor, min_positions=200) is None


def test_floor_verdict(tmp_path, capsys):
    """compare.py --floor ends with one verdict: within the floor only if every sequence's mean KL is at most
    the floor's and the confident agreement reaches --agree."""
    import json

    margins = [i / 10 for i in range(100)]
    a, floor = _run(margins, [m > 0.45 for m in margins])  # the floor flips only low-margin positions
    _, near = _run(margins, [m > 0.45 for m in margins])
    _, far = _run(margins, [m > 2.05 for m in margins])  # flips confident positions too
    paths = {}
    for name, rec in (("a", a), ("floor", floor), ("near", near), ("far", far)):
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(dict(rec, prompts=[])))

    def verdict(b):
        compare.main([str(paths["a"]), str(paths[b]), "--floor", str(paths["floor"])])
        return [x for x in capsys.readouterr().out.splitlines() if x.startswith("verdict:")][0]

    assert verdict("near").endswith("-> within the floor") and "on 1 of 1 sequences" in verdict("near")
    v = verdict("far")
    assert v.endswith("-> NOT within the floor") and "on 0 of 1 sequences" in v


def test_several_floors_the_widest_counts(tmp_path, capsys):
    """--floor repeated (batch composition, another machine): per sequence the widest floor counts, and the
    confident margin is calibrated on the runs pooled."""
    import json

    margins = [i / 10 for i in range(100)]
    a, tight = _run(margins, [True] * 100)  # the batch-composition rerun: identical
    _, machine = _run(margins, [m > 0.45 for m in margins])  # another machine flips the low margins
    _, patched = _run(margins, [m > 0.25 for m in margins])  # flips fewer than the machine does
    rows = compare.floor_rows(a, [tight, machine], 0.5)
    assert rows[0]["kl_mean"] == compare.compare(a, machine)[0]["kl_mean"] > 0 and rows[0]["length"] == 101
    assert compare.calibrate_margin(a, [tight, machine], min_positions=20)[:3:2] == (0.3, 192)  # pooled: 1 flip in 192
    paths = {}
    for name, rec in (("a", a), ("tight", tight), ("machine", machine), ("patched", patched)):
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(dict(rec, prompts=[])))

    def verdict(*floors):
        compare.main([str(paths["a"]), str(paths["patched"])] + [x for f in floors for x in ("--floor", str(paths[f]))])
        return [x for x in capsys.readouterr().out.splitlines() if x.startswith("verdict:")][0]

    assert verdict("tight").endswith("NOT within the floor")
    assert verdict("tight", "machine").endswith("-> within the floor")


def test_http_teacher_record_feeds_compare(tmp_path, capsys):
    """http_check's teacher-forced vision A/B: SGLang's /generate meta_info (input_token_logprobs as (logprob,
    id, text), input_top_logprobs per position, None first) becomes compare.py's record, tops largest first."""
    import json

    from dsv4_lab.beds import http_check

    meta = {"input_token_logprobs": [[None, 0, None], [-0.5, 7, None], [-2.0, 9, None]],
            "input_top_logprobs": [None, [[-1.5, 8, None], [-0.5, 7, None]], [[-0.1, 9, None], [-3.0, 4, None]]]}
    rec = http_check.teacher_record([meta])
    assert rec["teacher"][0] == {"sequence": [0, 7, 9], "input_logprobs": [None, -0.5, -2.0],
                                 "top": [[], [[7, -0.5], [8, -1.5]], [[9, -0.1], [4, -3.0]]]}
    other = json.loads(json.dumps(meta))
    other["input_top_logprobs"][2] = [[-0.1, 4, None], [-3.0, 9, None]]  # the top-1 flips at a 2.9-nat margin
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(rec))
    b.write_text(json.dumps(http_check.teacher_record([other])))
    compare.main([str(a), str(b)])
    out = capsys.readouterr().out
    assert "top-1 disagree 50.0% (50.0% of 2 positions with margin > 0.5)" in out
    requests = http_check.teacher_requests()
    assert len(requests) == 2 and all(r["logprob_start_len"] == 0 for r in requests)


def test_agreement_curve_beside_the_verdict(tmp_path, capsys):
    """Beside the verdict, the agreement at larger margins for both: whether the other record's shortfall at
    the calibrated margin closes further out (here: it flips positions up to a margin of 3.0)."""
    import json

    margins = [i / 10 for i in range(100)]
    a, floor = _run(margins, [m > 0.45 for m in margins])
    _, patched = _run(margins, [not (1.0 <= m <= 3.0) for m in margins])  # flips margins 1.0..3.0
    rows = compare.agreement_curve(a, patched, [floor], [1.0, 3.0])
    # above 1.0: 89 positions (1.1..9.9); patched flips 1.1..3.0 (20 of them); the floor none
    assert rows[0] == (1.0, 1.0, 89, 69 / 89, 89)
    assert rows[1] == (3.0, 1.0, 69, 1.0, 69)
    paths = {}
    for name, rec in (("a", a), ("floor", floor), ("patched", patched)):
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(dict(rec, prompts=[])))
    compare.main([str(paths["a"]), str(paths["patched"]), "--floor", str(paths["floor"])])
    out = capsys.readouterr().out
    assert "  at margin > 1.0: native vs native 100.00% of 89; this record 77.53% of 89" in out
    assert "  at margin > 3.0: native vs native 100.00% of 69; this record 100.00% of 69" in out
