"""GetLoad sums the loaded generation models; the prefix-cache hit rate is weighted by tokens."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

from services.engine.api.servicers import EngineAdminServicer
from services.engine.core.engine import EngineLoad
from services.engine.models.runtime import GenerationRuntime
from services.engine.models.store import ModelEntry


@dataclass
class FakeEngine:
    queried: int
    hits: int

    def load(self) -> EngineLoad:
        return EngineLoad(num_waiting=1, num_running=2, num_kv_blocks_total=10, num_kv_blocks_used=3,
                          num_finished=4, num_preemptions=0, worker_restarts=0,
                          num_prefix_query_tokens=self.queried, num_prefix_hit_tokens=self.hits, num_cached_blocks=1)


class FakeModels:
    budget_bytes = 1000

    def __init__(self, runtimes: list[GenerationRuntime]):
        self.runtimes = runtimes

    def used_bytes(self) -> int:
        return 10

    def reserved_bytes(self) -> int:
        return 0

    def loaded(self) -> list[tuple[ModelEntry, object]]:
        return [(rt.entry, rt) for rt in self.runtimes]


def runtime(name: str, queried: int, hits: int) -> GenerationRuntime:
    entry = ModelEntry(id=name, name=name, task="text-generation", format="safetensors", source=name,
                       dtype="float32", context_length=512, memory_estimate_bytes=0)
    return GenerationRuntime(entry, steps=None, engine=FakeEngine(queried, hits), tokenizer=None, limits=None)  # type: ignore[arg-type]


def get_load(models: FakeModels):
    async def call():
        return await EngineAdminServicer(models, blocking=None, location="here").GetLoad(None, None)  # type: ignore[arg-type]
    return asyncio.run(call())


def test_the_hit_rate_is_the_share_of_all_looked_up_tokens_found_cached():
    # A busy model with a cold cache and an idle one with a warm cache: 100 of 1010 tokens hit.
    load = get_load(FakeModels([runtime("busy", 1000, 90), runtime("idle", 10, 10)]))
    assert abs(load.prefix_cache_hit_rate - 100 / 1010) < 1e-6
    assert (load.num_running, load.num_kv_blocks_total, list(load.loaded_models)) == (4, 20, ["busy", "idle"])


def test_no_lookups_is_a_zero_rate():
    assert get_load(FakeModels([runtime("fresh", 0, 0)])).prefix_cache_hit_rate == 0.0
    assert get_load(FakeModels([])).prefix_cache_hit_rate == 0.0
