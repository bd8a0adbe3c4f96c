"""The GPU suite's planning, budget, resume and thresholds, on the CPU: jobs are short Python processes,
verdicts read recorded fixtures."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from dsv4_lab.gpu import runner, suite, verdicts
from dsv4_lab.gpu.__main__ import select

REPO = runner.ROOT


def py(code: str) -> tuple[str, ...]:
    return (sys.executable, "-c", code)


def write(res_file: str, code: str = "pass") -> tuple[str, ...]:
    """A job that (after `code`) writes {res}/res_file."""
    return py(f"import sys, time; {code}; open(sys.argv[1], 'w').write('{{}}')") + ("{res}/" + res_file,)


@pytest.fixture
def tree(tmp_path):
    """A stand-in source tree (the key's digest reads it) and a results folder."""
    root = tmp_path / "root"
    (root / "dsv4_lab").mkdir(parents=True)
    (root / "dsv4_lab" / "x.py").write_text("A = 1\n")
    return root, tmp_path / "res"


def make(tree, jobs, **kw):
    root, res = tree
    return runner.Runner(res, jobs, root=root, log=lambda *a: None, poll_s=0.05, **kw)


def test_core_tier_is_declared_whole():
    core = suite.tier("core")
    names = [j.name for j in core]
    assert len(names) == len(set(names))
    assert {"trained-native", "trained-sm80", "trained-native-dspark", "trained-sm80-dspark", "trained-score",
            "attention-kit", "kernels", "http"} <= set(names)
    beds = set()
    for j in suite.JOBS:
        assert all(n in suite.BY_NAME for n in j.needs), j.name
        assert 0.0 <= j.gpu_share <= 1.0 and j.estimate_s <= j.timeout_s
        scripts = [a for a in j.argv if a.endswith(".py") and "/" in a and not a.startswith("{")]
        assert all((REPO / s).is_file() for s in scripts), (j.name, scripts)
        # beds run as modules (python -m), also inside `bash -c` strings: each names a file of dsv4_lab/beds
        line = " ".join(j.argv)
        assert not re.search(r"dsv4_lab/beds/\w+\.py", line), (j.name, line)
        modules = re.findall(r"(?<!\S)-m (dsv4_lab\.beds\.\w+)", line)
        assert all((REPO / (m.replace(".", "/") + ".py")).is_file() for m in modules), (j.name, modules)
        beds |= set(modules)
    assert {"dsv4_lab.beds.trained_bed", "dsv4_lab.beds.engine_bed", "dsv4_lab.beds.moe_check",
            "dsv4_lab.beds.jit_seed"} <= beds  # the scan finds them, in argv and in bash strings
    # the core tier fits a 25-minute window with the engines side by side (estimates on a built cache)
    assert runner.makespan(core) <= 25 * 60 < sum(j.estimate_s for j in core)
    assert {j.name for j in suite.tier("full")} > set(names)
    with pytest.raises(ValueError, match="unknown tier"):
        suite.tier("nightly")


def test_makespan_follows_needs_and_shares():
    a = suite.Job("a", "core", 10, ("x",))
    b = suite.Job("b", "core", 5, ("x",), gpu_share=0.6)
    c = suite.Job("c", "core", 5, ("x",), gpu_share=0.6)
    d = suite.Job("d", "core", 1, ("x",), needs=("a",))
    assert runner.makespan([a, b, c, d]) == 11.0  # a with b, then c (b's share ended it), d after a
    assert runner.makespan([b, c]) == 10.0


def test_select_takes_what_a_job_needs():
    names = [j.name for j in select(suite.tier("core"), ["trained-score"])]
    assert names[0] == "unpack" and names[-1] == "trained-score" and "attention-kit" not in names
    with pytest.raises(SystemExit, match="unknown job"):
        select(suite.tier("core"), ["nope"])


def test_runs_in_order_and_resumes_without_repeating(tree):
    root, res = tree
    a = suite.Job("a", "core", 1, write("a.json"))
    b = suite.Job("b", "core", 1, write("b.json", "assert open(sys.argv[1].replace('b.json', 'a.json'))"),
                  needs=("a",))
    r = make(tree, [a, b])
    r.run(60)
    assert [r.entry(n)["status"] for n in "ab"] == ["passed", "passed"]
    first = {n: r.entry(n)["started"] for n in "ab"}
    r2 = make(tree, [a, b])
    assert r2.pending() == []
    r2.run(60)
    assert {n: r2.entry(n)["started"] for n in "ab"} == first  # nothing ran again
    # a change of the source tree changes every key: the jobs run again
    (root / "dsv4_lab" / "x.py").write_text("A = 2\n")
    assert [j.name for j in make(tree, [a, b]).pending()] == ["a", "b"]


def test_failure_says_why(tree):
    boom = suite.Job("boom", "core", 1, py("print('loading'); raise RuntimeError('engine died: no pages')"))
    r = make(tree, [boom])
    r.run(60)
    e = r.entry("boom")
    assert e["status"] == "failed" and e["rc"] == 1
    assert e["error"] == "RuntimeError: engine died: no pages"
    assert make(tree, [boom]).pending() == []  # a failure is a verdict, not rerun unless asked
    assert [j.name for j in make(tree, [boom]).pending(retry_failed=True)] == ["boom"]


def test_error_line_names_a_kill():
    log = "start\nTraceback (most recent call last):\nValueError: bad shape\nReceived sigquit from a child\n"
    assert runner.error_line(log, 1) == "ValueError: bad shape"
    assert runner.error_line(log, -9).startswith("killed by signal 9 (SIGKILL); last error line: ValueError")
    assert runner.error_line("", 137).startswith("exit 137 (SIGKILL")


def test_budget_defers_and_cuts_then_resumes(tree):
    quick = suite.Job("quick", "core", 1, write("q.json"))
    slow = suite.Job("slow", "core", 1, write("s.json", "time.sleep(30)"), timeout_s=60)
    big = suite.Job("big", "core", 500, write("big.json"))
    r = make(tree, [quick, slow, big])
    r.run(4.0)
    assert r.entry("quick")["status"] == "passed"
    assert r.entry("slow")["status"] == "cut"  # killed by the end of the budget, not a failure
    assert "big" not in r.state["jobs"]          # its estimate never fit
    r2 = make(tree, [quick, slow, big])
    assert [j.name for j in r2.pending()] == ["slow", "big"]


def test_time_limit_is_a_failure(tree):
    hang = suite.Job("hang", "core", 1, py("import time; print('compiling'); time.sleep(30)"), timeout_s=1)
    r = make(tree, [hang])
    r.run(30)
    assert r.entry("hang")["status"] == "failed"
    assert r.entry("hang")["error"].startswith("timed out after 1 s")


def test_side_by_side_within_one_gpu(tree):
    jobs = [suite.Job(n, "core", 1, write(f"{n}.json", "time.sleep(0.5)"), gpu_share=0.5) for n in "xyz"]
    r = make(tree, jobs)
    r.run(60)
    # two fit at once, the third waits for one of them to end
    e = {n: r.entry(n) for n in "xyz"}
    assert "y" in e["x"]["overlap"] and "x" in e["y"]["overlap"]
    assert not {"x", "y"} <= set(e["z"]["overlap"])
    first_end = min(e[n]["started"] + e[n]["seconds"] for n in "xy")
    assert e["z"]["started"] >= first_end - 0.2


def test_export_hands_back_what_finished(tree, tmp_path):
    out = tmp_path / "out"
    r = make(tree, [suite.Job("a", "core", 1, write("a.json"))], export=out)
    r.run(30)
    assert sorted(p.name for p in out.iterdir()) == ["gpu-results.tar.xz", "gpu-state.json", "gpu-summary.txt"]
    summary = (out / "gpu-summary.txt").read_text()
    assert "a" in summary and "passed" in summary and "not measured" in summary


# --- verdicts on recorded fixtures


def trained_fixture(sm80_bpb=1.806, sm80_greedy=60.0, sm80_drift=0.05, sm80_accept=3.0, native_accept=3.1):
    def path(bpb, greedy, drift, accept):
        return {"bits_per_byte": bpb, "greedy_match_mean": greedy, "greedy_new": 128,
                "long_decode_nll": {"0.0": {"drift": drift}, "0.7": {"drift": drift / 2}},
                "dspark_accept_len": accept, "dspark_speedup": 1.8, "dspark_greedy_identical": True}
    return {"reference": {"R_q": {"bits_per_byte": 1.805}, "R_x": {"bits_per_byte": 1.804}},
            "paths": {"native": path(1.807, 62.0, 0.02, native_accept),
                      "sm80": path(sm80_bpb, sm80_greedy, sm80_drift, sm80_accept)}}


def test_trained_verdicts_pass_on_a_record_that_meets_them():
    vs = verdicts.trained(trained_fixture())
    assert len(vs) == 7 and all(v.ok for v in vs), [str(v) for v in vs if not v.ok]


@pytest.mark.parametrize("kw,failing", [
    ({"sm80_bpb": 1.83}, "sm80: bits per byte"),                      # 1.4 % above R_q
    ({"sm80_greedy": 50.0}, "sm80: greedy agreement"),               # 12 ids below native's
    ({"sm80_drift": 0.2}, "sm80: long-decode drift"),                # 0.18 nats above native's
    ({"sm80_accept": 1.45, "native_accept": 1.5}, "sm80: DSPARK accept length >= 1.5"),
    ({"sm80_accept": 2.9, "native_accept": 3.1}, "sm80: DSPARK accept length at least"),
])
def test_trained_verdicts_fail_on_a_record_that_misses(kw, failing):
    bad = [v.name for v in verdicts.trained(trained_fixture(**kw)) if not v.ok]
    assert len(bad) == 1 and bad[0].startswith(failing), bad


def test_a_missing_record_is_not_a_pass():
    t = trained_fixture()
    del t["paths"]["native"]
    vs = verdicts.trained(t)
    assert [v.ok for v in vs if v.name.startswith("native")] == [None, None]
    assert all(v.ok is None for v in vs if v.name.startswith("sm80: ") and "native" in v.name)
    assert all(v.ok is None for v in verdicts.trained(None))


def test_job_verdicts_on_records(tmp_path):
    kit = [{"kind": "decode", "case": "c4", "ok": True}, {"kind": "prefill", "case": "c128", "ok": False,
                                                          "error": "AssertionError: mismatch\nmore"}]
    v = verdicts.attention_kit(kit)
    assert v.ok is False and "prefill c128: AssertionError: mismatch" in v.figure
    assert verdicts.attention_kit(kit[:1]).ok
    xml = '<testsuites><testsuite tests="12" failures="0" errors="0" skipped="2"/></testsuites>'
    assert verdicts.kernels(xml).ok and "10 passed" in verdicts.kernels(xml).figure
    assert not verdicts.kernels(xml.replace('failures="0"', 'failures="1"')).ok
    rec = {"startup_s": 40.0, "healthy_after": True, "results": [{"check": "chat", "ok": True}]}
    assert verdicts.http(rec).ok
    assert not verdicts.http({**rec, "healthy_after": False}).ok
    (tmp_path / "http.json").write_text(json.dumps(rec))
    state = {"jobs": {"kernels": {"status": "failed", "error": "ImportError: no triton"}}}
    vs = verdicts.collect(tmp_path, state)
    assert any(v.ok and v.name.startswith("serve") for v in vs)
    assert any(v.ok is False and v.name == "job kernels failed" and "no triton" in v.figure for v in vs)


def test_gpu_tests_skip_with_one_line_without_a_gpu():
    if runner.gpu_host() is None:
        pytest.skip("this host has a GPU: tests/gpu runs for real here")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/gpu", "-rs"],
                       cwd=REPO, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode in (0, 5), r.stdout + r.stderr  # 5: the only module was skipped whole
    skips = [ln for ln in r.stdout.splitlines() if ln.startswith("SKIPPED")]
    assert len(skips) == 1 and "GPU suite:" in skips[0] and "python -m dsv4_lab.gpu run" in skips[0]
    assert "1 skipped" in r.stdout


def accuracy_fixture(sm80_passes=True, control_passes=True, caught=None):
    caught = caught if caught is not None else {"kv_store_skip_last": True, "indexer_topk_511": True,
                                                "router_bias_on_weights": True, "e8m0_exponent_off": True}
    row = {"kl_ratio": 1.02, "agree_drop_points": 0.0, "reasons": []}
    return {"references": {"R_q": {
        "paths": {"sm80": {**row, "passes": sm80_passes}},
        "controls": {"native-reversed": {**row, "passes": control_passes}},
        "mutants": {n: {**row, "kl_ratio": 40.0, "caught": c, "passes": not c} for n, c in caught.items()}}}}


def test_accuracy_verdicts():
    assert all(v.ok for v in verdicts.accuracy(accuracy_fixture()))
    assert [v.ok for v in verdicts.accuracy(accuracy_fixture(sm80_passes=False))] == [False, True, True]
    assert [v.ok for v in verdicts.accuracy(accuracy_fixture(control_passes=False))] == [True, False, True]
    missed = verdicts.accuracy(accuracy_fixture(caught={"kv_store_skip_last": True, "indexer_topk_511": False,
                                                        "router_bias_on_weights": True, "e8m0_exponent_off": True}))
    assert missed[2].ok is False and "missed indexer_topk_511" in missed[2].figure
    # four caught but of three stages: not enough
    few = verdicts.accuracy(accuracy_fixture(caught={"kv_store_skip_last": True, "router_bias_on_weights": True,
                                                     "tid2eid_by_position": True, "e8m0_exponent_off": True}))
    assert few[2].ok is False and "stages dense, kv store, moe" in few[2].figure
    assert all(v.ok is None for v in verdicts.accuracy(None))


def test_the_accuracy_jobs_cover_four_stages_in_two_sm80_engines():
    from dsv4_lab.mutants import MUTANTS

    assert {MUTANTS[m].stage for m in (*suite.RUNTIME_MUTANTS, suite.LOAD_MUTANT)} >= {
        "kv store", "indexer", "moe", "dense"}
    assert all(MUTANTS[m].runtime for m in suite.RUNTIME_MUTANTS) and not MUTANTS[suite.LOAD_MUTANT].runtime
    cmd = suite.BY_NAME["accuracy"].command(REPO, REPO)
    assert cmd.count("--mutant") == len(suite.RUNTIME_MUTANTS) + 1 and "--control" in cmd
    sm80 = [j for j in suite.tier("core") if j.name.startswith("acc-sm80")]
    assert [j.env.get("DSV4_SM80_LAB_MUTANT") for j in sm80] == ["runtime", suite.LOAD_MUTANT]


def test_accuracy_bed_plans_its_runs():
    from dsv4_lab.beds.accuracy_bed import run_plan
    from dsv4_lab.mutants import MUTANTS

    plan = run_plan(["sm80", "mutant-kv_store_skip_last", "native-reversed"], MUTANTS, "runtime")
    assert plan == [("sm80", "", False), ("mutant-kv_store_skip_last", "kv_store_skip_last", False),
                    ("native-reversed", "", True)]
    assert run_plan(["mutant-e8m0_exponent_off"], MUTANTS, "e8m0_exponent_off") == [
        ("mutant-e8m0_exponent_off", "", False)]  # the bug is in the weights: nothing to switch
    with pytest.raises(SystemExit, match="needs an engine started with DSV4_SM80_LAB_MUTANT=runtime"):
        run_plan(["mutant-e8m0_exponent_off"], MUTANTS, "runtime")
    with pytest.raises(SystemExit, match="needs an engine started"):
        run_plan(["mutant-kv_store_skip_last"], MUTANTS, "")
    with pytest.raises(SystemExit, match="serves one run"):
        run_plan(["sm80", "mutant-e8m0_exponent_off"], MUTANTS, "e8m0_exponent_off")


def test_teacher_entries_are_what_the_metrics_read():
    from dsv4_lab.beds.engine_bed import teacher_entry
    from dsv4_lab.oracle import metrics

    seq = [1, 20, 30, 40]
    meta = {"input_token_logprobs": [(None, 1, None), (-0.5, 20, None), (-0.1, 30, None), (-2.0, 40, None)],
            "input_top_logprobs": [None, [(-0.5, 20, None), (-1.5, 21, None)], [(-0.1, 30, None), (-3.0, 31, None)],
                                   [(-0.2, 41, None), (-2.0, 40, None)]]}
    e = teacher_entry(seq, meta)
    assert e["input_logprobs"] == [None, -0.5, -0.1, -2.0] and e["top"][0] == [] and e["top"][3][0] == [41, -0.2]
    row = metrics.sequence_metrics(e, e)
    assert row["positions"] == 3 and row["kl_sum"] == 0.0 and row["dnll_sum"] == 0.0


def test_tools_check_validates_what_it_is_sent():
    from dsv4_lab.beds import tools_check as T

    assert T.valid({"color": "red", "ok": True}, T.SCHEMA)
    assert not T.valid({"color": "pink", "ok": True}, T.SCHEMA)
    assert not T.valid({"color": "red", "ok": True, "extra": 1}, T.SCHEMA)
    assert not T.valid({"color": "red"}, T.SCHEMA) and not T.valid({"color": "red", "ok": "yes"}, T.SCHEMA)
    call = {"choices": [{"message": {"tool_calls": [{"function": {"name": "get_weather",
                                                                  "arguments": '{"city": "Paris", "unit": "c"}'}}]}}]}
    assert T.tool_call_ok(call, [T.WEATHER, T.TIME], "get_weather")[0]
    assert not T.tool_call_ok(call, [T.WEATHER, T.TIME], "get_time")[0]
    wrong = json.loads(json.dumps(call))
    wrong["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] = '{"unit": "k"}'
    assert not T.tool_call_ok(wrong, [T.WEATHER], None)[0]
    assert not T.tool_call_ok({"choices": [{"message": {"content": "sunny"}}]}, [T.WEATHER], None)[0]
    rec = {"results": [{"check": "a", "ok": True}, {"check": "b", "ok": False}]}
    assert verdicts.tools(rec, "x").ok is False and "failing: b" in verdicts.tools(rec, "x").figure


def test_tools_check_reads_answers_and_streams(monkeypatch):
    from dsv4_lab.beds import tools_check as T

    sse = 'data: {"a": 1}\n\ndata: {"a": 2}\n\ndata: [DONE]\n\n'
    monkeypatch.setattr(T, "call", lambda port, path, body: (200, sse))
    assert T.post(1, "/v1/chat/completions", {}, stream=True) == (200, [{"a": 1}, {"a": 2}])
    monkeypatch.setattr(T, "call", lambda port, path, body: (200, '{"text": "yes, 42"}'))
    assert T.post(1, "/generate", {}) == (200, {"text": "yes, 42"})
    monkeypatch.setattr(T, "call", lambda port, path, body: (400, "bad schema " * 50))
    assert T.post(1, "/v1/chat/completions", {}) == (400, ("bad schema " * 50)[:300])


def vision_fixture(color=0.97, split=0.93, rule=True, caught=True):
    row = {"color_accuracy": color, "split_accuracy": split, "shape_accuracy": 0.91, "two_accuracy": 0.95}
    verdict = {"passes": rule, "kl_ratio": 1.02 if rule else 3.0, "reasons": [] if rule else ["KL mean 3 > 1.1 x"]}
    return {"paths": {"native": dict(row), "sm80": dict(row, rule={"verdict": verdict})},
            "mutants": {"image_patches_transposed": {"caught": caught, "rule": {"verdict": {"passes": not caught}},
                                                     "drop": {"split": 0.4 if caught else 0.0}}}}


def test_vision_verdicts_hold_accuracy_rule_and_mutants():
    assert all(v.ok for v in verdicts.vision(vision_fixture()))
    assert [v.ok for v in verdicts.vision(vision_fixture(color=0.9))] == [False, False, True, True]
    assert [v.ok for v in verdicts.vision(vision_fixture(split=0.85))] == [False, False, True, True]
    assert [v.ok for v in verdicts.vision(vision_fixture(rule=False))] == [True, True, False, True]
    assert [v.ok for v in verdicts.vision(vision_fixture(caught=False))] == [True, True, True, False]
    assert [v.ok for v in verdicts.vision(None)] == [None]
