"""Weight matrices prepared once for the device's fastest matmul.

On CPU in bfloat16, ``F.linear`` hands oneDNN a plain weight and oneDNN reorders it into its blocked
layout on every call: for this model's small matrices that reorder costs more than the product
(a 576 → 1536 projection of one token: 112 µs plain, 36 µs prepacked). A weight reordered once
(``torch.ops.mkldnn._reorder_linear_weight``, what inductor's weight freezing does) and multiplied with
``mkldnn._linear_pointwise`` runs 2–3× faster at every batch size.

One row (a batch-1 decode step) is a stream of weight bytes, and oneDNN reads its packed weights at
~36 GB/s here; the C++ kernel ``kernels/gemv.cpp`` reads a plain row-major copy at ~59 GB/s. Where the
kernels run, each matrix keeps that copy too (``held_bytes`` counts it) and one row goes through it.

Elsewhere (float32, which is the exactness path; CUDA) the plain ``F.linear`` is used, so results are
bit-for-bit those of the stock model.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from services.worker import kernels


class Linear:
    """``y = x @ weight.T`` for ``x`` of shape [..., in_features]."""

    def __init__(self, weight: torch.Tensor):
        weight = weight.detach()
        self.out_features, self.in_features = weight.shape
        self.packed = _can_pack(weight)
        # Packed for a batch of one: measured as fast as a batch-specific packing at 8 and 32 rows.
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, 1) if self.packed else weight.contiguous()
        lib = kernels.library() if self.packed else None
        self._lib = lib if lib is not None and lib.llmserve_gemv_supports(self.out_features, self.in_features) else None
        self.rows = weight.contiguous() if self._lib is not None else None   # the one-row kernel's copy

    def held_bytes(self, shared: set[int]) -> int:
        """Bytes of weights this holds beyond the tensors whose data pointers are in ``shared``."""
        held = [self.weight] + ([self.rows] if self.rows is not None else [])
        return sum(t.numel() * t.element_size() for t in held if t.is_mkldnn or t.data_ptr() not in shared)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.packed:
            return F.linear(x, self.weight)
        flat = x.reshape(-1, self.in_features)
        if self._lib is not None and flat.shape[0] == 1:
            flat = flat.contiguous()
            y = torch.empty(1, self.out_features, dtype=x.dtype)
            self._lib.llmserve_gemv(self.rows.data_ptr(), flat.data_ptr(), y.data_ptr(),  # type: ignore[union-attr]
                                    self.out_features, self.in_features)
        else:
            y = torch.ops.mkldnn._linear_pointwise(flat, self.weight, None, "none", [], "")
        return y.view(*x.shape[:-1], self.out_features)


def _can_pack(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())

