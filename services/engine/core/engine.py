"""The engine loop: schedule → execute on the worker → update, forever, on one thread.

One step stays in flight: the next step is scheduled and sent before the running one's tokens are
read, and the loop emits a step's output (detokenizing, stop strings, handing deltas to the streams)
while the worker runs the next, so the worker does not wait for the engine between two forwards.

Requests enter through ``submit`` and leave through each sequence's ``on_event`` callback, called on
the loop thread (the gRPC face hands the events over to its event loop); aborts
(cancel, deadline) enter through ``abort``. Only the loop thread touches the scheduler, so the
scheduler and block manager need no locks. New sequences join the running batch at the next
step and finished ones leave it at once (iteration-level batching). An injected ``StepObserver``
(metrics) hears of each step and each finished sequence (``core.observer``; a no-op by default).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from services.common.backoff import Backoff
from services.common.errors import Unavailable
from services.engine.core.admission import Admission
from services.engine.core.detokenizer import Detokenizer
from services.engine.core.executor import Executor, WorkerFailure
from services.engine.core.inbox import AbortSequence, AddSequence, InboxMessage
from services.engine.core.observer import NullObserver, StepObserver
from services.engine.core.scheduler import Scheduler, SchedulerOutput
from services.engine.core.sequence import FinishReason, SeqEvent, Sequence

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
    num_prefix_query_tokens: int      # prompt tokens looked up in the prefix cache
    num_prefix_hit_tokens: int        # of those, tokens found cached
    num_cached_blocks: int
    max_queue: int = 0          # most sequences that may wait; more are refused
    retry_after_ms: int = 0     # what a refused request is told now


@dataclass
class _Live:
    """A sequence the engine still serves, with what its reader has been handed so far."""

    seq: Sequence
    detok: Detokenizer
    num_sent: int                          # output tokens already handed to the reader
    on_event: Callable[[SeqEvent], None]   # the reader (called on the loop thread; must not block)


class LLMEngine:
    def __init__(self, scheduler: Scheduler, executor: Executor, decode: Callable[[list[int]], str],
                 max_queue: int, max_worker_restarts: int, observer: StepObserver | None = None,
                 restart_backoff: float = 0.5):
        self.scheduler = scheduler
        self.observer = observer or NullObserver()    # metrics: called at the three marked points below
        self.executor = executor
        self.decode = decode
        self.admission = Admission(max_queue)
        self.max_worker_restarts = max_worker_restarts
        self._inbox: queue.Queue[InboxMessage] = queue.Queue()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._live: dict[int, _Live] = {}             # the sequence map: id → live sequence and its output state
        self._failures_in_a_row = 0                   # worker failures (broken steps, failed restarts) since the last good step
        self._restart_backoff = Backoff(initial=restart_backoff, maximum=max(restart_backoff, 10.0))
        self._updated: list[Sequence] = []            # got tokens in the last step, not yet emitted
        self._in_flight: deque[SchedulerOutput] = deque()   # steps sent, not yet read (at most two)
        self._last_result = 0.0   # when the last step's result was read (the speculation gate's step seconds)
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    # -- called from other threads (the server's event loop) --------------------------

    def start(self) -> None:
        self._thread.start()

    @property
    def max_queue(self) -> int:
        return self.admission.max_queue

    def admit(self, num_seqs: int) -> None:
        """Reserve queue room for ``num_seqs`` sequences, all or none (ResourceExhausted with a retry
        hint when they do not fit); each must then be handed over with ``submit(..., admitted=True)``."""
        if self._stopping.is_set():
            raise Unavailable("engine is shutting down")
        self.admission.admit(num_seqs, len(self.scheduler.waiting))

    def submit(self, seq: Sequence, on_event: Callable[[SeqEvent], None], delivered_chars: int = 0,
               admitted: bool = False) -> Sequence:
        """Queue ``seq``; its output goes to ``on_event`` (new tokens and text, then the finish). A
        sequence resumed after a failover starts with output of which ``delivered_chars`` characters
        of text were already delivered: its reader gets only what follows."""
        if not admitted:
            self.admit(1)
        self._inbox.put(AddSequence(seq, on_event, delivered_chars))
        self._wake.set()
        return seq

    def abort(self, seq_id: int, reason: FinishReason) -> None:
        self._inbox.put(AbortSequence(seq_id, reason))
        self._wake.set()

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()
        self._thread.join(timeout=30)

    def load(self) -> EngineLoad:
        bm = self.scheduler.block_manager
        queued = len(self.scheduler.waiting)
        return EngineLoad(self.admission.num_waiting(queued), len(self.scheduler.running),
                          bm.num_blocks, bm.num_used_blocks, self.scheduler.num_finished,
                          self.scheduler.num_preemptions, self.executor.restarts, bm.num_prefix_queries, bm.num_prefix_hits,
                          bm.num_cached_blocks, self.admission.max_queue, self.admission.retry_after_ms(queued))

    # -- the loop ------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._wake.clear()
            self._drain_inbox()
            self._expire_deadlines()
            self.admission.on_finished(self.scheduler.num_finished)
            if not self.scheduler.has_work() and not self._in_flight:
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
            self._finish(seq, FinishReason.UNAVAILABLE, "engine is shutting down")

    def step(self) -> None:
        """Schedule and send the next step, then read the step the worker is running and update.

        One step stays in flight: step N+1 is scheduled and sent before step N's tokens are read (a
        sequence that samples in step N has a pending token, which the worker feeds into its row of
        step N+1), so the worker starts N+1 as soon as it ends N. Step N's tokens are detokenized and
        handed to their streams at the next call, right after it sends its step: while the worker runs.
        A sequence that step N ends still has a row in N+1 (and, for a stop string, which the emit finds,
        in N+2): those rows' tokens are dropped, and the blocks it freed are reused only by steps
        scheduled later, which the worker runs after them."""
        out = self.scheduler.schedule()
        try:
            if not out.is_empty:
                now = time.monotonic()
                for s in out.scheduled:
                    if s.seq.scheduled_time is None:
                        s.seq.scheduled_time = now   # the end of its queue time (kept across preemptions)
                self.observer.on_scheduled(out)  # metrics: queue time ends for new sequences
                out.sent_at = now
                self.executor.send(out)
                self._in_flight.append(out)
            # The last step's tokens go to their streams now, while the worker runs the step just sent: a
            # sequence that waited for its token (a speculative draft's) does not wait for the emit as well.
            self._emit_updated()
            if not self._in_flight or (not out.is_empty and len(self._in_flight) == 1):
                return   # nothing sent yet, or the first step of a busy spell: schedule the next one first
            done = self._in_flight.popleft()
            sampled = self.executor.receive(done)
            now = time.monotonic()
            done.seconds = now - max(self._last_result, done.sent_at)   # the speculation gate's measure
            self._last_result = now
        except WorkerFailure as exc:
            self._in_flight.clear()
            self._emit_updated()
            self._recover(exc)
            return
        if self._failures_in_a_row:
            self._reset_failures()
        self._updated = self.scheduler.update(done, sampled)
        self.observer.on_tokens(self._updated)  # metrics: TTFT, inter-token latency, token counters

    def _emit_updated(self) -> None:
        updated, self._updated = self._updated, []
        for seq in updated:
            self._emit(seq)

    def _recover(self, exc: WorkerFailure) -> None:
        """The worker died: its KV memory is gone, so every running sequence is recomputed after a restart.

        A restart that fails (the new worker dies while starting, or fails its handshake) is one more
        failure in a row, like a step that breaks: the loop tries again after a backoff (during which
        it still takes requests and aborts), and only more than ``max_worker_restarts`` failures in a
        row fail the requests (UNAVAILABLE). Then the worker stays down until the next request's step
        finds it so and starts this again."""
        victims = self.scheduler.preempt_all()
        # The cached blocks' contents died with the worker: a later hit would attend to zeros.
        self.scheduler.block_manager.reset_prefix_cache()
        log.error("%s; %d running sequences requeued", exc, len(victims))
        restart_failed = False   # whether the last failure was a restart's
        while True:
            self._failures_in_a_row += 1
            if self._failures_in_a_row > self.max_worker_restarts:
                self._give_up(exc, restart_failed)
                return
            if self._failures_in_a_row > 1 and self._pause(self._restart_backoff.next_delay()):
                return  # stopping: _run fails what is left
            try:
                self.executor.restart()
                return
            except WorkerFailure as restart_exc:
                log.error("worker restart failed: %s", restart_exc)
                exc, restart_failed = restart_exc, True

    def _pause(self, seconds: float) -> bool:
        """Wait ``seconds`` before the next restart, still taking new requests, aborts and expired
        deadlines (every sequence is queued now, none on a worker); True when the engine is stopping."""
        end = time.monotonic() + seconds
        while True:
            self._wake.clear()
            self._drain_inbox()
            self._expire_deadlines()
            left = end - time.monotonic()
            if self._stopping.is_set() or left <= 0:
                return self._stopping.is_set()
            self._wake.wait(min(left, 0.5))

    def _give_up(self, exc: WorkerFailure, restart_failed: bool) -> None:
        why = (f"worker is down and could not be restarted: {exc}" if restart_failed
               else f"worker keeps failing ({exc})")
        log.error("%s; failing %d requests after %d failures in a row", why, len(self._live), self._failures_in_a_row)
        for seq in [live.seq for live in self._live.values()]:
            self._finish(seq, FinishReason.UNAVAILABLE, f"{why}; giving up on this request")
        self._reset_failures()

    def _reset_failures(self) -> None:
        """A step succeeded (or we gave up): the next failure starts a new count, restarting at once."""
        self._failures_in_a_row = 0
        self._restart_backoff.reset()

    def _drain_inbox(self) -> None:
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(message, AddSequence):
                seq = message.seq
                self._live[seq.seq_id] = _Live(seq, Detokenizer(self.decode, seq.sampling.stop, message.delivered_chars),
                                               seq.num_output_tokens, message.on_event)
                self.scheduler.add(seq)
                self.admission.picked_up()
            else:
                live = self._live.get(message.seq_id)
                if live is not None:
                    self._finish(live.seq, message.reason)

    def _expire_deadlines(self) -> None:
        now = time.monotonic()
        for seq in [x.seq for x in self._live.values() if x.seq.deadline is not None and x.seq.deadline <= now]:
            self._finish(seq, FinishReason.DEADLINE)

    def _finish(self, seq: Sequence, reason: FinishReason, error: str = "") -> None:
        self.scheduler.finish(seq, reason, error)
        self._emit(seq)

    @staticmethod
    def _detokenize(live: _Live, seq: Sequence) -> tuple[str, bool]:
        """The new text of ``seq`` and whether a stop string matched. Several new tokens (a verified
        speculative draft) are read one at a time, as one-token steps would be: a stop string that ends
        inside them ends the output there, and the tokens after it are dropped."""
        ids, text = seq.output_token_ids, ""
        if live.detok.has_stop and len(ids) - live.num_sent > 1:
            for end in range(live.num_sent + 1, len(ids)):
                delta, stopped = live.detok.step(ids[:end], final=False)
                text += delta
                if stopped:
                    del ids[end:]
                    if seq.is_finished:
                        seq.finish_reason = FinishReason.STOP   # what one token a step would have said
                    return text, True
        delta, stopped = live.detok.step(ids, final=seq.is_finished)
        return text + delta, stopped

    def _emit(self, seq: Sequence) -> None:
        """Hand the reader what is new for ``seq``; end it if a stop string matched."""
        live = self._live.get(seq.seq_id)
        if live is None:
            return
        text, stopped = self._detokenize(live, seq)
        if stopped and not seq.is_finished:
            self.scheduler.finish(seq, FinishReason.STOP)
        sent = live.num_sent
        new_ids = tuple(seq.output_token_ids[sent:])
        new_lps = tuple(seq.output_logprobs[sent:])
        live.num_sent = seq.num_output_tokens
        if new_ids or text or seq.is_finished:
            live.on_event(SeqEvent(new_ids, text, new_lps, seq.finish_reason, seq.finish_detail))
        if seq.is_finished:
            del self._live[seq.seq_id]
            self.observer.on_finished(seq)  # metrics: every sequence leaves here, once
