"""Online serving, as vLLM's ``benchmark_serving`` runs it (`BENCH_ONLY=online make bench`).

Requests arrive as a Poisson process at each rate of ``BENCH_ONLINE_RATES`` (1, 2 and 4 requests/s),
``BENCH_ONLINE_REQUESTS`` (120) at each rate, and every system gets the same requests at the same
moments through the same OpenAI HTTP client (streamed ``/v1/completions``):

- prompt lengths are lognormal (median ~150 tokens, capped at 2,000), each unique (a nonce first);
  ~30% of them start with one shared 400-token system prompt;
- outputs are 16-200 tokens (uniform), generated in full (``ignore_eos``), greedy.

Printed per system and rate: output tokens/s (over the run's wall time), TTFT and ITL p50/p99, and
goodput: the requests per second that met TTFT <= 2 s and a mean ITL <= 100 ms (the SLO). The systems
are llmserve as ``make up`` serves it (the default dtype, the router's HTTP face) and llama.cpp's
llama-server on the same GGUF, when ``make bench-peers`` has built it. Reported, not gated.
"""
from __future__ import annotations

import json
import math
import os
import random
import subprocess
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from bench.load import pct

RATES = [float(r) for r in os.environ.get("BENCH_ONLINE_RATES", "1,2,4").split(",")]
REQUESTS = int(os.environ.get("BENCH_ONLINE_REQUESTS", 120))
MEDIAN_PROMPT, PROMPT_SIGMA, MAX_PROMPT, SYSTEM_TOKENS, SHARED = 150, 0.9, 2000, 400, 0.3
MIN_OUT, MAX_OUT = 16, 200
TTFT_SLO, ITL_SLO = 2.0, 0.100
SEED = 20261201


@dataclass(frozen=True)
class Request:
    at: float           # seconds after the run starts
    prompt: str
    max_tokens: int


@dataclass
class Outcome:
    ttft: float
    gaps: list[float]   # seconds between tokens
    tokens: int
    done_at: float      # seconds after the run starts

    @property
    def mean_itl(self) -> float:
        return sum(self.gaps) / len(self.gaps) if self.gaps else 0.0


def corpus_ids(tok: object) -> list[int]:
    """Token ids of text the repository ships (its README and docs), repeated past any prompt's length."""
    root = Path(__file__).resolve().parents[1]
    text = "\n".join(p.read_text() for p in [root / "README.md", *sorted((root / "docs").glob("*.md"))])
    ids = tok(text)["input_ids"]  # type: ignore[operator]
    while len(ids) < 4 * MAX_PROMPT:
        ids = ids + ids
    return ids


def workload(tok: object, rate: float, n: int = REQUESTS, seed: int = SEED) -> list[Request]:
    """``n`` requests arriving at ``rate`` per second (exponential gaps), reproducible by ``seed``."""
    rng = random.Random(f"{seed}-{rate}")
    ids = corpus_ids(tok)
    decode = tok.decode  # type: ignore[attr-defined]
    system = decode(ids[:SYSTEM_TOKENS], skip_special_tokens=True)
    requests, at = [], 0.0
    for i in range(n):
        length = min(MAX_PROMPT, max(8, round(rng.lognormvariate(math.log(MEDIAN_PROMPT), PROMPT_SIGMA))))
        start = rng.randrange(SYSTEM_TOKENS, len(ids) - MAX_PROMPT)
        unique = f"Request {i} ({rng.getrandbits(64):016x}): " + decode(ids[start:start + length],
                                                                        skip_special_tokens=True)
        prompt = f"{system}\n\n{unique}" if rng.random() < SHARED else unique
        requests.append(Request(at, prompt, rng.randint(MIN_OUT, MAX_OUT)))
        at += rng.expovariate(rate)
    return requests


def completion_stream(url: str, prompt: str, max_tokens: int, timeout: float = 900) -> Iterator[int]:
    """Tokens as they arrive from a streamed OpenAI ``/v1/completions``; the usage's count when given."""
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                       "stream": True, "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    chunks = 0
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        for raw in resp:
            if not raw.startswith(b"data: {"):
                continue
            msg = json.loads(raw[6:])
            if msg.get("choices") and msg["choices"][0].get("text"):
                chunks += 1
                yield 1
            elif msg.get("usage") and msg["usage"].get("completion_tokens", 0) > chunks:
                yield msg["usage"]["completion_tokens"] - chunks


def run(url: str, requests: list[Request]) -> tuple[list[Outcome], float, list[str]]:
    """Each request sent at its arrival time on its own thread; (outcomes, wall seconds, errors)."""
    outcomes: list[Outcome] = []
    errors: list[str] = []
    lock = threading.Lock()
    t0 = time.perf_counter()

    def one(r: Request) -> None:
        delay = r.at - (time.perf_counter() - t0)
        if delay > 0:
            time.sleep(delay)   # the arrival process itself, not a wait on a condition
        sent = time.perf_counter()
        first = last = None
        gaps, n = [], 0
        try:
            for k in completion_stream(url, r.prompt, r.max_tokens):
                now = time.perf_counter()
                if first is None:
                    first = now
                elif k:
                    gaps.extend([(now - last) / k] * k)
                last, n = now, n + k
        except Exception as exc:  # noqa: BLE001 - counted and printed, the run goes on
            with lock:
                errors.append(repr(exc))
            return
        with lock:
            outcomes.append(Outcome((first or sent) - sent, gaps, n, (last or sent) - t0))

    threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in requests]
    for t in threads:
        t.start()
    for t in threads:
        t.join(1800)
    return outcomes, time.perf_counter() - t0, errors


def row(system: str, rate: float, outcomes: list[Outcome], seconds: float, errors: list[str]) -> str:
    ttft = [o.ttft for o in outcomes]
    itl = [g for o in outcomes for g in o.gaps]
    good = sum(1 for o in outcomes if o.ttft <= TTFT_SLO and o.mean_itl <= ITL_SLO)
    tokens = sum(o.tokens for o in outcomes)
    return (f"| {system} | {rate:g} | {len(outcomes)}/{len(outcomes) + len(errors)} | {tokens / seconds:.0f} | "
            f"{pct(ttft, 50) * 1e3:.0f} | {pct(ttft, 99) * 1e3:.0f} | {pct(itl, 50) * 1e3:.0f} | "
            f"{pct(itl, 99) * 1e3:.0f} | {good} ({good / seconds:.2f}/s) |")


def llama_server(binary: Path, gguf: Path, slots: int = 16, context: int = 0) -> tuple[subprocess.Popen, str]:
    """llama-server on a free port, ``slots`` parallel sequences sharing ``context`` tokens (default: room for
    the longest request each); (the process, its /v1/completions URL)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = context or slots * (MAX_PROMPT + SYSTEM_TOKENS + MAX_OUT + 64)
    proc = subprocess.Popen([str(binary), "-m", str(gguf), "--port", str(port), "--host", "127.0.0.1",
                             "-np", str(slots), "-c", str(ctx), "-t", str(os.cpu_count() or 2), "--no-warmup"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc, f"http://127.0.0.1:{port}/v1/completions"
        except OSError:
            time.sleep(0.2)   # polling a server's health until its deadline
    proc.terminate()
    raise RuntimeError("llama-server did not start")


def rows(dtype: str, llama_binary: Path, engine_args: list[str]) -> list[str]:
    from services.common.model_source import resolve_model
    from services.engine.models.tokenizer import Tokenizer
    from services.stack import start_stack

    source = resolve_model("smollm2")
    tok = Tokenizer(source).hf
    loads = {rate: workload(tok, rate) for rate in RATES}
    lines = ["", f"## Online serving (Poisson arrivals, {REQUESTS} requests a rate; SLO: TTFT <= {TTFT_SLO:g} s and "
             f"mean ITL <= {ITL_SLO * 1e3:.0f} ms)", "",
             "| system | requests/s | completed | output tokens/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | "
             "ITL p99 ms | met the SLO (goodput) |", "|---|---|---|---|---|---|---|---|---|"]
    stack = start_stack(["--model", "smollm2", "--dtype", dtype, *engine_args],
                        log_dir=Path(tempfile.mkdtemp(prefix="bench-online-")))
    try:
        url = f"http://{stack.http_address}/v1/completions"
        list(completion_stream(url, "warm up", 4))
        for rate, requests in loads.items():
            lines.append(row(f"llmserve ({dtype}, HTTP)", rate, *run(url, requests)))
            print(lines[-1], flush=True)
    finally:
        stack.stop()
    if not llama_binary.exists():
        lines.append("| llama-server not built (`make bench-peers`) | | | | | | | | |")
        return lines
    proc, url = llama_server(llama_binary, source.path)
    try:
        list(completion_stream(url, "warm up", 4))
        for rate, requests in loads.items():
            lines.append(row("llama-server (16 slots)", rate, *run(url, requests)))
            print(lines[-1], flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return lines
