"""Output constraints in the worker: one llguidance matcher per constrained sequence, beside the sampler.

The engine compiled and checked each grammar at admission; it sends it the first time this worker
sees a sequence, with the output tokens the sequence already has (a recomputed, restarted or resumed
one), which are replayed into the fresh matcher. Each step then:

- ``masks_async`` fills the bitmask of every constrained row that samples, on a helper thread while
  the forward pass runs (llguidance computes it without the GIL), so one step stays in flight;
- ``apply`` sets the scores of disallowed tokens to -inf before the sampler's temperature, top-k
  and top-p; greedy and sampled rows both stay inside the constraint;
- ``advance`` feeds each sampled token to its matcher at once. A complete constraint allows only the
  end-of-sequence token, which ends the sequence (finish reason stop) in the engine.

A speculative draft row (the sequence's last token and draft tokens d_1..d_k, verified in one forward)
needs a mask for each of its 1 + k verification positions: row j is scored after d_j, so its mask is the
matcher's after consuming d_1..d_j. On the helper thread, while the forward runs, the matcher computes
row 0's mask, then consumes the draft one token at a time, computing the next row's mask after each; the
draft is *cut* at the first token the previous row's mask forbids (or after which the grammar allows
nothing), since no verification could accept it. Verification then sees only the cut draft, each row
under its own mask, and ``advance`` rolls the matcher back (``LLMatcher.rollback``) over the draft tokens
it did not accept before feeding the token the row gave of its own: the matcher ends having consumed
exactly the accepted tokens and that token, as one-token steps would have left it.

Matchers of a grammar are copied from a pristine one (``deep_copy`` costs microseconds; building
one costs about a millisecond), kept per grammar text.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import llguidance
import llguidance.hf
import numpy as np
import torch

from services.common.model_source import ModelSource

log = logging.getLogger("llmserve.worker.constraints")

PRISTINE_CACHE = 64   # grammars whose pristine matcher is kept


@dataclass(frozen=True)
class Masks:
    rows: list[int]            # which rows of the step's logits are constrained
    bitmask: torch.Tensor      # [len(rows), ceil(vocab / 32)] int32: bit t of a row = token t allowed
    # sequence index (among the rows that sample) -> how many of its draft tokens the grammar allows
    drafts: dict[int, int] = field(default_factory=dict)
    # ... and how many of them its matcher has consumed (until ``advance`` rolls back what verification
    # rejects): all of them, less an end-of-sequence token (never consumed ahead: see _walk_draft)
    consumed: dict[int, int] = field(default_factory=dict)


class ConstraintError(ValueError):
    """The sequence's constraint cannot go on (its grammar broke, or a token it forbids was fed)."""


class Constraints:
    def __init__(self, tokenizer: Callable[[], llguidance.LLTokenizer], vocab_size: int, threads: int = 1):
        self._make_tokenizer = tokenizer
        self._tokenizer: llguidance.LLTokenizer | None = None
        self.vocab_size = vocab_size
        self._matchers: dict[int, llguidance.LLMatcher] = {}
        self._pristine: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._executor = llguidance.LLExecutor(num_threads=threads)
        # Fills the masks while the forward runs. Every other method runs on the compute thread, and a
        # step's masks are collected before its tokens advance the matchers: no lock is needed.
        self._helper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="masks")

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._matchers

    @property
    def active(self) -> int:
        return len(self._matchers)

    def start(self, seq_id: int, grammar: str, replay: list[int]) -> None:
        """A fresh matcher for ``seq_id`` that has consumed ``replay`` (the output it already has)."""
        matcher = self._pristine_matcher(grammar).deep_copy()
        if replay and not matcher.consume_tokens(replay):
            raise ConstraintError(f"sequence {seq_id}: its output so far does not match its constraint: "
                                  f"{matcher.get_error()}")
        self._matchers[seq_id] = matcher

    def release(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            self._matchers.pop(seq_id, None)

    def masks_async(self, seqs: list[tuple[int, tuple[int, ...]]]) -> "Future[Masks] | None":
        """The bitmasks of the constrained rows of a step's logits, computed on the helper thread; None
        when no row is constrained. ``seqs``: (seq id, draft) of each sequence that samples, in order; its
        logits rows are one, or 1 + len(draft) for a draft row (verify.py)."""
        plain: list[tuple[llguidance.LLMatcher, int]] = []             # (matcher, logits row)
        drafted: list[tuple[int, llguidance.LLMatcher, int, tuple[int, ...]]] = []   # (seq index, matcher, first row, draft)
        row = 0
        for i, (seq_id, draft) in enumerate(seqs):
            matcher = self._matchers.get(seq_id)
            if matcher is not None:
                if draft:
                    drafted.append((i, matcher, row, draft))
                else:
                    plain.append((matcher, row))
            row += 1 + len(draft)
        if not plain and not drafted:
            return None
        return self._helper.submit(self._fill, plain, drafted)

    def _fill(self, plain: list[tuple[llguidance.LLMatcher, int]],
              drafted: list[tuple[int, llguidance.LLMatcher, int, tuple[int, ...]]]) -> "Masks":
        # What llguidance.torch.fill_next_token_bitmask_par does, without importing that module (it
        # decorates a function with torch.compile, which costs seconds of every worker's start).
        words = (self.vocab_size + 31) // 32
        bitmask = torch.full((len(plain) + sum(1 + len(d) for *_, d in drafted), words), -1, dtype=torch.int32)
        if plain:
            self._executor.unsafe_compute_mask_ptr([(m, k) for k, (m, _) in enumerate(plain)], bitmask.data_ptr(),
                                                   words * 4, len(plain))
        rows = [r for _, r in plain]
        drafts: dict[int, int] = {}
        consumed: dict[int, int] = {}
        eos = self._tokenizer.eos_token if self._tokenizer is not None else -1
        for index, matcher, first, draft in drafted:
            drafts[index], consumed[index] = self._walk_draft(matcher, draft, bitmask[len(rows):], eos)
            rows.extend(range(first, first + 1 + consumed[index]))
        return Masks(rows, bitmask[:len(rows)], drafts, consumed)

    @staticmethod
    def _walk_draft(matcher: llguidance.LLMatcher, draft: tuple[int, ...], out: torch.Tensor,
                    eos: int) -> tuple[int, int]:
        """Fill ``out``'s rows with the masks of a draft row's verification positions, consuming the draft
        token by token; returns (how many draft tokens the grammar allows, how many were consumed). The
        draft is cut before the first token it forbids, or before one after which it allows no token at
        all. An allowed end-of-sequence token ends the walk unconsumed: it stops the matcher, and
        llguidance's rollback does not restore a stopped matcher's state (the masks after it differed);
        the sequence ends there if it is accepted, so the row after it needs no mask."""
        words = out.shape[1]
        bits = out.numpy().view(np.uint8)
        matcher.unsafe_compute_mask_ptr(out[0].data_ptr(), words * 4)
        for j, token in enumerate(draft):
            if token >= bits.shape[1] * 8 or not bits[j, token >> 3] >> (token & 7) & 1:
                return j, j
            if token == eos:
                return j + 1, j
            if not matcher.consume_token(token):
                return j, j   # (its mask allowed it: not expected) the matcher's error fails this row alone
            matcher.unsafe_compute_mask_ptr(out[j + 1].data_ptr(), words * 4)
            if not bits[j + 1].any():
                matcher.rollback(1)
                return j, j
        return len(draft), len(draft)

    @staticmethod
    def apply(logits: torch.Tensor, masks: "Masks") -> tuple[torch.Tensor, list[tuple[int, str]]]:
        """``logits`` [rows, vocab] (as float32) with the disallowed tokens' scores of the constrained
        rows at -inf, and (row, why) for each row whose constraint allows no token at all. On the CPU
        this is numpy's work, in place (torch's masked ops wake its thread pool: ~10x slower here)."""
        logits = logits.float()
        vocab = logits.shape[1]
        bits = np.unpackbits(masks.bitmask.numpy().view(np.uint8), axis=1, bitorder="little").view(np.bool_)
        allowed = np.zeros((len(masks.rows), vocab), dtype=np.bool_)
        width = min(vocab, bits.shape[1])
        allowed[:, :width] = bits[:, :width]
        if logits.device.type == "cpu":
            scores = logits.numpy()
            for k, row in enumerate(masks.rows):
                np.copyto(scores[row], -np.inf, where=~allowed[k])
        else:
            index = torch.tensor(masks.rows, device=logits.device)
            blocked = torch.from_numpy(~allowed).to(logits.device)
            logits[index] = logits[index].masked_fill(blocked, float("-inf"))
        refused = [(row, "the output constraint allows no further token")
                   for row, ok in zip(masks.rows, allowed.any(axis=1).tolist()) if not ok]
        return logits, refused

    def advance(self, seq_ids: list[int], tokens: list[int], errors: list[str], consumed: dict[int, int] | None = None,
                accepted: list[list[int]] | None = None) -> None:
        """Feed each row's sampled token to its matcher; a row the matcher refuses gets an error. A draft
        row's matcher (``consumed``: row → draft tokens it consumed while the masks were filled) is first
        rolled back over the draft tokens verification did not accept (``accepted[row]``), then fed the
        accepted ones it had not consumed (an end-of-sequence token) and the row's own token (-1: none, a
        near tie); nothing after a token that stops it (the engine ends the sequence there too)."""
        for i, (seq_id, token) in enumerate(zip(seq_ids, tokens)):
            matcher = self._matchers.get(seq_id)
            if matcher is None:
                continue
            ahead = consumed.get(i, 0) if consumed else 0
            kept = [] if errors[i] or not accepted else accepted[i]
            if ahead > len(kept) and not matcher.rollback(ahead - len(kept)):
                errors[i] = errors[i] or f"the output constraint could not roll a draft back: {matcher.get_error()}"
            if errors[i]:
                continue
            for t in [*kept[ahead:], *((token,) if token >= 0 else ())]:
                if matcher.is_stopped():
                    break
                if not matcher.consume_token(t):
                    errors[i] = f"the output constraint refused token {t}: {matcher.get_error()}"
                    break

    def _pristine_matcher(self, grammar: str) -> llguidance.LLMatcher:
        matcher = self._pristine.get(grammar)
        if matcher is not None:
            self._pristine.move_to_end(grammar)
            return matcher
        if self._tokenizer is None:
            self._tokenizer = self._make_tokenizer()
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ConstraintError(f"the constraint does not compile: {matcher.get_error()}")
        self._pristine[grammar] = matcher
        while len(self._pristine) > PRISTINE_CACHE:
            self._pristine.popitem(last=False)
        return matcher


def tokenizer_loader(source: ModelSource, vocab_size: int) -> Callable[[], llguidance.LLTokenizer]:
    """Builds (when first needed: ~1 s) the llguidance tokenizer of ``source``'s own tokenizer."""
    def load() -> llguidance.LLTokenizer:
        from transformers import AutoTokenizer

        folder = _tokenizer_dir(source)
        tok = (AutoTokenizer.from_pretrained(folder) if folder is not None
               else AutoTokenizer.from_pretrained(source.path.parent, gguf_file=source.path.name))
        log.info("llguidance tokenizer of %s built (first constrained sequence)", source.name)
        return llguidance.hf.from_tokenizer(tok, n_vocab=vocab_size)
    return load


def _tokenizer_dir(source: ModelSource) -> Path | None:
    """A directory with the model's tokenizer: the model's own, or the one the engine converted from a GGUF."""
    if source.format == "safetensors":
        return source.path
    converted = source.cache_dir / "tokenizer"
    return converted if (converted / "tokenizer_config.json").is_file() else None
