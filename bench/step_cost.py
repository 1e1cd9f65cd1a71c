"""The worker's own step, in process: decode step time against the step's Σ context tokens.

Builds a ModelRunner (the worker's compute path: paged KV pool, ragged attention, sampling) and times
decode steps of a few mixes of context lengths. The KV slots hold whatever is in the pool: a step's
cost does not depend on the values, only on how many slots it reads. Also fits a line, time = a + b ×
Σ context, so a reader can see that the cost follows Σ context and not batch × longest context.
"""
from __future__ import annotations

import time

import torch

from services.common.model_source import ModelSource
from services.worker.model_runner import ModelRunner, SeqWork

# (label, context lengths of the decode rows)
MIXES: list[tuple[str, list[int]]] = [
    ("1 × 32", [32]),
    ("1 × 2,000", [2000]),
    ("32 × 32", [32] * 32),
    ("32 × 128", [128] * 32),
    ("28 × 32 + 4 × 1,500", [32] * 28 + [1500] * 4),
    ("31 × 32 + 1 × 2,000", [32] * 31 + [2000]),
    ("16 × 512", [512] * 16),
    ("32 × 512", [512] * 32),
]


def make_runner(source: ModelSource, dtype: str, kv_cache_mb: int = 1024, block_size: int = 0) -> ModelRunner:
    return ModelRunner(source, dtype, "cpu", kv_cache_mb * 2**20, block_size)


def decode_work(runner: ModelRunner, contexts: list[int], token: int = 42, seq_base: int = 10_000,
                draft: int = 0) -> list[SeqWork]:
    """One decode row per context length, each with its own blocks (reused across calls); sequence ids
    from ``seq_base``; ``draft``: each row also carries a speculative draft of that many tokens."""
    bs = runner.pool.block_size
    work, next_block = [], 0
    for i, ctx in enumerate(contexts):
        n_blocks = -(-(ctx + draft) // bs)
        if next_block + n_blocks > runner.pool.num_blocks:
            raise ValueError(f"mix needs more than the pool's {runner.pool.num_blocks} blocks")
        table = list(range(next_block, next_block + n_blocks))
        next_block += n_blocks
        work.append(SeqWork(seq_id=seq_base + i, token_ids=[token] * (1 + draft), start_pos=ctx - 1, block_table=table,
                            sample=True, num_generated=1, prefix_token_ids=tuple([token] * (ctx - 1)),
                            draft=(token,) * draft))
    return work


def time_steps(runner: ModelRunner, works: list[list[SeqWork]], repeats: int = 5) -> list[float]:
    """Median seconds of one step of each work over ``repeats`` rounds (after one warm-up each). The works
    take turns within a round, so a slow second of the machine costs each of them one sample, not one of
    them all of its samples."""
    for work in works:
        runner.execute(work)
    times: list[list[float]] = [[] for _ in works]
    for _ in range(repeats):
        for work, ts in zip(works, times):
            t0 = time.perf_counter()
            runner.execute(work)
            ts.append(time.perf_counter() - t0)
    runner.release([w.seq_id for work in works for w in work])
    return [sorted(ts)[len(ts) // 2] for ts in times]


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares y = a + b x over (x, y) points."""
    xs = torch.tensor([p[0] for p in points], dtype=torch.float64)
    ys = torch.tensor([p[1] for p in points], dtype=torch.float64)
    xm, ym = xs.mean(), ys.mean()
    b = float(((xs - xm) * (ys - ym)).sum() / ((xs - xm) ** 2).sum().clamp(min=1e-12))
    return float(ym) - b * float(xm), b


def step_cost_rows(runner: ModelRunner, repeats: int = 5) -> tuple[list[str], tuple[float, float]]:
    rows = ["| decode mix | batch | Σ context | batch × max context | step ms |", "|---|---|---|---|---|"]
    works = [decode_work(runner, contexts, seq_base=10_000 * (m + 1)) for m, (_, contexts) in enumerate(MIXES)]
    points = []
    for (label, contexts), t in zip(MIXES, time_steps(runner, works, repeats)):
        points.append((sum(contexts), t))
        rows.append(f"| {label} | {len(contexts)} | {sum(contexts):,} | {len(contexts) * max(contexts):,} | {t * 1e3:.1f} |")
    a, b = fit_line(points)
    return rows, (a, b)
