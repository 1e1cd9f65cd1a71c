"""Attention over the paged KV pool, registered as a transformers attention implementation.

The stock model class runs all scheduled tokens of all sequences as one flattened row
``[1, num_tokens]``; per layer, this function writes the new keys/values into their slots, then
attends without padding one sequence to another (ragged attention).

In bfloat16 on a CPU with AVX-512 BF16, the whole step is one call of the C++ kernel
(``attention_kernel.py``): every query row (a decode row, or each token of a prefill chunk) over its own
causal context, read in place through its block table. On the native path (``NativeAttention``) a step's decode
and draft rows go through its decode kernel and, where it runs them (``prefill``), its prefill chunks through its
prefill kernel (``SplitRows``); where it does not, steps with a prefill chunk take the paths below. Elsewhere
(float32, the exactness path; CUDA):

- decode rows (one query each) are grouped by context length, and each group is one SDPA call
  over only its own slots: a group is cut wherever padding its shorter rows to its longest would
  cost more than another call. The grouped-query heads sharing a KV head are stacked as queries of
  that head, so no KV head is repeated. A step of equal-length decodes is one group, in flat order;
- each prefill chunk is its own causal SDPA call over its own context; a chunk that starts the
  sequence attends to the keys it has just computed, with no gather at all.

So a step's KV reads follow Σ context_i and its attention work Σ q_i × context_i, not batch × max.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from services.worker.attention_kernel import AttentionKernel
from services.worker.kv_cache import KVPool
from services.worker.native_ops import NativeAttention

ATTN_IMPLEMENTATION = "llmserve_paged"
STEP_KWARG = "llmserve_step"

# A decode group is cut when padding its rows to its longest context would gather more than this many
# extra slots per layer (plus a share of the group's own size): past that, one more SDPA call is cheaper.
GROUP_PAD_SLOTS = 256
GROUP_PAD_FRACTION = 0.25


@dataclass
class DecodeGroup:
    """Decode rows attended in one SDPA call, padded to the group's longest context."""

    rows: torch.Tensor | None      # [batch] flat-row index of each query; None = rows 0..batch-1 in order
    gather_slots: torch.Tensor     # [batch * max_kv] context slots (padded with slot 0)
    mask: torch.Tensor | None      # [batch, 1, 1, max_kv] True = may attend; None = no padding
    batch: int
    max_kv: int


@dataclass
class KernelRows:
    """Every query row of a step, in flat order, for the C++ kernel: each over its own causal context."""

    kernel: AttentionKernel | NativeAttention
    row_seq: torch.Tensor | None   # [T] which block table each row reads; None = row i reads table i (all decodes)
    tables: torch.Tensor           # [sequences, width] block tables (padded with block 0)
    lens: torch.Tensor             # [T] positions each row attends to (its own position + 1)
    split: "SplitRows | None" = None   # a step with prefill chunks for a kernel that runs them apart (NativeAttention)


@dataclass
class SplitRows:
    """A step with prefill chunks for ``NativeAttention``: its decode rows (one-token sequences, and each query of a
    speculative draft row) by the decode kernel, bit for bit as in a decode-only step, its chunks by the prefill
    kernel."""

    decode_rows: torch.Tensor | None   # [nd] flat rows attended as decode rows; None = none
    decode_tables: torch.Tensor        # [nd, width] the block table of each
    decode_lens: torch.Tensor          # [nd] positions each attends to
    chunks: torch.Tensor               # [c, 4] int64: first flat row, queries, start position, row of the tables


@dataclass
class PrefillChunk:
    """One sequence's run of queries (more than one token), attended causally over its own context."""

    begin: int                     # flat-row range of its queries
    end: int
    gather_slots: torch.Tensor | None  # [kv_len] context slots; None = the chunk starts the sequence
    mask: torch.Tensor | None      # [q, kv_len] True = may attend (bottom-right causal); None = is_causal


@dataclass
class DraftRow:
    """A speculative draft row's queries, each attended as a one-token decode alone is: its own SDPA call
    over exactly its own context (``start + j + 1`` slots, no padding, no mask). The context is gathered
    once; query j reads the first ``start + j + 1`` of it."""

    begin: int                     # flat-row index of its first query
    start: int                     # position of its first query
    n: int                         # queries
    gather_slots: torch.Tensor     # [start + n] context slots


@dataclass
class StepLayout:
    """Index tensors shared by every layer of one step (built once per step)."""

    pool: KVPool
    slot_mapping: torch.Tensor     # [num_tokens] slot each new token's K/V is written to
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillChunk]
    num_tokens: int
    kernel_rows: KernelRows | None = None   # when the kernel runs the step (then no decode groups or prefills)
    drafts: list[DraftRow] = field(default_factory=list)

    @classmethod
    def build(cls, pool: KVPool, seqs: list[tuple[int, int, list[int]]], device: torch.device,
              kernel: AttentionKernel | NativeAttention | None = None,
              verify: frozenset[int] = frozenset(), chunks: frozenset[int] = frozenset()) -> "StepLayout":
        """``seqs``: (start_pos, num_new_tokens, block_table) per sequence, in flat-row order; ``kernel``: runs
        every row (the caller has checked it supports this pool's dtype, device and heads), or, where it does not
        run prefill chunks (``kernel.prefill``), only the steps whose rows are all decode or draft rows.
        ``verify``: the indices of ``seqs`` that are speculative draft rows: each of their queries is attended
        exactly as a one-token decode alone is, so their scores are those one-token steps would give
        (docs/speculative-decoding.md): by the kernel as a decode row of its own, else by its own SDPA call
        over its own context (no padding); a sequence's generated tokens recomputed are such rows as well.
        ``chunks``: indices of one-query entries that are prefill chunks, not decode rows (a prompt's last token
        after a prefix-cache hit: computed as in the chunk it would have ended uncached, ModelRunner._entries)."""
        decode = [(n == 1 and i not in chunks) or i in verify for i, (_, n, _) in enumerate(seqs)]
        if isinstance(kernel, NativeAttention) and not kernel.prefill:
            # The native kernels' portable build has a decode kernel and no prefill kernel: it runs every query,
            # each of a prefill chunk as a decode row over its own causal context (the rows of one sequence share
            # its keys' reads, DecodePlan). SDPA for the chunks would round differently from the decode rows
            # beside them and from the same prompt cut elsewhere (fresh fp32 keys against the pool's fp16), so a
            # greedy request's tokens would depend on the batch, the cache and the chunking.
            decode = [True] * len(seqs)
        if kernel is not None and (kernel.prefill or all(decode)):
            return cls._for_kernel(pool, seqs, device, kernel, decode)
        bs = pool.block_size
        slot_parts: list[int] = []
        decodes: list[tuple[int, int, list[int]]] = []   # (flat row, kv_len, block table)
        prefills: list[PrefillChunk] = []
        drafts: list[DraftRow] = []
        flat = 0
        for i, (start, n, table) in enumerate(seqs):
            end = start + n
            if n == 1 and decode[i]:
                slot_parts.append(table[start // bs] * bs + start % bs)
                decodes.append((flat, end, table))
            elif decode[i]:
                pos = torch.arange(end)
                slots = torch.tensor(table[:-(-end // bs)], dtype=torch.long)[pos // bs] * bs + pos % bs
                slot_parts.extend(slots[start:].tolist())
                drafts.append(DraftRow(flat, start, n, slots.to(device)))
            else:
                pos = torch.arange(end)
                slots = torch.tensor(table[:-(-end // bs)], dtype=torch.long)[pos // bs] * bs + pos % bs
                slot_parts.extend(slots[start:].tolist())
                if start == 0:
                    prefills.append(PrefillChunk(flat, flat + n, None, None))
                else:
                    q_pos = torch.arange(start, end)
                    mask = pos[None, :] <= q_pos[:, None]
                    prefills.append(PrefillChunk(flat, flat + n, slots.to(device), mask.to(device)))
            flat += n
        groups = [cls._decode_group(g, bs, device, in_order=len(g) == flat)
                  for g in cls._split_decodes(decodes)] if decodes else []
        return cls(pool=pool, slot_mapping=torch.tensor(slot_parts, dtype=torch.long, device=device),
                   decode_groups=groups, prefills=prefills, num_tokens=flat, drafts=drafts)

    @classmethod
    def _for_kernel(cls, pool: KVPool, seqs: list[tuple[int, int, list[int]]], device: torch.device,
                    kernel: AttentionKernel | NativeAttention, decode: list[bool]) -> "StepLayout":
        bs = pool.block_size
        width = max(-(-(start + n) // bs) for start, n, _ in seqs)
        tables = torch.tensor([t[:width] + [0] * (width - len(t[:width])) for _, _, t in seqs], dtype=torch.long)
        if all(n == 1 and d for (_, n, _), d in zip(seqs, decode)):   # one-query decode rows only (the common step)
            slots = [t[start // bs] * bs + start % bs for start, _, t in seqs]
            rows = KernelRows(kernel, None, tables, torch.tensor([start + 1 for start, _, _ in seqs], dtype=torch.long))
            return cls(pool=pool, slot_mapping=torch.tensor(slots, dtype=torch.long, device=device), decode_groups=[],
                       prefills=[], num_tokens=len(seqs), kernel_rows=rows)
        row_seq = torch.repeat_interleave(torch.arange(len(seqs)), torch.tensor([n for _, n, _ in seqs]))
        positions = torch.cat([torch.arange(start, start + n) for start, n, _ in seqs])
        slot_mapping = tables[row_seq, positions // bs] * bs + positions % bs
        lens = positions + 1
        split = None
        # the native kernel runs decode rows (each query of a draft row one of its own) apart from prefill chunks
        if isinstance(kernel, NativeAttention):
            if not all(decode):
                split = cls._split(seqs, decode, tables, lens)
            elif len(seqs) != len(positions):
                tables = tables[row_seq]
        rows = KernelRows(kernel, None if len(tables) == len(positions) else row_seq, tables, lens, split)
        return cls(pool=pool, slot_mapping=slot_mapping.to(device), decode_groups=[], prefills=[],
                   num_tokens=len(positions), kernel_rows=rows)

    @staticmethod
    def _split(seqs: list[tuple[int, int, list[int]]], decode: list[bool], tables: torch.Tensor,
               lens: torch.Tensor) -> SplitRows:
        decode_rows: list[int] = []
        decode_seq: list[int] = []
        chunks: list[tuple[int, int, int, int]] = []
        flat = 0
        for i, (start, n, _) in enumerate(seqs):
            if decode[i]:
                decode_rows.extend(range(flat, flat + n))
                decode_seq.extend([i] * n)
            else:
                chunks.append((flat, n, start, i))
            flat += n
        rows = torch.tensor(decode_rows, dtype=torch.long)
        return SplitRows(rows if decode_rows else None, tables[torch.tensor(decode_seq, dtype=torch.long)],
                         lens[rows], torch.tensor(chunks, dtype=torch.long))

    @staticmethod
    def _split_decodes(decodes: list[tuple[int, int, list[int]]]) -> list[list[tuple[int, int, list[int]]]]:
        """One group when padding is cheap (kept in flat order); otherwise groups of similar lengths."""
        lens = [kv for _, kv, _ in decodes]
        longest = max(lens)
        if len(decodes) * longest - sum(lens) <= GROUP_PAD_SLOTS + GROUP_PAD_FRACTION * len(decodes) * longest:
            return [decodes]
        groups: list[list[tuple[int, int, list[int]]]] = []
        for d in sorted(decodes, key=lambda d: -d[1]):
            if groups:
                g = groups[-1]
                top, size = g[0][1], len(g) + 1
                waste = size * top - (sum(x[1] for x in g) + d[1])
                if waste <= GROUP_PAD_SLOTS + GROUP_PAD_FRACTION * size * top:
                    g.append(d)
                    continue
            groups.append([d])
        return groups

    @staticmethod
    def _decode_group(rows: list[tuple[int, int, list[int]]], bs: int, device: torch.device,
                      in_order: bool) -> DecodeGroup:
        kv_len = torch.tensor([kv for _, kv, _ in rows], dtype=torch.long)
        max_kv = int(kv_len.max())
        width = -(-max_kv // bs)
        tables = torch.tensor([t[:width] + [0] * (width - len(t[:width])) for _, _, t in rows], dtype=torch.long)
        positions = torch.arange(max_kv)
        gather = tables[:, positions // bs] * bs + positions % bs                  # [batch, max_kv]
        mask = None
        if int(kv_len.min()) != max_kv:
            mask = (positions[None, :] < kv_len[:, None])[:, None, None, :].to(device)
        flat_rows = None if in_order else torch.tensor([r for r, _, _ in rows], dtype=torch.long, device=device)
        return DecodeGroup(flat_rows, gather.reshape(-1).to(device), mask, len(rows), max_kv)


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                            **kwargs: object) -> tuple[torch.Tensor, None]:
    layout = kwargs.get(STEP_KWARG)
    if not isinstance(layout, StepLayout):
        raise RuntimeError(f"{ATTN_IMPLEMENTATION} attention needs the {STEP_KWARG} keyword argument")
    return attend(layout, module.layer_idx, query, key, value, scaling), None  # type: ignore[arg-type]


def attend(layout: StepLayout, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           scaling: float | None, stored: bool = False) -> torch.Tensor:
    """Write this step's keys/values into the layer's slots (unless the caller has: ``stored``) and attend:
    query [1, heads, T, d], key/value [1, kv_heads, T, d] → [1, T, heads, d]."""
    k_cache, v_cache = layout.pool.layer(layer_idx)
    if not stored:
        k_cache.index_copy_(0, layout.slot_mapping, key[0].transpose(0, 1).to(k_cache.dtype))
        v_cache.index_copy_(0, layout.slot_mapping, value[0].transpose(0, 1).to(v_cache.dtype))
    heads, d = query.shape[1], query.shape[3]
    kv_heads = k_cache.shape[1]
    group_size = heads // kv_heads
    q_flat = query[0].transpose(0, 1)                                          # [T, heads, d]
    groups, prefills, rows = layout.decode_groups, layout.prefills, layout.kernel_rows
    if rows is not None:
        if q_flat.stride(2) != 1 or q_flat.stride(1) != d:
            q_flat = q_flat.contiguous()
        out = torch.empty(layout.num_tokens, heads, d, dtype=query.dtype, device=query.device)
        scale = scaling if scaling is not None else d ** -0.5
        if rows.split is not None:
            sp = rows.split
            rows.kernel.chunks(q_flat, sp.decode_rows, sp.decode_tables, sp.decode_lens,  # type: ignore[union-attr]
                               sp.chunks, k_cache, v_cache, rows.tables, layout.pool.block_size, scale, out)
        else:
            rows.kernel(q_flat, rows.row_seq, k_cache, v_cache, rows.tables, rows.lens, layout.pool.block_size,
                        scale, out)
        return out.unsqueeze(0)
    if len(groups) == 1 and not prefills and not layout.drafts and groups[0].rows is None:
        return _decode(groups[0], q_flat, k_cache, v_cache, kv_heads, group_size, scaling).unsqueeze(0)
    out = torch.empty(layout.num_tokens, heads, d, dtype=query.dtype, device=query.device)
    for g in groups:
        q = q_flat if g.rows is None else torch.index_select(q_flat, 0, g.rows)
        res = _decode(g, q, k_cache, v_cache, kv_heads, group_size, scaling)
        if g.rows is None:
            out[:g.batch] = res
        else:
            out.index_copy_(0, g.rows, res)
    for p in prefills:
        q = query[:, :, p.begin:p.end]                                         # [1, heads, q, d]
        if p.gather_slots is None:
            k, v = key[:, :, p.begin:p.end], value[:, :, p.begin:p.end]
        else:
            kv_len = p.gather_slots.shape[0]
            k = torch.index_select(k_cache, 0, p.gather_slots).view(1, kv_len, kv_heads, d).transpose(1, 2)
            v = torch.index_select(v_cache, 0, p.gather_slots).view(1, kv_len, kv_heads, d).transpose(1, 2)
        res = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=p.mask,
                                             is_causal=p.mask is None, scale=scaling, enable_gqa=group_size > 1)
        out[p.begin:p.end] = res[0].transpose(0, 1)
    for r in layout.drafts:
        kv_len = r.gather_slots.shape[0]
        k = torch.index_select(k_cache, 0, r.gather_slots).view(1, kv_len, kv_heads, d).transpose(1, 2).to(q_flat.dtype)
        v = torch.index_select(v_cache, 0, r.gather_slots).view(1, kv_len, kv_heads, d).transpose(1, 2).to(q_flat.dtype)
        q = q_flat[r.begin:r.begin + r.n].reshape(r.n, kv_heads, group_size, d)
        for j in range(r.n):
            context = r.start + j + 1
            res = F.scaled_dot_product_attention(q[j:j + 1], k[:, :, :context], v[:, :, :context], scale=scaling)
            out[r.begin + j] = res.reshape(heads, d)
    return out.unsqueeze(0)


def _decode(g: DecodeGroup, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_heads: int,
            group_size: int, scaling: float | None) -> torch.Tensor:
    """``q`` [batch, heads, d] → [batch, heads, d]. The ``group_size`` query heads of one KV head are
    that head's queries: attention over [batch, kv_heads, group_size, max_kv], no KV repeated."""
    batch, max_kv, d = g.batch, g.max_kv, q.shape[-1]
    k = torch.index_select(k_cache, 0, g.gather_slots).view(batch, max_kv, kv_heads, d).transpose(1, 2)
    v = torch.index_select(v_cache, 0, g.gather_slots).view(batch, max_kv, kv_heads, d).transpose(1, 2)
    q = q.reshape(batch, kv_heads, group_size, d)
    out = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=g.mask,
                                         scale=scaling)  # [batch, kv_heads, group, d]
    return out.reshape(batch, kv_heads * group_size, d)


def _no_mask(*args: object, **kwargs: object) -> None:
    return None  # masks come from StepLayout; skip transformers' own mask construction


def register() -> None:
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)
