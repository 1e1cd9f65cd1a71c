"""The model manager's LRU order and budget accounting, with fake models (no processes)."""
from __future__ import annotations

import threading

import pytest

from services.common.errors import FailedPrecondition, NotFound, ResourceExhausted
from services.engine.models.manager import ModelManager
from services.engine.models.store import ModelEntry, ModelStore, model_id_for

MiB = 2**20


class FakeModel:
    def __init__(self, entry: ModelEntry, log: list[str]):
        self.entry, self.log, self.closed = entry, log, False

    def memory_bytes(self) -> int:
        return 0 if self.closed else self.entry.memory_estimate_bytes

    def close(self) -> None:
        self.closed = True
        self.log.append(f"close {self.entry.name}")


def entry(name: str, mb: int, task: str = "text-generation") -> ModelEntry:
    return ModelEntry(id=model_id_for(name), name=name, task=task, format="safetensors", source=f"/m/{name}",
                      dtype="float32", context_length=512, memory_estimate_bytes=mb * MiB)


def manager(sizes: dict[str, int], budget_mb: int, max_loaded: int = 8, loader=None, wait: float = 5.0):
    entries = [entry(n, mb) for n, mb in sizes.items()]
    log: list[str] = []

    def load(e: ModelEntry) -> FakeModel:
        log.append(f"load {e.name}")
        return FakeModel(e, log)

    return ModelManager(ModelStore(entries, entries[0].name), loader or load, budget_mb * MiB, max_loaded,
                        wait_seconds=wait), log


def use(m: ModelManager, key: str) -> None:
    with m.use(key):
        pass


def test_load_on_miss_then_warm():
    m, log = manager({"a": 100, "b": 100}, 1000)
    with m.use("a") as lease:
        assert lease.entry.name == "a" and lease.load_seconds >= 0
    with m.use("a") as lease:
        assert lease.load_seconds == 0.0  # warm
    assert log == ["load a"]
    m.check_invariants()


def test_lookup_by_id_name_and_default():
    m, log = manager({"a": 100, "b": 100}, 1000)
    use(m, model_id_for("b"))
    use(m, "b")
    use(m, "")  # the default model: the first entry here
    assert log == ["load b", "load a"]
    with pytest.raises(NotFound, match="ListModels"):
        use(m, "nope")


def test_least_recently_used_idle_model_is_evicted_first():
    m, log = manager({"a": 400, "b": 400, "c": 400}, 1000)
    use(m, "a")
    use(m, "b")
    use(m, "a")          # b is now the least recently used
    use(m, "c")
    assert log == ["load a", "load b", "close b", "load c"]
    assert m.used_bytes() == 800 * MiB
    assert {s.entry.name for s in m.snapshot() if s.loaded} == {"a", "c"}
    m.check_invariants()


def test_evicts_as_many_as_needed_and_respects_the_count():
    m, log = manager({"a": 300, "b": 300, "c": 300, "big": 800}, 1000)
    for name in ("a", "b", "c"):
        use(m, name)
    use(m, "big")
    assert log[-4:] == ["close a", "close b", "close c", "load big"]
    m2, log2 = manager({"a": 1, "b": 1, "c": 1}, 1000, max_loaded=2)
    for name in ("a", "b", "c"):
        use(m2, name)
    assert log2 == ["load a", "load b", "close a", "load c"]
    m2.check_invariants()


def test_a_model_in_use_is_never_evicted():
    m, log = manager({"a": 600, "b": 600}, 1000, wait=0.3)
    with m.use("a"):
        with pytest.raises(ResourceExhausted, match="in use"):
            use(m, "b")
        assert log == ["load a"]
    use(m, "b")  # a is idle now: evicted
    assert log == ["load a", "close a", "load b"]


def test_a_load_waits_for_a_busy_model_to_finish():
    m, log = manager({"a": 600, "b": 600}, 1000, wait=10)
    holding = threading.Event()
    release = threading.Event()

    def hold_a() -> None:
        with m.use("a"):
            holding.set()
            release.wait(10)

    t = threading.Thread(target=hold_a)
    t.start()
    assert holding.wait(10), "the first request never got its model"
    threading.Timer(0.2, release.set).start()
    use(m, "b")
    t.join()
    assert log == ["load a", "close a", "load b"]


def test_a_model_larger_than_the_budget_is_refused_without_evicting():
    m, log = manager({"a": 100, "huge": 5000}, 1000)
    use(m, "a")
    with pytest.raises(ResourceExhausted, match="5000 MiB.*1000 MiB"):
        use(m, "huge")
    assert log == ["load a"]


def test_concurrent_cold_requests_share_one_load():
    gate = threading.Event()
    loads = []

    def slow_load(e: ModelEntry) -> FakeModel:
        loads.append(e.name)
        gate.wait(10)
        return FakeModel(e, [])

    m, _ = manager({"a": 100}, 1000, loader=slow_load)
    results = []
    threads = [threading.Thread(target=lambda: results.append(m.load("a"))) for _ in range(4)]
    for t in threads:
        t.start()
    threading.Timer(0.2, gate.set).start()
    for t in threads:
        t.join(10)
    assert loads == ["a"] and len(results) == 4
    assert all(r.load_seconds > 0 for r in results)  # each waited for the one cold start
    m.check_invariants()


def test_a_failed_load_fails_every_waiter_and_leaves_nothing_behind():
    gate = threading.Event()

    def broken(e: ModelEntry) -> FakeModel:
        gate.wait(10)
        raise FileNotFoundError(f"model file missing: /m/{e.name}")

    m, _ = manager({"a": 100}, 1000, loader=broken)
    errors = []

    def call() -> None:
        try:
            use(m, "a")
        except FailedPrecondition as exc:
            errors.append(exc.message)

    threads = [threading.Thread(target=call) for _ in range(3)]
    for t in threads:
        t.start()
    threading.Timer(0.2, gate.set).start()
    for t in threads:
        t.join(10)
    assert len(errors) == 3 and all("/m/a" in e for e in errors)
    assert m.used_bytes() == 0 and not any(s.loaded for s in m.snapshot())


def test_unload_drains_then_frees_and_keeps_last_use():
    m, log = manager({"a": 100}, 1000)
    use(m, "a")
    with m.use("a"):
        with pytest.raises(FailedPrecondition, match="in flight"):
            m.unload("a", timeout=0.2)
    result = m.unload("a")
    assert result.was_loaded and result.freed_bytes == 100 * MiB
    assert m.used_bytes() == 0 and log == ["load a", "close a"]
    status = m.snapshot()[0]
    assert not status.loaded and status.last_used_unix_ms > 0
    assert not m.unload("a").was_loaded
    m.check_invariants()
