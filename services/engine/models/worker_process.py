"""One model's worker: started as our child process (or an external one at a fixed address) and connected.

``start`` spawns ``python -m services.worker`` through the shared handshake
(``services.common.process``), relays its log into ours (remembering its last error line, the
reason a failed start reports), dials it and checks with ``GetInfo`` that it serves the expected
task. Any failure of a start (the process exits or hangs before it serves, or fails the handshake)
is a ``WorkerFailure``, and a half-started process is killed. ``close`` ends the process, so an unloaded model's memory goes back to the OS.
"""
from __future__ import annotations

import logging
import os
import secrets
import subprocess
import sys
import threading
from dataclasses import dataclass

import grpc

from llmserve.worker.v1 import worker_pb2, worker_pb2_grpc
from services.common.process import ServiceProcess, StartFailure, start_service
from services.common.process_memory import rss_bytes
from services.common.security import PLAINTEXT, WORKER_SECRET, WORKER_SECRET_ENV, TlsFiles, channel
from services.common.server import CHANNEL_OPTIONS, wait_for_serving
from services.engine.core.executor import WorkerFailure

log = logging.getLogger("llmserve.engine.worker")


@dataclass(frozen=True)
class WorkerSpec:
    model: str
    task: str = "text-generation"     # text-generation | embedding | text-classification
    train_data: str = ""              # text-classification: the head's labelled file
    runtime: str = "transformers"     # transformers | onnxruntime (a store entry of format onnx)
    onnx_file: str = ""               # onnxruntime: this file instead of the export into the cache
    worker_address: str = ""          # external worker host:port; empty = start one
    dtype: str = "float32"
    device: str = "auto"
    kv_cache_mb: int = 512
    block_size: int = 0               # 0 = the worker's choice (see WorkerConfig.block_size)
    kv_cache_dtype: str = "auto"      # --dtype native only (see WorkerConfig.kv_cache_dtype)
    threads: int = 0
    start_timeout: float = 600.0      # first start converts a GGUF: allow minutes
    tls: TlsFiles = PLAINTEXT         # the engine's own: the worker serves with it and dials back nothing
    external_secret: str = ""         # what an external worker expects; a spawned one gets a fresh secret
    metrics: bool = False             # a spawned worker serves /metrics on a free port (see metrics_url)

    def args(self) -> list[str]:
        return ["--model", self.model, "--dtype", self.dtype, "--device", self.device,
                "--kv-cache-mb", str(self.kv_cache_mb), "--block-size", str(self.block_size),
                "--kv-cache-dtype", self.kv_cache_dtype,
                "--threads", str(self.threads), "--exit-with-parent", "--parent-pid", str(os.getpid()),
                "--task", self.task, "--runtime", self.runtime,
                *(["--onnx-file", self.onnx_file] if self.onnx_file else []),
                *(["--train-data", self.train_data] if self.train_data else []), *self.tls.args(),
                *([] if self.metrics else ["--no-metrics"])]


class WorkerProcess:
    def __init__(self, spec: WorkerSpec):
        self.spec = spec
        self.info: worker_pb2.WorkerInfo | None = None
        self.stub: worker_pb2_grpc.WorkerStub | None = None
        self.restarts = 0                      # the engine's metrics read it at scrape time
        self.metrics_url = ""                  # the spawned worker's /metrics; the engine's /metrics merges it in
        self._process: ServiceProcess | None = None
        self._channel: grpc.Channel | None = None
        self._last_error = ""                  # the worker's last logged error (why it failed to start)
        self._relay: threading.Thread | None = None
        self.metadata: tuple[tuple[str, str], ...] = ()   # the worker's credential, on every call to it

    def start(self) -> worker_pb2.WorkerInfo:
        """Start (or reach) the worker and connect; raises ``WorkerFailure`` with the reason."""
        address = self.spec.worker_address
        tls = self.spec.tls
        try:
            if address:
                secret = self.spec.external_secret
                wait_for_serving(address, self.spec.start_timeout, tls=tls)
            else:
                # A new secret per start: only this engine, and only this worker process, knows it.
                secret = secrets.token_urlsafe(32)
                self._process = start_service("services.worker", self.spec.args(), self.spec.start_timeout,
                                              stderr=subprocess.PIPE, on_started=self._relay_stderr,
                                              reason=self._reason, tls=tls, env={WORKER_SECRET_ENV: secret},
                                              metrics_port=0 if self.spec.metrics else None)
                address = self._process.address
                self.metrics_url = self._process.metrics_url
                log.info("started worker pid %d at %s%s", self._process.proc.pid, address,
                         f" (metrics at {self.metrics_url})" if self.metrics_url else "")
        except (StartFailure, TimeoutError, RuntimeError) as exc:
            raise WorkerFailure(str(exc)) from None
        self.metadata = ((WORKER_SECRET, secret),) if secret else ()
        self._channel = channel(address, tls, options=CHANNEL_OPTIONS)
        self.stub = worker_pb2_grpc.WorkerStub(self._channel)
        try:
            info = self.info = self.stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=30, metadata=self.metadata)
        except grpc.RpcError as exc:
            # Died (or hung) between SERVING and the handshake: a failed start like any other.
            detail = exc.details() if hasattr(exc, "details") else str(exc)
            self.close(kill=True)
            raise WorkerFailure(f"worker at {address} failed its GetInfo handshake: {detail}") from None
        if info.task and info.task != self.spec.task:
            self.close(kill=True)
            raise WorkerFailure(f"worker at {address} serves a {info.task} model, not {self.spec.task}")
        log.info("worker %s (%s) ready at %s on %s", info.model_name, info.task, address, info.device)
        return info

    def restart(self) -> worker_pb2.WorkerInfo:
        self.restarts += 1
        log.warning("restarting worker (restart #%d)", self.restarts)
        self.close(kill=True)
        return self.start()

    def close(self, kill: bool = False) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        process, self._process = self._process, None
        self.metrics_url = ""
        if process is not None:
            process.stop(timeout=15, kill=kill)
            if self._relay is not None:
                self._relay.join(timeout=5)  # its last lines reach our log before we go on (or exit)

    def died(self, timeout: float) -> bool:
        """Whether our worker process is gone, waiting up to ``timeout`` for a dying one to be reapable
        (refused connections come a few ms before a killed process can be reaped). An external worker
        is never ours to restart: False."""
        process = self._process
        if process is None:
            return False
        try:
            process.proc.wait(timeout=timeout)
            return True
        except subprocess.TimeoutExpired:
            return False

    def memory_bytes(self) -> int:
        """The worker's RSS (from /proc) when it is our child; else what it reports it allocated."""
        if self._process is not None:
            return rss_bytes(self._process.proc.pid)
        info = self.info
        return int(info.weights_bytes + info.kv_cache_bytes) if info is not None else 0

    def _relay_stderr(self, proc: subprocess.Popen[bytes]) -> None:
        self._last_error = ""
        self._relay = threading.Thread(target=self._copy_log, args=(proc,), name="worker-stderr", daemon=True)
        self._relay.start()

    def _copy_log(self, proc: subprocess.Popen[bytes]) -> None:
        """Pass the worker's log through to ours, remembering its last error line."""
        assert proc.stderr is not None
        for raw in proc.stderr:
            sys.stderr.buffer.write(raw)
            sys.stderr.buffer.flush()
            line = raw.decode(errors="replace").strip()
            if " ERROR " in line:
                self._last_error = line.split(" ERROR ", 1)[1]

    def _reason(self) -> str:
        if self._relay is not None:
            self._relay.join(timeout=5)  # its last words (the reason) are still in the pipe
        return self._last_error or "see the engine log"
