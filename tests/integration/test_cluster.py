"""The cluster with real processes: engines registered in a Consul stand-in across two datacenters,
a router discovering them, routing by model and load, spilling over, failing over mid-stream, and
surviving Consul going away. The tests run in file order and share one cluster (starting engines
is the expensive part); each says what state it leaves behind.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import consul
import grpc
import pytest

from llmserve.v1 import engine_admin_pb2, engine_admin_pb2_grpc, llm_pb2, llm_pb2_grpc
from services.common.consul_client import ENGINE_SERVICE
from services import REPO_ROOT
from services.stack import ServiceProcess, start_service
from tests.conftest import TINY_ENGINE_ARGS
from tests.helpers import wait_until

GREEDY_LONG = llm_pb2.SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)
SHORT = llm_pb2.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


class Cluster:
    def __init__(self, tmp: Path, model_dir: Path):
        self.tmp = tmp
        self.model_dir = model_dir
        self.consul_proc: subprocess.Popen[bytes] | None = None
        self.ports: dict[str, int] = {}
        self.engines: dict[str, ServiceProcess] = {}     # node name → process
        self.router: ServiceProcess | None = None

    def start_consul(self) -> None:
        """Start the agents; started again, they keep their ports and none of their state."""
        port_file = self.tmp / "consul-ports.json"
        port_file.unlink(missing_ok=True)
        log = open(self.tmp / "consul.log", "ab")
        dcs = [f"{dc}={self.ports[dc]}" if self.ports else dc for dc in ("dc1", "dc2")]
        self.consul_proc = subprocess.Popen(
            [sys.executable, "-m", "tests.consul_standin", "--dc", dcs[0], "--dc", dcs[1], "--port-file", str(port_file),
             "--deregister-min", "0s", "--reap-interval", "200ms"],
            cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        wait_until(port_file.exists, 30, "the Consul stand-in to listen")
        self.ports = json.loads(port_file.read_text())

    def consul(self, dc: str = "dc1") -> consul.Consul:
        return consul.Consul(host="127.0.0.1", port=self.ports[dc])

    def start_engine(self, node: str, dc: str) -> ServiceProcess:
        proc = start_service("services.engine", [
            "--model", str(self.model_dir), *TINY_ENGINE_ARGS, "--consul-addr", f"127.0.0.1:{self.ports[dc]}",
            "--node-name", node, "--consul-check-interval", "0.5", "--consul-deregister-after", "1",
            "--consul-resync-interval", "1"],
            log_path=self.tmp / f"engine-{node}.log")
        self.engines[node] = proc
        return proc

    def start_router(self) -> None:
        self.router = start_service("services.router", [
            "--consul-addr", f"127.0.0.1:{self.ports['dc1']}", "--datacenters", "dc1,dc2", "--health-interval", "0.2",
            "--consul-wait", "2", "--breaker-cooldown", "0.5", "--http-port", "-1"], log_path=self.tmp / "router.log")

    def stop(self) -> None:
        if self.router is not None:
            self.router.stop()
        for engine in self.engines.values():
            engine.stop()
        if self.consul_proc is not None and self.consul_proc.poll() is None:
            self.consul_proc.terminate()
            self.consul_proc.wait(10)

    def passing(self, dc: str) -> set[str]:
        _, entries = self.consul().health.service(ENGINE_SERVICE, passing=True, dc=dc)
        return {e["Service"]["Meta"]["node"] for e in entries}

    def finished(self, node: str) -> int:
        with grpc.insecure_channel(self.engines[node].address) as channel:
            load = engine_admin_pb2_grpc.EngineAdminStub(channel).GetLoad(engine_admin_pb2.GetLoadRequest(), timeout=5)
        return int(load.num_finished)

    def running(self, node: str) -> int:
        try:
            with grpc.insecure_channel(self.engines[node].address) as channel:
                load = engine_admin_pb2_grpc.EngineAdminStub(channel).GetLoad(engine_admin_pb2.GetLoadRequest(), timeout=5)
            return int(load.num_running)
        except grpc.RpcError:
            return 0


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("cluster"), tiny_model_dir)
    try:
        c.start_consul()
        with ThreadPoolExecutor(3) as pool:  # engines start in parallel: model load dominates
            list(pool.map(lambda a: c.start_engine(*a), [("a1", "dc1"), ("a2", "dc1"), ("b1", "dc2")]))
        wait_until(lambda: c.passing("dc1") == {"a1", "a2"} and c.passing("dc2") == {"b1"}, 90,
                   "three engines passing their Consul gRPC checks")
        c.start_router()
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def router(cluster):
    with grpc.insecure_channel(cluster.router.address) as channel:
        yield llm_pb2_grpc.LLMServiceStub(channel)


def loaded_on(router) -> set[str]:
    try:
        models = router.ListModels(llm_pb2.ListModelsRequest(), timeout=10).models
    except grpc.RpcError:
        return set()
    return {a for m in models for a in m.loaded_on}


def test_engines_register_with_address_meta_and_a_grpc_check(cluster):
    _, entries = cluster.consul().health.service(ENGINE_SERVICE, dc="dc1")
    entry = next(e for e in entries if e["Service"]["Meta"]["node"] == "a1")
    assert f"127.0.0.1:{entry['Service']['Port']}" == cluster.engines["a1"].address
    assert entry["Service"]["Address"] == "127.0.0.1"
    assert entry["Service"]["Meta"]["cluster"] == "dc1"
    assert cluster.model_dir.name in entry["Service"]["Meta"]["models"].split(",")
    (check,) = [c for c in entry["Checks"] if c["CheckID"] != "serfHealth"]
    assert check["CheckID"] == f"service:{entry['Service']['ID']}"
    assert check["Status"] == "passing" and "success" in check["Output"]


def test_router_discovers_every_datacenter_and_routes_locally(cluster, router):
    everyone = {e.address for e in cluster.engines.values()}
    wait_until(lambda: loaded_on(router) == everyone, 30, "the router to discover all three engines")
    before = {n: cluster.finished(n) for n in cluster.engines}
    for i in range(6):
        router.Generate(llm_pb2.GenerateRequest(prompt=f"Request {i} says", sampling=SHORT), timeout=60)
    after = {n: cluster.finished(n) for n in cluster.engines}
    assert after["b1"] == before["b1"], "dc1 has healthy engines: nothing may spill to dc2"
    assert after["a1"] + after["a2"] - before["a1"] - before["a2"] == 6


def test_router_routes_around_load_it_did_not_send(cluster, router):
    """Load another client put on a1 directly reaches the router through a1's WatchLoad stream."""
    with grpc.insecure_channel(cluster.engines["a1"].address) as channel:
        direct = llm_pb2_grpc.LLMServiceStub(channel)
        busy = [direct.GenerateStream(llm_pb2.GenerateRequest(prompt=f"Busy {i}", sampling=llm_pb2.SamplingParams(
            temperature=0, max_tokens=400, ignore_eos=True)), timeout=120) for i in range(20)]
        try:
            wait_until(lambda: cluster.running("a1") >= 18, 30, "a1 to run the direct streams")

            def lands_on_a2() -> bool:
                before = cluster.finished("a2")
                router.Generate(llm_pb2.GenerateRequest(prompt="Where do I go?", sampling=SHORT), timeout=60)
                return cluster.finished("a2") == before + 1
            wait_until(lands_on_a2, 10, "the router to see a1's load")
            before = {n: cluster.finished(n) for n in ("a2", "b1")}
            for i in range(4):
                router.Generate(llm_pb2.GenerateRequest(prompt="Where do I go?", sampling=SHORT), timeout=60)
            assert cluster.running("a1") >= 18, "a1 must still be loaded for this to mean anything"
            assert cluster.finished("a2") == before["a2"] + 4 and cluster.finished("b1") == before["b1"]
        finally:
            for call in busy:
                call.cancel()
    wait_until(lambda: cluster.running("a1") == 0, 30, "the cancelled streams to leave a1")


def test_unknown_model_is_not_found(router):
    with pytest.raises(grpc.RpcError) as err:
        router.Generate(llm_pb2.GenerateRequest(model="no-such-model", prompt="Hi", sampling=SHORT), timeout=30)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert "no-such-model" in err.value.details()


def test_clients_cannot_set_the_internal_resume_fields(router):
    with pytest.raises(grpc.RpcError) as err:
        list(router.GenerateStream(llm_pb2.GenerateRequest(prompt="Hi", sampling=SHORT, resume_token_ids=[1]), timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "internal" in err.value.details()


def test_engine_resumes_a_sequence_from_tokens_already_sent(cluster):
    """The engine half of failover: prompt + resume_token_ids continues exactly (greedy and seeded)."""
    with grpc.insecure_channel(cluster.engines["a1"].address) as channel:
        stub = llm_pb2_grpc.LLMServiceStub(channel)
        for sampling in (llm_pb2.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                         llm_pb2.SamplingParams(temperature=0.9, seed=7, max_tokens=24, ignore_eos=True)):
            full = stub.Generate(llm_pb2.GenerateRequest(prompt="Once upon a time", sampling=sampling), timeout=60)
            parts = list(stub.GenerateStream(llm_pb2.GenerateRequest(prompt="Once upon a time", sampling=sampling),
                                             timeout=60))
            # the head: whole messages up to 12 tokens (with speculation a message may carry several tokens,
            # and a repeated prompt's output can come in a few messages), so something is left to resume
            head = [parts[0]]
            for p in parts[1:]:
                if sum(len(h.token_ids) for h in head) + len(p.token_ids) > 12:
                    break
                head.append(p)
            head_ids = [t for p in head for t in p.token_ids]
            head_text = "".join(p.text for p in head)
            rest = list(stub.GenerateStream(llm_pb2.GenerateRequest(
                prompt="Once upon a time", sampling=sampling, resume_token_ids=head_ids,
                resume_text_chars=len(head_text)), timeout=60))
            assert head_ids + [t for p in rest for t in p.token_ids] == list(full.token_ids)
            assert head_text + "".join(p.text for p in rest) == full.text
            assert rest[-1].usage.completion_tokens == 24
        for bad in (dict(resume_token_ids=[1, 2, 3, 4]), dict(resume_token_ids=[10**6]),
                    dict(resume_token_ids=[42], resume_text_chars=1000)):
            with pytest.raises(grpc.RpcError) as err:
                stub.Generate(llm_pb2.GenerateRequest(prompt="Hi", sampling=SHORT, **bad), timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, bad


def test_engine_sigkilled_mid_stream_is_resumed_elsewhere_with_identical_tokens(cluster, router):
    request = llm_pb2.GenerateRequest(prompt="The history of the city", sampling=GREEDY_LONG)
    reference = router.Generate(request, timeout=120)
    stream = router.GenerateStream(request, timeout=120)
    parts = [next(stream)]
    victim = wait_until(lambda: next((n for n in ("a1", "a2") if cluster.running(n)), None), 10,
                        "the engine serving the stream")
    cluster.engines[victim].proc.send_signal(signal.SIGKILL)
    cluster.engines[victim].proc.wait()
    parts.extend(stream)
    assert [t for p in parts for t in p.token_ids] == list(reference.token_ids)
    assert "".join(p.text for p in parts) == reference.text
    assert parts[-1].finish_reason == llm_pb2.FINISH_REASON_LENGTH
    assert len({p.request_id for p in parts}) == 1
    assert "resuming on another engine" in (cluster.tmp / "router.log").read_text()
    del cluster.engines[victim]
    # Its check goes critical and DeregisterCriticalServiceAfter removes it from the catalog.
    wait_until(lambda: victim not in cluster.passing("dc1"), 30, "the killed engine to leave Consul")


def test_spills_to_the_second_datacenter_when_the_first_has_no_healthy_engine(cluster, router):
    (survivor,) = [n for n in cluster.engines if n.startswith("a")]
    cluster.engines.pop(survivor).stop()          # graceful: deregisters itself
    assert "deregistered" in (cluster.tmp / f"engine-{survivor}.log").read_text()
    wait_until(lambda: not cluster.passing("dc1"), 30, "dc1 to have no passing engine")
    wait_until(lambda: loaded_on(router) == {cluster.engines["b1"].address}, 30, "the router to drop dc1's engines")
    before = cluster.finished("b1")
    for i in range(3):
        router.Generate(llm_pb2.GenerateRequest(prompt=f"Spill {i}", sampling=SHORT), timeout=60)
    assert cluster.finished("b1") == before + 3


def test_engine_added_at_run_time_gets_traffic_without_a_router_restart(cluster, router):
    new = cluster.start_engine("a3", "dc1")
    wait_until(lambda: new.address in loaded_on(router), 30, "the router to discover the new engine")
    for i in range(3):
        router.Generate(llm_pb2.GenerateRequest(prompt=f"Local again {i}", sampling=SHORT), timeout=60)
    assert cluster.finished("a3") == 3, "dc1 is preferred again as soon as it has a healthy engine"


def test_routing_continues_from_the_last_known_set_when_consul_is_down(cluster, router):
    known = loaded_on(router)
    cluster.consul_proc.send_signal(signal.SIGKILL)
    cluster.consul_proc.wait()
    before = cluster.finished("a3")
    for i in range(3):
        router.Generate(llm_pb2.GenerateRequest(prompt=f"Consul is gone {i}", sampling=SHORT), timeout=60)
    assert cluster.finished("a3") == before + 3
    assert loaded_on(router) == known
    stream = list(router.GenerateStream(llm_pb2.GenerateRequest(prompt="Still", sampling=SHORT), timeout=60))
    assert stream[-1].finish_reason == llm_pb2.FINISH_REASON_LENGTH
    assert cluster.router.proc.poll() is None and os.path.exists(cluster.tmp / "router.log")


def test_engines_register_again_when_consul_comes_back_without_its_state(cluster, router):
    """An agent restarted without its data directory knows no services: each engine notices and registers
    again, and the router follows the restored catalog."""
    cluster.start_consul()
    wait_until(lambda: cluster.passing("dc1") == {"a3"} and cluster.passing("dc2") == {"b1"}, 30,
               "both engines registered and passing in the restarted Consul")
    assert "registering again" in (cluster.tmp / "engine-a3.log").read_text()
    wait_until(lambda: "watch of llmserve-engine in dc1 restored" in (cluster.tmp / "router.log").read_text(), 30,
               "the router's watch to reach the restarted Consul")
    before = cluster.finished("a3")
    for i in range(3):
        router.Generate(llm_pb2.GenerateRequest(prompt=f"Consul is back {i}", sampling=SHORT), timeout=60)
    assert cluster.finished("a3") == before + 3
    assert loaded_on(router) == {cluster.engines["a3"].address, cluster.engines["b1"].address}
