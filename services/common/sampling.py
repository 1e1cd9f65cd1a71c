"""Sampling parameters: one type from the engine's validation to the worker's sampler. Plain Python.

The engine fills every field (see the public ``SamplingParams`` for their meanings); the worker's
sampler reads the ones that pick a token (temperature, top_p, top_k, seed, repetition_penalty,
logprobs), while max_tokens, stop and ignore_eos are the engine's to apply. ``grammar`` (the
compiled output constraint) travels to the worker once per sequence, not with every step.
"""
from __future__ import annotations

from dataclasses import dataclass

MAX_LOGPROBS = 20      # most alternatives a token's logprobs may list


@dataclass(frozen=True)
class SamplingOptions:
    max_tokens: int = 64
    temperature: float = 1.0           # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0                     # 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    repetition_penalty: float = 1.0    # 1 = off
    ignore_eos: bool = False
    logprobs: int | None = None        # None = none; else how many alternatives (0..MAX_LOGPROBS)
    grammar: str = ""                  # llguidance grammar compiled from the request's constraint; "" = none
    speculate: bool = True             # the engine may draft for it (speculative decoding; the engine's)
