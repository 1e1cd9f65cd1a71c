"""Credentials of every hop: API and admin keys, the cluster and worker secrets, TLS files.

Who may call what (``Guard``, a grpc.aio server interceptor, first on every server):

- health (``grpc.health.v1``) and reflection are always open: Consul, ``wait_for_serving`` and
  grpcurl use them, and they reveal nothing a port scan does not (``--no-reflection`` closes
  reflection by not serving it);
- ``CLIENT`` methods need one of ``client_keys`` (the router: API keys; the engine: the cluster
  secret the router sends; the worker: the secret its engine made for it) or an admin key;
- ``ADMIN`` methods (anything that changes state) need an admin key; a valid non-admin credential
  gets PERMISSION_DENIED, none or a wrong one UNAUTHENTICATED.

A guard with no keys at all lets everything through: ``make up`` on loopback needs no setup.
Keys are stored as SHA-256 hashes (a key file holds hashes, never keys) and compared with
``hmac.compare_digest`` against every stored hash, so timing says nothing about which bytes matched.

TLS: ``TlsFiles`` makes server credentials (mTLS when ``ca`` is given: a client must present a
certificate the CA signed) and the matching channel credentials for the client side of a hop.

``python -m services.common.security hash-key`` reads a key on stdin (or makes one with ``--new``)
and prints the line for a key file.
"""
from __future__ import annotations

import argparse
import enum
import hashlib
import hmac
import re
import secrets
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import grpc

from services.common.config import ConfigError

# Request metadata (gRPC keys are lower case).
AUTHORIZATION = "authorization"               # "Bearer <key>": API keys (router) and admin keys (engine)
CLUSTER_SECRET = "x-llmserve-cluster-secret"  # router → engine
WORKER_SECRET = "x-llmserve-worker-secret"    # engine → its worker
# The engine hands a spawned worker its secret here (the environment, not argv: /proc/<pid>/cmdline
# is world-readable, /proc/<pid>/environ only to the same user).
WORKER_SECRET_ENV = "LLMSERVE_WORKER_SECRET"

OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/",
                 "/grpc.reflection.v1.ServerReflection/")
_HASH_LINE = re.compile(r"^(?:sha256:)?([0-9a-fA-F]{64})(?:\s+(.*))?$")


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    return secrets.token_urlsafe(32)


class KeySet:
    """Hashes of the keys that are valid; ``matches`` is constant-time in the presented key."""

    def __init__(self, hashes: Iterable[str] = ()):
        self._hashes = tuple(bytes.fromhex(h) for h in hashes)

    @classmethod
    def of_keys(cls, *keys: str) -> "KeySet":
        return cls(hash_key(k) for k in keys if k)

    def __bool__(self) -> bool:
        return bool(self._hashes)

    def __len__(self) -> int:
        return len(self._hashes)

    def matches(self, key: str) -> bool:
        return self.index_of(key) is not None

    def index_of(self, key: str) -> int | None:
        """Which stored hash ``key`` has (its line among the file's keys), or None."""
        digest = hashlib.sha256(key.encode(errors="surrogatepass")).digest()
        found = None
        for i, stored in enumerate(self._hashes):  # no early exit: every hash is compared
            if hmac.compare_digest(digest, stored):
                found = i
        return found


def load_key_file(path: str, flag: str) -> KeySet:
    """A key file: one SHA-256 hex digest per line (``sha256:`` prefix and a trailing label allowed),
    ``#`` comments and blank lines ignored. A line that is not a digest is refused: a key file must
    not hold keys. Empty ``path`` = no keys (that check is off)."""
    return KeySet(digest for digest, _ in read_key_file(path, flag))


def read_key_file(path: str, flag: str) -> list[tuple[str, str]]:
    """The (digest, rest of the line) pairs of a key file (see ``load_key_file``); [] for no ``path``."""
    if not path:
        return []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"{flag}: cannot read {path}: {exc.strerror}") from None
    hashes = []
    for number, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _HASH_LINE.match(line)
        if match is None:
            raise ConfigError(f"{flag}: {path} line {number} is not a SHA-256 hex digest (store hashes, not keys: "
                              "python -m services.common.security hash-key)")
        hashes.append((match.group(1).lower(), (match.group(2) or "").strip()))
    if not hashes:
        raise ConfigError(f"{flag}: {path} holds no key hashes")
    return hashes


def read_secret_file(path: str, flag: str) -> str:
    """A shared secret from a file (its first line); empty ``path`` = none."""
    if not path:
        return ""
    try:
        secret = Path(path).read_text().strip()
    except OSError as exc:
        raise ConfigError(f"{flag}: cannot read {path}: {exc.strerror}") from None
    if len(secret) < 16:
        raise ConfigError(f"{flag}: the secret in {path} is shorter than 16 characters")
    return secret


# -- TLS ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TlsFiles:
    """PEM files of one service: its certificate and key (server side, and its client certificate
    on the hops it dials) and the CA that signs its peers (mTLS). All empty = plaintext."""

    cert: str = ""
    key: str = ""
    ca: str = ""

    @property
    def enabled(self) -> bool:
        return bool(self.cert)

    def validate(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ConfigError("--tls-cert and --tls-key go together")
        if self.ca and not self.cert:
            raise ConfigError("--tls-ca needs --tls-cert and --tls-key (TLS on every hop, or none)")
        for flag, path in (("--tls-cert", self.cert), ("--tls-key", self.key), ("--tls-ca", self.ca)):
            if path and not Path(path).is_file():
                raise ConfigError(f"{flag}: {path} is not a readable file")

    def args(self) -> list[str]:
        """The flags that hand these files to a child service (paths are not secrets)."""
        return [arg for flag, path in (("--tls-cert", self.cert), ("--tls-key", self.key), ("--tls-ca", self.ca))
                if path for arg in (flag, path)]

    def server_credentials(self, require_client_cert: bool = True) -> grpc.ServerCredentials | None:
        if not self.enabled:
            return None
        ca = Path(self.ca).read_bytes() if self.ca else None
        return grpc.ssl_server_credentials([(Path(self.key).read_bytes(), Path(self.cert).read_bytes())],
                                           root_certificates=ca, require_client_auth=bool(ca) and require_client_cert)

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """Verify the server with ``ca`` (else the system's roots) and present our certificate."""
        if not self.enabled:
            return None
        return grpc.ssl_channel_credentials(root_certificates=Path(self.ca).read_bytes() if self.ca else None,
                                            private_key=Path(self.key).read_bytes(),
                                            certificate_chain=Path(self.cert).read_bytes())


PLAINTEXT = TlsFiles()


@dataclass(frozen=True)
class TlsConfig:
    """The TLS flags every service has (router, engine and worker configs derive from this)."""

    tls_cert: str = field(default="", metadata={"path": True, "help": "PEM certificate: serve TLS, and present it as the client "
                                                        "certificate on the hops this service dials; empty = plaintext"})
    tls_key: str = field(default="", metadata={"path": True, "help": "PEM private key of --tls-cert"})
    tls_ca: str = field(default="", metadata={"path": True, "help": "PEM CA: verify the servers this service dials, and require "
                                                      "clients to present a certificate it signed (mTLS)"})
    reflection: bool = field(default=True, metadata={"help": "serve gRPC reflection (open, like health: it lists "
                                                             "the public API); --no-reflection turns it off"})

    @property
    def tls(self) -> TlsFiles:
        return TlsFiles(self.tls_cert, self.tls_key, self.tls_ca)


def channel(address: str, tls: TlsFiles = PLAINTEXT, options: Any = None) -> grpc.Channel:
    creds = tls.channel_credentials()
    if creds is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, creds, options=options)


def aio_channel(address: str, tls: TlsFiles = PLAINTEXT, options: Any = None) -> grpc.aio.Channel:
    creds = tls.channel_credentials()
    if creds is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, creds, options=options)


@dataclass(frozen=True)
class Dialer:
    """How a service reaches its next hop: TLS files, and the metadata every call carries (its
    credential: the cluster secret, a worker's secret). Call sites pass ``metadata`` explicitly."""

    tls: TlsFiles = PLAINTEXT
    metadata: tuple[tuple[str, str], ...] = ()

    def channel(self, address: str, options: Any = None) -> grpc.Channel:
        return channel(address, self.tls, options)

    def aio_channel(self, address: str, options: Any = None) -> grpc.aio.Channel:
        return aio_channel(address, self.tls, options)


# -- the server side ------------------------------------------------------------------------------

class Access(enum.Enum):
    OPEN = "open"
    CLIENT = "client"
    ADMIN = "admin"


@dataclass(frozen=True)
class AccessPolicy:
    """What a server demands. ``client_keys`` are checked in ``client_header`` (``authorization``
    takes ``Bearer <key>``); ``admin_keys`` always in ``authorization``. ``admin_methods`` are full
    method names (``/pkg.Service/Method``). A server that demands any credential but has no admin
    keys refuses its admin methods outright: a router's credential must not unload models.
    ``transport_authenticated`` (mTLS) makes every caller a client, not an admin."""

    client_keys: KeySet = KeySet()
    client_header: str = AUTHORIZATION
    admin_keys: KeySet = KeySet()
    admin_methods: frozenset[str] = frozenset()
    transport_authenticated: bool = False     # mTLS: every connection already presented a CA-signed cert
    what: str = "this service"                # for messages: "the router", "the engine", ...
    carrier: str = "metadata"                 # for messages: where a credential goes ("header" on HTTP)

    @property
    def open(self) -> bool:
        return not self.client_keys and not self.admin_keys and not self.transport_authenticated

    def access(self, method: str) -> Access:
        if method.startswith(OPEN_SERVICES):
            return Access.OPEN
        return Access.ADMIN if method in self.admin_methods else Access.CLIENT

    def check(self, method: str, metadata: Iterable[tuple[str, Any]]) -> tuple[grpc.StatusCode, str] | None:
        """None when the call may proceed; else the status and message to refuse it with."""
        if self.open:
            return None
        access = self.access(method)
        if access is Access.OPEN:
            return None
        headers: dict[str, str] = {}
        for k, v in metadata:
            if isinstance(v, str):
                headers.setdefault(k.lower(), v)
        bearer = _bearer(headers.get(AUTHORIZATION, ""))
        is_admin = bool(self.admin_keys) and bearer is not None and self.admin_keys.matches(bearer)
        if is_admin:
            return None
        if self.client_header == AUTHORIZATION:
            presented = bearer
        else:
            presented = headers.get(self.client_header)
        if self.client_keys:
            is_client = presented is not None and self.client_keys.matches(presented)
        else:
            is_client = self.transport_authenticated
        if access is Access.CLIENT:
            if is_client or not self.client_keys:
                return None
            return grpc.StatusCode.UNAUTHENTICATED, self._missing(presented, bearer)
        # ADMIN
        if not self.admin_keys:
            return (grpc.StatusCode.PERMISSION_DENIED,
                    f"{method} changes state and {self.what} has no admin keys configured (--admin-keys-file)")
        if is_client:
            return grpc.StatusCode.PERMISSION_DENIED, f"{method} needs an admin key; the credential given is not one"
        if bearer:
            return grpc.StatusCode.UNAUTHENTICATED, f"{method}: the admin key is not valid"
        return (grpc.StatusCode.UNAUTHENTICATED,
                f"{method} needs an admin key: send the {self.carrier} 'authorization: Bearer <admin key>'")

    def _missing(self, presented: str | None, bearer: str | None) -> str:
        if self.client_header == AUTHORIZATION:
            if presented is None:
                return f"{self.what} needs an API key: send the {self.carrier} 'authorization: Bearer <key>'"
            return f"{self.what}: the API key is not valid"
        if presented is None and bearer is None:
            return f"{self.what} accepts calls only with its credential ({self.client_header} {self.carrier} or mTLS)"
        return f"{self.what}: the credential given is not valid"


def bearer_token(value: str) -> str | None:
    """The key of an ``authorization: Bearer <key>`` value; None for any other value."""
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


_bearer = bearer_token


@dataclass(frozen=True)
class ServerSecurity:
    """Everything ``create_server`` needs to secure one server."""

    policy: AccessPolicy = AccessPolicy()
    tls: TlsFiles = PLAINTEXT
    require_client_cert: bool = True     # with tls.ca: mTLS (False: the CA only verifies the peers we dial)
    reflection: bool = True              # serve grpc.reflection (open to anyone who can connect)


class Guard(grpc.aio.ServerInterceptor):
    """Refuses calls that ``policy`` refuses, before any service code runs."""

    def __init__(self, policy: AccessPolicy):
        self.policy = policy

    async def intercept_service(self, continuation: Callable[[Any], Any], handler_call_details: Any) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        refusal = self.policy.check(handler_call_details.method, handler_call_details.invocation_metadata or ())
        if refusal is None:
            return handler
        code, message = refusal

        async def refuse_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(code, message)

        async def refuse_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(code, message)
            yield  # pragma: no cover - an async generator, like the handler it replaces

        for kind, refuse in (("unary_unary", refuse_unary), ("stream_unary", refuse_unary),
                             ("unary_stream", refuse_stream), ("stream_stream", refuse_stream)):
            if getattr(handler, kind) is not None:
                return handler._replace(**{kind: refuse})
        return handler


# -- the CLI ----------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m services.common.security",
                                     description="Key-file lines for --api-keys-file and --admin-keys-file.")
    sub = parser.add_subparsers(dest="command", required=True)
    hk = sub.add_parser("hash-key", help="print the key file line (SHA-256) of the key read from stdin")
    hk.add_argument("--new", action="store_true", help="make a new random key; print it on stderr and its "
                                                        "line on stdout")
    hk.add_argument("--label", default="", help="text after the hash on the line (who the key is for)")
    args = parser.parse_args(argv)
    if args.new:
        key = new_key()
        print(key, file=sys.stderr)
    else:
        key = sys.stdin.readline().strip()
        if not key:
            parser.error("no key on stdin")
    print(f"{hash_key(key)}{' ' + args.label if args.label else ''}")


if __name__ == "__main__":
    main()
