"""Start a service (``python -m services.X``) as a child process and wait until it serves.

The one spawn-and-handshake, used by ``services.stack`` (router and engines) and by the engine for
its workers: the child binds ``--port`` (0 = a free port) and, once SERVING, writes the port to a
temporary ``--port-file``; the parent polls for that file with a deadline, then confirms SERVING
through ``grpc.health.v1``. A child that exits first fails the start with its exit code and reason.
With ``metrics_port`` set, the child also serves /metrics there (0 = a free port) and writes that
port to ``--metrics-port-file`` beside the port file (before it), so ``metrics_url`` is known too.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Callable, Sequence

from services import REPO_ROOT
from services.common.security import PLAINTEXT, TlsFiles
from services.common.server import wait_for_serving


class StartFailure(RuntimeError):
    """The child exited, or did not serve in time, before it was ready."""


@dataclass
class ServiceProcess:
    name: str
    proc: subprocess.Popen[bytes]
    address: str
    metrics_url: str = ""      # http://127.0.0.1:PORT/metrics; empty when it serves none

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 45.0, kill: bool = False) -> int:
        """End the process (SIGTERM: a graceful stop, which lets calls in flight finish within the
        service's --drain-seconds, 30 by default; ``kill``: SIGKILL), killing it after ``timeout``."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_service(module: str, args: list[str], ready_timeout: float = 600.0, port: int = 0,
                  stdout: IO[bytes] | int | None = None, stderr: IO[bytes] | int | None = None,
                  new_session: bool = False, on_started: Callable[[subprocess.Popen[bytes]], None] = lambda p: None,
                  reason: Callable[[], str] = lambda: "see its log", tls: TlsFiles = PLAINTEXT,
                  env: dict[str, str] | None = None, metrics_port: int | None = None,
                  cwd: Path | None = None) -> ServiceProcess:
    """Start ``python -m <module>`` on ``port`` and wait until it is SERVING.

    ``on_started`` sees the process at once (e.g. to relay a piped stderr); ``reason`` says why it
    exited, for the error. ``tls``: the credentials to reach its health service with (the child's
    own TLS flags are in ``args``). ``env``: added to ours (secrets go here, not in ``args``:
    /proc/<pid>/cmdline is world-readable). ``metrics_port``: see the module's docstring (None: no
    metrics flags are passed; ``args`` may say ``--no-metrics``). ``cwd``: its working directory
    (default the repository root).
    """
    name = module.rsplit(".", 1)[-1]
    port_file = Path(tempfile.mkdtemp(prefix=f"llmserve-{name}-")) / "port"
    metrics_file = port_file.parent / "metrics-port"
    metrics_args = [] if metrics_port is None or "--no-metrics" in args else [
        "--metrics-port", str(metrics_port), "--metrics-port-file", str(metrics_file)]
    cmd = [sys.executable, "-m", module, "--port", str(port), "--port-file", str(port_file), *metrics_args, *args]
    proc = subprocess.Popen(cmd, cwd=cwd or REPO_ROOT, stdout=stdout, stderr=stderr, start_new_session=new_session,
                            env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"})
    on_started(proc)
    deadline = time.monotonic() + ready_timeout
    try:
        while not port_file.exists():
            if proc.poll() is not None:
                raise StartFailure(f"{name} exited with code {proc.returncode} while starting: {reason()}")
            if time.monotonic() > deadline:
                raise StartFailure(f"{name} did not start within {ready_timeout:.0f}s")
            threading.Event().wait(0.05)
        address = f"127.0.0.1:{port_file.read_text().strip()}"
        wait_for_serving(address, max(1.0, deadline - time.monotonic()), is_alive=lambda: proc.poll() is None, tls=tls)
    except BaseException:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        raise
    metrics_url = f"http://127.0.0.1:{metrics_file.read_text().strip()}/metrics" if metrics_file.exists() else ""
    return ServiceProcess(name, proc, address, metrics_url)


def start_side_by_side(starts: Sequence[Callable[[], ServiceProcess]]) -> list[ServiceProcess]:
    """Run every ``start`` (a ``start_service`` call) at once: their processes, in order. A service's start is
    mostly its child's imports and loading, one core each, so two engines take about as long as one.
    When a start fails, the ones that succeeded are stopped and the first failure is raised."""
    with ThreadPoolExecutor(max_workers=max(1, len(starts)), thread_name_prefix="service-start") as pool:
        futures = [pool.submit(start) for start in starts]
    started: list[ServiceProcess] = []
    failures: list[BaseException] = []
    for future in futures:
        try:
            started.append(future.result())
        except BaseException as exc:  # noqa: BLE001 - raised below, once the others are stopped
            failures.append(exc)
    if failures:
        for proc in started:
            proc.stop(kill=True)
        raise failures[0]
    return started
