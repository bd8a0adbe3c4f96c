"""The suite's verdicts: each reads a job's record and holds it to a fixed threshold.

`tests/gpu/test_core.py` asserts them; the runner prints them after every call. A verdict whose record is absent
is `not measured` (never a pass). The thresholds:
- bits per byte on the held-out windows, per path: within BPB_REL of the reference's under R_q;
- the SM80 path against native on the same records: greedy agreement with R_q's greedy no more than
  GREEDY_MARGIN ids (of 128) below native's, long-decode NLL drift no more than DRIFT_MARGIN nats above native's
  at each temperature (drift: the last 500-id segment's mean NLL under R_q less the first's);
- DSPARK: accept length at least ACCEPT_MIN on every path, and the SM80 path's at least ACCEPT_VS_NATIVE of
  native's. The DSPARK speed-up is recorded, never asserted (engines share the GPU);
- the accuracy rule (`dsv4_lab.oracle.metrics`) against R_q on held-out text: the SM80 default path passes, the
  negative control passes, and every mutant is caught, mutants of at least MUTANT_STAGES stages among them;
- the attention kit, the kernel tests, the HTTP check and the tools check: every case of their record passed;
- the trained Vision-Exp (`vision-trained.json`, `python -m dsv4_lab.vision score`): on each path colour naming
  accuracy at least COLOUR_MIN and split, shape and two-image accuracy at least LAYOUT_MIN on held-out pictures,
  the SM80 path passes the accuracy rule against native on the answers, and every vision mutant run is caught.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

BPB_REL = 0.005
GREEDY_MARGIN = 8.0
DRIFT_MARGIN = 0.10
ACCEPT_MIN = 1.5
ACCEPT_VS_NATIVE = 0.95
MUTANT_STAGES = 4
COLOUR_MIN = 0.95
LAYOUT_MIN = 0.90


@dataclass(frozen=True)
class Verdict:
    name: str
    ok: bool | None  # None: not measured
    figure: str

    def __str__(self) -> str:
        mark = {True: "PASS", False: "FAIL", None: "----"}[self.ok]
        return f"{mark} {self.name}: {self.figure}"


def _missing(name: str, what: str) -> Verdict:
    return Verdict(name, None, f"not measured ({what})")


def trained(t: dict | None) -> list[Verdict]:
    """Verdicts of `trained.json` (`python -m dsv4_lab.gpu score`): per path, then the SM80 path against native."""
    paths = (t or {}).get("paths", {})
    out = []
    for p in ("native", "sm80"):
        name = f"{p}: bits per byte within {BPB_REL:.1%} of R_q"
        if p not in paths:
            out.append(_missing(name, f"no {p} record" if t else "no trained.json"))
            continue
        ref = t["reference"]["R_q"]["bits_per_byte"]
        bpb = paths[p]["bits_per_byte"]
        rel = (bpb - ref) / ref
        out.append(Verdict(name, abs(rel) <= BPB_REL, f"{bpb:.4f} against R_q {ref:.4f} ({rel:+.2%})"))
    for p in ("native", "sm80"):
        name = f"{p}: DSPARK accept length >= {ACCEPT_MIN}"
        acc = paths.get(p, {}).get("dspark_accept_len")
        if acc is None:
            out.append(_missing(name, f"no {p} DSPARK record"))
        else:
            out.append(Verdict(name, acc >= ACCEPT_MIN, f"{acc:.2f}; speed-up {paths[p]['dspark_speedup']:.2f}x "
                                                        f"(recorded), greedy identical to plain: "
                                                        f"{paths[p]['dspark_greedy_identical']}"))
    return out + against_native(paths.get("native"), paths.get("sm80"))


def against_native(native: dict | None, sm80: dict | None) -> list[Verdict]:
    names = [f"sm80: greedy agreement with R_q at most {GREEDY_MARGIN:.0f} ids below native's",
             f"sm80: long-decode drift at most {DRIFT_MARGIN} nats above native's",
             f"sm80: DSPARK accept length at least {ACCEPT_VS_NATIVE:.0%} of native's"]
    if native is None or sm80 is None:
        return [_missing(n, "needs the native and the sm80 records") for n in names]
    g_n, g_s = native["greedy_match_mean"], sm80["greedy_match_mean"]
    out = [Verdict(names[0], g_s >= g_n - GREEDY_MARGIN, f"{g_s:.1f} against native {g_n:.1f} (of "
                                                         f"{sm80.get('greedy_new', '?')})")]
    worst, figs = True, []
    for temp, d in sm80["long_decode_nll"].items():
        dn = native["long_decode_nll"][temp]["drift"]
        worst &= d["drift"] <= dn + DRIFT_MARGIN
        figs.append(f"T={temp}: {d['drift']:+.3f} against native {dn:+.3f}")
    out.append(Verdict(names[1], worst, "; ".join(figs)))
    a_n, a_s = native.get("dspark_accept_len"), sm80.get("dspark_accept_len")
    if a_n is None or a_s is None:
        out.append(_missing(names[2], "needs both DSPARK records"))
    else:
        out.append(Verdict(names[2], a_s >= ACCEPT_VS_NATIVE * a_n, f"{a_s:.2f} against native {a_n:.2f}"))
    return out


def accuracy(acc: dict | None, stages: dict[str, str] | None = None) -> list[Verdict]:
    """Verdicts of `accuracy.json` (`python -m dsv4_lab.oracle compare`) against R_q: the SM80 default path passes
    the rule, the negative control passes it, and mutants of at least MUTANT_STAGES stages are each caught.
    stages: mutant name -> its stage (default: dsv4_lab.mutants)."""
    names = ["accuracy rule against R_q: the SM80 default path passes",
             "accuracy rule: the negative control (native, reversed batch) passes",
             f"accuracy rule: every mutant caught, of at least {MUTANT_STAGES} stages"]
    if acc is None:
        return [_missing(n, "no accuracy.json") for n in names]
    if stages is None:
        from dsv4_lab.mutants import MUTANTS

        stages = {n: m.stage for n, m in MUTANTS.items()}
    ref = acc["references"]["R_q"]

    def rule(row: dict) -> str:
        return f"KL {row['kl_ratio']:.2f}x native's, top-1 at 1 nat {row['agree_drop_points']:+.2f} points below"

    out = []
    for name, rows in ((names[0], ref["paths"]), (names[1], ref["controls"])):
        if not rows:
            out.append(_missing(name, "no record"))
            continue
        (row,) = rows.values()
        out.append(Verdict(name, row["passes"], rule(row) + "".join(f"; {r}" for r in row["reasons"])))
    muts = ref["mutants"]
    missed = [n for n, r in muts.items() if not r["caught"]]
    kinds = {stages.get(n, "?") for n, r in muts.items() if r["caught"]}
    out.append(Verdict(names[2], bool(muts) and not missed and len(kinds) >= MUTANT_STAGES,
                       f"{len(muts) - len(missed)}/{len(muts)} caught, stages {', '.join(sorted(kinds))}"
                       + (f"; missed {', '.join(missed)}" if missed else "")))
    return out


def attention_kit(results: list | None) -> Verdict:
    name = "attention kit on the SM80 backend: every case passes"
    if results is None:
        return _missing(name, "no attention_kit.json")
    bad = [f"{r['kind']} {r['case']}: {r['error'].splitlines()[0]}" for r in results if not r["ok"]]
    return Verdict(name, not bad and bool(results), f"{len(results) - len(bad)}/{len(results)} passed"
                   + (f"; first failure {bad[0]}" if bad else ""))


def kernels(junit_xml: str | None) -> Verdict:
    name = "kernel tests compiled on the GPU: none fails"
    if junit_xml is None:
        return _missing(name, "no kernels.xml")
    root = ET.fromstring(junit_xml)
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    n = sum(int(s.get("tests", 0)) for s in suites)
    bad = sum(int(s.get("failures", 0)) + int(s.get("errors", 0)) for s in suites)
    skipped = sum(int(s.get("skipped", 0)) for s in suites)
    return Verdict(name, bad == 0 and n > skipped, f"{n - bad - skipped} passed, {bad} failed, {skipped} skipped")


def http(record: dict | None) -> Verdict:
    name = "serve in lab mode: every request answered as expected, bad launches refused, healthy after"
    if record is None:
        return _missing(name, "no http.json")
    bad = [r["check"] for r in record["results"] if not r["ok"]]
    return Verdict(name, not bad and record["healthy_after"],
                   f"{len(record['results']) - len(bad)}/{len(record['results'])} as expected, start "
                   f"{record['startup_s']:.0f} s" + (f"; failing: {', '.join(bad)}" if bad else ""))


def tools(record: dict | None, which: str) -> Verdict:
    name = f"tools, reasoning and structured output ({which}): every check passes"
    if record is None:
        return _missing(name, "no record")
    bad = [r["check"] for r in record["results"] if not r["ok"]]
    return Verdict(name, not bad, f"{len(record['results']) - len(bad)}/{len(record['results'])} pass"
                   + (f"; failing: {', '.join(bad)}" if bad else ""))


def vision(record: dict | None) -> list[Verdict]:
    """Verdicts of `vision-trained.json`: accuracy per path and question kind, the rule, the mutants."""
    if record is None:
        return [_missing("trained Vision-Exp: held-out picture questions", "no vision-trained.json")]
    out = []
    for path, row in sorted(record["paths"].items()):
        acc = {k[:-len("_accuracy")]: v for k, v in row.items() if k.endswith("_accuracy")}
        low = [k for k, v in acc.items() if v < (COLOUR_MIN if k == "color" else LAYOUT_MIN)]
        out.append(Verdict(f"trained Vision-Exp on {path}: color >= {COLOUR_MIN}, split/shape/two >= {LAYOUT_MIN}",
                           not low, " ".join(f"{k} {v:.3f}" for k, v in acc.items())))
        if path != "native":
            v = row["rule"]["verdict"]
            out.append(Verdict(f"trained Vision-Exp on {path}: the accuracy rule on the answers against native",
                               v["passes"], f"KL x{v['kl_ratio']:.2f} of native's" + (
                                   f"; {v['reasons'][0]}" if v["reasons"] else "")))
    for name, m in sorted(record.get("mutants", {}).items()):
        out.append(Verdict(f"vision mutant {name} caught", m["caught"],
                           f"rule {'fails' if not m['rule']['verdict']['passes'] else 'passes'}, accuracy drop "
                           + " ".join(f"{k} {d:+.2f}" for k, d in m["drop"].items())))
    return out


def _read(res: Path, name: str, parse=json.loads):
    p = Path(res) / name
    return parse(p.read_text()) if p.is_file() else None


def collect(res: Path, state: dict | None = None) -> list[Verdict]:
    """Every verdict the results folder can give now; a job that failed without a record says why."""
    out = trained(_read(res, "trained.json")) + accuracy(_read(res, "accuracy.json")) + [
        attention_kit(_read(res, "attention_kit.json")),
        kernels(_read(res, "kernels.xml", parse=str)),
        http(_read(res, "http.json")),
        tools(_read(res, "tools.json"), "trained checkpoint"),
        tools(_read(res, "tools-tiny.json"), "tiny checkpoint"),
    ] + vision(_read(res, "vision-trained.json"))
    jobs = (state or {}).get("jobs", {})
    failed = [f"{n}: {e.get('error', '')}" for n, e in jobs.items() if e.get("status") == "failed"]
    return out + [Verdict(f"job {f.split(':')[0]} failed", False, f.split(": ", 1)[1]) for f in failed]
