"""The OpenAI HTTP face's overhead: /v1/completions streaming vs gRPC GenerateStream through the same
router, same prompts and streams, measured back to back (BENCH_ROUNDS pairs, the median pair kept)."""
from __future__ import annotations

from typing import Callable, Iterator

from bench.load import RunStats, run_streams
from bench.online import completion_stream


def http_stream_fn(http_address: str, out_tokens: int) -> Callable[[str], Iterator[int]]:
    """A request through /v1/completions (stream, usage at the end): yields tokens as they arrive."""
    url = f"http://{http_address}/v1/completions"
    return lambda prompt: completion_stream(url, prompt, out_tokens)


def compare(grpc_fn: Callable[[str], Iterator[int]], http_address: str, prompts: list[str], out_tokens: int,
            rounds: int) -> tuple[RunStats, RunStats, list[tuple[float, RunStats, RunStats]]]:
    """(gRPC run, HTTP run) of the median-ratio pair, and every pair."""
    http_fn = http_stream_fn(http_address, out_tokens)
    pairs = []
    for i in range(rounds):
        # Alternate which goes first, so neither always gets the machine's state after the other.
        if i % 2:
            h = run_streams("llmserve OpenAI HTTP /v1/completions", prompts, http_fn)
            g = run_streams("llmserve via router", prompts, grpc_fn)
        else:
            g = run_streams("llmserve via router", prompts, grpc_fn)
            h = run_streams("llmserve OpenAI HTTP /v1/completions", prompts, http_fn)
        pairs.append((h.tokens_per_s / g.tokens_per_s, g, h))
    _, g, h = sorted(pairs, key=lambda p: p[0])[len(pairs) // 2]
    return g, h, pairs
