"""OpenAI request and reply shapes ↔ the public protobuf messages. Pure functions: no HTTP, no gRPC calls.

Sampling fields mapped: ``max_tokens`` / ``max_completion_tokens``, ``temperature``, ``top_p``, ``seed``,
``stop`` (a string or a list), ``logprobs`` / ``top_logprobs``, ``n`` (up to ``MAX_CHOICES`` choices
per request, prompts × n), and vLLM's extensions ``top_k``, ``repetition_penalty``, ``ignore_eos``.
Unknown fields are ignored, as OpenAI's servers do; a known field of the wrong type is a 400.
"""
from __future__ import annotations

import base64
import struct
import time
from dataclasses import dataclass, field
from typing import Any

from llmserve.v1 import llm_pb2

# Choices one request may ask for (prompts × n): each is a sequence on an engine.
MAX_CHOICES = 8
# Roles OpenAI clients send under another name: "developer" is what newer clients call the system
# message (OpenAI treats it so), and chat templates know only "system".
CHAT_ROLE_ALIASES = {"developer": "system"}

FINISH_REASON = {
    llm_pb2.FINISH_REASON_STOP: "stop",
    llm_pb2.FINISH_REASON_LENGTH: "length",
    llm_pb2.FINISH_REASON_CANCELLED: "abort",
    llm_pb2.FINISH_REASON_ERROR: "error",
}


class BadRequest(Exception):
    """A request the HTTP face refuses before any call (HTTP 400)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


_KINDS: dict[str, tuple[tuple[type, ...], str]] = {
    "int": ((int,), "an integer"),
    "number": ((int, float), "a number"),
    "bool": ((bool,), "a boolean"),
    "str": ((str,), "a string"),
    "dict": ((dict,), "an object"),
    "list": ((list,), "an array"),
}


# The protobuf field each integer goes into holds this range; past it the request is a 400, not a
# ValueError in protobuf (HTTP 500).
UINT32 = (0, 2**32 - 1)
UINT64 = (0, 2**64 - 1)
INT32 = (-2**31, 2**31 - 1)


def checked_field(body: dict[str, Any], key: str, kind: str, bounds: tuple[int, int] | None = None) -> Any:
    """``body[key]`` checked against ``kind`` (an "int" also against ``bounds``; a "str" must be
    UTF-8: JSON's ``\ud800`` escape makes a lone surrogate, which protobuf cannot carry); None when
    absent or null."""
    value = body.get(key)
    if value is None:
        return None
    types, what = _KINDS[kind]
    if not isinstance(value, types) or (kind in ("int", "number") and isinstance(value, bool)):
        raise BadRequest(f"'{key}' must be {what}, got {type(value).__name__} {json_repr(value)}", key)
    if bounds is not None and not bounds[0] <= value <= bounds[1]:
        raise BadRequest(f"'{key}' must be in [{bounds[0]}, {bounds[1]}], got {json_repr(value)}", key)
    if kind == "number" and isinstance(value, int) and not -2.0**1023 < value < 2.0**1023:
        raise BadRequest(f"'{key}' is too large a number: {json_repr(value)}", key)
    if kind == "str":
        utf8_text(value, key)
    return value


def utf8_text(text: str, where: str) -> str:
    """``text`` when it can be encoded as UTF-8 (a lone surrogate cannot)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise BadRequest(f"'{where}' is not valid Unicode text: {exc.reason} at position {exc.start} "
                         f"({text[exc.start]!r}); encode text as UTF-8", where.split("[")[0].split(".")[0]) from None
    return text


def json_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _strings(body: dict[str, Any], key: str) -> list[str] | None:
    """A string or a list of strings, as a list."""
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, str):
        return [utf8_text(value, key)]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return [utf8_text(v, f"{key}[{i}]") for i, v in enumerate(value)]
    raise BadRequest(f"'{key}' must be a string or an array of strings", key)


@dataclass
class GenerationSpec:
    """One /v1/completions or /v1/chat/completions request, as the GenerateRequests it runs."""

    chat: bool
    stream: bool
    include_usage: bool
    request_id: str
    requests: list[llm_pb2.GenerateRequest]
    prompt_of: list[int]                   # requests[i] is a choice of prompt prompt_of[i]
    logprobs: bool = False
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def id(self) -> str:
        return ("chatcmpl-" if self.chat else "cmpl-") + self.request_id

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"


def generation_request(body: dict[str, Any], chat: bool, max_choices: int, request_id: str) -> GenerationSpec:
    model = checked_field(body, "model", "str") or ""
    stream = bool(checked_field(body, "stream", "bool"))
    options = checked_field(body, "stream_options", "dict") or {}
    include_usage = bool(checked_field(options, "include_usage", "bool")) if stream else False
    n = checked_field(body, "n", "int")
    n = 1 if n is None else n
    if n < 1:
        raise BadRequest("'n' must be >= 1", "n")

    sampling = llm_pb2.SamplingParams()
    max_tokens = checked_field(body, "max_completion_tokens", "int")
    if max_tokens is None:
        max_tokens = checked_field(body, "max_tokens", "int")
    if max_tokens is not None:
        if not 1 <= max_tokens <= UINT32[1]:
            raise BadRequest(f"'max_tokens' must be in [1, {UINT32[1]}], got {json_repr(max_tokens)}", "max_tokens")
        sampling.max_tokens = max_tokens
    for key in ("temperature", "top_p", "repetition_penalty"):
        value = checked_field(body, key, "number")
        if value is not None:
            setattr(sampling, key, float(value))
    seed = checked_field(body, "seed", "int")
    if seed is not None:
        if not UINT64[0] <= seed <= UINT64[1]:
            raise BadRequest(f"'seed' must be in [0, 2^64 - 1], got {json_repr(seed)}", "seed")
        sampling.seed = seed
    top_k = checked_field(body, "top_k", "int", INT32)
    if top_k is not None:
        sampling.top_k = max(0, top_k)  # vLLM's -1 = off is our 0
    if checked_field(body, "ignore_eos", "bool"):
        sampling.ignore_eos = True
    stop = _strings(body, "stop")
    if stop:
        sampling.stop.extend(stop)
    wants_logprobs = False
    if chat:
        top = checked_field(body, "top_logprobs", "int", UINT32)
        if checked_field(body, "logprobs", "bool"):
            sampling.logprobs = top or 0
            wants_logprobs = True
        elif top is not None:
            raise BadRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    else:
        top = checked_field(body, "logprobs", "int", UINT32)
        if top is not None:
            sampling.logprobs = top
            wants_logprobs = True

    if chat:
        messages = chat_messages(body)
        prompts: list[Any] = [messages]
    else:
        prompts = completion_prompts(body)
    if len(prompts) * n > max_choices:
        raise BadRequest(f"{len(prompts)} prompt(s) × n={n} = {len(prompts) * n} choices exceed the maximum of "
                         f"{max_choices} per request", "n")
    requests, prompt_of = [], []
    for p, prompt in enumerate(prompts):
        for j in range(n):
            k = len(requests)
            req = llm_pb2.GenerateRequest(model=model, sampling=sampling,
                                          request_id=request_id if len(prompts) * n == 1 else f"{request_id}-{k}")
            if seed is not None and j:
                req.sampling.seed = (seed + j) % 2**64  # n seeded choices: different, each reproducible
            if chat:
                req.messages.extend(prompt)
            else:
                req.prompt = prompt
            requests.append(req)
            prompt_of.append(p)
    return GenerationSpec(chat, stream, include_usage, request_id, requests, prompt_of, wants_logprobs)


def completion_prompts(body: dict[str, Any]) -> list[str]:
    prompt = body.get("prompt")
    if prompt is None:
        raise BadRequest("'prompt' is required", "prompt")
    if isinstance(prompt, list) and prompt and not all(isinstance(p, str) for p in prompt):
        raise BadRequest("'prompt' must be a string or an array of strings (token-id prompts are not supported)",
                         "prompt")
    prompts = _strings(body, "prompt") or []
    if not prompts:
        raise BadRequest("'prompt' is an empty array; give at least one prompt", "prompt")
    return prompts


def chat_messages(body: dict[str, Any]) -> list[llm_pb2.ChatMessage]:
    messages = checked_field(body, "messages", "list")
    if not messages:
        raise BadRequest("'messages' is required: a non-empty array of {role, content}", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise BadRequest(f"messages[{i}] must be an object with 'role' and 'content'", "messages")
        role = m.get("role")
        if not isinstance(role, str):
            raise BadRequest(f"messages[{i}].role must be a string", "messages")
        role = CHAT_ROLE_ALIASES.get(utf8_text(role, f"messages[{i}].role"), role)
        content = m.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):  # content parts: only text ones are supported
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise BadRequest(f"messages[{i}].content: only text parts are supported", "messages")
                texts.append(part["text"])
            content = "".join(texts)
        elif not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string or an array of text parts", "messages")
        utf8_text(content, f"messages[{i}].content")
        out.append(llm_pb2.ChatMessage(role=role, content=content))
    return out


# -- replies -----------------------------------------------------------------------------------


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _chat_logprobs(lps: Any) -> dict[str, Any]:
    return {"content": [{"token": lp.token, "logprob": lp.logprob, "bytes": list(lp.token.encode()),
                         "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": list(t.token.encode())}
                                          for t in lp.top]} for lp in lps]}


def _completion_logprobs(lps: Any, offset: int) -> dict[str, Any]:
    offsets = []
    for lp in lps:
        offsets.append(offset)
        offset += len(lp.token)
    return {"tokens": [lp.token for lp in lps], "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{t.token: t.logprob for t in lp.top} for lp in lps], "text_offset": offsets}


def generation_reply(spec: GenerationSpec, replies: list[llm_pb2.GenerateResponse]) -> dict[str, Any]:
    choices = []
    for i, r in enumerate(replies):
        choice: dict[str, Any] = {"index": i, "finish_reason": FINISH_REASON.get(r.finish_reason),
                                  "logprobs": None}
        if spec.chat:
            choice["message"] = {"role": "assistant", "content": r.text}
            if spec.logprobs:
                choice["logprobs"] = _chat_logprobs(r.logprobs)
        else:
            choice["text"] = r.text
            if spec.logprobs:
                choice["logprobs"] = _completion_logprobs(r.logprobs, 0)
        choices.append(choice)
    prompt_tokens = {spec.prompt_of[i]: r.usage.prompt_tokens for i, r in enumerate(replies)}
    return {"id": spec.id, "object": spec.object, "created": spec.created,
            "model": replies[0].model if replies else "", "choices": choices,
            "usage": _usage(sum(prompt_tokens.values()), sum(r.usage.completion_tokens for r in replies))}


class StreamChunks:
    """The SSE chunks of a streamed request, built message by message."""

    def __init__(self, spec: GenerationSpec):
        self.spec = spec
        self.model = ""
        self.started: set[int] = set()
        self.offsets: dict[int, int] = {}
        self.prompt_tokens: dict[int, int] = {}
        self.completion_tokens = 0

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        out = {"id": self.spec.id, "object": self.spec.object + ("" if not self.spec.chat else ".chunk"),
               "created": self.spec.created, "model": self.model, "choices": choices}
        if self.spec.include_usage:
            out["usage"] = None
        return out

    def on_message(self, index: int, msg: llm_pb2.GenerateStreamResponse) -> list[dict[str, Any]]:
        self.model = msg.model or self.model
        finish = FINISH_REASON.get(msg.finish_reason)
        if finish is not None:
            self.prompt_tokens[self.spec.prompt_of[index]] = msg.usage.prompt_tokens
            self.completion_tokens += msg.usage.completion_tokens
        if not msg.text and finish is None and not msg.logprobs:
            return []
        choice: dict[str, Any] = {"index": index, "logprobs": None, "finish_reason": finish}
        if self.spec.chat:
            delta: dict[str, Any] = {}
            if index not in self.started:
                delta["role"] = "assistant"
                self.started.add(index)
            if msg.text:
                delta["content"] = msg.text
            choice["delta"] = delta
            if self.spec.logprobs:
                choice["logprobs"] = _chat_logprobs(msg.logprobs)
        else:
            choice["text"] = msg.text
            if self.spec.logprobs:
                offset = self.offsets.get(index, 0)
                choice["logprobs"] = _completion_logprobs(msg.logprobs, offset)
                self.offsets[index] = offset + len(msg.text)
        return [self._chunk([choice])]

    def usage_chunk(self) -> dict[str, Any]:
        out = self._chunk([])
        out["usage"] = _usage(sum(self.prompt_tokens.values()), self.completion_tokens)
        return out


def models_reply(resp: llm_pb2.ListModelsResponse) -> dict[str, Any]:
    return {"object": "list", "data": [
        {"id": m.name, "object": "model", "created": 0, "owned_by": "llmserve", "llmserve_id": m.id,
         "task": m.task, "loaded": m.loaded, "context_length": m.context_length} for m in resp.models]}


def embedding_request(body: dict[str, Any]) -> tuple[str, list[str], str]:
    model = checked_field(body, "model", "str")
    if not model:
        raise BadRequest("'model' is required: the name or id of an embedding model (see /v1/models)", "model")
    value = body.get("input")
    if isinstance(value, list) and value and not all(isinstance(v, str) for v in value):
        raise BadRequest("'input' must be a string or an array of strings (token-id inputs are not supported)",
                         "input")
    inputs = _strings(body, "input")
    if not inputs:
        raise BadRequest("'input' is required: a string or a non-empty array of strings", "input")
    if len(inputs) > 256:
        raise BadRequest(f"{len(inputs)} inputs exceed the maximum of 256 per request", "input")
    encoding = checked_field(body, "encoding_format", "str") or "float"
    if encoding not in ("float", "base64"):
        raise BadRequest("'encoding_format' must be 'float' or 'base64'", "encoding_format")
    return model, inputs, encoding


def embeddings_reply(model: str, replies: list[llm_pb2.PredictResponse], encoding: str) -> dict[str, Any]:
    data = []
    for i, r in enumerate(replies):
        values = list(r.embedding.values)
        vector: Any = values
        if encoding == "base64":
            vector = base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode()
        data.append({"object": "embedding", "index": i, "embedding": vector})
    return {"object": "list", "data": data, "model": model, "usage": {"prompt_tokens": 0, "total_tokens": 0}}
