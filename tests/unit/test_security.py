"""Keys, access decisions and TLS of services.common.security (real certificates, a real server)."""
from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.config import ConfigError
from services.common.security import (AUTHORIZATION, CLUSTER_SECRET, AccessPolicy, KeySet, ServerSecurity,
                                      TlsFiles, channel, hash_key, load_key_file)
from services.common.server import create_server
from tests.certs import make_ca, make_leaf

ADMIN = "/llmserve.v1.EngineAdmin/UnloadModel"
GENERATE = "/llmserve.v1.LLMService/Generate"
HEALTH = "/grpc.health.v1.Health/Check"
REFLECTION = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"


def test_key_set_matches_only_its_keys() -> None:
    keys = KeySet([hash_key("alpha-key-0123456789"), hash_key("beta-key-0123456789")])
    assert keys.matches("alpha-key-0123456789") and keys.matches("beta-key-0123456789")
    assert not keys.matches("alpha-key-012345678") and not keys.matches("") and not KeySet().matches("x")


def test_key_file_holds_hashes_not_keys(tmp_path: Path) -> None:
    good = tmp_path / "keys"
    good.write_text(f"# team keys\n\nsha256:{hash_key('k1-abcdefghijklmnop')} alice\n{hash_key('k2-abcdefghijklmnop').upper()}\n")
    keys = load_key_file(str(good), "--api-keys-file")
    assert len(keys) == 2 and keys.matches("k1-abcdefghijklmnop") and keys.matches("k2-abcdefghijklmnop")
    raw = tmp_path / "raw"
    raw.write_text("k1-abcdefghijklmnop\n")
    with pytest.raises(ConfigError, match="line 1 is not a SHA-256 hex digest"):
        load_key_file(str(raw), "--api-keys-file")
    with pytest.raises(ConfigError, match="cannot read"):
        load_key_file(str(tmp_path / "missing"), "--api-keys-file")
    (tmp_path / "empty").write_text("# nothing\n")
    with pytest.raises(ConfigError, match="holds no key hashes"):
        load_key_file(str(tmp_path / "empty"), "--api-keys-file")


def test_hash_key_cli_prints_a_line_the_key_file_accepts(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "services.common.security", "hash-key", "--label", "ci"],
                         input="my-secret-key-123456\n", capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == f"{hash_key('my-secret-key-123456')} ci"
    new = subprocess.run([sys.executable, "-m", "services.common.security", "hash-key", "--new"],
                         capture_output=True, text=True, timeout=60, check=True)
    (tmp_path / "keys").write_text(new.stdout)
    assert load_key_file(str(tmp_path / "keys"), "--api-keys-file").matches(new.stderr.strip())


def bearer(key: str) -> list[tuple[str, str]]:
    return [(AUTHORIZATION, f"Bearer {key}")]


def test_router_policy_needs_an_api_key_except_for_health_and_reflection() -> None:
    policy = AccessPolicy(client_keys=KeySet.of_keys("api-key-0123456789"), what="the router")
    assert policy.check(GENERATE, bearer("api-key-0123456789")) is None
    assert policy.check(GENERATE, [(AUTHORIZATION, "bearer   api-key-0123456789 ")]) is None
    code, message = policy.check(GENERATE, []) or (None, "")
    assert code == grpc.StatusCode.UNAUTHENTICATED and "authorization: Bearer <key>" in message
    code, message = policy.check(GENERATE, bearer("api-key-012345678")) or (None, "")
    assert code == grpc.StatusCode.UNAUTHENTICATED and "not valid" in message
    assert policy.check(GENERATE, [(AUTHORIZATION, "api-key-0123456789")]) is not None   # no scheme
    assert policy.check(HEALTH, []) is None and policy.check(REFLECTION, []) is None


def test_engine_policy_separates_routers_from_admins() -> None:
    policy = AccessPolicy(client_keys=KeySet.of_keys("cluster-secret-0123456789"), client_header=CLUSTER_SECRET,
                          admin_keys=KeySet.of_keys("admin-key-0123456789"), admin_methods=frozenset({ADMIN}))
    router = [(CLUSTER_SECRET, "cluster-secret-0123456789")]
    assert policy.check(GENERATE, router) is None
    assert (policy.check(GENERATE, []) or (None,))[0] == grpc.StatusCode.UNAUTHENTICATED
    assert (policy.check(ADMIN, router) or (None,))[0] == grpc.StatusCode.PERMISSION_DENIED
    assert (policy.check(ADMIN, []) or (None,))[0] == grpc.StatusCode.UNAUTHENTICATED
    assert (policy.check(ADMIN, bearer("admin-key-012345678")) or (None,))[0] == grpc.StatusCode.UNAUTHENTICATED
    assert policy.check(ADMIN, bearer("admin-key-0123456789")) is None
    assert policy.check(GENERATE, bearer("admin-key-0123456789")) is None     # an admin may do what a router may
    assert policy.check(HEALTH, []) is None


def test_a_secured_engine_without_admin_keys_refuses_admin_calls_and_an_open_one_allows_all() -> None:
    mtls_only = AccessPolicy(admin_methods=frozenset({ADMIN}), transport_authenticated=True)
    assert mtls_only.check(GENERATE, []) is None
    code, message = mtls_only.check(ADMIN, []) or (None, "")
    assert code == grpc.StatusCode.PERMISSION_DENIED and "--admin-keys-file" in message
    admin_only = AccessPolicy(admin_keys=KeySet.of_keys("admin-key-0123456789"), admin_methods=frozenset({ADMIN}))
    assert admin_only.check(GENERATE, []) is None         # no router credential configured: generation is open
    assert (admin_only.check(ADMIN, []) or (None,))[0] == grpc.StatusCode.UNAUTHENTICATED
    assert AccessPolicy(admin_methods=frozenset({ADMIN})).check(ADMIN, []) is None   # make up: open


def test_tls_flags_are_checked(tmp_path: Path) -> None:
    (tmp_path / "c.pem").write_text("x")
    with pytest.raises(ConfigError, match="go together"):
        TlsFiles(cert=str(tmp_path / "c.pem")).validate()
    with pytest.raises(ConfigError, match="needs --tls-cert"):
        TlsFiles(ca=str(tmp_path / "c.pem")).validate()
    with pytest.raises(ConfigError, match="not a readable file"):
        TlsFiles(str(tmp_path / "c.pem"), str(tmp_path / "missing.key")).validate()


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TlsFiles]:
    d = tmp_path_factory.mktemp("pki")
    ca, rogue = make_ca(d / "ca"), make_ca(d / "rogue", "rogue-ca")
    return {"server": make_leaf(d / "ca", "server", ca), "client": make_leaf(d / "ca", "client", ca),
            "rogue": make_leaf(d / "rogue", "intruder", rogue)}


@pytest.fixture()
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def _health(address: str, tls: TlsFiles, *, plaintext: bool = False, no_client_cert: bool = False) -> grpc.StatusCode | int:
    if plaintext:
        ch = grpc.insecure_channel(address)
    elif no_client_cert:
        ch = grpc.secure_channel(address, grpc.ssl_channel_credentials(Path(tls.ca).read_bytes()))
    else:
        ch = channel(address, tls)
    with ch:
        try:
            return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status
        except grpc.RpcError as exc:
            return exc.code()  # type: ignore[attr-defined, no-any-return]


def test_mtls_server_accepts_only_clients_with_a_certificate_from_its_ca(pki: dict[str, TlsFiles],
                                                                          loop: asyncio.AbstractEventLoop) -> None:
    import threading

    handle = loop.run_until_complete(create_server([], [], "127.0.0.1", 0, ServerSecurity(tls=pki["server"])))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        address = f"127.0.0.1:{handle.port}"
        assert _health(address, pki["client"]) == health_pb2.HealthCheckResponse.NOT_SERVING  # reached it
        assert _health(address, pki["client"], no_client_cert=True) == grpc.StatusCode.UNAVAILABLE  # TLS, no cert
        assert _health(address, pki["rogue"]) == grpc.StatusCode.UNAVAILABLE                 # wrong CA
        rogue_client = TlsFiles(pki["rogue"].cert, pki["rogue"].key, pki["server"].ca)
        assert _health(address, rogue_client) == grpc.StatusCode.UNAVAILABLE                 # cert not from the CA
        assert _health(address, pki["client"], plaintext=True) == grpc.StatusCode.UNAVAILABLE  # no TLS at all
    finally:
        asyncio.run_coroutine_threadsafe(handle.server.stop(0), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def test_a_router_refuses_to_start_with_a_raw_key_in_its_key_file(tmp_path: Path) -> None:
    (tmp_path / "keys").write_text("my-raw-api-key-0123456789\n")
    out = subprocess.run([sys.executable, "-m", "services.router", "--port", "0", "--api-keys-file",
                          str(tmp_path / "keys")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "not a SHA-256 hex digest" in out.stderr, out.stderr
