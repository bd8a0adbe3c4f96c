"""The gate on a `unit` checkpoint corrupted at random: header bytes, JSON types, data offsets, index
entries, config values, tokenizer files, files replaced by folders or devices. Every outcome is PASS or
FAIL lines naming a check, never a traceback; and where the gate passes a shard, the safetensors
library (what SGLang's loader runs) opens it too.
"""

import json
import os
import random
import shutil
import struct
import time

from dsv4_sm80 import env, gate
from dsv4_sm80.gate import Facts, GpuFacts, PatchFacts, SGLangFacts

CORRUPTIONS = 500
A800 = [{"index": i, "name": "NVIDIA A800-SXM4-80GB", "cc": "8.0", "memory_gib": 79.3} for i in range(4)]


def judge(path):
    facts = Facts(sglang=SGLangFacts(location="/x/sglang", version=env.SGLANG_VERSION),
                  gpus=GpuFacts(devices=list(A800)),
                  patch=PatchFacts(env_value="1", sitecustomize="/x/sitecustomize.py", ours=True, hook_installed=True,
                                   knobs={d.name: d.value for d in env.IMPORT_TIME_DEFAULTS}),
                  model=gate.collect_model(path))
    return gate.evaluate(facts)


VALUES = [None, True, False, 0, -1, 1, 7, 2 ** 63, 1.5, float("inf"), "", "x", "4096", "../x", "/etc/passwd",
          [], [1], ["a"], {}, {"a": 1}]


def other_value(rng):
    return rng.choice(VALUES)


def paths_of(value, prefix=()):
    """Every (key path) inside a JSON value, the root excluded."""
    out = []
    if isinstance(value, dict):
        for k, v in value.items():
            out.append(prefix + (k,))
            out += paths_of(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value[:4]):
            out.append(prefix + (i,))
            out += paths_of(v, prefix + (i,))
    return out


def set_path(value, path, new):
    for k in path[:-1]:
        value = value[k]
    if new is KeyError:
        del value[path[-1]]
    else:
        value[path[-1]] = new


class Workdir:
    """A private copy of the checkpoint; each corruption is undone before the next."""

    def __init__(self, src, dst):
        shutil.copytree(src, dst)
        self.src, self.dir = src, str(dst)
        self.files = sorted(os.listdir(dst))
        self.shards = [f for f in self.files if f.endswith(".safetensors")]

    def path(self, name):
        return os.path.join(self.dir, name)

    def save(self, name):
        return open(self.path(name), "rb").read()

    def stamps(self):
        out = {}
        for n in self.files:
            try:
                st = os.lstat(self.path(n))
                out[n] = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_mode)
            except FileNotFoundError:
                out[n] = None
        return out

    def restore(self, before):
        for n, stamp in self.stamps().items():
            if stamp == before[n]:
                continue
            p = self.path(n)
            if os.path.isdir(p) and not os.path.islink(p):
                shutil.rmtree(p)
            elif os.path.lexists(p):
                os.unlink(p)
            shutil.copyfile(os.path.join(self.src, n), p)
        assert self.stamps().keys() == before.keys()


def header_of(blob):
    n = struct.unpack("<Q", blob[:8])[0]
    return n, blob[8:8 + n], blob[8 + n:]


def with_header(header: bytes, payload: bytes) -> bytes:
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + payload


# --- the corruptions: each takes (rng, workdir) and returns (file touched, what was done) -------------

def flip_header_bytes(rng, w):
    name = rng.choice(w.shards)
    blob = bytearray(w.save(name))
    n = struct.unpack("<Q", blob[:8])[0]
    for _ in range(rng.randint(1, 4)):
        i = rng.randrange(0, 8 + n)
        blob[i] = rng.randrange(256)
    open(w.path(name), "wb").write(bytes(blob))
    return name, "header bytes"


def mutate_json(rng, value):
    paths = paths_of(value)
    if not paths or rng.random() < 0.05:
        value = other_value(rng)
    else:
        path = rng.choice(paths)
        set_path(value, path, KeyError if rng.random() < 0.2 and not isinstance(path[-1], int) else other_value(rng))
    return value


def header_json(rng, w):
    name = rng.choice(w.shards)
    n, head, payload = header_of(w.save(name))
    doc = json.loads(head)
    # an entry's field (dtype, shape, data_offsets) rather than whole entries, most of the time
    entry = rng.choice([k for k in doc if k != "__metadata__"])
    if rng.random() < 0.7:
        field = rng.choice(["dtype", "shape", "data_offsets"])
        if rng.random() < 0.2:
            del doc[entry][field]
        else:
            doc[entry][field] = other_value(rng)
    else:
        doc = mutate_json(rng, doc)
    open(w.path(name), "wb").write(with_header(json.dumps(doc).encode(), payload))
    return name, "header JSON"


def offsets(rng, w):
    name = rng.choice(w.shards)
    n, head, payload = header_of(w.save(name))
    doc = json.loads(head)
    entry = rng.choice([k for k in doc if k != "__metadata__"])
    b, e = doc[entry]["data_offsets"]
    doc[entry]["data_offsets"] = rng.choice([[b + 2, e + 2], [b, e - 1], [b - 2, e - 2] if b >= 2 else [0, e + 2],
                                             [e, b], [0, e - b], [b, e + 2 ** 40]])
    open(w.path(name), "wb").write(with_header(json.dumps(doc).encode(), payload))
    return name, "data offsets"


def json_file(name):
    def corrupt(rng, w):
        doc = json.loads(w.save(name))
        doc = mutate_json(rng, doc)
        open(w.path(name), "w").write(json.dumps(doc))
        return name, "JSON value"
    return corrupt


def index_entry(rng, w):
    name = "model.safetensors.index.json"
    doc = json.loads(w.save(name))
    tensor = rng.choice(list(doc["weight_map"]))
    doc["weight_map"][tensor] = rng.choice(["../" + doc["weight_map"][tensor], "/tmp/x.safetensors", "", ".",
                                            "nope.safetensors", 5, None, rng.choice(w.shards), "sub/a.safetensors"])
    open(w.path(name), "w").write(json.dumps(doc))
    return name, "index entry"


def config_value(rng, w):
    name = "config.json"
    doc = json.loads(w.save(name))
    doc[rng.choice(list(doc))] = other_value(rng) if rng.random() < 0.5 else rng.choice([0, -3, 3, 129280, 1e-6])
    open(w.path(name), "w").write(json.dumps(doc))
    return name, "config value"


def file_bytes(rng, w):
    name = rng.choice([f for f in w.files if f.endswith(".json")])
    data = w.save(name)
    cut = rng.randrange(len(data))
    open(w.path(name), "wb").write(rng.choice([data[:cut], data[:cut] + b"\xff\xfe" + data[cut:], b"", b"\0" * 9]))
    return name, "file bytes"


def file_kind(rng, w):
    name = rng.choice(w.files)
    p = w.path(name)
    os.unlink(p)
    how = rng.choice(["missing", "directory", "device"])
    if how == "directory":
        os.mkdir(p)
    elif how == "device":
        os.symlink("/dev/null", p)
    return name, how


CORRUPTORS = [flip_header_bytes, header_json, offsets, index_entry, config_value, file_bytes, file_kind,
              json_file("config.json"), json_file("model.safetensors.index.json"), json_file("tokenizer.json"),
              json_file("tokenizer_config.json")]


def test_random_corruptions_never_crash_the_gate(unit_ckpt, tmp_path):
    from safetensors import safe_open

    w = Workdir(unit_ckpt, tmp_path / "w")
    clean = judge(w.dir)
    assert not gate.failures(clean), [f.line() for f in gate.failures(clean)]
    checks = {f.check for f in clean} | {"model.files", "model.path"}  # + the guard's name for the file checks
    rng = random.Random(20260)
    t0, refused, outcomes = time.monotonic(), 0, {}
    for i in range(CORRUPTIONS):
        corrupt = CORRUPTORS[i % len(CORRUPTORS)]
        before = w.stamps()
        name, what = corrupt(rng, w)
        try:
            findings = judge(w.dir)  # any exception fails the test: the gate must turn it into a line
            for f in findings:
                assert f.status in ("pass", "fail", "skip") and f.check in checks, f
                assert "\n" not in f.line() and "Traceback" not in f.line(), f.line()
                if f.status == "fail":
                    assert f.found and f.expected and f.fix, f
            bad = gate.failures(findings)
            refused += bool(bad)
            outcomes[what] = outcomes.get(what, 0) + bool(bad)
            shards_ok = next(f for f in findings if f.check == "model.shards").status == "pass"
            if shards_ok and name.endswith(".safetensors"):
                with safe_open(w.path(name), "pt"):  # the gate's pass implies the library's
                    pass
        finally:
            w.restore(before)
    elapsed = time.monotonic() - t0
    assert refused > CORRUPTIONS // 2, outcomes  # most corruptions break something the loader relies on
    assert elapsed < 60, f"{CORRUPTIONS} corruptions took {elapsed:.0f} s"
