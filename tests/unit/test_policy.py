"""The two-level routing policy (pure): cluster choice, model placement, load, bounded prefix affinity."""
from __future__ import annotations

from collections import Counter

from services.router.policy import EngineView, PolicyConfig, choose_cluster, load, prefix_hash_order, rank

ORDER = ["dc1", "dc2", "dc3"]


def engine(key: str, cluster: str = "dc1", running: int = 0, waiting: int = 0, **kw) -> EngineView:
    return EngineView(key, cluster, num_running=running, num_waiting=waiting, capacity=8, **kw)


def test_local_cluster_first_then_spill_in_configured_order():
    engines = [engine("a", "dc1", running=2), engine("b", "dc2"), engine("c", "dc3")]
    assert choose_cluster(engines, "", ORDER) == "dc1"
    overloaded = [engine("a", "dc1", running=8, waiting=4), engine("c", "dc3"), engine("b", "dc2")]
    assert choose_cluster(overloaded, "", ORDER) == "dc2"
    assert [e.key for e in rank(overloaded, "", "", ORDER)] == ["b", "c", "a"]


def test_every_cluster_overloaded_picks_the_least_loaded():
    engines = [engine("a", "dc1", running=8, waiting=8), engine("b", "dc2", running=8, waiting=2)]
    assert choose_cluster(engines, "", ORDER) == "dc2"


def test_cluster_without_an_engine_for_the_model_is_skipped():
    engines = [engine("a", "dc1", models=frozenset({"m1"})), engine("b", "dc2", models=frozenset({"m2"}))]
    assert [e.key for e in rank(engines, "m2", "", ORDER)] == ["b"]
    assert rank(engines, "m3", "", ORDER) == []
    # an engine that has not said what it serves is asked anyway (it answers NOT_FOUND itself)
    assert [e.key for e in rank([engine("x")], "m3", "", ORDER)] == ["x"]


def test_loaded_model_first_then_lowest_load():
    engines = [engine("cold", models=frozenset({"m"}), loaded=frozenset({"other"})),
               engine("warm-busy", running=3, models=frozenset({"m"}), loaded=frozenset({"m"})),
               engine("warm-idle", running=1, models=frozenset({"m"}), loaded=frozenset({"m"}))]
    assert [e.key for e in rank(engines, "m", "", ORDER)] == ["warm-idle", "warm-busy", "cold"]


def test_in_flight_bounds_a_stale_report_from_below():
    assert load(engine("a", in_flight=4)) > load(engine("b", running=1))


def test_prefix_affinity_is_stable_and_bounded_by_load():
    engines = [engine(f"e{i}") for i in range(8)]
    home = prefix_hash_order("system prompt", engines)[0]
    assert rank(engines, "", "system prompt", ORDER)[0].key == home.key
    assert rank(list(reversed(engines)), "", "system prompt", ORDER)[0].key == home.key
    busy = [engine(e.key, running=4) if e.key == home.key else e for e in engines]
    assert rank(busy, "", "system prompt", ORDER)[0].key != home.key  # over the slack: goes elsewhere
    off = PolicyConfig(use_affinity=False)
    assert rank(engines, "", "system prompt", ORDER, off)[0].key == "e0"


def test_a_shared_prefix_spreads_over_engines_as_load_grows():
    running = Counter()
    for _ in range(32):
        views = [engine(f"e{i}", running=running[f"e{i}"]) for i in range(8)]
        running[rank(views, "", "the same system prompt", ORDER)[0].key] += 1
    assert max(running.values()) - min(running.values()) <= 3  # slack 0.25 of capacity 8 = 2 sequences
    assert len(running) == 8
