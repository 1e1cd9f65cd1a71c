"""A GGUF file's tensors as the file holds them (raw blocks), checked before any is used.

``gguf.GGUFReader`` maps the file and exposes each tensor's bytes; a file cut short fails there with a bare
numpy reshape error, so the byte range of every tensor is checked first, and the fp16 scales of every
quantized block are checked to be finite. Either failure raises ``CorruptModel`` naming the tensor: the worker
exits with it and the engine answers FAILED_PRECONDITION, while its other models keep serving.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, dequantize
from gguf.gguf_reader import ReaderField, ReaderTensor

_SCALE_BYTES = {GGMLQuantizationType.Q4_1: 4, GGMLQuantizationType.Q8_0: 2,
                GGMLQuantizationType.Q4_0: 2, GGMLQuantizationType.Q5_0: 2, GGMLQuantizationType.Q5_1: 4}


class CorruptModel(ValueError):
    """The GGUF file cannot be used as it is; the message names the tensor."""


class _CheckedReader(GGUFReader):
    def _get(self, offset: int, dtype: npt.DTypeLike, count: int = 1,
             override_order: None | Literal["I", "S", "<"] = None) -> npt.NDArray[Any]:
        """``GGUFReader._get`` on a plain ndarray view of the mapping: slicing the ``np.memmap`` itself costs
        most of the time of a field, and SmolLM2's tokenizer metadata is ~150,000 fields: the file opened in
        17 s with the memmap, 3 s with the view (2 contended cores)."""
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self._plain = self.data.view(np.ndarray)
        count = int(count)
        arr = plain[offset:offset + np.dtype(dtype).itemsize * count].view(dtype=dtype)[:count]
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    def _build_tensors(self, start_offs: int, fields: list[ReaderField]) -> None:
        size = len(self.data)
        for field in fields:
            _name_len, name_data, _n_dims, dims, raw_dtype, offset = field.parts
            name = bytes(name_data).decode("utf-8", "replace")
            try:
                qtype = GGMLQuantizationType(int(raw_dtype[0]))
            except ValueError:
                raise CorruptModel(f"tensor {name}: unknown GGML type {int(raw_dtype[0])}") from None
            block, type_size = GGML_QUANT_SIZES[qtype]
            end = start_offs + int(offset[0]) + int(np.prod(dims)) * type_size // block
            if end > size:
                raise CorruptModel(f"tensor {name}: truncated, its blocks end {end - size} bytes past the end "
                                   f"of the file ({size} bytes)")
        super()._build_tensors(start_offs, fields)


class GGUFWeights:
    def __init__(self, path: Path):
        try:
            self._reader = _CheckedReader(path)
        except CorruptModel as exc:
            raise CorruptModel(f"{path.name}: {exc}") from None
        except (ValueError, KeyError, IndexError, OSError) as exc:
            raise CorruptModel(f"{path.name}: not a readable GGUF file: {exc}") from None
        self.path = path
        self.tensors: dict[str, ReaderTensor] = {t.name: t for t in self._reader.tensors}

    def close(self) -> None:
        """Drop the file mapping (everything kept was copied out of it)."""
        self.tensors.clear()
        self._reader = None  # type: ignore[assignment]

    def has(self, name: str) -> bool:
        return name in self.tensors

    def matrix(self, name: str) -> tuple[np.ndarray, GGMLQuantizationType, int, int]:
        """A 2-D tensor [n, k] as (its rows of raw blocks [n, bytes per row] (a view of the file), type, n, k)."""
        t = self._get(name)
        if len(t.shape) != 2:
            raise CorruptModel(f"tensor {name}: expected 2 dimensions, the file has {len(t.shape)}")
        k, n = (int(d) for d in t.shape)
        blocks = np.asarray(t.data).reshape(n, -1)
        if blocks.dtype != np.uint8:
            blocks = blocks.view(np.uint8).reshape(n, -1)
        scale = _SCALE_BYTES.get(t.tensor_type)
        if scale is not None:
            size = GGML_QUANT_SIZES[t.tensor_type][1]
            scales = blocks.reshape(-1, size)[:, :scale].copy().view(np.float16)
            bad = ~np.isfinite(scales)
            if bad.any():
                first = int(np.argmax(bad.any(axis=1)))
                raise CorruptModel(f"tensor {name}: corrupt blocks: {int(bad.any(axis=1).sum())} have a non-finite "
                                   f"fp16 scale (the first is block {first} of {scales.shape[0]})")
        return blocks, t.tensor_type, n, k

    def vector(self, name: str) -> torch.Tensor:
        """A 1-D tensor (a norm's weights) in fp32."""
        t = self._get(name)
        values = dequantize(np.asarray(t.data), t.tensor_type).reshape(-1).astype(np.float32)
        if not np.isfinite(values).all():
            raise CorruptModel(f"tensor {name}: non-finite values")
        return torch.from_numpy(values.copy())

    def _get(self, name: str) -> ReaderTensor:
        t = self.tensors.get(name)
        if t is None:
            raise CorruptModel(f"{self.path.name}: tensor {name} is missing")
        return t
