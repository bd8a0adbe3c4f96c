"""Replacement for the `launch.gate` seam: the gate, run inside SGLang's own launch.

`Engine._launch_subprocesses` (srt/entrypoints/engine.py:765) is the one path by which both
`sglang.Engine` and `python -m sglang.launch_server` start their scheduler processes, so running
the gate first there means a PYTHONPATH-injected SGLang refuses exactly like `serve` does.
"""

from __future__ import annotations

import sys


def refusal(lines):
    """The refusal every launch-time check raises: its lines on stderr, then GateRefused, before any
    scheduler process starts (the gate here; the MoE and attention launch checks too)."""
    import compat_check

    text = "dsv4-sm80 gate refused to launch SGLang:\n" + "\n".join(lines)
    print(text, file=sys.stderr, flush=True)
    return compat_check.GateRefused(text)


def before_launch(cls, server_args, *args, **kwargs):
    import compat_check

    compat_check.banner_once()
    facts = compat_check.collect(model_path=server_args.model_path)
    findings = compat_check.evaluate(facts)
    findings.append(compat_check.check_speculative(getattr(server_args, "speculative_algorithm", None), facts.model))
    findings.append(compat_check.check_modes(server_args))
    findings.append(compat_check.check_bind(getattr(server_args, "host", None),
                                            bool(getattr(server_args, "api_key", None))))
    bad = compat_check.failures(findings)
    if bad:
        raise refusal(f.line() for f in bad)
    for f in findings:
        if f.check == "server.bind" and "WITHOUT" in f.found:
            print(f"dsv4-sm80: {f.line()}", file=sys.stderr, flush=True)
    return None
