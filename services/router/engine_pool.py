"""The engines a router knows, their health, and the choice of one per request.

Static discovery: a fixed list of addresses, each health-checked in the background through
``grpc.health.v1``. The policy picks the healthy engine with the fewest calls in flight from this
router, round-robin among equals.
"""
from __future__ import annotations

import itertools
import logging
import threading
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmserve.v1 import llm_pb2_grpc
from services.common.errors import Unavailable
from services.common.server import CHANNEL_OPTIONS

log = logging.getLogger("llmserve.router.pool")


@dataclass(eq=False)
class Endpoint:
    address: str
    channel: grpc.Channel
    stub: llm_pb2_grpc.LLMServiceStub
    healthy: bool = False
    in_flight: int = 0
    order: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def acquire(self) -> None:
        with self._lock:
            self.in_flight += 1

    def release(self) -> None:
        with self._lock:
            self.in_flight -= 1


class EnginePool:
    def __init__(self, addresses: list[str], health_interval: float):
        self.endpoints: list[Endpoint] = []
        for i, address in enumerate(addresses):
            channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
            self.endpoints.append(Endpoint(address, channel, llm_pb2_grpc.LLMServiceStub(channel), order=i))
        self._interval = health_interval
        self._tick = itertools.count()
        self._stop = threading.Event()
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._watch, name="engine-health", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for ep in self.endpoints:
            ep.channel.close()

    def any_healthy(self) -> bool:
        return any(ep.healthy for ep in self.endpoints)

    def pick(self, exclude: set[str] = frozenset()) -> Endpoint:  # type: ignore[assignment]
        candidates = [ep for ep in self.endpoints if ep.healthy and ep.address not in exclude]
        if not candidates:
            tried = f" (tried {', '.join(sorted(exclude))})" if exclude else ""
            raise Unavailable(f"no healthy engine available{tried}; engines: "
                              f"{', '.join(ep.address for ep in self.endpoints)}")
        tick = next(self._tick)
        n = len(self.endpoints)
        return min(candidates, key=lambda ep: (ep.in_flight, (ep.order - tick) % n))

    def mark_down(self, endpoint: Endpoint) -> None:
        """A call found the engine unreachable: stop routing to it until a health check passes."""
        endpoint.healthy = False

    def check_all(self) -> None:
        for ep in self.endpoints:
            healthy = _check(ep.channel)
            if healthy != ep.healthy:
                log.info("engine %s is now %s", ep.address, "SERVING" if healthy else "down")
            ep.healthy = healthy

    def _watch(self) -> None:
        while not self._stop.is_set():
            self.check_all()
            self._stop.wait(self._interval)


def _check(channel: grpc.Channel) -> bool:
    try:
        resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=2.0)
        return resp.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False
