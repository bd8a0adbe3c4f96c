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
    from dsv4_sm80.seams import SEAMS

    assert [s["name"] for s in doc["seams"]] == [s.name for s in SEAMS]
    assert {s["target_check"] for s in doc["seams"]} == {"ok"}


@pytest.mark.sglang
def test_doctor_patch_off_applies_no_seam(no_gpu):
    pytest.importorskip("sglang", reason="CI installs sglang==0.5.16; --apply imports it")
    p = cli("doctor", "--apply", "--as-is", ENABLE_SGLANG_DSV4_A100_PATCH="0")
    assert "seams: 0 applied in this process (patch off and no overlay switched on: none is applied)" in p.stdout
    assert "OFF      launch.gate" in p.stdout and "FAIL patch.active" in p.stdout
    p = cli("doctor", "--apply", ENABLE_SGLANG_DSV4_A100_PATCH="1")
    from dsv4_sm80.seams import SEAMS

    enabled = sum(s.enabled({"ENABLE_SGLANG_DSV4_A100_PATCH": "1"}) for s in SEAMS)  # tripwire seams stay off
    assert enabled < len(SEAMS)
    assert "APPLIED  launch.gate" in p.stdout and f"seams: {enabled} applied in this process" in p.stdout


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
            "for any address other than loopback") in p.stderr
    assert "== gate" not in p.stdout and "serve:" not in p.stdout  # refused before anything else
    p = cli("serve", "--model-path", unit_ckpt, "--host=10.1.2.3", "--api-key", "sk-secret-123")
    assert "server.bind" not in p.stderr and "FAIL gpu.count" in p.stdout  # past the bind rule, stopped by the gate
    assert "sk-secret-123" not in p.stdout + p.stderr
    p = cli("serve", "--model-path", unit_ckpt, "--host", "0.0.0.0", DSV4_SM80_ALLOW_OPEN_BIND="1")
    assert "PASS server.bind: 0.0.0.0 WITHOUT an API key (DSV4_SM80_ALLOW_OPEN_BIND=1)" in p.stderr
    p = cli("serve", "--model-path", unit_ckpt, "--host", "127.0.0.1")
    assert "server.bind" not in p.stderr


def test_serve_refuses_nextn_before_sglang_parses_it(no_gpu, unit_ckpt):
    """NEXTN on a checkpoint whose draft is DSPARK: refused by name before SGLang starts (SGLang's own DSV4
    hook would only assert "Only EAGLE and DSPARK ..." first, as the H200 run showed); DSPARK goes on to the gate."""
    for flag in (["--speculative-algorithm", "NEXTN"], ["--speculative-algorithm=eagle"]):
        p = cli("serve", "--model-path", unit_ckpt, *flag)
        assert p.returncode == 1, p.stderr
        assert "serve: FAIL speculative.draft: found --speculative-algorithm" in p.stderr
        assert "fix: use --speculative-algorithm DSPARK" in p.stderr
        assert "== gate" not in p.stdout and "serve:" not in p.stdout
    p = cli("serve", "--model-path", unit_ckpt, "--speculative-algorithm", "DSPARK")
    assert "speculative.draft" not in p.stderr and "FAIL gpu.count" in p.stdout


def test_redact_and_doctor_keep_secrets_out():
    from dsv4_sm80.cli import redact

    assert redact(["x", "--api-key", "k1", "--admin-api-key=k2", "--port", "1", "--ssl-keyfile-password", "p"]) == \
        ["x", "--api-key", "***", "--admin-api-key=***", "--port", "1", "--ssl-keyfile-password", "***"]
    p = cli("doctor", "--json", HF_TOKEN="hf_secret_token_9", SGLANG_API_KEY="sk-env-secret")
    assert "hf_secret_token_9" not in p.stdout + p.stderr and "sk-env-secret" not in p.stdout + p.stderr
    assert json.loads(p.stdout)["ok"] in (True, False)


def test_a_cold_first_start_gets_a_longer_watchdog(tmp_path):
    """No SM80 kernel in Triton's cache: SGLang's 300 s scheduler watchdog would kill the compiling first
    forward (native's took over 7.5 minutes cold on an H200), so serve raises it for that start and says so;
    a warm cache or the user's own --watchdog-timeout changes nothing."""
    from dsv4_sm80.cli import FIRST_START_WATCHDOG_S, first_start_args

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
