"""Public requests → validated domain inputs, with errors a person can act on.

Everything a client can get wrong is checked here, before a sequence exists, so a bad
request never reaches the scheduler and never disturbs anybody else's.
"""
from __future__ import annotations

import json
import math
import struct
from typing import Any

from llmserve.v1 import llm_pb2
from services.common.errors import InvalidArgument, clip
from services.common.sampling import MAX_LOGPROBS, SamplingOptions
from services.engine.models.constraints import MAX_CHOICES, MAX_CONSTRAINT_CHARS, ConstraintSpec
from services.engine.models.runtime import ModelLimits
from services.engine.models.tokenizer import Tokenizer

MAX_STOP_STRINGS = 16
# Below this a temperature only overflows the scaled scores (1e-45 turns them into infinities);
# smaller positive values are raised to it, as vLLM does: at 0.01 sampling is already near-greedy.
MIN_TEMPERATURE = 0.01
# The repetition penalty divides or multiplies scores: outside this range it only overflows them.
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 100.0
CHAT_ROLES = ("system", "user", "assistant", "tool")
MAX_TOOLS = 128


# Predict on an embedding or classification model: longer input is refused before it is sent (the
# encoders read their first 512 tokens; 100k characters is far beyond what they can use).
MAX_PREDICT_CHARS = 100_000


def prompt_tokens(req: llm_pb2.GenerateRequest, tokenizer: Tokenizer, context_length: int) -> list[int]:
    if req.prompt and req.messages:
        raise InvalidArgument("give either prompt or messages, not both")
    chars = len(req.prompt) + len(req.tools_json) + sum(len(m.content) + len(m.role) for m in req.messages)
    if chars > context_length * tokenizer.max_token_chars:
        raise InvalidArgument(f"prompt is {chars} characters: more than the model's context of {context_length} "
                              "tokens can hold: shorten the prompt")
    if req.messages:
        msgs = []
        for i, m in enumerate(req.messages):
            if m.role not in CHAT_ROLES:
                raise InvalidArgument(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, not {clip(m.role)}")
            msgs.append({"role": m.role, "content": m.content})
        try:
            return tokenizer.encode_chat(msgs, chat_tools(req.tools_json))
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
    if req.tools_json:
        raise InvalidArgument("tools_json needs messages (a chat), not a prompt")
    if not req.prompt:
        raise InvalidArgument("prompt is empty and no messages were given; send a prompt or chat messages")
    ids = tokenizer.encode(req.prompt)
    if not ids:
        raise InvalidArgument("prompt encodes to no tokens")
    return ids


def chat_tools(tools_json: str) -> list[Any] | None:
    """The request's tools (OpenAI function definitions), for the chat template."""
    if not tools_json:
        return None
    try:
        tools = json.loads(tools_json)
    except json.JSONDecodeError as exc:
        raise InvalidArgument(f"tools_json is not JSON: {exc}") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise InvalidArgument("tools_json must be a JSON array of tool objects")
    if len(tools) > MAX_TOOLS:
        raise InvalidArgument(f"tools_json holds {len(tools)} tools; at most {MAX_TOOLS}")
    return tools


def sampling_options(p: llm_pb2.SamplingParams, num_prompt_tokens: int, limits: ModelLimits) -> SamplingOptions:
    ctx = limits.context_length
    if num_prompt_tokens >= ctx:
        raise InvalidArgument(f"prompt is {num_prompt_tokens} tokens; the model's context is {ctx} tokens "
                              "(prompt + max_tokens must fit): shorten the prompt")
    room = min(ctx, limits.kv_capacity_tokens) - num_prompt_tokens
    if room <= 0:
        raise InvalidArgument(f"prompt is {num_prompt_tokens} tokens; this engine's KV cache holds "
                              f"{limits.kv_capacity_tokens} tokens per sequence: shorten the prompt")
    if p.HasField("max_tokens"):
        if p.max_tokens == 0:
            raise InvalidArgument("sampling.max_tokens must be >= 1 (leave it unset for the default)")
        if p.max_tokens > ctx:
            raise InvalidArgument(f"sampling.max_tokens {p.max_tokens} exceeds the model's context of {ctx} tokens")
        if p.max_tokens > room:
            raise InvalidArgument(f"prompt ({num_prompt_tokens} tokens) + max_tokens ({p.max_tokens}) exceeds "
                                  f"the {min(ctx, limits.kv_capacity_tokens)} tokens available; lower max_tokens")
        max_tokens = p.max_tokens
    else:
        max_tokens = min(limits.default_max_tokens, room)
    temperature = _opt(p, "temperature", 1.0)
    if math.isnan(temperature) or temperature < 0 or math.isinf(temperature):
        raise InvalidArgument(f"sampling.temperature must be a number >= 0 (0 = greedy), not {temperature}")
    if 0 < temperature < MIN_TEMPERATURE:
        temperature = MIN_TEMPERATURE
    top_p = _opt(p, "top_p", 1.0)
    if not (0.0 < top_p <= 1.0):  # also false for NaN
        raise InvalidArgument(f"sampling.top_p must be in (0, 1], not {top_p}")
    if p.top_k < 0:
        raise InvalidArgument(f"sampling.top_k must be >= 0 (0 = off), not {p.top_k}")
    penalty = _opt(p, "repetition_penalty", 1.0)
    # The proto field is a float32: 0.01 arrives as 0.0099999998, so compare in float32.
    if not (_f32(MIN_REPETITION_PENALTY) <= penalty <= _f32(MAX_REPETITION_PENALTY)):  # also false for NaN
        raise InvalidArgument(f"sampling.repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, "
                              f"{MAX_REPETITION_PENALTY:g}] (1 = off), not {penalty}")
    logprobs = p.logprobs if p.HasField("logprobs") else None
    if logprobs is not None and logprobs > MAX_LOGPROBS:
        raise InvalidArgument(f"sampling.logprobs must be <= {MAX_LOGPROBS}, not {logprobs}")
    if len(p.stop) > MAX_STOP_STRINGS:
        raise InvalidArgument(f"at most {MAX_STOP_STRINGS} stop strings, got {len(p.stop)}")
    if any(not s for s in p.stop):
        raise InvalidArgument("stop strings must not be empty")
    return SamplingOptions(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=p.top_k,
                           seed=p.seed if p.HasField("seed") else None, stop=tuple(p.stop),
                           repetition_penalty=penalty, ignore_eos=p.ignore_eos, logprobs=logprobs,
                           speculate=not p.disable_speculation)


def constraint_spec(p: llm_pb2.SamplingParams) -> ConstraintSpec | None:
    """The request's output constraint (at most one), checked for shape and size; compiled later."""
    given = [name for name in ("json_schema", "regex", "grammar") if p.HasField(name)]
    given += ["json_object"] if p.json_object else []
    given += ["choice"] if p.choice else []
    if not given:
        return None
    if len(given) > 1:
        raise InvalidArgument(f"give at most one output constraint, not {' and '.join(given)}")
    if p.ignore_eos:
        raise InvalidArgument(f"sampling.{given[0]} cannot be combined with ignore_eos: a constraint ends the "
                              "output when it is complete")
    kind = given[0]
    if kind == "json_object":
        return ConstraintSpec(kind)
    if kind == "choice":
        if len(p.choice) > MAX_CHOICES:
            raise InvalidArgument(f"sampling.choice has {len(p.choice)} strings; at most {MAX_CHOICES}")
        if any(not c for c in p.choice):
            raise InvalidArgument("sampling.choice strings must not be empty")
        size = sum(len(c) for c in p.choice)
        if size > MAX_CONSTRAINT_CHARS:
            raise InvalidArgument(f"sampling.choice is {size} characters; at most {MAX_CONSTRAINT_CHARS}")
        return ConstraintSpec(kind, choices=tuple(p.choice))
    text = getattr(p, kind)
    if not text.strip():
        raise InvalidArgument(f"sampling.{kind} is empty")
    if len(text) > MAX_CONSTRAINT_CHARS:
        raise InvalidArgument(f"sampling.{kind} is {len(text)} characters; at most {MAX_CONSTRAINT_CHARS}")
    return ConstraintSpec(kind, text=text)


def predict_text(text: str) -> str:
    if not text.strip():
        raise InvalidArgument("input_data is empty; give the text to run the model on")
    if len(text) > MAX_PREDICT_CHARS:
        raise InvalidArgument(f"input_data is {len(text)} characters; at most {MAX_PREDICT_CHARS} are accepted "
                              "for embedding and classification models: shorten it")
    return text


def resume_tokens(req: llm_pb2.GenerateRequest, sampling: SamplingOptions, tokenizer: Tokenizer) -> list[int]:
    """The internal failover fields: tokens another engine already generated for this request, and
    how much of their text was delivered."""
    vocab_size = tokenizer.vocab_size
    ids = list(req.resume_token_ids)
    if len(ids) >= sampling.max_tokens:
        raise InvalidArgument(f"resume_token_ids holds {len(ids)} tokens; it must be fewer than max_tokens "
                              f"({sampling.max_tokens}) so that something is left to generate")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidArgument(f"resume_token_ids: token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    if req.resume_text_chars and req.resume_text_chars > len(tokenizer.decode(ids)):
        raise InvalidArgument(f"resume_text_chars {req.resume_text_chars} exceeds the text of resume_token_ids")
    return ids


def _f32(x: float) -> float:
    return float(struct.unpack("f", struct.pack("f", x))[0])


def _opt(msg: Any, name: str, default: float) -> float:
    return float(getattr(msg, name)) if msg.HasField(name) else default
