"""The blocks of a model's sliding-window layers: only what the window can still see.

A model with sliding-window layers (Mistral, Gemma 2/3, Qwen2 with ``use_sliding_window``)
keeps those layers' KV in a pool of its own, beside the full-attention layers' (the
``KVCacheManager``'s). A request's table here has the same logical blocks as its full
table, but a block is given back as soon as no query of the request can see it: with
window ``W``, a step whose first query is at position ``c`` reads keys from ``c - W + 1``
on, so block ``b`` goes once ``(b + 1) * block_size <= c - W + 1``. A request then holds
at most ``ceil((W - 1 + chunk) / block_size) + 1`` blocks here, however long it grows
(``chunk``: the most tokens one step computes for it).

Freed blocks keep their hash (prefix caching): a later request with the same prefix can
start at ``h`` full blocks only if the blocks its first step's window reaches,
``[(h * block_size - W + 1) // block_size, h)``, are all still cached here
(``longest_hit``).

Invariant: ``tables[r][i]`` is None exactly for the blocks freed as the window passed;
the rest are the request's own references.
"""

from __future__ import annotations

from engine_service.kv_cache.block_pool import BlockPool, KVCacheBlock


class SlidingWindowBlocks:
    """Per-request tables of the sliding-window layers' blocks, freed as the window passes."""

    def __init__(self, num_blocks: int, block_size: int, window: int, enable_caching: bool) -> None:
        if window <= 0:
            raise ValueError(f"window must be positive, got {window}")
        self.block_size = block_size
        self.window = window
        self.pool = BlockPool(num_blocks, enable_caching)
        self.tables: dict[str, list[KVCacheBlock | None]] = {}
        self.num_registered: dict[str, int] = {}

    def first_needed_block(self, first_query: int) -> int:
        """The first block a step whose first query sits at ``first_query`` reads."""
        return max(0, first_query - self.window + 1) // self.block_size

    @staticmethod
    def blocks_needed_per_request(window: int, block_size: int, max_chunk: int) -> int:
        """The most blocks one request holds here at once."""
        return -(-(window - 1 + max_chunk) // block_size) + 1

    def longest_hit(self, block_hashes: list[bytes], num_hits: int) -> tuple[int, list[KVCacheBlock]]:
        """The largest ``h <= num_hits`` whose window blocks are all cached here, and those
        blocks (``[first_needed_block(h * block_size), h)``)."""
        h = num_hits
        while h > 0:
            lo = self.first_needed_block(h * self.block_size)
            found: list[KVCacheBlock] = []
            for i in range(lo, h):
                block = self.pool.get_cached_block(block_hashes[i])
                if block is None:
                    break
                found.append(block)
            else:
                return h, found
            h = lo + len(found)  # a hit covering the missing block cannot be had
        return 0, []

    def num_new_blocks(self, request_id: str, first_query: int, num_tokens: int, num_hit_tokens: int = 0) -> int:
        """Fresh blocks ``allocate`` would take for a step from ``first_query`` to
        ``num_tokens`` (tokens computed after it), after what the window lets go."""
        table = self.tables.get(request_id, [])
        total = -(-num_tokens // self.block_size)
        have = max(len(table), num_hit_tokens // self.block_size)
        lo = self.first_needed_block(first_query)
        return max(0, total - max(have, lo))

    def num_releasable(self, request_id: str, first_query: int) -> int:
        """Blocks of the request's own that a step from ``first_query`` frees first."""
        lo = self.first_needed_block(first_query)
        # (a block shared with another request stays taken when this one lets go)
        return sum(1 for block in self.tables.get(request_id, [])[:lo] if block is not None and block.ref_cnt == 1)

    def allocate(
        self, request_id: str, first_query: int, num_tokens: int, hit: tuple[int, list[KVCacheBlock]] = (0, [])
    ) -> None:
        """Free what the window has passed, take the ``hit`` (start index, blocks), and add
        fresh blocks up to ``num_tokens``. The caller checked ``num_new_blocks`` fit."""
        table = self.tables.setdefault(request_id, [])
        start, hits = hit
        if hits:
            self.pool.touch(hits)
            table.extend([None] * (start - len(table)))
            table.extend(hits)
        lo = self.first_needed_block(first_query)
        passed = [block for block in table[:lo] if block is not None]
        if passed:
            self.pool.free_blocks(passed)
            table[:lo] = [None] * min(lo, len(table))
        table.extend([None] * (lo - len(table)))  # blocks never needed (a hit past them)
        total = -(-num_tokens // self.block_size)
        if total > len(table):
            table.extend(self.pool.get_new_blocks(total - len(table)))

    def cache_blocks(self, request_id: str, num_computed: int, block_hashes: list[bytes]) -> None:
        """Register the request's full, computed blocks still held (after a step)."""
        if not self.pool.enable_caching:
            return
        table = self.tables.get(request_id, [])
        num_full = min(num_computed // self.block_size, len(block_hashes), len(table))
        for i in range(self.num_registered.get(request_id, 0), num_full):
            block = table[i]
            if block is not None and block.block_hash is None:
                self.pool.cache_block(block, block_hashes[i])
        self.num_registered[request_id] = max(self.num_registered.get(request_id, 0), num_full)

    def block_ids(self, request_id: str) -> list[int]:
        """The table as ids; 0 stands for a freed block (attention never reads it)."""
        return [0 if block is None else block.block_id for block in self.tables.get(request_id, ())]

    def num_held(self, request_id: str) -> int:
        return sum(1 for block in self.tables.get(request_id, ()) if block is not None)

    def free(self, request_id: str) -> None:
        table = self.tables.pop(request_id, None)
        self.num_registered.pop(request_id, None)
        if table:
            self.pool.free_blocks(block for block in reversed(table) if block is not None)
