"""Structured output and tool calls on SmolLM2-135M-Instruct, through the real `openai` client and gRPC."""
from __future__ import annotations

import json
import re

import grpc
import jsonschema
import openai
import pytest
from openai import OpenAI
from pydantic import BaseModel, Field

from llmserve.v1 import engine_admin_pb2, engine_admin_pb2_grpc, llm_pb2
from tests.helpers import wait_until


class City(BaseModel):
    name: str = Field(max_length=24)
    country: str = Field(max_length=24)
    population_millions: int = Field(ge=0, le=50)


CITY_PROMPT = [{"role": "user", "content": "Describe Paris as JSON with its name, country and population."}]
WEATHER_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now.",
                                      "parameters": {"type": "object",
                                                     "properties": {"city": {"type": "string", "maxLength": 24}},
                                                     "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "description": "The local time in a city.",
                                      "parameters": {"type": "object",
                                                     "properties": {"city": {"type": "string", "maxLength": 24}},
                                                     "required": ["city"], "additionalProperties": False}}},
]
WEATHER_PROMPT = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(smol_stack) -> OpenAI:
    return OpenAI(base_url=f"http://{smol_stack.http_address}/v1", api_key="unused", timeout=120, max_retries=0)


def test_parse_returns_a_pydantic_object(client):
    completion = client.chat.completions.parse(model="SmolLM2-135M-Instruct", messages=CITY_PROMPT,
                                               response_format=City, temperature=0, max_tokens=80)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(choice.message.parsed, City)
    assert choice.message.parsed == City.model_validate_json(choice.message.content)


def test_parse_streaming(client):
    with client.chat.completions.stream(model="SmolLM2-135M-Instruct", messages=CITY_PROMPT, response_format=City,
                                        temperature=1.0, seed=3, max_tokens=80) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    assert isinstance(final.choices[0].message.parsed, City)


def test_response_format_on_completions_and_vllm_structured_outputs(client):
    out = client.completions.create(model="SmolLM2-135M-Instruct", prompt="A JSON object describing a cat:",
                                    max_tokens=60, temperature=0, extra_body={"response_format": {
                                        "type": "json_schema", "json_schema": {
                                            "name": "cat", "strict": True, "schema": City.model_json_schema()}}})
    City.model_validate_json(out.choices[0].text)
    regex = r"[A-Z][a-z]+, [A-Z][a-z]+"
    out = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=CITY_PROMPT, max_tokens=20,
                                         extra_body={"structured_outputs": {"regex": regex}}, temperature=1.0)
    # Sampled at temperature 1 the model may wander inside [a-z]+ until max_tokens: then the output is a valid
    # prefix of the pattern and the finish reason says it was cut.
    text, cut = out.choices[0].message.content, out.choices[0].finish_reason == "length"
    assert re.fullmatch(regex, text) or (cut and re.fullmatch(r"[A-Z][a-z]*(, ([A-Z][a-z]*)?)?", text)), text
    out = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=[
        {"role": "user", "content": "Is Paris in France? Answer yes or no."}], max_tokens=5, temperature=0,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert out.choices[0].message.content in ("yes", "no")
    out = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=CITY_PROMPT, max_tokens=60,
                                         response_format={"type": "json_object"}, temperature=0)
    assert isinstance(json.loads(out.choices[0].message.content), dict)


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}}, None),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "(("}}, None),
    ({"tools": WEATHER_TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
    ({"tools": "get_weather"}, "tools"),
])
def test_bad_structured_requests_are_400(client, body, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=WEATHER_PROMPT, max_tokens=8,
                                       extra_body=body)
    assert err.value.status_code == 400
    assert param is None or err.value.body["param"] == param


def _calls(message):
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def _stream_calls(client, **kw):
    """The tool calls of a streamed request, as the openai client's stream helper accumulates them."""
    with client.chat.completions.stream(**kw) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    return final.choices[0]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_required_and_named_tool_calls_stream_and_unary_agree(client, tool_choice):
    kw = dict(model="SmolLM2-135M-Instruct", messages=WEATHER_PROMPT, tools=WEATHER_TOOLS, tool_choice=tool_choice,
              max_tokens=60, temperature=1.0, seed=11)
    unary = client.chat.completions.create(**kw).choices[0]
    assert unary.finish_reason == "tool_calls"
    calls = _calls(unary.message)
    assert calls and all(name in ("get_weather", "get_time") and "city" in args for name, args in calls)
    if isinstance(tool_choice, dict):
        assert [name for name, _ in calls] == ["get_weather"]
    streamed = _stream_calls(client, **kw)
    assert streamed.finish_reason == "tool_calls"
    assert _calls(streamed.message) == calls
    assert [c.id for c in streamed.message.tool_calls] == [c.id for c in unary.message.tool_calls]


def test_parallel_tool_calls_false_gives_one_call(client):
    out = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=WEATHER_PROMPT, tools=WEATHER_TOOLS,
                                         tool_choice="required", parallel_tool_calls=False, max_tokens=60,
                                         temperature=1.0, seed=5)
    assert len(out.choices[0].message.tool_calls) == 1


def test_auto_parses_the_hermes_format(client):
    """auto with the call format forced (a grammar): the parser finds the call in the text."""
    grammar = ('start: "<tool_call>\\n{\\"name\\": \\"get_weather\\", \\"arguments\\": {\\"city\\": \\"" CITY '
               '"\\"}}\\n</tool_call>"\nCITY: /[A-Z][a-z]{2,10}/')
    kw = dict(model="SmolLM2-135M-Instruct", messages=WEATHER_PROMPT, tools=WEATHER_TOOLS, tool_choice="auto",
              max_tokens=40, temperature=0, extra_body={"structured_outputs": {"grammar": grammar}})
    unary = client.chat.completions.create(**kw).choices[0]
    assert unary.finish_reason == "tool_calls" and unary.message.content is None
    (name, args), = _calls(unary.message)
    assert name == "get_weather" and re.fullmatch(r"[A-Z][a-z]{2,10}", args["city"])
    streamed = _stream_calls(client, **kw)
    assert _calls(streamed.message) == [(name, args)]
    # The call and its result as history: the next turn is accepted and answered.
    follow = client.chat.completions.create(model="SmolLM2-135M-Instruct", tools=WEATHER_TOOLS, max_tokens=20,
                                            temperature=0, tool_choice="none", messages=[
        *WEATHER_PROMPT, unary.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": unary.message.tool_calls[0].id, "content": '{"celsius": 21}'}])
    assert follow.choices[0].message.content and not follow.choices[0].message.tool_calls


def test_auto_without_a_call_is_plain_content(client):
    out = client.chat.completions.create(model="SmolLM2-135M-Instruct", tools=WEATHER_TOOLS, max_tokens=12,
                                         temperature=0, messages=[{"role": "user", "content": "Say hello."}])
    choice = out.choices[0]
    if not choice.message.tool_calls:
        assert choice.message.content and choice.finish_reason in ("stop", "length")


def test_grpc_bad_constraint_leaves_the_engine_idle(smol_stack, smol):
    with grpc.insecure_channel(smol_stack.engines[0].address) as channel:
        admin = engine_admin_pb2_grpc.EngineAdminStub(channel)
        for sampling in (llm_pb2.SamplingParams(json_schema='{"type": 3}'), llm_pb2.SamplingParams(regex="[a-")):
            with pytest.raises(grpc.RpcError) as err:
                smol.Generate(llm_pb2.GenerateRequest(prompt="x", sampling=sampling), timeout=60)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as err:  # a constraint on an embedding model
            smol.Generate(llm_pb2.GenerateRequest(model="all-MiniLM-L6-v2", prompt="x",
                                                  sampling=llm_pb2.SamplingParams(json_object=True)), timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        wait_until(lambda: (lambda x: x.num_running == 0 and x.num_waiting == 0 and x.num_kv_blocks_used == 0)(
            admin.GetLoad(engine_admin_pb2.GetLoadRequest(), timeout=10)), 30, "the engine to be idle")
