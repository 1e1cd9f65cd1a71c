"""The engines a router knows, their health and load, and the choice of one per request.

Membership comes from a static list (``--engines``, cluster ``local``) or from Consul discovery
(``replace_cluster`` per datacenter, engines added and removed at run time). Every endpoint is
health-checked through ``grpc.health.v1``, streams its load (``LoadWatcher``) and has a circuit
breaker; ``pick`` hands the routable ones to the pure policy (``policy.rank``). An engine that
leaves the pool stops getting new calls at once; its channel closes when its last call ends, so a
draining engine finishes what it serves.

The pool lives on the router's event loop: each engine has one asyncio channel (health checks, the
load watch and the relayed calls), the health checks run as one task, and membership changes from
other threads (Consul discovery) come in through ``call_soon_threadsafe``.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from functools import cached_property

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmserve.v1 import engine_admin_pb2, llm_pb2_grpc
from services.common.errors import NotFound, Unavailable, clip
from services.common.security import Dialer
from services.common.server import CHANNEL_OPTIONS
from services.router import policy
from services.router.breaker import CircuitBreaker
from services.router.discovery import EngineRecord
from services.router.load_watch import LoadWatcher

log = logging.getLogger("llmserve.router.pool")
STATIC_CLUSTER = "local"


@dataclass(frozen=True)
class PoolConfig:
    health_interval: float = 1.0
    load_interval_ms: int = 100
    breaker_failures: int = 3
    breaker_cooldown: float = 1.0
    policy: policy.PolicyConfig = policy.PolicyConfig()
    dialer: Dialer = Dialer()            # TLS and the cluster secret, for every call to an engine


@dataclass(eq=False)
class Endpoint:
    address: str
    cluster: str
    channel: grpc.aio.Channel                        # health checks, the load watch and relayed calls
    breaker: CircuitBreaker
    node: str = ""
    models: frozenset[str] = frozenset()
    healthy: bool = False
    in_flight: int = 0
    report: engine_admin_pb2.EngineLoad | None = None
    watcher: LoadWatcher | None = None

    @cached_property
    def llm(self) -> llm_pb2_grpc.LLMServiceStub:
        return llm_pb2_grpc.LLMServiceStub(self.channel)

    async def close(self) -> None:
        if self.watcher is not None:
            self.watcher.stop()
        await self.channel.close()

    def acquire(self) -> None:
        self.in_flight += 1

    def release(self) -> None:
        self.in_flight -= 1

    def view(self) -> policy.EngineView:
        r = self.report
        if r is None:
            return policy.EngineView(self.address, self.cluster, self.models, frozenset(), in_flight=self.in_flight)
        return policy.EngineView(
            self.address, self.cluster, self.models, frozenset(r.loaded_models), r.num_waiting, r.num_running,
            r.num_kv_blocks_used / r.num_kv_blocks_total if r.num_kv_blocks_total else 0.0,
            r.max_num_seqs, self.in_flight)


class EnginePool:
    def __init__(self, config: PoolConfig, cluster_order: list[str] | None = None):
        self.config = config
        self.cluster_order = list(cluster_order or [STATIC_CLUSTER])
        self._endpoints: dict[str, Endpoint] = {}
        self._retired: list[Endpoint] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def endpoints(self) -> list[Endpoint]:
        return list(self._endpoints.values())

    # -- membership (on the event loop) ---------------------------------------------------------

    def set_cluster_order(self, clusters: list[str]) -> None:
        """Clusters in spill-over order, the local one first."""
        self.cluster_order = list(clusters)

    def add_static(self, addresses: list[str]) -> None:
        self.replace_cluster(STATIC_CLUSTER, [EngineRecord(a, STATIC_CLUSTER, "", frozenset()) for a in addresses])

    def replace_cluster(self, cluster: str, records: list[EngineRecord]) -> None:
        """Make ``records`` the engines of ``cluster``: add the new, retire the gone, update the rest."""
        wanted = {r.address: r for r in records}
        for address, ep in list(self._endpoints.items()):
            if ep.cluster == cluster and address not in wanted:
                del self._endpoints[address]
                self._retired.append(ep)
                log.info("engine %s left cluster %s", ep.address, cluster)
                if ep.watcher is not None:
                    ep.watcher.stop()
        for address, record in wanted.items():
            ep = self._endpoints.get(address)
            if ep is not None:
                ep.models, ep.node, ep.cluster = record.models, record.node, record.cluster
                continue
            ep = self._endpoints[address] = self._new_endpoint(record)
            log.info("engine %s joined cluster %s (node %s, models %s)", ep.address, cluster, ep.node or "-",
                     ",".join(sorted(ep.models)) or "unknown")
            ep.watcher = LoadWatcher(ep.channel, ep.address, self.config.load_interval_ms,
                                     lambda load, ep=ep: setattr(ep, "report", load), self.config.dialer.metadata)
            ep.watcher.start()
            asyncio.get_running_loop().create_task(self._check(ep, timeout=1.0))

    def from_other_thread(self) -> "ThreadSafePool":
        """Membership calls for another thread (discovery): each runs on the pool's event loop."""
        assert self._loop is not None, "start the pool first"
        return ThreadSafePool(self, self._loop)

    def _new_endpoint(self, record: EngineRecord) -> Endpoint:
        channel = self.config.dialer.aio_channel(record.address, options=CHANNEL_OPTIONS)
        return Endpoint(record.address, record.cluster, channel,
                        CircuitBreaker(self.config.breaker_failures, self.config.breaker_cooldown),
                        node=record.node, models=record.models)

    # -- choice -------------------------------------------------------------------------------

    def any_healthy(self) -> bool:
        return any(ep.healthy for ep in self.endpoints)

    def rank(self, model: str, prefix: str, exclude: set[str] = frozenset()) -> list[Endpoint]:  # type: ignore[assignment]
        now = time.monotonic()
        usable = {ep.address: ep for ep in self.endpoints
                  if ep.healthy and ep.address not in exclude and ep.breaker.allows(now)}
        ranked = policy.rank([ep.view() for ep in usable.values()], model, prefix, self.cluster_order,
                             self.config.policy)
        return [usable[v.key] for v in ranked]

    def pick(self, model: str = "", prefix: str = "", exclude: set[str] = frozenset()) -> Endpoint:  # type: ignore[assignment]
        ranked = self.rank(model, prefix, exclude)
        if ranked:
            ranked[0].breaker.on_call()
            return ranked[0]
        known = self.endpoints
        tried = f" (tried {', '.join(sorted(exclude))})" if exclude else ""
        healthy = [ep for ep in known if ep.healthy]
        if model and healthy and not any(policy.serves(ep.view(), model) for ep in healthy):
            served = sorted({m for ep in healthy for m in ep.models})
            raise NotFound(f"unknown model {clip(model)}: no engine serves it (served: {', '.join(served)}); "
                           "call llmserve.v1.LLMService/ListModels to see the models")
        raise Unavailable(f"no healthy engine available{tried}; engines: "
                          f"{', '.join(ep.address for ep in known) or 'none discovered yet'}")

    def mark_down(self, endpoint: Endpoint) -> None:
        """A call found the engine unreachable: stop routing to it until a health check passes."""
        endpoint.healthy = False
        endpoint.breaker.on_failure(time.monotonic())

    def on_success(self, endpoint: Endpoint) -> None:
        endpoint.breaker.on_success()

    # -- background -----------------------------------------------------------------------------

    def start(self) -> None:
        """Start the health checks; call on the event loop."""
        self._loop = asyncio.get_running_loop()
        self._task = self._loop.create_task(self._watch(), name="engine-health")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for ep in [*self.endpoints, *self._retired]:
            await ep.close()

    async def check_all(self) -> None:
        await asyncio.gather(*(self._check(ep) for ep in self.endpoints))
        done = [ep for ep in self._retired if ep.in_flight <= 0]
        self._retired = [ep for ep in self._retired if ep.in_flight > 0]
        for ep in done:
            await ep.close()

    async def _check(self, ep: Endpoint, timeout: float = 2.0) -> None:
        try:
            resp = await health_pb2_grpc.HealthStub(ep.channel).Check(health_pb2.HealthCheckRequest(service=""),
                                                                      timeout=timeout)
            healthy = resp.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            healthy = False
        if healthy != ep.healthy:
            log.info("engine %s is now %s", ep.address, "SERVING" if healthy else "down")
        ep.healthy = healthy

    async def _watch(self) -> None:
        while True:
            await self.check_all()
            await asyncio.sleep(self.config.health_interval)


class ThreadSafePool:
    """The pool's membership calls, made from another thread: each is handed to the pool's loop."""

    def __init__(self, pool: EnginePool, loop: asyncio.AbstractEventLoop):
        self._pool = pool
        self._loop = loop

    def replace_cluster(self, cluster: str, records: list[EngineRecord]) -> None:
        self._loop.call_soon_threadsafe(self._pool.replace_cluster, cluster, records)

    def set_cluster_order(self, clusters: list[str]) -> None:
        self._loop.call_soon_threadsafe(self._pool.set_cluster_order, clusters)
