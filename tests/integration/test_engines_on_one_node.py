"""Several engines on one host: `ENGINES=2 make up` (services.stack) starts two, each on its own ports, both
behind the router; an engine started by hand on a port one of them holds refuses with a message naming the
flag that moves it (no traceback, nothing shared)."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading

import pytest

from tests.conftest import TINY_ENGINE_ARGS
from tests.helpers import REPO_ROOT, grpcurl, wait_until


def free_port_pair() -> int:
    """A port p with p + 1 free as well (the stack counts engine ports up from one)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
                return port
    raise AssertionError("no two consecutive free ports")


@pytest.fixture(scope="module")
def two_engines(tiny_model_dir):
    router_port, engine_port, engine_metrics = free_port_pair(), free_port_pair(), free_port_pair()
    proc = subprocess.Popen([sys.executable, "-m", "services.stack", "--router-port", str(router_port),
                             "--engine-port", str(engine_port), "--router-metrics-port", "0",
                             "--engine-metrics-port", str(engine_metrics), "--http-port", "0",
                             "--second-http-port", "-1", "--model", str(tiny_model_dir), *TINY_ENGINE_ARGS],
                            cwd=REPO_ROOT, env={**os.environ, "ENGINES": "2"}, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()  # type: ignore[arg-type]
    try:
        ready = wait_until(lambda: [l for l in lines if l.startswith("llmserve ready")], 300, "the ready line")
        yield {"router": f"127.0.0.1:{router_port}", "engines": [f"127.0.0.1:{engine_port + i}" for i in (0, 1)],
               "metrics": [engine_metrics, engine_metrics + 1], "ready": ready[0], "model": str(tiny_model_dir)}
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_engines_2_starts_two_engines_behind_the_router(two_engines):
    assert all(address in two_engines["ready"] for address in two_engines["engines"]), two_engines["ready"]
    result = grpcurl("-plaintext", two_engines["router"], "llmserve.v1.LLMService/ListModels")
    assert result.returncode == 0, result.stderr
    (model,) = json.loads(result.stdout)["models"]
    assert sorted(model["loaded_on"]) == sorted(two_engines["engines"])  # the router merged both engines' lists
    for address in two_engines["engines"]:
        result = grpcurl("-plaintext", "-d", '{"prompt":"Hello","sampling":{"max_tokens":2}}', address,
                         "llmserve.v1.LLMService/Generate")
        assert result.returncode == 0 and '"completion_tokens": 2' in result.stdout, result.stderr


@pytest.mark.parametrize("flag", ["--port", "--metrics-port"])
def test_an_engine_on_a_taken_port_refuses_naming_the_flag(two_engines, flag):
    taken = {"--port": two_engines["engines"][0].rsplit(":", 1)[1], "--metrics-port": str(two_engines["metrics"][1])}
    other = {"--port": "0", "--metrics-port": "0"}
    args = [arg for name in ("--port", "--metrics-port") for arg in (name, taken[name] if name == flag else other[name])]
    result = subprocess.run([sys.executable, "-m", "services.engine", "--model", two_engines["model"], *args,
                             *TINY_ENGINE_ARGS], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and "in use" in result.stderr
    assert f"start this one with {flag} 0" in result.stderr, result.stderr
