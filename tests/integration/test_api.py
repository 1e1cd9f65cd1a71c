"""The public API through real router → engine → worker processes (tiny random-weight model)."""
from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from llmserve.v1 import engine_admin_pb2, llm_pb2
from tests.helpers import wait_until

GREEDY = llm_pb2.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def test_generate_returns_tokens_text_and_usage(router):
    resp = router.Generate(llm_pb2.GenerateRequest(prompt="Hello, I am", sampling=GREEDY, request_id="r-1"), timeout=60)
    assert resp.request_id == "r-1" and resp.sequence_id > 0
    assert len(resp.token_ids) == 12 and resp.text
    assert resp.finish_reason == llm_pb2.FINISH_REASON_LENGTH
    assert resp.usage.prompt_tokens == 4 and resp.usage.completion_tokens == 12


def test_default_request_works(router):
    resp = router.Generate(llm_pb2.GenerateRequest(prompt="Hello, I am"), timeout=60)
    assert resp.finish_reason in (llm_pb2.FINISH_REASON_LENGTH, llm_pb2.FINISH_REASON_STOP)
    assert 1 <= resp.usage.completion_tokens <= 64


def test_stream_concatenation_equals_unary(router):
    req = llm_pb2.GenerateRequest(prompt="The weather is", sampling=GREEDY)
    unary = router.Generate(req, timeout=60)
    parts = list(router.GenerateStream(req, timeout=60))
    assert len(parts) >= 2  # deltas a slow reader missed are coalesced, so the count can vary
    assert "".join(p.text for p in parts) == unary.text
    assert [t for p in parts for t in p.token_ids] == list(unary.token_ids)
    assert all(p.finish_reason == llm_pb2.FINISH_REASON_UNSPECIFIED for p in parts[:-1])
    assert parts[-1].finish_reason == llm_pb2.FINISH_REASON_LENGTH
    assert parts[-1].usage.completion_tokens == 12


def test_batch_results_in_prompt_order(router):
    prompts = ["Hello, I am", "The weather is", "I want to", "The best way to"]
    batch = router.GenerateBatch(llm_pb2.GenerateBatchRequest(prompts=prompts, sampling=GREEDY), timeout=120)
    assert len(batch.results) == 4
    assert len({r.sequence_id for r in batch.results}) == 4
    for prompt, result in zip(prompts, batch.results):
        alone = router.Generate(llm_pb2.GenerateRequest(prompt=prompt, sampling=GREEDY), timeout=60)
        assert list(result.token_ids) == list(alone.token_ids)  # greedy: the batch changes nothing


def test_seeded_sampling_is_reproducible_whatever_shares_the_batch(router):
    sampling = llm_pb2.SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)
    req = llm_pb2.GenerateRequest(prompt="I want to", sampling=sampling)
    alone = router.Generate(req, timeout=60)
    others = [llm_pb2.GenerateRequest(prompt=f"other prompt {i}", sampling=llm_pb2.SamplingParams(
        temperature=1.0, max_tokens=16)) for i in range(1, 4)]
    with ThreadPoolExecutor(4) as pool:  # results (and errors) come back to this thread
        futures = [pool.submit(router.Generate, r, timeout=60) for r in [req, *others]]
        results = [f.result(timeout=120) for f in futures]
    assert list(results[0].token_ids) == list(alone.token_ids)
    other_seed = router.Generate(llm_pb2.GenerateRequest(prompt="I want to", sampling=llm_pb2.SamplingParams(
        temperature=1.0, seed=99, max_tokens=16, ignore_eos=True)), timeout=60)
    assert list(other_seed.token_ids) != list(alone.token_ids)


def test_stop_string_ends_generation_and_is_not_returned(router):
    full = router.Generate(llm_pb2.GenerateRequest(prompt="Hello, I am", sampling=GREEDY), timeout=60)
    # pick a stop string from the middle of the greedy text
    text = full.text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop.strip(), f"greedy text too short to pick a stop string from: {text!r}"
    resp = router.Generate(llm_pb2.GenerateRequest(prompt="Hello, I am", sampling=llm_pb2.SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, stop=[stop])), timeout=60)
    assert resp.finish_reason == llm_pb2.FINISH_REASON_STOP
    assert resp.text == text[: text.find(stop)]


def test_stop_string_in_a_shared_batch_leaves_the_others_intact_and_frees_its_blocks(router, engine_admin):
    # The engine finds stop strings while the worker already runs the next step (which still holds
    # the stopped sequence): the stopped one must end exactly, and the other must not notice.
    full = router.Generate(llm_pb2.GenerateRequest(prompt="Hello, I am", sampling=GREEDY), timeout=60)
    other_alone = router.Generate(llm_pb2.GenerateRequest(prompt="The weather is", sampling=llm_pb2.SamplingParams(
        temperature=0, max_tokens=30, ignore_eos=True)), timeout=60)
    stop = full.text[len(full.text) // 2: len(full.text) // 2 + 3]
    requests = {
        "stopped": llm_pb2.GenerateRequest(prompt="Hello, I am", sampling=llm_pb2.SamplingParams(
            temperature=0, max_tokens=12, ignore_eos=True, stop=[stop])),
        "other": llm_pb2.GenerateRequest(prompt="The weather is", sampling=llm_pb2.SamplingParams(
            temperature=0, max_tokens=30, ignore_eos=True)),
    }
    with ThreadPoolExecutor(2) as pool:  # results (and errors) come back to this thread
        futures = {name: pool.submit(router.Generate, req, timeout=60) for name, req in requests.items()}
        results = {name: f.result(timeout=120) for name, f in futures.items()}
    assert results["stopped"].finish_reason == llm_pb2.FINISH_REASON_STOP
    assert results["stopped"].text == full.text[: full.text.find(stop)]
    assert list(results["other"].token_ids) == list(other_alone.token_ids)
    wait_until(lambda: engine_admin.GetLoad(engine_admin_pb2.GetLoadRequest(), timeout=5).num_kv_blocks_used == 0,
               30, "both sequences to release their KV blocks")


def test_logprobs_are_returned_when_asked(router):
    resp = router.Generate(llm_pb2.GenerateRequest(prompt="Hello", sampling=llm_pb2.SamplingParams(
        temperature=0, max_tokens=3, ignore_eos=True, logprobs=2)), timeout=60)
    assert len(resp.logprobs) == 3
    for lp, tok in zip(resp.logprobs, resp.token_ids):
        assert lp.token_id == tok and lp.logprob <= 0 and len(lp.top) == 2
        assert lp.top[0].token_id == tok  # greedy picks the most likely token
        assert math.isclose(lp.top[0].logprob, lp.logprob, rel_tol=1e-5, abs_tol=1e-6)


BAD_REQUESTS = [
    ("empty prompt", llm_pb2.GenerateRequest(), grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty"),
    ("prompt and messages", llm_pb2.GenerateRequest(prompt="a", messages=[llm_pb2.ChatMessage(role="user", content="b")]),
     grpc.StatusCode.INVALID_ARGUMENT, "either prompt or messages"),
    ("bad role", llm_pb2.GenerateRequest(messages=[llm_pb2.ChatMessage(role="robot", content="b")]),
     grpc.StatusCode.INVALID_ARGUMENT, "role"),
    ("prompt too long", llm_pb2.GenerateRequest(prompt="hello " * 600), grpc.StatusCode.INVALID_ARGUMENT, "context"),
    ("max_tokens 0", llm_pb2.GenerateRequest(prompt="a", sampling=llm_pb2.SamplingParams(max_tokens=0)),
     grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
    ("max_tokens above context", llm_pb2.GenerateRequest(prompt="a", sampling=llm_pb2.SamplingParams(max_tokens=100000)),
     grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
    ("negative temperature", llm_pb2.GenerateRequest(prompt="a", sampling=llm_pb2.SamplingParams(temperature=-1)),
     grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    ("NaN temperature", llm_pb2.GenerateRequest(prompt="a", sampling=llm_pb2.SamplingParams(temperature=float("nan"))),
     grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    ("top_p 0", llm_pb2.GenerateRequest(prompt="a", sampling=llm_pb2.SamplingParams(top_p=0)),
     grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    ("top_p above 1", llm_pb2.GenerateRequest(prompt="a", sampling=llm_pb2.SamplingParams(top_p=1.5)),
     grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    ("negative top_k", llm_pb2.GenerateRequest(prompt="a", sampling=llm_pb2.SamplingParams(top_k=-1)),
     grpc.StatusCode.INVALID_ARGUMENT, "top_k"),
    ("tiny repetition_penalty", llm_pb2.GenerateRequest(prompt="a", sampling=llm_pb2.SamplingParams(
        repetition_penalty=1e-38)), grpc.StatusCode.INVALID_ARGUMENT, "repetition_penalty must be in [0.01, 100]"),
    ("huge repetition_penalty", llm_pb2.GenerateRequest(prompt="a", sampling=llm_pb2.SamplingParams(
        repetition_penalty=1e38)), grpc.StatusCode.INVALID_ARGUMENT, "repetition_penalty"),
    ("unknown model", llm_pb2.GenerateRequest(model="no-such-model", prompt="a"), grpc.StatusCode.NOT_FOUND,
     "ListModels"),
    # A 20 kB name echoed whole overflowed gRPC's metadata limit (RESOURCE_EXHAUSTED "Stream removed").
    ("huge unknown model name", llm_pb2.GenerateRequest(model="m" * 20_000, prompt="a"), grpc.StatusCode.NOT_FOUND,
     "(20000 characters)"),
    ("internal resume fields", llm_pb2.GenerateRequest(prompt="a", resume_token_ids=[1, 2]),
     grpc.StatusCode.INVALID_ARGUMENT, "internal to the router"),
    # It travels as metadata: a control character in it used to fail the call inside gRPC (INTERNAL).
    ("control character in request_id", llm_pb2.GenerateRequest(prompt="a", request_id="\x1f"),
     grpc.StatusCode.INVALID_ARGUMENT, "printable ASCII"),
]


@pytest.mark.parametrize("name,request_pb,code,words", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_input_gets_a_clear_status(router, name, request_pb, code, words):
    for call in (router.Generate, lambda r, timeout: list(router.GenerateStream(r, timeout=timeout))):
        with pytest.raises(grpc.RpcError) as err:
            call(request_pb, timeout=30)
        assert err.value.code() == code, err.value.details()
        assert words in err.value.details()


def test_bad_batches(router):
    with pytest.raises(grpc.RpcError) as err:
        router.GenerateBatch(llm_pb2.GenerateBatchRequest(prompts=[]), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompts is empty" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        router.GenerateBatch(llm_pb2.GenerateBatchRequest(prompts=["a"] * 9), timeout=30)  # max is 8 here
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "maximum of 8" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        router.GenerateBatch(llm_pb2.GenerateBatchRequest(prompts=["a", ""]), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompts[1]" in err.value.details()


def test_bad_input_does_not_disturb_requests_in_flight(router):
    stream = router.GenerateStream(llm_pb2.GenerateRequest(prompt="Hello", sampling=llm_pb2.SamplingParams(
        temperature=0, max_tokens=40, ignore_eos=True)), timeout=120)
    first = next(stream)
    for _, request_pb, _, _ in BAD_REQUESTS:
        with pytest.raises(grpc.RpcError):
            router.Generate(request_pb, timeout=30)
    rest = list(stream)
    assert len(first.token_ids) + sum(len(p.token_ids) for p in rest) == 40
    assert rest[-1].finish_reason == llm_pb2.FINISH_REASON_LENGTH


def test_cancelled_stream_frees_its_sequence(router, engine_admin):
    def idle() -> bool:
        load = engine_admin.GetLoad(engine_admin_pb2.GetLoadRequest(), timeout=5)
        return load.num_running == 0 and load.num_waiting == 0 and load.num_kv_blocks_used == 0

    wait_until(idle, 60, "the engine to be idle before the test")
    stream = router.GenerateStream(llm_pb2.GenerateRequest(prompt="Hello", sampling=llm_pb2.SamplingParams(
        temperature=0, max_tokens=400, ignore_eos=True)), timeout=120)
    for _ in range(3):
        next(stream)
    load = engine_admin.GetLoad(engine_admin_pb2.GetLoadRequest(), timeout=5)
    assert load.num_running == 1 and load.num_kv_blocks_used > 0
    stream.cancel()
    wait_until(idle, 30, "the cancelled sequence to release its KV blocks")


def test_deadline_exceeded_frees_the_sequence(router, engine_admin):
    # Work that cannot finish inside the deadline however fast the machine: 8 sequences of 480 tokens, one a
    # step each (no speculation: the tiny model's looping output would be drafted 9 tokens a step).
    with pytest.raises(grpc.RpcError) as err:
        router.GenerateBatch(llm_pb2.GenerateBatchRequest(prompts=[f"Hello {i}" for i in range(8)],
                                                          sampling=llm_pb2.SamplingParams(
            temperature=0, max_tokens=480, ignore_eos=True, disable_speculation=True)), timeout=0.5)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: engine_admin.GetLoad(engine_admin_pb2.GetLoadRequest(), timeout=5).num_kv_blocks_used == 0,
               30, "the expired sequence to release its KV blocks")


def test_list_models_and_predict(router):
    models = router.ListModels(llm_pb2.ListModelsRequest(), timeout=30).models
    assert len(models) == 1 and models[0].loaded and models[0].task == "text-generation"
    assert models[0].context_length == 512 and models[0].loaded_on
    by_id = router.Generate(llm_pb2.GenerateRequest(model=models[0].id, prompt="a", sampling=GREEDY), timeout=60)
    by_name = router.Generate(llm_pb2.GenerateRequest(model=models[0].name, prompt="a", sampling=GREEDY), timeout=60)
    assert by_id.token_ids == by_name.token_ids
    # Predict on a text-generation model returns the completion (multi-model serving)
    predicted = router.Predict(llm_pb2.PredictRequest(model_id=models[0].id, input_data="a"), timeout=60)
    assert predicted.WhichOneof("result") == "text" and predicted.model_id == models[0].id


def test_chat_messages_use_the_chat_template(router):
    chat = router.Generate(llm_pb2.GenerateRequest(messages=[llm_pb2.ChatMessage(role="user", content="Hi")],
                                                   sampling=GREEDY), timeout=60)
    # SmolLM2's template adds a system prompt and role markers around the one short message
    assert chat.usage.prompt_tokens > 10


def test_extreme_but_valid_sampling_values_are_served_beside_others(router):
    """temperature=1e-45 (raised to the 0.01 minimum), the penalty bounds and a huge temperature
    all complete, and greedy requests in the same batch are not disturbed."""
    greedy = llm_pb2.GenerateRequest(prompt="Hello, I am", sampling=GREEDY)
    expected = router.Generate(greedy, timeout=60).token_ids
    extremes = [llm_pb2.SamplingParams(temperature=1e-45, max_tokens=12, ignore_eos=True),
                llm_pb2.SamplingParams(temperature=1e-45, repetition_penalty=0.01, max_tokens=12, ignore_eos=True),
                llm_pb2.SamplingParams(temperature=1e30, repetition_penalty=100, max_tokens=12, ignore_eos=True),
                llm_pb2.SamplingParams(temperature=3.4e38, top_k=1, max_tokens=12, ignore_eos=True)]
    calls = [router.Generate.future(llm_pb2.GenerateRequest(prompt="The weather is", sampling=s), timeout=60)
             for s in extremes]
    calls += [router.Generate.future(greedy, timeout=60) for _ in range(3)]
    results = [c.result() for c in calls]
    assert all(len(r.token_ids) == 12 for r in results)
    assert all(r.token_ids == expected for r in results[len(extremes):])


def test_huge_inputs_are_refused_before_any_work(router):
    """20 MB of prompt (30 s of tokenizing before) and 5 MB of Predict input (14 s) are refused at once:
    a 10 s deadline is far more than the check needs."""
    with pytest.raises(grpc.RpcError) as err:
        router.Generate(llm_pb2.GenerateRequest(prompt="hello " * 3_500_000), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "characters" in err.value.details()
    chat = [llm_pb2.ChatMessage(role="user", content="hi " * 7_000_000)]
    with pytest.raises(grpc.RpcError) as err:
        list(router.GenerateStream(llm_pb2.GenerateRequest(messages=chat), timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "characters" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        router.Predict(llm_pb2.PredictRequest(input_data="spam " * 1_000_000), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "characters" in err.value.details()
