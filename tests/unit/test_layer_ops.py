"""The fused layer glue (services/worker/kernels/layer_ops.cpp) against torch's ops in bfloat16, at one row
(the calling thread alone) and at 40 (rows spread over threads): the rotary embedding and the KV write equal
torch's bit for bit, the residual add too, RMSNorm and SiLU · up within one bfloat16 rounding."""
from __future__ import annotations

import pytest
import torch

from services.worker import kernels
from services.worker.layer_ops import LayerOps

pytestmark = pytest.mark.skipif(not kernels.cpu_supported(), reason="the C++ kernels need AVX-512 BF16")

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 576, 9, 3, 64, 1536


@pytest.fixture(scope="module")
def ops() -> tuple[LayerOps, LayerOps]:
    fused = LayerOps.for_model(torch.bfloat16, torch.device("cpu"), HIDDEN, HEAD_DIM, INTER)
    assert fused.fused
    return fused, LayerOps(None)


def _bf16(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(torch.bfloat16)


def _within_one_rounding(a: torch.Tensor, b: torch.Tensor) -> None:
    """Every element equal or one bfloat16 step apart (8 bits of mantissa)."""
    diff = (a.float() - b.float()).abs()
    step = torch.maximum(a.float().abs(), b.float().abs()) * 2.0 ** -7
    assert bool((diff <= step + 1e-30).all()), (diff / step.clamp(min=1e-30)).max()


@pytest.mark.parametrize("rows", [1, 40])
def test_add_rms_norm(ops, rows):
    fused, plain = ops
    h = _bf16(rows, HIDDEN, seed=1, scale=3)
    delta, weight = _bf16(rows, HIDDEN, seed=2), _bf16(HIDDEN, seed=3)
    h1, h2 = h.clone(), h.clone()
    out1, out2 = fused.add_rms_norm(h1, delta, weight, 1e-5), plain.add_rms_norm(h2, delta, weight, 1e-5)
    assert torch.equal(h1, h2)                 # the residual: the same rounded sum
    _within_one_rounding(out1, out2)
    _within_one_rounding(fused.add_rms_norm(h1, None, weight, 1e-5), plain.add_rms_norm(h2, None, weight, 1e-5))
    assert torch.equal(h1, h2)                 # no delta: h untouched


@pytest.mark.parametrize("rows", [1, 40])
def test_rope_store(ops, rows):
    fused, plain = ops
    width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    qkv = _bf16(rows, width, seed=4, scale=2)
    pos = torch.arange(100, 100 + rows, dtype=torch.float32)
    freqs = pos[:, None] / (10000 ** (torch.arange(0, HEAD_DIM, 2) / HEAD_DIM))[None]
    angles = torch.cat([freqs, freqs], dim=-1)
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
    slots = torch.randperm(200)[:rows]
    caches = [torch.zeros(200, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16) for _ in range(4)]
    a, b = qkv.clone(), qkv.clone()
    fused.rope_store(a, cos, sin, HEADS, KV_HEADS, HEAD_DIM, slots, caches[0], caches[1])
    plain.rope_store(b, cos, sin, HEADS, KV_HEADS, HEAD_DIM, slots, caches[2], caches[3])
    assert torch.equal(a, b)
    assert not torch.equal(a, qkv)             # it did rotate
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert torch.equal(caches[1][slots].view(rows, -1), qkv[:, (HEADS + KV_HEADS) * HEAD_DIM:])  # v as computed


@pytest.mark.parametrize("rows", [1, 40])
def test_silu_mul(ops, rows):
    fused, plain = ops
    gate_up = _bf16(rows, 2 * INTER, seed=5, scale=4)
    _within_one_rounding(fused.silu_mul(gate_up, INTER), plain.silu_mul(gate_up, INTER))
