"""The worker's forward step in process, against the stock transformers model.

The lean Llama step (services/worker/llama_step.py: fused projections, prepacked bfloat16 matmuls,
paged attention) must compute what the stock model computes: in float32 the same logits and the same
greedy tokens, in bfloat16 the same distribution within bfloat16's precision. Models it does not
describe run the stock forward with the paged attention; that path is checked on a small random
Llama with biases.
"""
from __future__ import annotations

import copy
import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from services.common.model_source import ModelSource, resolve_model
from services.worker import kernels, paged_attention
from services.worker.kv_cache import KVPool
from services.worker.linear import Linear
from services.worker.llama_step import LlamaStep
from services.worker.model_loader import ensure_safetensors
from services.worker.model_runner import ModelRunner, SeqWork

BLOCK = 16
PROMPT = [1] + list(range(300, 420))      # 121 tokens: eight blocks, the last one partly filled


def _stock(dtype: torch.dtype) -> torch.nn.Module:
    paged_attention.register()
    return AutoModelForCausalLM.from_pretrained(ensure_safetensors(resolve_model("smollm2")), dtype=dtype).eval()


def _lean_logits(model: torch.nn.Module, tokens: list[int], chunk: int) -> torch.Tensor:
    """Logits at every position, computed by LlamaStep in prefill chunks of ``chunk`` tokens (the later
    chunks read the earlier ones' keys and values from the paged pool), then one decode step."""
    cfg = model.config
    step = LlamaStep(copy.deepcopy(model))
    head = Linear(model.lm_head.weight)
    pool = KVPool(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, BLOCK, 64 * 2**20,
                  model.dtype, torch.device("cpu"))
    table = list(range(-(-len(tokens) // BLOCK)))
    out = []
    with torch.inference_mode():
        for start in range(0, len(tokens) - 1, chunk):
            piece = tokens[start:min(start + chunk, len(tokens) - 1)]
            out.append(_run(step, pool, piece, start, table))
        out.append(_run(step, pool, tokens[-1:], len(tokens) - 1, table))   # a decode row
        return head(torch.cat(out)).float()


def _run(step: LlamaStep, pool: KVPool, piece: list[int], start: int, table: list[int]) -> torch.Tensor:
    layout = paged_attention.StepLayout.build(pool, [(start, len(piece), table)], torch.device("cpu"))
    return step(torch.tensor(piece), torch.arange(start, start + len(piece)), layout)


@pytest.fixture(scope="module")
def stock_fp32() -> torch.nn.Module:
    return _stock(torch.float32)


def test_lean_step_equals_the_stock_forward_in_float32(stock_fp32):
    assert LlamaStep.supports(stock_fp32)
    with torch.inference_mode():
        ref = stock_fp32(input_ids=torch.tensor([PROMPT])).logits[0].float()
    lean = _lean_logits(stock_fp32, PROMPT, chunk=48)
    assert lean.shape == ref.shape
    assert torch.equal(lean.argmax(-1), ref.argmax(-1))
    assert (lean - ref).abs().max().item() < 1e-3, (lean - ref).abs().max().item()


def test_lean_step_in_bfloat16_matches_the_stock_bfloat16_forward(stock_fp32):
    model = _stock(torch.bfloat16)
    assert Linear(model.lm_head.weight).packed == torch.ops.mkldnn._is_mkldnn_bf16_supported()
    with torch.inference_mode():
        ref = model(input_ids=torch.tensor([PROMPT])).logits[0].float()
        exact = stock_fp32(input_ids=torch.tensor([PROMPT])).logits[0].float()
    lean = _lean_logits(model, PROMPT, chunk=48)
    cos = torch.nn.functional.cosine_similarity(lean, ref, dim=-1).min().item()
    # bfloat16 keeps 8 bits of mantissa: fused and prepacked matmuls round differently, but the
    # distributions must be the same one. The prompt's tokens are a run of ids, whose next tokens are often
    # near ties, so two bfloat16 forwards may disagree on 10-15% of the argmaxes (oneDNN on AMX tiles: 88% alike);
    # the lean step must be as close to the exact fp32 forward as the stock bfloat16 one is (AMX: 90% and 88%).
    def top1(x: torch.Tensor) -> float:
        return (x.argmax(-1) == exact.argmax(-1)).float().mean().item()
    assert top1(lean) >= top1(ref) - 0.02, (top1(lean), top1(ref))
    assert cos > 0.99, cos


def _greedy(runner: ModelRunner, prompts: list[list[int]], new_tokens: int, chunk: int = 32) -> list[list[int]]:
    """Greedy decoding through ModelRunner.execute, every sequence sharing each step, prompts prefilled
    in chunks (a chunk and the other sequences' decode rows share steps)."""
    tables, next_block = [], 0
    for p in prompts:
        n = -(-(len(p) + new_tokens) // BLOCK)
        tables.append(list(range(next_block, next_block + n)))
        next_block += n
    done = [0] * len(prompts)        # tokens of the prompt already run
    outs: list[list[int]] = [[] for _ in prompts]
    while any(len(o) < new_tokens for o in outs):
        work = []
        for i, p in enumerate(prompts):
            if len(outs[i]) >= new_tokens:
                continue
            if done[i] < len(p):
                ids = p[done[i]:done[i] + chunk]
                work.append(SeqWork(i, ids, done[i], tables[i], sample=done[i] + len(ids) == len(p)))
                done[i] += len(ids)
            else:
                work.append(SeqWork(i, [outs[i][-1]], len(p) + len(outs[i]) - 1, tables[i], sample=True))
        seq_ids, sampled, failed = runner.execute(work)
        assert not failed
        for seq_id, tok in zip(seq_ids, sampled.token_ids):
            outs[seq_id].append(tok)
    return outs


def _generate(model: torch.nn.Module, prompt: list[int], new_tokens: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_runner_greedy_equals_the_stock_model_with_mixed_lengths_sharing_steps(stock_fp32):
    runner = ModelRunner(resolve_model("smollm2"), "float32", "cpu", 64 * 2**20, BLOCK)
    prompts = [PROMPT, [1, 2051, 314, 260], list(range(500, 540))]
    got = _greedy(runner, prompts, new_tokens=12)
    assert got == [_generate(stock_fp32, p, 12) for p in prompts]


def test_a_row_whose_input_is_the_last_sampled_token_continues_the_sequence(stock_fp32):
    """One step in flight: the engine sends a decode row before it knows the token the previous step
    sampled (input_is_last_sampled); the worker feeds in that token itself. Greedy output is the same as
    with the token sent, and a row with no sampled token behind it fails alone with a reason."""
    runner = ModelRunner(resolve_model("smollm2"), "float32", "cpu", 64 * 2**20, BLOCK)
    prompt, new_tokens = list(range(500, 540)), 8
    table = list(range(-(-(len(prompt) + new_tokens) // BLOCK)))
    seq_ids, sampled, failed = runner.execute([SeqWork(1, prompt, 0, table, sample=True)])
    got = list(sampled.token_ids)
    for i in range(new_tokens - 1):
        orphan = SeqWork(2, [], 0, [0], sample=True, input_is_last_sampled=True)   # never sampled
        row = SeqWork(1, [], len(prompt) + i, table, sample=True, input_is_last_sampled=True)
        seq_ids, sampled, failed = runner.execute([row, orphan])
        assert seq_ids == [1] and "sampled none" in failed[2]
        got.extend(sampled.token_ids)
    assert got == _generate(stock_fp32, prompt, new_tokens)


def test_a_guessed_row_runs_as_sent_only_when_its_guess_and_position_hold(stock_fp32):
    """Speculation keeps the step overlap: the row after a row in flight is sent with a guess of the token that
    row samples and a draft after it, at the position the guess would have if the draft in flight held in full.
    The worker runs it as sent when both hold; else the token it sampled alone, where the sequence stands. Greedy,
    every outcome gives the stock model's tokens."""
    runner = ModelRunner(resolve_model("smollm2"), "float32", "cpu", 64 * 2**20, BLOCK)
    prompt = list(range(500, 540))
    truth = _generate(stock_fp32, prompt, 10)
    n = len(prompt)
    table = list(range(-(-(n + 24) // BLOCK)))

    def row(start: int, tokens: list[int]) -> tuple[list[int], int]:
        work = SeqWork(1, tokens, start, table, sample=True, input_is_last_sampled=True,
                       draft=tuple(tokens[1:]), num_generated=start + 1 - n)
        _, sampled, failed = runner.execute([work])
        assert not failed and not sampled.errors[0]
        return (list(sampled.accepted[0]) if sampled.accepted else []), sampled.token_ids[0]

    _, sampled, _ = runner.execute([SeqWork(1, prompt, 0, table, sample=True)])
    assert sampled.token_ids == [truth[0]]
    wrong = (truth[3] + 1) % runner.vocab_size
    # the guess holds: its draft runs and verifies (the third draft token is wrong)
    assert row(n, [truth[0], truth[1], truth[2], wrong]) == ([truth[1], truth[2]], truth[3])
    # sent as if that draft held in full (position n + 4): it did not, so the sampled token runs alone at n + 3
    assert row(n + 4, [truth[4], truth[5]]) == ([], truth[4])
    # a wrong guess at the right position: the sampled token alone
    assert row(n + 4, [wrong, truth[5]]) == ([], truth[5])
    # no guess: the sampled token, where it stands
    assert row(n + 5, []) == ([], truth[6])
    # the guess holds again, its whole draft too
    assert row(n + 6, [truth[6], truth[7], truth[8]]) == ([truth[7], truth[8]], truth[9])


def test_models_the_lean_step_does_not_describe_run_the_stock_forward(tmp_path):
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      attention_bias=True)  # biases: not what LlamaStep computes
    torch.manual_seed(0)
    tiny = LlamaForCausalLM(cfg).eval()
    for p in tiny.parameters():  # a random model's biases are zero: make them matter
        torch.nn.init.normal_(p, std=0.2)
    tiny.save_pretrained(tmp_path)
    assert not LlamaStep.supports(tiny)
    runner = ModelRunner(ModelSource("tiny", tmp_path, "safetensors"), "float32", "cpu", 8 * 2**20, BLOCK)
    prompts = [list(range(3, 70)), [5, 6, 7]]
    got = _greedy(runner, prompts, new_tokens=10, chunk=16)
    with torch.inference_mode():
        assert got == [_generate(tiny, p, 10) for p in prompts]


@pytest.mark.skipif(not kernels.cpu_supported(), reason="the decode attention kernel needs AVX-512 BF16")
def test_bfloat16_decode_rows_through_the_kernel_equal_sdpa():
    """One bfloat16 step of SmolLM2 with a prefill chunk between decode rows of contexts 1,500, 121 and 40
    (scattered block tables): the hidden states of every row through the C++ decode kernel equal those
    through SDPA within bfloat16 rounding, and each decode row's greedy pick is a top pick through SDPA."""
    runner = ModelRunner(resolve_model("smollm2"), "bfloat16", "cpu", 128 * 2**20, BLOCK)
    assert runner._attention_kernel is not None and runner._step is not None
    long_prompt = [1] + [300 + (i * 37) % 4000 for i in range(1499)]
    prompts = [long_prompt, PROMPT, list(range(500, 540)), list(range(700, 790))]
    tables, free = [], list(reversed(range(runner.pool.num_blocks)))   # from the top: not 0, 1, 2, ...
    for p in prompts:
        tables.append([free.pop() for _ in range(-(-(len(p) + 1) // BLOCK))][::-1])
    # the first three prompts are in the KV cache; the fourth has its first 30 tokens there
    for i, p in enumerate(prompts):
        ids = p[:-1] if i < 3 else p[:30]
        runner.execute([SeqWork(i, ids, 0, tables[i], sample=False)])
    seqs = [(len(prompts[0]) - 1, 1, tables[0]), (len(prompts[1]) - 1, 1, tables[1]),
            (30, 40, tables[3]), (len(prompts[2]) - 1, 1, tables[2])]
    ids = torch.tensor([prompts[0][-1], prompts[1][-1], *prompts[3][30:70], prompts[2][-1]])
    positions = torch.tensor([s for s, n, _ in seqs for s in range(s, s + n)])
    hidden = {}
    with torch.inference_mode():
        for name, kernel in (("kernel", runner._attention_kernel), ("sdpa", None)):
            layout = paged_attention.StepLayout.build(runner.pool, seqs, runner.device, kernel)
            assert (layout.kernel_rows is not None) == (kernel is not None)
            hidden[name] = runner._step(ids, positions, layout).float()
    cos = torch.nn.functional.cosine_similarity(hidden["kernel"], hidden["sdpa"], dim=-1)
    assert cos.min().item() > 0.995, cos
    # the token each decode row would pick through the kernel is a top token through SDPA too (bfloat16 logits
    # tie often: a 0.125 step at 25; the SmolLM2 logits here have exact ties in their top 3)
    weight = runner.model.lm_head.weight.float()
    decode_rows = torch.tensor([0, 1, 42])
    kernel_logits, sdpa_logits = (hidden[k][decode_rows] @ weight.T for k in ("kernel", "sdpa"))
    picked = sdpa_logits.gather(1, kernel_logits.argmax(-1, keepdim=True))[:, 0]
    assert bool((picked >= sdpa_logits.max(-1).values - 0.25).all()), (picked, sdpa_logits.max(-1).values)


def test_block_size_0_is_64_where_the_kernel_runs_else_16():
    fp32 = ModelRunner(resolve_model("smollm2"), "float32", "cpu", 16 * 2**20)
    assert fp32.pool.block_size == 16 and fp32._attention_kernel is None
    bf16 = ModelRunner(resolve_model("smollm2"), "bfloat16", "cpu", 16 * 2**20)
    assert bf16.pool.block_size == (64 if kernels.cpu_supported() else 16)
    assert ModelRunner(resolve_model("smollm2"), "bfloat16", "cpu", 16 * 2**20, 32).pool.block_size == 32


@pytest.mark.skipif(kernels.quant_library() is None, reason="the native block kernels need AVX2, FMA, F16C")
@pytest.mark.parametrize("fewer", [True, False])
def test_a_one_row_native_step_leaves_a_core_to_the_services_where_that_was_measured_to_pay(fewer, caplog):
    """A native step of one row over a short context runs on one thread fewer where the load-time probe found
    every thread not enough faster (the engine, router and client need a core for the token before it); steps of
    more rows or a longer context, and the worker afterwards, keep every thread. The probe leaves the pool and
    the worker's sequences as they were."""
    from services.worker.model_runner import SHORT_CONTEXT, ModelRunner, SeqWork

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with caplog.at_level(logging.INFO, logger="llmserve.worker.runner"):
            runner = ModelRunner(resolve_model("smollm2"), "native", "cpu", 32 * 2**20)   # 21 blocks of 64
    finally:
        torch.set_num_threads(before)
    assert "a one-row step over a short context" in caplog.text and not runner._history and not runner._next
    runner.one_row_fewer_threads = fewer
    seen: list[int] = []
    real = runner._step

    def spy(*args):  # type: ignore[no-untyped-def]
        seen.append(torch.get_num_threads())
        return real(*args)

    runner._step = spy
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        runner.execute([SeqWork(seq_id=1, token_ids=[1, 2, 3], start_pos=0, block_table=[0], sample=True)])
        runner.execute([SeqWork(seq_id=1, token_ids=[4], start_pos=3, block_table=[0], sample=True, num_generated=1)])
        runner.execute([SeqWork(seq_id=1, token_ids=[5], start_pos=4, block_table=[0], sample=True, num_generated=2),
                        SeqWork(seq_id=2, token_ids=[6], start_pos=0, block_table=[1], sample=True)])
        long = list(range(10, 10 + SHORT_CONTEXT + 1))
        runner.execute([SeqWork(seq_id=3, token_ids=long, start_pos=0, block_table=list(range(2, 12)), sample=True)])
        runner.execute([SeqWork(seq_id=3, token_ids=[7], start_pos=len(long), block_table=list(range(2, 12)),
                                sample=True, num_generated=1)])
        after = torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
    assert seen == [2, 1 if fewer else 2, 2, 2, 2] and after == 2


def test_native_logits_do_not_depend_on_what_the_cache_held():
    """Native: each position is computed by the arithmetic of its kind, whatever the step around it. A prompt's
    last logits are the same bits uncached, after a cache hit that leaves one token or a few to compute, and in
    any chunks; a sequence recomputed (after a preemption or a worker's restart) in one row of its prompt and
    generated tokens, or from any cut, gives the bits its one-token steps gave. (A one-token prompt remainder
    used to run as a decode row, and a recomputation's generated tokens as a prefill chunk: the next token then
    came from logits 0.008-0.03 apart, enough to flip a near tie.)"""
    from services.engine.models.tokenizer import Tokenizer

    source = resolve_model("smollm2")
    runner = ModelRunner(source, "native", "cpu", 32 * 2**20)   # 21 blocks of 64
    prompt = Tokenizer(source).hf("Paged attention keeps each sequence's keys and values in fixed-size blocks, "
                                  "so that a scheduler can admit, preempt and resume sequences without copying "
                                  "memory, and a prefix shared by many requests is stored once.")["input_ids"]
    n = len(prompt)
    assert 40 < n < 64 + 40
    logits: list[torch.Tensor] = []
    head = runner._lm_head
    runner._lm_head = lambda h: (logits.append(head(h)), logits[-1])[1]
    tables = iter([[2 * i, 2 * i + 1] for i in range(runner.pool.num_blocks // 2)])   # 128 tokens each
    seq_ids = iter(range(1, 100))

    def run(tokens: list[int], cuts: list[int], generated: int = 0) -> torch.Tensor:
        seq, table = next(seq_ids), next(tables)
        bounds = [0, *cuts, len(tokens)]
        for a, b in zip(bounds, bounds[1:]):
            _, _, failed = runner.execute([SeqWork(seq, tokens[a:b], a, table, sample=b == len(tokens),
                                                   num_generated=max(0, b - n) if b < len(tokens) else generated)])
            assert not failed
        runner.release([seq])
        return logits[-1][-1].clone()

    uncached = run(prompt, [])
    for cuts in ([n - 1], [n - 2], [n // 2], [3, n - 1]):
        assert torch.equal(run(prompt, cuts), uncached), cuts
    # five one-token steps after the prompt, then the same sequence recomputed
    seq, table = next(seq_ids), next(tables)
    runner.execute([SeqWork(seq, prompt, 0, table, sample=True)])
    out = [int(logits[-1][-1].argmax())]
    for g in range(1, 6):
        _, _, failed = runner.execute([SeqWork(seq, [out[-1]], n + g - 1, table, sample=True, num_generated=g)])
        assert not failed
        out.append(int(logits[-1][-1].argmax()))
    stepped = logits[-1][-1].clone()
    runner.release([seq])
    for cuts in ([], [n - 1], [n // 2], [n + 2]):
        assert torch.equal(run(prompt + out[:5], cuts, generated=5), stepped), cuts
