"""Predict calls/s of the two frameworks side by side: the store's MiniLM encoder and spam detector on
transformers (torch) and on ONNX Runtime, through the router, in one run.

    python -m bench.predict_frameworks        (or BENCH_ONLY=predict make bench; a section of make bench)

One stack on the default store with the four encoder models warm. At each concurrency the two paths are
measured back to back, BENCH_ROUNDS pairs, and the pair with the median ratio is kept (the machine is
shared and its speed drifts: a pair shares the speed of the moment).
"""
from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from llmserve.v1 import llm_pb2, llm_pb2_grpc
from services.stack import start_stack

ROUNDS = int(os.environ.get("BENCH_ROUNDS", 3))
SECONDS = float(os.environ.get("BENCH_PREDICT_SECONDS", 5))   # each measurement: clients call for this long
MIN_CALLS = 2                                                  # ... and at least this many calls each
THREADS = int(os.environ.get("BENCH_PREDICT_THREADS", os.cpu_count() or 1))  # each worker's CPU threads
CONCURRENCY = (1, 8)
PAIRS = (("embedding", "all-MiniLM-L6-v2", "all-MiniLM-L6-v2-onnx"),
         ("text-classification", "spam-detector", "spam-detector-onnx"))
TEXTS = ["Win a free iPhone now!", "I will be at the library until six, then heading home",
         "URGENT: your account is locked, click the link to verify", "Can you pick up milk on the way back?",
         "Congratulations, you have been selected for a cash prize", "The meeting moved to Thursday at ten"]


def calls_per_second(llm: llm_pb2_grpc.LLMServiceStub, model: str, concurrency: int) -> float:
    """Calls completed per second by ``concurrency`` clients calling back to back for SECONDS."""
    def one(i: int) -> None:
        llm.Predict(llm_pb2.PredictRequest(model_id=model, input_data=TEXTS[i % len(TEXTS)]), timeout=120)

    def client(k: int) -> int:
        done = 0
        while time.perf_counter() < deadline or done < MIN_CALLS:
            one(k + done)
            done += 1
        return done

    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(concurrency)))  # warm: every connection and the worker's first call
        started = time.perf_counter()
        deadline = started + SECONDS
        calls = sum(pool.map(client, range(concurrency)))
        return calls / (time.perf_counter() - started)


def predict_rows() -> list[str]:
    models = [m for _, a, b in PAIRS for m in (a, b)]
    stack = start_stack(["--warm-models", ",".join(models), "--worker-threads", str(THREADS)],
                        http_port=-1)
    lines = ["", f"## Predict calls/s: transformers vs ONNX Runtime (through the router, {SECONDS:.0f} s of calls "
             f"each, median of {ROUNDS} back-to-back pairs, {THREADS} CPU thread(s) per worker)", "",
             "| model | concurrent calls | transformers calls/s | onnxruntime calls/s | onnxruntime / transformers |",
             "|---|---|---|---|---|"]
    try:
        assert stack.router is not None
        with grpc.insecure_channel(stack.router.address) as channel:
            llm = llm_pb2_grpc.LLMServiceStub(channel)
            for task, torch_model, onnx_model in PAIRS:
                for c in CONCURRENCY:
                    pairs = []
                    for _ in range(ROUNDS):
                        t, o = calls_per_second(llm, torch_model, c), calls_per_second(llm, onnx_model, c)
                        pairs.append((o / t, t, o))
                    ratio, t, o = sorted(pairs)[len(pairs) // 2]
                    print(f"predict {task} x{c}: transformers/onnxruntime calls/s "
                          + ", ".join(f"{a:.0f}/{b:.0f}" for _, a, b in pairs), flush=True)
                    lines.append(f"| {torch_model} ({task}) | {c} | {t:.0f} | {o:.0f} | {ratio:.2f} |")
    finally:
        stack.stop()
    return lines


if __name__ == "__main__":
    print("\n".join(predict_rows()))
