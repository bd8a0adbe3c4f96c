"""Plain float64 references written from the formats' definitions, shared by the CPU tests and the
GPU scripts (dsv4_lab/beds/): e4m3 (1-4-3, bias 7, subnormals), E8M0 (2^(b-127)), E2M1 (1-2-1, bias 1),
round-to-nearest-even onto the BF16 grid, and raw reads of a checkpoint's bytes. Nothing here uses
the code under test.
"""

import json
import os

import numpy as np

from dsv4_sm80.checkpoint.safetensors_io import read_header


def e4m3_table() -> np.ndarray:
    out = np.empty(256)
    for b in range(256):
        sign = -1.0 if b & 0x80 else 1.0
        exp, man = (b >> 3) & 0xF, b & 0x7
        if exp == 0xF and man == 0x7:
            out[b] = np.nan
        elif exp == 0:
            out[b] = sign * (man / 8) * 2.0 ** -6
        else:
            out[b] = sign * (1 + man / 8) * 2.0 ** (exp - 7)
    return out


def e2m1_table() -> np.ndarray:
    out = np.empty(16)
    for c in range(16):
        sign = -1.0 if c & 0x8 else 1.0
        exp, man = (c >> 1) & 0x3, c & 0x1
        out[c] = sign * (man * 0.5 if exp == 0 else (1 + man / 2) * 2.0 ** (exp - 1))
    return out


def e8m0(b: np.ndarray) -> np.ndarray:
    assert not np.any(b == 255), "E8M0 NaN byte"
    return np.exp2(b.astype(np.float64) - 127)


def load_raw(ckpt, name):
    wm = json.load(open(os.path.join(ckpt, "model.safetensors.index.json")))["weight_map"]
    h = read_header(os.path.join(ckpt, wm[name]))
    t = h.tensors[name]
    b, e = t["data_offsets"]
    with open(h.path, "rb") as f:
        f.seek(8 + h.header_len + b)
        data = f.read(e - b)
    np_dtype = {"F8_E4M3": np.uint8, "F8_E8M0": np.uint8, "I8": np.uint8, "BF16": np.uint16,
                "F32": np.float32, "I64": np.int64}[t["dtype"]]
    arr = np.frombuffer(data, dtype=np_dtype).reshape(t["shape"])
    if t["dtype"] == "BF16":
        arr = (arr.astype(np.uint32) << 16).view(np.float32)
    return t["dtype"], arr


def dequant_fp8(w_bytes, s_bytes):
    w = e4m3_table()[w_bytes]
    s = e8m0(s_bytes)
    full = np.repeat(np.repeat(s, 128, 0), 128, 1)[: w.shape[0], : w.shape[1]]
    return w * full


def dequant_mxfp4(packed, s_bytes):
    t = e2m1_table()
    vals = np.empty((packed.shape[0], packed.shape[1] * 2))
    vals[:, 0::2] = t[packed & 0xF]  # low nibble = even column
    vals[:, 1::2] = t[packed >> 4]
    return vals * np.repeat(e8m0(s_bytes), 32, axis=1)


# --- config and files --------------------------------------------------------------------------


BF16_MAX = (2 - 2.0 ** -7) * 2.0 ** 127


def round_to_bf16(x: np.ndarray) -> np.ndarray:
    ax = np.abs(x)
    _, e = np.frexp(ax)  # ax = m * 2^e, m in [0.5, 1)
    q = np.maximum(e - 8, -133).astype(np.float64)  # spacing of the BF16 grid around ax
    r = np.round(ax / np.exp2(q)) * np.exp2(q)  # numpy rounds half to even
    r = np.where(r > BF16_MAX, np.inf, r)
    return np.copysign(r, x)


def dequant_fp8_bf16(w_bytes: np.ndarray, scale_bytes: np.ndarray) -> np.ndarray:
    w = e4m3_table()[w_bytes]
    s = np.exp2(scale_bytes.astype(np.float64) - 127)
    full = np.repeat(np.repeat(s, 128, 0), 128, 1)[: w.shape[0], : w.shape[1]]
    return round_to_bf16(w * full)
