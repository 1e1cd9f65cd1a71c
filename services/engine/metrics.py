"""The engine's Prometheus metrics: vLLM's names, types, labels and bucket edges, plus llmserve_*.

The ``vllm:*`` families copy vllm-project/vllm ``vllm/v1/metrics/loggers.py`` (labels
``model_name`` and ``engine``; the same histogram edges), so vLLM's published Grafana dashboards
read an llmserve engine unchanged. prometheus-client accepts ':' in names and, like vLLM's
exposition, adds ``_total`` to every counter: ``vllm:generation_tokens`` is scraped as
``vllm:generation_tokens_total``.

Three sources:
- ``GenerationStats`` — one per loaded generation model, the ``StepObserver``
  (``services.engine.core.observer``) injected into its engine loop, so the core never imports
  Prometheus (no locks of ours: prometheus-client's children are thread-safe): per-request timings, token
  counters, finishes, and the scheduler's preemption and prefix-cache counters as deltas per step;
- ``ModelManagerMetrics`` — loads, evictions and load seconds, fed by the model manager;
- ``EngineStateCollector`` — read at scrape time: running/waiting/KV usage per model, the
  manager's memory, worker restarts, and each spawned worker's own /metrics (merged in, so one
  scrape target per engine covers its workers, however many models come and go).
"""
from __future__ import annotations

import logging
import time
import urllib.request
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from services.engine.constraint_metrics import ConstraintMetrics
from services.engine.core.sequence import FinishReason, Sequence
from services.engine.core.speculation import Speculator
from services.engine.models.manager import ModelManager
from services.engine.models.runtime import GenerationRuntime

if TYPE_CHECKING:
    from services.engine.core.scheduler import Scheduler, SchedulerOutput

log = logging.getLogger("llmserve.engine.metrics")

VLLM_LABELS = ("model_name", "engine")
ENGINE_INDEX = "0"   # vLLM's data-parallel engine index; one engine core per model here

# Bucket edges exactly as vLLM's loggers.py.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# A model load (worker start, maybe a GGUF conversion): seconds to minutes.
LOAD_BUCKETS = (0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
DEFAULT_MAX_MODEL_LEN = 8192

# vLLM's FinishReason has three values; its label is str(reason): "stop", "length", "abort".
FINISHED_REASON = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.CANCELLED: "abort",
    FinishReason.DEADLINE: "abort",
    FinishReason.ERROR: "abort",
    FinishReason.UNAVAILABLE: "abort",
}


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """vLLM's token-count edges: 1, 2, 5, 10, 20, 50, ... up to ``max_value``."""
    buckets: list[int] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


class EngineMetrics:
    """Every metric family the engine records into, registered in ``registry``.

    ``max_model_len`` sets the token-count histograms' edges (vLLM uses the served model's
    context length; here the largest of the store's models, so that one family fits all).
    """

    def __init__(self, registry: CollectorRegistry, max_model_len: int = DEFAULT_MAX_MODEL_LEN):
        self.registry = registry
        token_buckets = build_1_2_5_buckets(max_model_len)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, [*VLLM_LABELS, *extra], registry=registry)

        def histogram(name: str, doc: str, buckets: Iterable[float]) -> Histogram:
            return Histogram(name, doc, VLLM_LABELS, buckets=tuple(buckets), registry=registry)

        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.request_success = counter("vllm:request_success", "Count of successfully processed requests.",
                                       ("finished_reason",))
        self.num_preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prefix_cache_queries = counter("vllm:prefix_cache_queries",
                                            "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_cache_hits = counter("vllm:prefix_cache_hits",
                                         "Prefix cache hits, in terms of number of cached tokens.")
        self.time_to_first_token = histogram("vllm:time_to_first_token_seconds",
                                             "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.inter_token_latency = histogram("vllm:inter_token_latency_seconds",
                                             "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.e2e_request_latency = histogram("vllm:e2e_request_latency_seconds",
                                             "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS)
        self.request_queue_time = histogram("vllm:request_queue_time_seconds",
                                            "Histogram of time spent in WAITING phase for request.",
                                            REQUEST_LATENCY_BUCKETS)
        self.request_prefill_time = histogram("vllm:request_prefill_time_seconds",
                                              "Histogram of time spent in PREFILL phase for request.",
                                              REQUEST_LATENCY_BUCKETS)
        self.request_decode_time = histogram("vllm:request_decode_time_seconds",
                                             "Histogram of time spent in DECODE phase for request.",
                                             REQUEST_LATENCY_BUCKETS)
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                               token_buckets)
        self.request_generation_tokens = histogram("vllm:request_generation_tokens",
                                                   "Number of generation tokens processed.", token_buckets)
        # Speculative decoding (vLLM's SpecDecodingProm): drafts, their tokens, the accepted ones, by position.
        self.spec_num_drafts = counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.spec_num_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.spec_num_accepted_tokens = counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.")
        self.spec_accepted_per_pos = counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                             "Accepted tokens per draft position.", ("position",))
        self.manager = ModelManagerMetrics(registry)
        self.constraints = ConstraintMetrics(registry)

    def for_model(self, model_name: str, scheduler: "Scheduler") -> "GenerationStats":
        return GenerationStats(self, model_name, scheduler)


class ModelManagerMetrics:
    """llmserve_model_*: what the model manager did (its gauges come from ``EngineStateCollector``)."""

    def __init__(self, registry: CollectorRegistry):
        self.loads = Counter("llmserve_model_loads", "Models loaded (cold starts).", ["model_name"], registry=registry)
        self.evictions = Counter("llmserve_model_evictions",
                                 "Idle models evicted (least recently used) to make room for another.",
                                 ["model_name"], registry=registry)
        self.load_seconds = Histogram("llmserve_model_load_seconds", "Seconds one model load took.",
                                      ["model_name"], buckets=LOAD_BUCKETS, registry=registry)

    def on_loaded(self, model_name: str, seconds: float) -> None:
        self.loads.labels(model_name).inc()
        self.evictions.labels(model_name)  # its series exists (at 0) from the model's first load
        self.load_seconds.labels(model_name).observe(seconds)

    def on_evicted(self, model_name: str) -> None:
        self.evictions.labels(model_name).inc()


@dataclass
class _Timing:
    """One request's timestamps (time.monotonic), as vLLM's RequestStateStats."""

    scheduled: float
    first_token: float = 0.0
    last_token: float = 0.0
    num_generated: int = 0      # tokens generated here (a resumed sequence starts with others' output)


class GenerationStats:
    """The engine loop's observer (``core.observer.StepObserver``) for one model. Called only from
    that model's loop thread."""

    def __init__(self, metrics: EngineMetrics, model_name: str, scheduler: "Scheduler"):
        labels = (model_name, ENGINE_INDEX)
        self._scheduler = scheduler
        self._prompt_tokens = metrics.prompt_tokens.labels(*labels)
        self._generation_tokens = metrics.generation_tokens.labels(*labels)
        self._preemptions = metrics.num_preemptions.labels(*labels)
        self._prefix_queries = metrics.prefix_cache_queries.labels(*labels)
        self._prefix_hits = metrics.prefix_cache_hits.labels(*labels)
        # Every reason exists from the start (at 0), so a dashboard's rate() has a series to show.
        self._success = {reason: metrics.request_success.labels(*labels, reason)
                         for reason in sorted(set(FINISHED_REASON.values()))}
        self._ttft = metrics.time_to_first_token.labels(*labels)
        self._itl = metrics.inter_token_latency.labels(*labels)
        self._e2e = metrics.e2e_request_latency.labels(*labels)
        self._queue = metrics.request_queue_time.labels(*labels)
        self._prefill = metrics.request_prefill_time.labels(*labels)
        self._decode = metrics.request_decode_time.labels(*labels)
        self._req_prompt = metrics.request_prompt_tokens.labels(*labels)
        self._req_generation = metrics.request_generation_tokens.labels(*labels)
        self._timings: dict[int, _Timing] = {}
        self._spec = (metrics.spec_num_drafts.labels(*labels), metrics.spec_num_draft_tokens.labels(*labels),
                      metrics.spec_num_accepted_tokens.labels(*labels))
        spec = scheduler.speculator
        self._spec_per_pos = [metrics.spec_accepted_per_pos.labels(*labels, str(pos))
                              for pos in range(len(spec.counters.accepted_per_pos) if spec is not None else 0)]
        self._spec_seen = (0, 0, 0, [0] * len(self._spec_per_pos))
        bm = scheduler.block_manager
        self._seen = (scheduler.num_preemptions, bm.num_prefix_queries, bm.num_prefix_hits)

    def on_scheduled(self, out: "SchedulerOutput") -> None:
        """A step was scheduled: its sequences seen for the first time leave the queue now."""
        now = time.monotonic()
        timings = self._timings
        for s in out.scheduled:
            if s.seq.seq_id not in timings:
                timings[s.seq.seq_id] = _Timing(now)
        self._count_scheduler()

    def on_tokens(self, seqs: list[Sequence]) -> None:
        """A step ended: each of ``seqs`` got new tokens (one, or more from a speculative draft)."""
        if not seqs:
            return
        now = time.monotonic()
        for seq in seqs:
            t = self._timings.get(seq.seq_id)
            if t is None:
                continue
            if t.num_generated == 0:
                t.first_token = now
                self._ttft.observe(now - seq.arrival_time)
                self._prompt_tokens.inc(seq.num_prompt_tokens)
            else:
                # Several tokens in one step (a verified draft): each gets its share of the gap, so the
                # histogram still counts tokens and its mean is the time per token.
                n = max(1, seq.num_new_tokens)
                for _ in range(n):
                    self._itl.observe((now - t.last_token) / n)
            t.last_token = now
            t.num_generated += max(1, seq.num_new_tokens)
        self._generation_tokens.inc(sum(max(1, seq.num_new_tokens) for seq in seqs))
        self._count_scheduler()

    def on_finished(self, seq: Sequence) -> None:
        """``seq`` left the engine (any reason); called once per sequence."""
        now = time.monotonic()
        t = self._timings.pop(seq.seq_id, None)
        self._success[FINISHED_REASON.get(seq.finish_reason, "abort")].inc()  # type: ignore[arg-type]
        self._e2e.observe(now - seq.arrival_time)
        if t is None:  # never scheduled: all of its life was queueing
            self._queue.observe(now - seq.arrival_time)
            self._prefill.observe(0.0)
            self._decode.observe(0.0)
            generated = 0
        else:
            self._queue.observe(t.scheduled - seq.arrival_time)
            self._prefill.observe((t.first_token or now) - t.scheduled)
            self._decode.observe(t.last_token - t.first_token if t.num_generated else 0.0)
            generated = t.num_generated
        self._req_prompt.observe(seq.num_prompt_tokens)
        self._req_generation.observe(generated)

    def _count_scheduler(self) -> None:
        """The scheduler's and block manager's own counters, added as what changed since last time."""
        bm = self._scheduler.block_manager
        self._count_speculation()
        now = (self._scheduler.num_preemptions, bm.num_prefix_queries, bm.num_prefix_hits)
        if now == self._seen:
            return
        preemptions, queries, hits = (a - b for a, b in zip(now, self._seen))
        self._seen = now
        if preemptions:
            self._preemptions.inc(preemptions)
        if queries:
            self._prefix_queries.inc(queries)
        if hits:
            self._prefix_hits.inc(hits)

    def _count_speculation(self) -> None:
        """The speculator's counters (``core.speculation.SpecCounters``), added as what changed."""
        spec = self._scheduler.speculator
        if spec is None or spec.counters.num_drafts == self._spec_seen[0]:
            return
        c, seen = spec.counters, self._spec_seen
        for child, new, old in zip((*self._spec, *self._spec_per_pos),
                                   (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens, *c.accepted_per_pos),
                                   (*seen[:3], *seen[3])):
            if new != old:
                child.inc(new - old)
        self._spec_seen = (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens, list(c.accepted_per_pos))


class EngineStateCollector:
    """Gauges read at scrape time from the loaded models, plus the spawned workers' own metrics."""

    def __init__(self, models: ModelManager, worker_timeout: float = 1.0):
        self.models = models
        self.worker_timeout = worker_timeout

    def collect(self) -> Iterator[Metric]:
        running = GaugeMetricFamily("vllm:num_requests_running", "Number of requests in model execution batches.",
                                    labels=VLLM_LABELS)
        waiting = GaugeMetricFamily("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                                    labels=VLLM_LABELS)
        kv_usage = GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                                     labels=VLLM_LABELS)
        restarts = CounterMetricFamily("llmserve_worker_restarts", "Times the engine restarted a model's worker "
                                       "after it died (since the model was loaded).", labels=["model_name"])
        model_memory = GaugeMetricFamily("llmserve_model_memory_bytes", "Memory a loaded model holds (its worker's "
                                         "RSS, or the store's estimate if larger).", labels=["model_name"])
        worker_urls: list[tuple[str, str]] = []
        speculators: list[tuple[str, Speculator | None]] = []
        loaded = self.models.loaded()
        for entry, rt in loaded:
            worker = rt.worker
            restarts.add_metric([entry.name], worker.restarts)
            if worker.metrics_url:
                worker_urls.append((entry.name, worker.metrics_url))
            if isinstance(rt, GenerationRuntime):
                load = rt.engine.load()
                labels = [entry.name, ENGINE_INDEX]
                running.add_metric(labels, load.num_running)
                waiting.add_metric(labels, load.num_waiting)
                kv_usage.add_metric(labels, load.num_kv_blocks_used / load.num_kv_blocks_total
                                    if load.num_kv_blocks_total else 0.0)
                speculators.append((entry.name, rt.engine.scheduler.speculator))
        for status in self.models.snapshot():
            if status.loaded:
                model_memory.add_metric([status.entry.name], status.memory_bytes)
        yield from (running, waiting, kv_usage, restarts, model_memory, speculation_gate_family(speculators))
        yield GaugeMetricFamily("llmserve_model_memory_used_bytes",
                                "Memory the loaded models are charged against the budget.",
                                value=self.models.used_bytes())
        yield GaugeMetricFamily("llmserve_model_memory_budget_bytes",
                                "The model memory budget (--memory-budget-mb).", value=self.models.budget_bytes)
        yield GaugeMetricFamily("llmserve_models_loaded", "Models loaded now.", value=len(loaded))
        yield from merge_families(fetch_families(url, name, self.worker_timeout) for name, url in worker_urls)


def speculation_gate_family(speculators: list[tuple[str, Speculator | None]]) -> GaugeMetricFamily:
    """What each model's speculation gate measured (``core.speculation.SpeculationGate``): decode tokens a second
    by sequences running, with speculation allowed (on) and without (off)."""
    family = GaugeMetricFamily("llmserve_spec_decode_gate_tokens_per_second",
                               "Decode tokens a second the speculation gate measured, by sequences running and "
                               "whether the steps could speculate; it keeps the faster side.",
                               labels=["model_name", "running", "speculation"])
    for name, spec in speculators:
        if spec is None:
            continue
        for batch, (off, on) in spec.gate.rates().items():
            family.add_metric([name, str(batch), "off"], off)
            family.add_metric([name, str(batch), "on"], on)
    return family


def fetch_families(url: str, model_name: str, timeout: float) -> list[Metric]:
    """The metric families a worker serves at ``url``, their ``model_name`` set to the engine's name
    for the model (the worker knows only its file's); none when it cannot be reached right now."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            text = resp.read().decode()
    except OSError as exc:
        log.debug("worker metrics at %s unreachable: %s", url, exc)
        return []
    families = list(text_string_to_metric_families(text))
    for family in families:
        family.samples = [s._replace(labels={**s.labels, "model_name": model_name}) if "model_name" in s.labels
                          else s for s in family.samples]
    return families


def merge_families(sources: Iterable[list[Metric]]) -> list[Metric]:
    """One family per name: two workers (two models) export the same names with their own labels."""
    merged: dict[str, Metric] = {}
    for families in sources:
        for family in families:
            seen = merged.get(family.name)
            if seen is None:
                merged[family.name] = family
            else:
                seen.samples.extend(family.samples)
    return list(merged.values())

