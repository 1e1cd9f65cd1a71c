"""python -m services.router --help"""
from __future__ import annotations

import asyncio
import logging
import sys
from typing import Any

from prometheus_client import CollectorRegistry

from llmserve.v1 import llm_pb2, llm_pb2_grpc
from services.common.config import load_config
from services.common.exit import run_then_exit
from services.common.consul_client import ConsulSettings, consul_settings
from services.common.metrics_http import new_registry, serve_metrics
from services.common.security import (CLUSTER_SECRET, AccessPolicy, Dialer, ServerSecurity, load_key_file,
                                      read_secret_file)
from services.common.server import PortInUse, create_server, run_until_signal, setup_logging, write_port_file
from services.router.config import RouterConfig
from services.router.discovery import ConsulDiscovery
from services.router.engine_pool import EnginePool, PoolConfig
from services.router.metrics import RouterMetrics, instrument
from services.router.openai_http import serve_http
from services.router.policy import PolicyConfig
from services.router.key_limits import KeyLimitInterceptor, KeyLimits, Limit, MeteredRelay
from services.router.relay import Relay
from services.router.server import RouterServicer

log = logging.getLogger("llmserve.router")
LLM_SERVICE = llm_pb2.DESCRIPTOR.services_by_name["LLMService"].full_name


def main(argv: list[str] | None = None) -> None:
    config = load_config(RouterConfig, "LLMSERVE_ROUTER", argv)
    setup_logging(config.log_level)
    try:
        consul = consul_settings(config.consul_addr, config.consul_token)
        security, dialer = _security(config)
        limits = KeyLimits.from_key_file(config.api_keys_file, Limit(config.key_max_concurrent,
                                                                      config.key_tokens_per_minute))
    except ValueError as exc:  # ConfigError too: an unreadable key or secret file
        log.error("%s", exc)
        sys.exit(2)
    pool = EnginePool(PoolConfig(
        health_interval=config.health_interval, load_interval_ms=config.load_interval_ms,
        breaker_failures=config.breaker_failures, breaker_cooldown=config.breaker_cooldown,
        policy=PolicyConfig(spill_load=config.spill_load, affinity_slack=config.affinity_slack,
                            use_affinity=config.affinity_slack > 0), dialer=dialer), config.datacenter_list)
    if consul is None and not config.engine_addresses:
        log.error("--engines is empty and no Consul is configured (--consul-addr or CONSUL_HTTP_ADDR)")
        sys.exit(2)
    metrics = RouterMetrics(new_registry()) if config.metrics else None
    relay: Any = Relay(pool, config.max_attempts, config.max_resumes, config.affinity_prefix_chars, metrics)
    if limits is not None:
        relay = MeteredRelay(relay)  # counts each call's tokens against its API key, on both faces
        if metrics is not None:
            limits.on_refused = metrics.key_refused
    servicer = RouterServicer(relay)
    if metrics is not None:
        instrument(servicer, metrics)   # requests by method and status, latency, calls in flight
        metrics.watch_pool(pool)        # breaker state, health, engines per datacenter (read at scrape time)
    try:
        if metrics is not None and config.metrics_port >= 0:
            serve_metrics(metrics.registry, config.metrics_host or config.host, config.metrics_port,
                          config.metrics_port_file)
        asyncio.run(_serve(config, relay, servicer, pool, consul, security,
                           metrics.registry if metrics is not None else None, limits))
    except PortInUse as exc:  # another router on this host holds --port or --metrics-port
        log.error("%s", exc)
        sys.exit(2)


def _security(config: RouterConfig) -> tuple[ServerSecurity, Dialer]:
    """Who may call this router (API keys, mTLS), and how it reaches engines (TLS, cluster secret)."""
    api_keys = load_key_file(config.api_keys_file, "--api-keys-file")
    secret = read_secret_file(config.cluster_secret_file, "--cluster-secret-file")
    mtls = bool(config.tls_ca) and config.tls_client_auth
    policy = AccessPolicy(client_keys=api_keys, transport_authenticated=mtls, what="the router")
    if config.host not in ("127.0.0.1", "localhost", "::1") and not (api_keys or mtls):
        log.warning("listening on %s with no API keys (--api-keys-file) and no mTLS: anyone who reaches this port "
                    "can generate", config.host)
    return (ServerSecurity(policy, config.tls, config.tls_client_auth, config.reflection),
            Dialer(config.tls, ((CLUSTER_SECRET, secret),) if secret else ()))


def _describe(security: ServerSecurity) -> str:
    tls = ("mTLS" if security.tls.ca and security.require_client_cert else "TLS") if security.tls.enabled else "plaintext"
    keys = f"{len(security.policy.client_keys)} API key(s)" if security.policy.client_keys else "no API keys"
    return f"{tls}, {keys}"


async def _serve(config: RouterConfig, relay: Any, servicer: RouterServicer, pool: EnginePool,
                 consul: ConsulSettings | None, security: ServerSecurity,
                 registry: CollectorRegistry | None, limits: KeyLimits | None) -> None:
    handle = await create_server(
        [lambda s: llm_pb2_grpc.add_LLMServiceServicer_to_server(servicer, s)],
        [LLM_SERVICE], config.host, config.port, security,
        [KeyLimitInterceptor(limits)] if limits is not None else [])
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
    log.info("router listening on %s:%d (%s); %s", config.host, handle.port, _describe(security), where)
    http_servers = []  # (uvicorn server, its task): the HTTP API, and the same app on --second-http-port
    for port, port_file in ((config.http_port, config.http_port_file),
                            (config.second_http_port, config.second_http_port_file)):
        if port >= 0:
            http_servers.append(await serve_http(relay, config.host, port, port_file, security,
                                                 registry, config.http_read_timeout, limits))

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

    def on_signal() -> None:
        health_task.cancel()
        for http, _ in http_servers:
            http.should_exit = True  # stops accepting; open streams get its graceful timeout

    await run_until_signal(handle, on_stop, config.drain_seconds, on_signal=on_signal)
    for _, http_task in http_servers:
        await http_task
    await pool.stop()


if __name__ == "__main__":
    run_then_exit(main)
