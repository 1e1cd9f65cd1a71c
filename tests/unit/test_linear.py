"""The worker's matmuls (services/worker/linear.py) in bfloat16: one row through the C++ kernel
(kernels/gemv.cpp), more rows through oneDNN's prepacked weights; both equal a float32 product within
bfloat16 rounding, and what each matrix holds is counted."""
from __future__ import annotations

import pytest
import torch

from services.worker import kernels
from services.worker.linear import Linear

pytestmark = pytest.mark.skipif(not kernels.cpu_supported() or not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                                reason="the one-row kernel needs AVX-512 BF16")


@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (49152, 576)])
def test_one_row_and_many_rows_equal_the_float32_product(shape):
    gen = torch.Generator().manual_seed(sum(shape))
    weight = torch.randn(*shape, generator=gen).to(torch.bfloat16)
    lin = Linear(weight)
    assert lin.packed and lin.rows is not None
    for rows in (1, 3, 32):
        x = torch.randn(rows, shape[1], generator=gen).to(torch.bfloat16)
        ref = x.float() @ weight.float().T
        got = lin(x)
        assert got.shape == (rows, shape[0]) and got.dtype == torch.bfloat16
        # fp32 sums in another order, rounded to bfloat16 once: within a few bfloat16 steps of the largest value
        assert (got.float() - ref).abs().max().item() <= 2 ** -6 * ref.abs().max().item(), rows


def test_a_row_inside_a_larger_tensor_and_a_leading_batch_dim():
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(576, 576, generator=gen).to(torch.bfloat16)
    lin = Linear(weight)
    x = torch.randn(4, 1152, generator=gen).to(torch.bfloat16)[2:3, 576:]    # strided: one row, offset
    ref = (x.float() @ weight.float().T)
    got = lin(x[None])                                                      # [1, 1, 576]
    assert got.shape == (1, 1, 576)
    assert (got[0].float() - ref).abs().max().item() <= 2 ** -6 * ref.abs().max().item()


def test_held_bytes_count_the_packed_and_row_major_copies_once():
    weight = torch.randn(960, 576).to(torch.bfloat16)
    size = weight.numel() * 2
    lin = Linear(weight)
    assert lin.held_bytes(set()) == 2 * size                   # packed + its own row-major copy
    assert lin.held_bytes({weight.data_ptr()}) == size          # the row-major copy is the caller's tensor
    w32 = weight.float()
    assert Linear(w32).held_bytes({w32.data_ptr()}) == 0         # float32: the caller's tensor, used as it is
