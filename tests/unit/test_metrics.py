"""Metric recorders with no processes: vLLM's names and edges, and what one engine loop records."""
from __future__ import annotations

import asyncio

import grpc
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from llmserve.v1 import llm_pb2

from services.common.metrics_http import new_registry

from services.common.errors import NotFound
from services.engine.core.speculation import SpeculativeConfig, Speculator
from services.engine.metrics import (ITL_BUCKETS, REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS, EngineMetrics,
                                     build_1_2_5_buckets, merge_families, speculation_gate_family)
from services.engine.core.scheduler import SampledToken
from services.engine.core.sequence import FinishReason
from services.router.metrics import RouterMetrics, instrument
from tests.unit.test_engine import make_engine  # noqa: F401 - the fixture
from tests.unit.test_scheduler import make, seq


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    got = registry.get_sample_value(name, labels)
    assert got is not None, f"no sample {name}{labels}"
    return got


def test_bucket_edges_are_vllms():
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert build_1_2_5_buckets(8192)[-1] == 5000
    assert len(TTFT_BUCKETS) == 22 and TTFT_BUCKETS[0] == 0.001 and TTFT_BUCKETS[-1] == 2560.0
    assert len(ITL_BUCKETS) == 19 and ITL_BUCKETS[-1] == 80.0
    assert len(REQUEST_LATENCY_BUCKETS) == 21 and REQUEST_LATENCY_BUCKETS[-1] == 7680.0


def test_exposition_uses_vllm_names_types_and_labels():
    registry = new_registry()
    EngineMetrics(registry).for_model("m", make())
    text = generate_latest(registry).decode()
    assert "# TYPE vllm:generation_tokens_total counter" in text
    assert 'vllm:generation_tokens_total{engine="0",model_name="m"} 0.0' in text
    assert 'vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="m"} 0.0' in text
    assert 'vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 0.0' in text
    assert "_created" not in text


def test_one_engine_loop_records_tokens_timings_finishes_and_prefix_hits():
    registry = new_registry()
    sched = make(block_size=4)
    stats = EngineMetrics(registry).for_model("m", sched)
    shared = list(range(100, 109))  # two full blocks + 1 token
    a, b = seq(0, max_tokens=3, prompt=shared), seq(0, max_tokens=2, prompt=shared)
    sched.add(a)
    steps = 0
    for s in (a, b):
        if s is b:
            sched.add(b)
        while not s.is_finished and steps < 20:
            steps += 1
            out = sched.schedule()
            stats.on_scheduled(out)
            got = sched.update(out, {x.seq.seq_id: SampledToken(7) for x in out.scheduled if x.sample})
            stats.on_tokens(got)
        stats.on_finished(s)
    labels = {"model_name": "m", "engine": "0"}
    assert value(registry, "vllm:generation_tokens_total", **labels) == 5
    assert value(registry, "vllm:prompt_tokens_total", **labels) == 18
    assert value(registry, "vllm:request_success_total", finished_reason="length", **labels) == 2
    assert value(registry, "vllm:time_to_first_token_seconds_count", **labels) == 2
    assert value(registry, "vllm:inter_token_latency_seconds_count", **labels) == 3  # (3-1) + (2-1)
    assert value(registry, "vllm:e2e_request_latency_seconds_count", **labels) == 2
    assert value(registry, "vllm:request_generation_tokens_sum", **labels) == 5
    assert value(registry, "vllm:prefix_cache_queries_total", **labels) == 18
    assert value(registry, "vllm:prefix_cache_hits_total", **labels) == 8  # b found a's two full blocks


def test_a_sequence_cancelled_while_queued_counts_as_abort_with_all_its_time_queued():
    registry = new_registry()
    sched = make()
    stats = EngineMetrics(registry).for_model("m", sched)
    s = seq(3)
    sched.add(s)
    sched.finish(s, FinishReason.CANCELLED)
    stats.on_finished(s)
    labels = {"model_name": "m", "engine": "0"}
    assert value(registry, "vllm:request_success_total", finished_reason="abort", **labels) == 1
    assert value(registry, "vllm:request_queue_time_seconds_count", **labels) == 1
    assert value(registry, "vllm:request_generation_tokens_sum", **labels) == 0


def test_worker_families_of_two_models_merge_into_one_family_per_name():
    from prometheus_client.parser import text_string_to_metric_families

    a = list(text_string_to_metric_families('# TYPE x_total counter\nx_total{model_name="a"} 1\n'))
    b = list(text_string_to_metric_families('# TYPE x_total counter\nx_total{model_name="b"} 2\n'))
    (merged,) = merge_families([a, b])
    assert sorted(s.labels["model_name"] for s in merged.samples) == ["a", "b"]


class FakeServicer:
    async def Generate(self, request, context):
        if request == "missing":
            raise NotFound("no such model")
        return "ok"

    async def GenerateStream(self, request, context):
        for i in range(3):
            yield i

    async def GenerateBatch(self, request, context):
        return "ok"

    async def Predict(self, request, context):
        return "ok"

    async def ListModels(self, request, context):
        return "ok"


def test_router_instrumentation_counts_calls_by_method_and_status():
    registry = new_registry()
    servicer = instrument(FakeServicer(), RouterMetrics(registry))

    async def run() -> list[int]:
        await servicer.Generate("hi", None)
        with pytest.raises(NotFound):
            await servicer.Generate("missing", None)
        return [i async for i in servicer.GenerateStream("hi", None)]

    assert asyncio.run(run()) == [0, 1, 2]
    assert value(registry, "llmserve_router_requests_total", method="Generate", code="OK") == 1
    assert value(registry, "llmserve_router_requests_total", method="Generate", code=grpc.StatusCode.NOT_FOUND.name) == 1
    assert value(registry, "llmserve_router_requests_total", method="GenerateStream", code="OK") == 1
    assert value(registry, "llmserve_router_time_to_first_message_seconds_count", method="GenerateStream") == 1
    assert value(registry, "llmserve_router_calls_in_flight", method="GenerateStream") == 0


def test_metrics_endpoint_keeps_colons_even_when_openmetrics_is_asked_for():
    import urllib.request

    from prometheus_client import Counter

    from services.common.metrics_http import serve_metrics

    registry = new_registry()
    Counter("vllm:x", "doc", registry=registry).inc()
    url = serve_metrics(registry, "127.0.0.1", 0)
    accept = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"  # as Prometheus asks
    with urllib.request.urlopen(urllib.request.Request(url, headers={"Accept": accept}), timeout=10) as resp:
        assert "vllm:x_total 1.0" in resp.read().decode()


def test_the_engine_loop_feeds_generation_stats_through_its_observer(make_engine):
    """The Prometheus recorder injected into the real loop (a fake executor): what a scrape shows."""
    from tests.unit.test_engine import FakeExecutor, submit

    registry = new_registry()
    metrics = EngineMetrics(registry)
    executor = FakeExecutor()
    engine = make_engine(executor, observer=lambda scheduler: metrics.for_model("m", scheduler))
    _, reader = submit(engine, executor, max_tokens=4)
    assert reader.until_finished()[1].finish_reason is FinishReason.LENGTH
    engine.stop()
    labels = {"model_name": "m", "engine": "0"}
    assert value(registry, "vllm:generation_tokens_total", **labels) == 4
    assert value(registry, "vllm:prompt_tokens_total", **labels) == 3
    assert value(registry, "vllm:request_success_total", finished_reason="length", **labels) == 1
    assert value(registry, "vllm:inter_token_latency_seconds_count", **labels) == 3
    assert value(registry, "vllm:e2e_request_latency_seconds_count", **labels) == 1


def test_router_metrics_count_the_relays_retries_and_resumes():
    from services.router.relay import CallScope, Relay
    from tests.unit.test_relay import REQUEST, FakeEngine, FakePool, chunk, rpc_error

    registry = new_registry()
    metrics = RouterMetrics(registry)
    down = FakeEngine("a", unary=rpc_error(grpc.StatusCode.UNAVAILABLE))
    up = FakeEngine("b", unary=llm_pb2.GenerateResponse(text="hi"))
    asyncio.run(Relay(FakePool(down, up), max_attempts=3, observer=metrics).generate(REQUEST, CallScope()))
    broken = FakeEngine("a", stream=([chunk("x", [1])], rpc_error(grpc.StatusCode.UNAVAILABLE)))
    good = FakeEngine("b", stream=([chunk("y", [2], finish=True)], None))
    relay = Relay(FakePool(broken, good), max_attempts=3, observer=metrics)

    async def run() -> int:
        return len([m async for m in relay.generate_stream(REQUEST, CallScope())])

    assert asyncio.run(run()) == 2
    assert value(registry, "llmserve_router_retries_total", method="Generate") == 1
    assert value(registry, "llmserve_router_retries_total", method="GenerateStream") == 0
    assert value(registry, "llmserve_router_resumes_total", method="GenerateStream") == 1


def test_the_speculation_gates_measurements_are_exported_per_model_and_batch_size():
    spec = Speculator(SpeculativeConfig(method="suffix", gate_steps=2), 4096)
    for on, tokens in ((True, 30), (False, 4), (True, 30), (False, 4)):
        spec.gate.record(4, on, tokens, 0.01)
    family = speculation_gate_family([("m", spec), ("off-model", None)])
    got = {(s.labels["model_name"], s.labels["running"], s.labels["speculation"]): s.value for s in family.samples}
    assert got == {("m", "4", "on"): pytest.approx(3000.0), ("m", "4", "off"): pytest.approx(400.0)}
    assert family.name == "llmserve_spec_decode_gate_tokens_per_second"
