"""Admission control: the queue bound counts sequences (never other messages), a batch is admitted
whole or refused whole, and a refusal carries a retry hint derived from the finish rate."""
from __future__ import annotations

import threading
import time

import pytest

from services.common.errors import ResourceExhausted
from services.common.sampling import SamplingOptions
from services.engine.core.admission import IDLE_RETRY_MS, MAX_RETRY_MS, MIN_RETRY_MS, Admission
from services.engine.core.sequence import FinishReason, Sequence
from tests.unit.test_engine import FakeExecutor, Reader, make_engine  # noqa: F401 - the fixture


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_request_past_the_bound_is_refused_with_a_retry_hint():
    admission = Admission(max_queue=4)
    admission.admit(3, num_queued=0)
    admission.admit(1, num_queued=0)
    with pytest.raises(ResourceExhausted) as refused:
        admission.admit(1, num_queued=0)
    assert refused.value.code == "RESOURCE_EXHAUSTED"
    assert "--max-queue 4" in refused.value.message
    assert refused.value.retry_after_ms == IDLE_RETRY_MS   # nothing finished yet: the rate is unknown


def test_a_batch_is_admitted_whole_or_refused_whole():
    admission = Admission(max_queue=4)
    admission.admit(2, num_queued=1)
    with pytest.raises(ResourceExhausted, match="2 sequences"):
        admission.admit(2, num_queued=1)
    assert admission.num_waiting(1) == 3          # the refused batch reserved nothing
    admission.admit(1, num_queued=1)


def test_the_retry_hint_follows_the_finish_rate_within_bounds():
    clock = Clock()
    admission = Admission(max_queue=100, clock=clock)
    admission.on_finished(0)
    clock.now = 1.0
    admission.on_finished(20)                     # 20 sequences a second
    # A tenth of a 100-sequence queue at 20/s: 500 ms.
    assert admission.retry_after_ms(100) == 500
    assert admission.retry_after_ms(1) == max(MIN_RETRY_MS, 50)
    clock.now = 2.0
    admission.on_finished(20 + 1)                 # the rate drops to about 10/s
    assert admission.retry_after_ms(100_000) == MAX_RETRY_MS
    clock.now = 100.0                             # nothing finished for long: unknown again
    assert admission.retry_after_ms(100) == IDLE_RETRY_MS


def test_expired_calls_do_not_count_as_waiting_sequences(make_engine):  # noqa: F811 - the fixture
    """50 calls that expire at once put 50 aborts in the engine's inbox besides their sequences;
    only sequences are waiting, and the queue bound compares that number."""
    executor = FakeExecutor(step_seconds=0.02)
    engine = make_engine(executor)                # max_queue=16, max_num_seqs=8
    gate = threading.Event()
    original = executor.receive

    def held_receive(out):                        # keep the loop in one step while the calls come and go
        gate.wait(10)
        return original(out)
    executor.receive = held_receive
    first = Sequence(prompt_token_ids=[1, 2, 3], sampling=SamplingOptions(max_tokens=1))
    engine.submit(first, Reader(executor))
    deadline = time.monotonic() + 10
    while engine.load().num_running < 1:
        assert time.monotonic() < deadline, "the first sequence never ran"
        time.sleep(0.01)
    seqs = []
    for _ in range(10):
        seq = Sequence(prompt_token_ids=[1, 2, 3], sampling=SamplingOptions(max_tokens=1000))
        engine.submit(seq, Reader(executor))
        seqs.append(seq)
    for seq in seqs:
        engine.abort(seq.seq_id, FinishReason.CANCELLED)
    assert engine.load().num_waiting == 10        # 10 sequences, not 10 sequences + 10 aborts
    for _ in range(6):                            # 10 + 6 = 16: the bound holds room for them
        engine.submit(Sequence(prompt_token_ids=[1], sampling=SamplingOptions(max_tokens=1)), Reader(executor))
    with pytest.raises(ResourceExhausted):
        engine.submit(Sequence(prompt_token_ids=[1], sampling=SamplingOptions(max_tokens=1)), Reader(executor))
    gate.set()
    deadline = time.monotonic() + 10
    while engine.load().num_waiting or engine.load().num_running:
        assert time.monotonic() < deadline, f"the queue never drained: {engine.load()}"
        time.sleep(0.01)
    assert engine.scheduler.block_manager.num_used_blocks == 0
