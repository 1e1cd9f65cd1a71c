"""Cold start per model: first load (GGUF conversion / head training) vs cached load, and warm latency.

    python -m bench.cold_start [--store models.yaml] [--requests 5]
    python -m bench.cold_start --stack 5 [--baseline ../old-checkout]

Starts one engine on loopback with an empty model cache (a temporary LLMSERVE_CACHE_DIR), then for
every model of the store: LoadModel (the first load: converts a GGUF to safetensors, trains a
classifier head), UnloadModel (the worker process ends; its RSS is what is freed), LoadModel again
(the cached load), and a few warm requests. Prints one table with the figures side by side.

``--stack N``: instead, the whole stack as ``make up`` starts it (router + engine + the default
model's worker, the model cache warm: LLMSERVE_CACHE_DIR as set), N times: seconds from the start
until the router is SERVING, and from the stop until every process has exited. With ``--baseline``
(another checkout of llmserve, e.g. ``git worktree add ../old HEAD~3``; its generated protos built),
the two checkouts alternate round by round, and the table gives each one's median and the ratio.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

from llmserve.v1 import engine_admin_pb2, engine_admin_pb2_grpc, llm_pb2, llm_pb2_grpc
from services.stack import start_service

REPO_ROOT = Path(__file__).resolve().parents[1]


def warm_request(llm: llm_pb2_grpc.LLMServiceStub, model: llm_pb2.ModelInfo) -> float:
    started = time.perf_counter()
    if model.task == "text-generation":
        llm.Generate(llm_pb2.GenerateRequest(model=model.id, prompt="Hello, I am", sampling=llm_pb2.SamplingParams(
            temperature=0, max_tokens=16, ignore_eos=True)), timeout=120)
    else:
        llm.Predict(llm_pb2.PredictRequest(model_id=model.id, input_data="Win a free iPhone now!"), timeout=120)
    return time.perf_counter() - started


# Run in a child process inside a checkout (its own code, its own services): start, stop, two figures.
_STACK_ROUND = """
import sys, time
from services.stack import start_stack
started = time.monotonic()
stack = start_stack(sys.argv[2:], num_engines=int(sys.argv[1]), log_dir=None)
serving = time.monotonic()
stack.stop()
print(serving - started, time.monotonic() - serving)
"""


def stack_round(checkout: Path, engines: int, engine_args: list[str]) -> tuple[float, float]:
    """(start s, stop s) of one stack started from ``checkout``."""
    out = subprocess.run([sys.executable, "-c", _STACK_ROUND, str(engines), *engine_args], cwd=checkout, check=True,
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(checkout)}, timeout=900)
    start_s, stop_s = out.stdout.split()[-2:]
    return float(start_s), float(stop_s)


def stack_bench(rounds: int, baseline: Path | None, engines: int, engine_args: list[str]) -> None:
    checkouts = [("this checkout", REPO_ROOT)] + ([("baseline", baseline.resolve())] if baseline else [])
    times: dict[str, list[tuple[float, float]]] = {name: [] for name, _ in checkouts}
    for r in range(rounds):
        for name, path in checkouts if r % 2 == 0 else checkouts[::-1]:  # alternate who goes first
            times[name].append(stack_round(path, engines, engine_args))
    print(f"| stack (router + {engines} engine(s) + workers, warm cache) | start → SERVING s (median) | stop s (median) "
          "| rounds |")
    print("|---|---|---|---|")
    medians = {}
    for name, _ in checkouts:
        medians[name] = (statistics.median(t[0] for t in times[name]), statistics.median(t[1] for t in times[name]))
        print(f"| {name} | {medians[name][0]:.2f} | {medians[name][1]:.2f} | {rounds} |")
    if baseline:
        (a_start, a_stop), (b_start, b_stop) = medians["this checkout"], medians["baseline"]
        print(f"| this / baseline | {a_start / b_start:.2f}x | {a_stop / b_stop:.2f}x | |")
    print(f"(engine args: {' '.join(engine_args)}; every round: {times})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", default=str(REPO_ROOT / "models.yaml"))
    parser.add_argument("--requests", type=int, default=5, help="warm requests per model")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per worker (0 = all cores)")
    parser.add_argument("--stack", type=int, default=0, metavar="N", help="time N stack starts and stops instead")
    parser.add_argument("--baseline", type=Path, help="with --stack: another checkout to alternate with")
    parser.add_argument("--engines", type=int, default=1, help="with --stack: engines in the stack")
    parser.add_argument("--stack-args", default="--kv-cache-mb 256",
                        help="with --stack: the engine's flags (default: the store, as make up)")
    args = parser.parse_args()
    if args.stack:
        stack_bench(args.stack, args.baseline, args.engines, args.stack_args.split())
        return
    os.environ["LLMSERVE_CACHE_DIR"] = tempfile.mkdtemp(prefix="llmserve-bench-cache-")  # a truly first load
    log = Path(tempfile.mkdtemp(prefix="llmserve-bench-")) / "engine.log"
    engine = start_service("services.engine", ["--model-store", args.store, "--warm-models", "none",
                                               "--worker-threads", str(args.threads), "--kv-cache-mb", "256"],
                           log_path=log)
    rows = []
    try:
        with grpc.insecure_channel(engine.address) as channel:
            llm = llm_pb2_grpc.LLMServiceStub(channel)
            admin = engine_admin_pb2_grpc.EngineAdminStub(channel)
            for model in llm.ListModels(llm_pb2.ListModelsRequest(), timeout=10).models:
                first = admin.LoadModel(engine_admin_pb2.LoadModelRequest(model=model.id), timeout=900)
                unload = admin.UnloadModel(engine_admin_pb2.UnloadModelRequest(model=model.id), timeout=120)
                cached = admin.LoadModel(engine_admin_pb2.LoadModelRequest(model=model.id), timeout=900)
                warm_request(llm, model)  # the first request after a load pays one-off allocations
                latencies = [warm_request(llm, model) for _ in range(args.requests)]
                rss = next(m for m in llm.ListModels(llm_pb2.ListModelsRequest(), timeout=10).models
                           if m.id == model.id).memory_bytes
                admin.UnloadModel(engine_admin_pb2.UnloadModelRequest(model=model.id), timeout=120)
                rows.append((model.name, model.task, model.format, first.load_seconds, cached.load_seconds,
                             statistics.median(latencies) * 1000, rss / 2**20, unload.freed_bytes / 2**20))
    finally:
        engine.stop()
    header = ("model", "task", "format", "first load s", "cached load s", "first/cached", "warm p50 ms",
              "worker RSS MiB", "freed on unload MiB")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for name, task, fmt, first_s, cached_s, p50, rss_mb, freed_mb in rows:
        print(f"| {name} | {task} | {fmt} | {first_s:.2f} | {cached_s:.2f} | {first_s / cached_s:.1f}x | "
              f"{p50:.1f} | {rss_mb:.0f} | {freed_mb:.0f} |")
    print(f"(warm p50: Generate of 16 tokens, or one Predict, median of {args.requests}; engine log: {log})")


if __name__ == "__main__":
    main()
