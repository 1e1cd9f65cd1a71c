"""Consul access shared by engine (registration) and router (discovery), through py-consul.

The address and ACL token come from the service's own flag/env (``--consul-addr``,
``--consul-token``) or else from Consul's standard ``CONSUL_HTTP_ADDR`` / ``CONSUL_HTTP_TOKEN``, so
an environment set up for the ``consul`` CLI works unchanged. Empty address = Consul is off.
"""
from __future__ import annotations

import os
from typing import NamedTuple
from urllib.parse import urlsplit

import consul

ENGINE_SERVICE = "llmserve-engine"     # the Consul service name engines register under


class ConsulSettings(NamedTuple):
    scheme: str
    host: str
    port: int
    token: str | None


def consul_settings(addr: str, token: str) -> ConsulSettings | None:
    """The flag values, else the standard env names; None when no address is configured."""
    addr = addr or os.environ.get("CONSUL_HTTP_ADDR", "")
    if not addr:
        return None
    # CONSUL_HTTP_ADDR is host:port or http(s)://host:port (the consul CLI accepts both).
    parts = urlsplit(addr if "://" in addr else f"http://{addr}")
    if not parts.hostname:
        raise ValueError(f"consul address {addr!r} is not host:port or http(s)://host:port")
    return ConsulSettings(parts.scheme or "http", parts.hostname, parts.port or 8500,
                          token or os.environ.get("CONSUL_HTTP_TOKEN") or None)


def connect(settings: ConsulSettings, timeout: float = 10.0) -> consul.Consul:
    # host and port are passed explicitly: py-consul reads CONSUL_HTTP_ADDR only when both are None,
    # and here the flag may differ from the env. (It does let CONSUL_HTTP_TOKEN override `token`.)
    return consul.Consul(host=settings.host, port=settings.port, token=settings.token, scheme=settings.scheme,
                         connections_timeout=timeout)


def go_duration(seconds: float) -> str:
    """Seconds → a Go duration string, the form Consul documents for check timings."""
    return f"{int(seconds * 1000)}ms"
