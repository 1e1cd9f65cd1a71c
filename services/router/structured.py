"""OpenAI ``response_format`` and vLLM's extra-body ``structured_outputs`` → the constraint fields of
``SamplingParams``. Pure functions: no HTTP, no gRPC calls.

- ``response_format``: ``{"type": "text"}`` (none), ``{"type": "json_object"}``, or
  ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``. The
  output always follows the schema (``strict`` is accepted either way: a constraint is never loose).
- ``structured_outputs`` (vLLM): one of ``json`` (a schema, as an object or JSON text), ``regex``,
  ``choice`` (an array of strings), ``grammar`` (llguidance Lark, or GBNF), ``json_object`` (true).
- vLLM's older top-level ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``.

More than one of these in a request is a 400; the engine checks that the constraint compiles.
"""
from __future__ import annotations

import json
import re
from typing import Any

from llmserve.v1 import llm_pb2
from services.router.openai_schema import BadRequest, json_repr

SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def apply_structured(body: dict[str, Any], requests: list[llm_pb2.GenerateRequest]) -> None:
    """Set each request's constraint from the body (a 400 for a malformed or second one)."""
    for req in requests:
        constrain(body, req.sampling)


def constrain(body: dict[str, Any], sampling: llm_pb2.SamplingParams) -> None:
    """Set ``sampling``'s constraint from the request body (a 400 for a malformed or second one)."""
    given: list[tuple[str, str, Any]] = []   # (where, kind, value)
    rf = body.get("response_format")
    if rf is not None:
        given.extend(_response_format(rf))
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise BadRequest("'structured_outputs' must be an object", "structured_outputs")
        given.extend((f"structured_outputs.{k}", k, v) for k, v in so.items() if v is not None and v is not False)
    given.extend((key, kind, body[key]) for key, kind in GUIDED.items() if body.get(key) is not None)
    if not given:
        return
    if len(given) > 1:
        raise BadRequest(f"give at most one output constraint, not {' and '.join(w for w, _, _ in given)}",
                         given[1][0].split(".")[0])
    where, kind, value = given[0]
    set_constraint(sampling, where, kind, value)


def set_constraint(sampling: llm_pb2.SamplingParams, where: str, kind: str, value: Any) -> None:
    param = where.split(".")[0]
    if kind == "json":
        if isinstance(value, str):
            sampling.json_schema = value
        elif isinstance(value, (dict, bool)):
            sampling.json_schema = json.dumps(value)
        else:
            raise BadRequest(f"'{where}' must be a JSON Schema (an object, or its JSON text)", param)
    elif kind == "json_object":
        if value is not True:
            raise BadRequest(f"'{where}' must be true", param)
        sampling.json_object = True
    elif kind in ("regex", "grammar"):
        if not isinstance(value, str):
            raise BadRequest(f"'{where}' must be a string, got {json_repr(value)}", param)
        setattr(sampling, kind, value)
    elif kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise BadRequest(f"'{where}' must be a non-empty array of strings", param)
        sampling.choice.extend(value)
    else:
        raise BadRequest(f"'{where}' is not a known constraint: use json, regex, choice, grammar or json_object",
                         param)


def _response_format(rf: Any) -> list[tuple[str, str, Any]]:
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise BadRequest("'response_format' must be an object with a 'type'", "response_format")
    kind = rf["type"]
    if kind == "text":
        return []
    if kind == "json_object":
        return [("response_format", "json_object", True)]
    if kind != "json_schema":
        raise BadRequest(f"response_format.type must be text, json_object or json_schema, not {json_repr(kind)}",
                         "response_format")
    spec = rf.get("json_schema")
    if not isinstance(spec, dict):
        raise BadRequest("response_format.json_schema must be an object with 'name' and 'schema'", "response_format")
    name = spec.get("name")
    if not isinstance(name, str) or not SCHEMA_NAME.fullmatch(name):
        raise BadRequest("response_format.json_schema.name must be 1 to 64 letters, digits, '_' or '-'",
                         "response_format")
    if spec.get("strict") is not None and not isinstance(spec.get("strict"), bool):
        raise BadRequest("response_format.json_schema.strict must be a boolean", "response_format")
    schema = spec.get("schema", {})   # OpenAI: absent = any JSON
    if not isinstance(schema, dict):
        raise BadRequest("response_format.json_schema.schema must be an object (a JSON Schema)", "response_format")
    return [("response_format", "json", schema)]
