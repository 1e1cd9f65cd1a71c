"""Weight matrices prepared once for the device's fastest matmul.

On CPU in bfloat16, ``F.linear`` hands oneDNN a plain weight and oneDNN reorders it into its blocked
(AMX) layout on every call: for this model's small matrices that reorder costs more than the product
(a 576 → 1536 projection of one token: 112 µs plain, 36 µs prepacked). A weight reordered once
(``torch.ops.mkldnn._reorder_linear_weight``, what inductor's weight freezing does) and multiplied with
``mkldnn._linear_pointwise`` runs 2–3× faster at every batch size. Elsewhere (float32, which is the
exactness path; CUDA) the plain ``F.linear`` is used, so results are bit-for-bit those of the stock model.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


class Linear:
    """``y = x @ weight.T`` for ``x`` of shape [..., in_features]."""

    def __init__(self, weight: torch.Tensor):
        weight = weight.detach()
        self.out_features, self.in_features = weight.shape
        self.nbytes = weight.numel() * weight.element_size()
        self.packed = _can_pack(weight)
        # Packed for a batch of one: measured as fast as a batch-specific packing at 8 and 32 rows.
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, 1) if self.packed else weight.contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.packed:
            return F.linear(x, self.weight)
        flat = x.reshape(-1, self.in_features)
        y = torch.ops.mkldnn._linear_pointwise(flat, self.weight, None, "none", [], "")
        return y.view(*x.shape[:-1], self.out_features)


def _can_pack(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())
