"""Per-request block tables on top of the BlockPool, with automatic prefix caching."""

from __future__ import annotations

from dataclasses import dataclass

from engine_service.kv_cache.block_pool import (
    BlockEventSink,
    BlockPool,
    KVCacheBlock,
    hash_block_tokens,
)
from engine_service.kv_cache.sliding import SlidingWindowBlocks
from engine_service.request import Request


@dataclass(frozen=True)
class KVBlocks:
    """Blocks outside any request's table, opaque beyond this package: a prefix-cache
    hit (``get_computed_blocks``: not referenced yet), or blocks taken out of a request
    (``take_blocks``: one reference each, the holder's, given back with ``free_blocks``)."""

    blocks: tuple[KVCacheBlock, ...] = ()
    block_size: int = 0
    # A hit's sliding-window blocks (sliding.py): ``window_blocks`` are the window's
    # blocks ``[window_start, len(blocks))``.
    window_start: int = 0
    window_blocks: tuple[KVCacheBlock, ...] = ()

    def __len__(self) -> int:
        return len(self.blocks)

    @property
    def num_tokens(self) -> int:
        return len(self.blocks) * self.block_size

    @property
    def block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks]


NO_BLOCKS = KVBlocks()


@dataclass
class PrefixCacheStats:
    """Counts since the last ``take_stats``: prompt tokens looked up and found."""

    queries: int = 0
    hits: int = 0


class KVCacheManager:
    """Maps each request to the blocks holding its KV and finds prefix-cache hits.

    A request's block ``i`` holds its tokens ``[i * block_size, (i + 1) * block_size)``.
    Full blocks whose KV has been computed are registered under their chained hash, so
    a later request with the same prefix (and cache salt) reuses them.
    """

    def __init__(
        self, num_blocks: int, block_size: int, enable_caching: bool, window: SlidingWindowBlocks | None = None
    ) -> None:
        """``window``: the sliding-window layers' own blocks (sliding.py); None when every
        layer reads this manager's tables."""
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.window = window
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}
        # request id -> how many of its leading blocks are already registered.
        self.num_registered: dict[str, int] = {}
        self.stats = PrefixCacheStats()

    @property
    def usage(self) -> float:
        if self.window is not None:
            return max(self.pool.usage, self.window.pool.usage)
        return self.pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def set_event_sink(self, events: BlockEventSink | None) -> None:
        """Report blocks cached and evicted from now on to ``events`` (None: stop)."""
        self.pool.events = events

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def window_block_ids(self, request_id: str) -> list[int]:
        """The sliding-window layers' table (0 for blocks the window passed); requires ``window``."""
        assert self.window is not None
        return self.window.block_ids(request_id)

    def _update_block_hashes(self, request: Request) -> None:
        """Extend ``request.block_hashes`` to cover every full block of its known tokens."""
        bs = self.block_size
        tokens = request.all_token_ids
        hashes = request.block_hashes
        for i in range(len(hashes), len(tokens) // bs):
            parent = hashes[-1] if hashes else None
            salt = request.cache_extra if i == 0 else None
            hashes.append(hash_block_tokens(parent, tokens[i * bs : (i + 1) * bs], salt))

    def get_computed_blocks(self, request: Request) -> KVBlocks:
        """Longest cached prefix of a request that has nothing computed yet (not yet
        referenced: ``allocate_slots`` takes it). At least one token is always left to
        compute, so the step produces logits."""
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            # Prompt logprobs need the logits of every prompt position.
            return NO_BLOCKS
        self._update_block_hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        window_start, window_blocks = 0, []
        if self.window is not None and hits:
            # Only as far as the sliding layers still have the window before it.
            num_hits, window_blocks = self.window.longest_hit(request.block_hashes, len(hits))
            hits = hits[:num_hits]
            window_start = num_hits - len(window_blocks)
        num_hit_tokens = len(hits) * self.block_size
        self.stats.queries += request.num_tokens
        self.stats.hits += num_hit_tokens
        return KVBlocks(tuple(hits), self.block_size, window_start, tuple(window_blocks))

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        hit: KVBlocks = NO_BLOCKS,
    ) -> bool:
        """Give the request blocks for ``num_new_tokens`` more tokens after its computed ones
        and the prefix-cache ``hit`` (``get_computed_blocks``'s) it starts with.
        Returns False, changing nothing, when the free blocks do not suffice.
        """
        hits = list(hit.blocks)
        blocks = self.req_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(hits) * self.block_size
        needed = -(-(num_computed + num_new_tokens) // self.block_size) - len(blocks) - len(hits)
        # Hits sitting in the free queue stop being allocatable once touched.
        free_hits = sum(1 for b in hits if b.ref_cnt == 0)
        fits = needed <= self.pool.num_free_blocks - free_hits
        window = self.window
        rid = request.request_id
        if window is not None and fits:
            window_needed = window.num_new_blocks(rid, num_computed, num_computed + num_new_tokens, len(hits) * self.block_size)
            window_free_hits = sum(1 for b in hit.window_blocks if b.ref_cnt == 0)
            room = window.pool.num_free_blocks + window.num_releasable(rid, num_computed)
            fits = window_needed + window_free_hits <= room
        if not fits:
            if not blocks:
                del self.req_blocks[rid]
            return False
        if hits:
            self.pool.touch(hits)
            blocks.extend(hits)
        if needed > 0:
            blocks.extend(self.pool.get_new_blocks(needed))
        if window is not None:
            window.allocate(rid, num_computed, num_computed + num_new_tokens, (hit.window_start, list(hit.window_blocks)))
        return True

    def cache_blocks(self, request: Request) -> None:
        """Register the request's full blocks whose KV is computed (call after a step)."""
        if not self.enable_caching:
            return
        self._update_block_hashes(request)
        blocks = self.req_blocks.get(request.request_id, [])
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_hashes))
        start = self.num_registered.get(request.request_id, 0)
        hashes, bs = request.block_hashes, self.block_size
        for i in range(start, num_full):
            if self.pool.events is None:
                self.pool.cache_block(blocks[i], hashes[i])
            else:
                parent = hashes[i - 1] if i else None
                tokens = request.all_token_ids[i * bs : (i + 1) * bs]
                self.pool.cache_block(blocks[i], hashes[i], parent, tokens)
        self.num_registered[request.request_id] = max(start, num_full)
        if self.window is not None:
            self.window.cache_blocks(request.request_id, request.num_computed_tokens, request.block_hashes)

    def free(self, request: Request) -> None:
        """Return the request's blocks; the tail goes first so it is evicted first."""
        blocks = self.req_blocks.pop(request.request_id, None)
        self.num_registered.pop(request.request_id, None)
        if blocks:
            self.pool.free_blocks(reversed(blocks))
        if self.window is not None:
            self.window.free(request.request_id)

    def blocks_of(self, request: Request) -> KVBlocks:
        """The request's blocks (still its own: nothing changes hands)."""
        return KVBlocks(tuple(self.req_blocks.get(request.request_id, ())), self.block_size)

    def take_blocks(self, request: Request) -> KVBlocks:
        """Forget the request's blocks without freeing them: the caller now owns their
        references (a KV connector holding them for another engine) and gives them
        back with ``free_blocks``."""
        if self.window is not None:  # (start-up keeps the window off with a KV connector)
            raise RuntimeError("blocks of a model with sliding-window layers cannot change hands")
        self.num_registered.pop(request.request_id, None)
        return KVBlocks(tuple(self.req_blocks.pop(request.request_id, ())), self.block_size)

    def free_blocks(self, taken: KVBlocks) -> None:
        """Return blocks taken with ``take_blocks``; the tail goes first."""
        self.pool.free_blocks(reversed(taken.blocks))

    def check_invariants(self) -> None:
        """The block pool's reference counts and free queue agree with the request tables."""
        self.pool.check_invariants()
        if self.window is not None:
            self.window.pool.check_invariants()

    def check_all_free(self) -> None:
        """After every request ended: every block of every pool is free."""
        self.pool.check_all_free()
        if self.window is not None:
            self.window.pool.check_all_free()

    def reset_prefix_cache(self) -> int:
        if self.window is not None:
            self.window.pool.reset_prefix_cache()
        return self.pool.reset_prefix_cache()

    def take_stats(self) -> PrefixCacheStats:
        stats, self.stats = self.stats, PrefixCacheStats()
        return stats
