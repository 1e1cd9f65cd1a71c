"""The HTTP face's structured-output and tool-calling mappings (pure functions, no processes)."""
from __future__ import annotations

import json

import pytest

from llmserve.v1 import llm_pb2
from services.router import openai_schema as schema
from services.router.openai_schema import BadRequest
from services.router.structured import apply_structured
from services.router.tools import ToolStreamChunks, plan_tools, rewrite_reply

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "get_time"}}]
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


def spec_of(body: dict, chat: bool = True) -> schema.GenerationSpec:
    spec = schema.generation_request(body, chat, 8, "rid")
    apply_structured(body, spec.requests)
    return spec


def test_response_format_and_structured_outputs_map_to_the_constraint_fields():
    s = spec_of({"messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": {
        "name": "w", "strict": True, "schema": {"type": "object"}}}}).requests[0].sampling
    assert json.loads(s.json_schema) == {"type": "object"}
    assert spec_of({"prompt": "x", "response_format": {"type": "json_object"}}, chat=False).requests[0].sampling.json_object
    assert spec_of({"messages": MESSAGES, "response_format": {"type": "text"}}).requests[0].sampling == llm_pb2.SamplingParams()
    assert list(spec_of({"messages": MESSAGES, "n": 2, "structured_outputs": {"choice": ["a", "b"]}})
                .requests[1].sampling.choice) == ["a", "b"]
    assert spec_of({"messages": MESSAGES, "guided_regex": "[0-9]+"}).requests[0].sampling.regex == "[0-9]+"
    assert spec_of({"messages": MESSAGES, "structured_outputs": {"json": '{"type": "array"}'}}).requests[0] \
        .sampling.json_schema == '{"type": "array"}'


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "bad name!", "schema": {}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": "x"}}}, "response_format"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs"),
    ({"structured_outputs": {"xml": "<a/>"}}, "structured_outputs"),
    ({"structured_outputs": "regex"}, "structured_outputs"),
])
def test_malformed_or_second_constraints_are_400(body, param):
    with pytest.raises(BadRequest) as err:
        spec_of({"messages": MESSAGES, **body})
    assert err.value.param == param


def test_required_named_and_auto_tool_plans():
    spec = spec_of({"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False})
    plan = plan_tools({"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False},
                      spec)
    req = spec.requests[0]
    constraint = json.loads(req.sampling.json_schema)
    assert constraint["maxItems"] == 1 and constraint["minItems"] == 1
    assert [o["properties"]["name"]["enum"] for o in constraint["items"]["anyOf"]] == [["get_weather"], ["get_time"]]
    assert json.loads(req.tools_json) == TOOLS
    reply = rewrite_reply(plan, {"choices": [{"index": 0, "finish_reason": "stop", "message": {
        "role": "assistant", "content": '[{"name":"get_weather","arguments":{"city":"Paris"}}]'}}]})
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}

    body = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    spec = spec_of(body)
    plan = plan_tools(body, spec)
    assert json.loads(spec.requests[0].sampling.json_schema) == TOOLS[0]["function"]["parameters"]
    msg = rewrite_reply(plan, {"choices": [{"index": 0, "finish_reason": "stop", "message": {
        "role": "assistant", "content": '{"city":"Oslo"}'}}]})["choices"][0]["message"]
    assert msg["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city":"Oslo"}'}

    body = {"messages": MESSAGES, "tools": TOOLS}
    spec = spec_of(body)
    plan = plan_tools(body, spec)
    assert not spec.requests[0].sampling.HasField("json_schema")
    text = 'Sure. <tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call><tool_call>{"name": "nope"}</tool_call>'
    choice = rewrite_reply(plan, {"choices": [{"index": 0, "finish_reason": "stop", "message": {
        "role": "assistant", "content": text}}]})["choices"][0]
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_time"]
    assert choice["message"]["content"] == "Sure." and choice["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("extra, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "unknown"}}}, "tool_choice"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_bad_tools_are_400(extra, param):
    body = {"messages": MESSAGES, "tools": TOOLS, **extra}
    with pytest.raises(BadRequest) as err:
        plan_tools(body, spec_of(body))
    assert err.value.param == param


def test_tool_history_is_written_into_the_assistant_content():
    body = {"messages": [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "21 C"}]}
    spec = spec_of(body)
    assert plan_tools(body, spec) is None
    msgs = spec.requests[0].messages
    assert msgs[1].content == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert (msgs[2].role, msgs[2].content) == ("tool", "21 C")


def test_a_stream_ends_with_the_unary_message():
    body = {"messages": MESSAGES, "tools": TOOLS, "stream": True}
    spec = spec_of(body)
    plan = plan_tools(body, spec)
    assert plan is not None
    chunks = ToolStreamChunks(spec, plan)
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
    out = chunks.on_message(0, llm_pb2.GenerateStreamResponse(text=text[:20]))
    assert out == []
    out = chunks.on_message(0, llm_pb2.GenerateStreamResponse(text=text[20:], finish_reason=llm_pb2.FINISH_REASON_STOP,
                                                              usage=llm_pb2.Usage(prompt_tokens=3, completion_tokens=9)))
    delta = out[0]["choices"][0]["delta"]
    unary = rewrite_reply(plan, {"choices": [{"index": 0, "finish_reason": "stop", "message": {
        "role": "assistant", "content": text}}]})["choices"][0]
    assert [{k: v for k, v in c.items() if k != "index"} for c in delta["tool_calls"]] == unary["message"]["tool_calls"]
    assert [c["index"] for c in delta["tool_calls"]] == [0]
    assert out[-1]["choices"][0]["finish_reason"] == "tool_calls"
