"""A stand-in for Consul's HTTP API, for tests on machines with no Consul binary.

It is NOT Consul. It follows Consul's documented behaviour (``website/content/api-docs`` of
hashicorp/consul, and the agent source where the two differ, as summarised in
``/work/shared/reference/consul-and-grpc.md``) for exactly the endpoints llmserve uses through
py-consul:

- ``PUT /v1/agent/service/register`` (case-insensitive keys plus the snake-case aliases, unknown
  keys rejected with 400, ``Check`` then ``Checks``, default check IDs ``service:<id>[:n]``, new
  checks ``critical`` unless ``Status`` is given, re-registration keeps a check's status);
- ``PUT /v1/agent/service/deregister/:id`` (404 for an unknown id, as the source does; the docs
  say "no action");
- ``PUT /v1/agent/check/pass|warn|fail/:id`` and ``/check/update/:id`` (TTL checks);
- ``GET /v1/health/service/:name`` with ``passing`` (any non-passing check drops the entry, the
  node's ``serfHealth`` included), ``dc``, ``tag``, and blocking queries (``index`` + ``wait``,
  default 5m, capped at 10m, jitter up to wait/16, ``X-Consul-Index`` never 0);
- ``GET /v1/agent/services`` (the local agent's services by id), ``/v1/catalog/services``,
  ``/v1/catalog/datacenters``, ``/v1/status/leader``, ``/v1/agent/self``.

Checks really run: a gRPC check calls ``grpc.health.v1.Health/Check`` on its target (in plaintext,
or with ``GRPCUseTLS`` over TLS verified with the agent's CA and presenting the agent's certificate,
as Consul's ``enable_agent_tls_for_checks`` does: ``--tls-ca``/``--tls-cert``/``--tls-key``) every
``Interval`` (first probe after a random delay within one interval; intervals under 1s raised to
1s), SERVING → passing, anything else → critical; a TTL check turns critical when no update
arrives within its TTL. ``DeregisterCriticalServiceAfter`` removes a service whose check stayed
critical that long; Consul's 1m minimum and 30s reaper interval are flags here
(``--deregister-min``, ``--reap-interval``) because Consul's own tests lower them the same way.

Several datacenters: one process hosts one agent per datacenter, each on its own port (``--dc``
repeated). Each agent's ``agent/*`` endpoints act on its own datacenter; ``?dc=`` reads another's
catalog, as a WAN-federated server forwards it; an unknown dc answers 500 ``No path to
datacenter``. One global index increases monotonically across all of them.

    python -m tests.consul_standin --dc dc1 --dc dc2 --port-file /tmp/ports.json
writes ``{"dc1": port, "dc2": port}`` once every agent listens (``--port 0`` = free ports); ``--dc
dc1=8500`` pins one agent's port, so a restart keeps its address (and, like an agent without a data
directory, none of its state). Check status changes and reaps are logged, as the agent logs them.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

# Consul accepts these snake-case aliases (structs/service_definition.go, check_type.go); every other
# key matches case-insensitively, and a key that matches nothing is a 400.
SERVICE_KEYS = {"name", "id", "address", "port", "tags", "meta", "weights", "enabletagoverride",
                "taggedaddresses", "check", "checks", "kind", "proxy", "connect", "socketpath", "locality"}
SERVICE_ALIASES = {"enable_tag_override": "enabletagoverride", "tagged_addresses": "taggedaddresses"}
CHECK_KEYS = {"checkid", "name", "status", "notes", "grpc", "grpcusetls", "tlsskipverify", "tlsservername",
              "ttl", "interval", "timeout", "deregistercriticalserviceafter", "successbeforepassing",
              "failuresbeforecritical", "http", "tcp", "args", "serviceid", "method", "header", "body"}
CHECK_ALIASES = {"deregister_critical_service_after": "deregistercriticalserviceafter", "grpc_use_tls": "grpcusetls",
                 "tls_skip_verify": "tlsskipverify", "tls_server_name": "tlsservername", "service_id": "serviceid"}
STATUSES = ("passing", "warning", "critical")
MAX_OUTPUT = 4096
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_TRUE = {"1", "t", "T", "TRUE", "true", "True"}
_FALSE = {"0", "f", "F", "FALSE", "false", "False"}


class _NotModelled(Exception):
    pass


def _as_bool(value: Any) -> bool:
    return value is True or (isinstance(value, str) and value in _TRUE)


class HttpError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def parse_duration(value: Any) -> float:
    """A Go duration string ("10s", "1m30s", "500ms") or a number of nanoseconds → seconds."""
    if isinstance(value, (int, float)):
        return float(value) / 1e9
    text = str(value).strip()
    if text in ("", "0"):
        return 0.0
    pos, total = 0, 0.0
    for m in _DURATION.finditer(text):
        if m.start() != pos:
            raise ValueError(f"invalid duration {text!r}")
        total += float(m.group(1)) * _UNITS[m.group(2)]
        pos = m.end()
    if pos != len(text):
        raise ValueError(f"invalid duration {text!r}")
    return total


def _normalize(obj: dict[str, Any], allowed: set[str], aliases: dict[str, str]) -> dict[str, Any]:
    out = {}
    for key, value in obj.items():
        k = aliases.get(key, key.lower())
        if k not in allowed:
            raise HttpError(400, f'Request decode failed: json: unknown field "{key}"')
        out[k] = value
    return out


@dataclass
class Check:
    check_id: str
    name: str
    service_id: str
    service_name: str
    status: str
    output: str = ""
    notes: str = ""
    grpc: str = ""
    grpc_use_tls: bool = False
    tls_skip_verify: bool = False
    tls_server_name: str = ""
    interval: float = 0.0
    timeout: float = 10.0
    ttl: float = 0.0
    deregister_after: float = 0.0
    next_run: float = 0.0
    ttl_deadline: float = 0.0
    critical_since: float | None = None
    running: bool = False


@dataclass
class Service:
    id: str
    name: str
    address: str
    port: int
    tags: list[str]
    meta: dict[str, str]
    weights: dict[str, int]
    tagged_addresses: dict[str, Any]
    create_index: int
    modify_index: int
    check_ids: list[str] = field(default_factory=list)


@dataclass
class Datacenter:
    name: str
    node: str
    services: dict[str, Service] = field(default_factory=dict)
    checks: dict[str, Check] = field(default_factory=dict)
    service_index: dict[str, int] = field(default_factory=dict)   # name → index of its last change


class Cluster:
    """The catalogs of every hosted datacenter, one lock, one global index."""

    def __init__(self, dcs: list[str], deregister_min: float, reap_interval: float, check_interval_min: float,
                 check_tls: tuple[bytes | None, bytes | None, bytes | None] = (None, None, None)):
        self.check_tls = check_tls   # the agent's (CA, certificate, key) for TLS checks
        self.dcs = {dc: Datacenter(dc, f"standin-{dc}") for dc in dcs}
        self.index = 1
        self.deregister_min = deregister_min
        self.reap_interval = reap_interval
        self.check_interval_min = check_interval_min
        self.changed = threading.Condition()
        self._stop = threading.Event()
        self._channels: dict[str, grpc.Channel] = {}

    # -- writes (hold self.changed) --------------------------------------------------------

    def _bump(self, dc: Datacenter, service_name: str) -> None:
        self.index += 1
        dc.service_index[service_name] = self.index
        self.changed.notify_all()

    def register(self, dc_name: str, body: dict[str, Any], replace_existing_checks: bool = False) -> None:
        body = _normalize(body, SERVICE_KEYS, SERVICE_ALIASES)
        name = body.get("name") or ""
        if not name:
            raise HttpError(400, "Missing service name")
        sid = body.get("id") or name
        raw_checks = ([body["check"]] if body.get("check") else []) + list(body.get("checks") or [])
        checks = [_normalize(c, CHECK_KEYS, CHECK_ALIASES) for c in raw_checks if c]
        for c in checks:
            if c.get("interval") and c.get("ttl"):
                raise HttpError(400, "Invalid check: Interval and TTL cannot both be specified")
            if c.get("grpc") and parse_duration(c.get("interval") or 0) <= 0:
                raise HttpError(400, "Invalid check: Interval must be > 0 for Script, HTTP, H2PING, TCP, UDP or GRPC checks")
            if "ttl" in c and parse_duration(c["ttl"]) <= 0:
                raise HttpError(400, "Invalid check: TTL must be > 0 for TTL checks")
            if c.get("status") and c["status"] not in STATUSES:
                raise HttpError(400, "Status for checks must 'passing', 'warning', 'critical'")
        address = body.get("address") or ""
        tagged = dict(body.get("taggedaddresses") or {})
        if re.fullmatch(r"\d+\.\d+\.\d+\.\d+", address):
            tagged.setdefault("lan_ipv4", {"Address": address, "Port": body.get("port") or 0})
            tagged.setdefault("wan_ipv4", {"Address": address, "Port": body.get("port") or 0})
        with self.changed:
            dc = self.dcs[dc_name]
            old = dc.services.get(sid)
            svc = Service(sid, name, address, int(body.get("port") or 0), list(body.get("tags") or []),
                          dict(body.get("meta") or {}), dict(body.get("weights") or {"Passing": 1, "Warning": 1}),
                          tagged, old.create_index if old else self.index + 1, self.index + 1)
            now = time.monotonic()
            for n, c in enumerate(checks, start=1):
                cid = c.get("checkid") or (f"service:{sid}" if len(checks) == 1 else f"service:{sid}:{n}")
                prev = dc.checks.get(cid)
                interval = parse_duration(c.get("interval") or 0)
                check = Check(
                    check_id=cid, name=c.get("name") or f"Service '{name}' check", service_id=sid, service_name=name,
                    status=prev.status if prev else (c.get("status") or "critical"),
                    output=prev.output if prev else "", notes=c.get("notes") or "", grpc=c.get("grpc") or "",
                    grpc_use_tls=_as_bool(c.get("grpcusetls")), tls_skip_verify=_as_bool(c.get("tlsskipverify")),
                    tls_server_name=c.get("tlsservername") or "",
                    interval=max(interval, self.check_interval_min) if interval else 0.0,
                    timeout=parse_duration(c.get("timeout") or "10s") or 10.0,
                    ttl=parse_duration(c.get("ttl") or 0),
                    deregister_after=parse_duration(c.get("deregistercriticalserviceafter") or 0))
                check.critical_since = (prev.critical_since if prev else None) or (now if check.status == "critical" else None)
                if check.grpc:
                    check.next_run = now + random.uniform(0, check.interval)  # Consul staggers the first probe
                if check.ttl:
                    check.ttl_deadline = now + check.ttl
                dc.checks[cid] = check
                svc.check_ids.append(cid)
            for cid in old.check_ids if old else []:
                if cid in svc.check_ids:
                    continue
                if replace_existing_checks:   # ?replace-existing-checks deletes checks missing from the request
                    dc.checks.pop(cid, None)
                else:
                    svc.check_ids.append(cid)
            dc.services[sid] = svc
            self._bump(dc, name)

    def deregister(self, dc_name: str, sid: str) -> None:
        with self.changed:
            dc = self.dcs[dc_name]
            if sid not in dc.services:
                raise HttpError(404, f'Unknown service ID "{sid}". Ensure that the service ID is passed, not the service name.')
            self._remove(dc, sid)

    def _remove(self, dc: Datacenter, sid: str) -> None:
        svc = dc.services.pop(sid)
        for cid in svc.check_ids:
            dc.checks.pop(cid, None)
        self._bump(dc, svc.name)

    def set_status(self, dc_name: str, cid: str, status: str, output: str | None, ttl_only: bool = True) -> None:
        with self.changed:
            dc = self.dcs[dc_name]
            check = dc.checks.get(cid)
            if check is None:
                raise HttpError(404, f'Unknown check ID "{cid}". Ensure that the check ID is passed, not the check name.')
            if ttl_only and not check.ttl:
                raise HttpError(500, f'CheckID "{cid}" does not have associated TTL')
            if check.ttl:
                check.ttl_deadline = time.monotonic() + check.ttl  # an update resets the TTL clock
            self._set(dc, check, status, output if output is not None else check.output)

    def _set(self, dc: Datacenter, check: Check, status: str, output: str) -> None:
        check.output = output[:MAX_OUTPUT]
        if status == check.status:
            return  # output-only changes do not wake blocking queries
        print(f"{dc.name}: check {check.check_id} is now {status}: {check.output}", flush=True)
        check.status = status
        check.critical_since = time.monotonic() if status == "critical" else None
        self._bump(dc, check.service_name)

    # -- reads -------------------------------------------------------------------------------

    def resolve_dc(self, local: str, query: dict[str, list[str]]) -> Datacenter:
        name = (query.get("dc") or [local])[-1] or local
        if name not in self.dcs:
            raise HttpError(500, "No path to datacenter")
        return self.dcs[name]

    def health_service(self, dc: Datacenter, name: str, passing: bool, tags: list[str]) -> list[dict[str, Any]]:
        out = []
        for svc in dc.services.values():
            if svc.name != name or any(t not in svc.tags for t in tags):
                continue
            checks = [dc.checks[c] for c in svc.check_ids if c in dc.checks]
            if passing and any(c.status != "passing" for c in checks):
                continue
            out.append({
                "Node": {"ID": "", "Node": dc.node, "Address": "127.0.0.1", "Datacenter": dc.name,
                         "TaggedAddresses": {"lan": "127.0.0.1", "wan": "127.0.0.1"}, "Meta": {}},
                "Service": {"ID": svc.id, "Service": svc.name, "Tags": svc.tags, "Address": svc.address,
                            "TaggedAddresses": svc.tagged_addresses, "Meta": svc.meta, "Port": svc.port,
                            "Weights": svc.weights, "EnableTagOverride": False, "Namespace": "default",
                            "CreateIndex": svc.create_index, "ModifyIndex": svc.modify_index},
                "Checks": [{"Node": dc.node, "CheckID": c.check_id, "Name": c.name, "Status": c.status,
                            "Notes": c.notes, "Output": c.output, "ServiceID": c.service_id,
                            "ServiceName": c.service_name, "ServiceTags": svc.tags} for c in checks]
                + [{"Node": dc.node, "CheckID": "serfHealth", "Name": "Serf Health Status", "Status": "passing",
                    "Notes": "", "Output": "Agent alive and reachable", "ServiceID": "", "ServiceName": "",
                    "ServiceTags": []}],
            })
        return out

    def blocking(self, index: int, wait: float, current: Any) -> int:
        """Wait until ``current()`` (the result's index) exceeds ``index`` or ``wait`` passes."""
        if index <= 0:
            return max(1, current())
        deadline = time.monotonic() + wait + random.uniform(0, wait / 16)
        with self.changed:
            while current() <= index and not self._stop.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.changed.wait(left)
            return max(1, current())

    # -- background: run checks, reap critical services --------------------------------------

    def start(self) -> None:
        threading.Thread(target=self._run_checks, daemon=True).start()
        threading.Thread(target=self._reap, daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        with self.changed:
            self.changed.notify_all()

    def _run_checks(self) -> None:
        while not self._stop.wait(0.05):
            now = time.monotonic()
            with self.changed:
                for dc in self.dcs.values():
                    for check in dc.checks.values():
                        if check.ttl and check.status != "critical" and now > check.ttl_deadline:
                            out = "TTL expired" + (f" (last output before timeout follows): {check.output}" if check.output else "")
                            self._set(dc, check, "critical", out)
                        if check.grpc and not check.running and now >= check.next_run:
                            check.running = True
                            check.next_run = now + check.interval
                            threading.Thread(target=self._probe, args=(dc, check), daemon=True).start()

    def _probe(self, dc: Datacenter, check: Check) -> None:
        target, _, service = check.grpc.partition("/")
        try:
            if check.grpc_use_tls and check.tls_skip_verify:
                # grpcio cannot skip verification; llmserve never asks for it.
                raise _NotModelled("TLSSkipVerify is not modelled by the stand-in")
            key = f"{'tls' if check.grpc_use_tls else 'plain'}:{check.tls_server_name}:{target}"
            channel = self._channels.get(key)
            if channel is None:
                if check.grpc_use_tls:
                    ca, cert, private_key = self.check_tls
                    options = [("grpc.ssl_target_name_override", check.tls_server_name)] if check.tls_server_name else []
                    creds = grpc.ssl_channel_credentials(ca, private_key, cert)
                    channel = self._channels[key] = grpc.secure_channel(target, creds, options=options)
                else:
                    channel = self._channels[key] = grpc.insecure_channel(target)
            resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                            timeout=check.timeout)
            if resp.status == health_pb2.HealthCheckResponse.SERVING:
                status, output = "passing", f"gRPC check {check.grpc}: success"
            else:
                name = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
                status, output = "critical", f"gRPC {check.grpc} serving status: {name}"
        except grpc.RpcError as exc:
            status, output = "critical", f"gRPC {check.grpc}: rpc error: {exc.code().name}: {exc.details()}"  # type: ignore[attr-defined]
        except _NotModelled as exc:
            status, output = "critical", f"gRPC {check.grpc}: {exc}"
        with self.changed:
            check.running = False
            if dc.checks.get(check.check_id) is check:
                self._set(dc, check, status, output)

    def _reap(self) -> None:
        while not self._stop.wait(self.reap_interval):
            now = time.monotonic()
            with self.changed:
                for dc in self.dcs.values():
                    doomed = {c.service_id for c in dc.checks.values()
                              if c.deregister_after and c.critical_since is not None
                              and now - c.critical_since > max(c.deregister_after, self.deregister_min)}
                    for sid in doomed:
                        if sid in dc.services:
                            print(f"{dc.name}: removed service {sid} (its check was critical too long)", flush=True)
                            self._remove(dc, sid)


def make_handler(cluster: Cluster, local_dc: str) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt: str, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            self._dispatch("GET")

        def do_PUT(self) -> None:
            self._dispatch("PUT")

        def _dispatch(self, method: str) -> None:
            url = urlsplit(self.path)
            query = parse_qs(url.query, keep_blank_values=True)
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            try:
                status, body, headers = self._route(method, url.path, query, raw)
            except HttpError as exc:
                status, body, headers = exc.status, str(exc).encode(), {"Content-Type": "text/plain"}
            except Exception as exc:  # noqa: BLE001 - Consul answers 500 for anything else
                status, body, headers = 500, str(exc).encode(), {"Content-Type": "text/plain"}
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _route(self, method: str, path: str, q: dict[str, list[str]], raw: bytes) -> tuple[int, bytes, dict[str, str]]:
            parts = [unquote(p) for p in path.strip("/").split("/")]
            if parts[:1] != ["v1"]:
                raise HttpError(404, f"no handler for {path}")
            parts = parts[1:]
            if method == "PUT" and parts[:3] == ["agent", "service", "register"]:
                try:
                    body = json.loads(raw or b"{}")
                except ValueError as exc:
                    raise HttpError(400, f"Request decode failed: {exc}") from None
                replace = q.get("replace-existing-checks", ["false"])[-1] in ("", "true")
                try:
                    cluster.register(local_dc, body, replace)
                except ValueError as exc:
                    raise HttpError(400, f"Request decode failed: {exc}") from None
                return 200, b"", {}
            if method == "PUT" and parts[:3] == ["agent", "service", "deregister"] and len(parts) == 4:
                cluster.deregister(local_dc, parts[3])
                return 200, b"", {}
            if method == "PUT" and parts[:2] == ["agent", "check"] and len(parts) == 4:
                action, cid = parts[2], parts[3]
                note = (q.get("note") or [None])[-1]
                if action in ("pass", "warn", "fail"):
                    status = {"pass": "passing", "warn": "warning", "fail": "critical"}[action]
                    cluster.set_status(local_dc, cid, status, note)
                    return 200, b"", {}
                if action == "update":
                    body = json.loads(raw or b"{}")
                    status = body.get("Status", "")
                    if status not in STATUSES:
                        raise HttpError(400, f"Invalid check status: '{status}'")
                    cluster.set_status(local_dc, cid, status, body.get("Output", ""))
                    return 200, b"", {}
            if method == "GET" and parts[:2] == ["health", "service"] and len(parts) == 3:
                dc = cluster.resolve_dc(local_dc, q)
                passing = _parse_passing(q)
                index, wait = _blocking_params(q)
                name = parts[2]
                got = cluster.blocking(index, wait, lambda: dc.service_index.get(name, cluster.index))
                with cluster.changed:
                    result = cluster.health_service(dc, name, passing, q.get("tag") or [])
                return self._json(result, got)
            if method == "GET" and parts == ["agent", "services"]:
                with cluster.changed:
                    dc = cluster.dcs[local_dc]
                    return self._json({sid: {"ID": sid, "Service": svc.name, "Tags": svc.tags, "Meta": svc.meta,
                                             "Port": svc.port, "Address": svc.address, "Weights": svc.weights,
                                             "Datacenter": local_dc} for sid, svc in dc.services.items()})
            if method == "GET" and parts == ["catalog", "services"]:
                dc = cluster.resolve_dc(local_dc, q)
                index, wait = _blocking_params(q)
                got = cluster.blocking(index, wait, lambda: max(dc.service_index.values(), default=1))
                with cluster.changed:
                    out: dict[str, list[str]] = {"consul": []}
                    for svc in dc.services.values():
                        tags = out.setdefault(svc.name, [])
                        tags.extend(t for t in svc.tags if t not in tags)
                return self._json(out, got)
            if method == "GET" and parts == ["catalog", "datacenters"]:
                # Local first, then the others: the order Consul gives (by estimated round-trip time).
                return self._json([local_dc, *sorted(d for d in cluster.dcs if d != local_dc)])
            if method == "GET" and parts == ["status", "leader"]:
                cluster.resolve_dc(local_dc, q)
                return self._json(f"127.0.0.1:{self.server.server_address[1]}")
            if method == "GET" and parts == ["agent", "self"]:
                return self._json({"Config": {"Datacenter": local_dc, "NodeName": cluster.dcs[local_dc].node,
                                              "NodeID": "", "Server": True, "Revision": "standin",
                                              "Version": "standin"}, "Member": {"Name": cluster.dcs[local_dc].node}})
            raise HttpError(404 if method == "GET" else 405, f"stand-in does not implement {method} {path}")

        @staticmethod
        def _json(obj: Any, index: int | None = None) -> tuple[int, bytes, dict[str, str]]:
            headers = {"Content-Type": "application/json"}
            if index is not None:
                headers.update({"X-Consul-Index": str(max(1, index)), "X-Consul-KnownLeader": "true",
                                "X-Consul-LastContact": "0"})
            return 200, json.dumps(obj).encode(), headers

    return Handler


def _parse_passing(q: dict[str, list[str]]) -> bool:
    if "passing" not in q:
        return False
    value = q["passing"][-1]
    if value == "" or value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise HttpError(400, "Invalid value for ?passing")


def _blocking_params(q: dict[str, list[str]]) -> tuple[int, float]:
    try:
        index = int(q["index"][-1]) if q.get("index") else 0
    except ValueError:
        raise HttpError(400, "Invalid index") from None
    try:
        wait = parse_duration(q["wait"][-1]) if q.get("wait") else 300.0
    except ValueError:
        raise HttpError(400, "Invalid wait time") from None
    return index, min(wait, 600.0) if wait > 0 else 300.0


class AgentServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that goes away mid-answer (a router stopped during its blocking query) is routine for an
        # agent, not a traceback in its log.
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            super().handle_error(request, client_address)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dc", action="append", help="datacenter to host, NAME or NAME=PORT (repeat); the first is dc1 "
                                                      "by default")
    parser.add_argument("--port", type=int, default=0, help="port of the first datacenter's agent; the others follow (0 = free ports)")
    parser.add_argument("--port-file", default="", help="write {dc: port} as JSON here once listening")
    parser.add_argument("--deregister-min", default="1m", help="lower bound of DeregisterCriticalServiceAfter (Consul: 1m)")
    parser.add_argument("--reap-interval", default="30s", help="how often critical services are reaped (Consul: 30s)")
    parser.add_argument("--check-interval-min", default="1s", help="lower bound of check intervals (Consul: 1s)")
    parser.add_argument("--tls-ca", default="", help="CA the agent verifies GRPCUseTLS checks with (Consul: ca_file "
                                                       "with enable_agent_tls_for_checks); empty = the system's roots")
    parser.add_argument("--tls-cert", default="", help="certificate the agent presents in TLS checks (cert_file)")
    parser.add_argument("--tls-key", default="", help="its key (key_file)")
    args = parser.parse_args()
    named = [d.partition("=") for d in args.dc or ["dc1"]]
    dcs = [name for name, _, _ in named]
    pinned = [int(port) if port else 0 for _, _, port in named]
    read = lambda path: open(path, "rb").read() if path else None  # noqa: E731
    cluster = Cluster(dcs, parse_duration(args.deregister_min), parse_duration(args.reap_interval),
                      parse_duration(args.check_interval_min), (read(args.tls_ca), read(args.tls_cert),
                                                                read(args.tls_key)))
    servers = []
    for i, dc in enumerate(dcs):
        port = pinned[i] or (args.port + i if args.port else 0)
        server = AgentServer(("127.0.0.1", port), make_handler(cluster, dc))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
    cluster.start()
    ports = {dc: s.server_address[1] for dc, s in zip(dcs, servers)}
    if args.port_file:
        with open(args.port_file + ".tmp", "w") as f:
            json.dump(ports, f)
        os.replace(args.port_file + ".tmp", args.port_file)
    print(f"consul stand-in: {ports}", flush=True)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    done.wait()
    cluster.stop()
    for server in servers:
        server.shutdown()


if __name__ == "__main__":
    main()
