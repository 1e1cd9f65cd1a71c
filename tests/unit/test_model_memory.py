"""What the model manager reports as memory in use, and that it keeps to its budget (issue 19:
GetLoad read 2,865 MB against a 2,200 MB budget while a model was swapped for another)."""
from __future__ import annotations

import threading

from services.engine.models.manager import ModelManager
from services.engine.models.store import ModelEntry, ModelStore
from tests.unit.test_model_manager import FakeModel, entry, use

MiB = 2**20


class SlowClose(FakeModel):
    """A model whose close (the worker's exit) takes until ``gate`` opens."""

    def __init__(self, e: ModelEntry, log: list[str], closing: threading.Event, gate: threading.Event):
        super().__init__(e, log)
        self.closing, self.gate = closing, gate

    def close(self) -> None:
        self.closing.set()
        self.gate.wait(10)
        super().close()


def test_memory_in_use_never_counts_an_evicted_worker_and_the_new_reservation_together():
    closing, gate = threading.Event(), threading.Event()
    log: list[str] = []
    a, b = entry("a", 600), entry("b", 600)
    m = ModelManager(ModelStore([a, b], "a"), lambda e: SlowClose(e, log, closing, gate), 1000 * MiB, 8)
    use(m, "a")
    loader = threading.Thread(target=lambda: use(m, "b"))
    loader.start()
    assert closing.wait(10), "a was never evicted"
    during = (m.used_bytes(), m.reserved_bytes())  # a is closing (its worker still there), b reserved
    gate.set()
    loader.join(10)
    assert during == (600 * MiB, 600 * MiB)
    assert m.used_bytes() == 600 * MiB and m.reserved_bytes() == 0  # b, measured
    m.check_invariants()


class Outgrown(FakeModel):
    """Measures more than its entry's estimate once loaded."""

    def memory_bytes(self) -> int:
        return 0 if self.closed else 900 * MiB


def test_a_model_that_outgrows_its_estimate_evicts_idle_ones_to_stay_within_the_budget():
    log: list[str] = []
    small, big = entry("small", 300), entry("big", 600)
    m = ModelManager(ModelStore([small, big], "small"),
                     lambda e: (log.append(f"load {e.name}"), (Outgrown if e is big else FakeModel)(e, log))[1],
                     1000 * MiB, 8)
    use(m, "small")
    result = m.load("big")  # 300 + 600 fits the plan; then big measures 900
    assert result.evicted == ["small"] and log == ["load small", "load big", "close small"]
    assert m.used_bytes() == 900 * MiB <= m.budget_bytes
    m.check_invariants()
