"""Which engine a new request goes to.

``least-load``: the engine with the lowest load score (vLLM's: waiting x 4 + running,
from the stats each engine pushes every step, plus requests sent since). Engines tied
at the lowest score take turns (round-robin over the tied, in index order), so a light
load spreads over all engines instead of always landing on the first.

``prefix-aware``: among the engines whose score is within ``load_slack`` of the lowest,
the one most likely to hold the prompt's prefix in its prefix cache: the frontend keeps,
per engine, an LRU of the prompt block hashes it placed there (the engine's own chained
hash scheme: full blocks of ``block_size`` tokens, the cache salt in the first), and
prefers the engine that matches the longest run of leading blocks. With no match it
falls back to least-load. The LRU is a guess (the engine may have evicted the blocks,
another frontend may have filled them); a wrong guess only costs a recomputed prefill.
"""

from __future__ import annotations

import enum
import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class PlacementPolicy(enum.Enum):
    LEAST_LOAD = "least-load"
    PREFIX_AWARE = "prefix-aware"


@dataclass
class PlacementConfig:
    """How ``EngineGroup`` places new requests."""

    policy: PlacementPolicy = PlacementPolicy.LEAST_LOAD
    # prefix-aware: an engine with a cached prefix is preferred while its load score is
    # at most the lowest + load_slack (a waiting request scores 4, a running one 1).
    load_slack: int = 8
    # prefix-aware: block hashes remembered per engine, at most (and at most its KV blocks).
    max_remembered_blocks: int = 16384


class Load(Protocol):
    @property
    def score(self) -> int: ...


class Placeable(Protocol):
    """What placement reads of an engine: its index and its current load."""

    @property
    def index(self) -> int: ...

    @property
    def load(self) -> Load: ...


def block_hashes(
    token_ids: Sequence[int], block_size: int, cache_salt: str | None = None
) -> list[bytes]:
    """Chained hashes of the full blocks of ``token_ids`` (equal prefixes, equal chains)."""
    hashes: list[bytes] = []
    parent = b""
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        h = hashlib.blake2b(parent, digest_size=16)
        if start == 0 and cache_salt:
            h.update(b"\x00salt\x00" + cache_salt.encode())
        h.update(array("q", token_ids[start:start + block_size]).tobytes())
        parent = h.digest()
        hashes.append(parent)
    return hashes


class PrefixMemory:
    """An LRU set of block hashes: what the frontend sent to one engine lately."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._hashes: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._hashes)

    def matched_blocks(self, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of ``hashes`` are remembered."""
        n = 0
        for h in hashes:
            if h not in self._hashes:
                break
            n += 1
        return n

    def remember(self, hashes: Sequence[bytes]) -> None:
        for h in hashes:
            self._hashes[h] = None
            self._hashes.move_to_end(h)
        while len(self._hashes) > self.capacity:
            self._hashes.popitem(last=False)


class Placement:
    """Chooses among the engines that can take new requests; remembers prefixes sent."""

    def __init__(self, config: PlacementConfig | None = None) -> None:
        self.config = config or PlacementConfig()
        self._turn = 0  # advances on every tie, so tied engines take turns
        self._memories: dict[int, PrefixMemory] = {}  # engine index -> its prefixes
        self._block_size = 0

    @property
    def prefix_aware(self) -> bool:
        return self.config.policy is PlacementPolicy.PREFIX_AWARE

    def add_engine(self, index: int, block_size: int, num_kv_blocks: int) -> None:
        """An engine joined (or came back, its cache then empty)."""
        if not self.prefix_aware or block_size <= 0:
            return
        self._block_size = block_size
        capacity = max(1, min(num_kv_blocks or self.config.max_remembered_blocks,
                              self.config.max_remembered_blocks))
        self._memories[index] = PrefixMemory(capacity)

    def remove_engine(self, index: int) -> None:
        self._memories.pop(index, None)

    def choose(
        self,
        engines: Sequence[Placeable],
        prompt_token_ids: Sequence[int] | None = None,
        cache_salt: str | None = None,
    ) -> Placeable:
        """The engine for a new request; ``engines`` must not be empty."""
        if not engines:
            raise ValueError("no engine to choose from")
        hashes: list[bytes] = []
        if self.prefix_aware and prompt_token_ids and self._block_size:
            hashes = block_hashes(prompt_token_ids, self._block_size, cache_salt)
        chosen = self._by_prefix(engines, hashes) if hashes else None
        if chosen is None:
            chosen = self._least_load(engines)
        if hashes:
            memory = self._memories.get(chosen.index)
            if memory is not None:
                memory.remember(hashes)
        return chosen

    def _least_load(self, engines: Sequence[Placeable]) -> Placeable:
        low = min(e.load.score for e in engines)
        tied = sorted((e for e in engines if e.load.score == low), key=lambda e: e.index)
        if len(tied) == 1:
            return tied[0]
        chosen = tied[self._turn % len(tied)]
        self._turn += 1
        return chosen

    def _by_prefix(self, engines: Sequence[Placeable], hashes: list[bytes]) -> Placeable | None:
        """The engine within the load slack with the longest remembered prefix, if any."""
        low = min(e.load.score for e in engines)
        best: list[Placeable] = []
        best_match = 0
        for engine in engines:
            memory = self._memories.get(engine.index)
            if memory is None or engine.load.score > low + self.config.load_slack:
                continue
            match = memory.matched_blocks(hashes)
            if match > best_match:
                best, best_match = [engine], match
            elif match == best_match and match > 0:
                best.append(engine)
        if not best:
            return None
        return self._least_load(best)
