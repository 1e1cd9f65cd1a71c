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

Partly matching blocks: a freed sequence's last, partly filled block keeps the tokens it holds (a *tail*),
and a lookup that has matched whole blocks then takes the free block after them (a tail, or a cached full
block) whose first tokens match the prompt's next ones longest, if the prompt continues all the block holds
(a conversation's next turn after a tail) or ends inside it (a repeated prompt): it then recomputes only what
follows the match, not the rest of a 64-token block (SGLang's radix cache shares prefixes at token granularity;
this reaches that for the last block). The block's later slots are overwritten by the new sequence, so only a
free block is taken that way, and a full one taken so leaves the cache.

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
from dataclasses import dataclass
from itertools import islice

from services.engine.core.sequence import Sequence

BlockHash = bytes   # 32-byte SHA-256 digest


def chain_hash(parent: BlockHash | None, tokens: tuple[int, ...]) -> BlockHash:
    """SHA-256 of the parent block's hash and this block's token ids (int64, little-endian)."""
    return hashlib.sha256((parent or b"") + array("q", tokens).tobytes()).digest()


@dataclass(frozen=True)
class CachedPrefix:
    """What a new sequence can take from the cache: blocks (whole matches, then possibly one matching in part)
    holding its first ``num_tokens`` tokens."""

    blocks: list[int]
    num_tokens: int


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
        # Free blocks that were a sequence's last, partly filled block: block -> (parent hash, the tokens it holds)
        self._tail: dict[int, tuple[BlockHash | None, tuple[int, ...]]] = {}
        # parent hash -> the cached full blocks and tails that follow it (for lookups that match in part)
        self._following: dict[BlockHash | None, set[int]] = {}
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
        return self._match_whole(seq)[0]

    def _match_whole(self, seq: Sequence) -> tuple[list[int], BlockHash | None]:
        if not self.enable_prefix_caching:
            return [], None
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
        return blocks, parent

    def find_prefix(self, seq: Sequence) -> CachedPrefix:
        """The cached blocks matching the start of ``seq``'s tokens, then the free block after them whose first
        tokens match its next ones longest (at least one token is left to run)."""
        blocks, parent = self._match_whole(seq)
        done = len(blocks) * self.block_size
        if not self._following.get(parent):   # (empty unless prefix caching is on)
            return CachedPrefix(blocks, done)
        wanted = seq.token_ids(done, min(done + self.block_size, seq.num_tokens - 1))
        best, best_n = -1, 0
        for block in self._following[parent]:
            if self._ref_counts[block]:
                continue   # held: its later slots are someone's
            held = self._tail[block][1] if block in self._tail else self._block_key[block][1]  # type: ignore[index]
            n = 0
            for a, b in zip(held, wanted):
                if a != b:
                    break
                n += 1
            # Only a block that holds all it matches for: the prompt continues what the block holds (a tail), or
            # ends inside it (a repeat). A prompt that merely shares a few tokens with a cached block would take
            # and destroy a block that a repeat of its own prompt could have found whole.
            if n > best_n and (n == len(held) or n == len(wanted)):
                best, best_n = block, n
        return CachedPrefix(blocks + [best], done + best_n) if best_n else CachedPrefix(blocks, done)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block: the worker's KV memory behind them is gone (it restarted).

        Only blocks nobody holds may be in the cache then; the caller has freed every sequence."""
        if self.num_used_blocks:
            raise RuntimeError(f"reset_prefix_cache: {self.num_used_blocks} blocks are still held")
        self._cached.clear()
        self._block_hash = [None] * self.num_blocks
        self._block_key = [None] * self.num_blocks
        self._tail.clear()
        self._following.clear()

    def can_allocate_with_prefix(self, seq: Sequence, prefix: CachedPrefix, num_new_tokens: int) -> bool:
        """Room for ``seq`` to take ``prefix`` and then ``num_new_tokens`` more tokens."""
        taken_from_free = sum(1 for b in prefix.blocks if self._ref_counts[b] == 0)
        needed = self.blocks_for_tokens(prefix.num_tokens + num_new_tokens) - len(prefix.blocks)
        return needed <= len(self._free) - taken_from_free

    def take_prefix(self, seq: Sequence, prefix: CachedPrefix) -> None:
        """Give a fresh sequence (no blocks, nothing computed) the cached blocks of its prefix; a block it matches
        only in part (the last) leaves the cache, since the sequence writes its later slots."""
        if seq.block_table or seq.num_computed_tokens:
            raise RuntimeError(f"take_prefix: sequence {seq.seq_id} already holds blocks")
        self.num_prefix_queries += seq.num_tokens
        self.num_prefix_hits += prefix.num_tokens
        whole = prefix.num_tokens // self.block_size
        for i, block in enumerate(prefix.blocks):
            if self._ref_counts[block] == 0:
                del self._free[block]
            if i >= whole:
                self._uncache(block)
            self._ref_counts[block] += 1
        seq.block_table = list(prefix.blocks)
        seq.num_computed_tokens = prefix.num_tokens
        if prefix.blocks:
            self._owners[seq.seq_id] = seq

    def _uncache(self, block: int) -> None:
        """``block`` no longer holds what it was cached for (whole or as a tail)."""
        tail = self._tail.pop(block, None)
        key = tail if tail is not None else self._block_key[block]
        if key is not None:
            following = self._following.get(key[0])
            if following is not None:
                following.discard(block)
                if not following:
                    del self._following[key[0]]
        stale = self._block_hash[block]
        if stale is not None:
            del self._cached[stale]
            self._block_hash[block] = None
            self._block_key[block] = None

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
                self._following.setdefault(parent, set()).add(block)
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
            self._uncache(block)   # evict the cached contents this block held
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
        return ((self._block_hash[block] is None and block not in self._tail)
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

    def free(self, seq: Sequence, keep_tail: bool = True) -> None:
        """Release every block of ``seq``; safe to call on a sequence that holds none.

        Blocks go to the back of the free list in reverse order, so a sequence's last blocks (the
        least likely to be shared) are evicted before its first ones. Its last, partly filled block is
        remembered as a tail (``keep_tail``: its KV is sound), with the tokens it holds: those before both
        its computed tokens and its last token (steps in flight write only from there on)."""
        tail = self._tail_of(seq) if keep_tail and self.enable_prefix_caching else None
        for block in reversed(seq.block_table):
            self._release(block)
        if tail is not None and self._ref_counts[tail[0]] == 0 and self._block_hash[tail[0]] is None:
            block, parent, tokens = tail
            self._tail[block] = (parent, tokens)
            self._following.setdefault(parent, set()).add(block)
        seq.block_table = []
        seq.block_hashes = []
        self._owners.pop(seq.seq_id, None)

    def _tail_of(self, seq: Sequence) -> tuple[int, BlockHash | None, tuple[int, ...]] | None:
        bs = self.block_size
        sound = min(seq.num_computed_tokens, seq.num_tokens - 1)
        index = sound // bs
        if sound % bs == 0 or index >= len(seq.block_table) or len(seq.block_hashes) < index:
            return None
        parent = seq.block_hashes[index - 1] if index else None
        return seq.block_table[index], parent, tuple(seq.token_ids(index * bs, sound))

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
        for block, (parent, _) in self._tail.items():
            if block not in self._free or self._block_hash[block] is not None:
                raise AssertionError(f"tail block {block} is held or hashed")
            if block not in self._following.get(parent, ()):
                raise AssertionError(f"tail block {block} is not found after its parent")
        for parent, blocks in self._following.items():
            for block in blocks:
                key = self._tail.get(block) or self._block_key[block]
                if key is None or key[0] != parent:
                    raise AssertionError(f"block {block} listed after a parent it does not follow")
