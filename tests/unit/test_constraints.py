"""Constraint checks and compiles in the engine, and the worker's matchers and masks (SmolLM2's tokenizer)."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer

from llmserve.v1 import llm_pb2
from services.common.errors import InvalidArgument
from services.common.model_source import resolve_model
from services.engine.api.validation import constraint_spec
from services.engine.models.constraints import ConstraintCompiler, ConstraintSpec
from services.engine.models.tokenizer import _tokenizer_dir
from services.worker.constraints import ConstraintError, Constraints


@pytest.fixture(scope="module")
def hf():
    # _tokenizer_dir converts the GGUF's tokenizer into the cache when it is not there yet (a fresh clone)
    return AutoTokenizer.from_pretrained(_tokenizer_dir(resolve_model("smollm2")))


@pytest.fixture(scope="module")
def compiler(hf):
    seen: list[tuple[str, bool]] = []

    class Observer:
        def on_compiled(self, kind: str, seconds: float, cached: bool) -> None:
            seen.append((kind, cached))

    c = ConstraintCompiler(lambda: hf, len(hf), Observer())
    c.seen = seen  # type: ignore[attr-defined]
    return c


def test_spec_checks_one_constraint_its_size_and_ignore_eos():
    assert constraint_spec(llm_pb2.SamplingParams()) is None
    assert constraint_spec(llm_pb2.SamplingParams(choice=["a", "b"])) == ConstraintSpec("choice", choices=("a", "b"))
    assert constraint_spec(llm_pb2.SamplingParams(json_object=True)) == ConstraintSpec("json_object")
    for bad, why in ((dict(regex="a", grammar="start: x"), "not regex and grammar"),
                     (dict(json_object=True, ignore_eos=True), "ignore_eos"), (dict(regex=" "), "empty"),
                     (dict(choice=["x"] * 257), "at most 256"), (dict(json_schema="{" * 70_000), "at most")):
        with pytest.raises(InvalidArgument) as err:
            constraint_spec(llm_pb2.SamplingParams(**bad))
        assert why in err.value.message


def test_compile_caches_results_and_failures(compiler):
    spec = ConstraintSpec("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}}))
    assert compiler.compile(spec) == compiler.compile(spec)
    bad = ConstraintSpec("regex", "a(b")
    for _ in range(2):
        with pytest.raises(InvalidArgument) as err:
            compiler.compile(bad)
        assert "unclosed group" in err.value.message
    assert compiler.seen[-4:] == [("json_schema", False), ("json_schema", True), ("regex", False), ("regex", True)]


def test_a_cached_constraint_is_answered_without_compiling(compiler):
    # The engine's event loop asks `cached` first and goes to a thread only on a miss.
    spec = ConstraintSpec("regex", r"[0-9]{3}-cached")
    assert compiler.cached(spec) is None
    grammar = compiler.compile(spec)
    assert compiler.cached(spec) == grammar
    bad = ConstraintSpec("regex", "(unclosed-cached")
    assert compiler.cached(bad) is None
    with pytest.raises(InvalidArgument):
        compiler.compile(bad)
    with pytest.raises(InvalidArgument) as err:
        compiler.cached(bad)   # a failure is remembered with its reason
    assert "unclosed group" in err.value.message
    assert compiler.seen[-3:] == [("regex", True), ("regex", False), ("regex", True)]


def test_matchers_mask_advance_replay_and_release(compiler, hf):
    grammar = compiler.compile(ConstraintSpec("choice", choices=("yes", "no")))
    constraints = Constraints(compiler.tokenizer, len(hf))
    constraints.start(1, grammar, [])
    yes = hf("yes", add_special_tokens=False)["input_ids"]
    constraints.start(2, grammar, yes)          # replayed: complete, only EOS is left
    masks = constraints.masks_async([(7, ()), (1, ()), (2, ())]).result()   # row 0 is unconstrained
    assert masks.rows == [1, 2]
    logits, refused = constraints.apply(torch.zeros(3, len(hf)), masks)
    assert refused == []
    assert bool(torch.isfinite(logits[0]).all())
    allowed_1 = set(torch.isfinite(logits[1]).nonzero()[:, 0].tolist())
    assert set(hf("no", add_special_tokens=False)["input_ids"][:1]) <= allowed_1 and yes[0] in allowed_1
    assert torch.isfinite(logits[2]).nonzero()[:, 0].tolist() == [hf.eos_token_id]
    errors = ["", ""]
    constraints.advance([1, 2], [hf.eos_token_id, hf.eos_token_id], errors)
    assert "refused" in errors[0] and errors[1] == ""
    constraints.release([1, 2])
    assert constraints.active == 0
    with pytest.raises(ConstraintError):
        constraints.start(3, grammar, [hf.eos_token_id, 5])
