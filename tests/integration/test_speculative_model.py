"""Speculative decoding with the real model (SmolLM2-135M, float32), in process: the engine loop,
scheduler and block manager drive a ``ModelRunner`` through the same protobuf the worker stream carries.

- greedy output is token for token the output with speculation off, alone and in a batch, for
  copy-heavy prompts (where drafts are accepted) and a free one;
- a seeded sampled request gives the same text run to run with speculation on, and the text it gets
  with speculation off;
- the drafts were really verified (many accepted), and no KV block is left held;
- in the default dtype (native GGUF blocks), a draft row's scores are bit for bit those of one-token
  steps, and greedy output equals speculation off alone and in a batch;
- a constrained greedy request (JSON Schema, regex) speculates (drafts cut by its grammar, each row
  masked, the matcher rolled back) and writes exactly its tokens with speculation off, which validate.
"""
from __future__ import annotations

import json
import queue
import re
import time
from collections import deque

import jsonschema
import pytest
import torch

from llmserve.worker.v1 import worker_pb2
from services.common.model_source import resolve_model
from services.common.sampling import SamplingOptions
from services.worker import kernels
from services.engine.core.block_manager import BlockManager
from services.engine.core.engine import LLMEngine
from services.engine.core.scheduler import SampledToken, Scheduler, SchedulerConfig, SchedulerOutput
from services.engine.core.sequence import Sequence
from services.engine.core.speculation import SpeculativeConfig, Speculator
from services.engine.models.constraints import ConstraintCompiler, ConstraintSpec
from services.engine.models.step_client import StepClient
from services.engine.models.tokenizer import Tokenizer
from services.worker.model_runner import ModelRunner, SeqWork
from services.worker.server import add_tokens, work_from_pb

WAIT = 300.0


class InProcessWorker:
    """The ``Executor`` over a ``ModelRunner`` in this process, through the worker protocol's messages."""

    restarts = 0

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.client = StepClient(None)  # type: ignore[arg-type]   # only its message building is used
        self.results: deque[worker_pb2.StepResult] = deque()
        self.step_id = 0

    def send(self, out: SchedulerOutput) -> None:
        self.step_id += 1
        req = self.client.step_request(out, self.step_id)
        self.runner.release(list(req.released_seq_ids))
        seq_ids, sampled, failed = self.runner.execute([work_from_pb(s) for s in req.seqs])
        result = worker_pb2.StepResult(step_id=self.step_id)
        add_tokens(result, seq_ids, sampled, failed)
        self.results.append(result)

    def receive(self, out: SchedulerOutput) -> dict[int, SampledToken]:
        return StepClient.sampled_tokens(self.results.popleft(), out)

    def restart(self) -> None:
        raise AssertionError("no restarts here")


@pytest.fixture(scope="module")
def model() -> tuple[ModelRunner, Tokenizer]:
    source = resolve_model("smollm2")
    return ModelRunner(source, "float32", "cpu", 48 * 2**20, 16), Tokenizer(source)


@pytest.fixture(scope="module")
def native_model() -> tuple[ModelRunner, Tokenizer]:
    if kernels.quant_library() is None:
        pytest.skip("the block kernels need AVX2, FMA, F16C")
    source = resolve_model("smollm2")
    return ModelRunner(source, "native", "cpu", 48 * 2**20, 16), Tokenizer(source)


PASSAGE = ("The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, "
           "polished the great lens, and wrote the weather in a leather logbook: wind from the west, "
           "seas moderate, visibility good. Ships passing the point saw the beam sweep across the water "
           "every twelve seconds, and they knew where the rocks were.")
CODE = ("def total(items):\n    result = 0\n    for item in items:\n        result += item.price * item.count\n"
        "    return result\n")


PROMPTS = [
    "Repeat this passage exactly, word for word:\n\n" + PASSAGE + "\n\nRepeated passage:\n",
    "Rename the function total to grand_total and output the whole code:\n\n" + CODE + "\nUpdated code:\n",
    "Write a short poem about autumn leaves.\n",
]


def generate(model, prompts: list[str], spec: SpeculativeConfig, sampling: SamplingOptions | list[SamplingOptions]):
    runner, tok = model
    bm = BlockManager(runner.pool.num_blocks, runner.pool.block_size)
    sched = Scheduler(SchedulerConfig(max_model_len=2048, eos_token_ids=tok.eos_token_ids), bm,
                      Speculator(spec, 2048))
    engine = LLMEngine(sched, InProcessWorker(runner), tok.decode, max_queue=64, max_worker_restarts=0)
    each = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
    seqs = [Sequence(prompt_token_ids=tok.encode_chat([{"role": "user", "content": p}]), sampling=s)
            for p, s in zip(prompts, each)]
    done: queue.Queue = queue.Queue()
    engine.start()
    try:
        for s in seqs:
            engine.submit(s, lambda ev, s=s: ev.finish_reason is not None and done.put(s))
        deadline = time.monotonic() + WAIT
        for _ in seqs:
            done.get(timeout=max(0.1, deadline - time.monotonic()))
    finally:
        engine.stop()
    bm.check_invariants()
    assert bm.num_used_blocks == 0
    return [list(s.output_token_ids) for s in seqs], sched.speculator


GREEDY = SamplingOptions(max_tokens=32, temperature=0.0)
ON = SpeculativeConfig(method="ngram", num_speculative_tokens=8, max_batch=4)   # batches speculate too


def test_greedy_speculation_gives_the_same_tokens_alone_and_in_a_batch(model):
    off, _ = generate(model, PROMPTS, SpeculativeConfig(method="none"), GREEDY)
    alone, spec = generate(model, PROMPTS[:1], ON, GREEDY)
    assert alone == off[:1]
    copied = spec.counters.num_accepted_tokens
    assert copied >= 16, f"only {copied} draft tokens accepted on a copy-heavy prompt"
    batch, spec = generate(model, PROMPTS, SpeculativeConfig(method="suffix", num_speculative_tokens=8, max_batch=4), GREEDY)
    assert batch == off
    assert spec.counters.num_drafts > 0


def test_a_seeded_sampled_request_is_reproducible_and_the_same_text_as_without_speculation(model):
    """Draft rows draw each token as the sampler does (verify.py), so a seeded request writes what it
    writes with speculation off, and the same again on a second run."""
    seeded = SamplingOptions(max_tokens=24, temperature=0.8, top_p=0.95, seed=42)
    first, spec = generate(model, PROMPTS[:1], ON, seeded)
    second, _ = generate(model, PROMPTS[:1], ON, seeded)
    off, _ = generate(model, PROMPTS[:1], SpeculativeConfig(method="none"), seeded)
    assert first == second == off
    assert spec.counters.num_drafts > 0 and spec.counters.num_accepted_tokens > 0


RECORD = {"name": "Alice Smith", "city": "Springfield", "job": "lighthouse keeper", "years": 12}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                           "city": {"type": "string", "maxLength": 40},
                                           "job": {"type": "string", "maxLength": 40},
                                           "years": {"type": "integer", "minimum": 0, "maximum": 100}},
          "required": ["name", "city", "job", "years"], "additionalProperties": False}
SENTENCE_RE = r"[a-z ,]+\."
CONSTRAINED_PROMPTS = [
    "Copy this JSON record exactly, then stop:\n\n" + json.dumps(RECORD, separators=(",", ":")) + "\n\nCopy:\n",
    "Repeat this sentence exactly, in lower case:\n\nthe keeper trimmed the wick, polished the lens, and wrote "
    "the weather in the logbook.\n\nRepeated:\n",
    PROMPTS[2],
]


def test_constrained_greedy_speculation_gives_the_same_valid_tokens(model):
    """Drafts under a constraint: cut where the grammar forbids, each verification row masked, the matcher
    rolled back over rejected drafts (services/worker/constraints.py). Greedy output equals speculation
    off, token for token, alone and beside a free row; the outputs validate; drafts were accepted."""
    runner, tok = model
    compiler = ConstraintCompiler(lambda: tok.hf, runner.vocab_size)
    json_grammar = compiler.compile(ConstraintSpec("json_schema", json.dumps(SCHEMA)))
    regex_grammar = compiler.compile(ConstraintSpec("regex", SENTENCE_RE))
    sampling = [SamplingOptions(max_tokens=48, temperature=0.0, grammar=json_grammar),
                SamplingOptions(max_tokens=40, temperature=0.0, grammar=regex_grammar), GREEDY]
    off, _ = generate(model, CONSTRAINED_PROMPTS, SpeculativeConfig(method="none"), sampling)
    alone, spec = generate(model, CONSTRAINED_PROMPTS[:1], ON, sampling[:1])
    assert alone == off[:1]
    accepted = spec.counters.num_accepted_tokens
    assert accepted >= 8, f"only {accepted} draft tokens accepted on a copy-heavy constrained prompt"
    batch, spec = generate(model, CONSTRAINED_PROMPTS, ON, sampling)
    assert batch == off
    assert spec.counters.num_accepted_tokens > 0
    eos = set(tok.eos_token_ids)
    texts = [tok.decode([t for t in out if t not in eos]) for out in off[:2]]
    jsonschema.validate(json.loads(texts[0]), SCHEMA)
    assert re.fullmatch(SENTENCE_RE, texts[1]), texts[1]


def test_native_draft_rows_score_bit_for_bit_as_one_token_steps(native_model):
    """The default dtype: the block kernels' per-row results do not depend on the rows beside them, and a
    draft row's queries are attended one at a time as one-token decodes are (paged_attention.DraftRow), so
    the verification logits equal those of one-token steps exactly, alone and beside another sequence."""
    runner, tok = native_model
    captured: list[torch.Tensor] = []
    head = runner._lm_head

    def recording_head(hidden: torch.Tensor) -> torch.Tensor:
        captured.append(head(hidden))
        return captured[-1]

    runner._lm_head = recording_head
    try:
        prompt = tok.encode_chat([{"role": "user", "content": PROMPTS[0]}])
        n, k, greedy = len(prompt), 6, SamplingOptions(temperature=0.0)

        def table(base: int) -> list[int]:
            return list(range(base, base + (n + k + 2) // runner.pool.block_size + 1))

        _, s, _ = runner.execute([SeqWork(1, prompt, 0, table(0), True, greedy)])
        tokens, one_token = [s.token_ids[0]], []
        for j in range(k + 1):
            _, s, _ = runner.execute([SeqWork(1, [tokens[-1]], n + j, table(0), True, greedy, num_generated=j + 1)])
            one_token.append(captured[-1][0])
            tokens.append(s.token_ids[0])
        draft = tuple(tokens[1:k + 1])
        runner.execute([SeqWork(2, prompt, 0, table(20), True, greedy), SeqWork(3, prompt[:-2], 0, table(40), True, greedy)])
        _, s, _ = runner.execute([SeqWork(2, tokens[:k + 1], n, table(20), True, greedy, num_generated=1, draft=draft)])
        assert torch.equal(captured[-1], torch.stack(one_token))
        assert s.accepted[0] == list(draft) and s.token_ids[0] == tokens[k + 1]
        runner.release([2])
        runner.execute([SeqWork(2, prompt, 0, table(20), True, greedy)])
        _, s, _ = runner.execute([SeqWork(3, [prompt[-2]], n - 2, table(40), True, greedy, num_generated=0),
                                  SeqWork(2, tokens[:k + 1], n, table(20), True, greedy, num_generated=1, draft=draft)])
        assert torch.equal(captured[-1][1:], torch.stack(one_token))
    finally:
        runner._lm_head = head
        runner.release([1, 2, 3])


def test_native_greedy_speculation_gives_the_same_tokens_alone_and_in_a_batch(native_model):
    off, _ = generate(native_model, PROMPTS, SpeculativeConfig(method="none"), GREEDY)
    alone, spec = generate(native_model, PROMPTS[:1], ON, GREEDY)
    assert alone == off[:1]
    assert spec.counters.num_accepted_tokens >= 16
    batch, spec = generate(native_model, PROMPTS, SpeculativeConfig(method="suffix", num_speculative_tokens=8, max_batch=4), GREEDY)
    assert batch == off
    assert spec.counters.num_accepted_tokens > 0
