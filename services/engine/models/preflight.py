"""The cheap checks a model's files pass before the engine makes room for it (evicts anything).

``check_model_files(entry)`` raises ``FailedPrecondition`` naming the file and what is wrong when a
model cannot possibly load: the file or directory is missing, a GGUF header does not parse or its
tensors' data runs past the end of the file (a truncated copy), a ``config.json`` is not JSON, a
safetensors file's header is unreadable or does not cover its tensors. It reads headers only (a
few milliseconds, no weights), so it runs on every cold load. What it cannot see (weights that
parse but are nonsense, an architecture the worker does not know) still fails in the worker, and the
load guard (``load_guard.py``) remembers that failure.

The GGUF walk is ours because ``gguf.GGUFReader`` materialises every metadata value (tens of
thousands of tokenizer strings: seconds on this machine); the format constants and the quantisation
block sizes come from the ``gguf`` package.
"""
from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path

from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType
from safetensors import SafetensorError, safe_open

from services.common.errors import FailedPrecondition
from services.common.model_source import ModelSource, resolve_model
from services.engine.models.store import ModelEntry

# Byte sizes of the fixed-size GGUF metadata value types.
_SCALAR_SIZES = {GGUFValueType.UINT8: 1, GGUFValueType.INT8: 1, GGUFValueType.BOOL: 1,
                 GGUFValueType.UINT16: 2, GGUFValueType.INT16: 2,
                 GGUFValueType.UINT32: 4, GGUFValueType.INT32: 4, GGUFValueType.FLOAT32: 4,
                 GGUFValueType.UINT64: 8, GGUFValueType.INT64: 8, GGUFValueType.FLOAT64: 8}
_ALIGNMENT_KEY = b"general.alignment"


class _Truncated(ValueError):
    pass


def check_model_files(entry: ModelEntry) -> None:
    """Raise ``FailedPrecondition`` when ``entry``'s files cannot load; return when they look whole."""
    try:
        source = resolve_model(entry.source)
    except FileNotFoundError as exc:
        raise FailedPrecondition(f"model {entry.name} cannot be loaded: {exc}") from None
    try:
        _check(source)
    except (OSError, ValueError) as exc:
        raise FailedPrecondition(f"model {entry.name} cannot be loaded: {exc}; the file is corrupt or "
                                 "incomplete (copy it again), nothing was evicted for it") from None


def _check(source: ModelSource) -> None:
    if source.format == "gguf":
        check_gguf(source.path)
        return
    config = source.path / "config.json"
    try:
        json.loads(config.read_text())
    except ValueError as exc:
        raise ValueError(f"{config} is not valid JSON ({exc})") from None
    for weights in sorted(source.path.glob("*.safetensors")):
        check_safetensors(weights)


def check_safetensors(path: Path) -> None:
    """The safetensors library checks that the header parses and covers every tensor's bytes."""
    try:
        with safe_open(str(path), framework="numpy"):
            pass
    except SafetensorError as exc:
        raise ValueError(f"{path}: {exc}") from None


def check_gguf(path: Path) -> None:
    """Walk a GGUF file's header (metadata, tensor infos) and check every tensor's data lies in the file."""
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if size < 24:
            raise ValueError(f"{path}: {size} bytes is too short for a GGUF header")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            try:
                _walk_gguf(buf, size, path)
            except (_Truncated, struct.error):
                raise ValueError(f"{path}: the GGUF header ends early (truncated at {size} bytes)") from None


def _walk_gguf(buf: mmap.mmap, size: int, path: Path) -> None:
    magic, version, n_tensors, n_kv = struct.unpack_from("<IIQQ", buf, 0)
    if magic != GGUF_MAGIC:
        raise ValueError(f"{path}: not a GGUF file (magic {magic:#x})")
    if version < 2:
        raise ValueError(f"{path}: GGUF version {version} is not supported")
    pos = 24
    alignment = GGUF_DEFAULT_ALIGNMENT

    def string(at: int) -> tuple[bytes, int]:
        (n,) = struct.unpack_from("<Q", buf, at)
        if at + 8 + n > size:
            raise _Truncated
        return buf[at + 8:at + 8 + n], at + 8 + n

    def skip_value(kind: int, at: int) -> int:
        if kind == GGUFValueType.STRING:
            return string(at)[1]
        if kind == GGUFValueType.ARRAY:
            item, count = struct.unpack_from("<IQ", buf, at)
            at += 12
            if item in _SCALAR_SIZES:
                return at + count * _SCALAR_SIZES[GGUFValueType(item)]
            for _ in range(count):
                at = skip_value(item, at)
            return at
        if kind not in _SCALAR_SIZES:
            raise ValueError(f"{path}: unknown GGUF metadata type {kind}")
        return at + _SCALAR_SIZES[GGUFValueType(kind)]

    for _ in range(n_kv):
        key, pos = string(pos)
        (kind,) = struct.unpack_from("<I", buf, pos)
        if key == _ALIGNMENT_KEY and kind == GGUFValueType.UINT32:
            (alignment,) = struct.unpack_from("<I", buf, pos + 4)
        pos = skip_value(kind, pos + 4)
        if pos > size:
            raise _Truncated
    tensors = []
    for _ in range(n_tensors):
        name, pos = string(pos)
        (n_dims,) = struct.unpack_from("<I", buf, pos)
        dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
        kind, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        tensors.append((name.decode(errors="replace"), dims, kind, offset))
    data_start = -(-pos // alignment) * alignment
    for name, dims, kind, offset in tensors:
        try:
            block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
        except (ValueError, KeyError):
            raise ValueError(f"{path}: tensor {name} has unknown GGML type {kind}") from None
        elements = 1
        for d in dims:
            elements *= d
        end = data_start + offset + elements // block * block_bytes
        if end > size:
            raise ValueError(f"{path}: tensor {name} needs bytes up to {end}, but the file has only {size} "
                             "(truncated)")
