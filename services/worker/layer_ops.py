"""The elementwise work between a decoder layer's matmuls: one call each, in C++ where it can run.

In bfloat16 on a CPU with AVX-512 BF16, ``kernels/layer_ops.cpp`` does each in one call: at batch 1 the torch
ops cost more in dispatch than in arithmetic (``F.rms_norm`` alone is seven ops in bfloat16, 20 µs for 576
numbers). Elsewhere (float32, the exactness path; CUDA; another head size) the same functions run torch's
ops, and in float32 they compute exactly what the stock transformers layer does.
"""
from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from services.worker import kernels

class LayerOps:
    def __init__(self, lib: ctypes.CDLL | None):
        """``lib``: the C++ kernels (``kernels.library()``) to use for bfloat16 CPU tensors, or None for torch's ops."""
        self._lib = lib

    @classmethod
    def for_model(cls, dtype: torch.dtype, device: torch.device, hidden: int, head_dim: int,
                  intermediate: int) -> "LayerOps":
        """C++ where it handles this model's sizes in this dtype on this device, else torch's ops."""
        fits = dtype == torch.bfloat16 and device.type == "cpu" and hidden % 16 == 0 and head_dim % 32 == 0 \
            and intermediate % 16 == 0
        return cls(kernels.library() if fits else None)

    @property
    def fused(self) -> bool:
        return self._lib is not None

    def add_rms_norm(self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """``h += delta`` in place (when given), then RMSNorm(h) · weight: ``h``, ``delta`` [T, hidden]."""
        if self._lib is None:
            if delta is not None:
                h.add_(delta)
            return F.rms_norm(h, (h.shape[-1],), weight, eps)
        out = torch.empty_like(h)
        self._lib.llmserve_add_rms_norm(h.data_ptr(), h.stride(0), None if delta is None else delta.data_ptr(),
                           0 if delta is None else delta.stride(0), weight.data_ptr(), out.data_ptr(),
                           h.shape[0], h.shape[1], eps)
        return out

    def rope_store(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
                   head_dim: int, slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """The rotary embedding on the q and k heads of ``qkv`` [T, (heads + 2 kv_heads) · head_dim] in place
        (cos, sin: [T, head_dim]), then each row's k and v heads written to its slot of the caches."""
        t = qkv.shape[0]
        if self._lib is None:
            half, q_k = head_dim // 2, (heads + kv_heads) * head_dim
            qk = qkv[:, :q_k].view(t, heads + kv_heads, head_dim)
            c, s = cos[:, None, :], sin[:, None, :]
            qk.copy_(qk * c + torch.cat((-qk[..., half:], qk[..., :half]), dim=-1) * s)
            k = qkv[:, heads * head_dim:q_k].view(t, kv_heads, head_dim)
            v = qkv[:, q_k:].view(t, kv_heads, head_dim)
            k_cache.index_copy_(0, slots, k.to(k_cache.dtype))
            v_cache.index_copy_(0, slots, v.to(v_cache.dtype))
            return
        self._lib.llmserve_rope_store(qkv.data_ptr(), qkv.stride(0), t, heads, kv_heads, head_dim, cos.data_ptr(),
                         sin.data_ptr(), slots.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr())

    def silu_mul(self, gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
        """silu(gate) · up for ``gate_up`` [T, 2 · intermediate] = [gate | up]."""
        if self._lib is None:
            return F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
        out = torch.empty(gate_up.shape[0], intermediate, dtype=gate_up.dtype, device=gate_up.device)
        self._lib.llmserve_silu_mul(gate_up.data_ptr(), out.data_ptr(), gate_up.shape[0], intermediate)
        return out
