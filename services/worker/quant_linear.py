"""A weight matrix kept in its GGUF blocks (Q4_1, Q8_0) and multiplied by the C++ block kernels.

``y = x @ W.T`` for fp32 ``x`` [..., k], ``W`` [n, k] given as the file's raw blocks (one row of ``n`` is
``k / 32`` blocks). At load the blocks are repacked into the kernels' 16-row vertical tiles (``kernels/blocks.h``);
the matrix then holds only those bytes (Q4_1: 20 bytes per 32 weights, 5/8 of a byte a weight).

- with the kernels (AVX-512 VNNI or AVX2 builds, the same bits): every row count runs the block kernel, each
  activation row quantized per 32-block to 12 bits held in int16 (integer dot products, rounding 2^-12 of each
  block's largest value; docs/performance.md compares int16, llama.cpp's int8 and fp32 activations), so a row's
  result never depends on how many rows share the call. Prefill chunks too: in the avx512 build vpdpwssd multiplies as many pairs an
  instruction as bf16's vdpbf16ps (at 128-512 rows 2.2-2.9x torch's fp32 matmul over the dequantized matrix;
  from 16 rows on AMX tiles where the CPU has them, the same bits: kernels/amx.h); in the avx2 build 1.25-1.9x
  that matmul at 128-512 rows (Zen 3);
- where the kernels cannot run (no AVX2/FMA/F16C, no compiler, ``$LLMSERVE_QUANT_KERNELS=0``): the matrix
  is dequantized once to ``fallback_dtype`` and ``F.linear`` runs (the portable path).
"""
from __future__ import annotations

import logging

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, dequantize

from services.worker import huge_pages, kernels

log = logging.getLogger("llmserve.worker.quant")

BLOCK = 32
NATIVE_TYPES = {GGMLQuantizationType.Q4_1: "q4_1", GGMLQuantizationType.Q8_0: "q8_0"}
_BLOCK_BYTES = {GGMLQuantizationType.Q4_1: 20, GGMLQuantizationType.Q8_0: 34}
PREFILL_ROWS = 64      # the most rows the one-call native step runs (native_step.py)
TILE = 16              # rows a tile (kernels/blocks.h)


def repack(blocks: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """GGUF rows of blocks [n, k/32 · block bytes] → the kernels' layout (blocks.h): rows in tiles of 16 (the last
    padded with zero rows); per tile and block, 16 d (Q4_1: then 16 m), then 16-bit words w[chunk][t = 2j + e]
    holding weight 2p + e of row j for the chunk's pairs p: Q4_1 one nibble a pair (p = 4c + s in bits 4s..4s+3),
    Q8_0 one byte (p = 2c low, 2c + 1 high)."""
    n, row_bytes = blocks.shape
    size = _BLOCK_BYTES[qtype]
    nb = row_bytes // size
    pad = (-n) % TILE
    b = np.concatenate([blocks, np.zeros((pad, row_bytes), np.uint8)]) if pad else blocks
    b = b.reshape(-1, TILE, nb, size).transpose(0, 2, 1, 3)                # [tiles, nb, rows, block]
    tiles = b.shape[0]
    if qtype == GGMLQuantizationType.Q4_1:
        scales = b[..., :4].reshape(tiles, nb, 16, 2, 2).transpose(0, 1, 3, 2, 4).reshape(tiles, nb, 64)
        qs = b[..., 4:20]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.uint16)     # [tiles, nb, 16 j, 32 k]
        q = q.reshape(tiles, nb, 16, 4, 4, 2)                                   # k = 8c + 2s + e → [j, c, s, e]
        words = q[..., 0, :] | q[..., 1, :] << 4 | q[..., 2, :] << 8 | q[..., 3, :] << 12   # [tiles, nb, j, c, e]
    else:
        scales = b[..., :2].reshape(tiles, nb, 32)
        q = b[..., 2:34].astype(np.uint16).reshape(tiles, nb, 16, 8, 2, 2)      # k = 4c + 2h + e → [j, c, h, e]
        words = q[..., 0, :] | q[..., 1, :] << 8                               # [tiles, nb, j, c, e]
    words = words.transpose(0, 1, 3, 2, 4).astype("<u2")                        # [tiles, nb, c, j, e]
    out = np.concatenate([scales, words.reshape(tiles, nb, -1).view(np.uint8)], axis=-1)
    return np.ascontiguousarray(out.reshape(-1))


class QuantLinear:
    """``y = x @ W.T`` over a GGUF-quantized ``W`` [n, k]; fp32 in, fp32 out."""

    def __init__(self, blocks: np.ndarray, qtype: GGMLQuantizationType, n: int, k: int,
                 fallback_dtype: torch.dtype = torch.float32, isa: str | None = None):
        """``blocks``: [n, k / 32 · block bytes] uint8, the tensor's bytes as the file has them; ``isa``: the
        kernel build (``kernels.QUANT_BUILDS``; default the one this machine runs)."""
        self.out_features, self.in_features, self.qtype = n, k, qtype
        self._lib = None
        if qtype in NATIVE_TYPES and k % BLOCK == 0:
            self._lib = kernels.quant_build(isa) if isa else kernels.quant_library()
        if self._lib is None:
            self.packed = None
            self.weight = torch.from_numpy(dequantize(blocks, qtype).reshape(n, k)).to(fallback_dtype)
            return
        self.weight = None
        assert self._lib.llmserve_quant_tile_rows() == TILE
        self.packed = torch.from_numpy(repack(blocks, qtype))
        self.padded_rows = n + (-n) % TILE               # the kernels' n: whole tiles (also their output's width)
        name = NATIVE_TYPES[qtype]
        self._matmul = getattr(self._lib, f"llmserve_{name}_matmul_i16")
        self._dequant = getattr(self._lib, f"llmserve_{name}_dequant_rows")

    @property
    def library(self):
        """The kernel build this matrix's blocks are laid out for (None: dequantized)."""
        return self._lib

    @property
    def native(self) -> bool:
        return self.packed is not None

    def held_bytes(self) -> int:
        t = self.packed if self.packed is not None else self.weight
        return t.numel() * t.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x.to(self.weight.dtype), self.weight).to(x.dtype)
        flat = x.reshape(-1, self.in_features)
        if flat.dtype != torch.float32 or flat.stride(-1) != 1:
            flat = flat.float().contiguous()
        m = flat.shape[0]
        y = torch.empty(m, self.padded_rows, dtype=torch.float32)
        self._matmul(self.packed.data_ptr(), self.padded_rows, self.in_features, flat.data_ptr(), flat.stride(0), m,
                     y.data_ptr(), self.padded_rows)
        if self.padded_rows != self.out_features:
            y = y[:, :self.out_features]
        return y.view(*x.shape[:-1], self.out_features)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of ``W``, dequantized to fp32 [len(ids), k] (an embedding lookup)."""
        if self.packed is None:
            return self.weight[ids].float()
        ids = ids.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty(ids.numel(), self.in_features, dtype=torch.float32)
        self._dequant(self.packed.data_ptr(), self.in_features, ids.data_ptr(), ids.numel(), out.data_ptr())
        return out

    def dequantized(self) -> torch.Tensor:
        """All of ``W`` in fp32 (for checks against the file's blocks)."""
        return self.rows(torch.arange(self.out_features, dtype=torch.int64))


def gather(matrices: list[QuantLinear]) -> None:
    """Moves the native matrices' blocks into one mapping with huge pages asked for (``huge_pages.zeros``), in the
    order given (the step's): a one-row decode streams every matrix from memory once a step, and with 4 KiB
    pages each 0.2-1.1 MB matrix starts cold in the TLB (docs/performance.md)."""
    native = [m for m in matrices if m.packed is not None]
    align = 4096
    size = sum(-(-m.packed.numel() // align) * align for m in native)
    if not size:
        return
    arena = huge_pages.zeros(size)
    offset = 0
    for m in native:
        n = m.packed.numel()
        arena[offset:offset + n] = m.packed
        m.packed = arena[offset:offset + n]
        offset += -(-n // align) * align
