"""Paged attention in C++ for bfloat16 on CPUs with AVX-512 BF16 (``kernels/paged_attention.cpp``).

Every query row of a step attends to its own sequence's first positions: a decode row to its whole context,
the i-th token of a prefill chunk to the positions up to its own. Through SDPA that costs a gather of the
paged slots, padding, and for a decode row a kernel built for long query blocks: 200 µs a layer for one
row over 2,000 keys. The C++ kernel reads the slots in place through the block tables, 16 keys at a time
with ``vdpbf16ps``, and spreads the rows (and the parts of a long one) over torch's own OpenMP threads:
34 µs for that row. A prefill chunk's rows go in tiles of 16 that share each key and value read: a 512-token
prompt's attention 0.7 ms a layer against SDPA's 4.2 ms. Where it cannot run (float32, CUDA, another head
size, no AVX-512 BF16) ``paged_attention.py`` uses SDPA.
"""
from __future__ import annotations

import ctypes

import torch

from services.worker import kernels

class AttentionKernel:
    """``kernel(q, row_seq, k_cache, v_cache, tables, lens, block_size, scale, out)``: causal attention of
    query rows over their paged context, written into ``out``."""

    prefill = True      # runs prefill chunks' rows too (StepLayout gives it every step)

    def __init__(self, lib: ctypes.CDLL):
        """``lib``: ``kernels.library()``."""
        self._lib = lib

    @classmethod
    def load(cls) -> "AttentionKernel | None":
        """The kernel, or None where the C++ kernels cannot run here (``kernels.library`` logs why)."""
        lib = kernels.library()
        return cls(lib) if lib is not None else None

    def supports(self, dtype: torch.dtype, device: torch.device, head_dim: int, group: int) -> bool:
        return (dtype == torch.bfloat16 and device.type == "cpu"
                and bool(self._lib.llmserve_paged_attention_supports(head_dim, group)))

    def __call__(self, q: torch.Tensor, row_seq: torch.Tensor | None, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 tables: torch.Tensor, lens: torch.Tensor, block_size: int, scale: float, out: torch.Tensor) -> None:
        """Query row b attends to the first ``lens[b]`` positions of its sequence, into row b of ``out``.

        ``q``, ``out``: [n, heads, head_dim] bf16, heads and dims contiguous (rows may be strided);
        ``row_seq`` [n]: the block table of each row (None = table b); ``k_cache``/``v_cache``: [slots,
        kv_heads, head_dim] contiguous; ``tables`` [*, width] and ``lens`` [n]: int64, contiguous, every block
        id in range (the runner checks them)."""
        heads, d = q.shape[1], q.shape[2]
        kv_heads = k_cache.shape[1]
        rc = self._lib.llmserve_paged_attention(
            q.data_ptr(), q.stride(0), None if row_seq is None else row_seq.data_ptr(), lens.shape[0],
            k_cache.data_ptr(), v_cache.data_ptr(), kv_heads, d, heads // kv_heads,
            tables.data_ptr(), tables.shape[1], lens.data_ptr(), block_size, scale, out.data_ptr(), out.stride(0))
        if rc != 0:
            raise RuntimeError(f"attention kernel does not handle head_dim {d}, group {heads // kv_heads}")
