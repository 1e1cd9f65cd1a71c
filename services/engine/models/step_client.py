"""The step stream to a generation worker: ``Executor`` over gRPC (``Worker.Execute``).

Translates each ``SchedulerOutput`` into a ``StepRequest`` (protobuf stays here), mirroring what
the worker already holds: a sequence's sampling parameters are converted once, and the tokens
before a step's start are sent only when the worker has no history for it (a recomputed or
resumed sequence with a repetition penalty), and so is an output constraint with the output so far.
"""
from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from typing import Iterator

import grpc

from llmserve.worker.v1 import worker_pb2
from services.common.sampling_pb import sampling_to_pb
from services.engine.core.executor import WorkerFailure
from services.engine.core.scheduler import SampledToken, SchedulerOutput
from services.engine.core.sequence import TokenLogprob
from services.engine.models.worker_process import WorkerProcess

log = logging.getLogger("llmserve.engine.steps")


class StepClient:
    def __init__(self, worker: WorkerProcess):
        self.worker = worker
        self._requests: queue.Queue[worker_pb2.StepRequest | None] = queue.Queue()
        self._responses: Iterator[worker_pb2.StepResult] | None = None
        self._step_id = 0
        self._in_flight: deque[int] = deque()   # ids of the steps sent and not yet answered, oldest first
        self._handed_off = threading.Event()
        self._sampling_cache: dict[int, worker_pb2.WorkerSampling] = {}
        self._worker_has_history: set[int] = set()   # sequences the worker has seen since their last release

    @property
    def restarts(self) -> int:
        return self.worker.restarts

    def start(self) -> worker_pb2.WorkerInfo:
        info = self.worker.start()
        self._open_stream()
        log.info("worker %s: %d KV blocks of %d tokens", info.model_name, info.num_kv_blocks, info.block_size)
        return info

    def restart(self) -> None:
        """A fresh worker and step stream; raises ``WorkerFailure`` when the worker does not come up
        (the engine counts it and tries again), leaving no stream: ``send`` then fails at once."""
        self._end_stream()
        self.worker.restart()
        self._open_stream()

    def _end_stream(self) -> None:
        """Let go of a broken (or replaced) stream: its request iterator ends, and a ``send`` before the
        next ``_open_stream`` raises instead of waiting for a hand-off that cannot come."""
        self._requests.put(None)
        self._responses = None

    def shutdown(self) -> None:
        self._end_stream()
        self.worker.close()

    def _open_stream(self) -> None:
        assert self.worker.stub is not None
        self._requests = queue.Queue()
        self._responses = self.worker.stub.Execute(self._request_stream(self._requests), metadata=self.worker.metadata)
        self._sampling_cache.clear()
        self._worker_has_history.clear()
        self._in_flight.clear()

    # -- one step -------------------------------------------------------------------------

    def send(self, out: SchedulerOutput) -> None:
        if self._responses is None:
            raise WorkerFailure("worker not started")
        self._step_id += 1
        self._in_flight.append(self._step_id)
        req = self.step_request(out, self._step_id)
        self._handed_off.clear()
        self._requests.put(req)
        # Return once gRPC's sending thread has the request: the engine's next work (emitting the
        # last step's tokens) holds the GIL and would otherwise delay the send by a switch interval.
        self._handed_off.wait(timeout=1.0)

    def step_request(self, out: SchedulerOutput, step_id: int) -> worker_pb2.StepRequest:
        """The protobuf of step ``out`` (updates what this client knows the worker holds)."""
        req = worker_pb2.StepRequest(step_id=step_id, released_seq_ids=out.released_seq_ids)
        for released in out.released_seq_ids:
            self._sampling_cache.pop(released, None)
            self._worker_has_history.discard(released)
        for s in out.scheduled:
            seq = s.seq
            sampling = self._sampling_cache.get(seq.seq_id)
            if sampling is None:
                sampling = self._sampling_cache[seq.seq_id] = sampling_to_pb(seq.sampling)
            end = s.start_pos + s.num_tokens - len(s.draft)
            # A row past the known tokens is a decode of the token the step in flight samples: the worker
            # has it. The token sampled after this row is output number end - prompt length. A draft row is
            # the last known token and the draft (speculation.py); a guessed row, a guess of the token in
            # flight and a draft after it (or nothing: no guess), which the worker resolves (scheduler.py).
            pending = end > seq.num_tokens
            if s.guess is not None:
                tokens = [s.guess, *s.draft] if s.guess >= 0 else []
            else:
                tokens = [] if pending else seq.token_ids(s.start_pos, end) + list(s.draft)
            step = worker_pb2.SequenceStep(
                seq_id=seq.seq_id, token_ids=tokens,
                input_is_last_sampled=pending, start_pos=s.start_pos, block_table=seq.block_table,
                sample=s.sample, sampling=sampling, num_generated=max(0, end - seq.num_prompt_tokens),
                num_draft_tokens=len(s.draft))
            if seq.seq_id not in self._worker_has_history:
                self._worker_has_history.add(seq.seq_id)
                step.request_id = seq.request_id  # first time the worker sees it: for its log
                if s.start_pos and seq.sampling.repetition_penalty != 1.0:
                    step.prefix_token_ids.extend(seq.token_ids(0, s.start_pos))
                if seq.sampling.grammar:  # its matcher starts now, after the output it already has
                    step.grammar = seq.sampling.grammar
                    step.grammar_replay_token_ids.extend(seq.output_token_ids)
            req.seqs.append(step)
        return req

    def _request_stream(self, requests: "queue.Queue[worker_pb2.StepRequest | None]") -> Iterator[worker_pb2.StepRequest]:
        while (req := requests.get()) is not None:
            self._handed_off.set()
            yield req

    def receive(self, out: SchedulerOutput) -> dict[int, SampledToken]:
        if self._responses is None:
            raise WorkerFailure("worker not started")
        try:
            result = next(self._responses)
        except (grpc.RpcError, StopIteration) as exc:
            detail = exc.details() if isinstance(exc, grpc.RpcError) else "stream ended"  # type: ignore[attr-defined]
            self._end_stream()
            raise WorkerFailure(f"worker stream broke: {detail}") from None
        expected = self._in_flight.popleft() if self._in_flight else 0
        if result.step_id != expected:
            self._end_stream()
            raise WorkerFailure(f"worker answered step {result.step_id} to step {expected}: out of step")
        return self.sampled_tokens(result, out)

    @staticmethod
    def sampled_tokens(result: worker_pb2.StepResult, out: SchedulerOutput) -> dict[int, SampledToken]:
        """A step's result, by sequence id."""
        wants_logprobs = {s.seq.seq_id for s in out.scheduled if s.seq.sampling.logprobs is not None}
        tokens: dict[int, SampledToken] = {}
        for t in result.tokens:
            lp = None
            if t.seq_id in wants_logprobs:
                lp = TokenLogprob(t.token_id, t.logprob, tuple(zip(t.top_token_ids, t.top_logprobs)))
            tokens[t.seq_id] = SampledToken(-1 if t.no_token else t.token_id, lp, t.error, tuple(t.accepted_token_ids))
        return tokens
