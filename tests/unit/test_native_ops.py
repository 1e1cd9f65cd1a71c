"""The native path's fp32 glue and decode attention (services/worker/kernels/native_ops.cpp, through
native_ops.py) against NumPy float64 references, at odd shapes and tails: rows 1..70, widths that are not a
multiple of 16, contexts that end mid-block and mid-8-keys, shuffled block tables, grouped query heads, and a
step big enough to run on several threads."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from services.worker import kernels, paged_attention
from services.worker.kv_cache import KVPool
from services.worker.native_ops import NativeAttention, NativeLayerOps
from tests.unit.q8 import dequant_q8, q8

pytestmark = [pytest.mark.skipif(kernels.quant_library() is None, reason="the native kernels need AVX2, FMA, F16C"),
              pytest.mark.usefixtures("each_quant_build")]


def _ops() -> NativeLayerOps:
    ops = NativeLayerOps.for_native(576, 64, 1536)
    assert isinstance(ops, NativeLayerOps) and ops.fused
    return ops


def _close(got: torch.Tensor, ref: np.ndarray, tol: float = 2e-6) -> None:
    scale = max(np.abs(ref).max(), 1e-30)
    assert np.abs(got.double().numpy() - ref).max() <= tol * scale


@pytest.mark.parametrize("rows,dim", [(1, 8), (3, 40), (70, 576)])
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm(rows, dim, with_delta):
    gen = torch.Generator().manual_seed(rows * dim)
    h = torch.randn(rows, dim, generator=gen) * 3
    delta_wide = torch.randn(rows, dim + 8, generator=gen)
    delta = delta_wide[:, :dim] if with_delta else None          # strided rows
    w = torch.randn(dim, generator=gen)
    h_ref = h.double().numpy() + (delta.double().numpy() if with_delta else 0)
    ref = h_ref / np.sqrt((h_ref ** 2).mean(axis=1, keepdims=True) + 1e-5) * w.double().numpy()
    out = _ops().add_rms_norm(h, delta, w, 1e-5)
    _close(h, h_ref)
    _close(out, ref)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, "f16q8"])
@pytest.mark.parametrize("rows,heads,kv_heads,head_dim", [(1, 9, 3, 64), (5, 2, 1, 16), (33, 4, 2, 32)])
def test_rope_store(rows, heads, kv_heads, head_dim, kv_dtype):
    """Into an fp32 pool, or an fp16 one (what the native path uses): each stored value is the fp32 result
    rounded to the nearest fp16, as torch's conversion rounds it; int8 values: each head's q8 (``q8`` here)."""
    _needs_q8(kv_dtype)
    gen = torch.Generator().manual_seed(rows + heads)
    width = (heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(rows, width + 16, generator=gen)[:, :width]     # strided rows, as a matmul's slice may be
    qkv[0, -head_dim:] = 0.0                                            # a value head of zeros (q8: scale 0)
    before = qkv.double().numpy().copy()
    angle = torch.rand(rows, head_dim // 2, generator=gen) * 6.3
    cos, sin = torch.cat([angle.cos()] * 2, dim=1), torch.cat([angle.sin()] * 2, dim=1)
    slots = torch.randperm(rows * 3, generator=gen)[:rows]
    k_cache, v_cache = _kv(torch.zeros(rows * 3, kv_heads, head_dim), torch.zeros(rows * 3, kv_heads, head_dim), kv_dtype)
    _ops().rope_store(qkv, cos, sin, heads, kv_heads, head_dim, slots, k_cache, v_cache)
    half, qk = head_dim // 2, (heads + kv_heads) * head_dim
    x = before[:, :qk].reshape(rows, heads + kv_heads, head_dim)
    c, s = cos.double().numpy()[:, None], sin.double().numpy()[:, None]
    rotated = x * c + np.concatenate([-x[..., half:], x[..., :half]], axis=-1) * s
    _close(qkv[:, :qk].reshape(rows, heads + kv_heads, head_dim), rotated)
    _close(qkv[:, qk:], before[:, qk:], 0.0)                            # v untouched
    if kv_dtype != torch.float32:
        stored_k = qkv[:, heads * head_dim:qk].reshape(rows, kv_heads, head_dim)
        assert torch.equal(k_cache[slots], stored_k.half())                # round to nearest, as torch does
        v = qkv[:, qk:].reshape(rows, kv_heads, head_dim)
        assert torch.equal(v_cache[slots], v.half() if kv_dtype == torch.float16 else q8(v))
        if kv_dtype == "f16q8":
            assert (dequant_q8(v_cache[slots]) - v).abs().max() <= v.abs().max() / 254 * 1.0001
    else:
        _close(k_cache[slots], rotated[:, heads:])
        _close(v_cache[slots], before[:, qk:].reshape(rows, kv_heads, head_dim), 0.0)
    untouched = torch.ones(rows * 3, dtype=torch.bool)
    untouched[slots] = False
    assert not k_cache[untouched].any() and not v_cache[untouched].any()


@pytest.mark.parametrize("rows,inter", [(1, 8), (7, 24), (64, 1536)])
def test_silu_mul(rows, inter):
    gen = torch.Generator().manual_seed(rows + inter)
    gate_up = torch.randn(rows, 2 * inter, generator=gen) * 8      # reaches e^x's clamped range at the tails
    gate_up[0, 0], gate_up[0, 1] = -120.0, 95.0
    g, u = gate_up[:, :inter].double().numpy(), gate_up[:, inter:].double().numpy()
    ref = g / (1 + np.exp(-g)) * u
    _close(_ops().silu_mul(gate_up, inter), ref, 1e-6)


def _kv(k_cache: torch.Tensor, v_cache: torch.Tensor, kv_dtype: object) -> tuple[torch.Tensor, torch.Tensor]:
    """The caches as a pool of kv_dtype holds them: torch.float32 / torch.float16, or "f16q8" (fp16 keys, q8 values)."""
    if kv_dtype == "f16q8":
        return k_cache.half(), q8(v_cache)
    return k_cache.to(kv_dtype), v_cache.to(kv_dtype)   # type: ignore[arg-type]


def _needs_q8(kv_dtype: object) -> None:
    if kv_dtype == "f16q8" and not NativeAttention.load(576, 64, 1536).q8:
        pytest.skip("int8 values run in the avx512 build, on a CPU with AVX-512 BF16")


def _paged(lens: list[int], kv_heads: int, head_dim: int, block_size: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-n // block_size) for n in lens)
    blocks = torch.randperm(len(lens) * width + 3, generator=gen)           # shuffled, some blocks unused
    tables = blocks[:len(lens) * width].view(len(lens), width).contiguous()
    slots = (len(lens) * width + 3) * block_size
    k_cache = torch.randn(slots, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(slots, kv_heads, head_dim, generator=gen)
    return tables, k_cache, v_cache


def _reference_decode(q, tables, k_cache, v_cache, lens, block_size, scale):
    rows, heads, d = q.shape
    kv_heads = k_cache.shape[1]
    out = np.zeros((rows, heads, d))
    for b, n in enumerate(lens):
        pos = np.arange(n)
        slots = tables[b].numpy()[pos // block_size] * block_size + pos % block_size
        if v_cache.dtype == torch.int8:
            v_cache = dequant_q8(v_cache)
        k, v = k_cache.double().numpy()[slots], v_cache.double().numpy()[slots]     # [n, kv_heads, d]
        for h in range(heads):
            kh = h // (heads // kv_heads)
            s = k[:, kh] @ q[b, h].double().numpy() * scale
            p = np.exp(s - s.max())
            out[b, h] = (p / p.sum()) @ v[:, kh]
    return out


def _check_decode(lens: list[int], heads: int, kv_heads: int, head_dim: int, kv_dtype: object,
                  block_size: int) -> None:
    """One step of decode rows against the float64 reference (which reads the same stored values, widened
    exactly)."""
    _needs_q8(kv_dtype)
    tables, k_cache, v_cache = _paged(lens, kv_heads, head_dim, block_size, sum(lens))
    k_cache, v_cache = _kv(k_cache, v_cache, kv_dtype)
    q = torch.randn(len(lens), heads, head_dim, generator=torch.Generator().manual_seed(len(lens))) * 2
    out = torch.full((len(lens), heads, head_dim), float("nan"))
    kernel = NativeAttention.load(576, head_dim, 1536)
    assert kernel is not None
    lens_t = torch.tensor(lens, dtype=torch.long)
    kernel(q, None, k_cache, v_cache, tables, lens_t, block_size, head_dim ** -0.5, out)
    _close(out, _reference_decode(q, tables, k_cache, v_cache, lens, block_size, head_dim ** -0.5), 1e-5)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, "f16q8"])
@pytest.mark.parametrize("lens,heads,kv_heads,head_dim", [
    ([1], 9, 3, 64), ([17, 1, 100], 9, 3, 64), ([5, 40], 2, 2, 16), ([640, 333, 600, 9, 512], 9, 3, 64),
    ([33, 70], 8, 2, 96), ([20, 2001], 4, 1, 128)])
def test_paged_decode_attention(lens, heads, kv_heads, head_dim, kv_dtype):
    """fp32 or fp16 KV, or fp16 keys with int8 values."""
    _check_decode(lens, heads, kv_heads, head_dim, kv_dtype, 16)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, "f16q8"])
@pytest.mark.parametrize("block_size", [5, 16, 64])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (10, 2, 48), (5, 1, 80)])
def test_paged_decode_at_the_tails_of_16_keys_blocks_and_parts(heads, kv_heads, head_dim, block_size, kv_dtype):
    """Contexts just below, at and past a multiple of 16 keys (the avx512 build's runs; the AVX2 code's groups of
    8), of a block and of a 512-key part; SmolLM2's heads, and 5 query heads a KV head (runs of 4 + 1) over value
    rows of 3 and 5 16-lane vectors (64-lane slices 3, and 4 + 1); blocks of 5 keys put a group of 8 across two
    blocks."""
    _check_decode([1, 15, 16, 17, 63, 64, 65, 511, 512, 513, 1025, 2000], heads, kv_heads, head_dim, kv_dtype,
                  block_size)


def _decode_rows(q, k_cache, v_cache, tables, lens, block_size):
    """run(rows, threads): the decode attention of those rows alone (in that order) on that many threads."""
    kernel = NativeAttention.load(576, q.shape[2], 1536)
    assert kernel is not None
    heads, d = q.shape[1], q.shape[2]

    def run(rows: list[int], threads: int) -> torch.Tensor:
        out = torch.empty(len(rows), heads, d)
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            kernel(q[rows].contiguous(), None, k_cache, v_cache, tables[rows].contiguous(),
                   torch.tensor([lens[r] for r in rows]), block_size, d ** -0.5, out)
        finally:
            torch.set_num_threads(before)
        return out

    return run


def test_a_rows_attention_does_not_depend_on_the_rows_beside_it_or_the_threads():
    """Long contexts are split into parts (kernels/native_ops.cpp, SPLIT keys each) run on both threads and merged;
    the split follows the row's own length only, so a row gives the same bits alone, beside other rows and on
    one thread or two (speculative verification rows must equal one-token decodes bit for bit)."""
    lens, heads, kv_heads, d, block_size = [2001, 7, 513, 1500, 64], 9, 3, 64, 64
    tables, k_cache, v_cache = _paged(lens, kv_heads, d, block_size, 5)
    k_cache, v_cache = k_cache.half(), v_cache.half()
    q = torch.randn(len(lens), heads, d, generator=torch.Generator().manual_seed(9))
    run = _decode_rows(q, k_cache, v_cache, tables, lens, block_size)

    together = run(list(range(len(lens))), 2)
    for r in range(len(lens)):
        for threads in (1, 2):
            assert torch.equal(run([r], threads)[0], together[r]), (r, threads)
    assert torch.equal(run([3, 0], 1), together[[3, 0]])
    _close(together, _reference_decode(q, tables, k_cache, v_cache, lens, block_size, d ** -0.5), 1e-5)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, "f16q8"])
def test_verification_rows_sharing_a_table_give_each_rows_own_bits(kv_dtype):
    """A speculating sequence's verification rows share its block table (the same keys, one more a row) and run
    together, one thread taking each part for several of them (DecodePlan's units); here they cross the 512-key
    part boundary, so some have a part the others lack. Each row must give the bits it gives alone, on one thread
    or two, beside another sequence's rows, and match the reference."""
    heads, kv_heads, d, block_size = 9, 3, 64, 64
    spec = list(range(506, 518))                     # 1 + 11 draft rows: 506..511 keys one part, 512.. two
    lens = [300, *spec, 40]
    tables, k_cache, v_cache = _paged(lens, kv_heads, d, block_size, 11)
    tables[2:1 + len(spec)] = tables[1]              # the verification rows' one table
    _needs_q8(kv_dtype)
    k_cache, v_cache = _kv(k_cache, v_cache, kv_dtype)
    q = torch.randn(len(lens), heads, d, generator=torch.Generator().manual_seed(3))
    run = _decode_rows(q, k_cache, v_cache, tables, lens, block_size)

    together = run(list(range(len(lens))), 2)
    for r in range(len(lens)):
        assert torch.equal(run([r], 1)[0], together[r]), r
    assert torch.equal(run(list(range(1, 1 + len(spec))), 1), together[1:1 + len(spec)])
    _close(together, _reference_decode(q, tables, k_cache, v_cache, lens, block_size, d ** -0.5), 1e-5)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_the_layout_gives_the_kernel_decode_steps_and_prefill_chunks_where_it_runs_them_and_it_matches_sdpa(kv_dtype):
    """A step with a prefill chunk: to the kernel's prefill chunks where it runs them (the avx512 build with
    AVX-512 BF16: tests/unit/test_native_prefill.py), else every query to its decode kernel; decode rows match
    SDPA's (the layout without a kernel)."""
    kernel = NativeAttention.load(576, 64, 1536)
    pool = KVPool(1, 3, 64, 16, 8 << 20, kv_dtype, torch.device("cpu"))
    k_cache, v_cache = pool.layer(0)
    k_cache.copy_(torch.randn_like(k_cache))
    v_cache.copy_(torch.randn_like(v_cache))
    seqs = [(20, 1, [4, 9]), (0, 1, [2]), (70, 1, [7, 1, 3, 11, 12])]
    mixed = paged_attention.StepLayout.build(pool, seqs + [(0, 5, [5])], torch.device("cpu"), kernel)
    assert mixed.kernel_rows is not None and not mixed.prefills
    if kernel.prefill:
        assert mixed.kernel_rows.split is not None
    else:                                       # the chunk's five queries as decode rows of their own
        assert mixed.kernel_rows.split is None and mixed.kernel_rows.lens.tolist() == [21, 1, 71, 1, 2, 3, 4, 5]
    sdpa = paged_attention.StepLayout.build(pool, seqs + [(0, 5, [5])], torch.device("cpu"), None)
    assert sdpa.kernel_rows is None and sdpa.prefills
    fast = paged_attention.StepLayout.build(pool, seqs, torch.device("cpu"), kernel)
    slow = paged_attention.StepLayout.build(pool, seqs, torch.device("cpu"), None)
    assert fast.kernel_rows is not None and slow.kernel_rows is None
    assert torch.equal(fast.slot_mapping, slow.slot_mapping)
    q = torch.randn(1, 9, 3, 64)
    got = paged_attention.attend(fast, 0, q, None, None, 0.125, stored=True)   # type: ignore[arg-type]
    want = paged_attention.attend(slow, 0, q, None, None, 0.125, stored=True)  # type: ignore[arg-type]
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_a_decode_only_layout_gives_the_kernel_each_rows_table_slot_and_length():
    """The decode-only layout (built in plain Python): row i reads table i, writes its token's slot, attends to
    its position + 1 keys; tables padded with block 0 to the widest."""
    kernel = NativeAttention.load(576, 64, 1536)
    pool = KVPool(1, 3, 64, 16, 8 << 20, torch.float16, torch.device("cpu"))
    seqs = [(20, 1, [4, 9]), (0, 1, [2]), (79, 1, [7, 1, 3, 11, 12]), (47, 1, [6, 8, 10])]
    layout = paged_attention.StepLayout.build(pool, seqs, torch.device("cpu"), kernel)
    rows = layout.kernel_rows
    assert rows is not None and rows.row_seq is None and rows.split is None and layout.num_tokens == 4
    assert rows.tables.tolist() == [[4, 9, 0, 0, 0], [2, 0, 0, 0, 0], [7, 1, 3, 11, 12], [6, 8, 10, 0, 0]]
    assert rows.lens.tolist() == [21, 1, 80, 48]
    assert layout.slot_mapping.tolist() == [9 * 16 + 4, 2 * 16, 12 * 16 + 15, 10 * 16 + 15]
    assert layout.slot_mapping.dtype == rows.tables.dtype == rows.lens.dtype == torch.long


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_without_a_prefill_kernel_each_query_of_a_chunk_is_a_decode_row_however_the_prompt_is_cut(kv_dtype):
    """A build without the prefill kernel (avx2; avx512 on a CPU without AVX-512 BF16) runs every query of a
    prefill chunk through its decode kernel, over the query's own causal context: a chunk's rows are bit for bit
    the rows of the whole prompt however it is cut, beside decode rows or alone, and a decode step's row. (Prefill
    chunks through SDPA rounded otherwise: 1e-3 apart in the logits, and greedy tokens depended on the cut.)"""
    kernel = NativeAttention.load(576, 64, 1536)
    if kernel.prefill:
        pytest.skip("this build runs prefill chunks in its prefill kernel (tests/unit/test_native_prefill.py)")
    pool = KVPool(1, 3, 64, 16, 8 << 20, kv_dtype, torch.device("cpu"))
    k_cache, v_cache = pool.layer(0)
    k_cache.copy_(torch.randn_like(k_cache))
    v_cache.copy_(torch.randn_like(v_cache))
    table, n = [7, 2, 9, 4], 53
    q = torch.randn(1, 9, n, 64)
    cpu = torch.device("cpu")

    def attend(seqs: list[tuple[int, int, list[int]]], queries: torch.Tensor) -> torch.Tensor:
        layout = paged_attention.StepLayout.build(pool, seqs, cpu, kernel)
        assert layout.kernel_rows is not None and not layout.prefills and not layout.decode_groups
        return paged_attention.attend(layout, 0, queries, None, None, 0.125, stored=True)[0]  # type: ignore[arg-type]

    whole = attend([(0, n, table)], q)
    for cuts in ([1], [52], [16, 17], [5, 31, 50]):
        bounds = [0, *cuts, n]
        parts = [attend([(a, b - a, table)], q[:, :, a:b]) for a, b in zip(bounds, bounds[1:])]
        assert torch.equal(torch.cat(parts), whole), cuts
    beside = attend([(20, 1, [3, 5]), (30, n - 30, table), (0, 1, [1])],
                    torch.cat([torch.randn(1, 9, 1, 64), q[:, :, 30:], torch.randn(1, 9, 1, 64)], dim=2))
    assert torch.equal(beside[1:1 + n - 30], whole[30:])
    assert torch.equal(attend([(n - 1, 1, table)], q[:, :, n - 1:]), whole[n - 1:])
    pos = torch.arange(n)
    slots = torch.tensor(table)[pos // 16] * 16 + pos % 16
    k, v = (c[slots].float().transpose(0, 1)[None] for c in (k_cache, v_cache))   # [1, kv_heads, n, 64]
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.125, enable_gqa=True)
    assert (whole - sdpa[0].transpose(0, 1)).abs().max() <= 1e-5 * sdpa.abs().max()
