"""Write a safetensors file one tensor at a time (the header first, from declared names, dtypes and
shapes), so a large dump never holds more than the tensor being written. Written to a temporary
sibling and renamed into place when every declared tensor has been written; readable by
`safetensors.safe_open` / `load_file` like any other.

Format: 8-byte little-endian header length, the JSON header (padded with spaces to a multiple of 8),
then each tensor's bytes (row-major, little-endian) back to back in header order.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch

_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
           torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8", torch.bool: "BOOL"}


class SafetensorsWriter:
    def __init__(self, path: str | Path, entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None):
        self.path = Path(path)
        self.tmp = self.path.with_name(f".{self.path.name}.partial")
        header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
        self.order, offset = [], 0
        for name, dtype, shape in entries:
            if dtype not in _DTYPES:
                raise ValueError(f"{name}: dtype {dtype} has no safetensors code")
            n = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
            header[name] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
            self.order.append((name, dtype, tuple(shape)))
            offset += n
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        self.f = open(self.tmp, "wb")
        self.f.write(struct.pack("<Q", len(blob)) + blob)
        self.next = 0

    def write(self, name: str, t: torch.Tensor) -> None:
        want, dtype, shape = self.order[self.next]
        if (name, t.dtype, tuple(t.shape)) != (want, dtype, shape):
            raise ValueError(f"safetensors stream: expected {want} {dtype} {shape}, got {name} {t.dtype} {tuple(t.shape)}")
        self.f.write(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        self.next += 1

    def close(self) -> None:
        self.f.close()
        if self.next != len(self.order):
            self.tmp.unlink(missing_ok=True)
            raise ValueError(f"safetensors stream: {len(self.order) - self.next} declared tensors never written")
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        self.f.close()
        self.tmp.unlink(missing_ok=True)
