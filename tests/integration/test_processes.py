"""The service entry points: --help, and the `make up` launcher with its ready line and Ctrl-C."""
from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import urllib.request

import pytest

from tests.conftest import TINY_ENGINE_ARGS
from tests.helpers import REPO_ROOT, child_pids, grpcurl, pid_alive, wait_until


@pytest.mark.parametrize("service", ["router", "engine", "worker"])
def test_help_lists_flags_and_env(service):
    out = subprocess.run([sys.executable, "-m", f"services.{service}", "--help"], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "--port" in out.stdout and f"LLMSERVE_{service.upper()}_PORT" in out.stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_up_prints_a_ready_line_serves_and_stops_on_ctrl_c(tiny_model_dir):
    router_port, engine_port, router_metrics, engine_metrics = free_port(), free_port(), free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "services.stack", "--router-port", str(router_port),
                             "--engine-port", str(engine_port), "--router-metrics-port", str(router_metrics),
                             "--engine-metrics-port", str(engine_metrics), "--model", str(tiny_model_dir),
                             *TINY_ENGINE_ARGS],
                            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()  # type: ignore[arg-type]
    try:
        ready = wait_until(lambda: [l for l in lines if l.startswith("llmserve ready")], 300, "the ready line")
        assert f"localhost:{router_port}" in ready[0] and "grpcurl" in ready[0]
        metrics_lines = wait_until(lambda: [l for l in lines if l.startswith("llmserve metrics:")] if len(
            [l for l in lines if l.startswith("llmserve metrics:")]) == 2 else None, 30, "two metrics lines")
        for port in (router_metrics, engine_metrics):
            url = f"http://127.0.0.1:{port}/metrics"
            assert any(url in line for line in metrics_lines), metrics_lines
            with urllib.request.urlopen(url, timeout=10) as resp:
                assert resp.status == 200 and b"llmserve_" in resp.read()
        result = grpcurl("-plaintext", "-d", '{"prompt":"Hello, I am","sampling":{"max_tokens":4}}',
                         f"localhost:{router_port}", "llmserve.v1.LLMService/Generate")
        assert result.returncode == 0 and '"completion_tokens": 4' in result.stdout, result.stderr
        services = child_pids(proc.pid)
        assert len(services) == 2  # engine and router (the worker is the engine's child)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        for pid in services:
            wait_until(lambda: not pid_alive(pid), 30, f"service {pid} to stop")
    finally:
        if proc.poll() is None:
            proc.kill()
