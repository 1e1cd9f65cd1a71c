"""Constrained decoding in `make bench` (section "constrained"): what a JSON Schema costs.

1. 32 streams where every request carries a JSON Schema against the same 32 streams unconstrained,
   back to back in pairs (BENCH_ROUNDS, the median pair kept). The schema (an array of at least
   200 records) cannot be complete within OUT_TOKENS, so both sides generate the same tokens.
2. Time to first token of one request: unconstrained, with a schema never seen before (compiled in
   the engine, a matcher built in the worker), and with that schema again (cached); medians of
   TTFT_SAMPLES, interleaved.
3. The per-row mask cost: the 32 constrained outputs of (1) replayed in this process through fresh
   llguidance matchers (the worker's code, ``services.worker.constraints``), timing each step's
   mask fill for the 32 rows together (per row) and one row alone; mean and p99 in µs.
"""
from __future__ import annotations

import json
import time
from typing import Any, Callable, Iterator

import llguidance.hf

from bench.load import RunStats, pct, run_streams
from llmserve.v1 import llm_pb2
from services.engine.models.constraints import ConstraintSpec, grammar_of
from services.worker.constraints import Constraints

STREAMS = 32
TTFT_SAMPLES = 15


def record_schema(tag: str = "name") -> dict[str, Any]:
    return {"type": "array", "minItems": 200, "items": {
        "type": "object", "additionalProperties": False, "required": [tag, "age", "city"],
        "properties": {tag: {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                       "city": {"enum": ["Paris", "Rome", "Oslo", "Lima"]}}}}


def rows(stub: Any, prompts: list[str], out_tokens: int, rounds: int, tok: Any) -> list[str]:
    schema = json.dumps(record_schema())
    outputs: list[list[int]] = []   # the constrained outputs of the last run

    def stream(constrained: bool) -> Callable[[str], Iterator[int]]:
        def one(prompt: str) -> Iterator[int]:
            sampling = (llm_pb2.SamplingParams(temperature=0, max_tokens=out_tokens, json_schema=schema) if constrained
                        else llm_pb2.SamplingParams(temperature=0, max_tokens=out_tokens, ignore_eos=True))
            ids: list[int] = []
            for msg in stub.GenerateStream(llm_pb2.GenerateRequest(prompt=prompt, sampling=sampling), timeout=900):
                ids.extend(msg.token_ids)
                yield len(msg.token_ids)
            if constrained:
                outputs.append(ids)
        return one

    batch = prompts[:STREAMS]
    run_streams("warm up", batch[:2], stream(True))
    pairs: list[tuple[float, RunStats, RunStats]] = []
    for i in range(rounds):
        first, second = (True, False) if i % 2 else (False, True)
        outputs.clear()
        a = run_streams("constrained" if first else "free", batch, stream(first))
        b = run_streams("constrained" if second else "free", batch, stream(second))
        free, constrained = (b, a) if first else (a, b)
        pairs.append((constrained.tokens_per_s / free.tokens_per_s, free, constrained))
        print(f"constrained @{STREAMS}: free {free.tokens_per_s:.0f} tok/s, JSON Schema {constrained.tokens_per_s:.0f} "
              f"tok/s ({pairs[-1][0]:.2f})", flush=True)
    ratio, free, constrained = sorted(pairs, key=lambda p: p[0])[len(pairs) // 2]
    lines = ["\n## Constrained decoding (JSON Schema on every request)\n",
             "| load | streams | tokens/s | TTFT p50 ms | ITL p50 ms | ITL p99 ms |", "|---|---|---|---|---|---|"]
    for label, r in (("unconstrained", free), ("JSON Schema", constrained)):
        lines.append(f"| {label} | {r.streams} | {r.tokens_per_s:.0f} | {pct(r.ttft, 50) * 1e3:.0f} | "
                     f"{pct(r.itl, 50) * 1e3:.0f} | {pct(r.itl, 99) * 1e3:.0f} |")
    lines.append(f"- JSON Schema @{STREAMS} / unconstrained @{STREAMS} tokens/s: {ratio:.2f} (target >= 0.9); pairs "
                 + ", ".join(f"{p[0]:.2f}" for p in pairs))
    for more in (ttft_lines(stub, batch[0]), mask_lines(tok, schema, list(outputs))):
        print("\n".join(more), flush=True)
        lines += more
    return lines


def ttft_lines(stub: Any, prompt: str) -> list[str]:
    def ttft(sampling: llm_pb2.SamplingParams) -> float:
        t0 = time.perf_counter()
        for msg in stub.GenerateStream(llm_pb2.GenerateRequest(prompt=prompt, sampling=sampling), timeout=300):
            if msg.token_ids:
                return time.perf_counter() - t0
        return time.perf_counter() - t0

    free, new, cached = [], [], []
    for i in range(TTFT_SAMPLES):
        schema = json.dumps(record_schema(f"name{time.time_ns()}"))   # never seen before
        free.append(ttft(llm_pb2.SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)))
        new.append(ttft(llm_pb2.SamplingParams(temperature=0, max_tokens=2, json_schema=schema)))
        cached.append(ttft(llm_pb2.SamplingParams(temperature=0, max_tokens=2, json_schema=schema)))
    f, n, c = (pct(x, 50) * 1e3 for x in (free, new, cached))
    # What a schema adds, also as the median of each interleaved triple's own difference: the three
    # requests of a triple share the machine's speed of the moment.
    dn, dc = (pct([b - a for a, b in zip(free, x)], 50) * 1e3 for x in (new, cached))
    return [f"- TTFT p50, one request ({TTFT_SAMPLES} interleaved triples): unconstrained {f:.1f} ms; new schema "
            f"{n:.1f} ms (adds {n - f:.1f} ms; median paired difference {dn:.1f} ms; target <= 50); cached schema "
            f"{c:.1f} ms (adds {c - f:.1f} ms; median paired difference {dc:.1f} ms; target <= 5)"]


def mask_lines(tok: Any, schema: str, outputs: list[list[int]]) -> list[str]:
    if not outputs:
        return ["- mask cost: no constrained outputs recorded"]
    vocab = len(tok)
    llt = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    grammar = grammar_of(ConstraintSpec("json_schema", schema))
    batched, alone = [], []
    for together in (True, False):
        c = Constraints(lambda: llt, vocab)
        groups = [list(range(len(outputs)))] if together else [[i] for i in range(len(outputs))]
        for group in groups:
            for i in group:
                c.start(i, grammar, [])
            for step in range(max(len(outputs[i]) for i in group)):
                live = [i for i in group if step < len(outputs[i])]
                t0 = time.perf_counter()
                future = c.masks_async([(i, ()) for i in live])
                assert future is not None
                future.result()
                (batched if together else alone).append((time.perf_counter() - t0) / len(live))
                errors = [""] * len(live)
                c.advance(live, [outputs[i][step] for i in live], errors)
                assert not any(errors), errors
            c.release(group)
    mean = lambda xs: sum(xs) / len(xs) * 1e6  # noqa: E731
    return [f"- mask cost per row (the {len(outputs)} outputs replayed, {len(alone)} tokens): "
            f"{len(outputs)} rows a step: mean {mean(batched):.0f} µs, p99 {pct(batched, 99) * 1e6:.0f} µs; "
            f"one row a step: mean {mean(alone):.0f} µs, p99 {pct(alone, 99) * 1e6:.0f} µs"]
