"""The only code that runs the model: one flattened forward pass per step, then sampling."""
from __future__ import annotations

import contextlib
import itertools
import logging
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch

from services.common.model_source import ModelSource
from services.common.sampling import SamplingOptions
from services.worker import native_model, paged_attention
from services.worker.attention_kernel import AttentionKernel
from services.worker.constraints import Constraints, tokenizer_loader
from services.worker.kv_cache import KVPool
from services.worker.linear import Linear
from services.worker.llama_step import LlamaStep
from services.worker.model_loader import load_causal_lm
from services.worker.native_ops import NativeAttention
from services.worker.sampler import RowParams, Sampled, sample
from services.worker.verify import TIE_MARGIN, verify_rows

log = logging.getLogger("llmserve.worker.runner")

# a one-row native step over at most this many positions leaves a core to the services (ModelRunner._threads_for):
# the decode attention's part (kernels/native_glue.h SPLIT), which one thread runs whatever the step's threads
SHORT_CONTEXT = 512
# _one_row_leaves_a_core: the probe's context, its steps on each thread count a round, its rounds, and how much faster
# every thread must be in process to pay for the services' preemption served
ONE_ROW_PROBE = 32
ONE_ROW_STEPS = 16
ONE_ROW_ROUNDS = 5
ONE_ROW_GAIN = 0.85


@dataclass(frozen=True)
class SeqWork:
    """One sequence's share of a step (the worker-side view of a SequenceStep)."""

    seq_id: int
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sample: bool
    sampling: SamplingOptions = SamplingOptions(temperature=0.0)
    num_generated: int = 0
    prefix_token_ids: tuple[int, ...] = ()   # tokens before start_pos, when the worker has no history
    input_is_last_sampled: bool = False      # the input is this sequence's last sampled token, where it left off;
                                             # token_ids: empty, or a guess of it and a draft (_resolve)
    grammar: str = ""                        # set the first time the worker sees a constrained sequence
    grammar_replay: tuple[int, ...] = ()     # with grammar: the output tokens it already has
    draft: tuple[int, ...] = ()              # speculative draft: the last len(draft) of token_ids (verify.py)


class ModelRunner:
    def __init__(self, source: ModelSource, dtype: str, device: str, kv_cache_bytes: int, block_size: int = 0,
                 kv_cache_dtype: str = "auto"):
        self.device = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                                   ("cpu" if device == "auto" else device))
        # dtype "native": a GGUF's own blocks through the block kernels (native_model.py), 12-bit activations;
        # a model it cannot run that way runs in bfloat16 instead (said in the log and in ``weights``).
        if dtype == "native" and not native_model.supported(source):
            log.info("%s is not a GGUF file: native weights are its bfloat16 weights", source.name)
            dtype = "bfloat16"
        self.weights = dtype
        self.dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "native": torch.float32}[dtype]
        paged_attention.register()
        started = time.monotonic()
        native = native_model.load_native(source) if dtype == "native" else None
        if native is not None:
            self.model = None
            cfg = native.config
        else:
            self.model = load_causal_lm(source, self.dtype, self.device, paged_attention.ATTN_IMPLEMENTATION)
            cfg = self.model.config
        self.load_seconds = time.monotonic() - started
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        # Attention: the C++ kernel where it runs (bfloat16 on AVX-512 BF16 CPUs), else SDPA.
        kernel = AttentionKernel.load() if self.dtype == torch.bfloat16 and self.device.type == "cpu" else None
        self._attention_kernel: AttentionKernel | NativeAttention | None = kernel if kernel is not None and \
            kernel.supports(self.dtype, self.device, head_dim, cfg.num_attention_heads // cfg.num_key_value_heads) \
            else None
        kv_dtype, value_dtype = self.dtype, None
        if native is not None:
            # the native path's attention: C++ over the paged slots (native_ops.py), decode rows and (the avx512
            # build on an AVX-512 BF16 CPU) prefill chunks; elsewhere a chunk's queries run as decode rows.
            # Its KV pool is fp16 where the kernels run: half the bytes a long context reads each step (at 2,000
            # positions fp32 K and V are 92 MB a step for SmolLM2, as much as its weights) and twice the tokens
            # a pool holds; the conversion back to fp32 is exact, so only the stored values round (2^-11).
            # --kv-cache-dtype int8-values, where the avx512 kernels run every step's attention: the values in
            # int8 (q8: each head's values rounded to 255 levels of its largest, an fp32 scale beside them;
            # native_glue.h), a quarter less to hold and read than fp16 keys and values, at a cost in top-1
            # agreement (docs/performance.md); auto and float16 keep fp16 values.
            self._attention_kernel = NativeAttention.load(cfg.hidden_size, head_dim, cfg.intermediate_size)
            q8 = self._attention_kernel is not None and self._attention_kernel.q8
            if kv_cache_dtype == "int8-values" and not q8:
                raise ValueError("--kv-cache-dtype int8-values needs the avx512 attention kernels (a CPU with AVX-512 "
                                 "F/BW/VL and BF16); use auto or float16")
            if self._attention_kernel is not None:
                kv_dtype = torch.float16
                value_dtype = torch.int8 if kv_cache_dtype == "int8-values" else None
        # Block size 0: 64 tokens for a kernel (it reads a context block by block, and a scattered one
        # costs a cache and TLB miss per block: 1.48x a short step at 2,000 positions with 16-token blocks,
        # 1.22x with 64), else 16.
        block_size = block_size or (64 if self._attention_kernel is not None else 16)
        self.pool = KVPool(cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim, block_size,
                           kv_cache_bytes, kv_dtype, self.device, value_dtype)
        self.context_length = int(cfg.max_position_embeddings)
        self.vocab_size = int(cfg.vocab_size)
        # Each position computed by the arithmetic of its kind, whatever the step around it (_entries): with the
        # native block kernels, whose per-row results do not depend on the rows beside them, a draft row's scores
        # are then bit for bit those of one-token steps, and a prompt or a recomputed sequence gives the bits it
        # gave uncached. torch's float32 matmuls are not row-invariant, so there it would buy nothing.
        self._exact_rows = native is not None and native.lm_head.native
        if native is not None:
            self._step, self._lm_head = native.step, native.lm_head
            self.weights_bytes = native.weights_bytes
            self.weights_summary = native.summary
        else:
            # Llama-family models run the lean step (llama_step.py); others the stock forward with paged attention.
            self._step = LlamaStep(self.model) if LlamaStep.supports(self.model) else None
            self._lm_head = Linear(self.model.lm_head.weight)
            # What the worker holds: the model's own tensors (less the layers the lean step took) and the
            # matmuls' prepared copies (packed, and row-major for the one-row kernel).
            params = {p.data_ptr(): p.numel() * p.element_size() for p in self.model.parameters()}
            linears = (self._step.linears() if self._step is not None else []) + [self._lm_head]
            self.weights_bytes = sum(params.values()) + sum(lin.held_bytes(set(params)) for lin in linears)
            self.weights_summary = f"{dtype} (dequantized)" if source.format == "gguf" else dtype
        # Token history per sequence, for the repetition penalty; dropped when the engine releases it.
        self._history: dict[int, list[int]] = {}
        # The token each sequence sampled last and its position: the input of its next step when the engine
        # sent that step before reading this one's result (input_is_last_sampled).
        self._next: dict[int, tuple[int, int]] = {}
        # Output constraints: a grammar matcher per constrained sequence, masking its rows' logits.
        self.constraints = Constraints(tokenizer_loader(source, self.vocab_size), self.vocab_size,
                                       threads=torch.get_num_threads())
        # Whether a one-row step over a short context leaves a core to the services (_threads_for): measured here.
        self.one_row_fewer_threads = self._one_row_leaves_a_core()
        log.info("model %s loaded in %.2fs on %s (%s, %s forward, attention: %s; weights %.0f MiB: %s); "
                 "KV pool %d blocks x %d tokens (%.0f MiB; keys %s, values %s)",
                 source.name, self.load_seconds, self.device, dtype,
                 "lean Llama" if self._step is not None else "transformers",
                 self._attention_name(), self.weights_bytes / 2**20,
                 self.weights_summary, self.pool.num_blocks, block_size,
                 self.pool.nbytes / 2**20, self.pool.dtype, self.pool.value_dtype)

    def _attention_name(self) -> str:
        """Which attention the steps run, for the load log."""
        kernel = self._attention_kernel
        if kernel is None:
            return "SDPA"
        if not isinstance(kernel, NativeAttention):
            return "C++ kernel"
        if kernel.prefill:
            return f"C++ decode rows (fp32) and prefill chunks (bf16 products{' on AMX tiles' if kernel.tiles else ''})"
        return "C++ decode rows (fp32), prefill chunks' queries as decode rows (no prefill kernel in this build)"

    def release(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            self._history.pop(seq_id, None)
            self._next.pop(seq_id, None)
        self.constraints.release(seq_ids)

    @torch.inference_mode()
    def execute(self, work: list[SeqWork]) -> tuple[list[int], Sampled, dict[int, str]]:
        """Run one step; returns the seq ids that sampled and their samples (in ``work`` order), and
        the sequences refused before the forward (seq id → why): they fail alone, the rest run."""
        failed: dict[int, str] = {}
        ready = []
        for w in work:
            try:
                w = self._check(self._resolve(w))
                if w.grammar:
                    self.constraints.start(w.seq_id, w.grammar, list(w.grammar_replay))
                ready.append(w)
            except ValueError as exc:
                failed[w.seq_id] = str(exc)
        work = ready
        if not work:
            return [], Sampled([], [], [], [], []), failed
        for w in work:
            hist = self._history.get(w.seq_id) or list(w.prefix_token_ids) if w.start_pos else []
            del hist[w.start_pos:]  # in place: a decode step appends one token, O(1)
            hist.extend(w.token_ids)
            self._history[w.seq_id] = hist
        input_ids = torch.tensor([t for w in work for t in w.token_ids], dtype=torch.long, device=self.device)
        positions = torch.tensor([p for w in work for p in range(w.start_pos, w.start_pos + len(w.token_ids))],
                                 dtype=torch.long, device=self.device)
        # The constrained rows' masks (a draft row's: one per verification position) are filled on a helper
        # thread while the forward runs.
        sampling = [w for w in work if w.sample]
        masks = self.constraints.masks_async([(w.seq_id, w.draft) for w in sampling])
        entries, verify, chunks = self._entries(work)
        layout = paged_attention.StepLayout.build(self.pool, entries, self.device, self._attention_kernel, verify,
                                                  chunks)
        # Only the last token of a sequence that samples needs logits (every token of a draft row): skip the
        # vocab projection elsewhere.
        ends, flat = [], 0
        for w in work:
            flat += len(w.token_ids)
            if w.sample:
                ends.extend(range(flat - 1 - len(w.draft), flat))
        with self._threads_for(len(input_ids), work[0].start_pos + 1):
            if self._step is not None:
                hidden = self._step(input_ids, positions, layout)                                # [T, hidden]
            else:
                hidden = self.model.model(input_ids=input_ids[None], position_ids=positions[None], use_cache=False,
                                          **{paged_attention.STEP_KWARG: layout}).last_hidden_state[0]
            if not sampling:
                return [], Sampled([], [], [], [], []), failed
            logits = self._lm_head(hidden[torch.tensor(ends, device=self.device)])  # [num_sampling rows, vocab]
        rows = [RowParams(w.sampling, w.num_generated, self._history[w.seq_id]) for w in sampling]
        # Logits rows: one per plain sequence, 1 + k per draft row (verify.py).
        row_of = list(itertools.accumulate((1 + len(w.draft) for w in sampling), initial=0))
        drafts = [w.draft for w in sampling]
        refused: list[tuple[int, str]] = []   # (index among the sampling sequences, why)
        ready = masks.result() if masks is not None else None
        if ready is not None:
            # Each verification row under its own mask; a constrained draft is cut where its grammar stops it.
            logits, refused_rows = self.constraints.apply(logits, ready)
            index_of_row = {row: k for k, row in enumerate(row_of[:-1])}
            refused = [(index_of_row[row], why) for row, why in refused_rows if row in index_of_row]
            for k, allowed in ready.drafts.items():
                drafts[k] = drafts[k][:allowed]
        if any(drafts):
            sampled = verify_rows(logits, list(zip(drafts, (w.start_pos for w in sampling))), rows,
                                  TIE_MARGIN[self.dtype], offsets=row_of[:-1])
        else:
            sampled = sample(logits[torch.tensor(row_of[:-1], device=self.device)] if any(w.draft for w in sampling)
                             else logits, rows)   # the masks come before temperature, top-k and top-p
        for k, why in refused:
            sampled.errors[k] = why
        self.constraints.advance([w.seq_id for w in sampling], sampled.token_ids, sampled.errors,
                                 ready.consumed if ready is not None else None, sampled.accepted)
        for i, (w, token, error) in enumerate(zip(sampling, sampled.token_ids, sampled.errors)):
            accepted = len(sampled.accepted[i]) if sampled.accepted else 0
            last = len(w.token_ids) - len(w.draft) - 1 + accepted   # the row's last token that holds
            if error:
                self._next.pop(w.seq_id, None)
            elif token < 0:   # a draft row stopped at a near tie: a one-token row of its last token decides it
                self._next[w.seq_id] = (w.token_ids[last], w.start_pos + last)
            else:
                self._next[w.seq_id] = (token, w.start_pos + last + 1)
        return [w.seq_id for w in sampling], sampled, failed

    def _entries(self, work: list[SeqWork]) -> tuple[list[tuple[int, int, list[int]]], frozenset[int], frozenset[int]]:
        """The step's layout entries (start, queries, block table) in flat order, the entries whose queries are each
        a decode row (``verify``), and the one-query entries that are prefill chunks (``chunks``).

        With exact rows, each position is computed by the arithmetic of its kind: a prompt's tokens as a prefill
        chunk (whose rows' bits do not depend on where the chunks start, so a prompt's last token after a cache hit
        gets the bits it got uncached), the tokens the sequence generated as decode rows, one query each (so a
        sequence recomputed after a preemption or a worker's restart writes the keys and values its one-token steps
        wrote). A row that holds both (a recomputation) is two entries. Elsewhere one entry a row, a draft row's
        queries attended as one prefill chunk, a one-token row as a decode."""
        if not self._exact_rows:
            return [(w.start_pos, len(w.token_ids), w.block_table) for w in work], frozenset(), frozenset()
        entries: list[tuple[int, int, list[int]]] = []
        verify: set[int] = set()
        chunks: set[int] = set()
        for w in work:
            end = w.start_pos + len(w.token_ids)
            # the prompt ends where the generated tokens begin: num_generated of them end the known tokens
            prompt_end = min(max(end - len(w.draft) - w.num_generated, w.start_pos), end)
            if prompt_end > w.start_pos:
                chunks.add(len(entries))
                entries.append((w.start_pos, prompt_end - w.start_pos, w.block_table))
            if end > prompt_end:
                verify.add(len(entries))
                entries.append((prompt_end, end - prompt_end, w.block_table))
        return entries, frozenset(verify), frozenset(chunks)

    def _one_row_leaves_a_core(self) -> bool:
        """Times one-row native steps over a short context on one thread fewer and on every thread, alternating
        (a scratch sequence in the empty pool's first blocks), in ONE_ROW_ROUNDS rounds, and keeps the fewer unless
        every thread is faster by more than ONE_ROW_GAIN (the median of the rounds' ratios: one round read 0.68-0.91
        on an AVX2-only Zen 3 whose median was 0.76). Served, a step on every core shares them with the engine,
        router and client handling the token before it (~2 ms of CPU a token), which preempt its threads. While
        the step's phases met at barriers that cost ~0.2 (an AMD EPYC Zen 5: 0.80-0.88 in process, one stream's ITL
        ~10% lower on one thread); with phases that end when their work is done (kernels/share.h) ~0.05-0.1: on an
        Intel Xeon the probe read 0.61-0.63 and served two threads were 0.73 of one, on the Zen 3 0.66-0.81 and
        0.81-0.87 (docs/performance.md, "The probe in rounds")."""
        threads = torch.get_num_threads()
        if self.weights != "native" or self.device.type != "cpu" or threads < 2:
            return False
        bs = self.pool.block_size
        table = list(range(min(self.pool.num_blocks, -(-(ONE_ROW_PROBE + 2 * ONE_ROW_STEPS + 2) // bs))))
        if len(table) * bs < ONE_ROW_PROBE + 2 * ONE_ROW_STEPS + 2:
            return True
        seq = -1
        self.execute([SeqWork(seq, list(range(100, 100 + ONE_ROW_PROBE)), 0, table, sample=True)])
        ratios: list[float] = []
        medians: dict[int, list[float]] = {threads - 1: [], threads: []}
        try:
            for _ in range(ONE_ROW_ROUNDS):   # each round the same positions again (a scratch sequence)
                times: dict[int, list[float]] = {threads - 1: [], threads: []}
                for i in range(2 * ONE_ROW_STEPS):
                    n = threads - 1 if i % 4 in (0, 3) else threads
                    torch.set_num_threads(n)
                    started = time.perf_counter()
                    self._step(torch.tensor([100 + i]), torch.tensor([ONE_ROW_PROBE + i]),
                               paged_attention.StepLayout.build(self.pool, [(ONE_ROW_PROBE + i, 1, table)], self.device,
                                                                self._attention_kernel))
                    times[n].append(time.perf_counter() - started)
                for n in times:
                    medians[n].append(statistics.median(times[n][1:]))
                ratios.append(medians[threads][-1] / medians[threads - 1][-1])
        finally:
            torch.set_num_threads(threads)
            self.release([seq])
        ratio = statistics.median(ratios)
        fewer = not ratio < ONE_ROW_GAIN
        log.info("a one-row step over a short context: %.2f ms with %d threads, %.2f ms with %d (ratio %.2f, the "
                 "median of %d rounds' %.2f-%.2f): it runs with %d", statistics.median(medians[threads - 1]) * 1e3,
                 threads - 1, statistics.median(medians[threads]) * 1e3, threads, ratio, len(ratios), min(ratios),
                 max(ratios), threads - 1 if fewer else threads)
        return fewer

    @contextlib.contextmanager
    def _threads_for(self, rows: int, context: int) -> Iterator[None]:
        """A native step of one row over at most SHORT_CONTEXT positions runs on one thread fewer than the worker
        has (at least one) where that was measured to pay (_one_row_leaves_a_core): its few ms share the cores
        with the engine, router and client handling the token before it. Steps of more rows keep every thread
        (their arithmetic grows with the rows: 4 rows 6.0 against 3.5 ms in process), and so do longer contexts,
        whose attention runs in 512-key parts over the threads (2,000 positions 6.4 against 4.7 ms; up to 512 one
        part, one thread)."""
        threads = torch.get_num_threads()
        if (rows != 1 or context > SHORT_CONTEXT or not self.one_row_fewer_threads or threads < 2):
            yield
            return
        torch.set_num_threads(threads - 1)
        try:
            yield
        finally:
            torch.set_num_threads(threads)

    def _resolve(self, w: SeqWork) -> SeqWork:
        """A row whose input is the token this sequence sampled last: the row as sent when it starts with that
        token (a guess) at that token's position (the previous row's draft held in full); else that token alone,
        where the previous row left the sequence (the engine resolves it alike: Scheduler._settle)."""
        if not w.input_is_last_sampled:
            return w
        if w.seq_id not in self._next:
            raise ValueError(f"sequence {w.seq_id}: its input is the last sampled token, but the previous step "
                             "sampled none for it")
        token, pos = self._next[w.seq_id]
        if pos > w.start_pos:
            raise ValueError(f"sequence {w.seq_id}: its row starts at {w.start_pos}, before its last sampled "
                             f"token's position {pos}")
        if w.token_ids and w.token_ids[0] == token and pos == w.start_pos:
            return replace(w, input_is_last_sampled=False)
        return replace(w, token_ids=[token], start_pos=pos, draft=(), input_is_last_sampled=False,
                       num_generated=w.num_generated - (w.start_pos - pos))

    def _check(self, w: SeqWork) -> SeqWork:
        bs = self.pool.block_size
        end = w.start_pos + len(w.token_ids)
        if not w.token_ids:
            raise ValueError(f"sequence {w.seq_id}: no tokens to run")
        if end > self.context_length:
            raise ValueError(f"sequence {w.seq_id}: position {end} beyond the context length {self.context_length}")
        if len(w.block_table) * bs < end:
            raise ValueError(f"sequence {w.seq_id}: block table covers {len(w.block_table) * bs} tokens, needs {end}")
        if any(b >= self.pool.num_blocks or b < 0 for b in w.block_table):
            raise ValueError(f"sequence {w.seq_id}: block id out of range (pool has {self.pool.num_blocks})")
        return w
