"""Model executor: starts and supervises one model's worker process and drives it.

One executor per loaded model. For a text-generation model it drives the step stream; for an
embedding or classification model it calls ``Embed`` / ``Classify``.

``send`` starts one step (a StepRequest) and ``receive`` waits for its StepResult, so the engine
can do other work while the worker runs. When the worker dies (the stream breaks), ``receive``
raises ``WorkerFailure``; the engine then takes back every running
sequence's KV blocks and calls ``restart``, which starts a fresh worker (or reconnects to an
external one) so the queued requests are recomputed instead of lost.
"""
from __future__ import annotations

import logging
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import grpc

from llmserve.worker.v1 import worker_pb2, worker_pb2_grpc
from services.common.process_memory import rss_bytes
from services.common.server import CHANNEL_OPTIONS, wait_for_serving
from services.engine.scheduler import SampledToken, SchedulerOutput
from services.engine.sequence import SamplingOptions, TokenLogprob

log = logging.getLogger("llmserve.engine.executor")
REPO_ROOT = Path(__file__).resolve().parents[2]


class WorkerFailure(RuntimeError):
    """The worker process died or its stream broke; running sequences lost their KV memory."""


@dataclass(frozen=True)
class ExecutorConfig:
    model: str
    task: str = "text-generation"     # text-generation | embedding | text-classification
    train_data: str = ""              # text-classification: the head's labelled file
    worker_address: str = ""          # external worker host:port; empty = start one
    dtype: str = "float32"
    device: str = "auto"
    kv_cache_mb: int = 512
    block_size: int = 16
    threads: int = 0
    start_timeout: float = 600.0      # first start converts a GGUF: allow minutes
    metrics: bool = False             # a spawned worker serves /metrics on a free port (see metrics_url)


def sampling_to_pb(s: SamplingOptions) -> worker_pb2.WorkerSampling:
    return worker_pb2.WorkerSampling(
        temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, has_seed=s.seed is not None,
        seed=s.seed or 0, repetition_penalty=s.repetition_penalty,
        num_logprobs=-1 if s.logprobs is None else s.logprobs,
    )


class ModelExecutor:
    def __init__(self, config: ExecutorConfig):
        self.config = config
        self.info: worker_pb2.WorkerInfo | None = None
        self.restarts = 0
        self.metrics_url = ""                  # the spawned worker's /metrics; the engine's /metrics merges it in
        self._proc: subprocess.Popen[bytes] | None = None
        self._channel: grpc.Channel | None = None
        self._requests: queue.Queue[worker_pb2.StepRequest | None] = queue.Queue()
        self._responses: Iterator[worker_pb2.StepResult] | None = None
        self._stub: worker_pb2_grpc.WorkerStub | None = None
        self._last_error = ""                  # the worker's last logged error (why it failed to start)
        self._restart_lock = threading.Lock()  # concurrent failed calls restart a dead encoder worker once
        self._step_id = 0
        self._handed_off = threading.Event()
        self._sampling_cache: dict[int, worker_pb2.WorkerSampling] = {}
        self._worker_has_history: set[int] = set()   # sequences the worker has seen since their last release

    # -- lifecycle ----------------------------------------------------------------------

    def start(self) -> worker_pb2.WorkerInfo:
        address = self.config.worker_address or self._spawn()
        alive = (lambda: self._proc is None or self._proc.poll() is None)
        wait_for_serving(address, self.config.start_timeout, is_alive=alive)
        self._channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        stub = self._stub = worker_pb2_grpc.WorkerStub(self._channel)
        self.info = stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=30)
        if self.info.task and self.info.task != self.config.task:
            raise WorkerFailure(f"worker at {address} serves a {self.info.task} model, not {self.config.task}")
        if self.config.task != "text-generation":
            log.info("worker %s (%s) ready at %s", self.info.model_name, self.info.task, address)
            return self.info
        self._requests = queue.Queue()
        self._responses = stub.Execute(self._request_stream(self._requests))
        self._sampling_cache.clear()
        self._worker_has_history.clear()
        log.info("worker %s ready at %s: %s, %d KV blocks of %d tokens", self.info.model_name, address,
                 self.info.device, self.info.num_kv_blocks, self.info.block_size)
        return self.info

    def _spawn(self) -> str:
        c = self.config
        port_file = Path(tempfile.mkdtemp(prefix="llmserve-worker-")) / "port"
        cmd = [sys.executable, "-m", "services.worker", "--port", "0", "--port-file", str(port_file),
               "--model", c.model, "--dtype", c.dtype, "--device", c.device, "--kv-cache-mb", str(c.kv_cache_mb),
               "--block-size", str(c.block_size), "--threads", str(c.threads), "--exit-with-parent",
               "--task", c.task, *(["--train-data", c.train_data] if c.train_data else []),
               *(["--metrics-port", "0", "--metrics-port-file", str(port_file.parent / "metrics-port")]
                 if c.metrics else ["--no-metrics"])]
        self._proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                      stderr=subprocess.PIPE)
        relay = threading.Thread(target=self._relay_stderr, args=(self._proc,), name="worker-stderr", daemon=True)
        relay.start()
        log.info("started worker pid %d: %s", self._proc.pid, " ".join(cmd))
        deadline = time.monotonic() + self.config.start_timeout
        while not port_file.exists():
            if self._proc.poll() is not None:
                relay.join(timeout=5)  # its last words (the reason) are still in the pipe
                raise WorkerFailure(f"worker exited with code {self._proc.returncode} while starting: "
                                    f"{self._last_error or 'see the engine log'}")
            if time.monotonic() > deadline:
                raise WorkerFailure(f"worker did not start within {self.config.start_timeout:.0f}s")
            time.sleep(0.05)
        metrics_port_file = port_file.parent / "metrics-port"  # written before the port file
        if metrics_port_file.exists():
            self.metrics_url = f"http://127.0.0.1:{metrics_port_file.read_text().strip()}/metrics"
            log.info("worker pid %d metrics at %s", self._proc.pid, self.metrics_url)
        return f"127.0.0.1:{port_file.read_text().strip()}"

    def _relay_stderr(self, proc: subprocess.Popen[bytes]) -> None:
        """Pass the worker's log through to ours, remembering its last error line for WorkerFailure."""
        assert proc.stderr is not None
        for raw in proc.stderr:
            sys.stderr.buffer.write(raw)
            sys.stderr.buffer.flush()
            line = raw.decode(errors="replace").strip()
            if " ERROR " in line:
                self._last_error = line.split(" ERROR ", 1)[1]

    @property
    def worker_pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def memory_bytes(self) -> int:
        """The worker's RSS (from /proc) when it is our child; else what it reports it allocated."""
        if self._proc is not None:
            return rss_bytes(self._proc.pid)
        info = self.info
        return int(info.weights_bytes + info.kv_cache_bytes) if info is not None else 0

    # -- embedding and classification ----------------------------------------------------------

    def embed(self, texts: list[str], timeout: float | None) -> worker_pb2.EmbedResponse:
        return self._unary("Embed", worker_pb2.EmbedRequest(texts=texts), timeout)  # type: ignore[no-any-return]

    def classify(self, texts: list[str], timeout: float | None) -> worker_pb2.ClassifyResponse:
        return self._unary("Classify", worker_pb2.ClassifyRequest(texts=texts), timeout)  # type: ignore[no-any-return]

    def _unary(self, method: str, request: object, timeout: float | None) -> object:
        """One call to an encoder worker; if our worker process died, start a new one and retry once."""
        proc = self._proc  # the worker this call talks to
        try:
            return getattr(self._stub, method)(request, timeout=timeout)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE or proc is None:  # type: ignore[attr-defined]
                raise
            with self._restart_lock:
                if proc is self._proc:  # nobody restarted it meanwhile
                    try:
                        # Refused connections mean it is dying: a killed process can be reaped only once all
                        # its threads are gone, a few ms after /proc already shows it as a zombie.
                        proc.wait(timeout=5)
                    except subprocess.TimeoutExpired:
                        raise exc from None  # alive after all: a real error, not a dead worker
                    self.restart()
            return getattr(self._stub, method)(request, timeout=timeout)

    def restart(self) -> worker_pb2.WorkerInfo:
        self.restarts += 1
        log.warning("restarting worker (restart #%d)", self.restarts)
        self._close(kill=True)
        return self.start()

    def shutdown(self) -> None:
        self._close(kill=False)

    def _close(self, kill: bool) -> None:
        self._requests.put(None)
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill() if kill else proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    # -- one step -------------------------------------------------------------------------

    def send(self, out: SchedulerOutput) -> None:
        """Start one step on the worker; ``receive`` waits for its result."""
        if self._responses is None:
            raise WorkerFailure("worker not started")
        self._step_id += 1
        req = worker_pb2.StepRequest(step_id=self._step_id, released_seq_ids=out.released_seq_ids)
        for released in out.released_seq_ids:
            self._sampling_cache.pop(released, None)
            self._worker_has_history.discard(released)
        for s in out.scheduled:
            seq = s.seq
            sampling = self._sampling_cache.get(seq.seq_id)
            if sampling is None:
                sampling = self._sampling_cache[seq.seq_id] = sampling_to_pb(seq.sampling)
            step = worker_pb2.SequenceStep(
                seq_id=seq.seq_id, token_ids=seq.token_ids(s.start_pos, s.start_pos + s.num_tokens),
                start_pos=s.start_pos, block_table=seq.block_table, sample=s.sample, sampling=sampling,
                num_generated=seq.num_output_tokens)
            if seq.seq_id not in self._worker_has_history:
                self._worker_has_history.add(seq.seq_id)
                if s.start_pos and seq.sampling.repetition_penalty != 1.0:
                    step.prefix_token_ids.extend(seq.token_ids(0, s.start_pos))
            req.seqs.append(step)
        self._handed_off.clear()
        self._requests.put(req)
        # Return once gRPC's sending thread has the request: the engine's next work (emitting the
        # last step's tokens) holds the GIL and would otherwise delay the send by a switch interval.
        self._handed_off.wait(timeout=1.0)

    def _request_stream(self, requests: "queue.Queue[worker_pb2.StepRequest | None]") -> Iterator[worker_pb2.StepRequest]:
        while (req := requests.get()) is not None:
            self._handed_off.set()
            yield req

    def receive(self, out: SchedulerOutput) -> dict[int, SampledToken]:
        """The sampled tokens of the step ``send(out)`` started."""
        assert self._responses is not None
        try:
            result = next(self._responses)
        except (grpc.RpcError, StopIteration) as exc:
            detail = exc.details() if isinstance(exc, grpc.RpcError) else "stream ended"  # type: ignore[attr-defined]
            raise WorkerFailure(f"worker stream broke: {detail}") from None
        wants_logprobs = {s.seq.seq_id for s in out.scheduled if s.seq.sampling.logprobs is not None}
        tokens: dict[int, SampledToken] = {}
        for t in result.tokens:
            lp = None
            if t.seq_id in wants_logprobs:
                lp = TokenLogprob(t.token_id, t.logprob, tuple(zip(t.top_token_ids, t.top_logprobs)))
            tokens[t.seq_id] = SampledToken(t.token_id, lp)
        return tokens
