"""One load client for every system under test: N concurrent streams, per-token timestamps."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable


@dataclass
class RunStats:
    label: str
    streams: int
    tokens: int
    seconds: float
    ttft: list[float]
    itl: list[float]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @staticmethod
    def pooled(runs: list["RunStats"]) -> "RunStats":
        """Runs taken as one: their tokens over their seconds, their TTFTs and ITLs together."""
        return RunStats(runs[0].label, runs[0].streams, sum(r.tokens for r in runs), sum(r.seconds for r in runs),
                        [t for r in runs for t in r.ttft], [g for r in runs for g in r.itl])


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


# A request: prompt → iterable of token counts as they arrive (one item per streamed message).
StreamFn = Callable[[str], Iterable[int]]


def run_streams(label: str, prompts: list[str], stream: StreamFn, timeout: float = 900) -> RunStats:
    """Start every prompt at once on its own thread; wall time from first start to last token."""
    ttft: list[float] = []
    itl: list[float] = []
    counts: list[int] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    start_gate = threading.Barrier(len(prompts) + 1)

    def one(prompt: str) -> None:
        start_gate.wait()
        t0 = time.perf_counter()
        last = None
        n = 0
        gaps: list[float] = []
        try:
            for k in stream(prompt):
                now = time.perf_counter()
                if last is None:
                    first = now - t0
                elif k:
                    gaps.append((now - last) / k)
                last = now
                n += k
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
            return
        with lock:
            ttft.append(first)
            itl.extend(gaps)
            counts.append(n)

    threads = [threading.Thread(target=one, args=(p,), daemon=True) for p in prompts]
    for t in threads:
        t.start()
    start_gate.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join(timeout)
    seconds = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{label}: {len(errors)} requests failed: {errors[0]!r}")
    return RunStats(label, len(prompts), sum(counts), seconds, ttft, itl)
