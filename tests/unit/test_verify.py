"""Verifying a speculative draft (services/worker/verify.py) on made-up scores: greedy acceptance, near
ties left to a one-token row, and rejection sampling that keeps the target distribution."""
from __future__ import annotations

import torch

from services.common.sampling import SamplingOptions
from services.worker.sampler import NON_FINITE, RowParams
from services.worker.verify import verify, verify_rows

GREEDY = SamplingOptions(temperature=0.0)


def scores(*best: int, vocab: int = 8, margin: float = 2.0) -> torch.Tensor:
    """One row per entry: token ``best[j]`` leads the others by ``margin``."""
    x = torch.zeros(len(best), vocab)
    for j, b in enumerate(best):
        x[j, b] = margin
    return x


def test_greedy_accepts_the_matching_prefix_and_adds_the_models_next_token():
    row = RowParams(GREEDY, 0, [])
    assert verify(scores(5, 6, 7), [5, 6], row, 0, 1e-3).accepted == [5, 6]
    v = verify(scores(5, 6, 7), [5, 6], row, 0, 1e-3)
    assert v.bonus == 7
    v = verify(scores(5, 1, 7), [5, 6], row, 0, 1e-3)
    assert (v.accepted, v.bonus) == ([5], 1)
    v = verify(scores(4, 6, 7), [5, 6], row, 0, 1e-3)
    assert (v.accepted, v.bonus) == ([], 4)


def test_a_near_tie_stops_the_draft_without_a_token_of_its_own():
    x = scores(5, 6, 7)
    x[1, 3] = x[1, 6] - 1e-4          # row 1: 6 leads 3 by less than the margin
    v = verify(x, [5, 6], RowParams(GREEDY, 0, []), 0, 1e-3)
    assert (v.accepted, v.bonus) == ([5], None)
    x[0, 2] = x[0, 5]                 # an exact tie on row 0
    v = verify(x, [5, 6], RowParams(GREEDY, 0, []), 0, 1e-3)
    assert (v.accepted, v.bonus) == ([], None)


def test_each_row_sees_the_repetition_penalty_of_the_tokens_before_it():
    penalized = SamplingOptions(temperature=0.0, repetition_penalty=100.0)
    x = scores(5, 5, 5, margin=1.0)
    x[:, 2] = 0.5                     # second best everywhere
    # history: position 0 holds 7, the row's tokens are [7, 5, 5]: row 0 has not seen 5 yet, rows 1 and 2 have
    v = verify(x, [5, 5], RowParams(penalized, 0, [7, 7, 5, 5]), 1, 1e-3)
    assert (v.accepted, v.bonus) == ([5], 2)


def test_non_finite_scores_fail_the_row():
    x = scores(5, 6, 7)
    x[1, 0] = float("nan")
    assert verify(x, [5, 6], RowParams(GREEDY, 0, []), 0, 1e-3).error == NON_FINITE


def test_a_step_of_plain_and_draft_rows():
    x = torch.cat([scores(3), scores(5, 6, 7), scores(1)])
    rows = [RowParams(GREEDY, 0, []) for _ in range(3)]
    out = verify_rows(x, [((), 0), ((5, 2), 4), ((), 0)], rows, 1e-3)
    assert out.token_ids == [3, 6, 1] and out.accepted == [[], [5], []] and out.errors == ["", "", ""]


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    return float((((counts - expected) ** 2)[keep] / expected[keep]).sum())


def test_rejection_sampling_keeps_the_target_distribution():
    """Over many seeds, the first token has row 0's distribution, and after an accepted first draft token the
    second has row 1's: a chi-square test on each (critical value at p = 0.001 with 5 degrees of freedom:
    20.5), with temperature and top-k applied as the sampler does."""
    torch.manual_seed(0)
    logits = torch.randn(3, 6) * 1.5
    draft = [2, 4]
    probs = []
    for j in range(2):
        scaled = logits[j] / 0.8
        kth = torch.topk(scaled, 5).values[-1]
        probs.append(torch.softmax(scaled.masked_fill(scaled < kth, float("-inf")), -1))
    first, second = torch.zeros(6), torch.zeros(6)
    n = 3000
    for seed in range(n):
        s = SamplingOptions(temperature=0.8, top_k=5, seed=seed)
        v = verify(logits.clone(), draft, RowParams(s, 0, []), 0, 1e-3)
        out = v.accepted + [v.bonus]
        first[out[0]] += 1
        if out[0] == draft[0]:
            second[out[1]] += 1
    assert _chi2(first, probs[0]) < 20.5, (first / n, probs[0])
    assert _chi2(second, probs[1]) < 20.5, (second / second.sum(), probs[1])
    assert first[draft[0]] > 0.1 * n      # the test saw acceptances (the draft token is likely enough)


def test_a_seeded_draft_row_is_reproducible():
    logits = torch.randn(4, 50)
    s = SamplingOptions(temperature=1.0, seed=1234)
    runs = {tuple(verify(logits.clone(), [1, 2, 3], RowParams(s, 7, []), 0, 1e-3).accepted) for _ in range(5)}
    bonuses = {verify(logits.clone(), [1, 2, 3], RowParams(s, 7, []), 0, 1e-3).bonus for _ in range(5)}
    assert len(runs) == 1 and len(bonuses) == 1


def test_a_seeded_draft_row_draws_what_the_sampler_draws_without_speculation():
    """Row j's token is the sampler's own draw for that output index: a draft of exactly those tokens is
    accepted whole, and a draft differing at one position ends there with the sampler's token."""
    from services.worker.sampler import sample

    torch.manual_seed(1)
    logits = torch.randn(4, 30)
    for seed in range(20):
        s = SamplingOptions(temperature=0.9, top_p=0.9, seed=seed)
        plain = [sample(logits[j:j + 1].clone(), [RowParams(s, 5 + j, [])]).token_ids[0] for j in range(4)]
        v = verify(logits.clone(), plain[:3], RowParams(s, 5, []), 0, 1e-3)
        assert v.accepted + [v.bonus] == plain
        wrong = [plain[0], (plain[1] + 1) % 30, plain[2]]
        v = verify(logits.clone(), wrong, RowParams(s, 5, []), 0, 1e-3)
        assert v.accepted + [v.bonus] == plain[:2]
