"""python -m dsv4_sm80 doctor | serve | make-tiny | footprint | prebuild-jit, run as a user runs them."""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO, clean_env


def cli(*args, timeout=600, **env):
    e = clean_env(**env)
    e["PYTHONPATH"] = REPO
    return subprocess.run([sys.executable, "-m", "dsv4_sm80", *args], env=e, capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


@pytest.fixture(scope="module")
def no_gpu():
    import compat_check

    g = compat_check.collect_gpus()
    if g.devices:
        pytest.skip(f"these checks describe the CPU CI machine; this one has GPUs: {g.devices}")


def test_make_tiny(tmp_path):
    p = cli("make-tiny", str(tmp_path / "t"), "--preset", "unit", "--seed", "3", "--head-scale", "12")
    assert p.returncode == 0, p.stderr
    assert "10 shards" in p.stdout
    cfg = json.load(open(tmp_path / "t" / "config.json"))
    assert cfg["hidden_size"] == 256 and "vision_dim" not in cfg
    p = cli("make-tiny", str(tmp_path / "v"), "--preset", "unit", "--vocab", "129280", "--vision")
    assert p.returncode == 0, p.stderr
    assert json.load(open(tmp_path / "v" / "config.json"))["vision_n_layers"] == 2
    p = cli("make-tiny", str(tmp_path / "bad"), "--hidden", "300")
    assert p.returncode == 2 and "hidden 300 % 128 != 0" in p.stderr


def test_doctor_on_the_cpu_machine_names_the_gpu_check(no_gpu, unit_ckpt):
    p = cli("doctor", "--model-path", unit_ckpt, ENABLE_SGLANG_DSV4_A100_PATCH="1")
    assert p.returncode != 0
    fails = [line for line in p.stdout.splitlines() if line.startswith("FAIL")]
    assert fails and fails[0].startswith("FAIL gpu.count: found 0 visible GPUs"), p.stdout
    assert "PASS patch.active" in p.stdout and "PASS model.experts" in p.stdout
    assert "PENDING  launch.gate" in p.stdout


def test_doctor_json(no_gpu):
    from conftest import nvcc_home

    home = nvcc_home()  # CI's venv brings nvcc in a wheel; where none is found the gate says so too
    p = cli("doctor", "--json", ENABLE_SGLANG_DSV4_A100_PATCH="1", CUDA_HOME=home)
    doc = json.loads(p.stdout)
    assert p.returncode == 1 and doc["ok"] is False
    assert {c["check"] for c in doc["checks"] if c["status"] == "fail"} == (
        {"gpu.count"} if home else {"gpu.count", "jit.compiler"})
    from dsv4_sm80.apply import all_seams

    assert [s["name"] for s in doc["seams"]] == [s.name for s in all_seams({})]
    assert {s["target_check"] for s in doc["seams"]} == {"ok"}


@pytest.mark.sglang
def test_doctor_patch_off_applies_no_seam(no_gpu):
    pytest.importorskip("sglang", reason="CI installs sglang==0.5.16; --apply imports it")
    from dsv4_sm80.apply import all_seams

    seams = all_seams({})
    p = cli("doctor", "--apply", "--as-is", ENABLE_SGLANG_DSV4_A100_PATCH="0")
    assert f"seams: 0 applied, 0 pending (applied as SGLang imports their modules; --apply imports them now), " \
           f"{len(seams)} off by their toggles, 0 refused" in p.stdout
    assert "OFF      launch.gate" in p.stdout and "FAIL patch.active" in p.stdout
    assert "== seams (41 declared; in this process, ENABLE_SGLANG_DSV4_A100_PATCH='0')" in p.stdout
    # by default, the seams as serve's launch environment applies them, whatever this shell has
    enabled = sum(s.enabled({"ENABLE_SGLANG_DSV4_A100_PATCH": "1"}) for s in seams)  # the vision seams stay off
    assert enabled < len(seams)
    p = cli("doctor", "--apply", ENABLE_SGLANG_DSV4_A100_PATCH="0")
    assert "== seams (41 declared; as SGLang imports them there, ENABLE_SGLANG_DSV4_A100_PATCH='1')" in p.stdout
    assert "APPLIED  launch.gate" in p.stdout and f"seams: {enabled} applied, 0 pending" in p.stdout


def test_serve_refuses_on_this_machine(no_gpu, unit_ckpt):
    p = cli("serve", "--model-path", unit_ckpt, "--port", "30000")
    assert p.returncode == 1
    assert "FAIL gpu.count" in p.stdout and "PASS patch.active: the launch environment" in p.stdout
    assert "serve:" not in p.stdout  # SGLang was never launched
    p = cli("serve")
    assert p.returncode == 2 and "--model-path is required" in p.stderr


def test_serve_lab_mode_is_loud_and_uses_the_embedded_model(no_gpu, tmp_path):
    p = cli("serve", XDG_CACHE_HOME=str(tmp_path), DSV4_SM80_LAB_GPU_COUNT="1", DSV4_SM80_LAB_CC="9.0", timeout=900)
    assert "dsv4-sm80 LAB MODE: DSV4_SM80_LAB_GPU_COUNT=1, DSV4_SM80_LAB_CC=9.0" in p.stderr
    assert os.path.isfile(tmp_path / "dsv4_sm80" / "tiny-s0-tok" / "model.safetensors.index.json")
    assert p.returncode == 1 and "FAIL gpu.count: found 0 visible GPUs" in p.stdout
    assert "PASS model.keys" in p.stdout


def test_serve_refuses_an_open_bind_without_a_key(no_gpu, unit_ckpt):
    """Patched serving on a non-loopback address needs --api-key (or the logged opt-out); the key itself
    is never printed."""
    p = cli("serve", "--model-path", unit_ckpt, "--host", "0.0.0.0")
    assert p.returncode == 1
    assert ("FAIL server.bind: found --host 0.0.0.0 (not loopback) without --api-key; expected --api-key KEY "
            "for any address other than loopback") in p.stdout
    assert p.stdout.strip().endswith("gate: REFUSED, 2 failed (gpu.count, server.bind)"), p.stdout
    assert "serve:" not in p.stdout  # SGLang was never launched
    p = cli("serve", "--model-path", unit_ckpt, "--host=10.1.2.3", "--api-key", "sk-secret-123")
    assert "PASS server.bind: 10.1.2.3 with an API key" in p.stdout and "FAIL gpu.count" in p.stdout
    assert "sk-secret-123" not in p.stdout + p.stderr
    p = cli("serve", "--model-path", unit_ckpt, "--host", "0.0.0.0", DSV4_SM80_ALLOW_OPEN_BIND="1")
    assert "PASS server.bind: 0.0.0.0 WITHOUT an API key (DSV4_SM80_ALLOW_OPEN_BIND=1)" in p.stdout
    p = cli("serve", "--model-path", unit_ckpt, "--host", "127.0.0.1")
    assert "PASS server.bind: 127.0.0.1 (loopback)" in p.stdout


def test_serve_judges_sglangs_arguments_in_the_gates_report(no_gpu, unit_ckpt):
    """serve reads SGLang's arguments before SGLang parses them (its own DSV4 hook would only assert "Only EAGLE and
    DSPARK ..." on NEXTN) and the one report judges them: the speculative draft, the unverified modes, the stages'
    rules; doctor judges the same arguments the same way."""
    for flag in (["--speculative-algorithm", "NEXTN"], ["--speculative-algorithm=eagle"]):
        p = cli("serve", "--model-path", unit_ckpt, *flag)
        assert p.returncode == 1, p.stderr
        assert "FAIL speculative.draft: found --speculative-algorithm" in p.stdout
        assert "fix: use --speculative-algorithm DSPARK" in p.stdout and "serve:" not in p.stdout
    p = cli("serve", "--model-path", unit_ckpt, "--speculative-algorithm", "DSPARK", "--ep", "4",
            "--kv-cache-dtype=fp8_e5m2", "--moe-runner-backend", "auto", "--pp-size", "2")
    assert "PASS speculative.draft: DSPARK" in p.stdout and "FAIL gpu.count" in p.stdout
    assert "FAIL moe.expert_parallel: found --ep-size 4; expected 1: tensor parallelism only" in p.stdout
    assert "FAIL attention.kv_cache_dtype: found --kv-cache-dtype fp8_e5m2; expected auto or fp8_e4m3 or bfloat16" \
           in p.stdout and "fix: drop --kv-cache-dtype (the launch then sets bfloat16)" in p.stdout
    assert "PASS moe.runner_backend: --moe-runner-backend auto, set to marlin at launch" in p.stdout
    assert "FAIL server.modes: found --pp-size 2 (pipeline parallelism" in p.stdout
    d = cli("doctor", "--model-path", unit_ckpt, "--ep", "4", "--kv-cache-dtype=fp8_e5m2", "--pp-size", "2")
    report = [line for line in p.stdout.splitlines() if line.startswith(("PASS", "FAIL", "WARN", "SKIP", "gate:"))]
    assert [line for line in d.stdout.splitlines() if line in report and "speculative" not in line] == \
           [line for line in report if "speculative" not in line]


def test_doctor_keeps_secrets_out():
    p = cli("doctor", "--json", HF_TOKEN="hf_secret_token_9", SGLANG_API_KEY="sk-env-secret")
    assert "hf_secret_token_9" not in p.stdout + p.stderr and "sk-env-secret" not in p.stdout + p.stderr
    assert json.loads(p.stdout)["ok"] in (True, False)


def test_a_cold_first_start_gets_a_longer_watchdog(tmp_path):
    """No SM80 kernel in Triton's cache: SGLang's 300 s scheduler watchdog would kill the compiling first
    forward (native's took over 7.5 minutes cold on an H200), so serve raises it for that start and says so;
    a warm cache or the user's own --watchdog-timeout changes nothing."""
    from dsv4_sm80.stages.launch import FIRST_START_WATCHDOG_S, first_start_args

    cold = {"TRITON_CACHE_DIR": str(tmp_path / "triton"), "TVM_FFI_CACHE_DIR": str(tmp_path / "tvm")}
    rest, note = first_start_args(["--port", "30000"], cold)
    assert rest == ["--port", "30000", "--watchdog-timeout", str(FIRST_START_WATCHDOG_S)]
    assert "first start on this host" in note and str(tmp_path / "triton") in note and "is empty" in note
    for mine in (["--watchdog-timeout", "600"], ["--watchdog-timeout=600"]):
        assert first_start_args(mine, cold) == (mine, None)
    build = tmp_path / "triton" / "ABCDEF"
    build.mkdir(parents=True)
    (build / "_sparse_attn_kernel.json").write_text("{}")
    rest, note = first_start_args(["--port", "30000"], cold)  # our Triton kernels built, SGLang's JIT not yet
    assert "--watchdog-timeout" in rest and "Triton" not in note and str(tmp_path / "tvm") in note
    (tmp_path / "tvm" / "sgl_compress").mkdir(parents=True)
    assert first_start_args(["--port", "30000"], cold) == (["--port", "30000"], None)


# --- a tool's manners: one line for a bad input, never a traceback ------------------------------------

def run_main(capsys, *argv):
    from dsv4_sm80.cli import main

    try:
        rc = main(list(argv))
    except SystemExit as e:
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


def _options():
    """(subcommand, argparse action) for every option and positional of every subcommand."""
    import argparse

    from dsv4_sm80.cli import parser

    sub = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    for cmd, p in sub.choices.items():
        for a in p._actions:
            if not isinstance(a, argparse._HelpAction):
                yield cmd, a


def test_every_option_has_help_and_there_is_a_version(capsys):
    missing = [f"{cmd} {a.dest}" for cmd, a in _options() if not a.help]
    assert not missing, missing
    rc, out, _ = run_main(capsys, "--version")
    assert rc == 0 and out.startswith("dsv4-sm80 ")


def test_every_option_of_every_subcommand_refuses_a_bad_value_in_one_line(capsys, tmp_path):
    """Each option gets a value it cannot take; the answer is one line on stderr and a non-zero exit."""
    import argparse

    from dsv4_sm80 import cli

    a_file = tmp_path / "a-file"
    a_file.write_text("[]")
    by_type = {cli.positive_int: "0", cli.positive_float: "-1", cli.count: "-1", cli._arch: "banana",
               cli._label_parts: ","}
    by_dest = {"model_path": str(a_file), "config": str(a_file), "out": str(tmp_path / "no" / "x.json"),
               "out_dir": str(a_file)}
    target = str(tmp_path / "new")  # make-tiny's positional where another option is under test
    walked = []
    for cmd, a in _options():
        if isinstance(a, argparse._StoreTrueAction):
            value = None
        elif a.choices:
            value = "no-such-choice"
        elif a.type in by_type:
            value = by_type[a.type]
        else:
            assert a.dest in by_dest, f"{cmd} {a.dest}: give it a bad value in this test"
            value = by_dest[a.dest]
        if not a.option_strings:
            argv = [cmd, value]
        else:
            opt = a.option_strings[-1]
            argv = [cmd, f"{opt}=yes" if value is None else f"{opt}={value}"]
            if cmd == "make-tiny":
                argv.insert(1, target)
        rc, out, err = run_main(capsys, *argv)
        assert rc not in (0, None), (argv, out, err)
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, (argv, err)
        assert not os.path.exists(target), argv
        walked.append(f"{cmd} {a.dest}")
    assert len(walked) >= 25, walked
    for argv in (["nosuch"], [], ["doctor", "extra"], ["footprint", "--tp"]):
        rc, out, err = run_main(capsys, *argv)
        assert rc == 2 and len(err.strip().splitlines()) == 1, (argv, err)


def test_footprint_errors_are_one_line(capsys, tmp_path):
    cfg = tmp_path / "config.json"
    for text, phrase in (("[1]", "holds a JSON list, expected an object"),
                         ('{"hidden_size": "4096"}', "architectures is absent, expected a list"),
                         ("{", "cannot be read as JSON")):
        cfg.write_text(text)
        rc, _, err = run_main(capsys, "footprint", "--config", str(cfg))
        assert rc == 2 and phrase in err and len(err.strip().splitlines()) == 1, err
    from dsv4_sm80.checkpoint import format as fmt

    bad = dict(fmt.flash_0731_config(), hidden_size="4096")
    cfg.write_text(json.dumps(bad))
    rc, _, err = run_main(capsys, "footprint", "--config", str(cfg))
    assert rc == 2 and "hidden_size is a string ('4096'), expected an integer" in err, err
    rc, _, err = run_main(capsys, "footprint", "--model-path", str(tmp_path / "nope"))
    assert rc == 2 and "does not exist" in err
    rc, out, _ = run_main(capsys, "footprint", "--tp", "8")
    assert rc == 0 and "TP8" in out


def test_make_tiny_refuses_a_non_empty_target_and_shows_progress_on_a_terminal(capsys, tmp_path, monkeypatch):
    import io

    target = tmp_path / "t"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    rc, _, err = run_main(capsys, "make-tiny", str(target), "--preset", "unit")
    assert rc == 2 and "is not empty" in err and "--force" in err
    assert os.listdir(target) == ["notes.txt"]

    class Tty(io.StringIO):
        def isatty(self):
            return True

    tty = Tty()
    monkeypatch.setattr(sys, "stderr", tty)
    rc, out, _ = run_main(capsys, "make-tiny", str(target), "--preset", "unit", "--force")
    assert rc == 0 and "make-tiny: writing 0.08 GiB (unit preset)" in out
    assert "\rmake-tiny: 658/658 tensors, 0.08 GiB written\n" in tty.getvalue()
    assert (target / "notes.txt").read_text() == "mine" and (target / "config.json").is_file()
    monkeypatch.undo()
    rc, _, err = run_main(capsys, "make-tiny", str(tmp_path / "v"), "--preset", "unit", "--vision")
    assert rc == 2 and "pass --vocab 129280" in err


def test_doctor_answers_for_serve_by_default(no_gpu, unit_ckpt):
    """Without the patch switch exported, doctor still evaluates what `serve` will launch (serve sets it)
    and says so; --as-is evaluates this shell, where the patch is off."""
    p = cli("doctor", "--model-path", unit_ckpt)
    assert "PASS patch.active: the launch environment" in p.stdout, p.stdout
    assert p.stdout.startswith("doctor: evaluated for the environment `serve` launches SGLang in, assuming "
                               "ENABLE_SGLANG_DSV4_A100_PATCH=1")
    p = cli("doctor", "--model-path", unit_ckpt, "--as-is")
    assert "FAIL patch.active: found ENABLE_SGLANG_DSV4_A100_PATCH='' in this interpreter" in p.stdout
    assert p.stdout.startswith("doctor: evaluated for this shell's environment as it is (--as-is)")


def test_doctor_with_a_switch_outside_its_column(no_gpu):
    """doctor says what every SGLang launch of that shell would say (the gate's env.knobs line), in its report and
    without a traceback, for serve's environment (which keeps the bad value) and for the shell as it is."""
    for as_is in ([], ["--as-is"]):
        p = cli("doctor", *as_is, ENABLE_SGLANG_DSV4_A100_PATCH="yes")
        assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
        assert "FAIL env.knobs: found ENABLE_SGLANG_DSV4_A100_PATCH='yes'; expected one of 0, 1" in p.stdout
        assert "gate: REFUSED, 3 failed (gpu.count, env.knobs, patch.active)" in p.stdout, p.stdout
        assert ("ENABLE_SGLANG_DSV4_A100_PATCH='yes' as set, outside its column" in p.stdout) is not bool(as_is)


def test_compat_check_says_which_environment_it_judges(no_gpu):
    env = clean_env()
    env["PYTHONPATH"] = REPO
    p = subprocess.run([sys.executable, "compat_check.py"], env=env, capture_output=True, text=True, cwd=REPO,
                       timeout=600)
    assert p.stdout.startswith("gate: evaluated for this interpreter's environment (ENABLE_SGLANG_DSV4_A100_PATCH='')"
                               "; `python -m dsv4_sm80 doctor` evaluates the one `serve` launches SGLang in")
    assert "FAIL patch.active: found ENABLE_SGLANG_DSV4_A100_PATCH='' in this interpreter" in p.stdout
