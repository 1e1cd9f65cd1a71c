"""The engine loop: schedule → execute on the worker → update, forever, on one thread.

While the worker runs a step, the loop emits the previous step's output (detokenizing, stop
strings, handing deltas to the streams), so that work is off the path between two forwards.

Requests enter through ``submit`` and leave through each sequence's event queue; aborts
(cancel, deadline) enter through ``abort``. Only the loop thread touches the scheduler, so the
scheduler and block manager need no locks. New sequences join the running batch at the next
step and finished ones leave it at once (iteration-level batching).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

from services.common.errors import ResourceExhausted, Unavailable
from services.engine.detokenizer import Detokenizer
from services.engine.executor import ModelExecutor, WorkerFailure
from services.engine.metrics import GenerationStats, NullStats
from services.engine.scheduler import Scheduler
from services.engine.sequence import FinishReason, SeqEvent, Sequence
from services.engine.tokenizer import Tokenizer

log = logging.getLogger("llmserve.engine")


@dataclass(frozen=True)
class EngineLoad:
    num_waiting: int
    num_running: int
    num_kv_blocks_total: int
    num_kv_blocks_used: int
    num_finished: int
    num_preemptions: int
    worker_restarts: int
    prefix_cache_hit_rate: float
    num_cached_blocks: int


@dataclass
class _Live:
    """A sequence the engine still serves, with what its reader has been handed so far."""

    seq: Sequence
    detok: Detokenizer
    num_sent: int          # output tokens already handed to the reader


class LLMEngine:
    def __init__(self, scheduler: Scheduler, executor: ModelExecutor, tokenizer: Tokenizer,
                 max_queue: int, max_worker_restarts: int, stats: GenerationStats | NullStats | None = None):
        self.scheduler = scheduler
        self.stats = stats or NullStats()             # metrics: called at the three marked points below
        self.executor = executor
        self.tokenizer = tokenizer
        self.max_queue = max_queue
        self.max_worker_restarts = max_worker_restarts
        self._inbox: queue.Queue[tuple[str, object, FinishReason | None]] = queue.Queue()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._live: dict[int, _Live] = {}             # the sequence map: id → live sequence and its output state
        self._failures_in_a_row = 0
        self._updated: list[Sequence] = []            # got tokens in the last step, not yet emitted
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    # -- called from request threads ------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def submit(self, seq: Sequence) -> Sequence:
        if len(self.scheduler.waiting) + self._inbox.qsize() >= self.max_queue:
            raise ResourceExhausted(f"queue full ({self.max_queue} sequences waiting); retry later")
        if self._stopping.is_set():
            raise Unavailable("engine is shutting down")
        self._inbox.put(("add", seq, None))
        self._wake.set()
        return seq

    def abort(self, seq_id: int, reason: FinishReason) -> None:
        self._inbox.put(("abort", seq_id, reason))
        self._wake.set()

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()
        self._thread.join(timeout=30)

    def load(self) -> EngineLoad:
        bm = self.scheduler.block_manager
        return EngineLoad(len(self.scheduler.waiting) + self._inbox.qsize(), len(self.scheduler.running),
                          bm.num_blocks, bm.num_used_blocks, self.scheduler.num_finished,
                          self.scheduler.num_preemptions, self.executor.restarts, bm.prefix_hit_rate,
                          bm.num_cached_blocks)

    # -- the loop ------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._wake.clear()
            self._drain_inbox()
            self._expire_deadlines()
            if not self.scheduler.has_work():
                self._emit_updated()
                self._wake.wait(timeout=0.5)
                continue
            try:
                self.step()
            except Exception:  # noqa: BLE001 - a bug must fail requests, not kill the loop silently
                log.exception("engine step failed; failing the running sequences")
                for seq in list(self.scheduler.running):
                    self._finish(seq, FinishReason.ERROR, "internal error in the engine step")
        for seq in [live.seq for live in self._live.values()]:
            self._finish(seq, FinishReason.ERROR, "engine is shutting down")

    def step(self) -> None:
        out = self.scheduler.schedule()
        if out.is_empty:
            self._emit_updated()
            return
        self.stats.on_scheduled(out)  # metrics: queue time ends for new sequences
        try:
            self.executor.send(out)
            # The previous step's tokens are detokenized and handed to their streams while the worker
            # runs this one. A stop string found now ends a sequence already in this step: its extra
            # token is dropped by update(), and its freed blocks are reused only after this step ends.
            self._emit_updated()
            sampled = self.executor.receive(out)
        except WorkerFailure as exc:
            self._emit_updated()
            self._recover(exc)
            return
        self._failures_in_a_row = 0
        self._updated = self.scheduler.update(out, sampled)
        self.stats.on_tokens(self._updated)  # metrics: TTFT, inter-token latency, token counters

    def _emit_updated(self) -> None:
        updated, self._updated = self._updated, []
        for seq in updated:
            self._emit(seq)

    def _recover(self, exc: WorkerFailure) -> None:
        """The worker died: its KV memory is gone, so every running sequence is recomputed."""
        victims = self.scheduler.preempt_all()
        self._failures_in_a_row += 1
        log.error("%s; %d running sequences requeued", exc, len(victims))
        if self._failures_in_a_row > self.max_worker_restarts:
            for seq in [live.seq for live in self._live.values()]:
                self._finish(seq, FinishReason.ERROR, f"worker keeps failing ({exc}); giving up on this request")
            self._failures_in_a_row = 0
        try:
            self.executor.restart()
        except Exception as restart_exc:  # noqa: BLE001
            log.error("worker restart failed: %s", restart_exc)
            for seq in [live.seq for live in self._live.values()]:
                self._finish(seq, FinishReason.ERROR, f"worker is down and could not be restarted: {restart_exc}")

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, item, reason = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                assert isinstance(item, Sequence)
                # A resumed sequence starts with output another engine already delivered.
                self._live[item.seq_id] = _Live(item, Detokenizer(self.tokenizer.decode, item.sampling.stop,
                                                                  item.num_sent_chars), item.num_output_tokens)
                self.scheduler.add(item)
            else:
                live = self._live.get(item)  # type: ignore[arg-type]
                if live is not None and reason is not None:
                    self._finish(live.seq, reason)

    def _expire_deadlines(self) -> None:
        now = time.monotonic()
        for seq in [x.seq for x in self._live.values() if x.seq.deadline is not None and x.seq.deadline <= now]:
            self._finish(seq, FinishReason.DEADLINE)

    def _finish(self, seq: Sequence, reason: FinishReason, error: str = "") -> None:
        self.scheduler.finish(seq, reason)
        self._emit(seq, error)

    def _emit(self, seq: Sequence, error: str = "") -> None:
        """Hand the reader what is new for ``seq``; end it if a stop string matched."""
        live = self._live.get(seq.seq_id)
        if live is None:
            return
        text, stopped = live.detok.step(seq.output_token_ids, final=seq.is_finished)
        if stopped and not seq.is_finished:
            self.scheduler.finish(seq, FinishReason.STOP)
        sent = live.num_sent
        new_ids = tuple(seq.output_token_ids[sent:])
        new_lps = tuple(seq.output_logprobs[sent:])
        live.num_sent = seq.num_output_tokens
        if new_ids or text or seq.is_finished:
            seq.events.put(SeqEvent(new_ids, text, new_lps, seq.finish_reason, error))
        if seq.is_finished:
            del self._live[seq.seq_id]
            self.stats.on_finished(seq)  # metrics: every sequence leaves here, once
