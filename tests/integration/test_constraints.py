"""Output constraints through real router → engine → worker processes (tiny random-weight model).

A random-weight model has no idea of JSON, so whatever it emits inside a constraint is the mask's
doing: each output must still match."""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import pytest

from llmserve.v1 import engine_admin_pb2, llm_pb2
from tests.helpers import wait_until

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def sampling(**kw) -> llm_pb2.SamplingParams:
    return llm_pb2.SamplingParams(temperature=kw.pop("temperature", 0), max_tokens=kw.pop("max_tokens", 48), **kw)


def test_json_schema_greedy_and_sampled(router):
    for temperature in (0.0, 1.0):
        resp = router.Generate(llm_pb2.GenerateRequest(prompt="A person:", sampling=sampling(
            json_schema=json.dumps(SCHEMA), temperature=temperature, seed=7)), timeout=60)
        assert resp.finish_reason == llm_pb2.FINISH_REASON_STOP, resp.text
        jsonschema.validate(json.loads(resp.text), SCHEMA)


def test_regex_choice_json_object_and_grammar(router):
    resp = router.Generate(llm_pb2.GenerateRequest(prompt="Phone:", sampling=sampling(
        regex=r"\(\d{3}\) \d{3}-\d{4}")), timeout=60)
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", resp.text), resp.text
    assert resp.finish_reason == llm_pb2.FINISH_REASON_STOP
    resp = router.Generate(llm_pb2.GenerateRequest(prompt="Answer:", sampling=sampling(
        choice=["yes", "no", "maybe not"], temperature=1.0)), timeout=60)
    assert resp.text in ("yes", "no", "maybe not")
    resp = router.Generate(llm_pb2.GenerateRequest(prompt="JSON:", sampling=sampling(json_object=True,
                                                                                    max_tokens=64)), timeout=60)
    if resp.finish_reason == llm_pb2.FINISH_REASON_STOP:
        assert isinstance(json.loads(resp.text), dict)
    else:  # cut by max_tokens: still a prefix of an object
        assert resp.text.startswith("{")
    resp = router.Generate(llm_pb2.GenerateRequest(prompt="Sum:", sampling=sampling(
        grammar='start: num " + " num\nnum: /[1-9][0-9]?/')), timeout=60)
    assert re.fullmatch(r"[1-9][0-9]? \+ [1-9][0-9]?", resp.text), resp.text


def test_stream_and_batch_are_constrained(router):
    req = llm_pb2.GenerateRequest(prompt="A person:", sampling=sampling(json_schema=json.dumps(SCHEMA)))
    unary = router.Generate(req, timeout=60)
    parts = list(router.GenerateStream(req, timeout=60))
    assert "".join(p.text for p in parts) == unary.text
    assert parts[-1].finish_reason == llm_pb2.FINISH_REASON_STOP
    batch = router.GenerateBatch(llm_pb2.GenerateBatchRequest(
        prompts=["one", "two", "three"], sampling=sampling(choice=["red", "green"], temperature=1.0)), timeout=60)
    assert [r.text in ("red", "green") for r in batch.results] == [True] * 3


@pytest.mark.parametrize("params, reason", [
    (dict(json_schema='{"type": "object"', max_tokens=8), "not JSON"),
    (dict(json_schema='{"type": "foo"}'), "foo"),
    (dict(regex="a(b"), "unclosed group"),
    (dict(grammar="start: nothing_defined"), "nothing_defined"),
    (dict(regex="a", choice=["a"]), "at most one"),
    (dict(json_object=True, ignore_eos=True), "ignore_eos"),
    (dict(choice=["a", ""]), "empty"),
    (dict(regex="a" * 70_000), "at most"),
])
def test_bad_constraints_are_invalid_argument_and_leak_nothing(router, engine_admin, params, reason):
    with pytest.raises(grpc.RpcError) as err:
        router.Generate(llm_pb2.GenerateRequest(prompt="x", sampling=sampling(**params)), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert reason in err.value.details()
    load = wait_until(lambda: (lambda x: x if x.num_running == 0 and x.num_kv_blocks_used == 0 else None)(
        engine_admin.GetLoad(engine_admin_pb2.GetLoadRequest(), timeout=10)), 30, "the engine to be idle")
    assert load.num_waiting == 0


def _stream(router, req: llm_pb2.GenerateRequest) -> tuple[str, list[int], int]:
    parts = list(router.GenerateStream(req, timeout=120))
    return "".join(p.text for p in parts), [t for p in parts for t in p.token_ids], parts[-1].finish_reason


def test_32_streams_half_constrained_half_free(router):
    """Constrained and free streams share steps: every constrained output validates, every free greedy
    output equals its run alone."""
    prompts = [f"Story {i}: once upon a time" for i in range(16)]
    free = llm_pb2.SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    with ThreadPoolExecutor(16) as pool:   # results (and errors) come back to this thread
        alone = list(pool.map(lambda p: _stream(router, llm_pb2.GenerateRequest(prompt=p, sampling=free))[1],
                              prompts))
    reqs = []
    for i, p in enumerate(prompts):
        reqs.append(llm_pb2.GenerateRequest(prompt=p, sampling=free))
        reqs.append(llm_pb2.GenerateRequest(prompt=p, sampling=sampling(json_schema=json.dumps(SCHEMA),
                                                                        temperature=1.0, seed=i)))
    with ThreadPoolExecutor(len(reqs)) as pool:
        results = list(pool.map(lambda r: _stream(router, r), reqs))
    for i in range(len(prompts)):
        assert results[2 * i][1] == alone[i]
        text, _, finish = results[2 * i + 1]
        assert finish == llm_pb2.FINISH_REASON_STOP, text
        jsonschema.validate(json.loads(text), SCHEMA)
