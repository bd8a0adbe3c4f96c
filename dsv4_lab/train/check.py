"""Check a trained archive: the gate's checkpoint checks pass, the oracle loads it; optionally the held-out
bits per byte under the oracle (R_x, or R_q with the model's own roundings)."""

from __future__ import annotations

import os
import tarfile
import tempfile

import torch

from . import data


def unpack(archive: str, into: str) -> str:
    with tarfile.open(archive, "r:xz") as tar:
        tar.extractall(into, filter="data")
    dirs = [d for d in os.listdir(into) if os.path.isfile(os.path.join(into, d, "config.json"))]
    if len(dirs) != 1:
        raise RuntimeError(f"archive layout: {archive} holds {dirs} checkpoint folders; expected one")
    return os.path.join(into, dirs[0])


def gate_findings(ckpt: str) -> list:
    """The gate's model checks (config, files, tokenizer) on ckpt."""
    from dsv4_sm80.gate import check_model_config, check_model_files, check_tokenizer, collect_model
    from dsv4_sm80.gate.report import guarded

    m = collect_model(ckpt)
    return [*guarded("model.config", check_model_config, m), *guarded("model.files", check_model_files, m),
            *guarded("model.tokenizer", check_tokenizer, m)]


def held_out_bpb(model, max_files: int, max_len: int, numerics: str = "R_q", device: str = "cpu") -> dict:
    """Bits per byte of the first max_files held-out files, each scored in windows of max_len ids."""
    from dsv4_lab.oracle.numerics import NUMERICS, applied

    _, held = data.split()
    nll, n = 0.0, 0
    with torch.no_grad(), applied(model, NUMERICS[numerics]):
        for rel in held[:max_files]:
            ids = data.token_stream([rel])
            for s in range(0, ids.numel() - 1, max_len):
                w = ids[s:s + max_len + 1].to(device)
                a, b = data.sequence_nll(model(input_ids=w[None]).logits[0].float().cpu(), w.cpu())
                nll, n = nll + a, n + b
    return {"files": min(max_files, len(held)), "bytes": n, "bits_per_byte": data.bits_per_byte(nll, n),
            "numerics": numerics}


def check(archive: str, bpb_files: int = 0, max_len: int = 4096, device: str = "cpu", log=print) -> int:
    from dsv4_lab.oracle.load import load_reference
    from dsv4_sm80.gate.report import failures

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = unpack(archive, tmp)
        findings = gate_findings(ckpt)
        bad = failures(findings)
        for f in findings:
            log(f"gate {f.status}: {f.check}: {f.found}")
        if bad:
            log(f"check: {len(bad)} gate checks failed on {archive}")
            return 1
        model = load_reference(ckpt, device)
        log(f"check: the oracle loaded {archive} ({sum(p.numel() for p in model.parameters())} parameters)")
        for numerics in ("R_q", "R_x") if bpb_files else ():
            log(f"check: held-out {held_out_bpb(model, bpb_files, max_len, numerics, device)}")
    return 0
