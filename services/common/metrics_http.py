"""The /metrics endpoint every service serves, on an HTTP port of its own (prometheus-client).

Each service keeps its metrics in its own ``CollectorRegistry`` (no process-global state: tests
build several in one process) and serves it with prometheus-client's own threaded HTTP server.
``--metrics-port 0`` picks a free port; ``--metrics-port-file`` tells a parent which one;
``--no-metrics`` serves nothing and records nothing.
"""
from __future__ import annotations

import logging

import prometheus_client
from prometheus_client import CollectorRegistry

from services.common.server import write_port_file

log = logging.getLogger("llmserve.metrics")

# Counters and histograms would also export a ``*_created`` timestamp series per label set: nothing
# here (nor vLLM's dashboards) reads them, and they double the size of every scrape.
prometheus_client.disable_created_metrics()


def new_registry() -> CollectorRegistry:
    """A registry for one service's metrics (importing this module turned off ``*_created``)."""
    return CollectorRegistry()


def serve_metrics(registry: CollectorRegistry, host: str, port: int, port_file: str = "") -> str:
    """Serve ``registry`` at ``http://host:port/metrics`` on a daemon thread; returns that URL."""
    server, _thread = prometheus_client.start_http_server(port, host, registry=registry)
    bound = int(server.server_port)
    write_port_file(port_file, bound)
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else host
    url = f"http://{shown}:{bound}/metrics"
    log.info("metrics at %s", url)
    return url
