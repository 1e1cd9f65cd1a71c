"""The HTTP face against clients that hold connections: slowloris connections (never finishing
their headers or body) are closed after --http-read-timeout, and the face keeps serving; and the
smaller promises of the HTTP face, end to end through router → engine → worker."""
from __future__ import annotations

import socket
import time
from typing import Iterator

import httpx
import pytest

from services.stack import ServiceProcess, Stack, start_service
from tests.helpers import wait_until

READ_TIMEOUT = 1.0
IDLE, PARTIAL_HEADERS, PARTIAL_BODY = 20, 20, 10


@pytest.fixture(scope="module")
def strict_router(tiny_stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    d = tmp_path_factory.mktemp("strict-router")
    proc: ServiceProcess = start_service("services.router", [
        "--engines", tiny_stack.engines[0].address, "--http-port", "0", "--http-port-file", str(d / "http.port"),
        "--http-read-timeout", str(READ_TIMEOUT), "--health-interval", "0.2"], log_path=d / "router.log")
    try:
        yield f"127.0.0.1:{(d / 'http.port').read_text().strip()}"
    finally:
        proc.stop()


def _closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(4096) == b""
    except BlockingIOError:
        return False
    except OSError:   # reset
        return True


def test_slowloris_connections_are_closed(strict_router: str):
    host, port = strict_router.rsplit(":", 1)
    socks = [socket.create_connection((host, int(port)), timeout=5) for _ in range(IDLE + PARTIAL_HEADERS + PARTIAL_BODY)]
    try:
        for i, sock in enumerate(socks):
            if i >= IDLE + PARTIAL_HEADERS:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: 1000\r\n\r\n{\"prompt\": \"")
            elif i >= IDLE:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            sock.setblocking(False)
        started = time.monotonic()
        # A connection in use is not cut: a full request on a fresh one is answered meanwhile.
        assert httpx.get(f"http://{strict_router}/health", timeout=10).status_code == 200
        wait_until(lambda: all(_closed_by_peer(s) for s in socks), 10 * READ_TIMEOUT + 10,
                   f"the router to close {len(socks)} slow connections")
        took = time.monotonic() - started
        assert took < 5 * READ_TIMEOUT + 5, took
    finally:
        for sock in socks:
            sock.close()
    with httpx.Client(base_url=f"http://{strict_router}", timeout=60) as client:  # kept alive across requests
        for _ in range(2):
            resp = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
            assert resp.status_code == 200, resp.text


def test_the_longest_request_id_with_several_choices(tiny_stack: Stack):
    rid = "r" * 128
    resp = httpx.post(f"http://{tiny_stack.http_address}/v1/completions", headers={"x-request-id": rid},
                      json={"prompt": "Hi", "max_tokens": 2, "n": 2}, timeout=60)
    assert resp.status_code == 200, resp.text
    assert len(resp.json()["choices"]) == 2 and resp.headers["x-request-id"] == rid


def test_role_developer_reaches_the_chat_template(tiny_stack: Stack):
    url = f"http://{tiny_stack.http_address}/v1/chat/completions"
    greedy = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
    developer = httpx.post(url, json={"messages": [{"role": "developer", "content": "Be brief."},
                                                   {"role": "user", "content": "Hi"}], **greedy}, timeout=60)
    system = httpx.post(url, json={"messages": [{"role": "system", "content": "Be brief."},
                                                {"role": "user", "content": "Hi"}], **greedy}, timeout=60)
    assert developer.status_code == 200, developer.text
    assert developer.json()["choices"][0]["message"] == system.json()["choices"][0]["message"]
    assert developer.json()["usage"] == system.json()["usage"]


@pytest.mark.parametrize("value", ["inf", "1e308"])
def test_a_deadline_that_would_overflow_is_a_400(tiny_stack: Stack, value: str):
    resp = httpx.post(f"http://{tiny_stack.http_address}/v1/completions", headers={"x-llmserve-timeout": value},
                      json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert resp.status_code == 400 and "x-llmserve-timeout" in resp.json()["error"]["message"]
