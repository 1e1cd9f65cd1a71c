"""A weight matrix kept in its GGUF blocks (Q4_1, Q8_0) and multiplied by the C++ block kernels.

``y = x @ W.T`` for fp32 ``x`` [..., k], ``W`` [n, k] given as the file's raw blocks (one row of ``n`` is
``k / 32`` blocks). At load the blocks are repacked into the kernel build's tiles (``kernels/blocks.h``
describes both layouts: 16-row vertical tiles for AVX-512 VNNI, 4-row tiles for AVX2); the matrix then holds
only those bytes (Q4_1: 20 bytes per 32 weights, 5/8 of a byte a weight).

- up to ``PREFILL_ROWS`` rows (decode steps, batched decode): the block kernel, activations quantized per
  32-block to int16 (``ACTIVATIONS`` = "int16", the default: integer dot products, rounding 2^-16 of each
  block's largest value), to int8 ("int8", llama.cpp's Q8_1) or kept in fp32 ("float32"), those two in the
  AVX2 build only; docs/performance.md measures the three;
- more rows (prefill chunks): in the avx512 build the same int16 kernel (vpdpwssd multiplies as many pairs an
  instruction as bf16's vdpbf16ps: at 128-512 rows 2.2-2.9x torch's fp32 matmul over the dequantized matrix;
  from 16 rows on AMX tiles where the CPU has them, the same bits: kernels/amx.h);
  in the avx2 build the matrix dequantized to fp32 into a scratch buffer shared by every matrix, then torch's
  fp32 matmul (at hundreds of rows the product is compute-bound, and the dequantization costs ~1/rows of it);
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
_SCALE_BYTES = {GGMLQuantizationType.Q4_1: 4, GGMLQuantizationType.Q8_0: 2}   # fp16 d (and m) per block
PREFILL_ROWS = 64
ACTIVATIONS = "int16"


def repack(blocks: np.ndarray, qtype: GGMLQuantizationType, tile: int = 4) -> np.ndarray:
    """GGUF rows of blocks [n, k/32 · block bytes] → the kernels' layout: rows in tiles of ``tile`` (the last
    padded with zero rows); per tile and block index, the rows' fp16 scales (Q4_1: the d, then the m), then their
    quants: 4-row tiles row by row, 16-row tiles in the vertical order (``repack_vertical``)."""
    n, row_bytes = blocks.shape
    size, scale = _BLOCK_BYTES[qtype], _SCALE_BYTES[qtype]
    nb = row_bytes // size
    pad = (-n) % tile
    b = np.concatenate([blocks, np.zeros((pad, row_bytes), np.uint8)]) if pad else blocks
    b = b.reshape(-1, tile, nb, size).transpose(0, 2, 1, 3)                # [tiles, nb, rows, block]
    if tile == 16:
        return repack_vertical(b, qtype)
    assert tile == 4, tile
    if qtype == GGMLQuantizationType.Q4_1:
        scales = b[..., :4].reshape(*b.shape[:2], 4, 2, 2).transpose(0, 1, 3, 2, 4)   # [tiles, nb, (d|m), 4, 2]
    else:
        scales = b[..., :2]
    out = np.concatenate([scales.reshape(*b.shape[:2], -1), b[..., scale:].reshape(*b.shape[:2], -1)], axis=-1)
    return np.ascontiguousarray(out.reshape(-1))


def repack_vertical(b: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """Blocks [tiles, nb, 16 rows, block bytes] → the AVX-512 build's layout (blocks.h): per tile and block, 16 d
    (Q4_1: then 16 m), then 16-bit words w[chunk][t = 2j + e] holding weight 2p + e of row j for the chunk's
    pairs p: Q4_1 one nibble a pair (p = 4c + s in bits 4s..4s+3), Q8_0 one byte (p = 2c low, 2c + 1 high)."""
    tiles, nb = b.shape[:2]
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

    _scratch = torch.empty(0)      # the prefill path's dequantized matrix, shared (one matmul runs at a time)

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
        self.tile = self._lib.llmserve_quant_tile_rows()
        self.packed = torch.from_numpy(repack(blocks, qtype, self.tile))
        self.padded_rows = n + (-n) % self.tile          # the kernels' n: whole tiles (also their output's width)
        # past PREFILL_ROWS rows the avx2 build's tiles lose to torch's fp32 matmul over the dequantized matrix;
        # the avx512 build's (vpdpwssd) win at any row count
        self._prefill_dequantized = self.tile == 4
        name = NATIVE_TYPES[qtype]
        self._i8 = getattr(self._lib, f"llmserve_{name}_matmul_i8", None)       # the avx2 build's schemes
        self._f32 = getattr(self._lib, f"llmserve_{name}_matmul_f32", None)
        self._i16 = getattr(self._lib, f"llmserve_{name}_matmul_i16")
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

    def __call__(self, x: torch.Tensor, activations: str | None = None) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x.to(self.weight.dtype), self.weight).to(x.dtype)
        flat = x.reshape(-1, self.in_features)
        if flat.dtype != torch.float32 or flat.stride(-1) != 1:
            flat = flat.float().contiguous()
        m = flat.shape[0]
        if m > PREFILL_ROWS and activations is None and self._prefill_dequantized:
            y = F.linear(flat, self.dequantized())
        else:
            y = torch.empty(m, self.padded_rows, dtype=torch.float32)
            scheme = activations or ACTIVATIONS
            if scheme != "int16" and self._i8 is None:
                raise ValueError(f"{scheme} activations: only the avx2 build of the block kernels has them")
            if scheme == "int8":
                xq, xd, xs = quantize_q8(flat)
                self._i8(self.packed.data_ptr(), self.padded_rows, self.in_features, xq.data_ptr(), xd.data_ptr(),
                         xs.data_ptr(), m, y.data_ptr(), self.padded_rows)
            else:
                matmul = self._i16 if scheme == "int16" else self._f32
                matmul(self.packed.data_ptr(), self.padded_rows, self.in_features, flat.data_ptr(), flat.stride(0),
                       m, y.data_ptr(), self.padded_rows)
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
        """All of ``W`` in fp32, in the shared scratch buffer (valid until the next call on any matrix): the avx2
        build's prefill path (the avx512 build's prefill runs the block kernel)."""
        size = self.out_features * self.in_features
        if QuantLinear._scratch.numel() < size:
            QuantLinear._scratch = torch.empty(size, dtype=torch.float32)
        out = QuantLinear._scratch[:size].view(self.out_features, self.in_features)
        ids = torch.arange(self.out_features, dtype=torch.int64)
        self._dequant(self.packed.data_ptr(), self.in_features, ids.data_ptr(), self.out_features, out.data_ptr())
        return out


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


def quantize_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 rows [m, k] → per 32-block int8 quants [m, k], scales [m, k/32], scale · Σquants [m, k/32]."""
    lib = kernels.quant_build("avx2")
    assert lib is not None
    m, k = x.shape
    xq = torch.empty(m, k, dtype=torch.int8)
    xd = torch.empty(m, k // BLOCK, dtype=torch.float32)
    xs = torch.empty(m, k // BLOCK, dtype=torch.float32)
    lib.llmserve_quantize_q8(x.data_ptr(), x.stride(0), m, k, xq.data_ptr(), xd.data_ptr(), xs.data_ptr())
    return xq, xd, xs


