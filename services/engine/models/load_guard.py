"""The load guard: which cold loads may start, so a broken model cannot be turned against the good ones.

A load that would have to evict models first passes ``check(entry)``:
- a model whose last load failed less than ``backoff_seconds`` ago fails at once
  (FAILED_PRECONDITION with the remembered reason and how long until it is tried again), before
  anything is evicted or started;
- otherwise the preflight (``preflight.check_model_files``: files present, headers and tensor sizes
  readable) runs; its failure is remembered the same way.

``failed(entry, error)`` remembers a load that failed later (in the worker). A memory ends when
its back-off passes, when the model's file changes on disk (its size or mtime: someone copied it
again), or on ``clear(entry)`` (an explicit LoadModel: the operator asks for a retry now).
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from services.common.errors import FailedPrecondition, ServiceError
from services.common.model_source import resolve_model
from services.engine.models.preflight import check_model_files
from services.engine.models.store import ModelEntry

log = logging.getLogger("llmserve.engine.models")

Preflight = Callable[[ModelEntry], None]
Fingerprint = tuple[int, int] | None   # (size, mtime_ns) of the model's file; None when it cannot be read


def file_fingerprint(entry: ModelEntry) -> Fingerprint:
    """What changes when the model's file is replaced: its size and mtime (a directory: its config.json's)."""
    try:
        path = resolve_model(entry.source).path
        st = (path / "config.json" if path.is_dir() else path).stat()
    except (FileNotFoundError, OSError):
        return None
    return st.st_size, st.st_mtime_ns


@dataclass(frozen=True)
class _Failure:
    error: ServiceError
    at: float
    fingerprint: Fingerprint


@dataclass
class LoadGuard:
    backoff_seconds: float = 30.0        # how long a failed load is remembered (0 = never remembered)
    preflight: Preflight = check_model_files
    fingerprint: Callable[[ModelEntry], Fingerprint] = file_fingerprint
    clock: Callable[[], float] = time.monotonic
    _failures: dict[str, _Failure] = field(default_factory=dict, init=False)   # entry id → last failure
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)

    def check(self, entry: ModelEntry) -> None:
        """Raise the remembered failure, or the preflight's; return when a load of ``entry`` may start."""
        remembered = self._remembered(entry)
        if remembered is not None:
            waited = self.clock() - remembered.at
            left = self.backoff_seconds - waited
            raise FailedPrecondition(
                f"{remembered.error.message} [load failed {waited:.1f}s ago; not retried for another "
                f"{left:.1f}s, or until its file changes or an admin calls EngineAdmin/LoadModel]",
                retry_after_ms=max(1, int(left * 1000)))
        try:
            self.preflight(entry)
        except ServiceError as exc:
            self.failed(entry, exc)
            raise

    def failed(self, entry: ModelEntry, error: ServiceError) -> None:
        if self.backoff_seconds <= 0:
            return
        with self._lock:
            self._failures[entry.id] = _Failure(error, self.clock(), self.fingerprint(entry))
        log.warning("remembering the failed load of %s for %.0fs: %s", entry.name, self.backoff_seconds,
                    error.message)

    def clear(self, entry: ModelEntry) -> None:
        with self._lock:
            self._failures.pop(entry.id, None)

    def failure(self, entry: ModelEntry) -> str:
        """The remembered reason ``entry`` does not load ('' when none)."""
        remembered = self._remembered(entry)
        return remembered.error.message if remembered is not None else ""

    def _remembered(self, entry: ModelEntry) -> _Failure | None:
        with self._lock:
            remembered = self._failures.get(entry.id)
        if remembered is None:
            return None
        if self.clock() - remembered.at >= self.backoff_seconds or self.fingerprint(entry) != remembered.fingerprint:
            with self._lock:
                if self._failures.get(entry.id) is remembered:
                    del self._failures[entry.id]
            return None
        return remembered
