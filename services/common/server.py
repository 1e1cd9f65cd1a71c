"""Server bootstrap shared by router, engine and worker.

Every server is a ``grpc.aio`` server: a call spends its life waiting (on an engine, on the
engine loop, on the compute thread), and a thread per open stream cost more CPU per token than
the work itself, on the model's cores.

``create_server`` builds one with the error-mapping and request-decoding interceptors, the
standard ``grpc.health.v1`` servicer (every service starts NOT_SERVING and flips to SERVING when it
is ready) and server reflection, and binds it (port 0 picks a free port, as tests do), with the credentials and access
policy of ``services.common.security``. ``run_until_signal`` waits for SIGTERM/SIGINT and then
drains: NOT_SERVING, new calls refused (UNAVAILABLE, so a router retries them elsewhere), calls in
flight finish within the drain time.
"""
from __future__ import annotations

import asyncio
import inspect
import logging
import signal
import threading
import time
from typing import AsyncIterator, Callable, Iterable, NamedTuple

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common.error_mapping import ErrorMappingInterceptor
from services.common.errors import Unavailable
from services.common.request_decoding import DecodingInterceptor
from services.common.security import PLAINTEXT, Guard, ServerSecurity, TlsFiles, channel

log = logging.getLogger("llmserve.server")

# Generated-code hook: add_XServicer_to_server(servicer, server).
Registration = Callable[[grpc.aio.Server], None]

# Larger than the 4 MiB default: a batch of long completions or an embedding list can exceed it.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
# Calls gRPC core may hold for a server before the service has picked them up. Past grpc's default
# (1,000, then random drops up to 3,000) a burst of new calls that arrives while the event loop is
# busy loses some of them, cancelled (CANCELLED, details "CANCELLED") before any of our code, or log,
# sees them. Held instead, each call reaches the service, whose admission control answers it
# (RESOURCE_EXHAUSTED with a retry hint when its queue is full).
MAX_PENDING_CALLS = 20_000
SERVER_OPTIONS = [
    *CHANNEL_OPTIONS,
    # A port another process listens on is refused, not shared (gRPC's default on Linux is SO_REUSEPORT):
    # a second engine on a host must not split the first one's calls with it.
    ("grpc.so_reuseport", 0),
    ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
    ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_CALLS),
]


class PortInUse(OSError):
    """A port this service was told to listen on is taken; the message names the flag that moves it."""


class ServerHandle(NamedTuple):
    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer

    async def set_serving(self, serving: bool, service_names: Iterable[str] = ()) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *service_names):
            await self.health.set(name, status)


async def create_server(registrations: Iterable[Registration], service_full_names: Iterable[str], host: str,
                        port: int, security: ServerSecurity = ServerSecurity(),
                        interceptors: Iterable[grpc.aio.ServerInterceptor] = ()) -> ServerHandle:
    """Build and start a server; returns it with its bound port and health servicer (NOT_SERVING).

    ``interceptors``: the service's own, inside the guard and the error mapping (what they raise
    maps to a status) and outside the request parsing. Call from the event loop the server will run on.
    """
    # The guard first: a refused call runs no service code. An open policy needs no guard at all.
    guard = [] if security.policy.open else [Guard(security.policy)]
    # Then the error mapping, around the parsing of the request's bytes (a bad message: INVALID_ARGUMENT).
    server = grpc.aio.server(interceptors=[*guard, ErrorMappingInterceptor(), *interceptors, DecodingInterceptor()],
                             options=SERVER_OPTIONS)
    health_servicer = health.aio.HealthServicer()
    for register in registrations:
        register(server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = list(service_full_names)
    if security.reflection:
        reflection.enable_server_reflection(
            [*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME], server
        )
    credentials = security.tls.server_credentials(security.require_client_cert)
    try:
        if credentials is None:
            bound = server.add_insecure_port(f"{host}:{port}")
        else:
            bound = server.add_secure_port(f"{host}:{port}", credentials)
    except RuntimeError:  # grpc.aio: "Failed to bind to address"
        bound = 0
    if bound == 0:
        raise PortInUse(f"cannot listen on {host}:{port}: the port is in use (another service on this host?); "
                        "start this one with --port 0 (a free port) or another --port")
    await server.start()
    handle = ServerHandle(server, bound, health_servicer)
    await handle.set_serving(False, names)
    return handle


async def run_until_signal(handle: ServerHandle, on_stop: Callable[[], object] = lambda: None,
                           drain_seconds: float = 30.0, on_signal: Callable[[], object] = lambda: None) -> None:
    """Wait for SIGTERM/SIGINT, then drain and stop.

    Draining: ``on_signal`` (e.g. leave service discovery), NOT_SERVING, and the server stops
    accepting: a new call is refused with UNAVAILABLE (a router fails it over to another engine);
    calls in flight get up to ``drain_seconds`` to finish, then are cancelled. ``on_stop`` last.
    """
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda sig=sig: (log.info("signal %s: draining (up to %.0fs for calls in "
                                                               "flight)", sig.name, drain_seconds), stop.set()))
    await stop.wait()
    started = time.monotonic()
    on_signal()
    await handle.health.enter_graceful_shutdown()
    await handle.server.stop(drain_seconds)
    log.info("drained in %.1fs; stopping", time.monotonic() - started)
    on_stop()


def time_remaining(context: grpc.ServicerContext) -> float | None:
    """Seconds left of the call's deadline, or None when it has none.

    grpcio reports "no deadline" as an enormous number; passed on as a timeout it overflows into
    an immediate DEADLINE_EXCEEDED, so it is mapped to None here.
    """
    remaining = context.time_remaining()
    if remaining is None or remaining > 10**7:
        return None
    return float(remaining)


def write_port_file(path: str, port: int) -> None:
    """Tell a parent process which port was bound (with ``--port 0``); written atomically."""
    if not path:
        return
    import os

    with open(path + ".tmp", "w") as f:
        f.write(str(port))
    os.replace(path + ".tmp", path)


def setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def wait_for_serving(address: str, deadline_seconds: float, service: str = "",
                     is_alive: Callable[[], bool] = lambda: True, tls: TlsFiles = PLAINTEXT) -> None:
    """Poll ``grpc.health.v1`` at ``address`` until SERVING; raise TimeoutError at the deadline.

    ``is_alive`` lets a caller that started the server process stop waiting when it died.
    """
    end = time.monotonic() + deadline_seconds
    with channel(address, tls) as health_channel:
        stub = health_pb2_grpc.HealthStub(health_channel)
        while True:
            if not is_alive():
                raise RuntimeError(f"server at {address} exited before it was SERVING")
            try:
                resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1.0)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            remaining = end - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{address} not SERVING after {deadline_seconds:.0f}s")
            threading.Event().wait(min(0.1, remaining))


class LazyServicer:
    """Stands in for a servicer that exists only once the service is ready (its model loaded).

    Registered at server start so health and reflection answer at once; until ``holder[key]``
    is set, every rpc fails with UNAVAILABLE and ``message``. ``servicer_type`` tells which of its
    methods stream (async generators) and which return one response.
    """

    def __init__(self, holder: dict[str, object], key: str, message: str, servicer_type: type):
        self._holder = holder
        self._key = key
        self._message = message
        self._type = servicer_type

    def _target(self) -> object:
        target = self._holder.get(self._key)
        if target is None:
            raise Unavailable(self._message)
        return target

    def __getattr__(self, name: str) -> object:
        if inspect.isasyncgenfunction(getattr(self._type, name)):
            async def stream(request: object, context: object) -> AsyncIterator[object]:
                async for item in getattr(self._target(), name)(request, context):
                    yield item
            return stream

        async def unary(request: object, context: object) -> object:
            return await getattr(self._target(), name)(request, context)
        return unary
