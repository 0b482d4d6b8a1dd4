"""Sharded safetensors writing with bounded memory: ``ShardWriter`` takes tensors one by one and writes
``model.safetensors`` (one shard) or ``model-0000K-of-0000N.safetensors`` with ``model.safetensors.index.json``
(``transformers``' layout), each shard at most ``max_shard_size`` bytes.

A shard's tensor bytes are spooled to disk as they arrive and the file is assembled (header, then the
spooled bytes) when the shard is full, so the writer holds no tensor after ``add`` returns: the
``safetensors`` package can only write a shard from a dict held in memory whole.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
from pathlib import Path

import torch

__all__ = ["DEFAULT_MAX_SHARD_SIZE", "ShardWriter", "parse_size"]

DEFAULT_MAX_SHARD_SIZE = "5GB"  # transformers' default

_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(size: int | str) -> int:
    """Bytes of ``size``: an int, or a string such as ``"5GB"``, ``"500MB"``, ``"2GiB"`` (as transformers reads it)."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", str(size).upper())
        if not m:
            raise ValueError(f"max_shard_size {size!r} is not a size: give bytes or e.g. '5GB', '500MB'")
        value = int(float(m.group(1)) * _UNITS[m.group(2) or ""])
    if value <= 0:
        raise ValueError(f"max_shard_size must be positive, got {size!r}")
    return value


class ShardWriter:
    """Write tensors into ``folder`` shard by shard; ``close()`` names the shards and writes the index."""

    def __init__(self, folder: Path, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> None:
        self.folder = Path(folder)
        self.max_bytes = parse_size(max_shard_size)
        self.shards: list[Path] = []  # the finished shards, numbered in order
        self.weight_map: dict[str, int] = {}  # tensor name -> shard index
        self.total = 0
        self._header: dict[str, dict] = {}
        self._size = 0
        self._spool = None

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Append ``tensor`` under ``name`` (its bytes go to disk now)."""
        if name in self.weight_map or name in self._header:
            raise ValueError(f"tensor {name!r} written twice")
        if tensor.dtype not in _DTYPES:
            raise ValueError(f"tensor {name!r}: dtype {tensor.dtype} has no safetensors name")
        t = tensor.detach().to("cpu").contiguous()
        nbytes = t.numel() * t.element_size()
        if self._header and self._size + nbytes > self.max_bytes:
            self._finish_shard()
        if self._spool is None:
            self._spool = open(self.folder / f".shard-{len(self.shards) + 1}.spool", "w+b")  # noqa: SIM115
        if nbytes:
            self._spool.write(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        self._header[name] = {
            "dtype": _DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [self._size, self._size + nbytes],
        }
        self._size += nbytes
        self.total += nbytes

    def add_all(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, t in tensors.items():
            self.add(name, t)

    def _finish_shard(self) -> None:
        header = dict(self._header)
        header["__metadata__"] = {"format": "pt"}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        path = self.folder / f".shard-{len(self.shards) + 1}.safetensors"
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            self._spool.seek(0)
            shutil.copyfileobj(self._spool, f, 1 << 24)
        self._spool.close()
        os.remove(self._spool.name)
        self._spool = None
        for key in self._header:
            self.weight_map[key] = len(self.shards)
        self.shards.append(path)
        self._header, self._size = {}, 0

    def close(self) -> list[str]:
        """Write the last shard, give the shards their final names (and the index when there are several);
        returns the file names written."""
        if self._header or not self.shards:
            self._finish_shard()
        n = len(self.shards)
        names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        for path, name in zip(self.shards, names, strict=True):
            os.replace(path, self.folder / name)
        if n == 1:
            return names
        index = {
            "metadata": {"total_size": self.total},
            "weight_map": {k: names[i] for k, i in sorted(self.weight_map.items())},
        }
        (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        return [*names, "model.safetensors.index.json"]

    def abort(self) -> None:
        """Close the spool file (the folder itself is removed by its owner)."""
        if self._spool is not None:
            self._spool.close()
            self._spool = None
