"""The GPU suite's core tier as tests (`dsv4_lab.gpu`): each asserts one verdict of a job's record.

On a GPU host with SGLang 0.5.16, a test whose job has not run on this tree runs it first (into
$DSV4_GPU_RESULTS, default /tmp/dsv4-gpu); `python -m dsv4_lab.gpu run --tier core` runs the same jobs inside a
time budget and resumes a cut run. Elsewhere the module is skipped with one line.
"""

from __future__ import annotations

import pytest

from dsv4_lab.gpu import runner, suite, verdicts

WHY = runner.gpu_host()
if WHY:
    pytest.skip(f"GPU suite: {WHY} (on a GPU host: python -m dsv4_lab.gpu run --tier core)",
                allow_module_level=True)


@pytest.fixture(scope="module")
def res():
    return runner.DEFAULT_RESULTS


def ensure(res, name: str) -> None:
    """Run the job (and the jobs it needs) unless it ended on this tree already."""
    from dsv4_lab.gpu.__main__ import select

    run = runner.Runner(res, select(suite.tier("core"), [name]))
    run.run(budget_s=3600)


def by_name(vs: list[verdicts.Verdict], prefix: str) -> verdicts.Verdict:
    (v,) = [v for v in vs if v.name.startswith(prefix)]
    return v


def _trained(res):
    ensure(res, "trained-score")
    return verdicts.trained(verdicts._read(res, "trained.json"))


@pytest.mark.parametrize("path", suite.PATHS)
def test_trained_bits_per_byte(res, path):
    v = by_name(_trained(res), f"{path}: bits per byte")
    assert v.ok, str(v)


@pytest.mark.parametrize("path", suite.PATHS)
def test_trained_dspark_acceptance(res, path):
    v = by_name(_trained(res), f"{path}: DSPARK accept length")
    assert v.ok, str(v)


@pytest.mark.parametrize("what", ["greedy agreement", "long-decode drift", "DSPARK accept length at least"])
def test_sm80_against_native(res, what):
    v = by_name(_trained(res), f"sm80: {what}")
    assert v.ok, str(v)


@pytest.mark.parametrize("what", ["the SM80 default path passes", "the negative control", "every mutant caught"])
def test_accuracy_rule(res, what):
    ensure(res, "accuracy")
    v = by_name(verdicts.accuracy(verdicts._read(res, "accuracy.json")), f"accuracy rule: {what}"
                if what != "the SM80 default path passes" else "accuracy rule against R_q")
    assert v.ok, str(v)


def test_attention_kit(res):
    ensure(res, "attention-kit")
    v = verdicts.attention_kit(verdicts._read(res, "attention_kit.json"))
    assert v.ok, str(v)


def test_kernels(res):
    ensure(res, "kernels")
    v = verdicts.kernels(verdicts._read(res, "kernels.xml", parse=str))
    assert v.ok, str(v)


def test_http(res):
    ensure(res, "http")
    v = verdicts.http(verdicts._read(res, "http.json"))
    assert v.ok, str(v)


@pytest.mark.parametrize("job,which", [("tools", "trained checkpoint"), ("tools-tiny", "tiny checkpoint")])
def test_tools_reasoning_structured_output(res, job, which):
    ensure(res, job)
    v = verdicts.tools(verdicts._read(res, f"{job}.json"), which)
    assert v.ok, str(v)
