"""The GGUF block kernels (services/worker/kernels/quant.cpp, through quant_linear.py) against a NumPy reference
of the block formats, written out here from the GGUF spec (Q4_1: fp16 d, fp16 m, 16 bytes whose low nibbles
are weights 0-15 and high nibbles 16-31, value d·q + m; Q8_0: fp16 d, 32 int8, value d·q), at odd shapes
and tails: rows not a multiple of the tile (16 rows), 1..70 activation
rows (the passes' tails, the 64-row chunks, the prefill path). Every build this CPU runs is tested, and the builds
agree bit for bit."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quantize

from services.worker import kernels
from services.worker.quant_linear import PREFILL_ROWS, TILE, QuantLinear

pytestmark = pytest.mark.skipif(kernels.quant_library() is None, reason="the block kernels need AVX2, FMA, F16C")
BUILDS = kernels.quant_builds()


def reference_weights(blocks: np.ndarray, qtype: T, n: int, k: int) -> np.ndarray:
    """The weights [n, k] the blocks hold, in float64."""
    raw = blocks.reshape(n * k // 32, -1)
    d = raw[:, 0:2].copy().view(np.float16).astype(np.float64)
    if qtype == T.Q4_1:
        m = raw[:, 2:4].copy().view(np.float16).astype(np.float64)
        qs = raw[:, 4:20]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float64)
        return (d * q + m).reshape(n, k)
    q = raw[:, 2:34].copy().view(np.int8).astype(np.float64)
    return (d * q).reshape(n, k)


def _blocks(qtype: T, n: int, k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32) * rng.uniform(0.01, 2.0, (n, 1)).astype(np.float32)
    return quantize(w, qtype)


@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q8_0])
@pytest.mark.parametrize("n,k", [(4, 32), (7, 96), (193, 576), (576, 1536)])
def test_matmul_equals_the_reference_at_odd_shapes_and_row_counts(qtype, n, k, isa):
    blocks = _blocks(qtype, n, k, n + k)
    w = reference_weights(blocks, qtype, n, k)
    lin = QuantLinear(blocks, qtype, n, k, isa=isa)
    assert lin.native and lin.held_bytes() == (n + (-n) % TILE) * blocks.shape[1]   # the file's bytes, no more
    gen = torch.Generator().manual_seed(n)
    for m in (1, 2, 3, 5, 8, 11, PREFILL_ROWS, 70):
        x = torch.randn(m, k, generator=gen)
        ref = x.double().numpy() @ w.T
        scale = np.abs(ref).max()
        # 12-bit activations: exact integer sums of rows rounded to 2^-12 of each block's largest
        xr = quantize_q16_reference(x.double().numpy())
        got = lin(x).double().numpy()
        assert got.shape == (m, n)
        assert np.abs(got - xr @ w.T).max() <= 1e-5 * scale, (m, "12-bit activations")
        assert np.abs(got - ref).max() <= 2e-3 * scale, (m, "12-bit activations against fp32")


@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q8_0])
def test_each_rows_result_does_not_depend_on_the_rows_beside_it(qtype, isa):
    """Up to PREFILL_ROWS rows: row i of an m-row product is bit for bit row i alone, whatever pass (avx2: 4 down
    to 1 rows over a tile; avx512: 8 down to 1, with 2 or 4 integer sums a row) it shares. Speculative
    verification relies on it: a draft row's scores are then those of one-token steps
    (docs/speculative-decoding.md)."""
    n, k = 193, 576
    lin = QuantLinear(_blocks(qtype, n, k, 7), qtype, n, k, isa=isa)
    x = torch.randn(PREFILL_ROWS, k, generator=torch.Generator().manual_seed(3))
    alone = torch.cat([lin(x[i:i + 1]) for i in range(PREFILL_ROWS)])
    for m in (2, 3, 4, 5, 6, 7, 8, 9, 13, 15, 17, PREFILL_ROWS):
        assert torch.equal(lin(x[:m]), alone[:m]), m


@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q8_0])
def test_every_pass_shape_equals_the_reference_and_each_row_alone(qtype, isa):
    """Row counts whose passes are uneven (avx512: passes of at most 8 rows of near-equal size in 64-row chunks,
    9 → 5 + 4, 13 → 7 + 6, 17 → 6 + 6 + 5, 25 → 7 + 6 + 6 + 6, 65 → 8 × 8 + 1; avx2: passes of at most 4 rows,
    9 → 3 + 3 + 3, 10 → 4 + 3 + 3): each product equals the 12-bit scheme's NumPy reference, and each row is bit for
    bit that row alone."""
    n, k = 48, 96                                                       # three 16-row tiles of three blocks
    blocks = _blocks(qtype, n, k, 23)
    w = reference_weights(blocks, qtype, n, k)
    lin = QuantLinear(blocks, qtype, n, k, isa=isa)
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(140, k, generator=gen) * torch.logspace(-2, 2, 140)[torch.randperm(140, generator=gen), None]
    alone = torch.cat([lin(x[i:i + 1]) for i in range(len(x))])
    want = quantize_q16_reference(x.double().numpy()) @ w.T
    for m in (9, 10, 12, 13, 16, 17, 25, 33, 63, 64, 65, 71, 130, 140):
        got = lin(x[:m])
        assert torch.equal(got, alone[:m]), m
        assert (np.abs(got.double().numpy() - want[:m]) <= 1e-5 * np.abs(want[:m]).max(axis=1, keepdims=True)).all(), m


@pytest.mark.skipif(len(BUILDS) < 2, reason="one build of the block kernels runs on this CPU")
@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q8_0])
def test_the_builds_agree_bit_for_bit(qtype):
    """The avx512 build's vpdpwssd over 16 rows a vector and the avx2 build's vpmaddwd over 8 give each row the same
    exact integer block sums and the same fp32 operations: products, row lookups and the dequantized matrix are
    equal."""
    n, k = 200, 576
    blocks = _blocks(qtype, n, k, 17)
    lins = [QuantLinear(blocks, qtype, n, k, isa=isa) for isa in BUILDS]
    gen = torch.Generator().manual_seed(5)
    for m in (1, 2, 3, 4, 7, 8, 9, 33, PREFILL_ROWS):
        x = torch.randn(m, k, generator=gen) * torch.logspace(-3, 3, m)[:, None]
        first, *rest = [lin(x) for lin in lins]
        for other in rest:
            assert torch.equal(first, other), m
    ids = torch.tensor([0, 199, 15, 16, 17, 100])
    first, *rest = lins
    for other in rest:
        assert torch.equal(first.rows(ids), other.rows(ids))
        assert torch.equal(first.dequantized().clone(), other.dequantized().clone())


LEVELS = 2047   # the activations' quants: 12 bits, held in int16 (blocks.h quantize_block)


def quantize_q16_reference(x: np.ndarray) -> np.ndarray:
    """Rows [m, k] rounded as the kernels do: per 32-block, scale max|x| / 2047, quants rounded half to even;
    returned as the values the quants stand for (float64)."""
    m, k = x.shape
    blocks = x.reshape(m, k // 32, 32).astype(np.float32)
    amax = np.abs(blocks).max(axis=2, keepdims=True)
    inv = np.divide(np.float32(LEVELS), amax, out=np.zeros_like(amax), where=amax > 0)
    q = np.round(blocks * inv)
    assert np.abs(q).max() <= LEVELS
    return (q.astype(np.float64) * (amax.astype(np.float64) / LEVELS)).reshape(m, k)


@pytest.mark.parametrize("isa", BUILDS)
def test_12_bit_activations_at_extreme_values(isa):
    """Tiny, huge, all-zero and single-spike blocks: the 12-bit scheme's error stays within 2^-11 of each block's
    largest value times the weights, and an all-zero block contributes nothing (scale 0, no NaN)."""
    n, k = 8, 128
    blocks = _blocks(T.Q8_0, n, k, 13)
    w = reference_weights(blocks, T.Q8_0, n, k)
    lin = QuantLinear(blocks, T.Q8_0, n, k, isa=isa)
    x = torch.zeros(4, k)
    x[0] = torch.randn(k) * 1e-30
    x[1] = torch.randn(k) * 1e30
    x[2, 40] = 3.0                               # one spike, the rest of its block and the others zero
    x[3, :32] = torch.randn(32)                  # then three all-zero blocks
    got = lin(x).double().numpy()
    assert np.isfinite(got).all()
    ref = x.double().numpy() @ w.T
    bound = (np.abs(x.double().numpy()).reshape(4, -1, 32).max(axis=2) / LEVELS) @ np.abs(w).reshape(n, -1, 32).sum(axis=2).T
    assert (np.abs(got - ref) <= bound + 1e-6 * np.abs(ref)).all()
    assert np.abs(got[2] - 3.0 * w[:, 40]).max() <= 1e-6 * np.abs(w[:, 40]).max() * 3.0


@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q8_0])
def test_rows_and_full_dequantization_equal_the_reference(qtype, isa):
    n, k = 10, 64
    blocks = _blocks(qtype, n, k, 5)
    w = reference_weights(blocks, qtype, n, k)
    lin = QuantLinear(blocks, qtype, n, k, isa=isa)
    ids = torch.tensor([9, 0, 4, 4, 7])
    assert np.array_equal(lin.rows(ids).double().numpy(), w[ids.numpy()])
    assert np.array_equal(lin.dequantized().double().numpy(), w)


@pytest.mark.parametrize("isa", BUILDS)
def test_a_strided_row_and_leading_dims(isa):
    n, k = 12, 64
    blocks = _blocks(T.Q4_1, n, k, 9)
    w = reference_weights(blocks, T.Q4_1, n, k)
    lin = QuantLinear(blocks, T.Q4_1, n, k, isa=isa)
    x = torch.randn(4, 2 * k)[1:3, k:]                                  # rows with a stride, at an offset
    got = lin(x[None])
    assert got.shape == (1, 2, n)
    assert np.abs(got[0].double().numpy() - x.double().numpy() @ w.T).max() <= 1e-4 * np.abs(w).max() * k


def test_the_portable_path_where_the_kernels_are_off(monkeypatch):
    """No AVX2 (or $LLMSERVE_QUANT_KERNELS=0): the matrix is dequantized once and F.linear runs."""
    monkeypatch.setattr(kernels, "quant_library", lambda: None)
    n, k = 6, 64
    blocks = _blocks(T.Q4_1, n, k, 11)
    lin = QuantLinear(blocks, T.Q4_1, n, k)
    assert not lin.native and lin.held_bytes() == n * k * 4
    x = torch.randn(3, k)
    assert np.abs(lin(x).double().numpy() - x.double().numpy() @ reference_weights(blocks, T.Q4_1, n, k).T).max() < 1e-4
    assert np.array_equal(lin.rows(torch.tensor([5])).double().numpy(), reference_weights(blocks, T.Q4_1, n, k)[[5]])


@pytest.fixture
def amx_rows():
    """Sets from how many rows the avx512 build's integer products run on the AMX tiles (amx.h); skips where this
    CPU or process has no tiles; puts the default back."""
    if "avx512" not in BUILDS:
        pytest.skip("the avx512 build of the block kernels does not run here")
    lib = kernels.quant_build("avx512")
    if not lib.llmserve_quant_amx(kernels.AMX_MIN_ROWS):
        pytest.skip("no AMX tiles on this CPU (or the kernel refuses them)")
    yield lambda rows: lib.llmserve_quant_amx(rows)
    lib.llmserve_quant_amx(kernels.AMX_MIN_ROWS)


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q8_0])
@pytest.mark.parametrize("n,k", [(16, 32), (48, 96), (193, 576), (576, 1536)])
def test_the_amx_tiles_give_the_vnni_bits(amx_rows, qtype, n, k):
    """The AMX kernel splits each 12-bit quant into bytes (Q4_1: x >> 4 and x & 15 against 16w and w, one
    product; Q8_0: the int16's high and low bytes, two) and sums them exactly in the tiles, then runs tile_v16's
    fp32 steps in its order: every product is bit for bit the vpdpwssd one, at row counts that fill no tile (1-15
    rows left), one tile, and the 128-row chunks, with blocks at the extremes (±2047, one spike, all zero) and rows
    far apart in scale."""
    blocks = _blocks(qtype, n, k, 3 * n + k)
    lin = QuantLinear(blocks, qtype, n, k, isa="avx512")
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(300, k, generator=gen) * torch.logspace(-4, 4, 300)[torch.randperm(300, generator=gen), None]
    x[0] = 0.0
    x[1, :] = -1.0                                   # every quant -2047
    x[2, 5] = 7.0                                    # one spike: its block's quants 0 and 2047
    x[3, 0::2], x[3, 1::2] = 1e3, -1e3               # the largest sums of both signs
    for m in (1, 5, 15, 16, 17, 31, 64, 129, 300):
        amx_rows(0)
        vnni = lin(x[:m])
        amx_rows(1)
        assert torch.equal(lin(x[:m]), vnni), m
