"""python -m services.router --help"""
from __future__ import annotations

import logging
import threading

from llmserve.v1 import llm_pb2, llm_pb2_grpc
from services.common.config import load_config
from services.common.server import write_port_file, create_server, run_until_signal, setup_logging
from services.router.config import RouterConfig
from services.router.engine_pool import EnginePool
from services.router.server import RouterServicer

log = logging.getLogger("llmserve.router")
LLM_SERVICE = llm_pb2.DESCRIPTOR.services_by_name["LLMService"].full_name


def main(argv: list[str] | None = None) -> None:
    config = load_config(RouterConfig, "LLMSERVE_ROUTER", argv)
    setup_logging(config.log_level)
    pool = EnginePool(config.engine_addresses, config.health_interval)
    servicer = RouterServicer(pool, config.max_attempts)
    handle = create_server([lambda s: llm_pb2_grpc.add_LLMServiceServicer_to_server(servicer, s)],
                           [LLM_SERVICE], config.host, config.port)
    write_port_file(config.port_file, handle.port)
    log.info("router listening on %s:%d; engines: %s", config.host, handle.port, ", ".join(config.engine_addresses))
    stop = threading.Event()

    def follow_health() -> None:
        # The router is SERVING while at least one engine is.
        serving = None
        while not stop.is_set():
            now = pool.any_healthy()
            if now != serving:
                handle.set_serving(now, [LLM_SERVICE])
                log.info("router %s", "SERVING" if now else "NOT_SERVING (no healthy engine)")
                serving = now
            stop.wait(config.health_interval / 2)

    pool.start()
    threading.Thread(target=follow_health, name="router-health", daemon=True).start()

    def on_stop() -> None:
        stop.set()
        pool.stop()

    run_until_signal(handle, on_stop)


if __name__ == "__main__":
    main()
