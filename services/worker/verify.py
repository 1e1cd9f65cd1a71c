"""Verifying a speculative draft: which of its tokens the model would have produced, and one more.

A draft row ran the sequence's last token and k draft tokens d_1..d_k, so the step has the model's
scores after each of them: row j scores the token after d_j (row 0: after the last token).

- Greedy: d_{j+1} is accepted while it is row j's argmax; the first row whose argmax differs gives the
  next token instead (the bonus), or row k when every draft token was accepted. The scores of a row of
  k + 1 tokens are not bit for bit those of a one-token step here (torch's float32 matmul takes another
  path for one row than for several: the logits differ by up to ~1e-4), so a *near tie* — the two best
  scores closer than ``TIE_MARGIN`` of the dtype — is never decided by a draft row: the draft stops before
  it and no bonus token is given; the engine's next step for the sequence is then a one-token decode,
  which decides the tie as speculation off would.
- Sampled: row j's token is drawn exactly as the sampler would draw it after d_j (its distribution p_j
  after the penalty, temperature, top-k and top-p; the generator of (seed, output index) for a seeded
  request), and d_{j+1} is accepted while it equals that draw. With the draft as a distribution of
  probability 1 on its token, this *is* rejection sampling (vLLM's rejection sampler for n-gram drafts):
  d is kept with probability p_j(d), and a rejected row's token is distributed as p_j without d,
  renormalized. And a seeded request gets the very tokens it gets without speculation (the same draws),
  so "same seed, same text whatever shares the batch" still holds.

Each row sees the repetition penalty of the history before it (the draft tokens before it included).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from services.worker.sampler import (NON_FINITE, RowParams, Sampled, _finite_rows, _seeded_generator,
                                     apply_repetition_penalty, best_two, filter_top_k_top_p, first_maxima,
                                     sample)

# Two best scores closer than this are a near tie: left to a one-token step (see above).
TIE_MARGIN = {torch.float32: 1e-3, torch.bfloat16: 0.125}


@dataclass(frozen=True)
class Verified:
    accepted: list[int]        # the draft tokens accepted, in order
    bonus: int | None          # the token after them; None: a near tie, left to a one-token step
    error: str = ""            # the row's scores were not finite: nothing could be verified


def verify(logits: torch.Tensor, draft: list[int], row: RowParams, start: int, tie_margin: float) -> Verified:
    """``logits`` [1 + k, vocab] of one draft row whose first token is at position ``start`` (``row.history``
    holds the tokens through the last draft token, ``row.num_generated`` the outputs before row 0's)."""
    logits = logits.float()
    k = len(draft)
    rows = [RowParams(row.sampling, row.num_generated + j,
                      row.history[:start + 1 + j] if row.sampling.repetition_penalty != 1.0 else [])
            for j in range(k + 1)]
    apply_repetition_penalty(logits, rows)
    if row.sampling.temperature <= 0.0:
        return _greedy(logits, draft, tie_margin)
    if not bool(_finite_rows(first_maxima(logits)[0]).all()):
        return Verified([], None, NON_FINITE)
    return _rejection_sample(logits, draft, rows)


def _greedy(logits: torch.Tensor, draft: list[int], tie_margin: float) -> Verified:
    """The best two scores of each row (``best_two``: NumPy, ~40 µs for 8 rows; two torch maxima and a ``topk``
    were ~1 ms, a seventh of an 8-row verification step): the best gives the finite check (a NaN is a row's maximum)
    and the token, the first maximum, as the sampler takes it; a near tie is never decided here."""
    maxima, idx, second = best_two(logits)
    if not bool(_finite_rows(maxima).all()):
        return Verified([], None, NON_FINITE)
    best = idx.tolist()
    tie = ((maxima - second) < tie_margin).tolist()
    accepted: list[int] = []
    for j, token in enumerate(best):
        if tie[j]:
            return Verified(accepted, None)
        if j == len(draft) or token != draft[j]:
            return Verified(accepted, token)
        accepted.append(token)
    raise AssertionError("unreachable: row k always ends the draft")


def _rejection_sample(logits: torch.Tensor, draft: list[int], rows: list[RowParams]) -> Verified:
    """Each row's token drawn exactly as the sampler draws it (same distribution, same generator of
    (seed, output index)); the draft holds while it equals the draws. For a draft of probability 1 this
    is rejection sampling: d is kept with probability p(d), and a rejected row's token is distributed as
    p without d, renormalized."""
    s = rows[0].sampling
    accepted: list[int] = []
    for j, row in enumerate(rows):
        probs = torch.softmax(filter_top_k_top_p(logits[j] / s.temperature, s.top_k, s.top_p), dim=-1)
        if not bool(torch.isfinite(probs).all()):
            return Verified(accepted, None, "" if accepted else NON_FINITE)
        gen = _seeded_generator(s.seed, row.num_generated, logits.device) if s.seed is not None else None
        token = int(torch.multinomial(probs, 1, generator=gen)[0])
        if j == len(draft) or token != draft[j]:
            return Verified(accepted, token)
        accepted.append(token)
    raise AssertionError("unreachable: row k always ends the draft")


def verify_rows(logits: torch.Tensor, drafts: list[tuple[tuple[int, ...], int]], rows: list[RowParams],
                tie_margin: float, offsets: list[int] | None = None) -> Sampled:
    """A step's sampling rows, some of them draft rows: ``logits`` holds one row per plain sequence and
    1 + k per draft row, in order; ``drafts`` (draft, start position) per sequence (an empty draft: a
    plain row, sampled as usual). ``offsets``: each sequence's first logits row, when a draft was cut
    shorter than the rows it ran (a constraint's cut); else they follow from the drafts. Token -1 for a
    draft row: no bonus token (a near tie)."""
    plain = [i for i, (draft, _) in enumerate(drafts) if not draft]
    if offsets is None:
        offsets = list(itertools.accumulate((1 + len(draft) for draft, _ in drafts), initial=0))[:-1]
    out = Sampled([0] * len(rows), [0.0] * len(rows), [[] for _ in rows], [[] for _ in rows], [""] * len(rows),
                  [[] for _ in rows])
    if plain:
        picked = sample(logits[torch.tensor([offsets[i] for i in plain], device=logits.device)], [rows[i] for i in plain])
        for n, i in enumerate(plain):
            out.token_ids[i], out.logprobs[i], out.errors[i] = picked.token_ids[n], picked.logprobs[n], picked.errors[n]
            out.top_ids[i], out.top_logprobs[i] = picked.top_ids[n], picked.top_logprobs[n]
    for i, (draft, start) in enumerate(drafts):
        if draft:
            v = verify(logits[offsets[i]:offsets[i] + 1 + len(draft)], list(draft), rows[i], start, tie_margin)
            out.token_ids[i] = -1 if v.bonus is None else v.bonus
            out.accepted[i], out.errors[i] = v.accepted, v.error
    return out
