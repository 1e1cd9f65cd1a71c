"""What the engine loop drives: one model's worker, one step at a time. Plain Python (no gRPC).

``send`` starts one step and ``receive`` waits for its sampled tokens, so the loop can emit the
previous step's output while the worker runs. When the worker dies, ``receive`` (or ``send``)
raises ``WorkerFailure``; the loop takes back every running sequence's KV blocks and calls
``restart``, which brings up a fresh worker so the queued requests are recomputed, not lost.
The implementation over gRPC is ``step_client.StepClient``; tests use a fake.
"""
from __future__ import annotations

from typing import Protocol

from services.engine.core.scheduler import SampledToken, SchedulerOutput


class WorkerFailure(RuntimeError):
    """The worker process died or its stream broke; running sequences lost their KV memory."""


class Executor(Protocol):
    @property
    def restarts(self) -> int:
        """Worker restarts so far."""

    def send(self, out: SchedulerOutput) -> None:
        """Start the step ``out`` on the worker."""

    def receive(self, out: SchedulerOutput) -> dict[int, SampledToken]:
        """The sampled tokens (by sequence id) of the step ``send(out)`` started."""

    def restart(self) -> None:
        """Replace a failed worker with a fresh one (empty KV memory); raises ``WorkerFailure`` if it
        cannot (the loop counts that toward ``max_worker_restarts`` and tries again)."""
