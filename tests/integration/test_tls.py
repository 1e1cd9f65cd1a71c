"""TLS and mTLS on every hop, with certificates made at test time: client → router → engine → worker,
and Consul's gRPC health check of the engine (GRPCUseTLS, the agent's own certificate)."""
from __future__ import annotations

import json
import re
import ssl
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import consul
import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmserve.v1 import engine_admin_pb2, engine_admin_pb2_grpc, llm_pb2, llm_pb2_grpc
from llmserve.worker.v1 import worker_pb2, worker_pb2_grpc
from services.common.consul_client import ENGINE_SERVICE
from services.common.security import AUTHORIZATION, TlsFiles, channel, hash_key
from services import REPO_ROOT
from services.stack import ServiceProcess, start_service
from tests.certs import make_ca, make_leaf
from tests.conftest import TINY_ENGINE_ARGS
from tests.helpers import wait_until

SHORT = llm_pb2.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
API_KEY = "tls-api-key-0123456789"


class Pki:
    def __init__(self, d: Path):
        ca, rogue = make_ca(d), make_ca(d / "rogue", "rogue-ca")
        self.node = make_leaf(d, "node", ca)          # router, engine and worker
        self.client = make_leaf(d, "client", ca)
        self.consul = make_leaf(d, "consul-agent", ca)
        self.rogue = make_leaf(d / "rogue", "intruder", rogue)


class TlsCluster:
    def __init__(self, d: Path, model_dir: Path):
        self.dir = d
        self.pki = Pki(d)
        self.processes: list[ServiceProcess] = []
        self.consul_proc: subprocess.Popen[bytes] | None = None
        self.model_dir = model_dir
        self.consul_port = 0

    def start(self) -> None:
        c = self.pki.consul
        port_file = self.dir / "consul-ports.json"
        self.consul_proc = subprocess.Popen(
            [sys.executable, "-m", "tests.consul_standin", "--port-file", str(port_file), "--tls-ca", c.ca,
             "--tls-cert", c.cert, "--tls-key", c.key, "--deregister-min", "0s", "--reap-interval", "200ms"],
            cwd=REPO_ROOT, stdout=open(self.dir / "consul.log", "ab"), stderr=subprocess.STDOUT,
            start_new_session=True)
        wait_until(port_file.exists, 30, "the Consul stand-in to listen")
        self.consul_port = json.loads(port_file.read_text())["dc1"]
        tls_args = self.pki.node.args()
        (self.dir / "admin.keys").write_text(hash_key("tls-admin-key-0123456789") + "\n")
        (self.dir / "api.keys").write_text(hash_key(API_KEY) + "\n")
        self.engine = self._start("services.engine", [
            "--model", str(self.model_dir), *TINY_ENGINE_ARGS, *tls_args, "--consul-addr",
            f"127.0.0.1:{self.consul_port}", "--node-name", "tls-node", "--consul-check-interval", "0.5",
            "--admin-keys-file", str(self.dir / "admin.keys")], "engine")
        # Discovery sees only engines whose check passes: the router serves only once Consul's TLS check does.
        self.router = self._start("services.router", [
            *tls_args, "--consul-addr", f"127.0.0.1:{self.consul_port}", "--datacenters", "dc1",
            "--health-interval", "0.2", "--consul-wait", "2", "--http-port", "0", "--http-port-file",
            str(self.dir / "http.port")], "router", ready_timeout=120)
        self.router_https = f"https://127.0.0.1:{(self.dir / 'http.port').read_text().strip()}"
        # A router whose clients use API keys over TLS, without client certificates.
        self.keyed_router = self._start("services.router", [
            *tls_args, "--no-tls-client-auth", "--api-keys-file", str(self.dir / "api.keys"),
            "--engines", self.engine.address, "--health-interval", "0.2", "--http-port", "-1"], "keyed-router",
            ready_timeout=120)

    def _start(self, module: str, args: list[str], name: str, ready_timeout: float = 600) -> ServiceProcess:
        proc = start_service(module, args, ready_timeout, log_path=self.dir / f"{name}.log", tls=self.pki.node)
        self.processes.append(proc)
        return proc

    def worker_address(self) -> str:
        found = re.findall(r"started worker pid \d+ at (\S+)", (self.dir / "engine.log").read_text())
        assert found, "the engine log names its worker"
        return found[-1]

    def stop(self) -> None:
        for proc in reversed(self.processes):
            proc.stop()
        if self.consul_proc is not None and self.consul_proc.poll() is None:
            self.consul_proc.terminate()
            self.consul_proc.wait(10)


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsCluster]:
    c = TlsCluster(tmp_path_factory.mktemp("tls"), tiny_model_dir)
    try:
        c.start()
        yield c
    finally:
        c.stop()


def _health(address: str, creds: grpc.ChannelCredentials | None) -> grpc.StatusCode | int:
    ch = grpc.secure_channel(address, creds) if creds is not None else grpc.insecure_channel(address)
    with ch:
        try:
            return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status
        except grpc.RpcError as exc:
            return exc.code()  # type: ignore[attr-defined, no-any-return]


def test_consul_checks_the_engine_over_mtls(cluster: TlsCluster) -> None:
    _, entries = consul.Consul(host="127.0.0.1", port=cluster.consul_port).health.service(ENGINE_SERVICE, dc="dc1")
    [entry] = entries
    [check] = [c for c in entry["Checks"] if c["ServiceID"] == entry["Service"]["ID"]]
    assert check["Status"] == "passing", check["Output"]
    assert check["Output"].startswith(f"gRPC check {cluster.engine.address}: success")


def test_every_hop_refuses_peers_without_a_certificate_from_the_ca(cluster: TlsCluster) -> None:
    ca = Path(cluster.pki.node.ca).read_bytes()
    rogue = cluster.pki.rogue
    for address in (cluster.router.address, cluster.engine.address, cluster.worker_address()):
        assert _health(address, cluster.pki.client.channel_credentials()) == health_pb2.HealthCheckResponse.SERVING
        assert _health(address, None) == grpc.StatusCode.UNAVAILABLE, address                     # plaintext
        assert _health(address, grpc.ssl_channel_credentials(ca)) == grpc.StatusCode.UNAVAILABLE   # no client cert
        assert _health(address, TlsFiles(rogue.cert, rogue.key, cluster.pki.node.ca).channel_credentials()) \
            == grpc.StatusCode.UNAVAILABLE, address                                                # another CA's cert
        # ...and a client that trusts another CA does not trust this server.
        assert _health(address, rogue.channel_credentials()) == grpc.StatusCode.UNAVAILABLE


def test_generation_over_mtls_end_to_end(cluster: TlsCluster) -> None:
    with channel(cluster.router.address, cluster.pki.client) as ch:
        stub = llm_pb2_grpc.LLMServiceStub(ch)
        request = llm_pb2.GenerateRequest(prompt="Hello", sampling=SHORT)
        assert len(stub.Generate(request, timeout=60).token_ids) == 4
        assert sum(len(c.token_ids) for c in stub.GenerateStream(request, timeout=60)) == 4


def test_a_router_may_take_api_keys_instead_of_client_certificates(cluster: TlsCluster) -> None:
    creds = grpc.ssl_channel_credentials(Path(cluster.pki.node.ca).read_bytes())   # verifies the router, no cert
    with grpc.secure_channel(cluster.keyed_router.address, creds) as ch:
        stub = llm_pb2_grpc.LLMServiceStub(ch)
        request = llm_pb2.GenerateRequest(prompt="Hello", sampling=SHORT)
        with pytest.raises(grpc.RpcError) as err:
            stub.Generate(request, timeout=30)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
        ok = stub.Generate(request, timeout=60, metadata=[(AUTHORIZATION, f"Bearer {API_KEY}")])
        assert len(ok.token_ids) == 4


def test_a_router_certificate_is_not_an_admin_credential(cluster: TlsCluster) -> None:
    with channel(cluster.engine.address, cluster.pki.client) as ch:
        admin = engine_admin_pb2_grpc.EngineAdminStub(ch)
        assert admin.GetLoad(engine_admin_pb2.GetLoadRequest(), timeout=10).num_kv_blocks_total > 0
        with pytest.raises(grpc.RpcError) as err:
            admin.UnloadModel(engine_admin_pb2.UnloadModelRequest(model=""), timeout=30)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED  # type: ignore[attr-defined]
        loaded = admin.LoadModel(engine_admin_pb2.LoadModelRequest(model=""), timeout=60,
                                 metadata=[(AUTHORIZATION, "Bearer tls-admin-key-0123456789")])
        assert loaded.was_loaded


def test_a_worker_wants_its_engines_secret_even_over_mtls(cluster: TlsCluster) -> None:
    with channel(cluster.worker_address(), cluster.pki.client) as ch:
        with pytest.raises(grpc.RpcError) as err:
            worker_pb2_grpc.WorkerStub(ch).GetInfo(worker_pb2.GetInfoRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]


def _https_get(url: str, ca: str, client: TlsFiles | None) -> int | str:
    """The status of GET ``url`` (trusting ``ca``, presenting ``client``'s certificate), or why none came."""
    context = ssl.create_default_context(cafile=ca)
    if client is not None:
        context.load_cert_chain(client.cert, client.key)
    try:
        return httpx.get(url, verify=context, timeout=30).status_code
    except httpx.HTTPError as exc:
        return type(exc).__name__


def test_the_http_face_wants_a_client_certificate_too(cluster: TlsCluster) -> None:
    """--tls-ca on the router asks every HTTPS client for a certificate the CA signed, as gRPC does."""
    url, ca = cluster.router_https + "/v1/models", cluster.pki.node.ca
    assert _https_get(url, ca, cluster.pki.client) == 200
    assert _https_get(url, ca, None) in ("ConnectError", "ReadError", "RemoteProtocolError")          # no cert
    assert _https_get(url, ca, cluster.pki.rogue) in ("ConnectError", "ReadError", "RemoteProtocolError")  # other CA
    with pytest.raises(httpx.HTTPError):
        httpx.get(url.replace("https://", "http://"), timeout=30)                                        # plaintext
