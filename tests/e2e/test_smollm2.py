"""End to end on SmolLM2-135M-Instruct through router → engine → worker."""
from __future__ import annotations

import threading

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import grpc

from llmserve.v1 import engine_admin_pb2, engine_admin_pb2_grpc, llm_pb2, llm_pb2_grpc
from services.common.model_source import resolve_model
from services.stack import start_service

SYSTEM = ("You are a helpful assistant who answers briefly and precisely, with facts only, "
          "and never makes anything up. Question: ")
CORE_PROMPTS = [SYSTEM + q for q in ("What is a cat?", "Why is the sky blue?", "Where is Rome?", "Who wrote Hamlet?")]
SEED_PROMPTS = ["Hello, I am", "The weather is", "I want to", "The best way to", "The most efficient way to"]
NUM_TOKENS = 40
GREEDY = llm_pb2.SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(smol_stack) -> dict[str, list[int]]:
    """Plain transformers greedy decode of each prompt alone (float32, KV cache, no EOS stop)."""
    source = resolve_model("smollm2")
    model = AutoModelForCausalLM.from_pretrained(source.cache_dir / "model", dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(source.cache_dir / "tokenizer")
    out = {}
    with torch.inference_mode():
        for prompt in SEED_PROMPTS + CORE_PROMPTS:
            ids = torch.tensor([tok(prompt)["input_ids"]])
            cache, generated = None, []
            for _ in range(NUM_TOKENS):
                step = model(input_ids=ids, cache=cache, use_cache=True)
                cache = step.cache if hasattr(step, "cache") else step.past_key_values
                nxt = int(step.logits[0, -1].argmax())
                generated.append(nxt)
                ids = torch.tensor([[nxt]])
            out[prompt] = generated
    return out


def test_capital_of_france(smol):
    resp = smol.Generate(llm_pb2.GenerateRequest(
        messages=[llm_pb2.ChatMessage(role="user", content="What is the capital of France?")],
        sampling=llm_pb2.SamplingParams(temperature=0, max_tokens=32)), timeout=120)
    assert "Paris" in resp.text


def test_batch_of_the_seed_prompts(smol):
    batch = smol.GenerateBatch(llm_pb2.GenerateBatchRequest(
        prompts=SEED_PROMPTS, sampling=llm_pb2.SamplingParams(temperature=0, max_tokens=16)), timeout=300)
    assert len(batch.results) == 5
    assert all(r.text.strip() for r in batch.results)
    assert len({r.sequence_id for r in batch.results}) == 5
    for prompt, result in zip(SEED_PROMPTS, batch.results):
        alone = smol.Generate(llm_pb2.GenerateRequest(prompt=prompt, sampling=llm_pb2.SamplingParams(
            temperature=0, max_tokens=16)), timeout=120)
        assert result.text == alone.text  # in prompt order


def test_stream_concatenates_to_the_unary_result(smol):
    req = llm_pb2.GenerateRequest(messages=[llm_pb2.ChatMessage(role="user", content="Name three colors.")],
                                  sampling=llm_pb2.SamplingParams(temperature=0, max_tokens=32))
    unary = smol.Generate(req, timeout=120)
    parts = list(smol.GenerateStream(req, timeout=120))
    assert len(parts) > 3
    assert "".join(p.text for p in parts) == unary.text
    assert [t for p in parts for t in p.token_ids] == list(unary.token_ids)


def test_greedy_equals_plain_transformers_alone(smol, reference):
    for prompt in SEED_PROMPTS:
        resp = smol.Generate(llm_pb2.GenerateRequest(prompt=prompt, sampling=GREEDY), timeout=120)
        assert list(resp.token_ids) == reference[prompt], prompt


def test_greedy_equals_plain_transformers_while_sharing_the_batch(smol, reference):
    results: dict[str, list[int]] = {}
    errors: list[BaseException] = []

    def greedy(prompt: str) -> None:
        try:
            resp = smol.Generate(llm_pb2.GenerateRequest(prompt=prompt, sampling=GREEDY), timeout=300)
            results[prompt] = list(resp.token_ids)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    def noise(i: int) -> None:
        try:
            smol.Generate(llm_pb2.GenerateRequest(prompt=f"Tell me a story about the number {i}.",
                                                  sampling=llm_pb2.SamplingParams(temperature=0.8, max_tokens=24 + i)),
                          timeout=300)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=greedy, args=(p,)) for p in SEED_PROMPTS]
    threads += [threading.Thread(target=noise, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for prompt in SEED_PROMPTS:
        assert results[prompt] == reference[prompt], prompt
    # and through GenerateBatch, where all five share every step
    batch = smol.GenerateBatch(llm_pb2.GenerateBatchRequest(prompts=SEED_PROMPTS, sampling=GREEDY), timeout=300)
    assert [list(r.token_ids) for r in batch.results] == [reference[p] for p in SEED_PROMPTS]


def test_greedy_is_exact_through_chunking_preemption_and_prefix_cache(reference, tmp_path):
    """A small KV pool (8 blocks of 16 tokens) forces preemption, a 16-token step budget forces
    chunked prefill, and a shared system prompt hits the prefix cache; output must not change."""
    engine = start_service("services.engine", ["--model", "smollm2", "--dtype", "float32", "--kv-cache-mb", "6",
                                               "--max-num-batched-tokens", "16"], log_path=tmp_path / "engine.log")
    try:
        with grpc.insecure_channel(engine.address) as channel:
            stub = llm_pb2_grpc.LLMServiceStub(channel)
            admin = engine_admin_pb2_grpc.EngineAdminStub(channel)
            first = stub.Generate(llm_pb2.GenerateRequest(prompt=CORE_PROMPTS[0], sampling=GREEDY), timeout=300)
            assert list(first.token_ids) == reference[CORE_PROMPTS[0]]
            results: dict[str, list[int]] = {}

            def run(prompt: str) -> None:
                resp = stub.Generate(llm_pb2.GenerateRequest(prompt=prompt, sampling=GREEDY), timeout=300)
                results[prompt] = list(resp.token_ids)

            threads = [threading.Thread(target=run, args=(p,)) for p in CORE_PROMPTS]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            for prompt in CORE_PROMPTS:
                assert results[prompt] == reference[prompt], prompt
            load = admin.GetLoad(engine_admin_pb2.GetLoadRequest(), timeout=10)
            assert load.num_preemptions > 0, "the test must exercise preemption"
            assert load.prefix_cache_hit_rate > 0.2, "the shared system prompt must hit the prefix cache"
            assert load.num_kv_blocks_total == 8 and load.num_kv_blocks_used == 0
    finally:
        engine.stop()


def test_seeded_sampling_is_reproducible_across_batch_mixes(smol):
    sampling = llm_pb2.SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=2024, max_tokens=24, ignore_eos=True)
    req = llm_pb2.GenerateRequest(prompt="Once upon a time", sampling=sampling)
    alone = list(smol.Generate(req, timeout=120).token_ids)
    # the same request inside a batch of other prompts, and beside concurrent unseeded requests
    batch = smol.GenerateBatch(llm_pb2.GenerateBatchRequest(
        prompts=["The weather is", "Once upon a time", "I want to"], sampling=sampling), timeout=300)
    assert list(batch.results[1].token_ids) == alone
    mixed: dict[str, list[int]] = {}

    def run(name: str, r: llm_pb2.GenerateRequest) -> None:
        mixed[name] = list(smol.Generate(r, timeout=300).token_ids)

    others = [llm_pb2.GenerateRequest(prompt=f"Story number {i}:", sampling=llm_pb2.SamplingParams(
        temperature=1.0, max_tokens=10 + 7 * i)) for i in range(3)]
    threads = [threading.Thread(target=run, args=("seeded", req))]
    threads += [threading.Thread(target=run, args=(f"other{i}", r)) for i, r in enumerate(others)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert mixed["seeded"] == alone


def _long_prompt(num_sentences: int = 80) -> str:
    """About 1,500 tokens of varied text (numbers keep it from being one repeated block)."""
    subjects = ["river", "lantern", "orchard", "harbor", "glacier", "market", "violin", "comet"]
    sentences = [f"Note {i}: the {subjects[i % 8]} near house {i * 7 % 101} was {i * 13 % 37} meters away."
                 for i in range(num_sentences)]
    return " ".join(sentences) + " Summarize the notes above in one sentence:"


@pytest.mark.timeout(1500)  # 31 prompts and their plain-transformers references on a 2-core machine
def test_greedy_is_exact_when_a_long_prompt_shares_steps_with_short_ones(smol):
    """A 1,500-token prompt and 30 short ones in one batch: the long prompt's prefill chunks run beside
    the short ones' prefills and decodes, and its decodes beside theirs (ragged attention: decode rows
    grouped by context length, prefill chunks on their own). Every greedy output (float32) equals plain
    transformers running that prompt alone."""
    num_tokens = 12
    short = [f"Question {i}: what is {i} plus {i * 3}? Answer:" for i in range(30)]
    long_prompt = _long_prompt()
    prompts = short[:10] + [long_prompt] + short[10:]  # shorts start before, and are admitted after, the long one
    source = resolve_model("smollm2")
    model = AutoModelForCausalLM.from_pretrained(source.cache_dir / "model", dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(source.cache_dir / "tokenizer")
    long_len = len(tok(long_prompt)["input_ids"])
    assert 1400 <= long_len <= 1700, long_len
    batch = smol.GenerateBatch(llm_pb2.GenerateBatchRequest(
        prompts=prompts, sampling=llm_pb2.SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)),
        timeout=600)
    assert len(batch.results) == len(prompts)
    assert batch.results[10].usage.prompt_tokens == long_len
    with torch.inference_mode():
        for prompt, result in zip(prompts, batch.results):
            ids = torch.tensor([tok(prompt)["input_ids"]])
            cache, generated = None, []
            for _ in range(num_tokens):
                step = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
                cache = step.cache if hasattr(step, "cache") else step.past_key_values
                generated.append(int(step.logits[0, -1].argmax()))
                ids = torch.tensor([[generated[-1]]])
            assert list(result.token_ids) == generated, prompt[:40]
