"""Graceful drain with real processes: on SIGTERM a service goes NOT_SERVING, refuses new calls
with UNAVAILABLE, lets the streams in flight finish (longer than the old 5 s cut) and exits 0; with
two engines behind a router, draining one costs no client an error.

The streams must outlast the old 5 s grace, whatever this machine's speed: one engine runs one
sequence at a time (``--max-num-seqs 1``) and the test queues enough streams, sized from a timed
warm-up stream, that the queue takes well over 5 s to drain.
"""
from __future__ import annotations

import math
import signal
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmserve.v1 import engine_admin_pb2, engine_admin_pb2_grpc, llm_pb2, llm_pb2_grpc
from services.common.process import start_side_by_side
from services.stack import ServiceProcess, start_service
from tests.conftest import TINY_ENGINE_ARGS
from tests.helpers import wait_until

TOKENS = 480   # most of the tiny model's 512 positions: a stream takes ~0.25 s even where it runs ~0.5 ms a token
LONG = llm_pb2.SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
SHORT = llm_pb2.SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
OLD_GRACE = 5.0
WANTED_DRAIN = 2 * OLD_GRACE        # queued work after SIGTERM, in seconds of generation
ENGINE_ARGS = [*TINY_ENGINE_ARGS, "--max-num-seqs", "1", "--drain-seconds", "300"]


def _stream(address: str, prompt: str) -> tuple[int, float]:
    """Run one stream to its end: (tokens received, monotonic end time). Raises its gRPC error."""
    with grpc.insecure_channel(address) as ch:
        chunks = llm_pb2_grpc.LLMServiceStub(ch).GenerateStream(
            llm_pb2.GenerateRequest(prompt=prompt, sampling=LONG), timeout=600)
        tokens = sum(len(c.token_ids) for c in chunks)
    return tokens, time.monotonic()


def _num_streams(address: str) -> int:
    """How many one-at-a-time streams take WANTED_DRAIN seconds here (timed on a warm engine)."""
    _stream(address, "warm up")
    started = time.monotonic()
    _stream(address, "time one stream")
    one = time.monotonic() - started
    return max(3, min(60, math.ceil(WANTED_DRAIN / max(one, 0.05)) + 1))


def _load(address: str) -> engine_admin_pb2.EngineLoad | None:
    try:
        with grpc.insecure_channel(address) as ch:
            return engine_admin_pb2_grpc.EngineAdminStub(ch).GetLoad(engine_admin_pb2.GetLoadRequest(), timeout=5)
    except grpc.RpcError:
        return None


def _serving(address: str) -> bool:
    try:
        with grpc.insecure_channel(address) as ch:
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status
        return status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def _results(futures: list[Future[tuple[int, float]]]) -> tuple[list[int], list[str], float]:
    tokens, errors, last = [], [], 0.0
    for f in futures:
        try:
            n, end = f.result(timeout=600)
            tokens.append(n)
            last = max(last, end)
        except grpc.RpcError as exc:
            errors.append(f"{exc.code().name}: {exc.details()}")  # type: ignore[attr-defined]
    return tokens, errors, last


def test_sigterm_drains_streams_in_flight_and_refuses_new_calls(tiny_model_dir: Path, tmp_path: Path) -> None:
    engine = start_service("services.engine", ["--model", str(tiny_model_dir), *ENGINE_ARGS],
                           log_path=tmp_path / "engine.log")
    try:
        n = _num_streams(engine.address)
        with ThreadPoolExecutor(n) as pool:
            futures = [pool.submit(_stream, engine.address, f"Stream {i} says") for i in range(n)]
            wait_until(lambda: (load := _load(engine.address)) is not None and load.num_running == 1
                       and load.num_waiting >= n - 2, 60, "one stream running and the rest queued")
            signalled = time.monotonic()
            engine.proc.send_signal(signal.SIGTERM)
            wait_until(lambda: not _serving(engine.address), 30, "the engine to leave SERVING")
            # A new call is refused with UNAVAILABLE: a router retries it on another engine.
            with grpc.insecure_channel(engine.address) as ch:
                with pytest.raises(grpc.RpcError) as refused:
                    llm_pb2_grpc.LLMServiceStub(ch).Generate(llm_pb2.GenerateRequest(prompt="late", sampling=SHORT),
                                                             timeout=30)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
            tokens, errors, last = _results(futures)
        assert errors == [], f"{len(errors)} of {n} streams failed during the drain: {errors[:3]}"
        assert tokens == [TOKENS] * n
        assert last - signalled > OLD_GRACE, "the streams should have outlasted the old 5 s grace"
        assert engine.proc.wait(timeout=60) == 0
        assert "drained in" in (tmp_path / "engine.log").read_text()
    finally:
        engine.stop(kill=True)


def test_draining_one_of_two_engines_costs_no_client_an_error(tiny_model_dir: Path, tmp_path: Path) -> None:
    engines: list[ServiceProcess] = []
    router: ServiceProcess | None = None
    try:
        engines = start_side_by_side([lambda i=i: start_service(
            "services.engine", ["--model", str(tiny_model_dir), *ENGINE_ARGS], log_path=tmp_path / f"engine{i}.log")
            for i in range(2)])
        router = start_service("services.router", ["--engines", ",".join(e.address for e in engines),
                                                   "--health-interval", "0.2", "--affinity-slack", "0",
                                                   "--http-port", "-1"],
                               log_path=tmp_path / "router.log")
        per_engine = _num_streams(engines[0].address)
        n = 2 * per_engine
        victim, survivor = engines
        stop_traffic = threading.Event()
        late: list[str] = []          # outcome of each request sent while the victim drains

        def new_requests() -> None:
            with grpc.insecure_channel(router.address) as ch:  # type: ignore[union-attr]
                stub = llm_pb2_grpc.LLMServiceStub(ch)
                for i in range(200):
                    if stop_traffic.is_set():
                        return
                    try:
                        stub.Generate(llm_pb2.GenerateRequest(prompt=f"late {i}", sampling=SHORT), timeout=120)
                        late.append("OK")
                    except grpc.RpcError as exc:
                        late.append(f"{exc.code().name}: {exc.details()}")  # type: ignore[attr-defined]

        with ThreadPoolExecutor(n + 1) as pool:
            futures = [pool.submit(_stream, router.address, f"Stream {i} says") for i in range(n)]
            wait_until(lambda: all((load := _load(e.address)) is not None and load.num_running == 1
                                   and load.num_waiting >= 1 for e in engines), 60,
                       "both engines running one stream with more queued")
            signalled = time.monotonic()
            victim.proc.send_signal(signal.SIGTERM)
            traffic = pool.submit(new_requests)
            tokens, errors, last = _results(futures)
            wait_until(lambda: late.count("OK") >= 3, 120, "new requests to succeed during the drain")
            stop_traffic.set()
            traffic.result(timeout=120)
        assert errors == [], f"{len(errors)} of {n} streams failed: {errors[:3]}"
        assert tokens == [TOKENS] * n
        assert all(outcome == "OK" for outcome in late), [o for o in late if o != "OK"][:3]
        assert victim.proc.wait(timeout=120) == 0
        assert last - signalled > OLD_GRACE, "the streams should have outlasted the old 5 s grace"
        # Drained, not rescued: no stream had to be resumed on the survivor.
        assert "died mid-stream" not in (tmp_path / "router.log").read_text()
        assert survivor.alive and _serving(router.address)
    finally:
        if router is not None:
            router.stop(kill=True)
        for e in engines:
            e.stop(kill=True)
