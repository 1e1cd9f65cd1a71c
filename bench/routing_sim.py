"""Routing simulation: the router's policy vs round-robin vs pure least-load, in seconds, no model.

    python -m bench.routing_sim [--requests N] [--rate R] [--seed S]

A discrete-event simulation of 64 engines in 4 datacenters (16 each). Each engine runs up to
``SLOTS`` sequences at once and queues the rest (FIFO); engines differ in speed (synthetic
background load: 0.7-1.3x). Requests arrive as a Poisson stream, 40% of them in dc1 and 20% in
each other datacenter (the local datacenter is where a request arrives). Every prompt starts with
one of 48 shared system prompts (Zipf popularity) followed by a unique user part. A request whose
system prompt is in its engine's prefix cache (LRU of 4 prefixes per engine) skips that prefill.

Measured per policy: requests per engine (max / mean), p99 queueing delay (arrival → a slot),
the worst datacenter's max / mean (balance inside a datacenter), prefix-cache hit rate, and the
share served outside the request's own datacenter.

- ``policy``: ``services.router.policy.rank`` itself (two-level, local first, bounded prefix affinity);
- ``round-robin``: every engine in turn, ignoring load, models and datacenters;
- ``least-load``: the engine with the fewest running + waiting sequences anywhere.
"""
from __future__ import annotations

import argparse
import heapq
import random
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable

from services.router import policy

DATACENTERS = ["dc1", "dc2", "dc3", "dc4"]
ENGINES_PER_DC = 16
SLOTS = 8                     # sequences an engine runs at once (its max_num_seqs)
CACHE_PREFIXES = 4            # system prompts an engine's prefix cache holds
NUM_PREFIXES = 48
BASE_SECONDS = 1.0            # mean decode + user-part prefill time of one request
PREFIX_MISS_SECONDS = 0.6     # extra prefill time when the system prompt is not cached
ORIGIN_SHARE = [0.4, 0.2, 0.2, 0.2]


@dataclass
class SimEngine:
    key: str
    cluster: str
    speed: float
    running: int = 0
    queue: deque = field(default_factory=deque)
    cache: OrderedDict = field(default_factory=OrderedDict)
    served: int = 0

    def view(self) -> policy.EngineView:
        return policy.EngineView(self.key, self.cluster, num_running=self.running, num_waiting=len(self.queue),
                                 capacity=SLOTS)


@dataclass
class Request:
    arrival: float
    origin: str
    prefix: int
    work: float


Picker = Callable[[list[SimEngine], Request], SimEngine]


def round_robin() -> Picker:
    counter = iter(range(10**9))
    return lambda engines, req: engines[next(counter) % len(engines)]


def least_load() -> Picker:
    return lambda engines, req: min(engines, key=lambda e: (e.running + len(e.queue), e.key))


def router_policy() -> Picker:
    def pick(engines: list[SimEngine], req: Request) -> SimEngine:
        by_key = {e.key: e for e in engines}
        order = [req.origin] + [d for d in DATACENTERS if d != req.origin]
        best = policy.rank([e.view() for e in engines], "", f"system-prompt-{req.prefix}", order)[0]
        return by_key[best.key]
    return pick


def simulate(picker: Picker, requests: list[Request], seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    engines = [SimEngine(f"{dc}-e{i:02d}", dc, rng.uniform(0.7, 1.3))
               for dc in DATACENTERS for i in range(ENGINES_PER_DC)]
    events: list[tuple[float, int, str, object]] = []
    seq = 0
    for req in requests:
        events.append((req.arrival, seq, "arrive", req))
        seq += 1
    heapq.heapify(events)
    waits: list[float] = []
    hits = remote = 0

    def start(engine: SimEngine, req: Request, now: float) -> None:
        nonlocal seq, hits
        engine.running += 1
        waits.append(now - req.arrival)
        hit = req.prefix in engine.cache
        hits += hit
        engine.cache[req.prefix] = True
        engine.cache.move_to_end(req.prefix)
        while len(engine.cache) > CACHE_PREFIXES:
            engine.cache.popitem(last=False)
        duration = (req.work + (0 if hit else PREFIX_MISS_SECONDS)) / engine.speed
        heapq.heappush(events, (now + duration, seq, "done", engine))
        seq += 1

    while events:
        now, _, kind, item = heapq.heappop(events)
        if kind == "arrive":
            req = item  # type: ignore[assignment]
            engine = picker(engines, req)  # type: ignore[arg-type]
            engine.served += 1
            remote += engine.cluster != req.origin  # type: ignore[union-attr]
            if engine.running < SLOTS:
                start(engine, req, now)  # type: ignore[arg-type]
            else:
                engine.queue.append(req)
        else:
            engine = item  # type: ignore[assignment]
            engine.running -= 1
            if engine.queue:
                start(engine, engine.queue.popleft(), now)
    served = [e.served for e in engines]
    waits.sort()
    in_dc = max(max(e.served for e in engines if e.cluster == dc) / (sum(e.served for e in engines if e.cluster == dc)
                                                                     / ENGINES_PER_DC) for dc in DATACENTERS)
    return {"max_per_engine": max(served), "mean_per_engine": sum(served) / len(served), "in_dc": in_dc,
            "p99_wait": waits[int(0.99 * (len(waits) - 1))], "hit_rate": hits / len(requests),
            "remote": remote / len(requests)}


def workload(n: int, rate: float, seed: int) -> list[Request]:
    rng = random.Random(seed)
    zipf = [1 / (k + 1) for k in range(NUM_PREFIXES)]
    t = 0.0
    out = []
    for _ in range(n):
        t += rng.expovariate(rate)
        origin = rng.choices(DATACENTERS, ORIGIN_SHARE)[0]
        out.append(Request(t, origin, rng.choices(range(NUM_PREFIXES), zipf)[0], rng.expovariate(1 / BASE_SECONDS)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=6000)
    parser.add_argument("--rate", type=float, default=280.0, help="requests per second over the whole fleet")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    requests = workload(args.requests, args.rate, args.seed)
    capacity = len(DATACENTERS) * ENGINES_PER_DC * SLOTS
    print(f"{len(DATACENTERS) * ENGINES_PER_DC} engines in {len(DATACENTERS)} datacenters, {SLOTS} slots each; "
          f"{args.requests} requests at {args.rate:g}/s ({args.rate * (BASE_SECONDS + PREFIX_MISS_SECONDS) / capacity:.0%} "
          f"of capacity if every prefix missed, {args.rate * BASE_SECONDS / capacity:.0%} if every one hit); "
          f"{NUM_PREFIXES} shared system prompts (Zipf), prefix cache {CACHE_PREFIXES} per engine\n")
    print(f"| {'policy':<12} | {'req/engine max':>14} | {'mean':>6} | {'max/mean':>8} | {'p99 queueing':>12} "
          f"| {'max/mean in a dc':>16} | {'prefix hits':>11} | {'off-dc':>6} | {'run time':>8} |")
    print(f"|{'-' * 14}|{'-' * 16}|{'-' * 8}|{'-' * 10}|{'-' * 14}|{'-' * 18}|{'-' * 13}|{'-' * 8}|{'-' * 10}|")
    for name, picker in [("policy", router_policy()), ("round-robin", round_robin()), ("least-load", least_load())]:
        began = time.perf_counter()
        r = simulate(picker, requests, args.seed)
        took = time.perf_counter() - began
        print(f"| {name:<12} | {r['max_per_engine']:>14} | {r['mean_per_engine']:>6.1f} | "
              f"{r['max_per_engine'] / r['mean_per_engine']:>8.2f} | {r['p99_wait']:>10.2f} s | {r['in_dc']:>16.2f} | "
              f"{r['hit_rate']:>10.1%} | {r['remote']:>5.1%} | {took:>6.1f} s |")


if __name__ == "__main__":
    main()
