"""The worker's Prometheus metrics: forward seconds per step and batch size, labelled by model.

The worker serves them on its own port; the engine that spawned it merges them into its own
/metrics (see services/engine/metrics.py), so one scrape target per engine covers its workers.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram

# A forward pass: a decode step of a small model on a GPU (~1 ms) to a long prefill on CPU (seconds).
FORWARD_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                   2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 256, 512)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str):
        labels = ["model_name", "kind"]
        forward = Histogram("llmserve_worker_forward_seconds", "Seconds one forward pass took (kind: step = an "
                            "engine step, embed = an Embed/Classify batch).", labels, buckets=FORWARD_BUCKETS,
                            registry=registry)
        batch = Histogram("llmserve_worker_batch_size", "Sequences (step) or texts (embed) in one forward pass.",
                          labels, buckets=BATCH_BUCKETS, registry=registry)
        tokens = Histogram("llmserve_worker_step_tokens", "Tokens (prefill + decode) one engine step ran.",
                           ["model_name"], buckets=TOKEN_BUCKETS, registry=registry)
        self._forward = {kind: forward.labels(model_name, kind) for kind in ("step", "embed")}
        self._batch = {kind: batch.labels(model_name, kind) for kind in ("step", "embed")}
        self._tokens = tokens.labels(model_name)

    def on_step(self, seconds: float, num_seqs: int, num_tokens: int) -> None:
        self._forward["step"].observe(seconds)
        self._batch["step"].observe(num_seqs)
        self._tokens.observe(num_tokens)

    def on_embed(self, seconds: float, num_texts: int) -> None:
        self._forward["embed"].observe(seconds)
        self._batch["embed"].observe(num_texts)
