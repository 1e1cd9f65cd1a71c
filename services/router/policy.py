"""Two-level routing policy: pick a cluster, then an engine in it. Pure functions, no I/O.

1. **Cluster.** Clusters (Consul datacenters) are tried in the configured order, the local one
   first. A cluster is used when it has an engine that serves the model and it is not
   overloaded (its least-loaded such engine is below ``spill_load``); when every cluster is
   overloaded, the one with the least-loaded engine wins (ties: configured order).
2. **Engine.** Inside the cluster: engines that are not overloaded and have the model loaded
   come first, then the lowest load. Prefix affinity: requests whose prompts share a prefix go
   to the same engine (rendezvous hashing of the prefix, so every router replica agrees and an
   engine joining or leaving moves only its share), so its prefix cache is warm, but only while
   that engine's load is within ``affinity_slack`` of the least-loaded candidate: a shared system
   prompt spreads over as many engines as the load needs instead of piling onto one.

``rank`` returns every usable engine, best first; the router tries them in that order when one
fails (the rest of the chosen cluster first, then the other clusters: those with room in the
configured order, then the overloaded ones).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterable, Sequence

DEFAULT_CAPACITY = 64           # sequences per step when an engine has not said (its default max_num_seqs)


@dataclass(frozen=True)
class EngineView:
    """What the router knows about one engine when it routes a request."""

    key: str                                 # address; also the identity for hashing
    cluster: str = ""
    models: frozenset[str] = frozenset()     # names/ids it can serve; empty = unknown, ask it anyway
    loaded: frozenset[str] = frozenset()     # models loaded now
    num_waiting: int = 0                     # reported by the engine (WatchLoad)
    num_running: int = 0
    kv_usage: float = 0.0                    # KV blocks used / total, 0..1
    capacity: int = 0                        # max_num_seqs; 0 = unknown
    in_flight: int = 0                       # this router's calls to it not finished yet
    max_queue: int = 0                       # most sequences the engine lets wait; 0 = unknown
    retry_after_ms: int = 0                  # the engine's retry hint for a refused request


def is_full(e: EngineView) -> bool:
    """The engine's queue is at its bound: a request sent now would be refused (RESOURCE_EXHAUSTED).
    Busy, not down: it is skipped, not marked down, and it is full only while its report says so."""
    return e.max_queue > 0 and e.num_waiting >= e.max_queue


@dataclass(frozen=True)
class PolicyConfig:
    spill_load: float = 1.0          # load at which an engine counts as overloaded (1.0 = a full batch)
    affinity_slack: float = 0.25     # affinity may pick an engine this much more loaded than the best
    use_affinity: bool = True


def load(e: EngineView) -> float:
    """Load as a fraction of the engine's batch: queued work counts double (it waits for everyone),
    KV pressure adds up to half a batch. The router's own in-flight calls bound it from below, since
    the engine's report lags behind calls this router just sent."""
    cap = e.capacity or DEFAULT_CAPACITY
    queued = max(e.num_waiting + e.num_running, e.in_flight)
    return (queued + e.num_waiting) / cap + 0.5 * e.kv_usage


def serves(e: EngineView, model: str) -> bool:
    return not model or not e.models or model in e.models


def has_loaded(e: EngineView, model: str) -> bool:
    return not model or not e.loaded or model in e.loaded


def prefix_hash_order(prefix: str, engines: Iterable[EngineView]) -> list[EngineView]:
    """Rendezvous (highest-random-weight) order of engines for a prefix; stable across processes."""
    def weight(e: EngineView) -> bytes:
        return hashlib.blake2b(f"{prefix}\x00{e.key}".encode(), digest_size=8).digest()
    return sorted(engines, key=weight, reverse=True)


def _cluster_loads(engines: Sequence[EngineView], model: str) -> dict[str, float]:
    """Each cluster's least-loaded engine that serves ``model``: how much room the cluster has."""
    best: dict[str, float] = {}
    for e in engines:
        if serves(e, model):
            best[e.cluster] = min(best.get(e.cluster, float("inf")), load(e))
    return best


def _known_order(best: dict[str, float], cluster_order: Sequence[str]) -> list[str]:
    return [c for c in cluster_order if c in best] + sorted(c for c in best if c not in cluster_order)


def choose_cluster(engines: Sequence[EngineView], model: str, cluster_order: Sequence[str],
                   config: PolicyConfig = PolicyConfig()) -> str | None:
    best = _cluster_loads(engines, model)
    order = _known_order(best, cluster_order)
    for cluster in order:
        if best[cluster] < config.spill_load:
            return cluster
    return min(order, key=lambda c: (best[c], order.index(c)), default=None)


def rank_in_cluster(engines: Sequence[EngineView], model: str, prefix: str,
                    config: PolicyConfig = PolicyConfig()) -> list[EngineView]:
    def key(e: EngineView) -> tuple[bool, bool, float, str]:
        return (load(e) >= config.spill_load, not has_loaded(e, model), load(e), e.key)

    ordered = sorted(engines, key=key)
    if not ordered or not prefix or not config.use_affinity:
        return ordered
    head = key(ordered[0])
    # Affinity chooses among the engines in the best tier (same overload and loaded-model class).
    tier = [e for e in ordered if key(e)[:2] == head[:2]]
    bound = head[2] + config.affinity_slack
    for e in prefix_hash_order(prefix, tier):
        if load(e) <= bound:
            return [e, *(o for o in ordered if o is not e)]
    return ordered


def rank(engines: Sequence[EngineView], model: str, prefix: str, cluster_order: Sequence[str],
         config: PolicyConfig = PolicyConfig()) -> list[EngineView]:
    """Every engine that serves ``model``, best first: the chosen cluster's, then the others by cluster order."""
    usable = [e for e in engines if serves(e, model)]
    first = choose_cluster(usable, model, cluster_order, config)
    if first is None:
        return []
    best = _cluster_loads(usable, model)
    known = _known_order(best, cluster_order)
    # After the chosen one: clusters with room in configured order, then the overloaded ones.
    clusters = [first] + sorted((c for c in known if c != first),
                                key=lambda c: (best[c] >= config.spill_load, known.index(c)))
    out: list[EngineView] = []
    for cluster in clusters:
        out.extend(rank_in_cluster([e for e in usable if e.cluster == cluster], model, prefix, config))
    return out


def prefix_key(text: str, num_chars: int) -> str:
    """The part of a prompt that selects the engine: its first ``num_chars`` characters."""
    return text[:num_chars]
