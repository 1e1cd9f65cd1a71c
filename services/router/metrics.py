"""The router's Prometheus metrics (llmserve_router_*).

- requests by method and gRPC status, their latency, time to the first streamed message, calls in
  flight: recorded by ``instrument``, which wraps the servicer's rpc methods (the servicer's code
  is unchanged; a call's status is that of the exception it ended with, as the error interceptor
  maps it, ``services.common.error_mapping``);
- retries (another engine tried before any output) and mid-stream resumes: counted by the relay's
  attempt loop (``RouterMetrics`` is its ``RelayObserver``);
- breaker state, health and calls in flight per engine, engines discovered per datacenter: read
  from the engine pool at scrape time (``PoolCollector``, on the metrics server's thread, while the
  pool lives on the event loop: it reads plain attributes and copies), nothing recorded on the call path.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import time
from typing import Any, AsyncIterator, Callable, Iterator

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric

from services.common.errors import ServiceError
from services.router.breaker import BreakerState
from services.router.engine_pool import Endpoint, EnginePool

# A relayed call: a ListModels in milliseconds to a long generation in minutes.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
FIRST_MESSAGE_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                         10.0, 20.0, 40.0, 80.0)
BREAKER_VALUE = {BreakerState.CLOSED: 0, BreakerState.HALF_OPEN: 1, BreakerState.OPEN: 2}
RPCS = ("Generate", "GenerateStream", "GenerateBatch", "Predict", "ListModels")


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.registry = registry
        self.requests = Counter("llmserve_router_requests", "Calls the router answered, by method and gRPC status.",
                                ["method", "code"], registry=registry)
        self.latency = Histogram("llmserve_router_request_duration_seconds",
                                 "Seconds from a call's start to its end (a stream: its last message).", ["method"],
                                 buckets=LATENCY_BUCKETS, registry=registry)
        self.first_message = Histogram("llmserve_router_time_to_first_message_seconds",
                                       "Seconds from a GenerateStream call's start to its first message.", ["method"],
                                       buckets=FIRST_MESSAGE_BUCKETS, registry=registry)
        self.in_flight = Gauge("llmserve_router_calls_in_flight", "Calls being served now.", ["method"],
                               registry=registry)
        self.retries = Counter("llmserve_router_retries", "Calls moved to another engine before any output "
                               "(the first engine was unavailable).", ["method"], registry=registry)
        self.resumes = Counter("llmserve_router_resumes", "Streams resumed on another engine after their engine "
                               "died mid-stream.", ["method"], registry=registry)
        self.key_refusals = Counter("llmserve_router_key_limit_refusals", "Calls refused because their API key "
                                    "was at one of its limits, by the key's label and the limit.", ["key", "limit"],
                                    registry=registry)
        for method in RPCS:  # every series exists from the start, so rate() has something to show
            self.requests.labels(method, grpc.StatusCode.OK.name)
            self.latency.labels(method)
            self.in_flight.labels(method)
            self.retries.labels(method)
        self.first_message.labels("GenerateStream")
        self.resumes.labels("GenerateStream")

    def retry(self, method: str) -> None:
        self.retries.labels(method).inc()

    def resume(self, method: str) -> None:
        self.resumes.labels(method).inc()

    def key_refused(self, key: str, limit: str) -> None:
        self.key_refusals.labels(key, limit).inc()

    def watch_pool(self, pool: EnginePool) -> None:
        self.registry.register(PoolCollector(pool))


def instrument(servicer: Any, metrics: RouterMetrics) -> Any:
    """Wrap ``servicer``'s rpc methods (instance attributes shadow the class's) to record each call."""
    for method in RPCS:
        behavior = getattr(servicer, method)
        wrapped = _wrap_stream(method, behavior, metrics) if inspect.isasyncgenfunction(behavior) \
            else _wrap_unary(method, behavior, metrics)
        setattr(servicer, method, functools.wraps(behavior)(wrapped))
    return servicer


@contextlib.contextmanager
def _recorded(method: str, m: RouterMetrics) -> Iterator[float]:
    """One call's in-flight gauge, latency and request count (by its final status); yields its start."""
    started = time.perf_counter()
    m.in_flight.labels(method).inc()
    code = "OK"
    try:
        yield started
    except BaseException as exc:
        code = code_of(exc)
        raise
    finally:
        m.in_flight.labels(method).dec()
        m.latency.labels(method).observe(time.perf_counter() - started)
        m.requests.labels(method, code).inc()


def _wrap_unary(method: str, behavior: Callable[..., Any], m: RouterMetrics) -> Callable[..., Any]:
    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        with _recorded(method, m):
            return await behavior(request, context)
    return call


def _wrap_stream(method: str, behavior: Callable[..., AsyncIterator[Any]], m: RouterMetrics) -> Callable[..., Any]:
    first = m.first_message.labels(method)

    async def call(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        with _recorded(method, m) as started:
            seen_first = False
            async for item in behavior(request, context):
                if not seen_first:
                    first.observe(time.perf_counter() - started)
                    seen_first = True
                yield item
    return call


def code_of(exc: BaseException) -> str:
    """The gRPC status name a call that raised ``exc`` ends with (as services.common.error_mapping maps it)."""
    if isinstance(exc, ServiceError):
        return exc.code  # already a grpc.StatusCode name
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        code = exc.code()  # type: ignore[attr-defined]
        return code.name if code is not None else "INTERNAL"
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        return grpc.StatusCode.CANCELLED.name  # the client went away
    if isinstance(exc, grpc.aio.AbortError):
        return "ABORTED_BY_HANDLER"
    return grpc.StatusCode.INTERNAL.name


class PoolCollector:
    """Per-engine and per-datacenter gauges, read from the pool when Prometheus scrapes."""

    def __init__(self, pool: EnginePool):
        self.pool = pool

    def collect(self) -> Iterator[Metric]:
        breaker = GaugeMetricFamily("llmserve_router_breaker_state", "Circuit breaker per engine: 0 closed, "
                                    "1 half-open, 2 open.", labels=["engine", "datacenter"])
        healthy = GaugeMetricFamily("llmserve_router_engine_healthy", "1 while an engine passes its health "
                                    "checks.", labels=["engine", "datacenter"])
        engine_calls = GaugeMetricFamily("llmserve_router_engine_calls_in_flight", "Calls relayed to an engine "
                                         "now.", labels=["engine", "datacenter"])
        discovered = GaugeMetricFamily("llmserve_router_engines_discovered", "Engines known per datacenter "
                                       "(static --engines: datacenter 'local').", labels=["datacenter"])
        per_dc: dict[str, int] = {dc: 0 for dc in list(self.pool.cluster_order)}
        for ep in self._endpoints():
            labels = [ep.address, ep.cluster]
            breaker.add_metric(labels, BREAKER_VALUE[ep.breaker.state])
            healthy.add_metric(labels, 1 if ep.healthy else 0)
            engine_calls.add_metric(labels, ep.in_flight)
            per_dc[ep.cluster] = per_dc.get(ep.cluster, 0) + 1
        for dc, count in per_dc.items():
            discovered.add_metric([dc], count)
        yield from (breaker, healthy, engine_calls, discovered)

    def _endpoints(self) -> list[Endpoint]:
        """The pool's endpoints, copied from this thread while the event loop may change membership."""
        for _ in range(10):
            try:
                return self.pool.endpoints
            except RuntimeError:  # "dictionary changed size during iteration": copy again
                continue
        return []
