"""Train the tiny target, then its DSPARK draft, write both in the official format and pack the archive."""

from __future__ import annotations

import hashlib
import json
import math
import os
import tarfile
import time

import torch

from dsv4_sm80.tiny.generate import generate

from . import data
from .draft import Draft, capture_features, init_draft
from .model import build, indexer_distillation, official_config, official_weights, qat

ARCHIVE_LIMIT = 32 * 2**20


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


def train_target(model, batches, steps, device, peak_lr=2e-3, log=print) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=peak_lr, betas=(0.9, 0.95), weight_decay=0.01)
    losses = []
    model.train()
    for step in range(steps):
        for grp in opt.param_groups:
            grp["lr"] = lr_at(step, steps, peak_lr, max(1, steps // 20))
        ids = batches(step).to(device)
        with qat(model), indexer_distillation(model) as kl:
            loss = model(input_ids=ids, labels=ids).loss
        index_kl = torch.stack(kl).mean() if kl else torch.zeros(())
        opt.zero_grad(set_to_none=True)
        (loss + index_kl).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        if step % max(1, steps // 20) == 0 or step == steps - 1:
            log(f"target step {step}/{steps} len {ids.shape[1]} x{ids.shape[0]} loss {losses[-1]:.4f} "
                f"({losses[-1] / math.log(2):.3f} bits/id) indexer KL {float(index_kl.detach()):.4f}")
    model.eval()
    return losses


def train_draft(draft, target, batches, steps, device, anchors_per_row=64, peak_lr=2e-3, log=print, seed=0):
    for p in target.parameters():
        p.requires_grad_(False)
    opt = torch.optim.AdamW(draft.parameters(), lr=peak_lr, betas=(0.9, 0.95), weight_decay=0.01)
    out = []
    for step in range(steps):
        for grp in opt.param_groups:
            grp["lr"] = lr_at(step, steps, peak_lr, max(1, steps // 20))
        ids = batches(step).to(device)
        with torch.no_grad(), qat(target):
            feats = capture_features(target, ids, draft.targets)
        g = torch.Generator().manual_seed(seed * 7919 + step)
        B, S = ids.shape
        rows = torch.arange(B).repeat_interleave(anchors_per_row)
        pref = torch.randint(1, S - draft.gamma, (B * anchors_per_row,), generator=g)
        anchors = torch.stack([rows, pref], dim=1).to(device)
        with qat(target, layers=draft.stages, fp8_inputs=[draft.main_proj]):
            loss, ce, acc = draft.loss(target, ids, feats, anchors)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        out.append(float(ce.detach()))
        if step % max(1, steps // 20) == 0 or step == steps - 1:
            log(f"draft step {step}/{steps} ce {out[-1]:.4f} top-1 {float(acc.detach()):.3f}")
    return out


def write_checkpoint(out_dir, cfg, target, draft, seed, log=print) -> dict:
    """The official-format checkpoint (project writer, stand-in tokenizer) of the trained weights."""
    weights = official_weights(target)
    weights.update(draft.official_weights(target))
    return generate(out_dir, cfg, seed=seed, head_scale=1.0, weights={k: v.cpu() for k, v in weights.items()},
                    log=log)


def pack(ckpt_dir: str, archive: str) -> int:
    with tarfile.open(archive, "w:xz", preset=9) as tar:
        for name in sorted(os.listdir(ckpt_dir)):
            tar.add(os.path.join(ckpt_dir, name), arcname=os.path.join("dsv4-lab-tiny", name))
    size = os.path.getsize(archive)
    if size > ARCHIVE_LIMIT:
        raise RuntimeError(f"archive size: {archive} is {size / 2**20:.1f} MiB, expected <= 32 MiB; use a smaller "
                           "preset")
    return size


def sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def run(out, preset="tiny", steps=2000, draft_steps=None, seq=4096, device="cpu", seed=0, short=512,
        short_batch=16, long_every=4, log=print, command=None) -> dict:
    t0 = time.time()
    torch.manual_seed(seed)
    # training needs no exact fp32 products (the oracle, loading the result, turns TF32 back off)
    torch.backends.cuda.matmul.allow_tf32 = True
    cfg = official_config(preset)
    train_files, held = data.split()
    stream = data.token_stream(train_files)
    short = min(short, seq)
    batches = data.Batches(stream, seed, short, short_batch, seq, long_every if seq > short else 0)
    target = build(cfg, seed).to(device)
    losses = train_target(target, batches, steps, device, log=log)
    draft = Draft(cfg)
    init_draft(draft, seed)
    draft.to(device)
    dbatches = data.Batches(stream, seed + 1, short, short_batch, short, 0)
    dlosses = train_draft(draft, target, dbatches, draft_steps if draft_steps is not None else max(1, steps // 4),
                          device, log=log, seed=seed)
    ckpt = os.path.join(out, "dsv4-lab-tiny")
    summary = write_checkpoint(ckpt, cfg, target.cpu(), draft.cpu(), seed, log=log)
    archive = os.path.join(out, "dsv4-lab-tiny.tar.xz")
    size = pack(ckpt, archive)
    import platform

    report = {"preset": preset, "seed": seed, "steps": steps, "draft_steps": len(dlosses), "seq": seq,
              "short": short, "batch": short_batch, "long_every": long_every, "device": device,
              "python": platform.python_version(), "torch": torch.__version__,
              "threads": torch.get_num_threads(),
              "train_files": len(train_files), "held_out_files": len(held), "train_ids": int(stream.numel()),
              "target_loss_first": losses[0] if losses else None, "target_loss_last": losses[-1] if losses else None,
              "draft_ce_first": dlosses[0] if dlosses else None, "draft_ce_last": dlosses[-1] if dlosses else None,
              "checkpoint": ckpt, "archive_bytes": size, "archive_sha256": sha256(archive),
              "tensors": summary["tensors"], "command": command,
              "seconds": round(time.time() - t0, 1)}
    with open(os.path.join(out, "train.json"), "w") as f:
        json.dump(report, f, indent=2)
    log(f"dsv4-lab train: {json.dumps(report)}")
    return report
