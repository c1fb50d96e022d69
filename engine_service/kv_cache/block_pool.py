"""KV-cache blocks, the LRU free queue, and the pool that hands blocks out.

Invariants (checked by ``BlockPool.check_invariants``):
- a block is in the free queue iff its ``ref_cnt`` is 0;
- a block with a ``block_hash`` is the one entry of that hash in ``cached_blocks``;
- free blocks that still carry a hash are prefix-cache entries, evicted in LRU order
  when the pool needs a fresh block.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Sequence
from typing import Protocol


class BlockEventSink(Protocol):
    """Hears the prefix cache change (engine_service/vllm_grpc/kv_events.py publishes
    it). Called on the engine's step thread, so it must only record and return."""

    def stored(self, block_hash: bytes, parent_hash: bytes | None, token_ids: Sequence[int]) -> None:
        """A full block became a prefix-cache entry."""

    def removed(self, block_hash: bytes) -> None:
        """A cached block was evicted (its slot reused for other tokens)."""

    def cleared(self) -> None:
        """Every entry was dropped at once (reset_prefix_cache)."""


class KVCacheBlock:
    """One block of ``block_size`` token slots in every layer's K and V cache."""

    __slots__ = ("block_hash", "block_id", "next_free", "prev_free", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # Hash of the block's tokens chained with its prefix; None while not full/cached.
        self.block_hash: bytes | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        cached = "cached" if self.block_hash is not None else "-"
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, {cached})"


class FreeBlockQueue:
    """Doubly linked list of free blocks: pop from the head, append to the tail.

    Removing a block from the middle (a prefix-cache hit on a free block) is O(1).
    The head is the least recently freed block, so eviction is LRU.
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)  # sentinels
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is None or block is self._tail:
            raise RuntimeError("no free KV-cache blocks left")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise RuntimeError(f"{block} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None  # sentinel invariant, not input
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free += 1

    def __iter__(self) -> Iterable[KVCacheBlock]:
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free


def hash_block_tokens(
    parent_hash: bytes | None, token_ids: Sequence[int], extra: str | None = None
) -> bytes:
    """Chained hash of one full block: identical prefixes give identical hash chains.

    ``extra`` (the request's cache salt) enters the first block's hash only, which is
    enough to separate whole chains.
    """
    h = hashlib.sha256(parent_hash or b"")
    h.update(array("q", token_ids).tobytes())
    if extra is not None:
        h.update(b"\x00salt\x00" + extra.encode())
    return h.digest()


class BlockPool:
    """Owns every KVCacheBlock: allocation, reference counts and the prefix-cache index."""

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached_blocks: dict[bytes, KVCacheBlock] = {}
        self.events: BlockEventSink | None = None  # set: told of every cache entry change

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached_blocks.get(block_hash)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take ``n`` blocks from the free queue's head, evicting their cache entries."""
        if n > self.num_free_blocks:
            raise RuntimeError(f"asked for {n} blocks, only {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits, pulling free ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; blocks reaching 0 go to the queue's tail in order."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_block(
        self,
        block: KVCacheBlock,
        block_hash: bytes,
        parent_hash: bytes | None = None,
        token_ids: Sequence[int] = (),
    ) -> None:
        """Register a full, computed block under its hash (first writer wins).

        ``parent_hash`` / ``token_ids``: the previous block's hash and this block's
        tokens, passed on to ``events`` only."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached_blocks:
            return  # an identical block is already cached; this one stays private
        block.block_hash = block_hash
        self.cached_blocks[block_hash] = block
        if self.events is not None:
            self.events.stored(block_hash, parent_hash, token_ids)

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached_blocks.get(block.block_hash) is block:
                del self.cached_blocks[block.block_hash]
                if self.events is not None:
                    self.events.removed(block.block_hash)
            block.block_hash = None

    def reset_prefix_cache(self) -> int:
        """Forget every cached hash; blocks in use keep their contents. Returns count."""
        count = len(self.cached_blocks)
        for block in self.cached_blocks.values():
            block.block_hash = None
        self.cached_blocks.clear()
        if self.events is not None:
            self.events.cleared()
        return count

    def check_invariants(self) -> None:
        """Raise AssertionError if the pool's bookkeeping is inconsistent (tests use it)."""
        in_queue = {b.block_id for b in self.free_queue}
        if len(in_queue) != self.free_queue.num_free:
            raise AssertionError("free queue count does not match its contents")
        for block in self.blocks:
            if block.ref_cnt < 0:
                raise AssertionError(f"{block} has a negative ref count")
            if (block.ref_cnt == 0) != (block.block_id in in_queue):
                raise AssertionError(f"{block}: free-queue membership disagrees with ref count")
            if block.block_hash is not None and self.cached_blocks.get(block.block_hash) is not block:
                raise AssertionError(f"{block} has a hash but is not the cached entry for it")
        for block_hash, block in self.cached_blocks.items():
            if block.block_hash != block_hash:
                raise AssertionError(f"cache index points at {block} under a different hash")

    def check_all_free(self) -> None:
        """After every request ended: each block is free (maybe cached), ref counts 0."""
        self.check_invariants()
        busy = [b for b in self.blocks if b.ref_cnt != 0]
        if busy or self.num_free_blocks != self.num_blocks:
            raise AssertionError(f"blocks still referenced: {busy[:8]}")
