"""Keep a stack's services running: one that dies is started again, with backoff, on the same ports.

What ``make up`` does for its router and engines, the way a systemd unit with ``Restart=always`` or
a Kubernetes pod's restart policy would: a service that exits (crash, SIGKILL, OOM) is logged with
its exit code and started again after a delay that doubles with each failure in a row (1 s, 2 s,
4 s ... up to ``max_delay``); a service that stayed up for ``stable_seconds`` starts again from the
shortest delay. The restarted process binds the same gRPC, metrics and HTTP ports as the first, so
routers, clients and Prometheus find it where it was. The other services keep running throughout.

A ``Supervised`` service knows how to start itself (``spec``); ``Supervisor.watch`` runs one
thread that polls them. ``stop()`` ends the watching first, so a deliberate stop is not restarted.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from services.common.process import ServiceProcess, StartFailure

log = logging.getLogger("llmserve.stack")

Starter = Callable[[], ServiceProcess]


@dataclass
class Supervised:
    name: str
    start: Starter                       # starts it again on the same ports, waits until SERVING
    process: ServiceProcess
    on_restart: Callable[[ServiceProcess], None] = lambda p: None   # e.g. the stack's reference to it
    failures: int = 0                    # exits in a row without a stable run between them
    restarts: int = 0
    up_since: float = field(default_factory=time.monotonic)
    next_start: float = 0.0              # when a dead one is started again (0 = not scheduled)


class Supervisor:
    def __init__(self, base_delay: float = 1.0, max_delay: float = 30.0, stable_seconds: float = 60.0,
                 poll_seconds: float = 0.2, clock: Callable[[], float] = time.monotonic):
        self.base_delay = base_delay
        self.max_delay = max_delay
        self.stable_seconds = stable_seconds
        self.poll_seconds = poll_seconds
        self.clock = clock
        self.services: list[Supervised] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, service: Supervised) -> None:
        self.services.append(service)

    def watch(self) -> None:
        self._thread = threading.Thread(target=self._run, name="supervisor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def delay(self, failures: int) -> float:
        return min(self.max_delay, self.base_delay * 2 ** max(0, failures - 1))

    def check(self) -> None:
        """One pass: schedule a restart for each service that died, start those whose delay passed."""
        for s in self.services:
            if self._stop.is_set():
                return
            now = self.clock()
            if s.process.alive:
                if s.failures and now - s.up_since >= self.stable_seconds:
                    s.failures = 0
                continue
            if not s.next_start:
                s.failures += 1
                wait = self.delay(s.failures)
                s.next_start = now + wait
                print(f"llmserve: {s.name} exited with code {s.process.proc.returncode}; starting it again in "
                      f"{wait:.0f}s (restart #{s.restarts + 1})", flush=True)
            if now >= s.next_start:
                self._restart(s)

    def _restart(self, s: Supervised) -> None:
        s.next_start = 0.0
        try:
            s.process = s.start()
        except (StartFailure, TimeoutError, OSError) as exc:
            # It did not come up: counts as one more failure, with a longer wait before the next try.
            print(f"llmserve: {s.name} did not start again: {exc}", flush=True)
            return
        s.restarts += 1
        s.up_since = self.clock()
        s.on_restart(s.process)
        print(f"llmserve: {s.name} is serving again at {s.process.address} (restart #{s.restarts})", flush=True)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_seconds):
            try:
                self.check()
            except Exception:  # noqa: BLE001 - the supervisor must outlive one bad pass
                log.exception("supervising the stack failed")
