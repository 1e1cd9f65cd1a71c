"""The router's pool tells busy from down: a health check that gets no answer in time keeps the
engine in the pool while its load stream is alive, and marks it down once that stream is silent."""
from __future__ import annotations

import asyncio
import threading
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.router.breaker import CircuitBreaker
from services.router.engine_pool import Endpoint, EnginePool, PoolConfig
from tests.helpers import health_only_server


class SlowHealth(health_pb2_grpc.HealthServicer):
    def __init__(self) -> None:
        self.release = threading.Event()

    def Check(self, request, context):  # noqa: N802 - the generated name
        self.release.wait(5)             # busier than the check's timeout
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


def test_a_late_health_check_keeps_a_busy_engine_and_a_silent_one_goes_down():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    slow = SlowHealth()
    health_pb2_grpc.add_HealthServicer_to_server(slow, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    async def check_twice() -> list[bool]:
        pool = EnginePool(PoolConfig(busy_grace=3.0))
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        ep = Endpoint(f"127.0.0.1:{port}", "local", channel, CircuitBreaker(), healthy=True)
        pool._endpoints[ep.address] = ep
        seen = []
        ep.report_at = time.monotonic()           # its load stream just reported
        await pool.check_all()
        seen.append(ep.healthy)
        ep.report_at = time.monotonic() - 10      # silent too: down
        await pool.check_all()
        seen.append(ep.healthy)
        await channel.close()
        return seen

    try:
        busy, silent = asyncio.run(check_twice())
        assert busy, "a busy engine (late health check, live load stream) was marked down"
        assert not silent
    finally:
        slow.release.set()
        server.stop(0)


def test_an_engine_that_says_not_serving_is_down_whatever_its_load_stream():
    async def check(address: str) -> bool:
        pool = EnginePool(PoolConfig(busy_grace=3.0))
        async with grpc.aio.insecure_channel(address) as channel:
            ep = Endpoint(address, "local", channel, CircuitBreaker(), healthy=True)
            pool._endpoints[ep.address] = ep
            ep.report_at = time.monotonic()       # a live load stream does not save it
            await pool.check_all()
            return ep.healthy

    with health_only_server(health_pb2.HealthCheckResponse.NOT_SERVING) as address:
        assert not asyncio.run(check(address))
