"""The engine loop with a fake executor: no model, no worker process, no gRPC server.

The fake answers each step with scripted tokens (the token a sequence samples depends only on how
many it has generated, so a recomputed sequence gets the same ones) and records, in order, what
the loop did: send, receive, emit. Token id ``t`` decodes to ``chr(t)``.
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Any

import pytest

from services.engine.core.block_manager import BlockManager
from services.engine.core.engine import LLMEngine
from services.engine.core.executor import WorkerFailure
from services.engine.core.scheduler import SampledToken, Scheduler, SchedulerConfig, SchedulerOutput
from services.common.sampling import SamplingOptions
from services.engine.core.sequence import FinishReason, SeqEvent, Sequence

WAIT = 10.0   # seconds any one wait may take before the test fails


def decode(ids: list[int]) -> str:
    return "".join(chr(t) for t in ids)


class FakeExecutor:
    def __init__(self, script: dict[int, str] | None = None, fail_receives: set[int] = frozenset(),
                 restart_error: str = "", step_seconds: float = 0.0, failed_restarts: int = 10**9):
        self.script = script or {}               # seq_id → the text it generates
        self.poisoned: dict[int, str] = {}       # seq_id → the error the worker reports for it
        self.fail_receives = set(fail_receives)  # receive calls (1-based) that find the worker dead
        self.restart_error = restart_error       # with it, the first ``failed_restarts`` restarts fail
        self.failed_restarts = failed_restarts
        self.step_seconds = step_seconds
        self.log: list[tuple] = []
        self.lock = threading.Lock()
        self.restarts = 0
        self._receives = 0

    def record(self, *entry: object) -> None:
        with self.lock:
            self.log.append(entry)

    def send(self, out: SchedulerOutput) -> None:
        self.record("send", tuple((s.seq.seq_id, s.start_pos, s.num_tokens) for s in out.scheduled),
                    tuple(out.released_seq_ids))

    def receive(self, out: SchedulerOutput) -> dict[int, SampledToken]:
        self._receives += 1
        if self.step_seconds:
            threading.Event().wait(self.step_seconds)  # the simulated forward pass
        if self._receives in self.fail_receives:
            self.record("fail")
            raise WorkerFailure("worker stream broke: killed")
        self.record("receive")
        text = {s.seq.seq_id: self.script.get(s.seq.seq_id, "z" * 10_000) for s in out.scheduled}
        # the row's token is output number (its last position + 1) - prompt length, as in the worker
        tokens = {s.seq.seq_id: SampledToken(ord(text[s.seq.seq_id][s.start_pos + s.num_tokens - s.seq.num_prompt_tokens]))
                  for s in out.scheduled if s.sample}
        for s in out.scheduled:
            if s.seq.seq_id in self.poisoned:
                tokens[s.seq.seq_id] = SampledToken(0, None, self.poisoned[s.seq.seq_id])
        return tokens

    def restart(self) -> None:
        self.restarts += 1
        self.record("restart")
        if self.restart_error and self.restarts <= self.failed_restarts:
            raise WorkerFailure(self.restart_error)   # what StepClient raises for any failed start

    def sends(self) -> list[tuple]:
        return [e for e in self.log if e[0] == "send"]


class Reader:
    """A request's reader: collects its events, and logs each emit into the executor's log."""

    def __init__(self, executor: FakeExecutor):
        self.executor = executor
        self.events: queue.Queue[SeqEvent] = queue.Queue()

    def __call__(self, event: SeqEvent) -> None:
        self.executor.record("emit", event.text)
        self.events.put(event)

    def first(self) -> SeqEvent:
        return self.events.get(timeout=WAIT)

    def until_finished(self) -> tuple[str, SeqEvent]:
        """All text up to the last event, and that event."""
        text, deadline = "", time.monotonic() + WAIT
        while True:
            event = self.events.get(timeout=max(0.0, deadline - time.monotonic()))
            text += event.text
            if event.finish_reason is not None:
                return text, event


@pytest.fixture
def make_engine():
    engines: list[LLMEngine] = []

    def make(executor: FakeExecutor, max_worker_restarts: int = 3, num_blocks: int = 64,
             prefix_caching: bool = False, observer: Any = None) -> LLMEngine:
        scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=1024),
                              BlockManager(num_blocks, 4, enable_prefix_caching=prefix_caching))
        if callable(observer):   # a factory that needs the scheduler (the metrics' GenerationStats)
            observer = observer(scheduler)
        engine = LLMEngine(scheduler, executor, decode, max_queue=16, max_worker_restarts=max_worker_restarts,
                           observer=observer, restart_backoff=0.001)
        engine.start()
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.stop()


def submit(engine: LLMEngine, executor: FakeExecutor, text: str = "", max_tokens: int = 3,
           **sampling: object) -> tuple[Sequence, Reader]:
    seq = Sequence(prompt_token_ids=[1, 2, 3], sampling=SamplingOptions(max_tokens=max_tokens, **sampling))
    if text:
        executor.script[seq.seq_id] = text
    reader = Reader(executor)
    engine.submit(seq, reader)
    return seq, reader


def test_a_steps_output_is_emitted_while_the_worker_runs_the_next_step(make_engine):
    executor = FakeExecutor()
    engine = make_engine(executor)
    seq, reader = submit(engine, executor, "abc", max_tokens=3)
    text, last = reader.until_finished()
    assert (text, last.finish_reason) == ("abc", FinishReason.LENGTH)
    kinds = [e[0] if e[0] != "emit" else f"emit {e[1]}" for e in executor.log]
    # One step in flight: step k+1 is sent before step k's result is read, and step k's token reaches
    # the reader after the next step is sent and before step k+1's result comes back. No step is sent for a
    # token past max_tokens.
    assert kinds == ["send", "send", "receive", "send", "emit a", "receive", "emit b", "receive", "emit c"]
    assert engine.scheduler.block_manager.num_used_blocks == 0


def test_a_stop_string_found_during_the_overlap_ends_exactly_and_spares_the_batch(make_engine):
    executor = FakeExecutor()
    engine = make_engine(executor)
    stopped, stop_reader = submit(engine, executor, "abcdefgh", max_tokens=8, stop=("bc",))
    other, other_reader = submit(engine, executor, "ABCDEFGH", max_tokens=8)
    assert stop_reader.until_finished()[0:1] == ("a",)
    text, last = other_reader.until_finished()
    assert (text, last.finish_reason) == ("ABCDEFGH", FinishReason.LENGTH)
    assert stopped.finish_reason is FinishReason.STOP
    # "c" was found while the next step (which sampled "d") ran: that token was dropped, not kept.
    assert decode(stopped.output_token_ids) == "abc"
    assert other.num_output_tokens == 8
    assert engine.scheduler.block_manager.num_used_blocks == 0
    assert any(stopped.seq_id in e[2] for e in executor.sends()), "the worker was told to release it"


def test_a_worker_failure_requeues_running_sequences_and_they_finish_after_the_restart(make_engine):
    executor = FakeExecutor(fail_receives={3})
    engine = make_engine(executor)
    seq, reader = submit(engine, executor, "abcde", max_tokens=5)
    text, last = reader.until_finished()
    assert (text, last.finish_reason) == ("abcde", FinishReason.LENGTH)
    assert executor.restarts == 1 and engine.load().worker_restarts == 1
    after = executor.log.index(("restart",))
    # The KV memory died with the worker: the sequence is recomputed from position 0.
    first_send = next(e for e in executor.log[after:] if e[0] == "send")
    assert first_send[1][0][:2] == (seq.seq_id, 0)
    assert engine.scheduler.block_manager.num_used_blocks == 0


def test_a_worker_that_keeps_failing_fails_the_requests_with_the_reason(make_engine):
    executor = FakeExecutor(fail_receives=set(range(1, 100)))
    engine = make_engine(executor, max_worker_restarts=2)
    _, reader = submit(engine, executor, "abc")
    text, last = reader.until_finished()
    assert last.finish_reason is FinishReason.UNAVAILABLE
    assert "worker keeps failing" in last.error and "killed" in last.error
    assert engine.scheduler.block_manager.num_used_blocks == 0


def test_a_worker_that_cannot_be_restarted_fails_the_requests_after_max_restarts(make_engine):
    executor = FakeExecutor(fail_receives={1}, restart_error="no memory for the model")
    engine = make_engine(executor, max_worker_restarts=3)
    _, reader = submit(engine, executor, "abc")
    _, last = reader.until_finished()
    assert last.finish_reason is FinishReason.UNAVAILABLE
    assert "could not be restarted: no memory for the model" in last.error
    # Each failed restart counts as one more failure in a row: the broken step and 3 restarts.
    assert executor.restarts == 3
    assert engine.scheduler.block_manager.num_used_blocks == 0


def test_restarts_that_fail_are_retried_and_the_requests_finish_as_if_undisturbed(make_engine):
    """The new worker dies while starting (or during its handshake) twice; the third restart holds.
    The running sequences are recomputed on it and end with exactly the tokens of an undisturbed run."""
    executor = FakeExecutor(fail_receives={3}, restart_error="worker failed its GetInfo handshake", failed_restarts=2)
    engine = make_engine(executor, max_worker_restarts=3)
    submitted = [submit(engine, executor, text, max_tokens=6) for text in ("abcdef", "ABCDEF", "uvwxyz")]
    results = [reader.until_finished() for _, reader in submitted]
    assert [(text, last.finish_reason, last.error) for text, last in results] == [
        ("abcdef", FinishReason.LENGTH, ""), ("ABCDEF", FinishReason.LENGTH, ""), ("uvwxyz", FinishReason.LENGTH, "")]
    assert executor.restarts == 3 and engine.load().worker_restarts == 3
    assert [e[0] for e in executor.log].count("restart") == 3
    # Recomputed from position 0 after the restart that held, and nothing sent to a worker in between.
    last_restart = max(i for i, e in enumerate(executor.log) if e == ("restart",))
    first_restart = executor.log.index(("restart",))
    assert not any(e[0] == "send" for e in executor.log[first_restart:last_restart])
    first_send = next(e for e in executor.log[last_restart:] if e[0] == "send")
    assert sorted(step[:2] for step in first_send[1]) == sorted((seq.seq_id, 0) for seq, _ in submitted)
    assert engine.scheduler.block_manager.num_used_blocks == 0
    assert not engine.scheduler.running and not engine.scheduler.waiting


def test_a_request_cancelled_while_the_engine_waits_to_restart_the_worker_ends_at_once(make_engine):
    executor = FakeExecutor(fail_receives={2}, restart_error="worker exited with code -9 while starting",
                            failed_restarts=1)
    engine = make_engine(executor, max_worker_restarts=3)
    engine._restart_backoff.initial = engine._restart_backoff.delay = 5.0   # the wait before restart #2
    seq, reader = submit(engine, executor, max_tokens=1000)
    assert reader.first().text
    deadline = time.monotonic() + WAIT
    while executor.restarts < 1:   # restart #1 has failed: the loop waits out its backoff
        assert time.monotonic() < deadline, "the worker was never restarted"
        time.sleep(0.01)
    began = time.monotonic()
    engine.abort(seq.seq_id, FinishReason.CANCELLED)
    _, last = reader.until_finished()
    assert last.finish_reason is FinishReason.CANCELLED and time.monotonic() - began < 2.0
    assert executor.restarts == 1 and engine.scheduler.block_manager.num_used_blocks == 0


def test_a_deadline_ends_the_sequence_and_frees_its_blocks(make_engine):
    executor = FakeExecutor(step_seconds=0.005)
    engine = make_engine(executor)
    seq = Sequence(prompt_token_ids=[1, 2, 3], sampling=SamplingOptions(max_tokens=1000),
                   deadline=time.monotonic() + 0.2)
    reader = Reader(executor)
    engine.submit(seq, reader)
    text, last = reader.until_finished()
    assert last.finish_reason is FinishReason.DEADLINE
    assert 0 < len(text) < 1000
    assert engine.scheduler.block_manager.num_used_blocks == 0


def test_cancel_ends_the_sequence_frees_its_blocks_and_tells_the_worker(make_engine):
    executor = FakeExecutor(step_seconds=0.002)
    engine = make_engine(executor)
    seq, reader = submit(engine, executor, max_tokens=1000)
    assert reader.first().text
    engine.abort(seq.seq_id, FinishReason.CANCELLED)
    _, last = reader.until_finished()
    assert last.finish_reason is FinishReason.CANCELLED
    assert engine.scheduler.block_manager.num_used_blocks == 0
    deadline = time.monotonic() + WAIT
    while not any(seq.seq_id in e[2] for e in executor.sends()):   # released with the next step
        assert time.monotonic() < deadline, "the worker was never told to release the sequence"
        submit(engine, executor, "a", max_tokens=1)[1].until_finished()


def test_the_engine_core_needs_neither_grpc_nor_generated_stubs_nor_prometheus():
    import subprocess
    import sys

    code = ("import sys, services.engine.core.engine, services.engine.core.executor, services.engine.core.observer; "
            "sys.exit(any(m.split('.')[0] in ('grpc', 'llmserve', 'torch', 'prometheus_client') for m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_a_sequence_the_worker_cannot_sample_fails_alone(make_engine):
    executor = FakeExecutor(step_seconds=0.002)
    engine = make_engine(executor)
    poisoned, bad_reader = submit(engine, executor, "abcdef", max_tokens=6)
    executor.poisoned[poisoned.seq_id] = "scores are not finite"
    _, good_reader = submit(engine, executor, "ABCDEF", max_tokens=6)
    _, bad = bad_reader.until_finished()
    text, good = good_reader.until_finished()
    assert bad.finish_reason is FinishReason.ERROR and bad.error == "scores are not finite"
    assert (text, good.finish_reason) == ("ABCDEF", FinishReason.LENGTH)
    assert executor.restarts == 0 and engine.scheduler.block_manager.num_used_blocks == 0


def test_a_worker_restart_forgets_the_prefix_cache(make_engine):
    """The cached blocks' memory died with the worker: after the restart a prompt that was cached is
    computed again from position 0, not read from blocks that now hold zeros."""
    executor = FakeExecutor()
    engine = make_engine(executor, prefix_caching=True)
    prompt = list(range(1, 14))   # three full blocks of 4
    first = Sequence(prompt_token_ids=prompt, sampling=SamplingOptions(max_tokens=2))
    reader = Reader(executor)
    engine.submit(first, reader)
    reader.until_finished()
    assert engine.scheduler.block_manager.num_cached_blocks >= 3
    executor.fail_receives.add(executor._receives + 1)
    again = Sequence(prompt_token_ids=prompt, sampling=SamplingOptions(max_tokens=2))
    reader = Reader(executor)
    engine.submit(again, reader)
    _, last = reader.until_finished()
    assert last.finish_reason is FinishReason.LENGTH and executor.restarts == 1
    after = executor.log.index(("restart",))
    first_send = next(e for e in executor.log[after:] if e[0] == "send")
    assert first_send[1][0][:2] == (again.seq_id, 0)


class RecordingObserver:
    """A StepObserver that notes what the loop told it (called on the loop thread)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.scheduled_steps = 0
        self.tokens: dict[int, int] = {}      # seq_id → tokens the loop reported
        self.finished: list[int] = []

    def on_scheduled(self, out: SchedulerOutput) -> None:
        with self.lock:
            self.scheduled_steps += 1

    def on_tokens(self, seqs: list[Sequence]) -> None:
        with self.lock:
            for seq in seqs:
                self.tokens[seq.seq_id] = self.tokens.get(seq.seq_id, 0) + 1

    def on_finished(self, seq: Sequence) -> None:
        with self.lock:
            self.finished.append(seq.seq_id)


def test_the_loop_tells_its_observer_of_each_step_each_token_and_each_finish_once(make_engine):
    executor = FakeExecutor(script={})
    observer = RecordingObserver()
    engine = make_engine(executor, observer=observer)
    done, done_reader = submit(engine, executor, max_tokens=3)
    cancelled, cancelled_reader = submit(engine, executor, max_tokens=1000)
    assert done_reader.until_finished()[1].finish_reason is FinishReason.LENGTH
    assert cancelled_reader.first().text
    engine.abort(cancelled.seq_id, FinishReason.CANCELLED)
    assert cancelled_reader.until_finished()[1].finish_reason is FinishReason.CANCELLED
    engine.stop()   # the loop thread has ended: what the observer holds is final
    assert sorted(observer.finished) == sorted([done.seq_id, cancelled.seq_id])
    assert observer.tokens[done.seq_id] == 3
    assert observer.tokens[cancelled.seq_id] == cancelled.num_output_tokens
    assert observer.scheduled_steps == len(executor.sends())
