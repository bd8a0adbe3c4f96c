"""`python -m dsv4_sm80 doctor`: will `serve` start here? The gate's report and every seam's state, both for the
environment SGLang would run in: by default the one `serve` launches it in (the patch switch and PYTHONPATH it
sets), with --as-is this shell's own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from . import env, upstream

# the seam states as a process started in the evaluated environment sees them (argv[1] == "1": targets imported)
_SEAM_PROBE = ("import json, sys; from dsv4_sm80 import apply; "
               "print(json.dumps(apply.import_targets() if sys.argv[1] == '1' else apply.status()))")


def seam_states(environ, import_targets: bool) -> list[dict]:
    """apply.status() in this process (environ None) or in a Python process started with `environ`."""
    from . import apply

    if environ is None:
        return apply.import_targets() if import_targets else apply.status()
    r = subprocess.run([sys.executable, "-c", _SEAM_PROBE, "1" if import_targets else "0"], env=environ,
                       capture_output=True, text=True, timeout=600)
    try:
        return json.loads(r.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        said = (r.stderr.strip().splitlines() or ["no output"])[-1][:300]
        return [{"name": s.name, "target": s.target, "kind": s.kind, "upstream": s.upstream, "toggle": "",
                 "state": "refused", "detail": f"the seam probe in that environment failed: {said}",
                 "applied_count": 0} for s in apply.all_seams()]


def doctor(model_path, server_args, as_is: bool, import_targets: bool, as_json: bool) -> int:
    from . import apply, gate

    if as_is:
        patch_environ, assumed = None, []
        where = "this shell's environment as it is (--as-is)"
        seams_where = f"in this process, {env.PATCH.name}={os.environ.get(env.PATCH.name, '')!r}"
    else:
        patch_environ, assumed = gate.launch_environ()
        where = ("the environment `serve` launches SGLang in, assuming " + "; ".join(assumed)
                 + " (--as-is: this shell's environment as it is)")
        seams_where = f"as SGLang imports them there, {env.PATCH.name}={patch_environ.get(env.PATCH.name, '')!r}"
    facts, findings = gate.run_gate(model_path, patch_environ, gate.tokenizer_wanted(server_args), server_args)
    states = seam_states(patch_environ, import_targets)
    declared = {s.name: s for s in apply.all_seams()}
    for st in states:
        s = declared[st["name"]]
        st["target_check"] = upstream.target_state(facts.sglang.location, s.upstream_file, s.attr_path)
    seam_bad = [s for s in states if s["target_check"] != "ok" or s["state"] == "refused"]
    gate_bad = gate.failures(findings)
    if as_json:
        report = json.loads(gate.report(facts, findings, as_json=True))
        report.update(evaluated_for="as-is" if as_is else "serve", assumed=assumed, seams=states,
                      ok=not gate_bad and not seam_bad)
        print(json.dumps(report, indent=2))
        return 1 if gate_bad or seam_bad else 0
    print(f"doctor: evaluated for {where}")
    print("== gate")
    print(gate.report(facts, findings))
    print(f"== seams ({len(states)} declared; {seams_where})")
    for st in states:
        detail = f" - {st['detail']}" if st["detail"] else ""
        print(f"{st['state'].upper():8s} {st['name']}: {st['target']} [{st['kind']}, upstream {st['upstream']}, "
              f"toggle {st['toggle']}] target {st['target_check']}{detail}")
    count = {k: sum(s["state"] == k for s in states) for k in ("applied", "pending", "off", "refused")}
    print(f"seams: {count['applied']} applied, {count['pending']} pending (applied as SGLang imports their modules; "
          f"--apply imports them now), {count['off']} off by their toggles, {count['refused']} refused")
    return 1 if gate_bad or seam_bad else 0
