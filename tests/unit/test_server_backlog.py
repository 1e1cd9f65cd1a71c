"""A burst of calls that arrives while a server's event loop is busy waits in gRPC core until the
service picks it up: none is cancelled there unseen (grpc's default backlog of 1,000 cancelled some,
CANCELLED with details "CANCELLED" and no log line anywhere)."""
from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter

import grpc

from services.common.server import create_server

BURST = 1500   # past grpc's default backlog (1,000)


STALLING = threading.Event()


async def _answer(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    if request == b"stall":
        STALLING.set()
        time.sleep(2.0)   # the loop is busy (on purpose, blocking): the burst piles up in gRPC core
    return b"ok"


def _register(server: grpc.aio.Server) -> None:
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "test.Backlog", {"Call": grpc.unary_unary_rpc_method_handler(_answer)})])


async def _burst() -> tuple[Counter, list[tuple[str, str]]]:
    handle = await create_server([_register], ["test.Backlog"], "127.0.0.1", 0)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
            call = channel.unary_unary("/test.Backlog/Call")
            assert await call(b"warm", timeout=10) == b"ok"
            STALLING.clear()
            stall = asyncio.ensure_future(call(b"stall", timeout=30))
            deadline = time.monotonic() + 10
            while not STALLING.is_set():   # until the stall has started: the loop then answers nothing for 2 s
                assert time.monotonic() < deadline, "the stalling call never reached the service"
                await asyncio.sleep(0.001)

            async def one() -> tuple[str, str]:
                try:
                    await call(b"x", timeout=60)
                    return ("OK", "")
                except grpc.aio.AioRpcError as exc:
                    return (exc.code().name, exc.details() or "")

            results = await asyncio.gather(*[one() for _ in range(BURST)])
            await stall
    finally:
        await handle.server.stop(None)
    return Counter(code for code, _ in results), [r for r in results if r[0] != "OK"][:3]


def test_a_burst_past_grpcs_default_backlog_reaches_the_service():
    started = time.monotonic()
    codes, failures = asyncio.run(_burst())
    assert codes == Counter({"OK": BURST}), (codes, failures)
    assert time.monotonic() - started < 60
