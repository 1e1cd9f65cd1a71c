"""The /metrics endpoint every service serves, on an HTTP port of its own (prometheus-client).

Each service keeps its metrics in its own ``CollectorRegistry`` (no process-global state: tests
build several in one process) and serves it with prometheus-client's own threaded HTTP server.
``--metrics-port 0`` picks a free port; ``--metrics-port-file`` tells a parent which one;
``--no-metrics`` serves nothing and records nothing.
"""
from __future__ import annotations

import errno
import logging
import threading
from typing import Any, Callable, Iterable
from wsgiref.simple_server import WSGIRequestHandler, make_server

import prometheus_client
from prometheus_client import CollectorRegistry, generate_latest, make_wsgi_app
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, ThreadingWSGIServer

from services.common.server import PortInUse, write_port_file

log = logging.getLogger("llmserve.metrics")

# Counters and histograms would also export a ``*_created`` timestamp series per label set: nothing
# here (nor vLLM's dashboards) reads them, and they double the size of every scrape.
prometheus_client.disable_created_metrics()


def new_registry() -> CollectorRegistry:
    """A registry for one service's metrics (importing this module turned off ``*_created``)."""
    return CollectorRegistry()


def serve_metrics(registry: CollectorRegistry, host: str, port: int, port_file: str = "") -> str:
    """Serve ``registry`` at ``http://host:port/metrics`` on a daemon thread; returns that URL.

    A port in use is ``PortInUse``, naming --metrics-port (a second engine on a host must move its own)."""
    try:
        server = make_server(host, port, _classic_text_only(make_wsgi_app(registry)), ThreadingWSGIServer,
                             handler_class=_QuietHandler)
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        raise PortInUse(f"cannot serve /metrics on {host}:{port}: the port is in use (another engine on this "
                        "host?); start this one with --metrics-port 0 (a free port), another --metrics-port, "
                        "or --no-metrics") from None
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    bound = int(server.server_port)
    write_port_file(port_file, bound)
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else host
    url = f"http://{shown}:{bound}/metrics"
    log.info("metrics at %s", url)
    return url


def _classic_text_only(app: Callable[..., Iterable[bytes]]) -> Callable[..., Iterable[bytes]]:
    """Always answer in the classic text format (0.0.4), as vLLM's scrapes read.

    Prometheus asks for OpenMetrics first, and prometheus-client 0.26's OpenMetrics writer escapes
    ':' in sample names to '_' (``vllm:generation_tokens_total`` became
    ``vllm_generation_tokens_total`` while its ``# TYPE`` line kept the colon), which would break
    every vLLM dashboard query. The classic format keeps the names as they are.
    """
    def classic(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        environ = {**environ, "HTTP_ACCEPT": "text/plain;version=0.0.4"}
        return app(environ, start_response)
    return classic


def with_metrics(app: Callable[..., Any], registry: CollectorRegistry) -> Callable[..., Any]:
    """ASGI: ``GET /metrics`` answers ``registry`` (classic text, as the metrics port does); any other
    request goes to ``app``. Lets an HTTP face serve its metrics behind its own TLS and keys."""
    async def asgi(scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] != "http" or scope["path"] != "/metrics":
            await app(scope, receive, send)
            return
        if scope["method"] not in ("GET", "HEAD"):
            status, body, kind = 405, b"GET /metrics\n", b"text/plain"
        else:
            status, body, kind = 200, generate_latest(registry), CONTENT_TYPE_PLAIN_0_0_4.encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", kind), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else body})
    return asgi


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass  # one line per scrape would drown the service's log
