"""KV block allocation: a free list, reference counts and each sequence's block table.

Plain Python. The engine decides which blocks a sequence owns; the worker only holds the
memory behind them. So the engine knows its KV usage exactly. Reference counts leave room for
sharing blocks between sequences (prefix caching).
"""
from __future__ import annotations

from collections import deque

from services.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be > 0")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self._owners: dict[int, Sequence] = {}  # seq_id -> sequence holding blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks ``seq`` must gain so positions [0, num_computed + num_new_tokens) have a slot."""
        needed = self.blocks_for_tokens(seq.num_computed_tokens + num_new_tokens)
        return max(0, needed - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.num_new_blocks(seq, num_new_tokens) <= len(self._free)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Extend ``seq``'s block table to cover ``num_new_tokens`` more tokens."""
        n = self.num_new_blocks(seq, num_new_tokens)
        if n > len(self._free):
            raise RuntimeError(f"allocate: need {n} blocks, {len(self._free)} free (call can_allocate first)")
        for _ in range(n):
            block = self._free.popleft()
            self._ref_counts[block] += 1
            seq.block_table.append(block)
        if seq.block_table:
            self._owners[seq.seq_id] = seq

    def free(self, seq: Sequence) -> None:
        """Release every block of ``seq``; safe to call on a sequence that holds none."""
        for block in reversed(seq.block_table):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free.append(block)
        seq.block_table = []
        self._owners.pop(seq.seq_id, None)

    def check_invariants(self) -> None:
        """Every block is either free (ref 0) or referenced by exactly its owners' tables."""
        refs = [0] * self.num_blocks
        for seq in self._owners.values():
            if not seq.block_table:
                raise AssertionError(f"seq {seq.seq_id} registered with no blocks")
            if len(seq.block_table) < self.blocks_for_tokens(seq.num_computed_tokens):
                raise AssertionError(f"seq {seq.seq_id} computed tokens exceed its blocks")
            for block in seq.block_table:
                refs[block] += 1
        if refs != self._ref_counts:
            raise AssertionError("reference counts disagree with block tables")
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a block is on the free list twice")
        for block, count in enumerate(refs):
            if (count == 0) != (block in free):
                raise AssertionError(f"block {block}: ref {count} but free={block in free}")
