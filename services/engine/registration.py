"""The engine's entry in Consul: register on start, keep it there, deregister on graceful shutdown.

The service ``llmserve-engine`` carries an explicit address (the Consul agent fills in nothing
useful for containers or loopback) and a gRPC health check that the agent runs against this
engine's ``grpc.health.v1`` with an explicit ``CheckID``: ``NOT_SERVING`` during drain or a dead
process turns the check critical, which drops the engine from routers' ``?passing`` watches, and
``DeregisterCriticalServiceAfter`` removes an engine that died without deregistering.

The check starts ``critical`` (Consul's default): nothing is routed here until the agent's own probe
has reached the engine, over TLS where it is on. The entry is kept: every ``resync_interval`` the
engine asks its agent for its services and registers again if the agent lost it: an agent restarted
without its data directory, or a reap because the first probe, staggered over one interval, came
later than a short ``DeregisterCriticalServiceAfter``. Consul's own agents re-sync their local state to
the servers the same way.
"""
from __future__ import annotations

import logging
import socket
import threading
from dataclasses import dataclass

from services.common.backoff import Backoff
from services.common.consul_client import ENGINE_SERVICE, ConsulSettings, connect, go_duration

log = logging.getLogger("llmserve.engine.consul")


@dataclass(frozen=True)
class EngineRegistration:
    address: str                 # host the agent and routers dial
    port: int
    node: str
    models: tuple[str, ...]      # names and ids this engine serves (all loaded, for now)
    check_interval: float
    check_timeout: float
    deregister_after: float
    resync_interval: float       # seconds between asks that the agent still has this engine
    tls: bool = False            # the engine serves TLS: the agent's check must too (GRPCUseTLS)

    @property
    def service_id(self) -> str:
        return f"{ENGINE_SERVICE}-{self.node}-{self.address}-{self.port}"


class ConsulRegistrar:
    def __init__(self, settings: ConsulSettings, registration: EngineRegistration):
        self._client = connect(settings)
        self.registration = registration
        self.datacenter = ""
        self.registered = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()   # a (re-)registration never lands after the drain's deregistration

    def start(self) -> None:
        """Register now, or keep retrying in the background: an engine serves without Consul."""
        try:
            self.register()
        except Exception as exc:  # noqa: BLE001 - any failure to reach Consul is retried
            log.warning("cannot register in Consul (%s); retrying in the background", exc)
        threading.Thread(target=self._keep, name="consul-register", daemon=True).start()

    def _keep(self) -> None:
        """Register until it succeeds, then make sure the agent keeps the entry."""
        backoff = Backoff(initial=0.5)
        while not self.registered.is_set():
            if backoff.wait(self._stop):
                return
            try:
                self.register()
            except Exception as exc:  # noqa: BLE001
                log.debug("Consul registration failed again: %s", exc)
        while not self._stop.wait(self.registration.resync_interval):
            try:
                if self.registration.service_id in self._client.agent.services():
                    continue
                log.warning("Consul no longer has %s; registering again", self.registration.service_id)
                self.register()
            except Exception as exc:  # noqa: BLE001 - Consul away: keep serving, try at the next interval
                log.debug("cannot confirm the Consul registration: %s", exc)

    def register(self) -> None:
        with self._lock:
            if not self._stop.is_set():   # draining: being gone is the point
                self._register()

    def _register(self) -> None:
        r = self.registration
        self.datacenter = str(self._client.agent.self()["Config"]["Datacenter"])
        check = {
            "CheckID": f"service:{r.service_id}",   # explicit: py-consul's list form would number it
            "Name": f"llmserve engine {r.node} gRPC health",
            "GRPC": f"{r.address}:{r.port}",
            "Interval": go_duration(r.check_interval),
            "Timeout": go_duration(r.check_timeout),
            "DeregisterCriticalServiceAfter": go_duration(r.deregister_after),
        }
        if r.tls:
            # The agent verifies the engine's certificate with its own CA (ca_file) and, for mTLS,
            # presents its own certificate: that needs the agent's enable_agent_tls_for_checks.
            # TLSSkipVerify stays false: a check that trusts any certificate proves nothing.
            check["GRPCUseTLS"] = True
        models = ",".join(r.models)
        self._client.agent.service.register(
            ENGINE_SERVICE, service_id=r.service_id, address=r.address, port=r.port,
            tags=[f"node={r.node}", f"cluster={self.datacenter}"],
            meta={"node": r.node, "cluster": self.datacenter, "models": models},
            check=check)
        self.registered.set()
        log.info("registered %s in Consul datacenter %s (%s:%d)", r.service_id, self.datacenter, r.address, r.port)

    def deregister(self) -> None:
        with self._lock:
            self._stop.set()
        if not self.registered.is_set():
            return
        try:
            self._client.agent.service.deregister(self.registration.service_id)
            log.info("deregistered %s from Consul", self.registration.service_id)
        except Exception as exc:  # noqa: BLE001 - shutting down: the critical check cleans up anyway
            log.warning("could not deregister %s from Consul: %s", self.registration.service_id, exc)


def advertised_host(listen_host: str, advertise: str) -> str:
    """The address to register: explicit, else the listen address unless it is a wildcard."""
    if advertise:
        return advertise
    if listen_host in ("0.0.0.0", "::", ""):
        return socket.gethostname()  # in compose this is the container's resolvable name
    return listen_host
