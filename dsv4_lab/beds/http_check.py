"""The patched server over HTTP on the tiny checkpoint (lab mode): the OpenAI-compatible and native
endpoints work, the API key is enforced, bad requests get a clear 4xx and the server keeps serving.

    DSV4_SM80_LAB_GPU_COUNT=1 DSV4_SM80_LAB_CC=9.0 python -m dsv4_lab.beds.http_check --out http.json

Starts `python -m dsv4_sm80 serve` (the one-command lab start: the embedded tiny model with its stand-in
tokenizer) on 127.0.0.1 with --api-key and a small --context-length, then sends each request below and
records the status and the first line of the body. Loopback only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request

from dsv4_lab.beds.lab_server import ROOT, lab_server

KEY = "lab-key-1"


def call(port, path, body=None, key=KEY, raw=None, method=None):
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                 method=method or ("POST" if data else "GET"))
    req.add_header("Content-Type", "application/json")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--port", type=int, default=30123)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--startup-timeout", type=int, default=400)
    ap.add_argument("--vision", action="store_true",
                    help="the tiny --vision checkpoint with DSV4_SM80_VISION=1: image requests instead")
    ap.add_argument("--native", action="store_true",
                    help="SGLang's own launch_server, patch off (with --vision: the vision overlay alone), for A/B")
    ap.add_argument("--compare", help="an earlier record (the other path): greedy tokens and logprobs side by side")
    ap.add_argument("--no-refused-starts", action="store_true",
                    help="skip the launches that must be refused (EP, NextN, another MoE runner) after the checks")
    ap.add_argument("--chunked-prefill-size", type=int, default=0,
                    help="serve with this --chunked-prefill-size (with --vision: image blocks cut across chunks)")
    args = ap.parse_args(argv)

    # beside other engines on one GPU: SGLang sizes a pool against the whole GPU less what is in use, so a capped
    # pool under a high fraction leaves the others room (a bare 0.6 takes all it can)
    serve_args = ["--api-key", KEY, "--context-length", str(args.context), "--moe-runner-backend", "marlin",
                  "--mem-fraction-static", "0.85", "--max-total-tokens", "65536", "--disable-cuda-graph"]
    extra_env = {}
    if args.chunked_prefill_size:
        serve_args += ["--chunked-prefill-size", str(args.chunked_prefill_size)]
    trace = os.path.splitext(os.path.abspath(args.out))[0] + "-route.jsonl"
    if args.vision:
        ckpt = "/tmp/dsv4-tiny-vl"
        from dsv4_sm80.tiny.generate import ensure

        ensure(ckpt, vision=True, head_scale=12.0)
        serve_args += ["--model-path", ckpt]
        extra_env["DSV4_SM80_VISION"] = "1"
        extra_env["DSV4_SM80_LAB_ROUTE_TRACE"] = trace  # every MoE top-k call with image rows, one JSON line
        if os.path.exists(trace):
            os.remove(trace)
    results, ok = [], True
    log_path = os.path.splitext(os.path.abspath(args.out))[0] + ".server.log"  # one per run: vision-ab runs three
    if args.native and not args.vision:
        ap.error("--native is for the vision A/B (with --vision): text A/B is engine_bed's")
    with lab_server(args.port, serve_args, log_path, extra_env, args.startup_timeout,
                    native=args.native) as (server, startup):
        long_ids = list(range(1000, 1000 + args.context + 100))
        if args.vision:
            checks = vision_checks(args.port)
        else:
            checks = text_checks(args.context, long_ids)
        for name, path, body, key, want in checks:
            raw = body if isinstance(body, bytes) else None
            status, text = call(args.port, path, None if raw else body, key=key, raw=raw)
            good = (status == want) if want else (400 <= status < 500)
            ok &= good
            first = text.strip().splitlines()[0][:200] if text.strip() else ""
            results.append({"check": name, "status": status, "expected": want or "4xx", "ok": good, "body": first})
            if status == 200 and path == "/generate":  # greedy output, for A/B against the other path
                out = json.loads(text)
                logprobs = [x[0] for x in out["meta_info"].get("output_token_logprobs") or []]
                results[-1]["output"] = {"ids": out.get("output_ids"), "logprobs": logprobs}
        if args.vision:  # the image reaches the model: a different image, different logprobs
            lps = []
            for color in ((220, 20, 20), (20, 20, 220)):
                status, text = call(args.port, "/generate", image_request([png(640, 480, color)]))
                lps.append(json.loads(text)["meta_info"]["output_token_logprobs"] if status == 200 else None)
            differ = lps[0] is not None and lps[1] is not None and [x[0] for x in lps[0]] != [x[0] for x in lps[1]]
            ok &= differ
            results.append({"check": "a different image changes the logprobs", "status": 200, "expected": 200,
                            "ok": differ, "body": ""})
            stem = os.path.splitext(os.path.abspath(args.out))[0]
            with open(stem + "-teacher.json", "w") as f:
                json.dump(teacher_forced(args.port), f)
            if args.native:  # the oracle's own floor: the same sequences, batched differently
                with open(stem + "-teacher-floor.json", "w") as f:
                    json.dump(teacher_forced(args.port, batched=True), f)
            routed = route_summary(trace)
            good = (routed["calls"] > 0 and routed["text_rows_changed"] == 0
                    and routed["image_rows_bias_vl"] >= 0.995 * routed["image_rows"]
                    and routed["image_rows_differ_from_text_rule"] > 0)
            ok &= good
            results.append({"check": "image rows routed by bias_vl", "status": 200, "expected": 200, "ok": good,
                            "body": json.dumps(routed)})
        healthy = call(args.port, "/health", key=None)[0] == 200
        ok &= healthy and server.poll() is None
    print(f"http_check: server healthy after {startup:.0f} s; {sum(r['ok'] for r in results)}/{len(results)} as "
          f"expected; alive and healthy after all requests: {healthy}")
    for r in results:
        print(f"  {'OK  ' if r['ok'] else 'FAIL'} {r['check']:34s} {r['status']} (want {r['expected']}): {r['body']}")
    with open(args.out, "w") as f:
        json.dump({"startup_s": startup, "results": results, "healthy_after": healthy}, f, indent=1)
    if args.compare:
        other = {r["check"]: r.get("output") for r in json.load(open(args.compare))["results"]}
        for r in results:
            a, b = r.get("output"), other.get(r["check"])
            if a and b:
                same = sum(x == y for x, y in zip(a["ids"] or [], b["ids"] or []))
                dlp = max((abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"])), default=float("nan"))
                print(f"  A/B {r['check']:34s} greedy tokens agree {same}/{len(a['ids'] or [])}, "
                      f"max |dlogprob| {dlp:.3f}")
    if args.compare and args.vision:  # teacher-forced: the native record is the oracle (a), its floor beside it
        from dsv4_lab.beds import compare

        this, other = (os.path.splitext(os.path.abspath(p))[0] for p in (args.out, args.compare))
        oracle, candidate = (this, other) if args.native else (other, this)
        floor = oracle + "-teacher-floor.json"
        print("  teacher-forced A/B (image prompts):", os.path.basename(candidate), "against", os.path.basename(oracle))
        compare.main([oracle + "-teacher.json", candidate + "-teacher.json"]
                     + (["--floor", floor] if os.path.exists(floor) else []))
    if not args.vision and not args.native and not args.no_refused_starts:
        for name, extra, want in REFUSED_STARTS:
            good, first = refused_start(args.port, serve_args + extra, want, extra_env)
            ok &= good
            print(f"  {'OK  ' if good else 'FAIL'} refused start: {name:28s} {first}")
            results.append({"check": f"refused start: {name}", "status": None, "expected": "exit != 0", "ok": good,
                            "body": first})
        with open(args.out, "w") as f:
            json.dump({"startup_s": startup, "results": results, "healthy_after": healthy}, f, indent=1)
    print("http_check:", "OK" if ok else "FAILED")
    return 0 if ok else 1


# launches the patch must refuse before any GPU work, naming the check (unsupported parameters with
# the patch on, e.g. an EP or NextN flag at runtime)
REFUSED_STARTS = [
    ("expert parallelism", ["--ep-size", "2", "--tp-size", "2"], "moe.expert_parallel"),
    ("NextN speculative decoding", ["--speculative-algorithm", "NEXTN"], "speculative.draft"),
    ("another MoE runner", ["--moe-runner-backend", "triton"], "moe.runner_backend"),
    ("HiSparse", ["--enable-hisparse"], "server.modes"),
    ("DP attention", ["--enable-dp-attention", "--tp-size", "2", "--dp-size", "2"], "server.modes"),
]


def refused_start(port, serve_args, want, extra_env, timeout=240):
    """(True, the refusal's line) if `dsv4_sm80 serve` with these arguments exits non-zero within `timeout`
    and the gate's report fails check `want`; never leaves a process behind."""
    import subprocess

    cmd = [sys.executable, "-m", "dsv4_sm80", "serve", "--host", "127.0.0.1", "--port", str(port + 1), *serve_args]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **(extra_env or {}))
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.communicate()
        return False, f"still running after {timeout} s"
    check = want.removeprefix("FAIL ")
    line = next((x.strip() for x in out.splitlines() if x.startswith(f"FAIL {check}:")), None)
    if proc.returncode != 0 and line:
        return True, f"exit {proc.returncode}: {line[:150]}"
    tail = [x.strip() for x in out.splitlines() if x.strip()][-1:] or [""]
    return False, f"exit {proc.returncode}, {want!r} not named: {tail[0][:150]}"


def route_summary(path):
    """Totals of the server's DSV4_SM80_LAB_ROUTE_TRACE lines (vision_backport/routing.py): top-k calls with
    image rows, their image rows, those whose experts are top-k of scores + bias_vl (recomputed in float64),
    those where that differs from the text rule, and text rows the hook changed (must be 0)."""
    keys = ("image_rows", "image_rows_bias_vl", "image_rows_differ_from_text_rule", "text_rows_changed")
    total = dict.fromkeys(keys, 0)
    total["calls"] = total["hash_calls"] = 0
    if os.path.exists(path):
        for line in open(path):
            row = json.loads(line)
            total["calls"] += 1
            total["hash_calls"] += row["kind"] == "hash"
            for k in keys:
                total[k] += row[k]
    return total


PROMPT = "<｜begin▁of▁sentence｜><｜User｜>{images}What is in the picture?<｜Assistant｜></think>"


def png(width, height, color):
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buf, format="PNG")
    return buf.getvalue()


def image_request(images, placeholders=None):
    import base64

    urls = ["data:image/png;base64," + base64.b64encode(b).decode() for b in images]
    n = len(images) if placeholders is None else placeholders
    return {"text": PROMPT.format(images="<｜deepseek_image｜>" * n), "image_data": urls, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 8, "temperature": 0}}


# Teacher-forced A/B over HTTP for image prompts (engine_bed's measure, which takes token ids only): a fixed text
# after the image block, scored position by position (input top-20 logprobs), on each path; the native run also
# sends the same requests inside a concurrent batch, its own batch-composition floor (compare.py --floor).
SUFFIX = "The picture shows a single colour filling the whole frame, with no text and no other object. " * 3


def teacher_requests():
    red, blue = png(640, 480, (220, 20, 20)), png(200, 900, (20, 20, 220))
    out = []
    for images in ([red], [red, blue]):
        body = image_request(images)
        body.update(text=body["text"] + SUFFIX, logprob_start_len=0, top_logprobs_num=20,
                    sampling_params={"max_new_tokens": 1, "temperature": 0})
        out.append(body)
    return out


def teacher_record(meta_infos) -> dict:
    """compare.py's record from /generate meta_info with input logprobs: per request the prompt's token ids,
    each position's input logprob and its top list as [token, logprob] pairs, largest first."""
    teacher = []
    for meta in meta_infos:
        toks = meta["input_token_logprobs"]
        tops = meta["input_top_logprobs"]
        teacher.append({"sequence": [int(t[1]) for t in toks], "input_logprobs": [t[0] for t in toks],
                        "top": [sorted(([int(x[1]), float(x[0])] for x in tp), key=lambda y: -y[1]) if tp else []
                                for tp in tops]})
    return {"teacher": teacher, "prompts": []}


def teacher_forced(port, batched=False) -> dict:
    """The teacher requests one after another, or (batched) all at once beside six text requests of other
    lengths, so the server batches them differently."""
    import threading

    bodies = teacher_requests()
    fillers = [{"text": "filler " * (40 * i + 7), "sampling_params": {"max_new_tokens": 24, "temperature": 0}}
               for i in range(6)] if batched else []
    replies = [None] * len(bodies)

    def send(i, body):
        status, text = call(port, "/generate", body)
        if i < len(replies):
            if status != 200:
                raise RuntimeError(f"teacher-forced request {i}: HTTP {status}: {text[:200]}")
            replies[i] = json.loads(text)["meta_info"]

    if batched:
        threads = [threading.Thread(target=send, args=(i, b)) for i, b in enumerate(bodies + fillers)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        if any(r is None for r in replies):
            raise RuntimeError("a batched teacher-forced request failed")
    else:
        for i, b in enumerate(bodies):
            send(i, b)
    return teacher_record(replies)


def vision_checks(port):
    red = png(640, 480, (220, 20, 20))
    return [
        ("one image", "/generate", image_request([red]), KEY, 200),
        ("two images", "/generate", image_request([red, png(200, 900, (20, 20, 220))]), KEY, 200),
        ("corrupt image bytes", "/generate", image_request([b"\x89PNG broken"]), KEY, None),
        ("aspect ratio 10:1", "/generate", image_request([png(1000, 100, (9, 9, 9))]), KEY, None),
        ("17 images", "/generate", image_request([red] * 17), KEY, None),
        ("placeholder count != images", "/generate", image_request([red], placeholders=2), KEY, None),
        ("chat completion with an image", "/v1/chat/completions",
         {"model": "x", "max_tokens": 8, "messages": [{"role": "user", "content": [
             {"type": "image_url", "image_url": {"url": image_request([red])["image_data"][0]}},
             {"type": "text", "text": "What color?"}]}]}, KEY, 200),
        ("chat image in an assistant message", "/v1/chat/completions",
         {"model": "x", "max_tokens": 8, "messages": [{"role": "assistant", "content": [
             {"type": "image_url", "image_url": {"url": image_request([red])["image_data"][0]}}]}]}, KEY, None),
        ("one image after the bad ones", "/generate", image_request([red]), KEY, 200),
    ]


def text_checks(context, long_ids):
    def gen(**params):
        return {"sampling_params": {"max_new_tokens": 4, **params}}

    def chat(text, **kw):
        return {"model": "x", "messages": [{"role": "user", "content": text}], **kw}

    return [  # name, path, body / raw, key, expected status (None: any 4xx)
        ("chat completion", "/v1/chat/completions", chat("Hello", max_tokens=8, temperature=0), KEY, 200),
        ("generate text", "/generate", {"text": "Hello", **gen(max_new_tokens=8, temperature=0)}, KEY, 200),
        ("generate ids", "/generate", {"input_ids": [0, 2, 100, 200], **gen(max_new_tokens=8)}, KEY, 200),
        ("completion", "/v1/completions", {"model": "x", "prompt": "Hi", "max_tokens": 4}, KEY, 200),
        ("no API key", "/v1/chat/completions", chat("Hi"), None, 401),
        ("wrong API key", "/generate", {"text": "Hi"}, "wrong", 401),
        ("prompt longer than the context", "/generate", {"input_ids": long_ids, **gen()}, KEY, None),
        ("max_tokens beyond the context", "/v1/completions",
         {"model": "x", "prompt": "Hi", "max_tokens": context * 4}, KEY, None),
        ("empty prompt", "/v1/completions", {"model": "x", "prompt": "", "max_tokens": 4}, KEY, None),
        ("empty messages", "/v1/chat/completions", {"model": "x", "messages": []}, KEY, None),
        ("token id beyond the vocabulary", "/generate", {"input_ids": [0, 10_000_000], **gen()}, KEY, None),
        ("negative token id", "/generate", {"input_ids": [0, -5], **gen()}, KEY, None),
        ("malformed JSON", "/v1/chat/completions", b'{"model": "x", "messages": [', KEY, None),
        ("negative max_tokens", "/v1/completions", {"model": "x", "prompt": "Hi", "max_tokens": -1}, KEY, None),
        ("chat after the bad requests", "/v1/chat/completions", chat("Still there?", max_tokens=8), KEY, 200),
    ]


if __name__ == "__main__":
    sys.exit(main())
