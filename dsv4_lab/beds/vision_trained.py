"""The trained tiny Vision-Exp served through the backport: held-out synthetic picture questions
(`dsv4_lab.vision.data.held_out`) over the OpenAI chat API, images as data URLs, greedy; each answer judged, per
question kind; and each expected answer teacher-forced through /generate (top-20 log-probs at the answer's
positions) for the accuracy rule against the oracle (`python -m dsv4_lab.vision score`). With --mutants, the
listed run-time vision mutants are switched on one after another in the same server and the questions asked again.

    python -m dsv4_lab.vision unpack DIR                       # the served (64-head) checkpoint in DIR
    DSV4_SM80_LAB_GPU_COUNT=1 DSV4_SM80_LAB_CC=9.0 ENABLE_SGLANG_DSV4_A100_PATCH=1 \\
        python -m dsv4_lab.beds.vision_trained --ckpt DIR/dsv4-lab-tiny-vl --out vision-sm80.json \\
        --per-kind 20 --mutants image_patches_transposed
    python -m dsv4_lab.beds.vision_trained --ckpt DIR/dsv4-lab-tiny-vl --native --out vision-native.json

--native: SGLang's own launch_server with the patch off and the vision overlay alone. --chunked-prefill-size N:
the same questions with image blocks cut across prefill chunks (recorded under `chunked`).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

from dsv4_lab.beds.http_check import call, teacher_record
from dsv4_lab.beds.lab_server import lab_server
from dsv4_lab.vision import data

KEY = "lab-key-1"
TOP = 20


def teacher_entry(meta: dict, n_answer: int) -> dict:
    """The record's entry for one teacher-forced request (`http_check.teacher_record`'s shape): the last n_answer
    input positions (the answer and its end of sentence) after one position of context, which stays empty."""
    full = teacher_record([meta])["teacher"][0]
    keep = slice(len(full["sequence"]) - n_answer - 1, None)
    entry = {k: v[keep] for k, v in full.items()}
    entry["input_logprobs"][0], entry["top"][0] = None, []
    return entry


def ask(port: int, examples) -> tuple[list, list]:
    """(answers, teacher entries) for the examples."""
    answers, teacher = [], []
    for ex in examples:
        urls = [data.data_url(im) for im in ex.images]
        status, text = call(port, "/v1/chat/completions", {
            "model": "default", "messages": ex.messages(urls), "temperature": 0, "max_tokens": 8}, key=KEY)
        got = json.loads(text)["choices"][0]["message"]["content"] if status == 200 else None
        answers.append({"kind": ex.kind, "expected": ex.answer, "answer": got, "status": status,
                        "right": status == 200 and data.judge(got or "", ex)})
        n_answer = len(data.encode(ex.answer)) + 1
        status, text = call(port, "/generate", {
            "text": data.chat_text(ex, with_answer=True), "image_data": urls, "return_logprob": True,
            "logprob_start_len": 0, "top_logprobs_num": TOP,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0}}, key=KEY)
        if status != 200:
            raise RuntimeError(f"teacher-forced request ({ex.kind}): HTTP {status}: {text[:200]}")
        teacher.append(teacher_entry(json.loads(text)["meta_info"], n_answer))
    return answers, teacher


def accuracy(answers: list) -> dict:
    return {k: sum(a["right"] for a in answers if a["kind"] == k) / max(1, sum(a["kind"] == k for a in answers))
            for k in data.KINDS}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", required=True, help="the served (64-head) trained Vision-Exp checkpoint")
    ap.add_argument("--out", required=True)
    ap.add_argument("--per-kind", type=int, default=20)
    ap.add_argument("--native", action="store_true")
    ap.add_argument("--mutants", default="", help="comma-separated run-time vision mutants (dsv4_lab/mutants.py)")
    ap.add_argument("--chunked-prefill-size", type=int, default=0)
    ap.add_argument("--port", type=int, default=30241)
    ap.add_argument("--startup-timeout", type=int, default=500)
    args = ap.parse_args(argv)

    examples = data.held_out(args.per_kind)
    switch = os.path.join(tempfile.mkdtemp(prefix="dsv4-vision-mutant-"), "mutant")
    open(switch, "w").close()
    # every pass computes its images and prompts afresh: SGLang would otherwise reuse the clean pass's image
    # embeddings (its multimodal cache, keyed by the image) and KV (the radix cache) under a mutant
    env = {"DSV4_SM80_VISION": "1", "SGLANG_VLM_CACHE_SIZE_MB": "0"}
    if args.mutants:
        env.update(DSV4_SM80_LAB_MUTANT="runtime", DSV4_SM80_LAB_MUTANT_FILE=switch)
    serve = ["--model-path", args.ckpt, "--api-key", KEY, "--context-length", "4096", "--moe-runner-backend",
             "marlin", "--mem-fraction-static", "0.85", "--max-total-tokens", "65536", "--disable-cuda-graph",
             "--disable-radix-cache"]
    if args.chunked_prefill_size:
        serve += ["--chunked-prefill-size", str(args.chunked_prefill_size)]
    record = {"path": "native" if args.native else "sm80", "per_kind": args.per_kind,
              "chunked_prefill_size": args.chunked_prefill_size or None}
    log = os.path.splitext(os.path.abspath(args.out))[0] + ".server.log"
    with lab_server(args.port, serve, log, env, args.startup_timeout, native=args.native) as (_, startup):
        record["startup_s"] = round(startup, 1)
        answers, teacher = ask(args.port, examples)
        record.update(accuracy=accuracy(answers), answers=answers, teacher=teacher)
        print(f"vision_trained {record['path']}: accuracy {json.dumps(record['accuracy'])}", flush=True)
        record["mutants"] = {}
        for name in filter(None, args.mutants.split(",")):
            with open(switch + ".tmp", "w") as f:
                f.write(name)
            os.replace(switch + ".tmp", switch)  # a new inode: the servers' processes see the switch at once
            answers, teacher = ask(args.port, examples)
            record["mutants"][name] = {"accuracy": accuracy(answers), "answers": answers, "teacher": teacher}
            print(f"vision_trained mutant {name}: accuracy {json.dumps(accuracy(answers))}", flush=True)
        open(switch + ".tmp", "w").close()
        os.replace(switch + ".tmp", switch)
    with open(args.out, "w") as f:
        json.dump(record, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
