"""tests/gpu/compare.py: the teacher-forced comparison, on hand-made records."""

import math
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "gpu"))
import compare  # noqa: E402


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
