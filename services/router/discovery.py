"""Engine discovery through Consul: a blocking-query watch of ``llmserve-engine`` per datacenter.

Each datacenter (a cluster) gets one thread that long-polls
``/v1/health/service/llmserve-engine?passing&dc=<dc>&index=<i>&wait=<w>`` through py-consul and
hands the full set of passing instances to ``on_change`` after every answer (an answer does not
guarantee a change; the pool diffs). When Consul cannot be reached the last set stays in force and
the watch retries with exponential backoff and jitter; an index that goes backwards (Consul
restarted, state lost) resets it to 0, as Consul's blocking-query docs require.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable

from services.common.backoff import Backoff
from services.common.consul_client import ENGINE_SERVICE, ConsulSettings, connect

log = logging.getLogger("llmserve.router.discovery")


@dataclass(frozen=True)
class EngineRecord:
    address: str                    # host:port to dial
    cluster: str                    # the datacenter it is registered in
    node: str
    models: frozenset[str]          # names/ids from the registration meta; empty = unknown


OnChange = Callable[[str, list[EngineRecord]], None]


def records_from_health(datacenter: str, entries: list[dict[str, Any]]) -> list[EngineRecord]:
    out = []
    for entry in entries:
        svc, node = entry.get("Service") or {}, entry.get("Node") or {}
        # An empty Service.Address means "the node's address" (Consul's documented fallback).
        host = svc.get("Address") or node.get("Address") or ""
        meta = svc.get("Meta") or {}
        if not host or not svc.get("Port"):
            continue
        out.append(EngineRecord(f"{host}:{svc['Port']}", datacenter, meta.get("node") or node.get("Node", ""),
                                frozenset(m for m in (meta.get("models") or "").split(",") if m)))
    return out


class ConsulDiscovery:
    def __init__(self, settings: ConsulSettings, datacenters: list[str], on_change: OnChange,
                 wait_seconds: float = 30.0, max_backoff: float = 10.0,
                 on_datacenters: Callable[[list[str]], None] = lambda dcs: None):
        self._settings = settings
        self.datacenters = list(datacenters)
        self._on_change = on_change
        self._on_datacenters = on_datacenters
        self._wait = wait_seconds
        self._max_backoff = max_backoff
        self._stop = threading.Event()
        self.ready = threading.Event()     # set once the datacenter list is known

    def start(self) -> None:
        threading.Thread(target=self._run, name="consul-discovery", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        if not self.datacenters:
            self.datacenters = self._retry(lambda c: list(c.catalog.datacenters()), "list datacenters")
            if not self.datacenters:
                return
        log.info("watching %s in datacenters %s (the first is local)", ENGINE_SERVICE, ", ".join(self.datacenters))
        self._on_datacenters(list(self.datacenters))
        self.ready.set()
        for dc in self.datacenters:
            threading.Thread(target=self._watch, args=(dc,), name=f"consul-watch-{dc}", daemon=True).start()

    def _retry(self, call: Callable[[Any], Any], what: str) -> Any:
        backoff = Backoff(maximum=self._max_backoff)
        attempts = 0
        while not self._stop.is_set():
            try:
                return call(connect(self._settings))
            except Exception as exc:  # noqa: BLE001 - any failure to reach Consul is retried
                attempts += 1
                # Once loudly, then quietly: an outage must not flood the log.
                log.log(logging.WARNING if attempts == 1 else logging.DEBUG,
                        "consul: cannot %s (%s); retrying with backoff", what, exc)
                backoff.wait(self._stop)
        return None

    def _watch(self, dc: str) -> None:
        # The blocking call's HTTP timeout must outlast the server-side wait (py-consul adds 30 s).
        client = connect(self._settings, timeout=self._wait + 30)
        index = 0
        backoff = Backoff(maximum=self._max_backoff)
        failing = False
        while not self._stop.is_set():
            try:
                got, entries = client.health.service(ENGINE_SERVICE, index=index or None, wait=f"{self._wait:g}s",
                                                     passing=True, dc=dc)
            except Exception as exc:  # noqa: BLE001 - keep the last known set and retry
                if not failing:
                    log.warning("consul: watch of %s in %s failed (%s); keeping the last known engines",
                                ENGINE_SERVICE, dc, exc)
                failing = True
                backoff.wait(self._stop)
                continue
            if failing:
                log.info("consul: watch of %s in %s restored", ENGINE_SERVICE, dc)
            failing = False
            backoff.reset()
            new_index = int(got)
            index = 0 if new_index < index else new_index   # backwards: Consul lost its state; start over
            if not self._stop.is_set():
                self._on_change(dc, records_from_health(dc, entries))
