"""Reading and writing safetensors files directly (no torch, no `safetensors` package).

Layout: 8-byte little-endian header length N, N bytes of JSON header (padded with spaces to a
multiple of 8), then the raw little-endian payload; each header entry is
{"dtype", "shape", "data_offsets": [begin, end]} relative to the payload start. Writing it
ourselves keeps the official dtype strings (F8_E8M0 in particular) exact on any torch.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass

MAX_HEADER = 100 << 20


class SafetensorsError(ValueError):
    pass


@dataclass
class ShardHeader:
    path: str
    file_size: int
    header_len: int
    tensors: dict  # name -> {"dtype", "shape", "data_offsets"}
    metadata: dict

    @property
    def payload_size(self) -> int:
        return max((t["data_offsets"][1] for t in self.tensors.values()), default=0)

    @property
    def expected_file_size(self) -> int:
        return 8 + self.header_len + self.payload_size


def read_header(path: str) -> ShardHeader:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise SafetensorsError(f"{path}: {size} bytes, too short for a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER or 8 + n > size:
            raise SafetensorsError(f"{path}: header length {n} does not fit in a {size}-byte file")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise SafetensorsError(f"{path}: header is not JSON ({e})") from None
    meta = header.pop("__metadata__", {}) or {}
    return ShardHeader(path, size, n, header, meta)


def write_shard(path: str, tensors) -> int:
    """tensors: iterable of (name, dtype string, shape, raw bytes). Returns the file size."""
    header, offset, payload = {}, 0, []
    for name, dtype, shape, data in tensors:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        payload.append(data)
    blob = json.dumps({"__metadata__": {"format": "pt"}, **header}, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for data in payload:
            f.write(data)
    os.replace(tmp, path)
    return 8 + len(blob) + offset
