"""The metrics-overhead row: llmserve at 32 streams with metrics on vs off, measured in one run.

Two stacks run side by side, one started with ``--no-metrics`` (router, engine and worker serve
and record nothing). Runs alternate on/off, BENCH_ROUNDS pairs; while the metrics-on stack runs,
a scraper fetches its router's and engine's /metrics every second, as Prometheus would. The
ratio is the median on-run's tokens/s over the median off-run's (goal >= 0.97).
BENCH_METRICS=0 leaves the row out of `make bench`; BENCH_ONLY=metrics runs only it.
"""
from __future__ import annotations

import os
import statistics
import threading
import urllib.request
from typing import Any, Callable

STREAMS = int(os.environ.get("BENCH_METRICS_STREAMS", 32))
ROUNDS = int(os.environ.get("BENCH_ROUNDS", 3))
METRICS_ROW = os.environ.get("BENCH_METRICS", "1") != "0"
SCRAPE_SECONDS = 1.0


class Scraper:
    """Fetches every URL each ``SCRAPE_SECONDS`` until stopped; counts the scrapes that worked."""

    def __init__(self, urls: list[str]):
        self.urls = urls
        self.ok = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-scraper", daemon=True)

    def __enter__(self) -> "Scraper":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(SCRAPE_SECONDS):
            for url in self.urls:
                try:
                    with urllib.request.urlopen(url, timeout=5) as resp:
                        resp.read()
                    self.ok += 1
                except OSError:
                    pass


def metrics_overhead(serve: Callable[..., Any]) -> str:
    """``serve(max_streams, metrics=...)`` starts a stack (bench's LLMServe); returns the report line."""
    on = serve(STREAMS, metrics=True)
    off = None
    tps_on: list[float] = []
    tps_off: list[float] = []
    scrapes = 0
    try:
        off = serve(STREAMS, metrics=False)
        urls = [p.metrics_url for p in [on.stack.router, *on.stack.engines] if p is not None and p.metrics_url]
        assert urls and not any(p.metrics_url for p in [off.stack.router, *off.stack.engines] if p is not None)
        for i in range(ROUNDS):
            # Alternate which side goes first, so a drift in the machine's speed hits both alike.
            order = [(on, tps_on), (off, tps_off)] if i % 2 == 0 else [(off, tps_off), (on, tps_on)]
            for stack, out in order:
                if stack is on:
                    with Scraper(urls) as scraper:
                        out.append(stack.run(STREAMS).tokens_per_s)
                    scrapes += scraper.ok
                else:
                    out.append(stack.run(STREAMS).tokens_per_s)
    finally:
        on.close()
        if off is not None:
            off.close()
    ratio = statistics.median(tps_on) / statistics.median(tps_off)
    return (f"metrics overhead @{STREAMS} streams: on {statistics.median(tps_on):.0f} tok/s / off "
            f"{statistics.median(tps_off):.0f} tok/s = {ratio:.3f} (goal >= 0.97; {ROUNDS} alternating pairs, "
            f"{scrapes} scrapes of /metrics during the on-runs; on runs "
            f"{', '.join(f'{t:.0f}' for t in tps_on)}, off runs {', '.join(f'{t:.0f}' for t in tps_off)})")
