"""The worker's sampler: per-row parameters, and a row that cannot be sampled fails alone."""
from __future__ import annotations

import torch

from services.common.sampling import SamplingOptions
from services.worker.sampler import NON_FINITE, RowParams, best_two, first_maxima, sample


def row(temperature: float = 0.0, repetition_penalty: float = 1.0, seed: int | None = None,
        num_logprobs: int = -1) -> RowParams:
    sampling = SamplingOptions(temperature=temperature, seed=seed, repetition_penalty=repetition_penalty,
                               logprobs=None if num_logprobs < 0 else num_logprobs)
    return RowParams(sampling, 0, [1, 2, 3])


def logits(num_rows: int) -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(num_rows, 50) * 8


def test_greedy_rows_take_the_first_maximum():
    x = logits(3)
    out = sample(x.clone(), [row(), row(), row()])
    assert out.token_ids == x.argmax(dim=-1).tolist() and out.errors == ["", "", ""]


def test_overflowing_parameters_fail_their_row_only():
    """temperature=1e-45 and repetition_penalty=1e-38 turn scores into infinities: those rows get an
    error, the greedy and seeded rows beside them are sampled exactly as they would be alone."""
    x = logits(4)
    x[2, 1] = 5.0  # a token in the history with a positive score: divided by 1e-38, it overflows
    rows = [row(), row(temperature=1e-45), row(temperature=0.7, repetition_penalty=1e-38), row(0.7, seed=5)]
    out = sample(x.clone(), rows)
    alone = [sample(x[i:i + 1].clone(), [rows[i]]) for i in (0, 3)]
    assert out.errors == ["", NON_FINITE, NON_FINITE, ""]
    assert [out.token_ids[0], out.token_ids[3]] == [alone[0].token_ids[0], alone[1].token_ids[0]]


def test_nan_scores_fail_their_row_and_logprobs_stay_finite_for_the_others():
    x = logits(3)
    x[1, 7] = float("nan")
    out = sample(x.clone(), [row(num_logprobs=2), row(num_logprobs=2), row(temperature=1.0, seed=1, num_logprobs=2)])
    assert out.errors[1] == NON_FINITE and out.errors[0] == out.errors[2] == ""
    assert all(torch.isfinite(torch.tensor(v)).all() for i, v in enumerate(out.top_logprobs) if i != 1)
    assert out.logprobs[0] == torch.log_softmax(x[0], -1).max().item()


def test_masked_minus_infinity_is_not_an_error():
    x = logits(1)
    x[0, :10] = float("-inf")
    out = sample(x.clone(), [row(temperature=1.0, seed=3)])
    assert out.errors == [""] and out.token_ids[0] >= 10


def test_first_maxima_and_best_two_match_torch_on_ties_infinities_and_nans():
    """The NumPy reductions the greedy rows take give what ``max(dim=-1)`` and ``topk(2)`` give, at the cases
    that matter: repeated maxima (the first index), a NaN or +inf anywhere, rows of only -inf; and the scores
    are left as they were."""
    x = logits(7)
    x[1, 3] = x[1, 40] = 100.0                      # a tie: the first of the two
    x[2, 10] = float("nan")
    x[3, 5] = float("inf")
    x[4] = float("-inf")
    x[5, :3] = float("-inf")
    x[6, 49] = 99.0                                 # the last index
    before = x.clone()
    values, idx = first_maxima(x)
    ref = x.max(dim=-1)
    assert idx.tolist() == ref.indices.tolist()
    assert torch.allclose(values, ref.values, equal_nan=True)
    maxima, idx2, second = best_two(x)
    top = torch.topk(x, 2, dim=-1).values
    finite = torch.isfinite(ref.values)
    assert torch.equal(idx2, idx) and torch.allclose(maxima, ref.values, equal_nan=True)
    assert torch.equal(second[finite], top[finite, 1]) and second[1] == 100.0
    assert torch.equal(x.isnan(), before.isnan()) and torch.equal(x.nan_to_num(), before.nan_to_num())
