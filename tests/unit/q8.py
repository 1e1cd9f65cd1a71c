"""The native kernels' int8 values (q8, ``services/worker/kernels/native_glue.h``) in NumPy, for the tests."""
from __future__ import annotations

import numpy as np
import torch


def q8(values: torch.Tensor) -> torch.Tensor:
    """[..., d] fp32 → the kernels' int8 values [..., d + 4]: each row's integers round(x · 127 / max|x|) (float32
    arithmetic, ties to even) and then the fp32 scale max|x| / 127."""
    x = values.float().numpy()
    amax = np.abs(x).max(axis=-1, keepdims=True).astype(np.float32)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.rint(x * inv).astype(np.int8)
    scale = (amax / np.float32(127)).astype(np.float32)
    return torch.from_numpy(np.concatenate([q, scale.view(np.int8)], axis=-1))


def dequant_q8(cache: torch.Tensor) -> torch.Tensor:
    """q8 [..., d + 4] → the values it holds, fp32 [..., d] (q · s, exact in float64 and rounded once)."""
    d = cache.shape[-1] - 4
    scale = cache[..., d:].contiguous().view(torch.float32)
    return (cache[..., :d].double() * scale.double()).float()
