"""Check a trained archive: the gate's checkpoint checks pass, the oracle loads it; optionally the held-out
bits per byte under the oracle (R_x, and R_q with the model's own roundings) on the windows trained_bed uses."""

from __future__ import annotations

import os
import tarfile
import tempfile

from . import data


def unpack(archive: str, into: str, served: bool = False) -> str:
    """The archive's checkpoint as into/<its folder> (replaced if present; other folders in `into` are left
    alone): the trained shape, or with served=True widened to the heads native SGLang runs (`widen.py`)."""
    import shutil

    from .widen import widen

    os.makedirs(into, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix=".unpack-", dir=into)
    try:
        with tarfile.open(archive, "r:xz") as tar:
            tar.extractall(scratch, filter="data")
        dirs = [d for d in os.listdir(scratch) if os.path.isfile(os.path.join(scratch, d, "config.json"))]
        if len(dirs) != 1:
            raise RuntimeError(f"archive layout: {archive} holds {dirs} checkpoint folders; expected one")
        dst = os.path.join(into, dirs[0])
        if served:
            return widen(os.path.join(scratch, dirs[0]), dst)
        shutil.rmtree(dst, ignore_errors=True)
        os.replace(os.path.join(scratch, dirs[0]), dst)
        return dst
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def gate_findings(ckpt: str) -> list:
    """The gate's model checks (config, files, tokenizer) on ckpt."""
    from dsv4_sm80.gate import check_model_config, check_model_files, check_tokenizer, collect_model
    from dsv4_sm80.gate.report import guarded

    m = collect_model(ckpt)
    return [*guarded("model.config", check_model_config, m), *guarded("model.files", check_model_files, m),
            *guarded("model.tokenizer", check_tokenizer, m)]


def check(archive: str, windows: int = 0, window_len: int = 3000, device: str = "cpu", log=print) -> int:
    from dsv4_lab.oracle.load import load_reference
    from dsv4_sm80.gate.report import failures

    from .score import reference_bpbs

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
        if windows:
            for numerics, bpb in reference_bpbs(model, data.held_out_prompts([window_len] * windows), device).items():
                log(f"check: held-out bits per byte under {numerics}: {bpb:.4f} ({windows} windows of {window_len} "
                    "ids)")
    return 0
