"""The KV connector seam: the hooks the scheduler and the runner call.

A connector moves KV-cache blocks between engines (disaggregated prefill and decode).
The scheduler and the engine core call these hooks on every engine, whatever its role;
``NoConnector`` answers them with "nothing to do", so neither has a branch on roles.
A connector may do its I/O on its own threads, but the hooks run on the step thread
only, and only the step thread touches the block pool and the KV-cache tensors'
block tables: a connector hands blocks back (``take_released``) and loaded data
(``poll_finished_loads``) for the step thread to apply.

Hooks, in a request's life:
- consumer, at admission (``KvTransfer.place``, kv_transfer/scheduling.py): ``get_num_external_tokens``
  says how many tokens beyond the local prefix-cache hit it can load; the scheduler
  allocates their blocks, the request waits as WAITING_FOR_REMOTE_KV (it takes no step
  slot) and calls ``start_load``.
- consumer, at each schedule() (and while idle): ``poll_finished_loads`` reports loads
  that ended, with the tokens now computed (0: failed, the request computes them).
- producer, when a request finishes (``KvTransfer.release``): ``request_finished``
  decides whether to keep its blocks for a consumer (the connector then owns one
  reference on each) and returns the params for the last output.
- producer, at each schedule() (and while idle): ``take_released`` gives back the
  block lists of held transfers that were pulled or expired; the scheduler frees them.
- the runner side: ``register_kv_caches`` (at start-up) gives the connector the KV
  cache tensors and their layout.

Later connectors (shared memory on one host, NCCL/NIXL between GPUs, host-memory
offload) implement the same hooks; the scheduler does not change.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from engine_service.kv_cache.manager import KVBlocks
    from engine_service.request import Request
    from tandem.protocol.kv_transfer import KvTransferParams
    from tandem.protocol.outputs import FinishReason


@dataclass(frozen=True)
class CacheLayout:
    """The KV cache's shape: per layer K and V, each
    [num_blocks, block_size, num_kv_heads, head_dim] ("NHD")."""

    dtype: str  # "float32", "float16", "bfloat16"
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    layout: str = "NHD"


@dataclass(frozen=True)
class FinishedLoad:
    """A load that ended: ``num_tokens`` tokens of ``request_id`` are now in its blocks
    (0: it failed and nothing was written; the request computes its prompt)."""

    request_id: str
    num_tokens: int


class KvConnector:
    """Base class and the do-nothing connector (every hook is a no-op)."""

    role: str | None = None  # None, "producer", "consumer", "both"

    # ---- runner side ---------------------------------------------------------

    def register_kv_caches(
        self, caches: Callable[[], Sequence[tuple[torch.Tensor, torch.Tensor]]], layout: CacheLayout
    ) -> None:
        """The engine's KV cache: ``caches()`` gives the current per-layer (K, V)
        tensors (they are reallocated after sleep mode)."""

    # ---- consumer side -------------------------------------------------------

    def get_num_external_tokens(self, request: Request, num_local_tokens: int) -> int:
        """Tokens after the first ``num_local_tokens`` (a local prefix-cache hit) whose
        KV this connector can load for a request with nothing computed; 0: none."""
        return 0

    def start_load(self, request: Request, block_ids: Sequence[int], num_local_tokens: int) -> None:
        """Start loading the tokens promised by ``get_num_external_tokens`` into the
        request's blocks ``block_ids`` (all of them, hits first); the first
        ``num_local_tokens`` are there already."""
        raise NotImplementedError(f"{type(self).__name__} loads nothing")

    def poll_finished_loads(self) -> list[FinishedLoad]:
        """Loads that ended since the last call; the data is in the cache on return."""
        return []

    def cancel_load(self, request_id: str) -> None:
        """The request ended while loading: stop when possible. Its load is still
        reported by ``poll_finished_loads`` (only then may its blocks be reused)."""

    @property
    def has_pending_loads(self) -> bool:
        return False

    def wait_if_idle(self) -> None:
        """Called for a step with nothing to run: wait briefly for a load to end
        rather than spin on empty steps."""

    # ---- producer side -------------------------------------------------------

    def request_finished(
        self, request: Request, reason: FinishReason, blocks: KVBlocks
    ) -> tuple[bool, KvTransferParams | None]:
        """(hold, params): hold True: the connector keeps ``blocks`` (the request's, in
        order; the KV cache manager hands them over with one reference each, and
        ``take_released`` gives them back later); params go in the request's last
        output. ``blocks`` is opaque but for ``len`` and ``block_ids``."""
        return False, None

    def take_released(self, now: float) -> list[KVBlocks]:
        """Blocks of held transfers done with (pulled, or expired by ``now``, a
        ``time.time()``), for the scheduler to free."""
        return []

    def drop_held(self) -> list[KVBlocks]:
        """Every held transfer's blocks, for the scheduler to free now (the KV cache goes
        away: sleep mode); pulls still streaming them fail."""
        return []

    @property
    def num_held_transfers(self) -> int:
        return 0

    # ---- both -------------------------------------------------------------------

    def set_wake(self, wake: Callable[[], None]) -> None:
        """``wake()`` makes an idle engine loop run its housekeeping (release held
        blocks, poll loads) soon; called from the connector's own threads."""

    def close(self) -> None:
        """Stop the connector's threads and channels."""


class NoConnector(KvConnector):
    """No KV transfer: the engine computes every token itself."""
