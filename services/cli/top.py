"""`llmserve top`: every engine's live load (EngineAdmin.GetLoad), one screen, refreshed like top."""
from __future__ import annotations

import sys
import threading
import time

import grpc

from llmserve.v1 import engine_admin_pb2, engine_admin_pb2_grpc, llm_pb2, llm_pb2_grpc

HEADER = ("ENGINE", "RUN", "WAIT", "KV USED", "KV %", "PREFIX HIT", "FINISHED", "PREEMPT", "RESTARTS", "MEMORY",
          "MODELS")


def engines_to_show(router: llm_pb2_grpc.LLMServiceStub, given: list[str], timeout: float) -> list[str]:
    """The engines named on the command line and every engine the router lists a model as loaded on."""
    found = list(given)
    try:
        for m in router.ListModels(llm_pb2.ListModelsRequest(), timeout=timeout).models:
            found.extend(a for a in m.loaded_on if a not in found)
    except grpc.RpcError:
        pass  # no router: the given engines only
    return found


def row(address: str, stub: engine_admin_pb2_grpc.EngineAdminStub, timeout: float) -> tuple[str, ...]:
    try:
        load = stub.GetLoad(engine_admin_pb2.GetLoadRequest(), timeout=timeout)
    except grpc.RpcError as exc:
        return (address, f"{exc.code().name}: {exc.details()}", *[""] * (len(HEADER) - 2))  # type: ignore[attr-defined]
    pct = 100.0 * load.num_kv_blocks_used / load.num_kv_blocks_total if load.num_kv_blocks_total else 0.0
    mem = f"{load.memory_used_bytes / 2**20:.0f}/{load.memory_budget_bytes / 2**20:.0f} MiB"
    return (address, str(load.num_running), str(load.num_waiting),
            f"{load.num_kv_blocks_used}/{load.num_kv_blocks_total}", f"{pct:.1f}",
            f"{100 * load.prefix_cache_hit_rate:.1f}%", str(load.num_finished), str(load.num_preemptions),
            str(load.worker_restarts), mem, ",".join(load.loaded_models) or "-")


def render(rows: list[tuple[str, ...]]) -> str:
    table = [HEADER, *rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(HEADER))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in table]
    return f"llmserve top - {time.strftime('%H:%M:%S')} - {len(rows)} engine(s)\n\n" + "\n".join(lines) + "\n"


def run_top(router: llm_pb2_grpc.LLMServiceStub, given: list[str], interval: float, iterations: int,
            timeout: float) -> None:
    stubs: dict[str, engine_admin_pb2_grpc.EngineAdminStub] = {}
    clear = sys.stdout.isatty()
    shown = 0
    wake = threading.Event()
    while True:
        addresses = engines_to_show(router, given, timeout)
        for a in addresses:
            if a not in stubs:
                stubs[a] = engine_admin_pb2_grpc.EngineAdminStub(grpc.insecure_channel(a))
        screen = render([row(a, stubs[a], timeout) for a in addresses])
        sys.stdout.write(("\x1b[H\x1b[2J" if clear else "") + screen)
        sys.stdout.flush()
        shown += 1
        if iterations and shown >= iterations:
            return
        wake.wait(interval)
