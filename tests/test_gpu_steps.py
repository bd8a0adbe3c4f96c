"""dsv4_lab/beds/steps.sh on the CPU: each step run with `python` replaced by a recorder, so the argument lists its
scripts would get are checked here and not after minutes of device time. steps.sh's `run` evals its command:
a quoted argument with a space or a `|` must survive as one argument (session 11: `--only "fused io|pair bf16"`
would have become a shell pipe). Every `--flag` a step passes must be an option its script defines."""

import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from conftest import REPO, load_script

SHIM = """#!/bin/bash
if [ "$1" = "-c" ]; then exec {real} "$@"; fi
{real} -c 'import json, os, sys; open(os.environ["SHIM_LOG"], "a").write(json.dumps(sys.argv[1:]) + "\\n")' "$@"
"""


def run_step(tmp_path, step, env=None, files=()):
    shim = tmp_path / "bin"
    shim.mkdir(exist_ok=True)
    (shim / "python").write_text(SHIM.format(real=shlex.quote(sys.executable)))
    (shim / "python").chmod(0o755)
    out = tmp_path / f"out-{step}"
    out.mkdir()
    for name in files:
        (out / name).write_text("{}")
    log = tmp_path / f"{step}.jsonl"
    log.write_text("")
    (tmp_path / "wide.ok").write_text("")  # a complete full-width checkpoint, as far as the steps can tell
    (tmp_path / "prev.json").write_text("{}")  # an earlier machine's native record (step machines)
    e = dict(os.environ, PATH=f"{shim}:{os.environ['PATH']}", OUT=str(out), NO_JIT_TAR="1",
             ORACLE=str(out / "native.json"), SHIM_LOG=str(log), WIDE=str(tmp_path / "wide"),
             PREV=str(tmp_path / "prev.json"))
    e.update(env or {})
    res = subprocess.run(["bash", "dsv4_lab/beds/steps.sh", step], cwd=REPO, env=e, capture_output=True, text=True,
                         timeout=120)
    assert "unknown step" not in res.stdout, res.stdout
    return [json.loads(x) for x in log.read_text().splitlines() if x.strip()], res.stdout


def options_of(script):
    src = open(os.path.join(REPO, script)).read()
    return set(re.findall(r"add_argument\(\s*\"(--[a-z0-9-]+)\"", src))


STEPS = {  # step: files it expects from earlier steps
    "kernels": (), "moe-bench": (), "moe-sweep": (), "moe-prefill": (), "mhc-bench": (), "attn-bench": (), "idx-bench": (), "cold": (),
    "e2e-floors": ("engine-e2e.json",), "trace": (), "e2e": (), "oracle": (), "soak": (), "soak-native": (),
    "wide-parity": (), "e2e-bench": (), "moe-wide": (), "machines": (), "trace-linears": (), "e2e-replay": ("native-alone.json",),
    "e2e-gemm": ("native-alone.json",), "vision-replay": (), "graphs-self": (), "mma-peak": (),
    "moe-close": (), "vision-gemm": (), "engine-wide": (),
}


def test_graphs_self_makes_its_own_teacher_then_runs_graphs_on_it(tmp_path):
    calls, _ = run_step(tmp_path, "graphs-self")
    beds = [a for a in calls if a[0] == "dsv4_lab/beds/engine_bed.py"]
    assert len(beds) == 3 and "--teacher-from" not in beds[0], beds
    made = beds[0][beds[0].index("--out") + 1]
    assert os.path.basename(made) == "self.json"
    assert all(b[b.index("--teacher-from") + 1] == made for b in beds[1:])
    assert "--cuda-graph" in beds[2] and "--cuda-graph" not in beds[1]


def test_steps_on_the_wide_checkpoint_refuse_without_its_marker(tmp_path):
    for step in ("wide-parity", "e2e-bench"):
        calls, stdout = run_step(tmp_path, step, env={"WIDE": str(tmp_path / "half-written")})
        assert calls == [] and "(step wide first)" in stdout, stdout


def test_e2e_bench_runs_every_mode_with_the_profile(tmp_path):
    calls, _ = run_step(tmp_path, "e2e-bench")
    (argv,) = calls
    assert argv[argv.index("--modes") + 1] == "native,patched,patched-marlin,patched-fp8"
    assert argv[argv.index("--ckpt") + 1] == str(tmp_path / "wide") and "--profile" in argv


@pytest.mark.parametrize("step", sorted(STEPS))
def test_every_flag_a_step_passes_is_its_scripts(tmp_path, step):
    calls, stdout = run_step(tmp_path, step, files=STEPS[step])
    assert calls, stdout
    for argv in calls:
        argv = [a for a in argv if a != "-u"]  # unbuffered output: an interpreter option
        if argv[0] == "-m":  # python -m pytest / dsv4_lab.trace: checked below where it matters
            continue
        script = argv[0]
        assert os.path.isfile(os.path.join(REPO, script)), (step, argv)
        flags = {a.split("=", 1)[0] for a in argv[1:] if a.startswith("--")}
        missing = flags - options_of(script)
        assert not missing, (step, script, missing)


def test_quoted_arguments_survive_runs_eval(tmp_path):
    calls, _ = run_step(tmp_path, "moe-bench")
    (argv,) = calls
    assert argv[argv.index("--only") + 1] == "fused io|pair bf16"
    calls, _ = run_step(tmp_path, "kernels")
    pytest_argv = next(a for a in calls if a[:2] == ["-m", "pytest"])
    assert pytest_argv[pytest_argv.index("-k") + 1] == "not every_bench_variant_computes_the_moe"
    assert all(os.path.isfile(os.path.join(REPO, a)) for a in pytest_argv if a.startswith("tests/"))
    calls, _ = run_step(tmp_path, "moe-close")
    pytest_argv = next(a for a in calls if a[:2] == ["-m", "pytest"])
    assert pytest_argv[pytest_argv.index("-k") + 1] == "wide or one_token or gemv_equals or kernel_equals or routed_scaling"


def test_trace_compares_against_the_pinned_run_with_the_perturbed_floor(tmp_path):
    calls, _ = run_step(tmp_path, "trace")
    traced = [a for a in calls if a[0] == "dsv4_lab/beds/layer_trace.py"]
    assert [os.path.basename(a[a.index("--out-dir") + 1]) for a in traced] == [
        "trace-native", "trace-pinned", "trace-perturbed", "trace-patched", "trace-replay"]
    assert traced[2][-2:] == ["--perturb", "1e-4"]
    compares = [[os.path.basename(x) for x in a[2:]] for a in calls if a[:2] == ["-m", "dsv4_lab.trace"]]
    assert ["trace-pinned", "trace-patched", "--floor", "trace-perturbed"] in compares
    assert ["trace-pinned", "trace-perturbed"] in compares


def test_trace_runs_picks_runs_and_compares_only_what_it_has(tmp_path):
    """TRACE_RUNS="pinned perturbed replay gemm": those four traced, the replay and the gemm replay each against
    the pinned run with the perturbed floor; no compare names a run that was neither made nor found."""
    calls, _ = run_step(tmp_path, "trace", env={"TRACE_RUNS": "pinned perturbed replay gemm"})
    traced = [a for a in calls if a[0] == "dsv4_lab/beds/layer_trace.py"]
    assert [os.path.basename(a[a.index("--out-dir") + 1]) for a in traced] == [
        "trace-pinned", "trace-perturbed", "trace-replay", "trace-gemm"]
    compares = [[os.path.basename(x) for x in a[2:]] for a in calls if a[:2] == ["-m", "dsv4_lab.trace"]]
    pairs = [c for c in compares if "--linears" not in c]
    assert ["trace-pinned", "trace-replay", "--floor", "trace-perturbed"] in pairs
    assert ["trace-pinned", "trace-gemm", "--floor", "trace-perturbed"] in pairs
    assert not any("trace-native" in c or "trace-patched" in c for c in compares), compares


def test_e2e_gemm_runs_natives_linears_without_the_tripwire_beside_each_floor(tmp_path):
    calls, _ = run_step(tmp_path, "e2e-gemm", files=("native-alone.json", "native-perturb-1e-4.json"))
    (bed,) = [a for a in calls if a[0] == "dsv4_lab/beds/engine_bed.py"]
    floors = [a[a.index("--floor") + 1] for a in calls if a[0] == "dsv4_lab/beds/compare.py"]
    assert [os.path.basename(f) for f in floors] == ["native-alone.json", "native-perturb-1e-4.json"]
    src = open(os.path.join(REPO, "dsv4_lab/beds/steps.sh")).read()
    block = src[src.index("  e2e-gemm)"):src.index(";;", src.index("  e2e-gemm)"))]
    assert "DSV4_SM80_LAB_NATIVE_ROUNDING=kv,gemm,idx" in block and "TRIPWIRE" not in block.split("run e2e-gemm")[1]


def test_moe_onetoken_is_moe_sweep_at_the_default_configs_switch_points(tmp_path):
    calls, _ = run_step(tmp_path, "moe-onetoken")
    (bench,) = [a for a in calls if a[0] == "bench/moe.py"]
    assert bench[bench.index("--tokens") + 1] == "1,2,4,8,16,24,32,48,64"
    assert bench[bench.index("--only") + 1] == "mma|gemv, split_k 8|wide"
    assert bench[bench.index("--profile-only") + 1] == ("gemv, split_k 8, block_n2 128|split_k 4, mma|"
                                                        "wide 16x8w, down 16x8w, quant in")
    assert os.path.basename(bench[bench.index("--out") + 1]) == "moe-sweep.json" and "--profile" in bench


def test_trace_linears_traces_native_once_and_asks_for_sglangs_models(tmp_path):
    calls, _ = run_step(tmp_path, "trace-linears")
    traced = [a for a in calls if a[0] == "dsv4_lab/beds/layer_trace.py"]
    assert [os.path.basename(a[a.index("--out-dir") + 1]) for a in traced] == ["trace-native"]
    (check,) = [a for a in calls if a[:2] == ["-m", "dsv4_lab.trace"]]
    assert os.path.basename(check[2]) == "trace-native" and check[3:] == ["--linears", "--sglang-models"]


def test_machines_holds_the_patched_run_to_both_floors(tmp_path):
    calls, _ = run_step(tmp_path, "machines")
    beds = [a for a in calls if a[0] == "dsv4_lab/beds/engine_bed.py"]
    prev = str(tmp_path / "prev.json")
    assert all(a[a.index("--teacher-from") + 1] == prev for a in beds) and len(beds) == 3
    compares = [a for a in calls if a[0] == "dsv4_lab/beds/compare.py"]
    (vs_prev,) = [a for a in compares if a[1] == prev and "--floor" in a]
    floors = [vs_prev[i + 1] for i, x in enumerate(vs_prev) if x == "--floor"]
    assert [os.path.basename(f) for f in floors] == ["native-here.json", "native-here-alone.json"]
    other = tmp_path / "without"
    other.mkdir()
    calls, stdout = run_step(other, "machines", env={"PREV": str(tmp_path / "missing.json")})
    assert calls == [] and "an earlier machine's native engine_bed record" in stdout


def test_moe_sweep_takes_its_sizes_and_variants_from_the_environment(tmp_path):
    (tmp_path / "set").mkdir(), (tmp_path / "unset").mkdir()
    calls, _ = run_step(tmp_path / "set", "moe-sweep", env={"MOE_TOKENS": "1,4", "MOE_ONLY": "fused io|pair"})
    (bench,) = [a for a in calls if a[0] == "bench/moe.py"]
    assert bench[bench.index("--tokens") + 1] == "1,4" and bench[bench.index("--only") + 1] == "fused io|pair"
    calls, _ = run_step(tmp_path / "unset", "moe-sweep")
    (bench,) = [a for a in calls if a[0] == "bench/moe.py"]
    assert bench[bench.index("--tokens") + 1] == "1,4,16,64" and bench[bench.index("--only") + 1] == "decode-"


def test_moe_ncu_profiles_the_second_call_of_each_variant(tmp_path):
    """moe-ncu: one Nsight Compute run per variant (a name with a space and a comma stays one argument), the first
    call's two W4A8 launches skipped, and each variant a name bench/moe.py knows."""
    ncu = tmp_path / "ncu"
    ncu.write_text('#!/bin/bash\necho "$@" >> "$(dirname "$0")/ncu.log"\nwhile [ "$1" != python ]; do shift; done\n'
                   'exec "$@"\n')
    ncu.chmod(0o755)
    calls, _ = run_step(tmp_path, "moe-ncu", env={"NCU": str(ncu), "NCU_TOKENS": "2048"})
    benches = [a for a in calls if a[0] == "bench/moe.py"]
    assert [b[b.index("--once") + 1] for b in benches] == ["default", "prefill-64x128, warps 8"]
    assert all(b[b.index("--tokens") + 1] == "2048" and "--no-marlin" in b for b in benches)
    assert all({a for a in b[1:] if a.startswith("--")} <= options_of("bench/moe.py") for b in benches)
    assert all("--launch-skip 2 --launch-count 2" in line and "-k regex:_w4a8" in line
               for line in (tmp_path / "ncu.log").read_text().splitlines())
    moe = load_script("bench/moe.py", "bench_moe_v")
    assert "prefill-64x128, warps 8" in moe.VARIANTS


def test_e2e_replay_runs_marlin_experts_with_every_rounding_replayed_against_the_batch_floor(tmp_path):
    calls, out = run_step(tmp_path, "e2e-replay", files=("native-alone.json",))
    (bed,) = [a for a in calls if a[0] == "dsv4_lab/beds/engine_bed.py"]
    assert os.path.basename(bed[bed.index("--out") + 1]) == "engine-e2e-replay.json" and "--teacher-from" in bed
    (cmp,) = [a for a in calls if a[0] == "dsv4_lab/beds/compare.py"]
    assert [os.path.basename(x) for x in cmp[2:]] == ["engine-e2e-replay.json", "--floor", "native-alone.json"]


def test_seed_builds_the_committed_seed_when_there_is_one(tmp_path):
    seed, fi = tmp_path / "seed.json.xz", tmp_path / "fi.json.xz"
    seeds = {"JIT_SEED": str(seed), "FI_SEED": str(fi)}
    calls, stdout = run_step(tmp_path, "seed", env=seeds)
    assert calls == [] and f"no {seed}" in stdout, stdout
    seed.write_text("")
    fi.write_text("")
    (tmp_path / "again").mkdir()
    calls, _ = run_step(tmp_path / "again", "seed", env=seeds)
    assert [argv[argv.index("--seed") + 1] for argv in calls] == [str(seed), str(fi)]
    for argv in calls:
        assert argv[:2] == ["dsv4_lab/beds/jit_seed.py", "build"]
        flags = {a for a in argv if a.startswith("--")}
        assert flags <= options_of("dsv4_lab/beds/jit_seed.py"), flags


def test_teacher_sequences_wait_for_a_record_made_beside_them(tmp_path):
    # par with PAR_SAME_GPU: e2e's engine compiles while the oracle it teacher-forces is still being made
    import threading

    bed, path = load_script("dsv4_lab/beds/engine_bed.py", "engine_bed"), tmp_path / "native.json"
    threading.Timer(0.3, lambda: path.write_text(json.dumps({"teacher": [{"sequence": [5, 6]}, {"sequence": [7]}]}))).start()
    assert bed.teacher_sequences(str(path), wait_s=30, poll_s=0.05) == [[5, 6], [7]]
    with pytest.raises(SystemExit, match=r"teacher record .*absent.* after waiting 0 s"):
        bed.teacher_sequences(str(tmp_path / "never.json"), wait_s=0.1, poll_s=0.05)


def test_steps_waiting_for_a_teacher_get_the_wait_added_to_their_limit(tmp_path):
    calls, stdout = run_step(tmp_path, "e2e", env={"DSV4_BED_TEACHER_WAIT": "1500"})
    (bed,) = [a for a in calls if a[0] == "dsv4_lab/beds/engine_bed.py"]
    assert "--teacher-from" in bed and "timeout 1900 python dsv4_lab/beds/engine_bed.py" in stdout, stdout
    src = open(os.path.join(REPO, "dsv4_lab/beds/steps.sh")).read()
    assert "DSV4_BED_MAX_TOKENS=${DSV4_BED_MAX_TOKENS:-131072}" in src and "timeout $((400 + TW))" in src


def test_bg_prebuilds_this_paths_modules_beside_the_engines_with_flags_the_cli_has():
    """bg starts `prebuild-jit --arch gpu --all-modes` beside the engines (the FP8-Marlin GEMM was in no seed, so an
    fp8_marlin run compiled it inside its first forward, session 28); its flags are the CLI's own."""
    src = open(os.path.join(REPO, "tests", "gpu", "steps.sh")).read()
    body = src[src.index("\n  bg)"):src.index("\n  jitpack)")]
    call = re.search(r"python -m dsv4_sm80 prebuild-jit ([^>]*)>", body.replace("\\\n", " ")).group(1)
    flags = set(re.findall(r"--[a-z-]+", call))
    assert {"--arch", "--all-modes"} <= flags and "--arch gpu" in call
    assert flags <= options_of("dsv4_sm80/cli.py"), flags
    assert body.index("steps.sh seed") < body.index("prebuild-jit") < body.index("steps.sh par")
