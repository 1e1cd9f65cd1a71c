"""python -m services.router --help"""
from __future__ import annotations

import asyncio
import logging
import sys

from llmserve.v1 import llm_pb2, llm_pb2_grpc
from services.common.config import load_config
from services.common.consul_client import ConsulSettings, consul_settings
from services.common.metrics_http import new_registry, serve_metrics
from services.common.server import create_server, run_until_signal, setup_logging, write_port_file
from services.router.config import RouterConfig
from services.router.discovery import ConsulDiscovery
from services.router.engine_pool import EnginePool, PoolConfig
from services.router.metrics import RouterMetrics, instrument
from services.router.policy import PolicyConfig
from services.router.relay import Relay
from services.router.server import RouterServicer

log = logging.getLogger("llmserve.router")
LLM_SERVICE = llm_pb2.DESCRIPTOR.services_by_name["LLMService"].full_name


def main(argv: list[str] | None = None) -> None:
    config = load_config(RouterConfig, "LLMSERVE_ROUTER", argv)
    setup_logging(config.log_level)
    try:
        consul = consul_settings(config.consul_addr, config.consul_token)
    except ValueError as exc:
        log.error("%s", exc)
        sys.exit(2)
    pool = EnginePool(PoolConfig(
        health_interval=config.health_interval, load_interval_ms=config.load_interval_ms,
        breaker_failures=config.breaker_failures, breaker_cooldown=config.breaker_cooldown,
        policy=PolicyConfig(spill_load=config.spill_load, affinity_slack=config.affinity_slack,
                            use_affinity=config.affinity_slack > 0)), config.datacenter_list)
    if consul is None and not config.engine_addresses:
        log.error("--engines is empty and no Consul is configured (--consul-addr or CONSUL_HTTP_ADDR)")
        sys.exit(2)
    metrics = RouterMetrics(new_registry()) if config.metrics else None
    relay = Relay(pool, config.max_attempts, config.max_resumes, config.affinity_prefix_chars, metrics)
    servicer = RouterServicer(relay)
    if metrics is not None:
        instrument(servicer, metrics)   # requests by method and status, latency, calls in flight
        metrics.watch_pool(pool)        # breaker state, health, engines per datacenter (read at scrape time)
        serve_metrics(metrics.registry, config.host, config.metrics_port, config.metrics_port_file)
    asyncio.run(_serve(config, servicer, pool, consul))


async def _serve(config: RouterConfig, servicer: RouterServicer, pool: EnginePool,
                 consul: ConsulSettings | None) -> None:
    handle = await create_server(
        [lambda s: llm_pb2_grpc.add_LLMServiceServicer_to_server(servicer, s)],
        [LLM_SERVICE], config.host, config.port)
    pool.start()
    discovery = None
    if consul is None:
        pool.add_static(config.engine_addresses)
        where = "static engines " + ", ".join(config.engine_addresses)
    else:
        members = pool.from_other_thread()
        discovery = ConsulDiscovery(consul, config.datacenter_list, members.replace_cluster, config.consul_wait,
                                    on_datacenters=members.set_cluster_order)
        discovery.start()
        where = f"engines from Consul at {consul.host}:{consul.port}"
    write_port_file(config.port_file, handle.port)
    log.info("router listening on %s:%d; %s", config.host, handle.port, where)

    async def follow_health() -> None:
        # The router is SERVING while at least one engine is.
        serving = None
        while True:
            now = pool.any_healthy()
            if now != serving:
                await handle.set_serving(now, [LLM_SERVICE])
                log.info("router %s", "SERVING" if now else "NOT_SERVING (no healthy engine)")
                serving = now
            await asyncio.sleep(config.health_interval / 2)

    health_task = asyncio.create_task(follow_health())

    def on_stop() -> None:
        if discovery is not None:
            discovery.stop()

    await run_until_signal(handle, on_stop, on_signal=health_task.cancel)
    await pool.stop()


if __name__ == "__main__":
    main()
