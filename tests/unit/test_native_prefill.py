"""The native path's prefill attention (services/worker/kernels/native_prefill.cpp, through
``NativeAttention.chunks``) against a NumPy float64 reference over the same stored keys and values: chunks that
start the sequence and chunks in its middle, contexts ending mid-block, shuffled block tables, chunk lengths 1..70
(not multiples of its 16-row tiles), grouped-query heads 1 and 3, head sizes 64, 32 and 128, several sequences
and decode rows in one step, one thread and two, and the parts a short chunk over a long context is cut into.
Where the CPU has AMX the products run on its tiles (by default) and the vdpbf16ps ones are tested too. Then the
routing: a mixed step's decode row gives the bits it gives in a decode-only step."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from services.worker import kernels, paged_attention
from services.worker.kv_cache import KVPool
from services.worker.native_ops import NativeAttention
from tests.unit.q8 import dequant_q8, q8

def _runs_here() -> bool:
    kernel = NativeAttention.load(576, 64, 1536)
    return kernel is not None and kernel.prefill


pytestmark = pytest.mark.skipif(not _runs_here(), reason="the native prefill attention needs the avx512 build of the "
                                "block kernels and AVX-512 BF16")


TOL = 4e-3     # the weights' and values' bf16 rounding (2^-9 each), averaged over the keys
DECODE_TOL = 1e-5   # decode rows: fp32 throughout


def _kernel(head_dim: int = 64) -> NativeAttention:
    kernel = NativeAttention.load(576, head_dim, 1536)
    assert kernel is not None and kernel.prefill
    return kernel


def _pool(seqs: list[tuple[int, int]], kv_heads: int, d: int, block_size: int, dtype: object, seed: int):
    """Random keys/values in a pool of shuffled blocks; a block table per sequence covering start + n positions.
    dtype "f16q8": fp16 keys, int8 values (tests/unit/q8.py)."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-(start + n) // block_size) for start, n in seqs]
    blocks = sum(need) + 3
    perm = torch.randperm(blocks, generator=gen).tolist()
    tables, used = [], 0
    for nb in need:
        tables.append(perm[used:used + nb])
        used += nb
    k = torch.randn(blocks * block_size, kv_heads, d, generator=gen) * 1.5
    v = torch.randn(blocks * block_size, kv_heads, d, generator=gen)
    if dtype == "f16q8":
        return tables, k.half(), q8(v)
    return tables, k.to(dtype), v.to(dtype)   # type: ignore[arg-type]


def _bf16(x: torch.Tensor) -> np.ndarray:
    return x.float().bfloat16().double().numpy()


def _reference(q: torch.Tensor, row: int, pos: int, table: list[int], k: torch.Tensor, v: torch.Tensor,
               block_size: int, scale: float, rounded: bool = True) -> np.ndarray:
    """Row ``row`` of q at position ``pos`` over positions 0..pos of its table: [heads, d], float64 over the
    stored keys and values, the values rounded to bf16 as the prefill kernel's are (``rounded``); or as they are (a
    decode row's reference). The kernel's scores must be as near exact as the tolerance says: q and k rounded to
    bf16 there missed it by 4x (1.6e-2), int16 with a scale a head (native_prefill.cpp) met it."""
    heads, kv_heads = q.shape[1], k.shape[1]
    p = np.arange(pos + 1)
    slots = np.asarray(table)[p // block_size] * block_size + p % block_size
    exact = lambda x: x.double().numpy()   # noqa: E731
    kk = exact(k)[slots]
    vv = (_bf16 if rounded else exact)(dequant_q8(v) if v.dtype == torch.int8 else v)[slots]
    out = np.zeros((heads, q.shape[2]))
    for h in range(heads):
        kh = h // (heads // kv_heads)
        s = kk[:, kh] @ exact(q[row, h] * scale)
        w = np.exp(s - s.max())
        out[h] = (w / w.sum()) @ vv[:, kh]
    return out


def _run(seqs: list[tuple[int, int]], kv_heads: int, group: int, d: int, block_size: int,
         dtype: object = torch.float16, threads: int | None = None, seed: int = 0,
         single_decodes: bool = True) -> None:
    """Every sequence a prefill chunk of n queries from position start (n == 1: a decode row, through the decode
    kernel, unless not ``single_decodes``), all in one step, q rows strided as the lean step's slice of its fused
    projection is."""
    tables, k, v = _pool(seqs, kv_heads, d, block_size, dtype, seed)
    heads = kv_heads * group
    total = sum(n for _, n in seqs)
    gen = torch.Generator().manual_seed(seed + 1)
    q = (torch.randn(total, heads + 2 * kv_heads, d, generator=gen) * 2)[:, :heads]
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
    decode_rows, decode_seq, chunks, flat = [], [], [], 0
    for i, (start, n) in enumerate(seqs):
        if n == 1 and single_decodes:
            decode_rows.append(flat)
            decode_seq.append(i)
        else:
            chunks.append((flat, n, start, i))
        flat += n
    rows = torch.tensor(decode_rows, dtype=torch.long)
    lens = torch.tensor([seqs[i][0] + 1 for i in decode_seq], dtype=torch.long)
    out = torch.full((total, heads, d), float("nan"))
    scale = d ** -0.5
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        _kernel(d).chunks(q, rows if decode_rows else None, padded[torch.tensor(decode_seq, dtype=torch.long)], lens,
                          torch.tensor(chunks, dtype=torch.long), k, v, padded, block_size, scale, out)
    finally:
        torch.set_num_threads(before)
    flat = 0
    for i, (start, n) in enumerate(seqs):
        for j in range(n):
            chunk = n > 1 or not single_decodes
            ref = _reference(q, flat + j, start + j, tables[i], k, v, block_size, scale, rounded=chunk)
            got = out[flat + j].double().numpy()
            assert np.abs(got - ref).max() <= (TOL if chunk else DECODE_TOL) * max(np.abs(ref).max(), 1.0), (i, j)
        flat += n


@pytest.mark.parametrize("n", [2, 5, 16, 17, 37, 70])
@pytest.mark.parametrize("start", [0, 29, 64, 100])
def test_a_chunk_at_the_start_or_in_the_middle(start, n):
    _run([(start, n)], 3, 3, 64, 16, seed=start * 100 + n)


@pytest.mark.parametrize("start", [0, 1, 63, 700])
def test_one_row_chunks(start):
    """The prefill kernel at one query a chunk (the layout gives it none: those are decode rows), beside others."""
    _run([(start, 1), (5, 1), (start, 3)], 3, 3, 64, 16, seed=start, single_decodes=False)


@pytest.mark.parametrize("kv_heads,group,d", [(3, 3, 64), (2, 1, 64), (1, 4, 32), (2, 3, 128), (4, 2, 16)])
@pytest.mark.parametrize("block_size", [16, 64])
def test_heads_and_head_sizes(kv_heads, group, d, block_size):
    _run([(0, 23), (45, 19)], kv_heads, group, d, block_size, seed=d + group)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, "f16q8"])
@pytest.mark.parametrize("threads", [1, 2])
def test_several_sequences_and_decode_rows_in_one_step(dtype, threads):
    """Chunks and decode rows interleaved, contexts ending mid-block, one thread or two; fp16, fp32, or fp16 keys
    with int8 values (the values the kernel reads: q · s)."""
    seqs = [(130, 1), (0, 33), (7, 1), (190, 50), (1, 17), (64, 64), (300, 1)]
    _run(seqs, 3, 3, 64, 64, dtype=dtype, threads=threads, seed=3)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_short_chunk_over_a_long_context_is_cut_into_parts(threads):
    """3 rows after 2,000 positions: one tile, fewer items than threads want, so each KV head's keys run in parts
    (whole blocks) merged by their maxima and sums."""
    _run([(2000, 3)], 3, 3, 64, 64, threads=threads, seed=5)
    _run([(2000, 3)], 3, 3, 64, 64, dtype="f16q8", threads=threads, seed=5)
    _run([(1500, 40), (0, 2)], 3, 3, 64, 16, threads=threads, seed=6)


def test_a_long_chunk():
    """512 queries from position 1,488 (a 2,000-token prompt's last chunk), 9 heads over 3: a sample of rows."""
    _run([(1300, 200)], 3, 3, 64, 64, seed=7)


@pytest.fixture
def vdpbf16ps_products():
    """The products by vdpbf16ps where the default is the AMX tiles (skipped where there are none), then back."""
    lib = kernels.quant_library()
    if not lib.llmserve_native_prefill_amx(0):
        lib.llmserve_native_prefill_amx(1)
        pytest.skip("no AMX tiles here: every test runs the vdpbf16ps products")
    yield
    lib.llmserve_native_prefill_amx(1)


@pytest.mark.parametrize("threads", [1, 2])
def test_the_vdpbf16ps_products_where_the_cpu_also_has_amx_tiles(vdpbf16ps_products, threads):
    """The AMX tiles (products of 32 keys or 32 dims, the weights zero past a block's keys) and vdpbf16ps both
    against the reference: chunks mid-block, decode rows, head sizes 64, 32 (the tiles' smallest) and 16 (never
    on the tiles), parts."""
    _run([(130, 1), (0, 33), (190, 50), (1, 17), (64, 64)], 3, 3, 64, 16, threads=threads, seed=11)
    _run([(0, 23), (45, 19)], 1, 4, 32, 16, threads=threads, seed=12)
    _run([(0, 23), (45, 19)], 4, 2, 16, 64, threads=threads, seed=13)
    _run([(2000, 3)], 3, 3, 64, 64, threads=threads, seed=14)


def test_unsupported_head_size_is_refused():
    kernel = _kernel(64)
    q = torch.zeros(2, 3, 24)
    k = torch.zeros(16, 3, 24, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="head_dim 24"):
        kernel.chunks(q, None, torch.zeros(0, 1, dtype=torch.long), torch.zeros(0, dtype=torch.long),
                      torch.tensor([[0, 2, 0, 0]]), k, k, torch.zeros(1, 1, dtype=torch.long), 16, 1.0,
                      torch.empty(2, 3, 24))


def test_a_mixed_steps_decode_rows_equal_a_decode_only_steps_bit_for_bit():
    """The layout sends a step with a prefill chunk to the kernel (not SDPA); its decode rows and a draft row's
    queries go through the decode kernel, so each equals the same row of a step without the chunk, bit for bit."""
    kernel = _kernel()
    bs = 64
    pool = KVPool(1, 3, 64, bs, 16 << 20, torch.float16, torch.device("cpu"))
    k_cache, v_cache = pool.layer(0)
    gen = torch.Generator().manual_seed(11)
    k_cache.copy_(torch.randn(k_cache.shape, generator=gen))
    v_cache.copy_(torch.randn(v_cache.shape, generator=gen))
    decodes = [(1100, 1, list(range(0, 18))), (70, 1, [40, 22])]
    draft = (600, 3, list(range(20, 30)))
    chunk = (100, 200, [50, 51, 52, 53, 54])
    seqs = [decodes[0], chunk, draft, decodes[1]]
    mixed = paged_attention.StepLayout.build(pool, seqs, torch.device("cpu"), kernel, frozenset({2}))
    assert mixed.kernel_rows is not None and mixed.kernel_rows.split is not None and not mixed.prefills
    alone = paged_attention.StepLayout.build(pool, decodes + [draft], torch.device("cpu"), kernel, frozenset({2}))
    assert alone.kernel_rows is not None and alone.kernel_rows.split is None
    q_mixed = torch.randn(1, 9, 205, 64, generator=gen)
    # the same queries for the decode and draft rows in the decode-only step's order
    order = [0, 204, 201, 202, 203]
    q_alone = q_mixed[:, :, order]
    got = paged_attention.attend(mixed, 0, q_mixed, None, None, 0.125, stored=True)[0]    # type: ignore[arg-type]
    want = paged_attention.attend(alone, 0, q_alone, None, None, 0.125, stored=True)[0]   # type: ignore[arg-type]
    assert torch.equal(got[order], want)
    # and the chunk's rows are the chunk's attention (the SDPA path as the reference, fp32)
    sdpa = paged_attention.StepLayout.build(pool, seqs, torch.device("cpu"), None, frozenset({2}))
    assert sdpa.kernel_rows is None and sdpa.prefills
    ref = paged_attention.attend(sdpa, 0, q_mixed, None, None, 0.125, stored=True)[0]     # type: ignore[arg-type]
    assert (got[order] - ref[order]).abs().max() <= 2e-5 * ref.abs().max()
    assert (got[1:201] - ref[1:201]).abs().max() <= TOL * ref.abs().max()


@pytest.mark.parametrize("d", [64, 128, 256])
def test_scores_of_keys_and_queries_at_their_largest_do_not_overflow(d):
    """Every element of a head at its row's largest (|x| the same across the head): each int16 product is the
    largest the kernel makes, and d of them must still fit the int32 sum. Keys alternate +1 and -1 rows, so the
    +1 keys carry all the weight; an overflowed sum would give them the -1 keys' score."""
    kv_heads, group, bs, n = 1, 1, 16, 17
    tables, k, v = _pool([(15, n)], kv_heads, d, bs, torch.float16, 3)
    sign = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(k.shape[0])])
    k = (sign[:, None, None] * torch.ones_like(k, dtype=torch.float32) * 4).half()
    q = torch.ones(n, kv_heads * group, d) * 3
    padded = torch.tensor(tables, dtype=torch.long)
    out = torch.full((n, kv_heads * group, d), float("nan"))
    _kernel(d).chunks(q, None, padded[:0], torch.zeros(0, dtype=torch.long), torch.tensor([(0, n, 15, 0)]), k, v,
                      padded, bs, d ** -0.5, out)
    for j in range(n):
        ref = _reference(q, j, 15 + j, tables[0], k, v, bs, d ** -0.5)
        assert np.abs(out[j].double().numpy() - ref).max() <= TOL * max(np.abs(ref).max(), 1.0), j
