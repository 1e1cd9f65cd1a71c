"""The C++ attention kernel (services/worker/kernels/paged_attention.cpp) against attention computed in
float32 by SDPA over the same bfloat16 keys and values: ragged contexts, scattered block tables, block sizes
that do not divide its 16-key tiles, every group size it builds, both head sizes, rows that are not in
order, prefill chunks (rows sharing a block table, causally), and contexts long enough to be split across
threads and merged."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.worker import kernels
from services.worker.attention_kernel import AttentionKernel

pytestmark = pytest.mark.skipif(not kernels.cpu_supported(),
                                reason="the decode attention kernel needs AVX-512 BF16 (SDPA runs instead)")


@pytest.fixture(scope="module")
def kernel() -> AttentionKernel:
    k = AttentionKernel.load()
    assert k is not None
    return k


def _case(kernel: AttentionKernel, contexts: list[int], kv_heads: int, group: int, head_dim: int, block_size: int,
          row_seq: list[int] | None = None, num_rows: int | None = None, seed: int = 0) -> None:
    """Row b attends over table ``row_seq[b]`` (default b) with that table's context; ``out`` has ``num_rows``
    rows, and those past the kernel's rows must stay as they were."""
    gen = torch.Generator().manual_seed(seed)
    n = len(contexts)
    blocks_needed = sum(-(-c // block_size) for c in contexts)
    num_blocks = blocks_needed + 7
    k_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    v_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    perm = torch.randperm(num_blocks, generator=gen).tolist()   # scattered, as after churn
    width = max(-(-c // block_size) for c in contexts)
    tables = torch.zeros(n, width, dtype=torch.long)
    used = 0
    for i, c in enumerate(contexts):
        nb = -(-c // block_size)
        tables[i, :nb] = torch.tensor(perm[used:used + nb])
        used += nb
    seq_of = row_seq if row_seq is not None else list(range(n))
    lens = torch.tensor([contexts[i] for i in seq_of], dtype=torch.long)
    heads = kv_heads * group
    rows = len(seq_of)
    total = num_rows or rows
    # q rows strided like the lean step's view of its fused projection output: [T, heads (+ more), d]
    qkv = (torch.randn(total, heads + 2 * kv_heads, head_dim, generator=gen) * 2).to(torch.bfloat16)
    q = qkv[:, :heads]
    out = torch.full((total, heads, head_dim), 7.0, dtype=torch.bfloat16)
    seq_idx = torch.tensor(row_seq, dtype=torch.long) if row_seq is not None else None
    scale = head_dim ** -0.5
    kernel(q, seq_idx, k_cache, v_cache, tables, lens, block_size, scale, out)
    for r in range(rows):
        b = seq_of[r]
        pos = torch.arange(contexts[b])
        slots = tables[b][pos // block_size] * block_size + pos % block_size
        k = k_cache[slots].float().transpose(0, 1)                        # [kv_heads, ctx, d]
        v = v_cache[slots].float().transpose(0, 1)
        qh = q[r].float().view(kv_heads, group, head_dim)
        ref = F.scaled_dot_product_attention(qh, k, v, scale=scale).reshape(heads, head_dim)
        torch.testing.assert_close(out[r].float(), ref, atol=2e-2, rtol=2e-2,
                                   msg=lambda m: f"row {r} (context {contexts[b]}): {m}")
    assert bool((out[rows:] == 7.0).all())   # rows it was not given are left alone


@pytest.mark.parametrize("group", [1, 3, 4, 8])
def test_every_group_size_over_ragged_contexts(kernel, group):
    _case(kernel, [1, 5, 16, 17, 130, 700], kv_heads=2, group=group, head_dim=64, block_size=16, seed=group)


def test_head_dim_128_and_block_sizes_that_do_not_tile_by_16(kernel):
    for bs in (1, 5, 24, 64):
        _case(kernel, [3, 31, 33, 250], kv_heads=3, group=3, head_dim=128, block_size=bs, seed=bs)


def test_one_long_context_is_split_across_threads_and_merged(kernel):
    """One row over 2,000 keys (parts of at least 256 keys run on separate threads) and a mix where one long
    row sits among short ones (the long one is split, the short ones are not)."""
    _case(kernel, [2000], kv_heads=3, group=3, head_dim=64, block_size=16)
    _case(kernel, [1999], kv_heads=3, group=3, head_dim=64, block_size=7)
    _case(kernel, [32] * 7 + [1500], kv_heads=3, group=3, head_dim=64, block_size=16, seed=1)


def test_rows_reading_tables_out_of_order_and_only_their_own_rows_written(kernel):
    """Rows name their block tables (several rows may share one), and the kernel writes only its rows."""
    _case(kernel, [40, 7, 300], kv_heads=3, group=3, head_dim=64, block_size=16, row_seq=[2, 0, 2, 1], num_rows=16)


def test_peaked_scores_stay_finite_and_exact(kernel):
    """Large logits (q scaled up) put all weight on a few keys: the softmax must not overflow."""
    gen = torch.Generator().manual_seed(3)
    k_cache = torch.randn(64, 1, 64, generator=gen).to(torch.bfloat16)
    v_cache = torch.randn(64, 1, 64, generator=gen).to(torch.bfloat16)
    q = (k_cache[17:18].float() * 40).to(torch.bfloat16)                # aligned with key 17: a score of ~3,000
    out = torch.empty(1, 1, 64, dtype=torch.bfloat16)
    kernel(q, None, k_cache, v_cache, torch.arange(4)[None], torch.tensor([64]), 16, 0.125, out)
    assert torch.isfinite(out.float()).all()
    torch.testing.assert_close(out[0, 0].float(), v_cache[17, 0].float(), atol=1e-2, rtol=1e-2)


def test_what_it_does_not_build_is_refused(kernel):
    assert kernel.supports(torch.bfloat16, torch.device("cpu"), 64, 3)
    assert not kernel.supports(torch.float32, torch.device("cpu"), 64, 3)
    assert not kernel.supports(torch.bfloat16, torch.device("cpu"), 80, 3)
    assert not kernel.supports(torch.bfloat16, torch.device("cpu"), 64, 16)


@pytest.mark.parametrize("kv_heads,group,d", [(3, 3, 64), (2, 1, 128), (1, 8, 64)])
def test_prefill_chunks_attend_causally_through_a_shared_table(kernel, kv_heads, group, d):
    """A step of a decode row, a 40-token chunk that continues a sequence at position 90 and a 300-token chunk
    that starts one: each chunk's rows share their sequence's table (row_seq) and attend to the positions up
    to their own (in tiles of 16 rows sharing each key and value read, the last tile shorter, odd and even
    context lengths); compared with SDPA's causal attention over the same slots."""
    gen = torch.Generator().manual_seed(5)
    bs = 16
    seqs = [(700, 1), (90, 40), (0, 300)]            # (start, tokens)
    num_blocks = sum(-(-(s + n) // bs) for s, n in seqs) + 3
    k_cache = torch.randn(num_blocks * bs, kv_heads, d, generator=gen).to(torch.bfloat16)
    v_cache = torch.randn(num_blocks * bs, kv_heads, d, generator=gen).to(torch.bfloat16)
    perm = torch.randperm(num_blocks, generator=gen)
    width = max(-(-(s + n) // bs) for s, n in seqs)
    tables, used = torch.zeros(len(seqs), width, dtype=torch.long), 0
    for i, (s, n) in enumerate(seqs):
        nb = -(-(s + n) // bs)
        tables[i, :nb] = perm[used:used + nb]
        used += nb
    row_seq = torch.repeat_interleave(torch.arange(len(seqs)), torch.tensor([n for _, n in seqs]))
    positions = torch.cat([torch.arange(s, s + n) for s, n in seqs])
    q = torch.randn(len(positions), kv_heads * group, d, generator=gen).to(torch.bfloat16)
    out = torch.empty_like(q)
    kernel(q, row_seq, k_cache, v_cache, tables, positions + 1, bs, d ** -0.5, out)
    flat = 0
    for i, (s, n) in enumerate(seqs):
        pos = torch.arange(s + n)
        slots = tables[i][pos // bs] * bs + pos % bs
        k = k_cache[slots].float().transpose(0, 1)[:, None]               # [kv_heads, 1, ctx, d]
        v = v_cache[slots].float().transpose(0, 1)[:, None]
        qh = q[flat:flat + n].float().view(n, kv_heads, group, d).permute(1, 2, 0, 3)   # [kv_heads, group, n, d]
        mask = pos[None, :] <= torch.arange(s, s + n)[:, None]
        ref = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, scale=d ** -0.5)
        torch.testing.assert_close(out[flat:flat + n].float(), ref.permute(2, 0, 1, 3).reshape(n, -1, d),
                                   atol=2e-2, rtol=2e-2)
        flat += n


def test_a_missing_or_failing_compiler_is_a_clear_error(tmp_path, monkeypatch):
    """What ``kernels.library()`` turns into a log line and torch's ops: the build says what went wrong."""
    monkeypatch.setenv("LLMSERVE_KERNEL_DIR", str(tmp_path))
    with pytest.raises(OSError):
        kernels.build(compiler=str(tmp_path / "no-such-g++"))
    failing = tmp_path / "failing-g++"
    failing.write_text("#!/bin/sh\necho 'error: this compiler refuses' >&2\nexit 1\n")
    failing.chmod(0o755)
    with pytest.raises(RuntimeError, match="failed to build the kernels: error: this compiler refuses"):
        kernels.build(compiler=str(failing))
    assert not list(tmp_path.glob("*.so"))        # nothing half-built is left to load
