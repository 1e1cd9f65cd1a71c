"""The native path's glue and attention in C++ (``kernels/native_ops.cpp``, fp32: AVX2 + FMA, and in the quant
library's avx512 build the decode attention in 512-bit vectors; prefill chunks ``kernels/native_prefill.cpp``,
AVX-512 BF16).

``layer_ops.py`` and ``attention_kernel.py`` fuse the same work for bfloat16, with AVX-512 BF16; on a CPU with
only AVX2 (and on the native path, whose activations are fp32) they run torch's ops, and at batch 1 those ops
cost most of a native step: ~40 tensor ops a layer, each ~5-20 µs of dispatch for a few hundred numbers. These
classes have the same interfaces and run the same math in one call each:

- ``NativeLayerOps``: residual add + RMSNorm, rotary embedding + KV write, SiLU · up;
- ``NativeAttention``: a step's rows over their paged context, read in place through the block tables (the native
  KV pool is fp16, or fp16 keys with int8 values; fp32 works too): decode rows one query each, prefill chunks in 16-row tiles (the avx512
  build on an AVX-512 BF16 CPU; elsewhere each query of a prefill chunk is a decode row of its own).

Only the native path uses them: the float32 path is the exactness path (its greedy outputs equal plain
transformers'), and these kernels round differently from torch's ops (fused sums, a polynomial e^x). Where the
AVX2 library cannot run, ``for_model`` / ``load`` give torch's ops and SDPA.
"""
from __future__ import annotations

import ctypes

import torch

from services.worker import kernels
from services.worker.layer_ops import LayerOps


# the C functions' prefix for each (keys, values) element type of the KV pool (int8 values: q8, the avx512 build)
_KV = {(torch.float32, torch.float32): "f32", (torch.float16, torch.float16): "f16", (torch.float16, torch.int8): "f16q8"}


def _kv_function(lib: ctypes.CDLL, name: str, k_cache: torch.Tensor, v_cache: torch.Tensor):  # type: ignore[no-untyped-def]
    return getattr(lib, f"llmserve_{_KV[k_cache.dtype, v_cache.dtype]}_{name}")


def _library(hidden: int, head_dim: int, intermediate: int) -> ctypes.CDLL | None:
    fits = hidden % 8 == 0 and head_dim % 16 == 0 and head_dim <= 256 and intermediate % 8 == 0
    return kernels.quant_library() if fits else None


class NativeLayerOps(LayerOps):
    """``LayerOps`` over fp32 CPU tensors with the AVX2 kernels (torch's ops where ``lib`` is None)."""

    @classmethod
    def for_native(cls, hidden: int, head_dim: int, intermediate: int) -> LayerOps:
        lib = _library(hidden, head_dim, intermediate)
        return cls(lib) if lib is not None else LayerOps(None)

    def add_rms_norm(self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        out = torch.empty(h.shape[0], h.shape[1], dtype=torch.float32)
        self._lib.llmserve_f32_add_rms_norm(   # type: ignore[union-attr]
            h.data_ptr(), h.stride(0), None if delta is None else delta.data_ptr(),
            0 if delta is None else delta.stride(0), weight.data_ptr(), out.data_ptr(), h.shape[0], h.shape[1], eps)
        return out

    def rope_store(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
                   head_dim: int, slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        cos, sin = cos.contiguous(), sin.contiguous()
        store = _kv_function(self._lib, "rope_store", k_cache, v_cache)   # type: ignore[arg-type]
        store(
            qkv.data_ptr(), qkv.stride(0), qkv.shape[0], heads, kv_heads, head_dim, cos.data_ptr(), sin.data_ptr(),
            slots.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr())

    def silu_mul(self, gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
        out = torch.empty(gate_up.shape[0], intermediate, dtype=torch.float32)
        self._lib.llmserve_f32_silu_mul(gate_up.data_ptr(), out.data_ptr(), gate_up.shape[0],  # type: ignore[union-attr]
                                        intermediate)
        return out


class NativeAttention:
    """The native path's attention with ``AttentionKernel``'s call, over the paged fp16 (fp16 keys and int8 values, or
    fp32) KV pool read in place through the block tables, fp32 queries and outputs:

    - ``kernel(q, None, k_cache, v_cache, tables, lens, block_size, scale, out)``: decode rows, one query each
      (``kernels/native_ops.cpp``, fp32 FMAs; row b reads table b), split into parts by each row's own length only,
      so a row gives the same bits whatever else the step holds;
    - ``kernel.chunks(...)``, where ``prefill`` is True: a step with prefill chunks, its decode rows and each query
      of a speculative draft row by the decode kernel above (the same bits as in a decode-only step), its chunks by
      ``kernels/native_prefill.cpp``: tiles of 16 query rows sharing each key and value read, the products in bf16
      by ``vdpbf16ps`` with fp32 sums (q, k, v and the softmax weights rounded to bf16, as the bfloat16 path's
      kernel rounds them; docs/performance.md: ~3x SDPA a layer, and why bf16 products rather than fp32); where
      the CPU has AMX (``tiles``) the same bf16 products on its tile registers, 32 keys or dims a product.

    ``prefill`` is False in the quant library's avx2 build (``LLMSERVE_QUANT_ISA=avx2``, or a CPU without AVX-512)
    and on a CPU without AVX-512 BF16: then ``StepLayout`` gives every query of a prefill chunk to the decode kernel
    as a row of its own over its causal context (the model runner's log line says which), so a position's bits do
    not depend on the chunk, the cache or the batch there either.
    """

    def __init__(self, lib: ctypes.CDLL):
        self._lib = lib
        # runs prefill chunks (StepLayout gives it every step); else each chunk's queries run as decode rows
        self.prefill = hasattr(lib, "llmserve_f16_paged_prefill") and bool(lib.llmserve_native_prefill_ok())
        self.tiles = self.prefill and bool(lib.llmserve_native_prefill_amx(1))   # the chunks' products on AMX tiles
        # q8 values in the KV pool (each head's int8 values and fp32 scale; --kv-cache-dtype int8-values) run where
        # every step's attention runs here: the avx512 build's decode and prefill kernels (no SDPA step reads them)
        self.q8 = self.prefill and hasattr(lib, "llmserve_f16q8_paged_decode")

    @classmethod
    def load(cls, hidden: int, head_dim: int, intermediate: int) -> "NativeAttention | None":
        lib = _library(hidden, head_dim, intermediate)
        return cls(lib) if lib is not None else None

    def __call__(self, q: torch.Tensor, row_seq: torch.Tensor | None, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 tables: torch.Tensor, lens: torch.Tensor, block_size: int, scale: float, out: torch.Tensor) -> None:
        """``q``, ``out``: [n, heads, head_dim] fp32, heads and dims contiguous; ``k_cache``/``v_cache`` [slots,
        kv_heads, head_dim] fp32 or fp16, contiguous; ``tables`` [n, width], ``lens`` [n] int64, block ids in range."""
        if row_seq is not None:
            raise ValueError("the native decode attention runs decode rows only")
        heads, d = q.shape[1], q.shape[2]
        kv_heads = k_cache.shape[1]
        decode = _kv_function(self._lib, "paged_decode", k_cache, v_cache)
        rc = decode(
            q.data_ptr(), q.stride(0), q.shape[0], k_cache.data_ptr(), v_cache.data_ptr(), kv_heads, d,
            heads // kv_heads, tables.data_ptr(), tables.shape[1], lens.data_ptr(), block_size, scale,
            out.data_ptr(), out.stride(0))
        if rc != 0:
            raise RuntimeError(f"native decode attention does not handle head_dim {d} with {heads // kv_heads} "
                               "query heads per KV head")

    def chunks(self, q: torch.Tensor, decode_rows: torch.Tensor | None, decode_tables: torch.Tensor,
               decode_lens: torch.Tensor, chunks: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               tables: torch.Tensor, block_size: int, scale: float, out: torch.Tensor) -> None:
        """A step with prefill chunks. ``decode_rows`` [nd]: the flat rows attended as decode rows (None: none),
        with their ``decode_tables`` [nd, width] and ``decode_lens`` [nd]; ``chunks`` [c, 4] int64: each chunk's
        first flat row, queries, start position and row of ``tables`` (query i attends to positions 0..start + i).
        ``q``/``out`` as for a call, rows strided alike."""
        if decode_rows is not None:
            qd = torch.index_select(q, 0, decode_rows)
            od = torch.empty_like(qd)
            self(qd, None, k_cache, v_cache, decode_tables, decode_lens, block_size, scale, od)
            out.index_copy_(0, decode_rows, od)
        heads, d = q.shape[1], q.shape[2]
        kv_heads = k_cache.shape[1]
        prefill = _kv_function(self._lib, "paged_prefill", k_cache, v_cache)
        rc = prefill(
            q.data_ptr(), q.stride(0), chunks.data_ptr(), chunks.shape[0], k_cache.data_ptr(), v_cache.data_ptr(),
            kv_heads, d, heads // kv_heads, tables.data_ptr(), tables.shape[1], block_size, scale, out.data_ptr(),
            out.stride(0))
        if rc != 0:
            raise RuntimeError(f"native prefill attention does not handle head_dim {d} with {heads // kv_heads} "
                               "query heads per KV head")
