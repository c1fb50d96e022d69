"""The one way a feature joins scheduling: a ``SchedulerFeature`` built at start-up.

The scheduler calls every feature's hooks, in the order the features were given, at
these points of a request's life (each hook's default does nothing):

- ``added``: a request joined the waiting queue.
- ``before_schedule``: the top of each ``schedule()`` (and ``idle_tick`` while idle);
  a feature may end requests here (through the ``RequestLifecycle``).
- ``gate``: the waiting queue's head, before its prefix-cache lookup. ``DEFER`` passes
  it over this round (it keeps its place); ``TAKEN`` means the feature took it out of
  the queue (ended it).
- ``place``: the head after its lookup, before its blocks are allocated, with the
  prefix-cache ``hit`` and the tokens it would compute. ``TAKEN``: the feature took it
  (ended it, or started loading its KV); ``NO_ROOM``: not enough free blocks for what
  the feature needs (the scheduler makes room or stops admitting).
- ``make_room``: free blocks run short; a feature may free some without ending a
  request (True if it did).
- ``after_token``: a sampled token was appended; a feature may end the request
  (returns why) beyond the sampling parameters' own stop conditions.

Who implements what: deadlines (admission.py: ``added``, ``before_schedule``,
``place``), sessions (sessions.py: ``make_room``), KV transfer (kv_transfer/scheduling.py:
``before_schedule``, ``place``), LoRA slots (lora/scheduling.py: ``gate``), structured
output (structured_output/scheduling.py: ``before_schedule``, ``gate``, ``after_token``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tandem.protocol.outputs import FinishReason, RequestError

if TYPE_CHECKING:
    from engine_service.kv_cache.manager import KVBlocks
    from engine_service.request import Request


class Verdict(enum.Enum):
    ADMIT = enum.auto()  # nothing against it: go on
    DEFER = enum.auto()  # passed over this round
    TAKEN = enum.auto()  # out of the waiting queue (ended, or loading its KV)
    NO_ROOM = enum.auto()  # the blocks it needs are not free


@dataclass(frozen=True)
class Stop:
    """Why a feature ends a request after a token."""

    reason: FinishReason
    stop_reason: int | None = None
    error: RequestError | None = None


class SchedulerFeature:
    """Base of the features: every hook does nothing."""

    def added(self, request: Request) -> None:
        return None

    def before_schedule(self, now: float) -> None:
        return None

    def gate(self, request: Request, now: float) -> Verdict:
        return Verdict.ADMIT

    def place(self, request: Request, hit: KVBlocks, num_new_tokens: int, now: float) -> Verdict:
        return Verdict.ADMIT

    def make_room(self) -> bool:
        return False

    def after_token(self, request: Request, token: int) -> Stop | None:
        return None
