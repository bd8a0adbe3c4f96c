"""The training text: the source and docs of the Python standard library on this machine (ships offline),
as stand-in tokenizer ids, with a held-out split decided per file.

- Files: every `*.py`, `*.txt`, `*.rst` under `sysconfig.get_paths()["stdlib"]`, site-packages, caches and
  test data folders left out, sorted by their path relative to that root.
- Split: a file is held out when crc32 of its relative path (utf-8) mod 100 < `HELD_OUT_PERCENT`; the same
  file is held out on every machine and every run, whatever else the library holds.
- Ids: the stand-in tokenizer (`dsv4_sm80.tiny.tokenizer`) encodes text byte by byte: byte b is id
  `BYTE_BASE + b` (its 14 special tokens come first), and each file starts with BOS (id 0).
- Bits per byte: summed next-token NLL (nats) over the predicted byte ids / ln 2 / bytes predicted.
"""

from __future__ import annotations

import math
import os
import sysconfig
import zlib

import torch

from dsv4_sm80.tiny.tokenizer import SPECIALS

BOS = 0
BYTE_BASE = len(SPECIALS)
HELD_OUT_PERCENT = 5
SUFFIXES = (".py", ".txt", ".rst")
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test", "idlelib"}


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def corpus_files(root: str | None = None) -> list[str]:
    """Relative paths of the text files under root, sorted."""
    root = root or stdlib_root()
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in SKIP_DIRS and not x.startswith("."))
        for f in files:
            if f.endswith(SUFFIXES):
                out.append(os.path.relpath(os.path.join(d, f), root))
    return sorted(out)


def is_held_out(rel_path: str) -> bool:
    return zlib.crc32(rel_path.encode("utf-8")) % 100 < HELD_OUT_PERCENT


def split(root: str | None = None) -> tuple[list[str], list[str]]:
    """(training files, held-out files), each sorted."""
    files = corpus_files(root)
    return [f for f in files if not is_held_out(f)], [f for f in files if is_held_out(f)]


def encode(data: bytes) -> torch.Tensor:
    """BOS then one id per byte."""
    ids = torch.tensor(list(data), dtype=torch.int64) + BYTE_BASE
    return torch.cat([torch.tensor([BOS]), ids])


def token_stream(files: list[str], root: str | None = None) -> torch.Tensor:
    """The files' ids concatenated, in the order given."""
    root = root or stdlib_root()
    parts = []
    for rel in files:
        with open(os.path.join(root, rel), "rb") as f:
            parts.append(encode(f.read()))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def save_corpus(path: str, root: str | None = None) -> dict:
    """This machine's split (training and held-out files' bytes) in one file, for a machine whose Python library
    differs: trained on there, the model sees this machine's training text and is scored on its held-out text."""
    import platform

    root = root or stdlib_root()
    corpus = {"python": platform.python_version()}
    for part, files in zip(("train", "held"), split(root)):
        blobs = [open(os.path.join(root, rel), "rb").read() for rel in files]
        corpus[part] = {"files": files, "lengths": torch.tensor([len(b) for b in blobs]),
                        "bytes": torch.frombuffer(bytearray(b"".join(blobs)), dtype=torch.uint8)}
    torch.save(corpus, path)
    return {"python": corpus["python"], **{p: {"files": len(corpus[p]["files"]),
                                               "bytes": int(corpus[p]["lengths"].sum())} for p in ("train", "held")}}


def load_corpus(path: str, part: str = "train") -> tuple[torch.Tensor, dict]:
    """(the token stream of a saved corpus's part, as `token_stream` builds it, and its facts)."""
    corpus = torch.load(path)
    parts, at = [], 0
    for n in corpus[part]["lengths"].tolist():
        parts.append(torch.cat([torch.tensor([BOS]), corpus[part]["bytes"][at:at + n].long() + BYTE_BASE]))
        at += n
    return torch.cat(parts), {"files": len(corpus[part]["files"]), "python": corpus["python"]}


def bits_per_byte(nll_nats: float, n_bytes: int) -> float:
    if n_bytes <= 0:
        raise ValueError(f"bits per byte: {n_bytes} bytes predicted; expected at least one")
    return nll_nats / math.log(2) / n_bytes


def sequence_nll(logits: torch.Tensor, ids: torch.Tensor) -> tuple[float, int]:
    """(summed NLL in nats, count) of ids[1:] under logits[:-1], over the byte ids only (BOS is not a byte)."""
    logp = torch.log_softmax(logits[:-1].double(), dim=-1)
    target = ids[1:]
    nll = -logp.gather(-1, target[:, None])[:, 0]
    is_byte = target >= BYTE_BASE
    return float(nll[is_byte].sum()), int(is_byte.sum())


class Batches:
    """Seeded windows of a token stream: step i draws from its own generator (seed, i), so a run restarted
    at step i sees the same batches. Every `long_every`-th step is `long_batch` windows of `long_len` ids (above
    2,048 so the C4 indexer selects); the others are `short_batch` windows of `short_len`."""

    def __init__(self, stream: torch.Tensor, seed: int, short_len: int, short_batch: int, long_len: int,
                 long_every: int, long_batch: int = 1):
        need = max(short_len, long_len) + 1
        if stream.numel() < need:
            raise ValueError(f"training text: {stream.numel()} ids, expected at least {need} for windows of "
                             f"{need - 1}; lower --seq")
        self.stream, self.seed = stream, seed
        self.short_len, self.short_batch, self.long_len, self.long_every = short_len, short_batch, long_len, long_every
        self.long_batch = long_batch

    def __call__(self, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        long = self.long_every > 0 and step % self.long_every == self.long_every - 1
        n, b = (self.long_len, self.long_batch) if long else (self.short_len, self.short_batch)
        starts = torch.randint(0, self.stream.numel() - n, (b,), generator=g)
        return torch.stack([self.stream[s:s + n] for s in starts.tolist()])


# Python the model never saw: sources of the transformers release the oracle pins, a window from each file's middle
FOREIGN_VERSION = "5.12.1"
FOREIGN_FILES = ("models/deepseek_v4/modeling_deepseek_v4.py", "generation/utils.py", "tokenization_utils_base.py",
                 "modeling_utils.py", "trainer.py", "configuration_utils.py", "models/llama/modeling_llama.py",
                 "pipelines/base.py")


def foreign_windows(length: int = 3000) -> list[tuple[str, list[int]]]:
    """(file, ids) for each of FOREIGN_FILES: `length` byte ids from the first line start at or after the file's
    middle (past the licence header every file repeats)."""
    import transformers

    if transformers.__version__ != FOREIGN_VERSION:
        raise RuntimeError(f"foreign windows: transformers {transformers.__version__} is installed, expected "
                           f"{FOREIGN_VERSION} (the files are this release's); install transformers=={FOREIGN_VERSION}")
    root = os.path.dirname(transformers.__file__)
    out = []
    for rel in FOREIGN_FILES:
        with open(os.path.join(root, rel), "rb") as f:
            raw = f.read()
        start = raw.index(b"\n", len(raw) // 2) + 1
        if len(raw) - start < length:
            raise RuntimeError(f"foreign windows: {rel} has {len(raw) - start} bytes after its middle, expected "
                               f"at least {length}")
        out.append((rel, encode(raw[start:start + length])[1:].tolist()))
    return out


def held_out_prompts(lengths: list[int], root: str | None = None, corpus: str | None = None) -> list[list[int]]:
    """One window of held-out text per length, spread evenly over the held-out files' ids (in file order), so
    prompts of one run do not overlap: prompt k of n starts at k / n of the stream. corpus: a saved corpus's
    held-out files instead of this machine's."""
    if corpus:
        stream = load_corpus(corpus, "held")[0]
    else:
        stream = token_stream(split(root)[1], root)
    step = stream.numel() // max(1, len(lengths))
    if any(n > step for n in lengths):
        raise ValueError(f"held-out prompts: {len(lengths)} prompts of up to {max(lengths)} ids need "
                         f"{len(lengths) * max(lengths)} held-out ids; this library has {stream.numel()}")
    return [stream[k * step:k * step + n].tolist() for k, n in enumerate(lengths)]
