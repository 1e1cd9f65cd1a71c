"""llmserve_constrained_* metrics: requests with an output constraint, and how long their compiles took.

Fed by each model's ``ConstraintCompiler`` (``services.engine.models.constraints``) through its
``CompileObserver``; registered beside the engine's other families (``EngineMetrics.constraints``).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from services.engine.models.constraints import KINDS

# A compile: tens of microseconds (a cached lexer) to the parser limits' bound (tens of milliseconds).
COMPILE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class ConstraintMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.requests = Counter("llmserve_constrained_requests", "Requests with an output constraint, by kind.",
                                ["model_name", "kind"], registry=registry)
        self.cache_hits = Counter("llmserve_constraint_cache_hits",
                                  "Constrained requests whose constraint was already compiled (cached).",
                                  ["model_name"], registry=registry)
        self.compile_seconds = Histogram("llmserve_constraint_compile_seconds",
                                         "Seconds one output constraint took to compile (cache misses).",
                                         ["model_name"], buckets=COMPILE_BUCKETS, registry=registry)

    def for_model(self, model_name: str) -> "ConstraintStats":
        return ConstraintStats(self, model_name)


class ConstraintStats:
    """One model's ``CompileObserver``; thread-safe (prometheus-client's children are)."""

    def __init__(self, metrics: ConstraintMetrics, model_name: str):
        self._requests = {kind: metrics.requests.labels(model_name, kind) for kind in KINDS}
        self._hits = metrics.cache_hits.labels(model_name)
        self._seconds = metrics.compile_seconds.labels(model_name)

    def on_compiled(self, kind: str, seconds: float, cached: bool) -> None:
        self._requests[kind].inc()
        if cached:
            self._hits.inc()
        else:
            self._seconds.observe(seconds)
