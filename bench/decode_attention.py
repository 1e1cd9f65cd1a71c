"""The native path's decode attention, libraries side by side in one process (docs/performance.md, "The avx512
build's decode attention"):

    python -m bench.decode_attention attention avx512 avx2 old=/path/to/llmserve_quant.so
    python -m bench.decode_attention steps avx512 old=/path/to/llmserve_quant.so

Each argument is a build of the quant library (``kernels.QUANT_BUILDS``), or NAME=PATH: a library compiled
elsewhere (say from an earlier commit, for a before/after), loaded in place of the build this CPU runs. The libraries
take turns within each round; medians over ROUNDS (default 7).

- ``attention``: 30 layers of one row's decode attention at KEYS (2,000) keys, the pool fp16 (KV=f32: fp32),
  every layer's keys and values in one mapping with huge pages (as the worker's pool) and a 64 MB read between
  rounds so the keys come from DRAM (HOT=1: one layer's pool 30 times), THREADS (2) threads;
- ``steps``: one-row ``ModelRunner.execute`` steps of SmolLM2 at a LONG (2,000) and a SHORT (64) context, and
  their ratio.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Iterator

import torch

from services.common.model_source import resolve_model
from services.worker import huge_pages, kernels
from services.worker.model_runner import ModelRunner

from bench.step_cost import decode_work

ROUNDS = int(os.environ.get("ROUNDS", 7))
LAYERS, BLOCK, KV_HEADS, HEAD_DIM, HEADS = 30, 64, 3, 64, 9    # SmolLM2


def _libraries(specs: list[str]) -> dict[str, tuple[str, str]]:
    """name → (build, path or '')."""
    out = {}
    for spec in specs:
        name, _, path = spec.partition("=")
        out[name] = (kernels.quant_isa() or "avx2", path) if path else (name, "")
    return out


@contextlib.contextmanager
def _built_from(build: str, path: str) -> Iterator[None]:
    """Inside, ``kernels.quant_library()`` is build ``build``, compiled from this tree or loaded from ``path``."""
    real, isa = kernels.build_quant, os.environ.get("LLMSERVE_QUANT_ISA")
    if path:
        kernels.build_quant = lambda compiler=None, isa=None: Path(path)   # type: ignore[assignment]
    os.environ["LLMSERVE_QUANT_ISA"] = build
    kernels.quant_build.cache_clear()
    try:
        if kernels.quant_library() is None:
            raise SystemExit(f"{build} ({path or 'this tree'}) does not run here")
        yield
    finally:
        kernels.build_quant = real                                          # type: ignore[assignment]
        if isa is None:
            os.environ.pop("LLMSERVE_QUANT_ISA", None)
        else:
            os.environ["LLMSERVE_QUANT_ISA"] = isa
        kernels.quant_build.cache_clear()


def _load(build: str, path: str) -> ctypes.CDLL:
    with _built_from(build, path):
        return kernels.quant_library()   # type: ignore[return-value]


def attention(specs: list[str]) -> None:
    keys, hot = int(os.environ.get("KEYS", 2000)), os.environ.get("HOT") == "1"
    dtype = torch.float32 if os.environ.get("KV") == "f32" else torch.float16
    torch.set_num_threads(int(os.environ.get("THREADS", 2)))
    libs = {name: _load(*spec) for name, spec in _libraries(specs).items()}
    blocks = -(-keys // BLOCK)
    gen = torch.Generator().manual_seed(0)

    # every layer's keys then values in one mapping, as the worker's pool (kv_cache.py): huge pages are granted
    # to a mapping of 2 MiB and more, not to a layer's 0.8 MB
    shape, count = (blocks * BLOCK, KV_HEADS, HEAD_DIM), 2 * (1 if hot else LAYERS)
    nbytes = count * blocks * BLOCK * KV_HEADS * HEAD_DIM * dtype.itemsize
    area = huge_pages.zeros(nbytes).view(dtype).view(count, *shape)
    area.copy_(torch.randn(area.shape, generator=gen))
    pools = [(area[2 * i], area[2 * i + 1]) for i in range(count // 2)]
    table = torch.arange(blocks, dtype=torch.long).view(1, blocks)
    lens = torch.tensor([keys], dtype=torch.long)
    q, out = torch.randn(1, HEADS, HEAD_DIM, generator=gen), torch.empty(1, HEADS, HEAD_DIM)
    flush = torch.ones(16 << 20)

    def run(lib: ctypes.CDLL) -> float:
        fn = lib.llmserve_f16_paged_decode if dtype == torch.float16 else lib.llmserve_f32_paged_decode
        if not hot:
            flush.sum()                  # 64 MB read (clean lines): the pools leave the caches
        t0 = time.perf_counter()
        for layer in range(LAYERS):
            k, v = pools[layer % len(pools)]
            fn(q.data_ptr(), q.stride(0), 1, k.data_ptr(), v.data_ptr(), KV_HEADS, HEAD_DIM, HEADS // KV_HEADS,
               table.data_ptr(), blocks, lens.data_ptr(), BLOCK, HEAD_DIM ** -0.5, out.data_ptr(), out.stride(0))
        return (time.perf_counter() - t0) * 1e3

    for lib in libs.values():
        run(lib)
    times: dict[str, list[float]] = {name: [] for name in libs}
    for _ in range(ROUNDS):
        for name, lib in libs.items():
            times[name].append(run(lib))
    print(f"{LAYERS} layers at {keys} keys, {'hot' if hot else 'from DRAM'}, {dtype}, "
          f"{torch.get_num_threads()} threads")
    for name, ts in times.items():
        print(f"{name:10s} {statistics.median(ts):6.2f} ms  (" + ", ".join(f"{t:.2f}" for t in ts) + ")")


def steps(specs: list[str]) -> None:
    long, short = int(os.environ.get("LONG", 2000)), int(os.environ.get("SHORT", 64))
    source = resolve_model("smollm2")
    runners = {}
    for name, (build, path) in _libraries(specs).items():
        with _built_from(build, path):
            runners[name] = ModelRunner(source, "native", "cpu", 160 * 2**20, 0)
    torch.set_num_threads(2)
    works = {n: (decode_work(r, [long], seq_base=10_000), decode_work(r, [short], seq_base=20_000))
             for n, r in runners.items()}
    for name, runner in runners.items():
        for work in works[name]:
            runner.execute(work)
    times: dict[str, tuple[list[float], list[float]]] = {n: ([], []) for n in runners}
    for _ in range(ROUNDS):
        for name, runner in runners.items():
            for work, ts in zip(works[name], times[name]):
                three = []
                for _ in range(3):
                    t0 = time.perf_counter()
                    runner.execute(work)
                    three.append((time.perf_counter() - t0) * 1e3)
                ts.append(sorted(three)[1])
    print(f"one row, a {long}-token context against a {short}-token one (each round the median of 3 steps)")
    for name, (lt, st) in times.items():
        ratios = [a / b for a, b in zip(lt, st)]
        print(f"{name:10s} {statistics.median(lt):6.2f} / {statistics.median(st):5.2f} ms, ratio "
              f"{statistics.median(ratios):.2f} (" + ", ".join(f"{r:.2f}" for r in ratios) + ")")


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] not in ("attention", "steps"):
        raise SystemExit(__doc__)
    (attention if sys.argv[1] == "attention" else steps)(sys.argv[2:])
