"""Speculative decoding rows of `make bench`: speculation on against off, side by side in one run.

One stack (router, engine, worker) with the engine's default speculation (``--speculative-method``);
"off" is the same request with ``disable_speculation`` set, so both sides share the machine of the
moment: each round runs a workload off then on (odd rounds on then off, so that neither side always
runs second), and the round with the median ratio is kept (the lower middle one of an even count). Every
round builds its prompts from other text of the repository (paragraphs of its docs and README, its
small Python files, frozen in bench/spec_texts.json), so no "on" request repeats one seen before (an
opted-out request's output is not remembered by the suffix method either). Each prompt is first run for
one token, so both sides find its prefill in the prefix cache (otherwise "on", running second, would).
Greedy, EOS honoured: on and off write the same tokens.

Workloads: summarize a passage; extract its figures; rewrite a code file with one change; a chat
whose last turn asks to quote an earlier one (copy-heavy); free chat (stories and explanations).
Rows: one stream copy-heavy (the four kinds one after another), one stream free chat, 32 streams
mixed, 4 streams copy-heavy. Prints tokens/s off and on, the ratio against its target, and the mean
tokens per speculating step (1 + accepted drafts) from the requests' trailers; beside each row's rounds, the
pooled ratio (every round's tokens over every round's seconds, each side), steadier than any one round. Last, with
the stack down, the 4-stream row's ceiling on this machine (``verification_ceiling``): what every draft accepted
would give, from the worker's step measured in process.
"""
from __future__ import annotations

import functools
import json
import os
import statistics
import tempfile
import threading
from pathlib import Path

import grpc

from bench.load import RunStats, run_streams
from llmserve.v1 import llm_pb2, llm_pb2_grpc
from services.common.call_metadata import SPEC_ACCEPTED_TOKENS_KEY, SPEC_DRAFT_TOKENS_KEY, SPEC_DRAFTS_KEY
from services.stack import start_stack

ROUNDS = int(os.environ.get("BENCH_SPEC_ROUNDS", 2))
MAX_TOKENS = int(os.environ.get("BENCH_SPEC_TOKENS", 96))
ONLY_ROWS = os.environ.get("BENCH_SPEC_ROWS", "")   # e.g. "0,1": only those rows (0-based)

FREE = ["Write a short story about a lighthouse keeper.", "Explain in simple words how rain forms.",
        "Describe a walk through an autumn forest.", "Write a short story about a lost robot.",
        "Explain in simple words why the sky is blue.", "Describe a busy market in the morning.",
        "Write a poem about the sea.", "Explain in simple words what a computer does.",
        "Describe your ideal weekend.", "Write a short story about two friends and a kite."]


# The workloads' text, frozen (bench/spec_texts.json): prose paragraphs of the repository's README and docs (no
# tables, code or headings; 300-900 characters) and its small Python files (400-1,400 characters, with the first
# name each defines), as they were on 2026-12-03. Read live, they changed with every edit of the docs, and so did
# every row's prompts: runs of different days measured different text (docs/speculative-decoding.md).
TEXTS = Path(__file__).with_name("spec_texts.json")


@functools.cache
def _texts() -> dict:
    return json.loads(TEXTS.read_text())


def passages() -> list[str]:
    return _texts()["passages"]


def code_files() -> list[tuple[str, str]]:
    """(text, an identifier in it to rename)."""
    return [(text, name) for text, name in _texts()["code_files"]]


def copy_heavy(n: int, offset: int) -> list[list[tuple[str, str]]]:
    """``n`` copy-heavy chats (as lists of (role, content)), of the four kinds in turn, from text ``offset`` on."""
    ps, codes = passages(), code_files()
    chats = []
    for i in range(n):
        p = ps[(offset + i) % len(ps)]
        kind = i % 4
        if kind == 0:
            chats.append([("user", f"Summarize the passage below, keeping its own wording.\n\n{p}")])
        elif kind == 1:
            chats.append([("user", f"From the passage below, extract every number and the phrase it belongs to, "
                                   f"one per line, quoting the passage.\n\n{p}")])
        elif kind == 2:
            code, name = codes[(offset + i) % len(codes)]
            chats.append([("user", f"Rewrite this Python file with one change: rename `{name}` to `{name}_v2`. "
                                   f"Output the whole file.\n\n{code}")])
        else:
            chats.append([("user", f"Here is a note from my colleague:\n\n{p}"),
                          ("assistant", "Thanks, I have read the note."),
                          ("user", "Quote the note back to me exactly, word for word.")])
    return chats


def free_chat(n: int, offset: int) -> list[list[tuple[str, str]]]:
    return [[("user", FREE[(offset + i) % len(FREE)] + (f" ({offset + i})" if offset + i >= len(FREE) else ""))]
            for i in range(n)]


class Client:
    def __init__(self, address: str):
        self.channel = grpc.insecure_channel(address)
        self.stub = llm_pb2_grpc.LLMServiceStub(self.channel)
        self.lock = threading.Lock()
        self.spec = [0, 0, 0]     # drafts, draft tokens, accepted tokens (from the trailers)

    def run(self, label: str, chats: list[list[tuple[str, str]]], speculate: bool, sequential: bool,
            max_tokens: int = MAX_TOKENS) -> RunStats:
        by_key = {str(i): c for i, c in enumerate(chats)}

        def stream(key: str):  # type: ignore[no-untyped-def]
            messages = [llm_pb2.ChatMessage(role=r, content=c) for r, c in by_key[key]]
            sampling = llm_pb2.SamplingParams(temperature=0, max_tokens=max_tokens, disable_speculation=not speculate)
            call = self.stub.GenerateStream(llm_pb2.GenerateRequest(messages=messages, sampling=sampling), timeout=900)
            for msg in call:
                yield len(msg.token_ids)
            md = dict(call.trailing_metadata() or ())
            with self.lock:
                for i, key_ in enumerate((SPEC_DRAFTS_KEY, SPEC_DRAFT_TOKENS_KEY, SPEC_ACCEPTED_TOKENS_KEY)):
                    self.spec[i] += int(md.get(key_, 0))

        if not sequential:
            return run_streams(label, list(by_key), stream)
        runs = [run_streams(label, [k], stream) for k in by_key]
        return RunStats.pooled(runs)

    def close(self) -> None:
        self.channel.close()


ROWS = [  # label, streams, chats(round), sequential, target
    ("one stream, copy-heavy (summarize, extract, code edit, quote a turn)", 1,
     lambda r: copy_heavy(4, 4 * r), True, 2.0),
    ("one stream, free chat", 1, lambda r: free_chat(2, 2 * r), True, 0.97),
    ("4 streams, copy-heavy", 4, lambda r: copy_heavy(4, 50 + 4 * r), False, 1.5),
    ("32 streams, mixed", 32, lambda r: copy_heavy(16, 100 + 16 * r) + free_chat(16, 20 + 16 * r), False, 0.97),
]


def spec_rows(address: str) -> list[str]:
    """Runs every row against the router at ``address``; → markdown lines."""
    client = Client(address)
    lines = ["| workload | streams | off tok/s | on tok/s | on / off | target | tokens per speculating step | "
             "draft acceptance |", "|---|---|---|---|---|---|---|---|"]
    try:
        for i, (label, streams, chats, sequential, target) in enumerate(ROWS):
            if ONLY_ROWS and str(i) not in ONLY_ROWS.split(","):
                continue
            pairs = []
            for r in range(ROUNDS):
                batch = chats(r)
                # Each prompt once first (one token): its prefill is then in the prefix cache for both sides.
                client.run(label, batch, False, False, max_tokens=1)
                sides = {}
                for speculate in ((True, False) if r % 2 else (False, True)):
                    before = list(client.spec)
                    sides[speculate] = (client.run(label, batch, speculate, sequential),
                                        [a - b for a, b in zip(client.spec, before)])
                (off, _), (on, (drafts, draft_tokens, accepted)) = sides[False], sides[True]
                pairs.append((on.tokens_per_s / off.tokens_per_s, off, on, drafts, draft_tokens, accepted))
                print(f"spec {label} round {r}: off {off.tokens_per_s:.1f} tok/s ({off.tokens} tokens), on "
                      f"{on.tokens_per_s:.1f} tok/s ({on.tokens} tokens), {drafts} drafts, {accepted}/{draft_tokens} "
                      f"accepted", flush=True)
            ratio, off, on, drafts, draft_tokens, accepted = sorted(pairs, key=lambda p: p[0])[(len(pairs) - 1) // 2]
            per_step = f"{1 + accepted / drafts:.2f}" if drafts else "– (no drafts)"
            rate = f"{accepted / draft_tokens:.0%}" if draft_tokens else "–"
            lines.append(f"| {label} | {streams} | {off.tokens_per_s:.1f} | {on.tokens_per_s:.1f} | **{ratio:.2f}** | "
                         f"≥ {target} | {per_step} | {rate} |")
            # pooled: every round's tokens over every round's seconds, each side (the rounds alternate which side
            # runs first, so the machine's drift falls on both; steadier than any one round)
            pooled = (RunStats.pooled([p[2] for p in pairs]).tokens_per_s
                      / RunStats.pooled([p[1] for p in pairs]).tokens_per_s)
            print(f"  ratios across rounds: {', '.join(f'{p[0]:.2f}' for p in pairs)} (median of "
                  f"{statistics.median(p[0] for p in pairs):.2f}; pooled {pooled:.2f})", flush=True)
    finally:
        client.close()
    return lines


def verification_ceiling(dtype: str, streams: int = 4, context: int = 600, repeats: int = 9) -> str:
    """The most speculation can give ``streams`` copy-heavy streams on this machine: every row a draft of the length
    the engine allows at that many sequences (``draft_cap``), every draft token accepted, against
    one-token rows. In process, the worker's step alone (a ``ModelRunner``), rows at ``context``-token contexts (the
    4-stream prompts' order of size), the two steps taking turns; → a markdown line."""
    from bench.step_cost import decode_work, make_runner, time_steps
    from services.common.model_source import resolve_model
    from services.engine.core.speculation import draft_cap

    runner = make_runner(resolve_model("smollm2"), dtype)
    k = draft_cap(streams)
    plain, drafted = time_steps(runner, [decode_work(runner, [context] * streams, seq_base=10_000),
                                         decode_work(runner, [context] * streams, seq_base=20_000, draft=k)], repeats)
    gain = (streams * (1 + k) / drafted) / (streams / plain)
    return (f"- {streams} streams: with every draft accepted ({k} tokens a row, {streams * (1 + k)} rows a step) "
            f"speculation could give at most **{gain:.2f}×** here: such a step takes {drafted * 1e3:.1f} ms against "
            f"{plain * 1e3:.1f} ms for {streams} one-token rows ({drafted / plain:.2f}×; in process, {dtype}, "
            f"{context}-token contexts, median of {repeats})")


def rows(engine_args: list[str]) -> list[str]:
    """The rows, on a stack of their own with the engine's default speculation (the other sections' stack runs
    with speculation off: their prompts repeat from round to round); then the 4-stream row's ceiling on this
    machine, measured in process once the stack is down."""
    stack = start_stack(["--model", "smollm2", *engine_args], log_dir=Path(tempfile.mkdtemp(prefix="bench-spec-")))
    try:
        lines = spec_rows(stack.router.address)
    finally:
        stack.stop()
    dtype = engine_args[engine_args.index("--dtype") + 1] if "--dtype" in engine_args else "native"
    return [*lines, "", verification_ceiling(dtype)]


def main(engine_args: list[str]) -> None:
    print("\n".join(rows(engine_args)), flush=True)
