"""A checkpoint directory as a lazy tensor directory: the index plus every top-level `*.safetensors` header."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open

from common.errors import CheckpointError

INDEX_FILE = "model.safetensors.index.json"

_ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_LIST_LIMIT = 20


def name_list(names: Iterable[str]) -> str:
    names = sorted(names)
    shown = ", ".join(names[:_LIST_LIMIT])
    return f"{shown} (+{len(names) - _LIST_LIMIT} more)" if len(names) > _LIST_LIMIT else shown


# ----------------------------------------------------------------------------------------------------
# Files


def _read_header(path: Path) -> dict[str, dict]:
    """Tensor entries of a safetensors header, without touching the data."""
    with path.open("rb") as f:
        raw_len = f.read(8)
        if len(raw_len) != 8:
            raise CheckpointError(f"{path}: truncated safetensors file")
        (length,) = struct.unpack("<Q", raw_len)
        try:
            header = json.loads(f.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{path}: unreadable safetensors header ({exc})") from exc
    header.pop("__metadata__", None)
    return header


class CheckpointFiles:
    """Lazy name -> tensor directory over the index and every top-level `*.safetensors` file."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise CheckpointError(f"checkpoint directory {self.directory} does not exist")
        self._file: dict[str, Path] = {}
        self._entry: dict[str, dict] = {}
        self._handles: dict[Path, object] = {}
        indexed = self._read_index()
        files = sorted(self.directory.glob("*.safetensors"))
        missing_files = sorted({p.name for p in indexed.values()} - {p.name for p in files})
        if missing_files:
            raise CheckpointError(f"{INDEX_FILE} names shard files that do not exist: {missing_files}")
        if not files:
            raise CheckpointError(f"{self.directory}: no *.safetensors files")
        for path in files:
            for name, entry in _read_header(path).items():
                if name in self._file:
                    raise CheckpointError(f"tensor {name} is stored twice: {self._file[name].name} and {path.name}")
                if name in indexed and indexed[name] != path:
                    raise CheckpointError(f"tensor {name} is in {path.name} but the index says {indexed[name].name}")
                self._file[name] = path
                self._entry[name] = entry
        absent = [n for n in indexed if n not in self._file]
        if absent:
            raise CheckpointError(f"{INDEX_FILE} lists tensors missing from their shard: {name_list(absent)}")
        self.unindexed = sorted(n for n in self._file if indexed and n not in indexed)

    def _read_index(self) -> dict[str, Path]:
        path = self.directory / INDEX_FILE
        if not path.exists():
            return {}
        try:
            weight_map = json.loads(path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{path}: invalid index ({exc!r})") from exc
        return {name: self.directory / file for name, file in weight_map.items()}

    def names(self) -> list[str]:
        return sorted(self._file)

    def __contains__(self, name: str) -> bool:
        return name in self._file

    def _lookup(self, name: str) -> dict:
        if name not in self._entry:
            raise CheckpointError(f"tensor {name} is not in the checkpoint {self.directory}")
        return self._entry[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._lookup(name)["shape"])

    def dtype(self, name: str) -> torch.dtype:
        code = self._lookup(name)["dtype"]
        if code not in _ST_DTYPES:
            raise CheckpointError(f"tensor {name}: unsupported safetensors dtype {code}")
        return _ST_DTYPES[code]

    def nbytes(self, name: str) -> int:
        start, end = self._lookup(name)["data_offsets"]
        return end - start

    def file_of(self, name: str) -> Path:
        self._lookup(name)
        return self._file[name]

    def _handle(self, name: str):
        path = self.file_of(name)
        if path not in self._handles:
            self._handles[path] = safe_open(str(path), framework="pt")
        return self._handles[path]

    def get(self, name: str) -> torch.Tensor:
        return self._handle(name).get_tensor(name)

    def read_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Rows `[start, stop)` along `dim`, read lazily: only those bytes leave the file."""
        return self._handle(name).get_slice(name)[(slice(None),) * dim + (slice(start, stop),)]

    def close(self) -> None:
        self._handles.clear()
