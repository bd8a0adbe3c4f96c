"""Tool calls, reasoning and structured output through the SM80 path over HTTP (lab mode).

    DSV4_SM80_LAB_GPU_COUNT=1 DSV4_SM80_LAB_CC=9.0 python -m dsv4_lab.beds.tools_check --out tools.json \\
        [--model-path CKPT]

Starts `python -m dsv4_sm80 serve` on loopback (the embedded tiny checkpoint, or --model-path, e.g. the trained
one) with `--tool-call-parser deepseekv4 --reasoning-parser deepseek-v4`, then:
- tools: a chat request whose `tool_choice` names a function, and one with `tool_choice: "required"`: answered
  with a parsed `tool_calls` entry naming a offered function, its arguments JSON that validates against it;
- reasoning: a streamed thinking request (the prompt ends in `<think>`): the chunks carry `reasoning_content`;
- structured output: --requests JSON-schema requests (an object of one enum and one boolean, no other
  properties) and --requests regex requests, sampled at T = 0.7: every output parses and validates;
- a bad schema is answered 4xx and the next request 200.
Each check's status and a sample answer go to --out; exit 1 if one fails.
"""

from __future__ import annotations

import argparse
import json
import re
import sys

from dsv4_lab.beds.http_check import KEY, call
from dsv4_lab.beds.lab_server import lab_server

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"],
                   "additionalProperties": False}}}
SCHEMA = {"type": "object", "properties": {"color": {"type": "string", "enum": ["red", "green", "blue"]},
                                           "ok": {"type": "boolean"}},
          "required": ["color", "ok"], "additionalProperties": False}
REGEX = r"(yes|no), [0-9]{2}"


def post(port: int, path: str, body: dict, stream: bool = False):
    """(status, the answer's JSON, or for a stream its chunks' JSON); on an error status, the body's start."""
    status, text = call(port, path, body)
    if status != 200:
        return status, text[:300]
    if not stream:
        return status, json.loads(text)
    return status, [json.loads(ln[5:]) for ln in text.splitlines() if ln.startswith("data:")
                    and ln.strip() != "data: [DONE]"]


def valid(value, schema: dict) -> bool:
    """The subset of JSON Schema these checks use: object, string (enum), boolean, required, no extra keys."""
    t = schema.get("type")
    if "enum" in schema and value not in schema["enum"]:
        return False
    if t == "object":
        props = schema.get("properties", {})
        return (isinstance(value, dict) and all(k in value for k in schema.get("required", []))
                and (schema.get("additionalProperties", True) or set(value) <= set(props))
                and all(valid(v, props[k]) for k, v in value.items() if k in props))
    return {"string": isinstance(value, str), "boolean": isinstance(value, bool),
            "integer": isinstance(value, int) and not isinstance(value, bool)}.get(t, True)


def tool_call_ok(resp: dict, tools: list[dict], name: str | None) -> tuple[bool, str]:
    calls = resp["choices"][0]["message"].get("tool_calls") or []
    if not calls:
        return False, f"no tool_calls; content {resp['choices'][0]['message'].get('content')!r:.120}"
    fn = calls[0]["function"]
    offered = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    if fn["name"] not in offered or (name and fn["name"] != name):
        return False, f"called {fn['name']!r}; expected {name or sorted(offered)}"
    try:
        args = json.loads(fn["arguments"])
    except json.JSONDecodeError:
        return False, f"arguments are not JSON: {fn['arguments']!r:.120}"
    return valid(args, offered[fn["name"]]), f"{fn['name']}({fn['arguments']})"


def checks(port: int, n: int) -> list[dict]:
    out = []

    def record(check: str, ok: bool, sample: str):
        out.append({"check": check, "ok": ok, "sample": sample[:300]})

    ask = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
    for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        status, resp = post(port, "/v1/chat/completions", {
            "model": "default", "messages": ask, "tools": [WEATHER, TIME], "tool_choice": choice,
            "max_tokens": 128, "temperature": 0.0})
        ok, sample = tool_call_ok(resp, [WEATHER, TIME], "get_weather" if isinstance(choice, dict) else None) \
            if status == 200 else (False, f"HTTP {status}: {resp}")
        record(f"tool_choice {json.dumps(choice)}", ok, sample)
    status, chunks = post(port, "/v1/chat/completions", {
        "model": "default", "messages": ask, "max_tokens": 48, "temperature": 0.0, "stream": True,
        "chat_template_kwargs": {"thinking": True}}, stream=True)
    if status == 200:
        deltas = [c["choices"][0]["delta"] for c in chunks if c.get("choices")]
        reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
        content = "".join(d.get("content") or "" for d in deltas)
        record("reasoning: streamed thinking request", bool(reasoning) and "<think>" not in content,
               f"reasoning {reasoning!r:.120}; content {content!r:.120}")
    else:
        record("reasoning: streamed thinking request", False, f"HTTP {status}: {chunks}")
    bad = []
    for i in range(n):
        status, resp = post(port, "/v1/chat/completions", {
            "model": "default", "messages": [{"role": "user", "content": f"A color and a truth value, {i}."}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA}},
            "max_tokens": 64, "temperature": 0.7, "seed": i})
        text = (resp["choices"][0]["message"]["content"] or "") if status == 200 else f"HTTP {status}: {resp}"
        try:
            good = status == 200 and valid(json.loads(text), SCHEMA)
        except json.JSONDecodeError:
            good = False
        if not good:
            bad.append(text)
    record(f"json_schema: {n} sampled requests parse and validate", not bad, bad[0] if bad else text)
    bad = []
    for i in range(n):
        status, resp = post(port, "/generate", {"text": f"Answer {i}: ", "sampling_params": {
            "regex": REGEX, "max_new_tokens": 16, "temperature": 0.7}})
        text = resp["text"] if status == 200 else f"HTTP {status}: {resp}"
        if not re.fullmatch(REGEX, text):
            bad.append(text)
    record(f"regex: {n} sampled requests match {REGEX}", not bad, bad[0] if bad else text)
    status, resp = post(port, "/v1/chat/completions", {
        "model": "default", "messages": ask, "max_tokens": 16,
        "response_format": {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "nonsense"}}}})
    after, _ = post(port, "/v1/chat/completions", {"model": "default", "messages": ask, "max_tokens": 4})
    record("a bad schema is 4xx, the next request 200", 400 <= status < 500 and after == 200,
           f"HTTP {status}: {resp}; next HTTP {after}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model-path", help="default: serve's embedded tiny checkpoint")
    ap.add_argument("--port", type=int, default=30133)
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--startup-timeout", type=int, default=500)
    args = ap.parse_args(argv)
    # a capped pool under a high fraction: other engines on the GPU keep their room (see http_check)
    serve = ["--api-key", KEY, "--context-length", "4096", "--mem-fraction-static", "0.85", "--max-total-tokens",
             "65536", "--disable-cuda-graph", "--tool-call-parser", "deepseekv4", "--reasoning-parser", "deepseek-v4",
             *(["--model-path", args.model_path] if args.model_path else [])]
    log = args.out.removesuffix(".json") + ".server.log"
    with lab_server(args.port, serve, log, timeout=args.startup_timeout) as (_, startup):
        results = checks(args.port, args.requests)
    with open(args.out, "w") as f:
        json.dump({"startup_s": startup, "model_path": args.model_path, "results": results}, f, indent=1)
    for r in results:
        print(f"  {'OK  ' if r['ok'] else 'FAIL'} {r['check']}: {r['sample']}")
    print("tools_check:", "OK" if all(r["ok"] for r in results) else "FAILED", f"(server start {startup:.0f} s)")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
