"""python -m services.engine --help"""
from __future__ import annotations

import asyncio
import logging
import socket
import sys
from pathlib import Path

from llmserve.v1 import engine_admin_pb2, engine_admin_pb2_grpc, llm_pb2, llm_pb2_grpc
from services import REPO_ROOT
from services.common.config import ConfigError, load_config
from services.common.exit import run_then_exit
from services.common.consul_client import consul_settings
from services.common.errors import ServiceError
from services.common.metrics_http import new_registry, serve_metrics
from services.common.model_source import resolve_model
from services.common.security import (CLUSTER_SECRET, AccessPolicy, KeySet, ServerSecurity, load_key_file,
                                      read_secret_file)
from services.common.server import LazyServicer, PortInUse, create_server, run_until_signal, setup_logging, write_port_file
from services.engine.config import EngineConfig
from services.engine.metrics import DEFAULT_MAX_MODEL_LEN, EngineMetrics, EngineStateCollector
from services.engine.serving_health import ServingHealth
from services.engine.registration import ConsulRegistrar, EngineRegistration, advertised_host
from services.engine.models.load_guard import LoadGuard
from services.engine.models.manager import ModelManager
from services.engine.models.runtime import RuntimeFactory
from services.engine.models.store import ModelStore, StoreError, load_store, single_model_store
from services.engine.api.blocking_calls import BlockingCalls
from services.engine.api.servicers import EngineAdminServicer, LLMServicer

log = logging.getLogger("llmserve.engine")
LLM_SERVICE = llm_pb2.DESCRIPTOR.services_by_name["LLMService"].full_name
ADMIN_SERVICE = engine_admin_pb2.DESCRIPTOR.services_by_name["EngineAdmin"].full_name
DEFAULT_STORE = REPO_ROOT / "models.yaml"
# EngineAdmin rpcs that change state: they need an admin key (GetLoad and WatchLoad are the routers').
ADMIN_METHODS = frozenset(f"/{ADMIN_SERVICE}/{m}" for m in ("LoadModel", "UnloadModel"))


def open_store(config: EngineConfig) -> ModelStore:
    """``--model`` (one model, the single-model behaviour) or the store file; exits 2 when unusable."""
    try:
        if config.model:
            source = resolve_model(config.model)
            # A path is handed to the worker (started in the repository root) as an absolute one.
            spec = str(source.path.resolve()) if Path(config.model).expanduser().exists() else config.model
            # as the store serves its GGUF entries: the file's own blocks (float32 stays for a model directory)
            dtype = config.dtype or ("native" if source.format == "gguf" else "float32")
            return single_model_store(source.name, spec, source.format, dtype)
        store = load_store(config.model_store or DEFAULT_STORE)
        return store.with_dtype(config.dtype) if config.dtype else store
    except (FileNotFoundError, StoreError) as exc:
        log.error("%s", exc)
        sys.exit(2)


def warm_list(config: EngineConfig, store: ModelStore) -> list[str]:
    if config.model:
        return [store.default.id]  # one model: load it before serving, as before the store existed
    names = [n.strip() for n in config.warm_models.split(",") if n.strip() and n.strip() != "none"]
    return [store.default.id if n == "default" else n for n in names]


def main(argv: list[str] | None = None) -> None:
    config = load_config(EngineConfig, "LLMSERVE_ENGINE", argv)
    setup_logging(config.log_level)
    try:
        security = _security(config)
        worker_secret = read_secret_file(config.worker_secret_file, "--worker-secret-file")
    except ConfigError as exc:
        log.error("%s", exc)
        sys.exit(2)
    try:
        asyncio.run(_serve(config, open_store(config), security, worker_secret))
    except PortInUse as exc:  # another engine on this host holds --port or --metrics-port
        log.error("%s", exc)
        sys.exit(2)


def _security(config: EngineConfig) -> ServerSecurity:
    """Routers present the cluster secret or a client certificate (mTLS); admins an admin key."""
    secret = read_secret_file(config.cluster_secret_file, "--cluster-secret-file")
    policy = AccessPolicy(client_keys=KeySet.of_keys(secret), client_header=CLUSTER_SECRET,
                          admin_keys=load_key_file(config.admin_keys_file, "--admin-keys-file"),
                          admin_methods=ADMIN_METHODS, transport_authenticated=bool(config.tls_ca),
                          what="the engine")
    loopback = config.host in ("127.0.0.1", "localhost", "::1")
    if not (policy.client_keys or policy.transport_authenticated or loopback):
        log.warning("listening on %s with no router credential (--cluster-secret-file or --tls-ca): anyone who "
                    "reaches this port can generate%s", config.host, "" if policy.admin_keys else " and unload models")
    return ServerSecurity(policy, config.tls, reflection=config.reflection)


async def _serve(config: EngineConfig, store: ModelStore, security: ServerSecurity, worker_secret: str) -> None:
    servicers: dict[str, object] = {}
    handle = await create_server(
        [lambda s: llm_pb2_grpc.add_LLMServiceServicer_to_server(LazyServicer(
            servicers, "llm", "the engine is starting: its models are still loading", LLMServicer), s),
         lambda s: engine_admin_pb2_grpc.add_EngineAdminServicer_to_server(LazyServicer(
             servicers, "admin", "the engine is starting", EngineAdminServicer), s)],
        [LLM_SERVICE, ADMIN_SERVICE], config.host, config.port, security)
    location = f"{config.host}:{handle.port}"
    log.info("engine listening on %s (NOT_SERVING until the warm models are loaded); store: %s", location,
             ", ".join(f"{e.name} ({e.task})" for e in store.entries))
    metrics = _metrics(config, store)
    models = ModelManager(store, RuntimeFactory(config, config.worker if config.model else "", worker_secret, metrics),
                          budget_bytes=config.memory_budget_mb * 2**20, max_loaded=config.max_loaded_models,
                          wait_seconds=config.model_wait_seconds, drain_seconds=config.unload_drain_seconds,
                          metrics=metrics.manager if metrics else None,
                          guard=LoadGuard(config.load_failure_backoff_seconds))
    blocking = BlockingCalls(config.server_threads)
    if metrics is not None:
        metrics.registry.register(EngineStateCollector(models))
        try:
            serve_metrics(metrics.registry, config.host, config.metrics_port, config.metrics_port_file)
        except PortInUse:
            await handle.server.stop(0)  # before the loop ends: main() says why and exits 2
            raise
    health = ServingHealth(models, lambda ok: handle.set_serving(ok, [LLM_SERVICE, ADMIN_SERVICE]),
                           lambda key: blocking.run(models.load, key),
                           retry_seconds=config.load_failure_backoff_seconds)
    default_failure = ""
    for key in warm_list(config, store):
        try:
            result = await blocking.run(models.load, key)
            log.info("warmed %s in %.2fs", result.entry.name, result.load_seconds)
        except ServiceError as exc:
            if config.model:
                log.error("%s", exc.message)
                await handle.server.stop(0)
                sys.exit(2)
            log.error("could not warm %s: %s (serving the other models)", key, exc.message)
            if key in (store.default.id, store.default.name):
                default_failure = exc.message
    servicers["llm"] = LLMServicer(models, blocking, config.max_batch_prompts, location)
    admin = EngineAdminServicer(models, blocking, location, config.max_num_seqs, lambda: health.reason)
    servicers["admin"] = admin
    # SERVING only when the default model can be served; else NOT_SERVING with the reason, retried.
    await (health.failed(default_failure) if default_failure else health.serving())
    health_task = asyncio.create_task(health.run())
    # Every model of the store can be served here (loaded on demand); ids, names and aliases all route.
    registrar = _registrar(config, handle.port, tuple(k for e in store.entries for k in (e.name, e.id, *e.aliases)))
    if registrar is not None:
        registrar.start()
    write_port_file(config.port_file, handle.port)
    log.info("engine %s on %s; loaded: %s", "NOT_SERVING" if health.reason else "SERVING", location,
             ", ".join(e.name for e, _ in models.loaded()) or "none")

    def on_signal() -> None:
        # Leave the catalog first so routers stop sending here while in-flight calls finish.
        if registrar is not None:
            registrar.deregister()
        health_task.cancel()  # a draining engine stays NOT_SERVING
        admin.stop()

    def on_stop() -> None:
        models.close_all()
        blocking.shutdown()

    await run_until_signal(handle, on_stop, config.drain_seconds, on_signal=on_signal)


def _metrics(config: EngineConfig, store: ModelStore) -> EngineMetrics | None:
    if not config.metrics:
        return None
    # vLLM sizes its token-count histograms by the model's context; one family here serves every model.
    longest = max((e.context_length for e in store.entries if e.context_length), default=DEFAULT_MAX_MODEL_LEN)
    return EngineMetrics(new_registry(), longest)


def _registrar(config: EngineConfig, port: int, models: tuple[str, ...]) -> ConsulRegistrar | None:
    try:
        settings = consul_settings(config.consul_addr, config.consul_token)
    except ValueError as exc:
        log.error("%s", exc)
        sys.exit(2)
    if settings is None:
        return None
    return ConsulRegistrar(settings, EngineRegistration(
        address=advertised_host(config.host, config.advertise), port=port,
        node=config.node_name or socket.gethostname(), models=models,
        check_interval=config.consul_check_interval, check_timeout=config.consul_check_timeout,
        deregister_after=config.consul_deregister_after, resync_interval=config.consul_resync_interval,
        tls=config.tls.enabled))


if __name__ == "__main__":
    run_then_exit(main)
