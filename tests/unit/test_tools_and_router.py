"""What users run besides plain chat, held on the CPU: DeepSeek-V4's tool-call and reasoning parsers pass the gate
and exist in SGLang 0.5.16; a tools request's prompt builds with SGLang's DSV4 encoding and the stand-in tokenizer;
the router command in docs/serving.md uses only flags the installed router takes. The requests themselves run in the GPU
suite (`dsv4_lab/beds/tools_check.py`)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.unit.test_gate import facts  # the gate tests' good host

pytestmark = pytest.mark.sglang
REPO = __import__("pathlib").Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text(encoding="utf-8")
SERVING = (REPO / "docs" / "serving.md").read_text(encoding="utf-8")
TOOL_PARSER, REASONING_PARSER = "deepseekv4", "deepseek-v4"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city"]}}}


def test_sglang_has_the_dsv4_parsers_the_readme_names():
    from sglang.srt.function_call.function_call_parser import FunctionCallParser
    from sglang.srt.parser.reasoning_parser import ReasoningParser

    assert TOOL_PARSER in FunctionCallParser.ToolCallParserEnum
    assert REASONING_PARSER in ReasoningParser.DetectorMap
    assert f"--tool-call-parser {TOOL_PARSER} --reasoning-parser {REASONING_PARSER}" in README


def test_the_gate_passes_the_parser_flags(unit_ckpt):
    from dsv4_sm80 import gate
    from dsv4_sm80.gate import argv

    line = ["--model-path", unit_ckpt, "--tp-size", "4", "--tool-call-parser", TOOL_PARSER,
            "--reasoning-parser", REASONING_PARSER]
    findings = gate.evaluate(facts(unit_ckpt), server_args=argv.server_args(line))
    assert not gate.failures(findings), [f.line() for f in gate.failures(findings)]


@pytest.fixture(scope="module")
def stand_in_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from dsv4_sm80.tiny.tokenizer import write_tokenizer

    d = tmp_path_factory.mktemp("tok")
    write_tokenizer(str(d), 384)
    return AutoTokenizer.from_pretrained(str(d))


@pytest.mark.parametrize("thinking", ["chat", "thinking"])
def test_a_tools_prompt_builds_with_the_dsv4_encoding_and_the_stand_in_tokenizer(stand_in_tokenizer, thinking):
    """As SGLang's serving_chat builds a DSV4 tools request (chat_encoding_spec "dsv4"): an empty system message
    carrying the tools, then encoding_dsv4.encode_messages, then the tokenizer."""
    from sglang.srt.entrypoints.openai import encoding_dsv4
    from sglang.srt.entrypoints.openai.chat_encoding import resolve_chat_encoding_spec

    assert resolve_chat_encoding_spec(hf_config=type("C", (), {"architectures": ["DeepseekV4ForCausalLM"]}),
                                      tokenizer=stand_in_tokenizer, tool_call_parser=TOOL_PARSER) == "dsv4"
    messages = [{"role": "system", "content": "", "tools": [WEATHER]},
                {"role": "user", "content": "Weather in Paris, in celsius?"}]
    text = encoding_dsv4.encode_messages(messages, thinking_mode=thinking, reasoning_effort=None)
    assert '<｜DSML｜tool_calls>' in text and "get_weather" in text and '"enum": ["c", "f"]' in text
    assert text.endswith("<｜Assistant｜>" + ("<think>" if thinking == "thinking" else "</think>"))
    ids = stand_in_tokenizer.encode(text, add_special_tokens=False)
    assert ids and max(ids) < 384
    assert stand_in_tokenizer.decode(ids) == text  # byte-level: every character of the prompt survives
    for special in ("<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<think>" if thinking == "thinking"
                    else "</think>"):  # each one id, as the model was trained with
        assert stand_in_tokenizer.convert_tokens_to_ids(special) in ids, special
    assert ids[0] == 0  # BOS is id 0, as config.json says


def test_the_router_command_uses_flags_the_router_takes():
    pytest.importorskip("smg", reason="the router (smg) is in the test extra")
    assert "docs/serving.md" in README
    block = SERVING.split("## More than one box", 1)[1].split("```", 2)[1]
    flags = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", block))
    assert {"--worker-urls", "--policy", "--health-check-endpoint"} <= flags
    help_text = subprocess.run([sys.executable, "-m", "smg", "launch", "--help"], capture_output=True, text=True,
                               timeout=120).stdout
    known = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", help_text))
    assert flags <= known, flags - known
    assert "cache_aware" in help_text
