"""Fingerprints of a checkpoint, read from its files (no torch, no weights loaded).

* `model_fingerprint(checkpoint, dtype)`: what the decode prefix cache and the Redis KV-prefix keys carry.
  SHA-256 over the model config, the compute dtype, the index file, and per `*.safetensors` file its name,
  size, raw header and `SAMPLE_WINDOWS` evenly spread windows of its data. Two checkpoints with the same
  config but different weights differ in (practically) every window, so they never share cached KV; the
  cost is a few hundred KiB of reads per shard, however large the checkpoint.
* `encoder_fingerprint_of(checkpoint, dtype)`: identifies the towers in every `mm_key`. The tower
  configs, the compute dtype, and a digest of every tower tensor's stored bytes (dtype, shape, data). The
  encoder and the decode replicas' encoder client compute it the same way, so a decode replica derives
  `mm_key`s without loading the towers.

`config_fingerprint` is the fallback of engines built from tensors rather than a checkpoint (tests).
The first two are computed once per process and checkpoint (cached on the files' sizes and modification times).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any

from common.config import load_model_config
from common.errors import CheckpointError
from common.hashing import canonical_encoding, encoder_fingerprint, tensor_digest

MODEL_FINGERPRINT_VERSION = "inkling-epd/model_fingerprint/v1"
ENCODER_INPUT_VERSION = "inkling-epd/encoder_fingerprint/files/v1"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
SAMPLE_WINDOWS = 64
WINDOW_BYTES = 4096
TOWER_PREFIXES = ("model.visual.", "model.audio.")
OUTPUT_DTYPE = "bfloat16"  # rows on the wire (common.wire)


def read_safetensors_header(path: Path) -> tuple[bytes, int]:
    """(raw JSON header, offset of the data section) of a safetensors file."""
    with path.open("rb") as f:
        raw_len = f.read(8)
        if len(raw_len) != 8:
            raise CheckpointError(f"{path}: truncated safetensors file")
        (length,) = struct.unpack("<Q", raw_len)
        header = f.read(length)
    if len(header) != length:
        raise CheckpointError(f"{path}: truncated safetensors header")
    return header, 8 + length


def _shards(directory: Path) -> list[Path]:
    shards = sorted(directory.glob("*.safetensors"))
    if not shards:
        raise CheckpointError(f"{directory}: no *.safetensors files")
    return shards


def _stamp(directory: Path) -> tuple:
    """What the cache of a fingerprint is keyed on: every relevant file's name, size and mtime."""
    files = [*_shards(directory), directory / CONFIG_FILE, directory / INDEX_FILE]
    return tuple((p.name, st.st_size, st.st_mtime_ns) for p in files if (st := _stat(p)) is not None)


def _stat(path: Path) -> os.stat_result | None:
    try:
        return path.stat()
    except FileNotFoundError:
        return None


def _read_optional(path: Path) -> bytes:
    return path.read_bytes() if path.exists() else b""


def _windows(path: Path, start: int, end: int) -> bytes:
    """SHA-256 of `SAMPLE_WINDOWS` windows spread evenly over `[start, end)` of a file (all of it if small)."""
    h = hashlib.sha256()
    size = end - start
    with path.open("rb") as f:
        if size <= SAMPLE_WINDOWS * WINDOW_BYTES:
            f.seek(start)
            h.update(f.read(size))
            return h.digest()
        step = (size - WINDOW_BYTES) / (SAMPLE_WINDOWS - 1)
        for i in range(SAMPLE_WINDOWS):
            f.seek(start + int(i * step))
            h.update(f.read(WINDOW_BYTES))
    return h.digest()


def model_fingerprint(checkpoint: str | Path, dtype: str) -> bytes:
    """32 bytes naming the decoder's KV: config, compute dtype and the weights (sampled, see the module doc)."""
    directory = Path(checkpoint).resolve()
    return _model_fingerprint(directory, dtype, _stamp(directory))


@functools.lru_cache(maxsize=8)
def _model_fingerprint(directory: Path, dtype: str, stamp: tuple) -> bytes:
    h = hashlib.sha256()
    h.update(canonical_encoding(MODEL_FINGERPRINT_VERSION))
    h.update(canonical_encoding(_config_json(directory)))
    h.update(canonical_encoding(dtype))
    h.update(canonical_encoding(_read_optional(directory / INDEX_FILE)))
    for shard in _shards(directory):
        header, data_start = read_safetensors_header(shard)
        size = shard.stat().st_size
        h.update(canonical_encoding([shard.name, size, header, _windows(shard, data_start, size)]))
    return h.digest()


def config_fingerprint(config_fields: dict, dtype: str) -> bytes:
    """The fallback of an engine built without a checkpoint directory (tests): config and cache dtype only."""
    return hashlib.sha256(json.dumps(config_fields, sort_keys=True).encode() + dtype.encode()).digest()


def _config_json(directory: Path) -> Any:
    path = directory / CONFIG_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: cannot read the model config ({exc})") from exc


def encoder_fingerprint_of(checkpoint: str | Path, dtype: str) -> bytes:
    """32 bytes naming the towers: their configs, the compute dtype and every tower tensor's stored bytes."""
    directory = Path(checkpoint).resolve()
    return _encoder_fingerprint(directory, dtype, _stamp(directory))


@functools.lru_cache(maxsize=8)
def _encoder_fingerprint(directory: Path, dtype: str, stamp: tuple) -> bytes:
    config = load_model_config(directory)
    digests: dict[str, bytes] = {}
    for shard in _shards(directory):
        header, data_start = read_safetensors_header(shard)
        entries = json.loads(header)
        with shard.open("rb") as f:
            for name, entry in sorted(entries.items()):
                if not name.startswith(TOWER_PREFIXES):
                    continue
                begin, end = entry["data_offsets"]
                f.seek(data_start + begin)
                digests[name] = tensor_digest(entry["dtype"], entry["shape"], f.read(end - begin))
    fields = {
        "version": ENCODER_INPUT_VERSION,
        "vision": dataclasses.asdict(config.vision) if config.vision else None,
        "audio": dataclasses.asdict(config.audio) if config.audio else None,
        "compute_dtype": dtype,
        "output_dtype": OUTPUT_DTYPE,
    }
    return encoder_fingerprint(fields, digests)
