"""What the trained checkpoint's record says of it, measured under the oracle.

- `windows`: per held-out window (trained_bed's: 8 of 3,000 ids), bits per byte under R_q and R_x, and what
  gzip -9 and xz -9e make of the same window's bytes compressed alone (8 x compressed bytes / bytes).
- `foreign`: the same figures on Python it never saw (`data.foreign_windows`: a window of 3,000 ids from the
  middle of each of 8 transformers source files).
- `greedy`: 16 held-out prompts of 400 ids continued greedily for 128 under R_q, each as text, with the
  degeneracy check's findings (`degeneracy`).
- `acceptance`: the draft's reference-side acceptance estimate (`score.draft_acceptance`) on the greedy
  continuations that pass the check and on continuations sampled at T = 0.7.
"""

from __future__ import annotations

import gzip
import lzma

import torch

from . import data

GREEDY_PROMPTS, GREEDY_PROMPT_LEN, GREEDY_NEW = 16, 400, 128
MAX_RUN, MIN_DISTINCT, REPEAT_LEN, MAX_REPEATS = 32, 12, 16, 3


def window_bytes(ids: list[int]) -> bytes:
    return bytes(i - data.BYTE_BASE for i in ids if i >= data.BYTE_BASE)


def compressed_bpb(ids: list[int]) -> dict:
    raw = window_bytes(ids)
    return {"gzip_9": 8 * len(gzip.compress(raw, 9, mtime=0)) / len(raw),
            "xz_9e": 8 * len(lzma.compress(raw, preset=9 | lzma.PRESET_EXTREME)) / len(raw)}


def loop_strings(ids: list[int], n: int = REPEAT_LEN):
    """(end position, string) of every n-id string of `ids` made of more than one id. A string of one repeated id
    is a run, judged by its length instead: counted here, one 20-space indent would be five 16-space strings."""
    for k in range(n - 1, len(ids)):
        key = tuple(ids[k - n + 1:k + 1])
        if len(set(key)) > 1:
            yield k, key


def degeneracy(ids: list[int]) -> list[str]:
    """Why a continuation is degenerate ([] when it is not): a run of one id longer than MAX_RUN, fewer than
    MIN_DISTINCT distinct ids, or a REPEAT_LEN-id string of more than one id occurring more than MAX_REPEATS times."""
    out = []
    run = best = 0
    for k, x in enumerate(ids):
        run = run + 1 if k and x == ids[k - 1] else 1
        best = max(best, run)
    if best > MAX_RUN:
        out.append(f"a run of {best} equal ids (at most {MAX_RUN})")
    if len(set(ids)) < MIN_DISTINCT:
        out.append(f"{len(set(ids))} distinct ids (at least {MIN_DISTINCT})")
    counts: dict[tuple, int] = {}
    for _, key in loop_strings(ids):
        counts[key] = counts.get(key, 0) + 1
    worst = max(counts.values(), default=0)
    if worst > MAX_REPEATS:
        out.append(f"a {REPEAT_LEN}-id string {worst} times (at most {MAX_REPEATS})")
    return out


def as_text(ids: list[int]) -> str:
    return window_bytes(ids).decode("utf-8", errors="replace")


@torch.no_grad()
def sample(model, prompts: list[list[int]], new: int, temperature: float, seed: int, device: str) -> list[list[int]]:
    """Continuations sampled at `temperature` by full forwards (prompts of one length as one batch), seeded."""
    g = torch.Generator(device=device).manual_seed(seed)
    ids = torch.tensor(prompts, device=device)
    for _ in range(new):
        p = torch.softmax(model(input_ids=ids).logits[:, -1].double() / temperature, dim=-1)
        ids = torch.cat([ids, torch.multinomial(p.float(), 1, generator=g)], dim=1)
    return [row[len(prompts[0]):] for row in ids.tolist()]


def windows_part(model, windows: list[list[int]], device: str) -> list[dict]:
    from dsv4_lab.oracle.numerics import NUMERICS, applied

    from .score import reference_bpb

    out = []
    for w in windows:
        row = {"start_ids": w[:8], "ids": len(w)}
        for numerics in ("R_q", "R_x"):
            with applied(model, NUMERICS[numerics]):
                row[numerics] = reference_bpb(model, [w], device)
        row.update(compressed_bpb(w))
        out.append(row)
    return out


def log_figures(label: str, rows: list[dict], log) -> None:
    for k in ("R_q", "R_x", "gzip_9", "xz_9e"):
        log(f"record: {label} bits per byte {k}: " + " ".join(f"{r[k]:.4f}" for r in rows))


def greedy_part(model, prompts: list[list[int]], device: str) -> list[dict]:
    from dsv4_lab.oracle.numerics import NUMERICS, applied

    from .score import greedy

    with applied(model, NUMERICS["R_q"]):
        conts = greedy(model, prompts, GREEDY_NEW, device)
    return [{"prompt_tail": as_text(p[-80:]), "ids": c, "text": as_text(c), "degenerate": degeneracy(c)}
            for p, c in zip(prompts, conts)]


def acceptance_part(model, draft, prompts: list[list[int]], greedy_rows: list[dict], new: int, device: str,
                    seed: int = 0) -> dict:
    from dsv4_lab.oracle.numerics import NUMERICS, applied

    from .score import draft_acceptance

    kept = [(p, r["ids"]) for p, r in zip(prompts, greedy_rows) if not r["degenerate"]]
    out = {"greedy_passing": {"prompts": len(kept), "of": len(prompts)}}
    if kept:
        out["greedy_passing"].update(draft_acceptance(model, draft, [p for p, _ in kept], new, device,
                                                      conts=[c for _, c in kept]))
    with applied(model, NUMERICS["R_q"]):
        sampled = sample(model, prompts, new + draft.gamma, 0.7, seed, device)
    out["sampled_t0.7"] = {"prompts": len(prompts),
                           **draft_acceptance(model, draft, prompts, new, device, conts=sampled)}
    return out


def measure(ckpt: str, device: str, parts: tuple[str, ...], corpus: str | None = None, windows: int = 8,
            window_len: int = 3000, log=print) -> dict:
    from dsv4_lab.oracle.load import load_reference

    model = load_reference(ckpt, device)
    out: dict = {}
    if "windows" in parts:
        rows = windows_part(model, data.held_out_prompts([window_len] * windows, corpus=corpus), device)
        out["windows"] = rows
        log_figures("held-out", rows, log)
    if "foreign" in parts:
        named = data.foreign_windows(window_len)
        rows = windows_part(model, [w for _, w in named], device)
        for (name, _), row in zip(named, rows):
            row["file"] = name
        out["foreign"] = rows
        log_figures("foreign", rows, log)
    if "greedy" in parts or "acceptance" in parts:
        prompts = data.held_out_prompts([GREEDY_PROMPT_LEN] * GREEDY_PROMPTS, corpus=corpus)
        rows = greedy_part(model, prompts, device)
        out["greedy"] = rows
        log(f"record: {sum(not r['degenerate'] for r in rows)} of {len(rows)} greedy continuations pass the "
            "degeneracy check")
        if "acceptance" in parts:
            from .draft import load_draft

            draft = load_draft(ckpt).to(device)
            out["acceptance"] = acceptance_part(model, draft, prompts, rows, 64, device)
            log(f"record: draft acceptance {out['acceptance']}")
    return out
