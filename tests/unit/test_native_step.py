"""The native path's whole decode step in one C++ call (services/worker/native_step.py) against the same step
run op by op (``LlamaStep`` over ``QuantLinear`` and ``native_ops``): bit for bit, hidden states and the KV it
writes, over a small random Llama in Q4_1 and Q8_0 blocks, for decode rows of mixed lengths (past one 512-key
attention part), a speculative draft row's queries, fp16, fp16 keys with int8 values, and fp32 pools, one and two
threads."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quantize
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from services.worker import kernels, native_step, paged_attention, quant_linear
from services.worker.kv_cache import KVPool
from services.worker.llama_step import LlamaStep, _Layer
from services.worker.native_ops import NativeAttention, NativeLayerOps
from services.worker.native_step import NativeDecodeStep
from services.worker.quant_linear import QuantLinear

pytestmark = [pytest.mark.skipif(kernels.quant_library() is None, reason="the native kernels need AVX2, FMA, F16C"),
              pytest.mark.usefixtures("each_quant_build")]


CFG = LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  num_hidden_layers=3, vocab_size=50, max_position_embeddings=4096, rms_norm_eps=1e-5)


def _matrix(n: int, k: int, qtype: T, gen: np.random.Generator) -> QuantLinear:
    w = (gen.standard_normal((n, k)) * 0.2).astype(np.float32)
    return QuantLinear(quantize(w, qtype), qtype, n, k)


def _model() -> tuple[LlamaStep, NativeDecodeStep]:
    gen = np.random.default_rng(7)
    h, d, inter = CFG.hidden_size, CFG.head_dim, CFG.intermediate_size
    qkv_n = (CFG.num_attention_heads + 2 * CFG.num_key_value_heads) * d

    def norm() -> torch.Tensor:
        return torch.from_numpy((1 + 0.1 * gen.standard_normal(h)).astype(np.float32))

    layers = [_Layer(index=i, input_norm=norm(), post_norm=norm(),
                     qkv=_matrix(qkv_n, h, T.Q4_1, gen), o=_matrix(h, CFG.num_attention_heads * d, T.Q4_1, gen),
                     gate_up=_matrix(2 * inter, h, T.Q8_0 if i == 1 else T.Q4_1, gen),
                     down=_matrix(h, inter, T.Q4_1, gen)) for i in range(CFG.num_hidden_layers)]
    embed = _matrix(CFG.vocab_size, h, T.Q8_0, gen)
    final = norm()
    decode = NativeDecodeStep.build(layers, final, CFG, d)
    assert decode is not None
    step = LlamaStep.from_parts(CFG, embed.rows, LlamaRotaryEmbedding(config=CFG), final, layers,
                                NativeLayerOps.for_native(h, d, inter), decode)
    return step, decode


def _randomize(pool: KVPool, gen: torch.Generator) -> None:
    """Every slot's keys and values random (int8 values: integers of ±127 and a positive scale per head)."""
    for layer in range(CFG.num_hidden_layers):
        for cache in pool.layer(layer):
            if cache.dtype == torch.int8:
                d = cache.shape[-1] - 4
                cache[..., :d] = torch.randint(-127, 128, cache[..., :d].shape, generator=gen, dtype=torch.int8)
                scales = (torch.rand(cache.shape[:-1], generator=gen) * 0.05 + 0.001).contiguous()
                cache[..., d:] = scales.view(torch.int8).view(*cache.shape[:-1], 4)
            else:
                cache.copy_(torch.randn(cache.shape, generator=gen).to(cache.dtype))


def _step_inputs(pool: KVPool, seqs: list[tuple[int, int]], gen: torch.Generator, prefill: bool = False):
    """Decode rows (context, 1) and draft rows (context, n), or prefill chunks where ``prefill``: each sequence
    its own shuffled blocks."""
    bs = pool.block_size
    blocks = torch.randperm(pool.num_blocks, generator=gen).tolist()
    work, ids, positions, verify = [], [], [], set()
    for i, (start, n) in enumerate(seqs):
        need = -(-(start + n) // bs)
        table, blocks = blocks[:need], blocks[need:]
        assert len(table) == need, "the test's pool is too small: sequences would share slots"
        work.append((start, n, table))
        ids += torch.randint(0, CFG.vocab_size, (n,), generator=gen).tolist()
        positions += list(range(start, start + n))
        if n > 1 and not prefill:
            verify.add(i)
    kernel = NativeAttention.load(CFG.hidden_size, CFG.head_dim, CFG.intermediate_size)
    layout = paged_attention.StepLayout.build(pool, work, torch.device("cpu"), kernel, frozenset(verify))
    return torch.tensor(ids), torch.tensor(positions), layout


@pytest.mark.parametrize("kv_dtype,value_dtype,block_size", [(torch.float16, None, 64), (torch.float32, None, 16),
                                                              (torch.float16, torch.int8, 64)])
@pytest.mark.parametrize("seqs", [[(40, 1)], [(0, 1), (17, 1), (700, 1), (1300, 1), (63, 1)], [(90, 1), (520, 5)],
                                  [(i * 37 % 900, 1) for i in range(64)]])
def test_the_one_call_step_equals_the_op_by_op_step_bit_for_bit(seqs, kv_dtype, value_dtype, block_size, monkeypatch):
    step, decode = _model()
    if value_dtype is not None and not NativeAttention.load(CFG.hidden_size, CFG.head_dim, CFG.intermediate_size).q8:
        pytest.skip("int8 values run in the avx512 build, on a CPU with AVX-512 BF16")
    pool = KVPool(CFG.num_hidden_layers, CFG.num_key_value_heads, CFG.head_dim, block_size, 48 * 2**20, kv_dtype,
                  torch.device("cpu"), value_dtype)
    gen = torch.Generator().manual_seed(len(seqs))
    _randomize(pool, gen)   # earlier positions' keys, values
    before = pool.data.clone()
    ids, positions, layout = _step_inputs(pool, seqs, gen)
    assert decode.runs(layout)
    results = {}
    for fused in (False, True):
        monkeypatch.setattr(native_step, "FUSED", fused)
        pool.data.copy_(before)
        with torch.inference_mode():
            results[fused] = (step(ids, positions, layout).clone(), pool.data.clone())
    (ref, ref_kv), (got, got_kv) = results[False], results[True]
    assert torch.isfinite(ref).all() and ref.abs().max() > 0
    assert torch.equal(got, ref)
    assert torch.equal(got_kv, ref_kv) and not torch.equal(ref_kv, before)   # the same slots, the same bits


def test_the_one_call_step_does_not_depend_on_the_threads_or_the_rows_beside_it():
    step, decode = _model()
    pool = KVPool(CFG.num_hidden_layers, CFG.num_key_value_heads, CFG.head_dim, 64, 8 * 2**20, torch.float16,
                  torch.device("cpu"))
    gen = torch.Generator().manual_seed(3)
    _randomize(pool, gen)
    before = pool.data.clone()
    seqs = [(600, 1), (30, 1), (1100, 1), (5, 1)]
    ids, positions, layout = _step_inputs(pool, seqs, gen)
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3):   # 3: more threads than this machine's 2 cores (the barrier yields, it must not hang)
            torch.set_num_threads(n)
            pool.data.copy_(before)
            with torch.inference_mode():
                outs.append(step(ids, positions, layout).clone())
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    # row 2 alone, over the same blocks: the same bits as beside the others
    table = layout.kernel_rows.tables[2]
    bs = pool.block_size
    alone = paged_attention.StepLayout.build(pool, [(1100, 1, table[:-(-1101 // bs)].tolist())], torch.device("cpu"),
                                             NativeAttention.load(CFG.hidden_size, CFG.head_dim,
                                                                  CFG.intermediate_size))
    pool.data.copy_(before)
    with torch.inference_mode():
        single = step(ids[2:3], positions[2:3], alone)
    assert torch.equal(single[0], outs[1][2])


def test_which_steps_run_in_one_call():
    step, decode = _model()
    pool = KVPool(CFG.num_hidden_layers, CFG.num_key_value_heads, CFG.head_dim, 64, 8 * 2**20, torch.float16,
                  torch.device("cpu"))
    gen = torch.Generator().manual_seed(5)
    assert decode.runs(_step_inputs(pool, [(10, 1), (20, 3)], gen)[2])
    # a prefill chunk: op by op where the kernel runs it as a chunk; else its queries are decode rows, one call
    with_chunk = _step_inputs(pool, [(0, 8), (20, 1)], gen, prefill=True)[2]
    assert decode.runs(with_chunk) == (not NativeAttention.load(CFG.hidden_size, CFG.head_dim,
                                                                CFG.intermediate_size).prefill)
    assert not decode.runs(_step_inputs(pool, [(i, 1) for i in range(quant_linear.PREFILL_ROWS + 1)], gen)[2])
