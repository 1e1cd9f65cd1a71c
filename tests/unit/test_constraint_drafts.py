"""Speculative drafts under an output constraint, in the worker's matchers (real llguidance, SmolLM2's
tokenizer, no model): the draft is cut at the first token the grammar forbids, each verification row gets
the mask of the matcher after the draft tokens before it, and after verification the matcher is rolled
back so that it has consumed exactly the accepted tokens and the row's own token."""
from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from services.common.model_source import resolve_model
from services.common.sampling import SamplingOptions
from services.engine.models.constraints import ConstraintCompiler, ConstraintSpec
from services.engine.models.tokenizer import _tokenizer_dir
from services.worker.constraints import Constraints
from services.worker.sampler import RowParams
from services.worker.verify import verify_rows

REGEX = r"[a-z]+( [a-z]+)*\."


@pytest.fixture(scope="module")
def hf():
    return AutoTokenizer.from_pretrained(_tokenizer_dir(resolve_model("smollm2")))


@pytest.fixture(scope="module")
def grammar_and_compiler(hf):
    class Quiet:
        def on_compiled(self, kind: str, seconds: float, cached: bool) -> None:
            pass

    compiler = ConstraintCompiler(lambda: hf, len(hf), Quiet())
    return compiler.compile(ConstraintSpec("regex", REGEX)), compiler


def ids(hf, text: str) -> list[int]:
    return hf(text, add_special_tokens=False)["input_ids"]


def allowed(bitmask_row: torch.Tensor, vocab: int) -> set[int]:
    bits = np.unpackbits(bitmask_row.numpy().view(np.uint8), bitorder="little")[:vocab]
    return set(np.flatnonzero(bits).tolist())


def reference_allowed(constraints: Constraints, grammar: str, consumed: list[int], vocab: int) -> set[int]:
    """What a fresh matcher that consumed ``consumed`` one token at a time allows next."""
    ref = Constraints(constraints._make_tokenizer, vocab)
    ref.start(99, grammar, consumed)
    masks = ref.masks_async([(99, ())]).result()
    return allowed(masks.bitmask[0], vocab)


def test_a_draft_is_cut_at_the_first_forbidden_token_and_each_row_gets_its_own_mask(hf, grammar_and_compiler):
    grammar, compiler = grammar_and_compiler
    vocab = len(hf)
    text = ids(hf, "hello world the end. xyz")          # "." ends the regex: " xy" is forbidden after it
    prompt_last, draft = text[0], tuple(text[1:])
    c = Constraints(compiler.tokenizer, vocab)
    c.start(1, grammar, [prompt_last])
    c.start(3, grammar, [])
    # Sampling rows: 1 (constrained draft row, logits rows 0..6), 2 (free draft row, rows 7..9), 3 (constrained plain, row 10)
    masks = c.masks_async([(1, draft), (2, (5, 6)), (3, ())]).result()
    cut = 4
    assert hf.decode(draft[cut]) == " xy"
    assert masks.drafts == {0: cut}                       # " world", " the", " end", "." are allowed; " xy" is not
    assert masks.rows == [10, 0, 1, 2, 3, 4]              # the plain row first (the executor's batch), then the draft's
    for k, row in enumerate(masks.rows[1:], start=1):
        consumed = [prompt_last, *draft[:row]]
        assert allowed(masks.bitmask[k], vocab) == reference_allowed(c, grammar, consumed, vocab)
    assert allowed(masks.bitmask[4 + 1], vocab) == {hf.eos_token_id}   # after ".": only the end
    assert allowed(masks.bitmask[0], vocab) == reference_allowed(c, grammar, [], vocab)

    # Verification (greedy) under those masks: the model "prefers" a forbidden token on every row, so only
    # the masks make the draft's tokens the best allowed ones up to row 2; row 2's best allowed token is " sea".
    logits = torch.zeros(11, vocab)
    logits[:, ids(hf, "!")[0]] = 50.0                    # forbidden everywhere
    for j in range(cut):
        logits[j, draft[j]] = 10.0
    sea = ids(hf, " sea")[0]
    logits[2, sea] = 20.0
    logits[10, ids(hf, "x")[0]] = 10.0
    logits, refused = c.apply(logits, masks)
    assert refused == []
    cut_drafts = [draft[:masks.drafts[0]], (5, 6), ()]
    greedy = SamplingOptions(temperature=0.0)
    rows = [RowParams(greedy, 0, []) for _ in range(3)]
    sampled = verify_rows(logits, [(cut_drafts[0], 1), ((5, 6), 3), ((), 0)], rows, 1e-3, offsets=[0, 7, 10])
    assert sampled.accepted[0] == list(draft[:2]) and sampled.token_ids[0] == sea
    errors = [""] * 3
    c.advance([1, 2, 3], sampled.token_ids, errors, masks.consumed, sampled.accepted)
    assert errors == ["", "", ""]
    # Rolled back over " end" and "." (rejected), then " sea": exactly what one-token steps consume.
    after = c.masks_async([(1, ()), (3, ())]).result()
    assert allowed(after.bitmask[0], vocab) == reference_allowed(c, grammar, [prompt_last, *draft[:2], sea], vocab)
    assert allowed(after.bitmask[1], vocab) == reference_allowed(c, grammar, [ids(hf, "x")[0]], vocab)


def test_an_end_of_sequence_draft_token_stops_the_matcher_and_the_rest_is_cut(hf, grammar_and_compiler):
    grammar, compiler = grammar_and_compiler
    vocab, eos = len(hf), hf.eos_token_id
    c = Constraints(compiler.tokenizer, vocab)
    words = ids(hf, "hello world.")
    c.start(1, grammar, words[:1])
    draft = (*words[1:], eos, words[0])                   # nothing may follow the end
    masks = c.masks_async([(1, draft)]).result()
    assert masks.drafts == {0: len(words)}                # " world", ".", EOS; the token after EOS is cut
    assert masks.consumed == {0: len(words) - 1}          # EOS is allowed but not consumed ahead
    logits = torch.zeros(1 + len(draft), vocab)
    logits, refused = c.apply(logits, masks)
    assert refused == []
    # All accepted, EOS among them: fed after the rollback (none here); the row's own token after it is not.
    errors = [""]
    c.advance([1], [eos], errors, masks.consumed, [list(draft[:len(words)])])
    assert errors == [""]
    assert c._matchers[1].is_stopped() and not c._matchers[1].is_error()


def test_a_rejected_first_draft_token_rolls_everything_back(hf, grammar_and_compiler):
    _, compiler = grammar_and_compiler
    vocab = len(hf)
    grammar = compiler.compile(ConstraintSpec("choice", choices=("hello world the end", "seashell")))
    c = Constraints(compiler.tokenizer, vocab)
    c.start(1, grammar, [])
    draft = tuple(ids(hf, "hello world the"))
    masks = c.masks_async([(1, draft)]).result()
    assert masks.drafts == {0: 3}
    sea = ids(hf, "sea")[0]                               # allowed only where nothing was consumed
    errors = [""]
    c.advance([1], [sea], errors, masks.consumed, [[]])     # nothing accepted; the row's own token is "sea"
    assert errors == [""]
    after = c.masks_async([(1, ())]).result()
    assert allowed(after.bitmask[0], vocab) == reference_allowed(c, grammar, [sea], vocab)
    # A verification error (non-finite scores) also leaves the matcher where it was before the draft.
    rest = tuple(ids(hf, "shell"))                        # "sea" + "shell": the whole choice
    masks = c.masks_async([(1, rest)]).result()
    assert masks.drafts == {0: len(rest)}
    errors = ["not finite"]
    c.advance([1], [0], errors, masks.consumed, [[]])
    again = c.masks_async([(1, ())]).result()
    assert allowed(again.bitmask[0], vocab) == reference_allowed(c, grammar, [sea], vocab)


def test_random_drafts_and_acceptances_leave_the_matcher_where_one_token_steps_would(hf, grammar_and_compiler):
    """Drafts looked up from JSON texts at random offsets, a random accepted prefix and an allowed token of
    the row after it, step after step: after each the matcher allows exactly what a fresh matcher that
    consumed the same output allows. (An end-of-sequence draft token is not consumed ahead: rolling back
    over a stop did not restore llguidance's state, which this test found.)"""
    _, compiler = grammar_and_compiler
    vocab, eos = len(hf), hf.eos_token_id
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                               "population": {"type": "integer", "minimum": 0, "maximum": 50}},
              "required": ["name", "population"], "additionalProperties": False}
    grammar = compiler.compile(ConstraintSpec("json_schema", json.dumps(schema)))
    docs = [ids(hf, t) + [eos] for t in ('{"name":"Paris","population":4}', '{"name":"Lyon","population":12}',
                                         '{"name":"Paris France","population":2}')]
    rng = random.Random(1)
    steps = 0
    for _ in range(25):
        c = Constraints(compiler.tokenizer, vocab)
        c.start(1, grammar, [])
        output: list[int] = []
        while eos not in output and len(output) < 40:
            doc = rng.choice(docs)
            at = rng.randrange(len(doc))
            draft = tuple(doc[at:at + rng.randrange(1, 9)])
            masks = c.masks_async([(1, draft)]).result()
            a = rng.randrange(masks.drafts[0] + 1)
            after = allowed(masks.bitmask[a], vocab) if a <= masks.consumed[0] else set(range(100))
            bonus = rng.choice(sorted(after))
            errors = [""]
            c.advance([1], [bonus], errors, masks.consumed, [list(draft[:a])])
            assert errors == [""]
            output += list(draft[:a]) if eos in draft[:a] else [*draft[:a], bonus]
            if eos not in output:
                now = c.masks_async([(1, ())]).result()
                assert allowed(now.bitmask[0], vocab) == reference_allowed(c, grammar, output, vocab), hf.decode(output)
            steps += 1
    assert steps >= 100
