"""The OpenAI HTTP face's overhead: /v1/completions streaming vs gRPC GenerateStream through the same
router, same prompts and streams, measured back to back (BENCH_ROUNDS pairs, the median pair kept)."""
from __future__ import annotations

import json
import urllib.request
from typing import Callable, Iterator

from bench.load import RunStats, run_streams


def http_stream_fn(http_address: str, out_tokens: int) -> Callable[[str], Iterator[int]]:
    """A request through /v1/completions (stream, usage at the end): yields tokens as they arrive."""
    url = f"http://{http_address}/v1/completions"

    def stream(prompt: str) -> Iterator[int]:
        body = json.dumps({"prompt": prompt, "max_tokens": out_tokens, "temperature": 0, "ignore_eos": True,
                           "stream": True, "stream_options": {"include_usage": True}}).encode()
        req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
        chunks = 0
        with urllib.request.urlopen(req, timeout=900) as resp:
            for raw in resp:
                if not raw.startswith(b"data: {"):
                    continue
                msg = json.loads(raw[6:])
                if msg["choices"]:
                    chunks += 1
                    yield 1  # a chunk holds one engine message: usually one token, more when coalesced
                elif msg.get("usage"):
                    yield msg["usage"]["completion_tokens"] - chunks  # the exact count, from the usage
    return stream


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
