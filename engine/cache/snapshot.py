"""Session snapshots: a chain's KV, method state and metadata <-> host tensors <-> bytes.

Format (no pickle anywhere): ``b"CKV1"``, a 4-byte little-endian header length, a msgpack header,
then the raw tensor buffers back to back. The header holds the metadata (plain values) and, per
tensor, its name, dtype, shape, byte offset, length and CRC-32, so a damaged buffer is detected
before anything is loaded.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch

from engine.cache.fork_snapshot import KVSnapshot

MAGIC = b"CKV1"
_DTYPES = {
    str(d): d
    for d in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int32,
        torch.int64,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.float8_e4m3fn,
    )
}


class SnapshotError(ValueError):
    """The bytes are not a snapshot, or a buffer fails its checksum."""


@dataclass
class SessionSnapshot:
    meta: dict[str, Any]
    """Plain values: session id, turn index, generation, token history, spans, method spec, ..."""
    kv: KVSnapshot | None
    """The physical KV; None when only the history is kept (a rebuild re-prefills it)."""
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    """Extra tensors: method state (``method.<name>``), the query window, ..."""

    def to_bytes(self) -> bytes:
        named = dict(self.tensors)
        if self.kv is not None:
            named.update({"kv.lengths": self.kv.lengths, "kv.k": self.kv.k, "kv.v": self.kv.v, "kv.pos": self.kv.pos})
        entries, buffers, offset = [], [], 0
        for name, t in named.items():
            raw = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
            entries.append(
                {
                    "name": name,
                    "dtype": str(t.dtype),
                    "shape": list(t.shape),
                    "offset": offset,
                    "nbytes": len(raw),
                    "crc32": zlib.crc32(raw),
                }
            )
            buffers.append(raw)
            offset += len(raw)
        header = msgpack.packb({"meta": self.meta, "tensors": entries}, use_bin_type=True)
        return MAGIC + struct.pack("<I", len(header)) + header + b"".join(buffers)

    @classmethod
    def from_bytes(cls, data: bytes | memoryview) -> "SessionSnapshot":
        data = memoryview(data)
        if len(data) < 8 or bytes(data[:4]) != MAGIC:
            raise SnapshotError("not a chainkv snapshot (bad magic)")
        (hlen,) = struct.unpack("<I", data[4:8])
        try:
            header = msgpack.unpackb(data[8 : 8 + hlen], raw=False)
        except Exception as e:
            raise SnapshotError(f"snapshot header is corrupt: {e}") from None
        body = data[8 + hlen :]
        tensors: dict[str, torch.Tensor] = {}
        for e in header["tensors"]:
            raw = body[e["offset"] : e["offset"] + e["nbytes"]]
            if len(raw) != e["nbytes"] or zlib.crc32(raw) != e["crc32"]:
                raise SnapshotError(f"snapshot tensor {e['name']!r} fails its checksum")
            dtype = _DTYPES.get(e["dtype"])
            if dtype is None:
                raise SnapshotError(f"snapshot tensor {e['name']!r} has unknown dtype {e['dtype']}")
            flat = (
                torch.frombuffer(bytearray(raw), dtype=torch.uint8)
                if e["nbytes"]
                else torch.empty(0, dtype=torch.uint8)
            )
            tensors[e["name"]] = flat.view(dtype).reshape(e["shape"])
        kv = None
        if "kv.lengths" in tensors:
            kv = KVSnapshot(
                lengths=tensors.pop("kv.lengths"),
                k=tensors.pop("kv.k"),
                v=tensors.pop("kv.v"),
                pos=tensors.pop("kv.pos"),
            )
        return cls(meta=header["meta"], kv=kv, tensors=tensors)

    @property
    def nbytes(self) -> int:
        n = sum(t.numel() * t.element_size() for t in self.tensors.values())
        if self.kv is not None:
            n += sum(t.numel() * t.element_size() for t in (self.kv.lengths, self.kv.k, self.kv.v, self.kv.pos))
        return n
