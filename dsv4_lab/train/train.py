"""Train the tiny target, then its DSPARK draft, write both in the official format and pack the archive."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import platform
import tarfile
import time

import torch

from dsv4_sm80.tiny.generate import generate

from . import data
from .draft import Draft, capture_features, init_draft
from .model import build, indexer_distillation, official_config, official_weights, qat

ARCHIVE_LIMIT = 32 * 2**20


WARMUP = 50  # steps of linear warm-up; a --budget run sets its step count once they are timed
SAVE_EVERY_S = 60.0


class Stopped(Exception):
    """The run's wall-clock limit (`stop_at`) came first; the state is saved and the same command continues."""


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


def _loop(name, params, step_fn, steps, budget_s, state, save, log, peak_lr=2e-3, weight_decay=0.1, stop_at=None):
    """AdamW over step_fn(step) -> (loss to minimise, figure to log, ids in the batch), resumable from `state`
    (a dict `save(state)` persists). With budget_s, `steps` is an upper bound and the count is fixed once the
    warm-up steps are timed, to end near budget_s seconds of stepping (counted over every resumed part)."""
    opt = torch.optim.AdamW(params, lr=peak_lr, betas=(0.9, 0.95), weight_decay=weight_decay)
    if "opt" in state:
        opt.load_state_dict(state["opt"])
    st = state
    st.setdefault("step", 0)
    st.setdefault("steps", None if budget_s else steps)
    st.setdefault("losses", [])
    st.setdefault("logged", [])
    st.setdefault("seconds", 0.0)
    st.setdefault("ids", 0)
    warmup = WARMUP if budget_s else max(1, min(WARMUP, steps // 20))
    t_mark, last_save, timed_from = time.time(), time.time(), None
    while st["steps"] is None or st["step"] < st["steps"]:
        step = st["step"]
        total = st["steps"] or steps
        for grp in opt.param_groups:
            grp["lr"] = lr_at(step, total, peak_lr, warmup)
        loss, figure, ids = step_fn(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        st["losses"].append(float(figure))
        now = time.time()
        st["seconds"] += now - t_mark
        t_mark = now
        st["ids"] += ids
        st["step"] = step + 1
        if step == 4:
            timed_from = (st["seconds"], st["step"])
        if st["steps"] is None and st["step"] >= warmup and timed_from:
            per = (st["seconds"] - timed_from[0]) / (st["step"] - timed_from[1])
            st["steps"] = min(steps, st["step"] + max(0, int((budget_s - st["seconds"]) / per)))
            log(f"{name}: {per:.3f} s per step; {st['steps']} steps fit the {budget_s:.0f} s budget")
        every = max(1, (st["steps"] or steps) // 20)
        if step % every == 0 or st["step"] == st["steps"]:
            st["logged"].append([step, round(st["losses"][-1], 4)])
            log(f"{name} step {step}/{st['steps'] or '?'} loss {st['losses'][-1]:.4f} "
                f"({st['ids'] / max(st['seconds'], 1e-9):.0f} ids/s)")
        stop = stop_at is not None and now >= stop_at
        if now - last_save > SAVE_EVERY_S or stop:
            st["opt"] = opt.state_dict()
            save(st)
            last_save = now
        if stop and st["step"] != st["steps"]:
            raise Stopped(f"{name} step {st['step']}/{st['steps']}")
    st["opt"] = opt.state_dict()
    save(st)
    return st


def text_loss(model, ids, rounding):
    """The language-model loss on a batch of text under `rounding`, plus the indexer's distillation KL;
    returns (loss to minimise, the language-model loss detached)."""
    with rounding, indexer_distillation(model) as kl:
        loss = model(input_ids=ids, labels=ids).loss
    index_kl = torch.stack(kl).mean() if kl else torch.zeros((), device=ids.device)
    return loss + index_kl, loss.detach()


def train_target(model, batches, steps, device, log=print, budget_s=None, state=None, save=lambda s: None,
                 qat_from: float = 0.0, peak_lr: float = 2e-3, stop_at=None):
    """The target's loop; the QAT roundings on from step qat_from * steps (0: throughout)."""
    state = {} if state is None else state
    if "model" in state:
        model.load_state_dict(state["model"])
    model.train()

    def step_fn(step):
        ids = batches(step).to(device)
        total = state.get("steps") or steps
        loss, text = text_loss(model, ids, qat(model) if step >= qat_from * total else contextlib.nullcontext())
        return loss, text, ids.numel()

    def keep(st):
        st["model"] = model.state_dict()
        save(st)

    state = _loop("target", list(model.parameters()), step_fn, steps, budget_s, state, keep, log, peak_lr,
                  stop_at=stop_at)
    model.eval()
    return state


def train_draft(draft, target, batches, steps, device, anchors_per_row=64, log=print, seed=0, budget_s=None,
                state=None, save=lambda s: None, peak_lr: float = 2e-3, stop_at=None):
    state = {} if state is None else state
    if "model" in state:
        draft.load_state_dict(state["model"])
    for p in target.parameters():
        p.requires_grad_(False)

    def step_fn(step):
        ids = batches(step).to(device)
        with torch.no_grad(), qat(target):
            feats = capture_features(target, ids, draft.targets)
        g = torch.Generator().manual_seed(seed * 7919 + step)
        B, S = ids.shape
        rows = torch.arange(B).repeat_interleave(anchors_per_row)
        pref = torch.randint(1, S - draft.gamma, (B * anchors_per_row,), generator=g)
        anchors = torch.stack([rows, pref], dim=1).to(device)
        with qat(target, layers=draft.stages, fp8_inputs=[draft.main_proj]):
            loss, ce, _acc = draft.loss(target, ids, feats, anchors)
        return loss, ce.detach(), ids.numel()

    def keep(st):
        st["model"] = draft.state_dict()
        save(st)

    return _loop("draft", list(draft.parameters()), step_fn, steps, budget_s, state, keep, log, peak_lr,
                 stop_at=stop_at)


LOOP_RUN = 24  # a run of one id longer than this is marked in unlikelihood training (the check allows 32)


def loop_positions(ids: list[int], n: int, run_from: int = LOOP_RUN) -> list[int]:
    """The positions where a continuation extends a loop: the n-id string ending there (`record.loop_strings`)
    occurred earlier in it, or the run of one id there is longer than run_from."""
    from .record import loop_strings

    hits, seen = set(), set()
    for k, key in loop_strings(ids, n):
        if key in seen:
            hits.add(k)
        seen.add(key)
    run = 0
    for k, x in enumerate(ids):
        run = run + 1 if k and x == ids[k - 1] else 1
        if run > run_from:
            hits.add(k)
    return sorted(hits)


def train_unlikelihood(model, batches, prompts, steps, device, new=128, pool_every=8, alpha=1.0, log=print,
                       budget_s=None, state=None, save=lambda s: None, peak_lr=1e-3, stop_at=None,
                       repeat_len=None):
    """Sequence-level unlikelihood training (Welleck et al., "Neural Text Generation with Unlikelihood
    Training", 2020): each step is the usual loss on a batch of text plus alpha x -log(1 - p) of every id of
    the model's own greedy continuations that extends a loop (`loop_positions`), normalised by the
    continuations' length. The continuations (of `prompts(step)`, windows of training text, under the
    roundings) are made again every `pool_every` steps; repeat_len: the loop strings' length (default the
    degeneracy check's)."""
    from .record import REPEAT_LEN
    from .score import greedy

    state = {} if state is None else state
    if "model" in state:
        model.load_state_dict(state["model"])
    pool: dict = {}

    def make_pool(step):
        heads = prompts(step)
        model.eval()
        with torch.no_grad(), qat(model):
            conts = greedy(model, heads.tolist(), new, device)
        model.train()
        mask = torch.zeros(len(conts), new)
        for r, c in enumerate(conts):
            mask[r, loop_positions(c, repeat_len or REPEAT_LEN)] = 1.0
        pool.update(seqs=torch.cat([heads, torch.tensor(conts)], dim=1).to(device), mask=mask.to(device),
                    plen=heads.shape[1])
        log(f"unlikelihood step {step}: {int(mask.sum())} of {mask.numel()} continuation ids extend a loop, "
            f"{int((mask.sum(1) > 0).sum())} of {len(conts)} continuations")

    def step_fn(step):
        if step % pool_every == 0 or not pool:
            make_pool(step)
        ids = batches(step).to(device)
        loss, text = text_loss(model, ids, qat(model))
        seqs, mask, plen = pool["seqs"], pool["mask"], pool["plen"]
        with qat(model):
            logits = model(input_ids=seqs).logits[:, plen - 1:-1].float()
        p = torch.softmax(logits, -1).gather(-1, seqs[:, plen:, None])[..., 0]
        ul = -(torch.log1p(-p.clamp(max=1 - 1e-6)) * mask).sum() / mask.numel()
        return loss + alpha * ul, text, ids.numel() + seqs.numel()

    def keep(st):
        st["model"] = model.state_dict()
        save(st)

    model.train()
    for p in model.parameters():
        p.requires_grad_(True)
    state = _loop("unlikelihood", list(model.parameters()), step_fn, steps, budget_s, state, keep, log, peak_lr,
                  stop_at=stop_at)
    model.eval()
    return state


def write_checkpoint(out_dir, cfg, target, draft, seed, log=print) -> dict:
    """The official-format checkpoint (project writer, stand-in tokenizer) of the trained weights."""
    weights = official_weights(target)
    weights.update(draft.official_weights(target))
    return generate(out_dir, cfg, seed=seed, head_scale=1.0, weights={k: v.cpu() for k, v in weights.items()},
                    log=log)


def pack(ckpt_dir: str, archive: str, name: str = "dsv4-lab-tiny") -> int:
    with tarfile.open(archive, "w:xz", preset=9) as tar:
        for leaf in sorted(os.listdir(ckpt_dir)):
            tar.add(os.path.join(ckpt_dir, leaf), arcname=os.path.join(name, leaf))
    size = os.path.getsize(archive)
    if size > ARCHIVE_LIMIT:
        raise RuntimeError(f"archive size: {archive} is {size / 2**20:.1f} MiB, expected <= 32 MiB; use a smaller "
                           "preset")
    return size


def sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def run(out, preset="tiny", steps=2000, draft_steps=None, seq=4096, device="cpu", seed=0, short=512,
        short_batch=16, long_every=4, long_batch=1, corpus=None, budget_s=None, draft_budget_s=None,
        qat_from=0.0, log=print, command=None, stop_after_s=None, init=None, ul_steps=0, ul_budget_s=None,
        ul_prompts=64, ul_prompt_len=256) -> dict:
    """Train, export and pack under out. Resumable: the state of the phase in flight is kept in out/state.pt
    (every minute, at each phase's end, and when stop_after_s seconds of this call have passed: then it raises
    Stopped); the same command run again continues from it. init: an official-format checkpoint of this
    preset whose target and draft weights start the run (its target phase is skipped). ul_steps / ul_budget_s:
    an unlikelihood phase (`train_unlikelihood`) after the target's, on ul_prompts greedy continuations of
    training windows of ul_prompt_len ids."""
    t0 = time.time()
    stop_at = t0 + stop_after_s if stop_after_s else None
    torch.manual_seed(seed)
    cfg = official_config(preset)
    if corpus:
        stream, facts = data.load_corpus(corpus)
        n_train, n_held, python = facts["files"], None, facts["python"]
    else:
        train_files, held = data.split()
        stream = data.token_stream(train_files)
        n_train, n_held, python = len(train_files), len(held), platform.python_version()
    short = min(short, seq)
    batches = data.Batches(stream, seed, short, short_batch, seq, long_every if seq > short else 0, long_batch)
    state_path = os.path.join(out, "state.pt")
    state = torch.load(state_path, map_location=device, weights_only=False) if os.path.exists(state_path) else {}
    if state:
        log(f"resuming from {state_path}: " + ", ".join(f"{k} step {v['step']}" for k, v in state.items()
                                                          if isinstance(v, dict) and "step" in v))

    def save(phase):
        def put(st):
            state[phase] = st
            torch.save(state, state_path + ".part")
            os.replace(state_path + ".part", state_path)
        return put

    target = build(cfg, seed)
    draft = Draft(cfg)
    init_draft(draft, seed)
    if init:
        from dsv4_lab.oracle.load import load_reference

        from .draft import load_draft

        target.load_state_dict(load_reference(init).state_dict())
        draft.load_state_dict(load_draft(init).state_dict())
    # training needs no exact fp32 products (set after --init's oracle load, which turns TF32 off, as loading
    # the result does again)
    torch.backends.cuda.matmul.allow_tf32 = True
    target.to(device)
    draft.to(device)
    tstate = None if init else train_target(target, batches, steps, device, log=log, budget_s=budget_s,
                                            state=state.get("target"), save=save("target"), qat_from=qat_from,
                                            stop_at=stop_at)
    ustate = None
    if ul_steps or ul_budget_s:
        prompts = data.Batches(stream, seed + 2, ul_prompt_len, ul_prompts, ul_prompt_len, 0)
        ustate = train_unlikelihood(target, batches, prompts, ul_steps or 100000, device, log=log,
                                    budget_s=ul_budget_s, state=state.get("unlikelihood"),
                                    save=save("unlikelihood"), stop_at=stop_at)
    dbatches = data.Batches(stream, seed + 1, short, short_batch, short, 0)
    dsteps = draft_steps if draft_steps is not None else max(1, steps // 4)
    dstate = train_draft(draft, target, dbatches, dsteps, device, log=log, seed=seed, budget_s=draft_budget_s,
                         state=state.get("draft"), save=save("draft"), stop_at=stop_at)
    ckpt = os.path.join(out, "dsv4-lab-tiny")
    summary = write_checkpoint(ckpt, cfg, target.cpu(), draft.cpu(), seed, log=log)
    archive = os.path.join(out, "dsv4-lab-tiny.tar.xz")
    size = pack(ckpt, archive)

    def phase(st):
        if st is None:
            return None
        return {"steps": st["step"], "ids_seen": st["ids"], "seconds": round(st["seconds"], 1),
                "ids_per_s": round(st["ids"] / max(st["seconds"], 1e-9), 1),
                "loss_first": st["losses"][0] if st["losses"] else None,
                "loss_last": st["losses"][-1] if st["losses"] else None,
                "loss_last_50_mean": sum(st["losses"][-50:]) / max(1, len(st["losses"][-50:])),
                "losses_logged": st["logged"]}

    report = {"preset": preset, "seed": seed, "seq": seq, "short": short, "batch": short_batch,
              "long_every": long_every, "long_batch": long_batch, "budget_s": budget_s,
              "draft_budget_s": draft_budget_s, "qat_from": qat_from, "device": device,
              "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else None,
              "gpu_peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if device.startswith("cuda")
              else None,
              "python": python, "torch": torch.__version__, "threads": torch.get_num_threads(),
              "train_files": n_train, "held_out_files": n_held, "train_ids": int(stream.numel()),
              "init": init, "target": phase(tstate), "unlikelihood": phase(ustate), "draft": phase(dstate),
              "checkpoint": ckpt, "archive_bytes": size, "archive_sha256": sha256(archive),
              "tensors": summary["tensors"], "command": command,
              "seconds": round(time.time() - t0, 1)}
    with open(os.path.join(out, "train.json"), "w") as f:
        json.dump(report, f, indent=2)
    phases = ("target", "unlikelihood", "draft")
    log(f"dsv4-lab train: {json.dumps({k: v for k, v in report.items() if k not in phases})}")
    return report
