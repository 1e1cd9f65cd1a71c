"""A real Prometheus server scrapes a running stack; PromQL over its HTTP API sees the traffic sent.

Prometheus is Debian's package (``make test`` installs it when missing, as root). The increase of
a counter is taken exactly, as ``now - value @ t0`` (``increase()`` extrapolates to the window's
edges, so it is not an exact count).
"""
from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from typing import Iterator

import grpc
import pytest

from llmserve.v1 import llm_pb2, llm_pb2_grpc
from services.stack import Stack
from tests.helpers import REPO_ROOT, wait_until

DASHBOARD = REPO_ROOT / "deploy" / "grafana" / "llmserve-dashboard.json"


def prometheus_binary() -> str:
    found = shutil.which("prometheus")
    if found is None:
        # The Makefile's `prometheus` prerequisite does the same; this covers a bare `pytest`.
        subprocess.run(["make", "-s", "prometheus"], cwd=REPO_ROOT, timeout=600, check=False)
        found = shutil.which("prometheus")
    if found is None:
        pytest.fail("the prometheus binary is missing and could not be installed (as root: "
                    "apt-get install -y prometheus)")
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hostport(url: str) -> str:
    return urllib.parse.urlparse(url).netloc


@pytest.fixture(scope="module")
def stack(tiny_stack: Stack) -> Stack:
    """The session's tiny stack: every count below is a delta from the test's own start."""
    return tiny_stack


class Prometheus:
    def __init__(self, base: str):
        self.base = base

    def query(self, expr: str) -> list[dict]:
        url = f"{self.base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=10) as resp:
            body = json.load(resp)
        assert body["status"] == "success", body
        return body["data"]["result"]

    def scalar(self, expr: str) -> float | None:
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else None


@pytest.fixture(scope="module")
def prometheus(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    binary = prometheus_binary()
    work = tmp_path_factory.mktemp("prometheus")
    assert stack.router is not None
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [
            {"job_name": "llmserve-router", "static_configs": [{"targets": [hostport(stack.router.metrics_url)]}]},
            {"job_name": "llmserve-engine",
             "static_configs": [{"targets": [hostport(e.metrics_url) for e in stack.engines]}]},
        ],
    }
    (work / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
    port = free_port()
    log = open(work / "prometheus.log", "wb")
    proc = subprocess.Popen([binary, f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={work / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    prom = Prometheus(f"http://127.0.0.1:{port}")
    try:
        def up() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"prometheus exited: {(work / 'prometheus.log').read_text()[-2000:]}")
            try:
                return [r["value"][1] for r in prom.query("up")] == ["1", "1"]
            except OSError:
                return False
        wait_until(up, 60, "prometheus to scrape router and engine (up == 1)", interval=0.2)
        yield prom
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def test_promql_counts_the_traffic_sent(stack: Stack, prometheus: Prometheus):
    assert stack.router is not None
    wait_until(lambda: prometheus.scalar("sum(vllm:generation_tokens_total)") is not None, 30,
               "the engine's counters in prometheus")
    t0 = time.time()
    received = 0
    with grpc.insecure_channel(stack.router.address) as channel:
        stub = llm_pb2_grpc.LLMServiceStub(channel)
        for i in range(4):
            sampling = llm_pb2.SamplingParams(temperature=0, max_tokens=3 + i, ignore_eos=True)
            for msg in stub.GenerateStream(llm_pb2.GenerateRequest(prompt=f"Count to {i}", sampling=sampling),
                                           timeout=120):
                received += len(msg.token_ids)
        for i in range(2):
            sampling = llm_pb2.SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
            received += stub.Generate(llm_pb2.GenerateRequest(prompt=f"Hello {i}", sampling=sampling),
                                      timeout=120).usage.completion_tokens
    assert received == (3 + 4 + 5 + 6) + 2 * 5

    def delta(selector: str) -> float | None:
        """How much the sum of ``selector``'s counters grew since t0."""
        return prometheus.scalar(f"sum({selector}) - sum({selector} @ {t0:.3f})")

    wait_until(lambda: delta("vllm:generation_tokens_total") == received, 30,
               f"prometheus to count {received} generation tokens")
    wait_until(lambda: delta('llmserve_router_requests_total{code="OK"}') == 6, 30,
               "prometheus to count the router's 6 calls")
    assert delta('vllm:request_success_total{finished_reason="length"}') == 6
    assert delta('vllm:request_success_total{finished_reason!="length"}') == 0
    assert delta("vllm:time_to_first_token_seconds_count") == 6
    assert delta("vllm:e2e_request_latency_seconds_count") == 6
    assert delta("vllm:inter_token_latency_seconds_count") == received - 6
    assert delta("vllm:request_generation_tokens_sum") == received
    assert delta('llmserve_router_requests_total{method="GenerateStream",code="OK"}') == 4
    assert delta('llmserve_router_requests_total{method="Generate",code="OK"}') == 2
    assert delta('llmserve_worker_forward_seconds_count{kind="step"}') >= received / 4  # merged from the worker
    assert prometheus.scalar("sum(vllm:num_requests_running)") == 0


def test_every_dashboard_expression_returns_a_series(stack: Stack, prometheus: Prometheus):
    panels = json.loads(DASHBOARD.read_text())["panels"]
    exprs = [t["expr"] for p in panels for t in p.get("targets", [])]
    assert len(exprs) >= 30
    # Grafana's variables as Grafana would fill them for "All" models over a short range.
    filled = [e.replace("$model_name", ".*").replace("$__rate_interval", "1m") for e in exprs]
    empty = [e for e in filled if not prometheus.query(e)]
    assert not empty, "dashboard expressions with no series:\n" + "\n".join(empty)
