"""KV block allocation: a free list, reference counts, block tables and the prefix cache.

Plain Python. The engine decides which blocks a sequence owns; the worker only holds the memory
behind them, so the engine knows its KV usage exactly.

Prefix caching: once a block is full, its hash — SHA-256 over the hash of everything before it
and the block's own tokens, so equal hashes mean equal prefixes — is recorded, together with the
parent hash and tokens it was made from. A lookup compares those too, so a hit is never trusted on
the hash alone (a 64-bit non-cryptographic hash can be collided on purpose: CVE-2025-25183). A new sequence whose prompt starts with cached
blocks takes them (reference counted) instead of recomputing them. A freed block keeps its
contents and its hash and stays findable until it is handed out again: the free list is LRU, so
the least recently freed cached block is the first evicted.

Consecutive blocks: the worker's attention reads a sequence's keys and values block by block, and a
block that does not follow the previous one in memory costs it a cache and TLB miss (one decode row
at 2,000 positions, 64-token blocks: 1.86 ms of attention a step from blocks in random order, 1.41 ms
in order, 1.52 ms in runs of four). After a busy load
the LRU order is scattered through the pool, so a sequence's next block is the one after its last
when that one is free and *cold* — holding nothing, or freed before the more recent half of the free
list (the recently freed half, the likeliest to be asked for again, is never taken out of turn). A
sequence's first block is the LRU candidate, among the first few, followed by the longest cold run.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from itertools import islice

from services.engine.core.sequence import Sequence

BlockHash = bytes   # 32-byte SHA-256 digest


def chain_hash(parent: BlockHash | None, tokens: tuple[int, ...]) -> BlockHash:
    """SHA-256 of the parent block's hash and this block's token ids (int64, little-endian)."""
    return hashlib.sha256((parent or b"") + array("q", tokens).tobytes()).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be > 0")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # LRU: evict from the front
        self._freed_at = [0] * num_blocks   # value of _num_freed when the block was last freed
        self._num_freed = 0
        self._ref_counts = [0] * num_blocks
        self._block_hash: list[BlockHash | None] = [None] * num_blocks
        # What each cached block was hashed from (parent hash, tokens): compared on every hit.
        self._block_key: list[tuple[BlockHash | None, tuple[int, ...]] | None] = [None] * num_blocks
        self._cached: dict[BlockHash, int] = {}   # hash -> block holding that full prefix block
        self._owners: dict[int, Sequence] = {}    # seq_id -> sequence holding blocks
        self.num_prefix_queries = 0               # prompt tokens looked up in the cache
        self.num_prefix_hits = 0                  # of those, tokens found cached

    # -- capacity -------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def prefix_hit_rate(self) -> float:
        return self.num_prefix_hits / self.num_prefix_queries if self.num_prefix_queries else 0.0

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks ``seq`` must gain so positions [0, num_computed + num_new_tokens) have a slot."""
        needed = self.blocks_for_tokens(seq.num_computed_tokens + num_new_tokens)
        return max(0, needed - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.num_new_blocks(seq, num_new_tokens) <= len(self._free)

    # -- prefix cache -----------------------------------------------------------------------

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks matching the start of ``seq``'s tokens (at least one token is left to run,
        so the step that admits it still produces logits)."""
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        tokens = seq.token_ids(0, seq.num_tokens)
        blocks: list[int] = []
        parent: BlockHash | None = None
        for start in range(0, (seq.num_tokens - 1) // bs * bs, bs):
            chunk = tuple(tokens[start:start + bs])
            digest = chain_hash(parent, chunk)
            block = self._cached.get(digest)
            if block is None or self._block_key[block] != (parent, chunk):
                break
            blocks.append(block)
            parent = digest
        return blocks

    def reset_prefix_cache(self) -> None:
        """Forget every cached block: the worker's KV memory behind them is gone (it restarted).

        Only blocks nobody holds may be in the cache then; the caller has freed every sequence."""
        if self.num_used_blocks:
            raise RuntimeError(f"reset_prefix_cache: {self.num_used_blocks} blocks are still held")
        self._cached.clear()
        self._block_hash = [None] * self.num_blocks
        self._block_key = [None] * self.num_blocks

    def can_allocate_with_prefix(self, seq: Sequence, cached: list[int], num_new_tokens: int) -> bool:
        """Room for ``seq`` to take ``cached`` and then ``num_new_tokens`` more tokens."""
        taken_from_free = sum(1 for b in cached if self._ref_counts[b] == 0)
        needed = self.blocks_for_tokens(len(cached) * self.block_size + num_new_tokens) - len(cached)
        return needed <= len(self._free) - taken_from_free

    def take_prefix(self, seq: Sequence, cached: list[int]) -> None:
        """Give a fresh sequence (no blocks, nothing computed) the cached blocks of its prefix."""
        if seq.block_table or seq.num_computed_tokens:
            raise RuntimeError(f"take_prefix: sequence {seq.seq_id} already holds blocks")
        self.num_prefix_queries += seq.num_tokens
        self.num_prefix_hits += len(cached) * self.block_size
        for block in cached:
            if self._ref_counts[block] == 0:
                del self._free[block]
            self._ref_counts[block] += 1
        seq.block_table = list(cached)
        seq.num_computed_tokens = len(cached) * self.block_size
        if cached:
            self._owners[seq.seq_id] = seq

    def cache_full_blocks(self, seq: Sequence, num_done: int) -> None:
        """Record the hashes of ``seq``'s blocks that its first ``num_done`` tokens (computed by the steps
        that have ended) have filled."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        hashes = seq.block_hashes
        done = len(hashes)
        full = min(min(num_done, seq.num_tokens) // bs, len(seq.block_table))
        if full <= done:
            return
        tokens = seq.token_ids(done * bs, full * bs)
        parent = hashes[-1] if hashes else None
        for i in range(done, full):
            j = (i - done) * bs
            chunk = tuple(tokens[j:j + bs])
            digest = chain_hash(parent, chunk)
            hashes.append(digest)
            block = seq.block_table[i]
            if self._block_hash[block] is None and digest not in self._cached:
                self._block_hash[block] = digest
                self._block_key[block] = (parent, chunk)
                self._cached[digest] = block
            parent = digest

    # -- allocation --------------------------------------------------------------------------

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Extend ``seq``'s block table to cover ``num_new_tokens`` more tokens."""
        n = self.num_new_blocks(seq, num_new_tokens)
        if n > len(self._free):
            raise RuntimeError(f"allocate: need {n} blocks, {len(self._free)} free (call can_allocate first)")
        for _ in range(n):
            block = self._next_block(seq.block_table[-1] if seq.block_table else None,
                                     self.blocks_for_tokens(seq.num_tokens) - len(seq.block_table))
            del self._free[block]
            stale = self._block_hash[block]
            if stale is not None:  # evict the cached contents this block held
                del self._cached[stale]
                self._block_hash[block] = None
                self._block_key[block] = None
            self._ref_counts[block] = 1
            seq.block_table.append(block)
        if seq.block_table:
            self._owners[seq.seq_id] = seq

    # A sequence's first block: the LRU candidate, among this many, with the longest cold run after it
    # (runs looked at up to RUN_PROBE blocks).
    RUN_CANDIDATES = 8
    RUN_PROBE = 64

    def _is_cold(self, block: int) -> bool:
        """Free and holding nothing, or freed before the most recently freed half of the free list."""
        if block >= self.num_blocks or block not in self._free:
            return False
        return (self._block_hash[block] is None
                or self._num_freed - self._freed_at[block] >= len(self._free) // 2)

    def _next_block(self, last: int | None, wanted: int) -> int:
        """The free block to hand out next: the one after ``last`` if cold, else the start of a cold run."""
        if last is not None and self._is_cold(last + 1):
            return last + 1
        longest = min(wanted, self.RUN_PROBE) - 1   # cold blocks after the start worth looking for
        best, best_run = -1, -1
        for block in islice(self._free, self.RUN_CANDIDATES):
            run = 0
            while run < longest and self._is_cold(block + 1 + run):
                run += 1
            if run > best_run:
                best, best_run = block, run
            if run >= longest:
                break
        return best

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the blocks of ``seq`` past its first ``num_tokens`` positions: slots a rejected
        speculative draft was given (they hold nothing cached: only full blocks of accepted tokens are
        hashed)."""
        keep = self.blocks_for_tokens(num_tokens)
        while len(seq.block_table) > keep:
            self._release(seq.block_table.pop())
        if not seq.block_table:
            self._owners.pop(seq.seq_id, None)

    def free(self, seq: Sequence) -> None:
        """Release every block of ``seq``; safe to call on a sequence that holds none.

        Blocks go to the back of the free list in reverse order, so a sequence's last blocks (the
        least likely to be shared) are evicted before its first ones."""
        for block in reversed(seq.block_table):
            self._release(block)
        seq.block_table = []
        seq.block_hashes = []
        self._owners.pop(seq.seq_id, None)

    def _release(self, block: int) -> None:
        self._ref_counts[block] -= 1
        if self._ref_counts[block] == 0:
            self._free[block] = None
            self._freed_at[block] = self._num_freed
            self._num_freed += 1

    def check_invariants(self) -> None:
        """Every block is either free (ref 0) or referenced by exactly its owners' tables; the
        prefix cache maps each hash to the one block that carries it."""
        refs = [0] * self.num_blocks
        for seq in self._owners.values():
            if not seq.block_table:
                raise AssertionError(f"seq {seq.seq_id} registered with no blocks")
            if len(seq.block_table) < self.blocks_for_tokens(seq.num_computed_tokens):
                raise AssertionError(f"seq {seq.seq_id} computed tokens exceed its blocks")
            if len(set(seq.block_table)) != len(seq.block_table):
                raise AssertionError(f"seq {seq.seq_id} holds a block twice")
            for block in seq.block_table:
                refs[block] += 1
        if refs != self._ref_counts:
            raise AssertionError("reference counts disagree with block tables")
        for block, count in enumerate(refs):
            if (count == 0) != (block in self._free):
                raise AssertionError(f"block {block}: ref {count} but free={block in self._free}")
        for h, block in self._cached.items():
            if self._block_hash[block] != h:
                raise AssertionError(f"cache entry for block {block} disagrees with its hash")
            key = self._block_key[block]
            if key is None or chain_hash(*key) != h:
                raise AssertionError(f"cache entry for block {block} is not the hash of its parent and tokens")
        if sum(h is not None for h in self._block_hash) != len(self._cached):
            raise AssertionError("a hashed block is missing from the cache map")
