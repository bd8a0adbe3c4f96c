"""Train a tiny DeepSeek-V4-Flash-Vision-Exp on synthetic picture questions (`data.py`) through the oracle's own
forward (`tower.py` for the image side, `text.py` for the text side), and write it in the official Vision-Exp
format.

- Shape: the text model of `dsv4_lab.train.model`'s `tiny` preset (16 heads, served widened to 64) over the full
  vocabulary of 129,280 ids the Vision-Exp tokenizer needs; the stand-in tokenizer's ids (specials, 256 bytes) are
  the only ones used: every other embedding and LM-head row is zero and held there (no gradient reaches them),
  so the archive stores them as nothing. Vision fields: the tiny generator's (2 ViT layers of 128, release
  geometry: patch 14, 3 x 3 unshuffle, 384 tokens, min 384^2 pixels).
- Loss: next-token cross entropy on the answer and its end-of-sentence id only.
- bias_vl: fixed, drawn N(0, BIAS_VL_STD) per layer and seeded: image rows route by it from the first step (it
  takes no gradient: it only moves a top-k choice), so a path that drops it or applies it to text rows changes
  the experts the trained model counts on.
- Roundings: the text model trains under the oracle's R_q roundings (straight-through), as the text checkpoint.
- The DSPARK draft (`mtp.*`) is written untrained: norms one, every other tensor zero (stored as nothing);
  speculative decoding on images is not what this checkpoint is for.
"""

from __future__ import annotations

import json
import os
import time

import torch

from dsv4_lab.train.data import BYTE_BASE
from dsv4_lab.train.model import PRESETS, build, official_weights, qat
from dsv4_sm80.tiny.generate import TinySize, tiny_config

from . import data
from .image import Geometry, layout, llm_side, pixels
from .text import VisionText, add_bias_vl, bias_vl_weights
from .tower import Tower

VOCAB = 129280
USED_IDS = BYTE_BASE + 256  # specials and bytes; the placeholder never reaches the model (it becomes a block)
BIAS_VL_STD = 0.5
PAD_ID = 13  # the stand-in tokenizer's <｜▁pad▁｜>
NAME = "dsv4-lab-tiny-vl"


def vl_config(preset: str = "tiny"):
    s = PRESETS[preset]
    size = TinySize(hidden=s.hidden, layers=s.layers, heads=s.heads, o_groups=s.o_groups, q_lora=s.q_lora,
                    o_lora=s.o_lora, moe_inter=s.moe_inter, experts=s.experts, vocab=VOCAB, markov_rank=s.markov_rank)
    return tiny_config(size, vision=True)


def build_vl(cfg, seed: int, device: str):
    """(text model with bias_vl, image tower), fp32 on device; unused vocabulary rows zero and frozen."""
    model = build(cfg, seed)
    with torch.no_grad():
        model.model.embed_tokens.weight[USED_IDS:].zero_()
        model.lm_head.weight[USED_IDS:].zero_()
    keep = torch.zeros(VOCAB, 1)
    keep[:USED_IDS] = 1
    for w in (model.model.embed_tokens.weight, model.lm_head.weight):
        w.register_hook(lambda g, k=keep: g * k.to(g.device))
    add_bias_vl(model)
    g = torch.Generator().manual_seed(seed + 17)
    with torch.no_grad():
        for p in bias_vl_weights(model).values():
            p.copy_(torch.randn(p.shape, generator=g) * BIAS_VL_STD)
    torch.manual_seed(seed)
    tower = Tower(cfg)
    tower.reset_parameters(generator=torch.Generator().manual_seed(seed + 29))
    return model.to(device), tower.to(device)


def encode_example(ex: data.Example, tower: Tower, g: Geometry, device: str, with_answer: bool = True):
    """(ids [S] with vocab_size + type at image positions, labels [S] (-100 outside the answer), image rows
    [n, hidden] in position order, spans [(start, end)])."""
    text_ids = data.encode(data.chat_text(ex, with_answer))
    answer_from = len(data.encode(data.chat_text(ex, False))) if with_answer else None
    ids, labels, rows, spans = [], [], [], []
    images = iter(ex.images)
    for k, t in enumerate(text_ids):
        if t != data.PLACEHOLDER_ID:
            ids.append(t)
            labels.append(t if answer_from is not None and k >= answer_from else -100)
            continue
        x, plan = pixels(next(images), g)
        block = layout(llm_side(plan.n_vit_h, g.ratio), llm_side(plan.n_vit_w, g.ratio), len(ids))
        rows.append(tower.assemble(tower(x.to(device)), block))
        start = len(ids) + block.align_pad
        spans.append((start, len(ids) + len(block) - 1))
        ids += block.token_ids(VOCAB)
        labels += [-100] * len(block)
    return ids, labels, rows, spans


def collate(encoded, device: str):
    """Right-padded batch: ids, labels, image mask [B, S], rows (row-major over the mask), spans per row."""
    S = max(len(e[0]) for e in encoded)
    ids = torch.full((len(encoded), S), PAD_ID, dtype=torch.long)
    labels = torch.full((len(encoded), S), -100, dtype=torch.long)
    for b, (i, lab, _, _) in enumerate(encoded):
        ids[b, :len(i)] = torch.tensor(i)
        labels[b, :len(lab)] = torch.tensor(lab)
    mask = ids >= VOCAB
    rows = torch.cat([r for e in encoded for r in e[2]]) if mask.any() else None
    return ids.to(device), labels.to(device), mask.to(device), rows, [e[3] for e in encoded]


def forward(model, tower, examples, g: Geometry, device: str, rounding: bool = True):
    enc = [encode_example(ex, tower, g, device) for ex in examples]
    ids, labels, mask, rows, spans = collate(enc, device)
    ctx = qat(model) if rounding else torch.enable_grad()
    with ctx, VisionText(model, mask, spans, rows=rows):
        hidden = model.model(input_ids=ids).last_hidden_state
    # the LM head only where an answer id is predicted: the vocabulary is 129,280 wide, the answers a few ids
    b, t = (labels[:, 1:] != -100).nonzero(as_tuple=True)
    logits = model.lm_head(hidden[b, t])
    return torch.nn.functional.cross_entropy(logits.float(), labels[b, t + 1]), int(b.numel())


@torch.no_grad()
def rq_logits(model, ids: list[int], rows, spans) -> torch.Tensor:
    """[S, vocab] logits of one sequence (vocab_size + type at image positions) under R_q, image rows given."""
    from dsv4_lab.oracle.numerics import NUMERICS, applied

    device = next(model.parameters()).device
    t = torch.tensor([ids], device=device)
    with applied(model, NUMERICS["R_q"]), VisionText(model, t >= VOCAB, [spans],
                                                     rows=torch.cat(rows) if rows else None):
        return model(input_ids=t).logits[0]


@torch.no_grad()
def answer(model, tower, ex: data.Example, g: Geometry, device: str, max_new: int = 8) -> str:
    """Greedy answer text (until end of sentence) under the training forward (R_q roundings)."""
    ids, _, rows, spans = encode_example(ex, tower, g, device, with_answer=False)
    ids = list(ids)
    out = []
    for _ in range(max_new):
        nxt = int(rq_logits(model, ids, rows, spans)[-1].argmax())
        if nxt == 1:  # end of sentence
            break
        out.append(nxt)
        ids.append(nxt)
    return bytes(i - BYTE_BASE for i in out if BYTE_BASE <= i < USED_IDS).decode("utf-8", "replace")


def export_weights(model, tower, cfg) -> dict:
    from dsv4_sm80.checkpoint import format as fmt
    from dsv4_sm80.tiny.generate import given_shape

    weights = official_weights(model)
    for spec in fmt.inventory(cfg):  # the untrained draft: norms one, everything else zero (stored as nothing)
        if spec.name.startswith("mtp.") and spec.init != "pair":
            shape = given_shape(spec)
            weights[spec.name] = torch.ones(shape) if spec.init == "ones" else torch.zeros(shape)
    for i in range(int(cfg["num_hash_layers"])):  # the release ships the (unused) correction bias on hash layers
        weights.setdefault(f"layers.{i}.ffn.gate.bias", torch.zeros(int(cfg["n_routed_experts"])))
    weights.update({k: v.detach() for k, v in tower.state_dict().items()})
    return {k: v.detach().float().cpu() for k, v in weights.items()}



def run(out: str, steps: int = 600, batch: int = 16, device: str = "cpu", seed: int = 0, budget_s=None,
        stop_after_s=None, eval_per_kind: int = 20, preset: str = "tiny", log=print, command=None) -> dict:
    """Train, evaluate on held-out examples (greedy answers, R_q), export and pack under out; resumable from
    out/state.pt as `dsv4_lab.train`."""
    from dsv4_lab.train.train import _loop, pack, sha256
    from dsv4_sm80.tiny.generate import generate

    t0 = time.time()
    stop_at = t0 + stop_after_s if stop_after_s else None
    torch.backends.cuda.matmul.allow_tf32 = True
    cfg = vl_config(preset)
    g = Geometry.from_config(cfg)
    model, tower = build_vl(cfg, seed, device)
    state_path = os.path.join(out, "state.pt")
    state = torch.load(state_path, map_location=device, weights_only=False) if os.path.exists(state_path) else {}
    if "model" in state:
        model.load_state_dict(state["model"])
        tower.load_state_dict(state["tower"])
        log(f"resuming from {state_path}: step {state['step']}")
    model.train()

    def step_fn(step):
        rng = data.training_rng(seed, step)
        examples = [data.make(rng) for _ in range(batch)]
        loss, n = forward(model, tower, examples, g, device)
        return loss, loss.detach(), n

    def save(st):
        st["model"], st["tower"] = model.state_dict(), tower.state_dict()
        torch.save(st, state_path + ".part")
        os.replace(state_path + ".part", state_path)

    params = [p for p in model.parameters() if p.requires_grad] + list(tower.parameters())
    st = _loop("vision", params, step_fn, steps, budget_s, state, save, log, stop_at=stop_at)
    model.eval()
    held = data.held_out(eval_per_kind)
    rows = []
    for ex in held:
        got = answer(model, tower, ex, g, device)
        rows.append({"kind": ex.kind, "question": ex.question, "expected": ex.answer, "answer": got,
                     "right": data.judge(got, ex), "sizes": [im.size for im in ex.images]})
    accuracy = {k: sum(r["right"] for r in rows if r["kind"] == k) / max(1, sum(r["kind"] == k for r in rows))
                for k in data.KINDS}
    log(f"vision: held-out greedy accuracy (R_q, training forward): {json.dumps(accuracy)}")
    ckpt = os.path.join(out, NAME)
    generate(ckpt, cfg, seed=seed, head_scale=1.0, weights=export_weights(model, tower, cfg), log=log)
    archive = os.path.join(out, NAME + ".tar.xz")
    size = pack(ckpt, archive, name=NAME)
    report = {"preset": preset, "seed": seed, "batch": batch, "budget_s": budget_s, "device": device,
              "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else None,
              "torch": torch.__version__, "steps": st["step"], "examples_seen": st["step"] * batch,
              "answer_ids_seen": st["ids"], "seconds": round(st["seconds"], 1),
              "loss_first": st["losses"][0] if st["losses"] else None,
              "loss_last_50_mean": sum(st["losses"][-50:]) / max(1, len(st["losses"][-50:])),
              "losses_logged": st["logged"], "bias_vl_std": BIAS_VL_STD,
              "held_out": {"per_kind": eval_per_kind, "accuracy": accuracy, "answers": rows},
              "archive_bytes": size, "archive_sha256": sha256(archive), "command": command,
              "wall_seconds": round(time.time() - t0, 1)}
    with open(os.path.join(out, "train-vl.json"), "w") as f:
        json.dump(report, f, indent=1)
    return report
