"""The launch_server command line as the gate reads it before SGLang does (dsv4_sm80/gate/argv.py), held to
SGLang 0.5.16's own parser."""

import argparse

import pytest

from dsv4_sm80.gate import argv
from dsv4_sm80.gate.checks import UNVERIFIED_MODES
from dsv4_sm80.seams import SERVER_ARGS


@pytest.fixture(scope="module")
def sglang_parser():
    pytest.importorskip("sglang", reason="CI installs sglang==0.5.16; the flags are held to its parser")
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return parser


def test_every_flag_the_checks_read_is_read_as_sglang_spells_it(sglang_parser):
    read = {"host", "api_key", "speculative_algorithm", "skip_tokenizer_init", "tokenizer_path", "model_path",
            *(attr for attr, _, _ in UNVERIFIED_MODES), *(r.attr for r in SERVER_ARGS)}
    assert read == set(argv.ATTRS)
    actions = {a.dest: a for a in sglang_parser._actions}
    for attr in argv.ATTRS:
        action = actions[attr]
        assert tuple(action.option_strings) == argv.flags(attr), attr
        assert argv.kind(attr) == ("flag" if action.nargs == 0 else "values" if action.nargs == "*" else "value"), attr


def test_a_command_line_reads_as_sglang_parses_it(sglang_parser):
    line = ["--model", "/m", "--host=0.0.0.0", "--port", "30000", "--ep", "4", "--enable-dp-attention",
            "--lora-paths", "a=/x", "b=/y", "--kv-cache-dtype", "fp8_e5m2", "--trust-remote-code",
            "--pipeline-parallel-size", "2", "--api-key", "k", "--api-key=k2"]
    ours = vars(argv.server_args(line))
    theirs = vars(sglang_parser.parse_args(line))
    assert ours == {"model_path": "/m", "host": "0.0.0.0", "ep_size": "4", "enable_dp_attention": True,
                    "lora_paths": ["a=/x", "b=/y"], "kv_cache_dtype": "fp8_e5m2", "pp_size": "2", "api_key": "k2"}
    for attr, value in ours.items():
        got = theirs[attr]
        assert (got if isinstance(got, bool) else str(got) if not isinstance(value, list) else value) == value, attr
    assert vars(argv.server_args([])) == {}  # the checks then take SGLang's defaults


def test_secrets_never_print():
    assert argv.redact(["x", "--api-key", "k1", "--admin-api-key=k2", "--port", "1", "--ssl-keyfile-password",
                        "p"]) == ["x", "--api-key", "***", "--admin-api-key=***", "--port", "1",
                                  "--ssl-keyfile-password", "***"]
    assert argv.flag_value(["--watchdog-timeout", "5", "--watchdog-timeout=9"], "--watchdog-timeout") == "9"
