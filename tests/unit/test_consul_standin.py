"""The Consul stand-in follows the documented behaviour the project relies on, and the router's
discovery watch works against it through py-consul (no model, no engine: a bare health server)."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time

import consul
import pytest

from services.common.consul_client import ENGINE_SERVICE, ConsulSettings
from services.common.server import create_server
from services.router import discovery
from services.router.discovery import ConsulDiscovery, EngineRecord
from tests.helpers import REPO_ROOT, wait_until


@pytest.fixture(scope="module")
def ports(tmp_path_factory):
    port_file = tmp_path_factory.mktemp("consul") / "ports.json"
    proc = subprocess.Popen([sys.executable, "-m", "tests.consul_standin", "--dc", "dc1", "--dc", "dc2",
                             "--port-file", str(port_file), "--deregister-min", "0s", "--reap-interval", "100ms"],
                            cwd=REPO_ROOT, start_new_session=True)
    try:
        wait_until(port_file.exists, 30, "the stand-in to listen")
        yield json.loads(port_file.read_text())
    finally:
        proc.terminate()
        proc.wait(10)


class HealthServer:
    """A bare asyncio gRPC server (health only) on its own event loop thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="health-server", daemon=True)
        self.thread.start()
        self.handle = self.call(create_server([], [], "127.0.0.1", 0))
        self.port = self.handle.port

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=10)

    def set_serving(self, serving: bool) -> None:
        self.call(self.handle.set_serving(serving))

    def stop(self) -> None:
        self.call(self.handle.server.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


@pytest.fixture
def health_server():
    server = HealthServer()
    yield server
    server.stop()


def client(ports, dc="dc1") -> consul.Consul:
    return consul.Consul(host="127.0.0.1", port=ports[dc])


def test_register_decoding_rules(ports):
    c = client(ports)
    with pytest.raises(consul.ConsulException, match='unknown field "id"'):
        c.agent.service.register("svc", service_id="bad", check={"id": "x", "ttl": "5s"})
    with pytest.raises(consul.ConsulException, match="Interval and TTL"):
        c.agent.service.register("svc", service_id="bad", check={"ttl": "5s", "interval": "1s"})
    assert c.agent.service.register("svc", service_id="s1", check={"ttl": "5s"}, extra_checks=[{"ttl": "5s"}])
    _, entries = c.health.service("svc")
    ids = sorted(ch["CheckID"] for ch in entries[0]["Checks"])
    assert ids == ["serfHealth", "service:s1:1", "service:s1:2"]      # numbered when more than one
    assert all(ch["Status"] == "critical" for ch in entries[0]["Checks"] if ch["CheckID"] != "serfHealth")
    assert c.health.service("svc", passing=True)[1] == []
    assert set(c.agent.services()) >= {"s1"}                          # the local agent's services, by id
    assert "s1" not in client(ports, "dc2").agent.services()          # another datacenter's agent has its own
    assert c.agent.service.deregister("s1")
    assert c.agent.service.deregister("s1") is False                 # 404 for an unknown id
    assert "s1" not in c.agent.services()


def test_ttl_check_blocking_query_and_datacenters(ports):
    c = client(ports)
    c.agent.service.register("ttl", service_id="t1", check={"CheckID": "t1-ttl", "ttl": "1s"})
    index, entries = c.health.service("ttl", passing=True)
    assert entries == [] and int(index) >= 1
    done = {}

    def block() -> None:
        done["answer"] = c.health.service("ttl", index=index, wait="10s", passing=True)

    waiter = threading.Thread(target=block)
    waiter.start()
    time.sleep(0.2)  # let the query block: it must not answer before the change below
    assert "answer" not in done
    c.agent.check.ttl_pass("t1-ttl", notes="fine")
    waiter.join(10)
    new_index, passing = done["answer"]
    assert int(new_index) > int(index) and [e["Service"]["ID"] for e in passing] == ["t1"]
    # no update within the TTL: critical, and with no deregister-after it stays registered
    wait_until(lambda: c.health.service("ttl", passing=True)[1] == [], 10, "the TTL to expire")
    (entry,) = c.health.service("ttl")[1]
    assert any(ch["Output"].startswith("TTL expired") for ch in entry["Checks"])
    assert c.health.service("ttl", dc="dc2")[1] == []                # separate catalogs
    with pytest.raises(consul.ConsulException, match="No path to datacenter"):
        c.health.service("ttl", dc="dc9")
    assert c.catalog.datacenters() == ["dc1", "dc2"]
    c.agent.service.deregister("t1")


def test_grpc_check_probes_the_health_service_and_critical_services_are_reaped(ports, health_server):
    c = client(ports, "dc2")
    target = f"127.0.0.1:{health_server.port}"
    c.agent.service.register(ENGINE_SERVICE, service_id="g1", address="127.0.0.1", port=health_server.port,
                             check={"CheckID": "g1-grpc", "GRPC": target, "Interval": "1s", "Timeout": "1s",
                                    "DeregisterCriticalServiceAfter": "1s"})
    health_server.set_serving(True)
    wait_until(lambda: c.health.service(ENGINE_SERVICE, passing=True)[1], 10, "the gRPC check to pass")
    health_server.set_serving(False)
    wait_until(lambda: not c.health.service(ENGINE_SERVICE, passing=True)[1], 10, "NOT_SERVING to turn critical")
    wait_until(lambda: not c.health.service(ENGINE_SERVICE)[1], 10, "the critical service to be reaped")


def test_discovery_follows_passing_engines_in_each_datacenter(ports):
    seen: dict[str, list[EngineRecord]] = {}
    watch = ConsulDiscovery(ConsulSettings("http", "127.0.0.1", ports["dc1"], None), [], lambda dc, r: seen.__setitem__(dc, r),
                            wait_seconds=2)
    watch.start()
    try:
        wait_until(watch.ready.is_set, 10, "the datacenter list")
        assert watch.datacenters == ["dc1", "dc2"]
        c = client(ports, "dc2")
        c.agent.service.register(ENGINE_SERVICE, service_id="w1", address="10.0.0.7", port=50052,
                                 meta={"node": "n7", "models": "m1,m2"},
                                 check={"CheckID": "w1-ttl", "TTL": "30s", "Status": "passing"})
        wait_until(lambda: seen.get("dc2"), 10, "discovery to see the engine")
        assert seen["dc2"] == [EngineRecord("10.0.0.7:50052", "dc2", "n7", frozenset({"m1", "m2"}))]
        c.agent.check.ttl_fail("w1-ttl")
        wait_until(lambda: seen.get("dc2") == [], 10, "discovery to drop the failing engine")
        c.agent.service.deregister("w1")
    finally:
        watch.stop()


def test_discovery_resets_a_backwards_index_and_keeps_the_last_set_on_errors(monkeypatch):
    answers = [("50", []), ConnectionError("consul is down"), ("7", []), ("8", [])]
    asked: list[int | None] = []
    done = threading.Event()

    class FakeHealth:
        def service(self, name, index=None, wait=None, passing=None, dc=None):
            asked.append(index)
            if not answers:
                done.set()
                time.sleep(0.05)
                return ("8", [])
            answer = answers.pop(0)
            if isinstance(answer, Exception):
                raise answer
            return answer

    class FakeClient:
        health = FakeHealth()

    monkeypatch.setattr(discovery, "connect", lambda settings, timeout=10.0: FakeClient())
    changes: list[str] = []
    watch = ConsulDiscovery(ConsulSettings("http", "x", 1, None), ["dc1"], lambda dc, r: changes.append(dc))
    watch.start()
    try:
        wait_until(done.is_set, 10, "the fake answers to be used up")
    finally:
        watch.stop()
    # 0 → 50; error: retry with 50; 7 < 50: reset to 0; then 8
    assert asked[:5] == [None, 50, 50, None, 8]
    assert len(changes) >= 3
