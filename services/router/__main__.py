"""python -m services.router --help"""
from __future__ import annotations

import asyncio
import logging
import sys

from llmserve.v1 import llm_pb2, llm_pb2_grpc
from services.common.config import load_config
from services.common.consul_client import consul_settings
from services.common.security import (CLUSTER_SECRET, AccessPolicy, Dialer, ServerSecurity, load_key_file,
                                      read_secret_file)
from services.common.server import create_server, run_until_signal, setup_logging, write_port_file
from services.router.config import RouterConfig
from services.router.discovery import ConsulDiscovery
from services.router.engine_pool import EnginePool, PoolConfig
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
        security, dialer = _security(config)
    except ValueError as exc:  # ConfigError too: an unreadable key or secret file
        log.error("%s", exc)
        sys.exit(2)
    pool = EnginePool(PoolConfig(
        health_interval=config.health_interval, load_interval_ms=config.load_interval_ms,
        breaker_failures=config.breaker_failures, breaker_cooldown=config.breaker_cooldown,
        policy=PolicyConfig(spill_load=config.spill_load, affinity_slack=config.affinity_slack,
                            use_affinity=config.affinity_slack > 0), dialer=dialer), config.datacenter_list)
    discovery = None
    if consul is None:
        if not config.engine_addresses:
            log.error("--engines is empty and no Consul is configured (--consul-addr or CONSUL_HTTP_ADDR)")
            sys.exit(2)
        pool.add_static(config.engine_addresses)
        where = "static engines " + ", ".join(config.engine_addresses)
    else:
        discovery = ConsulDiscovery(consul, config.datacenter_list, pool.replace_cluster, config.consul_wait,
                                    on_datacenters=pool.set_cluster_order)
        where = f"engines from Consul at {consul.host}:{consul.port}"
    servicer = RouterServicer(Relay(pool, config.max_attempts, config.max_resumes, config.affinity_prefix_chars))
    asyncio.run(_serve(config, servicer, pool, discovery, where, security))


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


async def _serve(config: RouterConfig, servicer: RouterServicer, pool: EnginePool,
                 discovery: ConsulDiscovery | None, where: str, security: ServerSecurity) -> None:
    handle = await create_server([lambda s: llm_pb2_grpc.add_LLMServiceServicer_to_server(servicer, s)],
                                 [LLM_SERVICE], config.host, config.port, security)
    write_port_file(config.port_file, handle.port)
    log.info("router listening on %s:%d (%s); %s", config.host, handle.port, _describe(security), where)

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

    pool.start()
    if discovery is not None:
        discovery.start()
    health_task = asyncio.create_task(follow_health())

    def on_stop() -> None:
        if discovery is not None:
            discovery.stop()
        pool.stop()

    await run_until_signal(handle, on_stop, config.drain_seconds, on_signal=health_task.cancel)


def _describe(security: ServerSecurity) -> str:
    tls = ("mTLS" if security.tls.ca and security.require_client_cert else "TLS") if security.tls.enabled else "plaintext"
    keys = f"{len(security.policy.client_keys)} API key(s)" if security.policy.client_keys else "no API keys"
    return f"{tls}, {keys}"


if __name__ == "__main__":
    main()
