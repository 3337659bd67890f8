"""Safetensors shards: tensors read lazily one at a time through the index, and shards written in order.

A safetensors file is an 8-byte little-endian header length, a JSON header
`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}` and the raw
little-endian bytes (offsets relative to the end of the header). The `safetensors` package's numpy
API has no float8 types, and the released checkpoint stores its weights as `F8_E4M3` with `F8_E8M0`
scales, so the format is read here directly: `Shards.read` returns a read-only `np.memmap` view of
one tensor (nothing else is loaded; the page cache holds what was touched), and `write_shards`
writes a dict of arrays as `model-XXXXX-of-YYYYY.safetensors` files plus `model.safetensors.index.json`.
Files written here are read back by `safetensors.safe_open` for every dtype it knows.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Iterable, Mapping

import ml_dtypes
import numpy as np

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
_CODES = {dtype: code for code, dtype in DTYPES.items()}


_FIX = "the file is damaged or was not written completely: copy or convert it again"


def _header(path: Path) -> tuple[dict, int]:
    """The JSON header of a safetensors file and where its data starts; every entry's dtype, shape and byte range
    checked against the header and the file's size."""
    if not path.is_file():
        raise ValueError(f"{path}: no such safetensors file; copy the whole checkpoint directory (its index names it)")
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8:
            raise ValueError(f"{path}: the header claims {n} bytes, the file holds {size - 8} after the length; {_FIX}")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"{path}: the header is not JSON ({err}); {_FIX}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the header is not a JSON object; {_FIX}")
    data = size - 8 - n
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        ok = (isinstance(entry, dict) and isinstance(entry.get("dtype"), str) and isinstance(entry.get("shape"), list)
              and all(isinstance(d, int) and d >= 0 for d in entry["shape"])
              and isinstance(entry.get("data_offsets"), list) and len(entry["data_offsets"]) == 2
              and all(isinstance(o, int) for o in entry["data_offsets"]))
        if not ok:
            raise ValueError(f"{path}: tensor {name!r} has a malformed header entry {entry!r} (needs dtype, shape "
                             f"and data_offsets [begin, end]); {_FIX}")
        begin, end = entry["data_offsets"]
        if not 0 <= begin <= end <= data:
            raise ValueError(f"{path}: tensor {name!r} claims bytes [{begin}, {end}) of a {data}-byte data section; "
                             f"{_FIX}")
    return header, 8 + n


class Shards:
    """The tensors of a checkpoint directory (`model.safetensors.index.json` + shards, or one `model.safetensors`).

    Only headers are read at construction. `read(name)` maps one tensor; `bytes_read` counts the bytes
    of every tensor handed out.
    """

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        index = self.directory / INDEX
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                files = sorted(set(weight_map.values()))
                if not all(isinstance(f, str) and f == Path(f).name for f in files):
                    raise TypeError(f"shard names must be file names in the directory, got {files[:3]}")
            except (ValueError, KeyError, TypeError, AttributeError) as err:
                raise ValueError(f"{index}: not a safetensors index (a JSON object with a weight_map of tensor → file "
                                 f"names: {type(err).__name__} {err}); copy or convert the checkpoint again") from None
        elif (self.directory / SINGLE).exists():
            files, weight_map = [SINGLE], None
        else:
            raise ValueError(f"{self.directory}: no {INDEX} or {SINGLE}; pass the directory of a safetensors "
                             "checkpoint")
        self._entries: dict[str, tuple[Path, int, dict]] = {}
        for file in files:
            header, start = _header(self.directory / file)
            for name, entry in header.items():
                if name != "__metadata__":
                    if weight_map is not None and weight_map.get(name) != file:
                        raise ValueError(f"{file} holds tensor {name!r}, which {INDEX} places in "
                                         f"{weight_map.get(name)!r}; the index and the shards disagree")
                    self._entries[name] = (self.directory / file, start, entry)
        if weight_map is not None:
            missing = sorted(set(weight_map) - set(self._entries))
            if missing:
                raise ValueError(f"{INDEX} lists {len(missing)} tensor(s) its shards lack, e.g. {missing[:3]}")
        self.bytes_read = 0

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entry(name)[2]["shape"])

    def dtype(self, name: str) -> str:
        """The safetensors dtype code (`"F8_E4M3"`, `"BF16"`, ...)."""
        return self._entry(name)[2]["dtype"]

    def read(self, name: str) -> np.ndarray:
        """Tensor `name` as a read-only memory map (its safetensors dtype as a numpy / ml_dtypes type)."""
        path, start, entry = self._entry(name)
        code = entry["dtype"]
        if code not in DTYPES:
            raise ValueError(f"tensor {name!r}: safetensors dtype {code} is not supported; known: {sorted(DTYPES)}")
        dtype, shape = DTYPES[code], tuple(entry["shape"])
        begin, end = entry["data_offsets"]
        if end - begin != int(np.prod(shape)) * dtype.itemsize:
            raise ValueError(f"tensor {name!r}: {end - begin} bytes for shape {shape} of {code}; the file is corrupt")
        self.bytes_read += end - begin
        if end == begin:
            return np.zeros(shape, dtype)
        return np.memmap(path, dtype=dtype, mode="r", offset=start + begin, shape=shape)

    def _entry(self, name: str) -> tuple[Path, int, dict]:
        if name not in self._entries:
            raise ValueError(f"tensor {name!r} is not in the checkpoint at {self.directory}")
        return self._entries[name]


def _write_file(path: Path, tensors: list[tuple[str, np.ndarray]], metadata: Mapping[str, str]) -> None:
    header: dict = {"__metadata__": dict(metadata)}
    offset = 0
    for name, array in tensors:
        if array.dtype not in _CODES:
            raise ValueError(f"tensor {name!r}: dtype {array.dtype} has no safetensors code; known: {sorted(DTYPES)}")
        header[name] = {"dtype": _CODES[array.dtype], "shape": list(array.shape),
                        "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _, array in tensors:
            f.write(np.ascontiguousarray(array).tobytes())


def write_shards(directory: str | os.PathLike, tensors: Iterable[tuple[str, np.ndarray]], *,
                 max_shard_bytes: int = 4 << 30, metadata: Mapping[str, str] | None = None) -> dict[str, str]:
    """Write `(name, array)` pairs in order into shards of at most `max_shard_bytes` (a larger tensor gets a
    shard of its own) and the index; at most one shard's tensors are held at a time. Returns the weight map."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    metadata = {"format": "pt", **(metadata or {})}
    pending: list[tuple[str, np.ndarray]] = []
    shards: list[list[str]] = []
    size = 0

    def flush() -> None:
        nonlocal pending, size
        if pending:
            _write_file(directory / f"part-{len(shards):05d}.tmp", pending, metadata)
            shards.append([name for name, _ in pending])
            pending, size = [], 0

    seen: set[str] = set()
    for name, array in tensors:
        if name in seen:
            raise ValueError(f"tensor {name!r} is written twice")
        seen.add(name)
        array = np.asarray(array)
        if pending and size + array.nbytes > max_shard_bytes:
            flush()
        pending.append((name, array))
        size += array.nbytes
    flush()
    weight_map = {}
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        os.replace(directory / f"part-{i:05d}.tmp", directory / file)
        weight_map.update({name: file for name in names})
    total = sum(os.path.getsize(directory / f) for f in set(weight_map.values()))
    (directory / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return weight_map
