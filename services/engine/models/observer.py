"""What the model side tells an observer (metrics) about loads and evictions. Plain Python (no Prometheus).

The model manager calls a ``LoadObserver`` after each load (with its cold-start seconds) and each
eviction; the runtime factory asks a ``RuntimeObserver`` for the ``StepObserver`` of each generation
model it starts (``services.engine.core.observer``). None of them is required: ``None`` records
nothing and starts the workers with --no-metrics. The Prometheus implementations live in
``services.engine.metrics`` (``ModelManagerMetrics``, ``EngineMetrics``), which imports this side,
never the other way round.
"""
from __future__ import annotations

from typing import Protocol

from services.engine.core.observer import StepObserver
from services.engine.core.scheduler import Scheduler


class LoadObserver(Protocol):
    def on_loaded(self, model_name: str, seconds: float) -> None:
        """A model finished loading (a cold start of ``seconds``)."""

    def on_evicted(self, model_name: str) -> None:
        """An idle model was evicted to make room for another."""


class RuntimeObserver(Protocol):
    def for_model(self, model_name: str, scheduler: Scheduler) -> StepObserver:
        """The observer of a generation model's engine loop (its scheduler's counters read from ``scheduler``)."""
