"""OpenAI tool calling on /v1/chat/completions: ``tools``, ``tool_choice``, ``parallel_tool_calls``.
Pure functions: no HTTP, no gRPC calls.

- The tools go to the engine (``GenerateRequest.tools_json``), which hands them to the chat
  template, or states them in the system message with the call format below.
- ``tool_choice``: ``"none"`` (tools not shown; plain text back), ``"auto"`` (the default with
  tools: free text, calls parsed out of it), ``"required"`` (one or more calls, enforced by a JSON
  Schema constraint: an array of ``{"name", "arguments"}`` over the given tools; one call when
  ``parallel_tool_calls`` is false), or ``{"type": "function", "function": {"name": ...}}`` (that
  function: the constraint is its ``parameters`` schema, the output its arguments).
- Call format parsed in ``auto`` (hermes style): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.
- History: ``role: "tool"`` messages pass as the template's tool role; an assistant message's
  ``tool_calls`` are written back into its content in the call format.
- Replies carry ``message.tool_calls`` (``id``, ``type``, ``function.name``, ``function.arguments``
  as JSON text) and ``finish_reason: "tool_calls"``. A stream holds a choice's text back until it
  ends and then sends the same message the unary reply has (``delta.tool_calls`` with an
  ``index``): the calls of a stream and of a unary request with the same seed are the same, and a
  call id is a hash of the call, so they match too.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from llmserve.v1 import llm_pb2
from services.router.openai_schema import BadRequest, GenerationSpec, StreamChunks, json_repr

TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolPlan:
    mode: str                          # auto | required | named | none
    parameters: dict[str, Any]         # tool name → its parameters schema
    named: str = ""                    # mode named: the function


def plan_tools(body: dict[str, Any], spec: GenerationSpec) -> ToolPlan | None:
    """Check the body's tools and tool_choice, rewrite each chat's tool history, send the tools and
    (required / named) the constraint; None when the request has no tools in play."""
    history = _history(body.get("messages"))
    for req in spec.requests:
        for i, content in history.items():
            req.messages[i].content = content
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools is None:
        if choice not in (None, "none"):
            raise BadRequest("'tool_choice' needs 'tools'", "tool_choice")
        return None
    parameters = _tools(tools)
    mode, named = _choice(choice, parameters)
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise BadRequest(f"'parallel_tool_calls' must be a boolean, got {json_repr(parallel)}", "parallel_tool_calls")
    if mode == "none":
        return None
    schema = None
    if mode == "named":
        schema = parameters[named]
    elif mode == "required":
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": [
            {"type": "object", "properties": {"name": {"enum": [name]}, "arguments": params},
             "required": ["name", "arguments"], "additionalProperties": False}
            for name, params in parameters.items()]}}
        if not parallel:
            schema["maxItems"] = 1
    for req in spec.requests:
        req.tools_json = json.dumps(tools)
        if schema is not None:
            if _constrained(req.sampling):
                raise BadRequest(f"tool_choice {json_repr(choice)} sets the output's form: it cannot be combined "
                                 "with response_format or structured_outputs", "tool_choice")
            req.sampling.json_schema = json.dumps(schema)
    return ToolPlan(mode, parameters, named)


def tool_message(plan: ToolPlan, index: int, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
    """The assistant message of choice ``index`` whose output is ``text``, and its finish reason."""
    calls: list[tuple[str, str]] = []   # (name, arguments as JSON text)
    content: str | None = text
    if plan.mode == "named" and finish == "stop":
        calls, content = [(plan.named, text)], None
    elif plan.mode == "required" and finish == "stop":
        try:
            calls = [(c["name"], json.dumps(c["arguments"])) for c in json.loads(text)]
            content = None
        except (ValueError, TypeError, KeyError):
            calls = []
    elif plan.mode == "auto":
        calls, rest = _parse_calls(text, plan.parameters)
        if calls:
            content = rest or None
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [{"id": _call_id(index, k, name, args), "type": "function",
                                  "function": {"name": name, "arguments": args}} for k, (name, args) in enumerate(calls)]
        finish = "tool_calls"
    return message, finish


def rewrite_reply(plan: ToolPlan | None, reply: dict[str, Any]) -> dict[str, Any]:
    """A unary chat reply with its choices' tool calls."""
    if plan is None:
        return reply
    for choice in reply["choices"]:
        choice["message"], choice["finish_reason"] = tool_message(
            plan, choice["index"], choice["message"]["content"], choice["finish_reason"])
    return reply


class ToolStreamChunks(StreamChunks):
    """Chat stream chunks that hold each choice's text back until it ends, then send its message
    (content and/or tool calls) as the unary reply has it."""

    def __init__(self, spec: GenerationSpec, plan: ToolPlan):
        super().__init__(spec)
        self.plan = plan
        self.texts: dict[int, list[str]] = {}

    def on_message(self, index: int, msg: llm_pb2.GenerateStreamResponse) -> list[dict[str, Any]]:
        self.texts.setdefault(index, []).append(msg.text)
        held = llm_pb2.GenerateStreamResponse()
        held.CopyFrom(msg)
        held.text = ""
        held.ClearField("logprobs")
        chunks = super().on_message(index, held)   # counts usage; a chunk only at the finish
        if not chunks:
            return []
        finish = chunks[-1]["choices"][0]["finish_reason"]
        message, finish = tool_message(self.plan, index, "".join(self.texts.pop(index)), finish)
        delta: dict[str, Any] = {"role": "assistant"}
        if message["content"] is not None:
            delta["content"] = message["content"]
        if "tool_calls" in message:
            delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]
        return [self._chunk([{"index": index, "logprobs": None, "delta": delta, "finish_reason": None}]),
                self._chunk([{"index": index, "logprobs": None, "delta": {}, "finish_reason": finish}])]


def stream_chunks(spec: GenerationSpec, plan: ToolPlan | None) -> StreamChunks:
    return StreamChunks(spec) if plan is None else ToolStreamChunks(spec, plan)


# -- request parts ---------------------------------------------------------------------------------


def _tools(tools: Any) -> dict[str, dict[str, Any]]:
    if not isinstance(tools, list) or not tools:
        raise BadRequest("'tools' must be a non-empty array of {type: function, function: {name, parameters}}",
                         "tools")
    out: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise BadRequest(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}", "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise BadRequest(f"tools[{i}].function.name must be 1 to 64 letters, digits, '_' or '-'", "tools")
        if name in out:
            raise BadRequest(f"tools[{i}]: a second function named {name}", "tools")
        params = fn.get("parameters", EMPTY_PARAMETERS)
        if not isinstance(params, dict):
            raise BadRequest(f"tools[{i}].function.parameters must be a JSON Schema object", "tools")
        if fn.get("description") is not None and not isinstance(fn.get("description"), str):
            raise BadRequest(f"tools[{i}].function.description must be a string", "tools")
        out[name] = params
    return out


def _choice(choice: Any, parameters: dict[str, Any]) -> tuple[str, str]:
    if choice is None:
        return "auto", ""
    if choice in ("none", "auto", "required"):
        return choice, ""
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(fn, dict) \
            or not isinstance(fn.get("name"), str):
        raise BadRequest("'tool_choice' must be none, auto, required or {\"type\": \"function\", \"function\": "
                         "{\"name\": ...}}", "tool_choice")
    if fn["name"] not in parameters:
        raise BadRequest(f"tool_choice names the function {json_repr(fn['name'])}, which is not among the tools "
                         f"({', '.join(parameters)})", "tool_choice")
    return "named", fn["name"]


def _history(messages: Any) -> dict[int, str]:
    """Content of the assistant messages that carry ``tool_calls``, with the calls written into it."""
    out: dict[int, str] = {}
    for i, m in enumerate(messages if isinstance(messages, list) else []):
        calls = m.get("tool_calls") if isinstance(m, dict) and m.get("role") == "assistant" else None
        if not calls:
            continue
        if not isinstance(calls, list):
            raise BadRequest(f"messages[{i}].tool_calls must be an array", "messages")
        parts = [m["content"]] if isinstance(m.get("content"), str) and m["content"] else []
        for k, call in enumerate(calls):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
                    or not isinstance(fn.get("arguments"), str):
                raise BadRequest(f"messages[{i}].tool_calls[{k}] must have function.name and function.arguments "
                                 "(JSON text)", "messages")
            try:
                arguments = json.loads(fn["arguments"])
            except ValueError:
                raise BadRequest(f"messages[{i}].tool_calls[{k}].function.arguments is not JSON", "messages") from None
            parts.append("<tool_call>\n" + json.dumps({"name": fn["name"], "arguments": arguments}) + "\n</tool_call>")
        out[i] = "\n".join(parts)
    return out


# -- reply parts -----------------------------------------------------------------------------------


def _parse_calls(text: str, parameters: dict[str, Any]) -> tuple[list[tuple[str, str]], str]:
    """The well-formed calls of known tools in ``text``, and the text outside every call."""
    calls = []
    for match in CALL.finditer(text):
        try:
            call = json.loads(match.group(1))
        except ValueError:
            continue
        if isinstance(call, dict) and call.get("name") in parameters and isinstance(call.get("arguments", {}), dict):
            calls.append((call["name"], json.dumps(call.get("arguments", {}))))
    return calls, CALL.sub("", text).strip() if calls else text


def _call_id(index: int, k: int, name: str, arguments: str) -> str:
    return "call_" + hashlib.sha256(f"{index}:{k}:{name}:{arguments}".encode()).hexdigest()[:24]


def _constrained(s: llm_pb2.SamplingParams) -> bool:
    return s.HasField("json_schema") or s.HasField("regex") or s.HasField("grammar") or s.json_object or bool(s.choice)
