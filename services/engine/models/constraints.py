"""Output constraints (JSON Schema, any JSON object, regex, choice, grammar) compiled by llguidance.

The engine checks and compiles a request's constraint at admission, on a thread of the server's
pool (never on the event loop or the engine loop), against the model's own tokenizer: what does
not compile is refused there with llguidance's reason, before a sequence exists. What comes out is
an llguidance grammar (text): the worker builds its matcher from it (``services.worker.constraints``).
Compiled grammars, and the reasons of the ones that failed, are cached by constraint; one compiler
serves one loaded model, so the cache is keyed by (constraint, tokenizer).

Bounds: a constraint's text is at most ``MAX_CONSTRAINT_CHARS``; its compile is bounded by
llguidance's default parser limits (lexer fuel 1,000,000 ≈ 20 ms of lexer construction, at most
500,000 grammar symbols and 250,000 lexer states), and past them it fails like a bad grammar.
"""
from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import llguidance

from services.common.errors import InvalidArgument

MAX_CONSTRAINT_CHARS = 64 * 1024   # of a json_schema, regex or grammar; of all choices together
MAX_CHOICES = 256
CACHE_SIZE = 256                   # compiled constraints kept per model
# JSON without free whitespace: a small model given the choice tends to pad JSON with newlines and
# spaces until max_tokens. A schema's own "x-guidance" options can override this.
JSON_OPTIONS: Any = {"whitespace_flexible": False}
MAX_ERROR_CHARS = 2000
KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class ConstraintSpec:
    """A request's constraint as given (validated for shape and size, not compiled yet)."""

    kind: str                       # one of KINDS
    text: str = ""                  # json_schema / regex / grammar text
    choices: tuple[str, ...] = ()   # choice


class CompileObserver(Protocol):
    """Metrics: hears of each constraint compiled (cached = answered from the cache)."""

    def on_compiled(self, kind: str, seconds: float, cached: bool) -> None: ...


class ConstraintCompiler:
    """Compiles constraints for one model's tokenizer; thread-safe (the server's pool calls it)."""

    def __init__(self, hf_tokenizer: Callable[[], Any], vocab_size: int, observer: CompileObserver | None = None):
        self._hf_tokenizer = hf_tokenizer   # built lazily: the llguidance tokenizer costs ~1 s, once
        self._vocab_size = vocab_size
        self._observer = observer
        self._lock = threading.Lock()
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[ConstraintSpec, tuple[str, str]] = OrderedDict()   # → (grammar, error)

    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf  # ~1 s (it imports transformers): on the first constrained request, not at start

                self._tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer(), n_vocab=self._vocab_size)
            return self._tokenizer

    def cached(self, spec: ConstraintSpec) -> str | None:
        """The grammar of ``spec`` if it was compiled before (InvalidArgument if it failed then), else
        None. A dictionary lookup: the event loop calls it, and only a miss goes to a thread."""
        started = time.perf_counter()
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
        return None if hit is None else self._answer(spec, hit, started, cached=True)

    def compile(self, spec: ConstraintSpec) -> str:
        """The llguidance grammar of ``spec``; InvalidArgument with llguidance's reason when it does
        not compile. Blocks (up to the parser limits' bound): call it off the event loop."""
        found = self.cached(spec)
        if found is not None:
            return found
        started = time.perf_counter()
        compiled = self._compile(spec)
        with self._lock:
            self._cache[spec] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return self._answer(spec, compiled, started, cached=False)

    def _answer(self, spec: ConstraintSpec, compiled: tuple[str, str], started: float, cached: bool) -> str:
        grammar, error = compiled
        if self._observer is not None:  # metrics
            self._observer.on_compiled(spec.kind, time.perf_counter() - started, cached)
        if error:
            raise InvalidArgument(error)
        return grammar

    def _compile(self, spec: ConstraintSpec) -> tuple[str, str]:
        try:
            grammar = grammar_of(spec)
        except ValueError as exc:
            return "", _clip(f"sampling.{spec.kind} is not valid: {exc}")
        matcher = llguidance.LLMatcher(self.tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            return "", _clip(f"sampling.{spec.kind} does not compile: {matcher.get_error()}")
        return grammar, ""


def grammar_of(spec: ConstraintSpec) -> str:
    """llguidance's grammar text for ``spec`` (not compiled yet); ValueError when it cannot be read."""
    if spec.kind == "json_schema":
        try:
            schema = json.loads(spec.text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"it is not JSON ({exc})") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"a JSON Schema is an object (or true/false), not {type(schema).__name__}")
        return str(llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS))
    if spec.kind == "json_object":
        return str(llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS))
    if spec.kind == "regex":
        return str(llguidance.grammar_from("regex", spec.text))
    if spec.kind == "choice":
        return str(llguidance.grammar_from("choice", json.dumps(list(spec.choices))))
    if spec.kind == "grammar":
        return str(llguidance.grammar_from("grammar", spec.text))
    raise ValueError(f"unknown constraint kind {spec.kind}")


def _clip(message: str) -> str:
    return message if len(message) <= MAX_ERROR_CHARS else message[:MAX_ERROR_CHARS] + " ..."
