"""The model manager: which models of the store are loaded, an LRU bounded by a memory budget.

Pure bookkeeping (no gRPC, no processes): a ``loader`` callable turns a store entry into a
``LoadedModel`` (in the engine: a worker process and, for generation, its own engine loop); the
manager decides when to call it and when to close what it returned.

Contract:
- ``use(key)`` is a context manager: the model is loaded on a miss (a cold start), marked in use
  for the duration, and its LRU position refreshed. Concurrent requests for the same cold model
  share one load (the others wait for it, and share its error if it fails).
- Before a load, the store's memory estimate is reserved; when the budget (or the model count)
  would be exceeded, the least recently used *idle* models are evicted. A model in use is never
  evicted: the load waits for room until its deadline, then fails RESOURCE_EXHAUSTED. After a load
  each model is charged the larger of its estimate and its measured memory (the worker's RSS, read
  again whenever room is planned): the estimate is the operator's bound, the measurement catches a
  model that outgrows it.
- A model whose estimate exceeds the whole budget is refused at once (RESOURCE_EXHAUSTED with the
  numbers) instead of evicting everything for nothing.
- With a ``guard`` (``load_guard.py``), a cold load first passes its checks (a remembered failure,
  then the model's files) before anything is evicted: a broken model fails fast and evicts
  nothing; a load that fails later is remembered too. ``load(key)`` (an explicit LoadModel) clears
  the memory first: it is the operator's retry.
- ``unload(key, timeout, drain_seconds)`` drains first: the requests in flight finish, then the
  model is closed. The drain waits at most ``drain_seconds`` (default: the manager's
  ``drain_seconds``), and never past the call's ``timeout``; past it the model serves on and the
  unload fails FAILED_PRECONDITION naming the bound. A request that arrives during a drain is not
  held: it fails UNAVAILABLE at once with a retry hint (the drain's time left), so a router can
  send it elsewhere and a client knows when to come back. A model that reports its work left
  (``remaining_tokens()``) is judged as it drains (``drain_estimate.py``): a drain that cannot end
  in its bound is given up early, with the numbers.
"""
from __future__ import annotations

import enum
import logging
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, NamedTuple, Protocol

from services.common.errors import FailedPrecondition, ResourceExhausted, ServiceError, Unavailable
from services.engine.models.drain_estimate import DrainProgress
from services.engine.models.load_guard import LoadGuard
from services.engine.models.observer import LoadObserver
from services.engine.models.store import ModelEntry, ModelStore

log = logging.getLogger("llmserve.engine.models")

LOAD_WAIT_LIMIT = 900.0   # a request without a deadline waits at most this long for someone else's load


class LoadedModel(Protocol):
    def memory_bytes(self) -> int:
        """Memory the loaded model holds now (measured)."""

    def close(self) -> None:
        """Release everything (end the worker process); called once, with no request in flight."""


Loader = Callable[[ModelEntry], LoadedModel]


class SlotState(enum.Enum):
    LOADING = "loading"
    LOADED = "loaded"
    DRAINING = "draining"      # unload requested: waits for in-flight requests, admits none
    UNLOADING = "unloading"    # being closed; its memory counts until it is gone


@dataclass
class _Slot:
    entry: ModelEntry
    state: SlotState
    memory_bytes: int                    # the reservation while loading, then measured
    model: LoadedModel | None = None
    in_flight: int = 0
    last_use_tick: int = 0               # LRU order (a counter: no clock ties)
    last_used_unix_ms: int = 0
    load_seconds: float = 0.0
    error: ServiceError | None = None


def _charge(slot: _Slot) -> int:
    """What a model counts against the budget."""
    return max(slot.memory_bytes, slot.entry.memory_estimate_bytes)


class Lease(NamedTuple):
    entry: ModelEntry
    model: LoadedModel
    load_seconds: float                  # the cold start this request caused or waited for; 0 when warm


class LoadResult(NamedTuple):
    entry: ModelEntry
    was_loaded: bool
    load_seconds: float
    evicted: list[str]


class UnloadResult(NamedTuple):
    entry: ModelEntry
    was_loaded: bool
    freed_bytes: int


@dataclass(frozen=True)
class ModelStatus:
    entry: ModelEntry
    loaded: bool
    memory_bytes: int                    # measured when loaded, else the estimate
    last_used_unix_ms: int
    load_seconds: float
    in_flight: int


@dataclass
class ModelManager:
    store: ModelStore
    loader: Loader
    budget_bytes: int
    max_loaded: int
    wait_seconds: float = 30.0           # longest a request waits for room (busy models)
    drain_seconds: float = 30.0          # longest an unload waits for the requests in flight, unless it says
    clock: Callable[[], float] = time.monotonic
    metrics: LoadObserver | None = None  # loads, evictions, load seconds (None = not recorded)
    guard: LoadGuard | None = None       # checks before a cold load evicts anything (None = no checks)
    _cond: threading.Condition = field(default_factory=threading.Condition, init=False)
    _slots: dict[str, _Slot] = field(default_factory=dict, init=False)   # entry id → slot
    _tick: int = field(default=0, init=False)
    # Last use of models no longer loaded, kept so ListModels still shows it after an unload.
    _last_used: dict[str, int] = field(default_factory=dict, init=False)
    _drain_ends: dict[str, float] = field(default_factory=dict, init=False)   # entry id → when its drain gives up

    # -- requests ---------------------------------------------------------------------------

    @contextmanager
    def use(self, key: str, timeout: float | None = None) -> Iterator[Lease]:
        """The model named ``key`` (id or name; empty = default), loaded and held for the block."""
        slot, load_seconds, _ = self._acquire(self.store.get(key), timeout)
        try:
            assert slot.model is not None
            yield Lease(slot.entry, slot.model, load_seconds)
        finally:
            self._release(slot)

    def load(self, key: str, timeout: float | None = None) -> LoadResult:
        entry = self.store.get(key)
        if self.guard is not None:
            self.guard.clear(entry)  # an explicit load is the operator's retry: try it now
        with self._cond:
            slot = self._slots.get(entry.id)
            was_loaded = slot is not None and slot.state is SlotState.LOADED
        slot, load_seconds, evicted = self._acquire(entry, timeout)
        self._release(slot)
        return LoadResult(entry, was_loaded, load_seconds, evicted)

    def unload(self, key: str, timeout: float | None = None, drain_seconds: float | None = None) -> UnloadResult:
        entry = self.store.get(key)
        bound = self.drain_seconds if drain_seconds is None else drain_seconds
        if timeout is not None:
            bound = min(bound, timeout)
        deadline = self.clock() + bound
        with self._cond:
            slot = self._slots.get(entry.id)
            if slot is None or slot.state is not SlotState.LOADED:
                return UnloadResult(entry, False, 0)
            slot.state = SlotState.DRAINING
            self._drain_ends[entry.id] = deadline
            progress = DrainProgress(bound, clock=self.clock)
            work = getattr(slot.model, "remaining_tokens", None)   # generation models report their work left
            try:
                while slot.in_flight > 0:
                    left = deadline - self.clock()
                    hopeless = progress.hopeless(work() if work is not None else None, left)
                    if left <= 0 or hopeless:
                        slot.state = SlotState.LOADED
                        raise FailedPrecondition(
                            f"model {entry.name} still has {slot.in_flight} request(s) in flight "
                            + (f"and cannot drain in time: {hopeless}" if hopeless and left > 0 else
                               f"after the drain's bound of {bound:.1f}s")
                            + "; it keeps serving. Retry the unload when they finish, or with a longer "
                              "drain_timeout_ms")
                    self._cond.wait(min(left, 0.25))
                slot.state = SlotState.UNLOADING
            finally:
                del self._drain_ends[entry.id]
                self._cond.notify_all()
        freed = self._close(slot)
        return UnloadResult(entry, True, freed)

    def close_all(self) -> None:
        with self._cond:
            slots = [s for s in self._slots.values() if s.state is not SlotState.LOADING]
            for s in slots:
                s.state = SlotState.UNLOADING
        for s in slots:
            self._close(s)

    # -- views ------------------------------------------------------------------------------

    def snapshot(self) -> list[ModelStatus]:
        with self._cond:
            self._measure()
            slots = dict(self._slots)
        out = []
        for entry in self.store.entries:
            slot = slots.get(entry.id)
            loaded = slot is not None and slot.model is not None and slot.state is not SlotState.UNLOADING
            out.append(ModelStatus(
                entry=entry, loaded=loaded,
                memory_bytes=slot.memory_bytes if loaded and slot is not None else entry.memory_estimate_bytes,
                last_used_unix_ms=slot.last_used_unix_ms if slot is not None else self._last_used.get(entry.id, 0),
                load_seconds=slot.load_seconds if slot is not None else 0.0,
                in_flight=slot.in_flight if slot is not None else 0))
        return out

    def loaded(self) -> list[tuple[ModelEntry, LoadedModel]]:
        with self._cond:
            return [(s.entry, s.model) for s in self._slots.values()
                    if s.model is not None and s.state in (SlotState.LOADED, SlotState.DRAINING)]

    def used_bytes(self) -> int:
        """Memory the models' workers hold now (measured): loaded ones, and evicted ones until they are
        gone. A load's reservation is not memory in use (see ``reserved_bytes``): counting both while
        an evicted worker closes read above the budget (2,865 MB against 2,200, issue 19)."""
        with self._cond:
            self._measure()
            return sum(s.memory_bytes for s in self._slots.values() if s.state is not SlotState.LOADING)

    def reserved_bytes(self) -> int:
        """The estimates reserved for loads in progress (their workers are not measured yet)."""
        with self._cond:
            return sum(s.memory_bytes for s in self._slots.values() if s.state is SlotState.LOADING)

    def check_invariants(self) -> None:
        with self._cond:
            loading = [s for s in self._slots.values() if s.state is SlotState.LOADING]
            settled = [s for s in self._slots.values() if s.state is not SlotState.LOADING]
            assert all(s.model is None for s in loading)
            assert all(s.model is not None for s in settled)
            assert all(s.in_flight >= 0 for s in self._slots.values())
            assert all(s.in_flight == 0 for s in self._slots.values() if s.state is SlotState.UNLOADING)
            assert len([s for s in self._slots.values() if s.state is not SlotState.UNLOADING]) <= self.max_loaded

    # -- internals --------------------------------------------------------------------------

    def _acquire(self, entry: ModelEntry, timeout: float | None) -> tuple[_Slot, float, list[str]]:
        if entry.memory_estimate_bytes > self.budget_bytes:
            raise ResourceExhausted(
                f"model {entry.name} needs about {entry.memory_estimate_bytes / 2**20:.0f} MiB, more than the whole "
                f"model memory budget of {self.budget_bytes / 2**20:.0f} MiB; raise --memory-budget-mb")
        if self.guard is not None:
            with self._cond:
                cold = entry.id not in self._slots
            if cold:
                self.guard.check(entry)  # before any eviction: a model that cannot load evicts nothing
        now = self.clock()
        # Waiting for a load in progress is bounded only by the call's deadline (a cold start takes what
        # it takes); waiting for busy models to make room is bounded by wait_seconds too.
        call_deadline = now + (LOAD_WAIT_LIMIT if timeout is None else timeout)
        room_deadline = min(call_deadline, now + self.wait_seconds)
        waited_for: _Slot | None = None
        with self._cond:
            while True:
                slot = self._slots.get(entry.id)
                if waited_for is not None and waited_for.error is not None and slot is None:
                    raise waited_for.error  # the shared load failed: every waiter gets its error
                if slot is not None and slot.state is SlotState.LOADED:
                    self._touch(slot)
                    slot.in_flight += 1
                    return slot, (slot.load_seconds if waited_for is slot else 0.0), []
                if slot is None:
                    victims = self._plan_room(entry)
                    if victims is not None:
                        break
                    left = room_deadline - self.clock()
                    why = self._busy_reason()
                elif slot.state is SlotState.DRAINING:
                    # Never held in silence behind an unload: say so now, and when to come back.
                    left = max(0.0, self._drain_ends.get(entry.id, self.clock()) - self.clock())
                    raise Unavailable(f"model {entry.name} is being unloaded (draining its requests in flight, "
                                      f"at most {left:.1f}s more); retry then, or on another engine",
                                      retry_after_ms=max(100, int(left * 1000)))
                else:
                    waited_for = slot if slot.state is SlotState.LOADING else waited_for
                    left = (call_deadline if slot.state is SlotState.LOADING else room_deadline) - self.clock()
                    why = f"model {entry.name} to finish {slot.state.value}"
                if left <= 0:
                    raise ResourceExhausted(f"cannot serve model {entry.name} now: gave up waiting for {why}; "
                                            "retry later or raise --memory-budget-mb")
                self._cond.wait(min(left, 1.0))
            for v in victims:
                v.state = SlotState.UNLOADING
            slot = _Slot(entry, SlotState.LOADING, entry.memory_estimate_bytes)
            self._slots[entry.id] = slot
        evicted = []
        started = self.clock()
        try:
            for v in victims:
                log.info("evicting idle model %s (least recently used) to make room for %s", v.entry.name, entry.name)
                self._close(v)
                evicted.append(v.entry.name)
                if self.metrics is not None:
                    self.metrics.on_evicted(v.entry.name)  # metrics
            started = self.clock()
            model = self.loader(entry)
        except BaseException as exc:
            # Whatever happened, the reservation goes and every waiter hears about it.
            error = exc if isinstance(exc, ServiceError) else FailedPrecondition(
                f"model {entry.name} could not be loaded: {exc}")
            with self._cond:
                slot.error = error
                del self._slots[entry.id]
                self._cond.notify_all()
            log.error("loading %s failed: %s", entry.name, error.message)
            if not isinstance(exc, Exception):
                raise  # KeyboardInterrupt and the like stay what they are
            if self.guard is not None:
                self.guard.failed(entry, error)
            raise error from None
        with self._cond:
            slot.model = model
            slot.load_seconds = self.clock() - started
            slot.memory_bytes = model.memory_bytes()
            slot.state = SlotState.LOADED
            self._touch(slot)
            slot.in_flight += 1
            self._cond.notify_all()
            over = self._over_budget(slot)
        for v in over:
            log.warning("model %s measures %.0f MiB, above its estimate of %.0f MiB: evicting idle model %s to stay "
                        "within the budget (raise its memory_estimate_mb)", entry.name, slot.memory_bytes / 2**20,
                        entry.memory_estimate_bytes / 2**20, v.entry.name)
            self._close(v)
            evicted.append(v.entry.name)
            if self.metrics is not None:
                self.metrics.on_evicted(v.entry.name)  # metrics
        if self.metrics is not None:
            self.metrics.on_loaded(entry.name, slot.load_seconds)  # metrics
        log.info("loaded model %s (%s) in %.2fs, %.0f MiB; %.0f of %.0f MiB used", entry.name, entry.task,
                 slot.load_seconds, slot.memory_bytes / 2**20, self.used_bytes() / 2**20, self.budget_bytes / 2**20)
        return slot, slot.load_seconds, evicted

    def _plan_room(self, entry: ModelEntry) -> list[_Slot] | None:
        """Idle models to evict (LRU first) so ``entry`` fits; None when it cannot fit without waiting."""
        self._measure()
        used = sum(_charge(s) for s in self._slots.values())
        count = len([s for s in self._slots.values() if s.state is not SlotState.UNLOADING])
        idle = sorted((s for s in self._slots.values() if s.state is SlotState.LOADED and s.in_flight == 0),
                      key=lambda s: s.last_use_tick)
        victims: list[_Slot] = []
        while used + entry.memory_estimate_bytes > self.budget_bytes or count >= self.max_loaded:
            if not idle:
                return None
            victim = idle.pop(0)
            victims.append(victim)
            used -= _charge(victim)
            count -= 1
        return victims

    def _over_budget(self, loaded: _Slot) -> list[_Slot]:
        """After a load measured more than its estimate: idle models to evict (LRU first, never ``loaded``)
        so the charges fit the budget again; marked UNLOADING here, closed by the caller."""
        used = sum(_charge(s) for s in self._slots.values())
        idle = sorted((s for s in self._slots.values() if s is not loaded and s.state is SlotState.LOADED
                       and s.in_flight == 0), key=lambda s: s.last_use_tick)
        victims = []
        while used > self.budget_bytes and idle:
            victim = idle.pop(0)
            victim.state = SlotState.UNLOADING
            victims.append(victim)
            used -= _charge(victim)
        return victims

    def _measure(self) -> None:
        # A worker's RSS grows as it serves (allocator pools, touched KV pages): budget on the current figure.
        for s in self._slots.values():
            if s.state is SlotState.LOADED and s.model is not None:
                s.memory_bytes = s.model.memory_bytes() or s.memory_bytes

    def _busy_reason(self) -> str:
        busy = [f"{s.entry.name} ({s.state.value}, {s.in_flight} in flight)" for s in self._slots.values()
                if s.state is not SlotState.LOADED or s.in_flight > 0]
        return "room: models in use cannot be evicted: " + ", ".join(busy)

    def _touch(self, slot: _Slot) -> None:
        self._tick += 1
        slot.last_use_tick = self._tick
        slot.last_used_unix_ms = int(time.time() * 1000)

    def _release(self, slot: _Slot) -> None:
        with self._cond:
            slot.in_flight -= 1
            self._touch(slot)  # a request that just ended counts as the latest use (long streams included)
            self._cond.notify_all()

    def _close(self, slot: _Slot) -> int:
        """Close an UNLOADING slot's model (outside the lock: it ends a process) and forget the slot."""
        freed = slot.memory_bytes
        try:
            assert slot.model is not None
            freed = max(freed, slot.model.memory_bytes())
            slot.model.close()
        finally:
            with self._cond:
                self._last_used[slot.entry.id] = slot.last_used_unix_ms
                if self._slots.get(slot.entry.id) is slot:
                    del self._slots[slot.entry.id]
                self._cond.notify_all()
        log.info("unloaded model %s (%.0f MiB freed)", slot.entry.name, freed / 2**20)
        return freed
