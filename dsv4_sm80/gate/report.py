"""The gate's findings and its one report: one line per check; a failed one names what was found,
what was expected and what to do."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass

from .. import env

RELEASES = ("deepseek-ai/DeepSeek-V4-Flash-0731", "deepseek-ai/DeepSeek-V4-Flash-Vision-Exp")  # README names the same
OFFICIAL = f"the official, unconverted checkpoint ({' or '.join(RELEASES)})"


@dataclass
class Finding:
    check: str
    status: str  # pass | warn | fail | skip (warn: the launch goes ahead, with what the line says)
    found: str = ""
    expected: str = ""
    fix: str = ""

    def line(self) -> str:
        if self.status == "fail":
            return f"FAIL {self.check}: found {self.found}; expected {self.expected}; fix: {self.fix}"
        return f"{self.status.upper()} {self.check}: {self.found}"


def ok(check, found) -> Finding:
    return Finding(check, "pass", found)


def fail(check, found, expected, fix) -> Finding:
    return Finding(check, "fail", " ".join(str(found).split()), expected, fix)


def warn(check, found) -> Finding:
    return Finding(check, "warn", " ".join(str(found).split()))


def skip(check, why) -> Finding:
    return Finding(check, "skip", why)


def guarded(check: str, fn, *args) -> list:
    """fn(*args) as a list of findings; an exception inside a check becomes that check's FAIL line,
    never a traceback (an input the checks do not foresee is still refused, by name)."""
    try:
        out = fn(*args)
    except BaseException as e:  # a Rust panic from a parsing library arrives as a BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        text = str(e).splitlines()[0][:200] if str(e) else ""
        return [fail(check, f"the check stopped on {type(e).__name__}: {text}", "an input this check can judge",
                     "compare the input named by the check with the official release; report this line if it "
                     "matches the release")]
    return out if isinstance(out, list) else [out]


class GateRefused(RuntimeError):
    """The gate failed; the message holds one line per failed check."""


def refusal(findings) -> GateRefused:
    """The launch stage's refusal: the failed checks' lines and the verdict on stderr, then GateRefused, before any
    scheduler process starts."""
    bad = failures(findings)
    text = "dsv4-sm80 gate refused to launch SGLang:\n" + "\n".join([*(f.line() for f in bad), verdict(findings)])
    print(text, file=sys.stderr, flush=True)
    return GateRefused(text)


def failures(findings) -> list:
    return [f for f in findings if f.status == "fail"]


def verdict(findings) -> str:
    """The report's last line: passed, or refused naming every check that failed."""
    bad = failures(findings)
    if not bad:
        return "gate: passed"
    names = ", ".join(dict.fromkeys(f.check for f in bad))
    return f"gate: REFUSED, {len(bad)} failed ({names})"


def report(facts, findings, as_json=False) -> str:
    if as_json:
        m = facts.model
        cfg = m.config_dict or {}
        return json.dumps({
            "ok": not failures(findings),
            "lab_overrides": facts.lab,
            "checks": [asdict(f) for f in findings],
            "facts": {
                "sglang": asdict(facts.sglang), "gpus": asdict(facts.gpus), "patch": asdict(facts.patch),
                "interconnect": asdict(facts.interconnect) if facts.interconnect is not None else None,
                "model": {"path": m.path, "shards_read": sum(h.entries is not None for h in m.shards.values()),
                          "architectures": cfg.get("architectures")},
                "jit_caches": [asdict(d) for d in facts.jit] if facts.jit is not None else None,
                "nvcc": asdict(facts.nvcc) if facts.nvcc is not None else None,
            },
        }, indent=2, default=str)
    return "\n".join([*(f.line() for f in findings), verdict(findings)])


def banner_once(stream=None):
    b = env.lab_banner()
    if b:
        print(b, file=stream or sys.stderr, flush=True)
