"""Loads with long prompts next to short ones, and the memory-bandwidth floor.

- mixed lengths: 32 streams where a few prompts are 500–2,000 tokens, against the all-short load;
- a 2,000-token prompt admitted while short streams decode: their ITL during its prefill;
- one stream's ITL at a ~2,000-token context against a short one;
- STREAM-like copy bandwidth, and the floor of a bf16 decode step (weight bytes ÷ bandwidth).

Long prompts are made unique (a nonce first) so the prefix cache cannot serve them.
"""
from __future__ import annotations

import threading
import time
import uuid
from typing import Callable, Iterable

import torch

from bench.load import RunStats, pct

SUBJECTS = ["river", "lantern", "orchard", "harbor", "glacier", "market", "violin", "comet"]


def long_prompt(tok: object, num_tokens: int) -> str:
    """A unique prompt of about ``num_tokens`` tokens (a nonce first, so no cached prefix matches)."""
    head = f"Log {uuid.uuid4().hex}. "
    sentences, i = [], 0
    text = head
    while len(tok(text)["input_ids"]) < num_tokens:  # type: ignore[operator]
        sentences.extend(f"Note {j}: the {SUBJECTS[j % 8]} near house {j * 7 % 101} was {j * 13 % 37} meters away."
                         for j in range(i, i + 20))
        i += 20
        text = head + " ".join(sentences)
    ids = tok(text)["input_ids"][:num_tokens]  # type: ignore[operator]
    return tok.decode(ids, skip_special_tokens=True)  # type: ignore[attr-defined]


LONG_LENGTHS = (500, 1000, 1500, 2000)


def long_prompts(tok: object, lengths: tuple[int, ...] = LONG_LENGTHS) -> list[str]:
    return [long_prompt(tok, n) for n in lengths]


def mixed_prompts(tok: object, short: list[str], lengths: tuple[int, ...] = LONG_LENGTHS) -> list[str]:
    """``short`` with a few of them replaced by long unique prompts, spread through the list."""
    prompts = list(short)
    step = len(prompts) // len(lengths)
    for k, long in enumerate(long_prompts(tok, lengths)):
        prompts[k * step + step // 2] = long
    return prompts


StreamFn = Callable[[str], Iterable[int]]


def itl_during_admission(stream: StreamFn, short: list[str], long: str, timeout: float = 600) -> tuple[list[float], float]:
    """Short streams decode; once each has a few tokens, the long prompt is sent. Returns the short streams'
    inter-token gaps that overlap the long prompt's admission (send → its first token), and that admission time."""
    stamps: list[list[float]] = [[] for _ in short]
    errors: list[BaseException] = []
    started = threading.Barrier(len(short) + 1)
    window: list[float] = []

    def one(i: int) -> None:
        try:
            started.wait(timeout)
            for k in stream(short[i]):
                if k:
                    stamps[i].append(time.perf_counter())
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            errors.append(exc)

    def long_one() -> None:
        try:
            window.append(time.perf_counter())
            for k in stream(long):
                if k:
                    window.append(time.perf_counter())
                    return
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(short))]
    for t in threads:
        t.start()
    started.wait(timeout)
    deadline = time.monotonic() + timeout
    while min(len(s) for s in stamps) < 4 and time.monotonic() < deadline and not errors:
        time.sleep(0.01)
    lt = threading.Thread(target=long_one, daemon=True)
    lt.start()
    lt.join(timeout)
    for t in threads:
        t.join(timeout)
    if errors:
        raise RuntimeError(f"admission run: {len(errors)} requests failed: {errors[0]!r}")
    if len(window) < 2:
        raise RuntimeError("admission run: the long prompt produced no token")
    t0, t1 = window[0], window[1]
    gaps = [b - a for s in stamps for a, b in zip(s, s[1:]) if b > t0 and a < t1]
    return gaps, t1 - t0


def stream_bandwidth(num_bytes: int = 256 * 2**20, repeats: int = 10) -> float:
    """Bytes/s of a large tensor copy (read + write counted, like STREAM's copy), best of ``repeats``."""
    src = torch.ones(num_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * num_bytes / best


def summary(stats: RunStats) -> tuple[float, float, float, float]:
    return stats.tokens_per_s, pct(stats.ttft, 50), pct(stats.itl, 50), pct(stats.itl, 99)
