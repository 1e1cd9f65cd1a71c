"""Per-call metadata (request id, serving engine, queue time, TTFT) on every gRPC response, and one
request id followed through the router's, the engine's and the worker's logs."""
from __future__ import annotations

import uuid

from llmserve.v1 import llm_pb2
from tests.helpers import wait_until

SHORT = llm_pb2.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def _timing(metadata) -> dict[str, str]:
    return {k: v for k, v in metadata if k.startswith("x-llmserve-")}


def test_generate_trailers(router, tiny_stack):
    _, call = router.Generate.with_call(llm_pb2.GenerateRequest(prompt="Hi", sampling=SHORT, request_id="md-1"),
                                        timeout=60)
    md = _timing(call.trailing_metadata())
    assert md["x-llmserve-request-id"] == "md-1"
    assert md["x-llmserve-engine"] == tiny_stack.engines[0].address
    assert 0 <= float(md["x-llmserve-queue-seconds"]) <= float(md["x-llmserve-ttft-seconds"])


def test_generated_request_id_matches_the_response(router):
    resp, call = router.Generate.with_call(llm_pb2.GenerateRequest(prompt="Hi", sampling=SHORT), timeout=60)
    assert resp.request_id and _timing(call.trailing_metadata())["x-llmserve-request-id"] == resp.request_id


def test_stream_initial_metadata_and_trailers(router, tiny_stack):
    call = router.GenerateStream(llm_pb2.GenerateRequest(prompt="Hi", sampling=SHORT), timeout=60)
    first = _timing(call.initial_metadata())  # known before the first token arrives at the client
    parts = list(call)
    last = _timing(call.trailing_metadata())
    assert first["x-llmserve-request-id"] == parts[0].request_id == last["x-llmserve-request-id"]
    assert first["x-llmserve-engine"] == last["x-llmserve-engine"] == tiny_stack.engines[0].address
    assert float(first["x-llmserve-ttft-seconds"]) == float(last["x-llmserve-ttft-seconds"]) > 0
    assert "x-llmserve-queue-seconds" in last


def test_predict_and_batch_trailers(router, tiny_stack):
    _, call = router.Predict.with_call(llm_pb2.PredictRequest(input_data="Hi"), timeout=60,
                                       metadata=(("x-llmserve-request-id", "md-predict"),))
    md = _timing(call.trailing_metadata())
    assert md["x-llmserve-request-id"] == "md-predict" and md["x-llmserve-engine"] == tiny_stack.engines[0].address
    _, call = router.GenerateBatch.with_call(llm_pb2.GenerateBatchRequest(prompts=["a", "b"], sampling=SHORT,
                                                                          request_id="md-batch"), timeout=60)
    assert _timing(call.trailing_metadata())["x-llmserve-request-id"] == "md-batch"


def test_one_request_id_through_router_engine_and_worker_logs(router, tiny_stack):
    rid = f"trace-{uuid.uuid4().hex[:12]}"
    router.Generate(llm_pb2.GenerateRequest(prompt="Follow me", sampling=SHORT, request_id=rid), timeout=60)
    logs = tiny_stack.log_dir
    assert logs is not None

    def lines() -> dict[str, list[str]]:
        found: dict[str, list[str]] = {"router": [], "engine": [], "worker": []}
        for path in logs.glob("*.log"):
            for line in path.read_text(errors="replace").splitlines():
                if rid not in line:
                    continue
                for who in found:
                    if f" llmserve.{who}" in line:
                        found[who].append(line)
        return found if all(found.values()) else {}

    found = wait_until(lines, 30, f"{rid} in the router's, the engine's and the worker's log lines")
    assert any("to engine" in line for line in found["router"])
    assert any("queued" in line for line in found["engine"]) and any("finished" in line for line in found["engine"])
    assert any("scheduled" in line for line in found["worker"])
