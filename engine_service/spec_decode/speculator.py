"""Who drafts this step, how many tokens, and what came of it.

The ``Speculator`` is a scheduler feature (scheduler_hooks.py): the scheduler asks it for a
decoding request's drafts when it schedules the request (``drafts``), and tells it how many
were accepted after the step (``record``). It owns the proposer (n-gram prompt lookup,
suffix decoding or a draft model, by ``SpeculativeConfig.method``), the load rules that
turn speculation off, and the step's counters for the metrics. A draft model drafts for
every request of the step at once, in ``before_schedule`` (draft_model.py); ``drafts``
then hands out what it drafted.

A request drafts when it decodes (one known token left to compute, no placeholder), unless
it is a pooling request or opted out (``SamplingParams.speculative``). Everything else
(temperature, top-k/p, min-p, penalties, logit bias, seeds, min_tokens, stop tokens,
max_tokens, logprobs: each emitted token's own row) is exact through ``verify``
(rejection.py); with structured output, drafts are cut to what the grammar accepts and
each draft row is masked as if the drafts before it were output (structured_output/).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine_service.scheduler_hooks import SchedulerFeature
from engine_service.spec_decode.config import SpeculativeConfig
from engine_service.spec_decode.ngram import NgramProposer
from engine_service.spec_decode.suffix import SuffixProposer

if TYPE_CHECKING:
    from engine_service.request import Request
    from engine_service.request_lifecycle import RequestLifecycle
    from engine_service.spec_decode.draft_model import DraftModel


FINISHED_PER_STEP = 4  # finished outputs added to suffix decoding's shared trie per step


@dataclass
class SpecDecodingStats:
    """Counters since the last ``take_stats`` (vLLM's spec-decode metrics)."""

    num_drafts: int = 0  # requests that verified drafts
    num_draft_tokens: int = 0  # tokens drafted (and verified)
    num_accepted_tokens: int = 0  # of which accepted
    # [k]: drafts accepted at position i (0-based: the first draft token is position 0)
    accepted_per_pos: list[int] = field(default_factory=list)


class _Acceptance:
    """A request's running acceptance rate: the chance that a draft token is accepted
    given the ones before it were, from decayed counts of accepted drafts over tries
    (a step that accepted ``a`` of ``k`` tried ``a + 1`` times if ``a < k``, else ``a``)."""

    __slots__ = ("accepted", "idle", "tries")
    DECAY = 0.8  # per verified step

    def __init__(self, prior: float) -> None:
        # (accepted, tries) worth two tries at the proposer's prior rate
        self.accepted, self.tries = 2.0 * prior, 2.0
        self.idle = 0  # decode steps without drafts since the last one (low acceptance)

    @property
    def rate(self) -> float:
        return self.accepted / self.tries

    def update(self, num_drafted: int, num_accepted: int) -> None:
        self.accepted = self.DECAY * self.accepted + num_accepted
        self.tries = self.DECAY * self.tries + num_accepted + (num_accepted < num_drafted)


def best_draft_length(rate: float, room: int, cost: float) -> int:
    """The k in [0, room] that maximizes expected tokens per step time,
    ``(1 + rate + ... + rate^k) / (1 + cost k)`` (0: a plain step is best)."""
    return best_prefix([rate**i for i in range(1, room + 1)], cost)


def best_prefix(held: Sequence[float], cost: float) -> int:
    """The k in [0, len(held)] that maximizes ``(1 + held[0] + ... + held[k-1]) / (1 + cost k)``,
    ``held[i]``: the chance that the first i + 1 drafts all hold (0: a plain step is best)."""
    best_k, best, expected = 0, 1.0, 1.0
    for k, p in enumerate(held, 1):
        expected += p
        value = expected / (1.0 + cost * k)
        if value > best * 1.0001:
            best_k, best = k, value
    return best_k


class Speculator(SchedulerFeature):
    def __init__(
        self, config: SpeculativeConfig, token_cost: float | None = None, draft_model: DraftModel | None = None,
        draft_cost: float = 0.0,
    ) -> None:
        """``token_cost``: a verified draft row's share of a batch-1 decode step (None: the
        config's ``draft_token_cost``); ``draft_model``: the proposer of ``method ==
        "draft_model"``; ``draft_cost``: its forward's share of a target decode step."""
        self.config = config
        self.k = config.num_speculative_tokens
        self.token_cost = config.draft_token_cost if token_cost is None else token_cost
        self.draft_cost = draft_cost
        # A new request's acceptance rate before it has verified anything: an n-gram draft
        # continues an exact match of the tail (and drafts only then); a suffix draft is
        # the trie's best guess, and there always is one. (SmolLM2-135M, benchmarks/NOTES.md,
        # issue 46: suffix decoding at 0.8 lost 8% on free chat; n-gram at 0.5 drafted too
        # little at first on copy-heavy prompts.) A draft model's guess is in between.
        self._prior = {"ngram": 0.8, "suffix": 0.5}.get(config.method, 0.7)
        self._acceptance: dict[str, _Acceptance] = {}
        self._stats = SpecDecodingStats(accepted_per_pos=[0] * self.k)
        self._ngram: NgramProposer | None = None
        self._suffix: SuffixProposer | None = None
        self._draft_model = draft_model
        if config.method == "ngram":
            self._ngram = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max, self.k)
        elif config.method == "suffix":
            self._suffix = SuffixProposer(
                self.k,
                max_tree_depth=config.suffix_decoding_max_tree_depth,
                min_token_prob=config.suffix_decoding_min_token_prob,
                max_cached_requests=config.suffix_decoding_max_cached_requests,
            )
        elif draft_model is None:
            raise ValueError(f"speculative method {config.method!r} needs its draft model")
        # Suffix decoding: tokens of each request its trie holds; finished outputs waiting
        # for the shared trie (the newest max_cached_requests).
        self._suffix_seen: dict[str, int] = {}
        self._finished: deque[list[int]] = deque(maxlen=max(1, config.suffix_decoding_max_cached_requests))
        # With a draft model: the running requests (bind) and this step's drafts.
        self._lifecycle: RequestLifecycle | None = None
        self._max_model_len = 0
        self._drafted: dict[str, list[int]] = {}

    def bind(self, lifecycle: RequestLifecycle, max_model_len: int) -> None:
        """The scheduler's running requests, which a draft model drafts for in one batch."""
        self._lifecycle = lifecycle
        self._max_model_len = max_model_len

    @property
    def draft_model(self) -> DraftModel | None:
        return self._draft_model

    # ---- the request's life (suffix decoding keeps a trie per request) -------------------
    # Suffix decoding's tries are kept up lazily: a request's own trie takes the tokens it
    # has not seen when the request drafts, and finished outputs join the shared trie a few
    # a step while speculation is on, so a step above disable_by_batch_size pays nothing.

    def ended(self, request: Request) -> None:
        """The request finished (its KV released): its state goes (suffix decoding keeps
        its output for the shared trie)."""
        self._acceptance.pop(request.request_id, None)
        if self._suffix is not None:
            self._suffix.drop(request.request_id)
            self._suffix_seen.pop(request.request_id, None)
            if request.output_token_ids:
                self._finished.append(list(request.output_token_ids))
        if self._draft_model is not None:
            self._draft_model.release(request.request_id)

    def _suffix_sync(self, request: Request) -> None:
        """``request``'s own trie up to its latest token."""
        assert self._suffix is not None
        rid = request.request_id
        seen = self._suffix_seen.get(rid)
        if seen is None or not self._suffix.has_request(rid):
            self._suffix.start(rid, request.prompt_token_ids)
            seen = request.num_prompt_tokens
        tokens = request.all_token_ids
        if seen < len(tokens):
            self._suffix.extend(rid, tokens[seen:])
        self._suffix_seen[rid] = len(tokens)

    # ---- drafting -------------------------------------------------------------------------

    def drafts(self, request: Request, num_running: int, budget: int, max_model_len: int) -> list[int]:
        """Draft tokens to verify after ``request``'s next token this step ([] for none):
        at most k, within the step's token ``budget`` (the known token takes one),
        ``max_model_len`` (the last draft's position stays below it) and the request's
        ``max_tokens`` (its last token this step is the verified one)."""
        if self._draft_model is not None:  # drafted for the whole step in before_schedule
            drafts = self._drafted.pop(request.request_id, [])[: self._room(request, budget, max_model_len)]
        else:
            k, cost, rate = self._plan(request, num_running, budget, max_model_len)
            drafts = self._propose(request, k, cost, rate) if k else []
        if request.structured is not None:  # a draft the grammar refuses would be rejected
            drafts = request.structured.valid_prefix(request.output_token_ids, drafts)
        return drafts

    def _room(self, request: Request, budget: int, max_model_len: int) -> int:
        """The most drafts ``request`` may verify this step (>= 0)."""
        room = min(self.k, budget - 1, max_model_len - request.num_tokens)
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - request.num_output_tokens - 1)
        return max(0, room)

    def _plan(self, request: Request, num_running: int, budget: int, max_model_len: int) -> tuple[int, float, float]:
        """(k, cost, rate): how many tokens ``request`` drafts this step (0: none), the
        cost of a draft token as a share of the step, and its acceptance rate. A request
        whose rate makes a plain step best drafts one token every ``probe_interval`` steps."""
        if self._off_under_load(num_running) or not self._eligible(request):
            return 0, 0.0, 0.0
        room = self._room(request, budget, max_model_len)
        if room <= 0:
            return 0, 0.0, 0.0
        acceptance = self._acceptance.get(request.request_id)
        if acceptance is None:
            acceptance = self._acceptance[request.request_id] = _Acceptance(self._prior)
        cost = self.step_share(num_running) + self.draft_cost
        rate = acceptance.rate
        k = best_draft_length(rate, room, cost)
        if k == 0:  # low acceptance: a one-token probe now and then
            acceptance.idle += 1
            if acceptance.idle < self.config.probe_interval:
                return 0, cost, rate
            k = 1
        acceptance.idle = 0
        return k, cost, rate

    def may_draft(self, running: Sequence[Request]) -> bool:
        """Whether a request of ``running`` may draft in the next step, its tokens in flight
        counted as known (async scheduling completes them first)."""
        if self._off_under_load(len(running)):
            return False
        cost = self.step_share(len(running)) + self.draft_cost
        for request in running:
            if not self._eligible(request, in_flight_known=True):
                continue
            acceptance = self._acceptance.get(request.request_id)
            if acceptance is None or acceptance.idle + 1 >= self.config.probe_interval:
                return True
            if best_draft_length(acceptance.rate, self.k, cost):
                return True
        return False

    def before_schedule(self, now: float) -> None:
        """Suffix decoding: a few finished outputs into the shared trie. A draft model:
        every request that drafts this step, drafted in one batch."""
        if self._lifecycle is None:
            return
        running = self._lifecycle.running
        if self._off_under_load(len(running)):
            return
        if self._suffix is not None:
            for _ in range(min(len(self._finished), FINISHED_PER_STEP)):
                self._suffix.add_output(self._finished.popleft())
        if self._draft_model is None:
            return
        wanted = []
        for request in running:
            k = self._plan(request, len(running), self.k + 1, self._max_model_len)[0]
            if k:
                wanted.append((request, k))
        self._drafted = self._draft_model.propose(wanted) if wanted else {}

    def step_share(self, num_running: int) -> float:
        """What one draft token of each of ``num_running`` requests adds to a step, as a
        fraction of it: with T(R) = T0 + r R for R rows and c = r / (T0 + r) the batch-1
        share (``token_cost``), ``r B / (T0 + r B) = c B / (1 + c (B - 1))`` for B requests.
        Rows are cheap while a step streams its weights once for a few rows, and cost a
        whole row's worth once the step is compute-bound."""
        c, b = self.token_cost, max(1, num_running)
        return c * b / (1.0 + c * (b - 1))

    def _propose(self, request: Request, room: int, cost: float, rate: float) -> list[int]:
        """The proposer's draft of at most ``room`` tokens after ``request``'s tokens; suffix
        decoding's cut where its path probabilities (each at most the request's ``rate`` to
        that power: the trie's counts are optimistic) stop paying for their rows."""
        if self._ngram is not None:
            return self._ngram.propose(request.all_token_ids, room)
        if self._suffix is None:
            return []
        self._suffix_sync(request)
        draft, probs = self._suffix.propose_with_probs(request.request_id, room)
        return draft[: best_prefix([min(p, rate**i) for i, p in enumerate(probs, 1)], cost)]

    def _off_under_load(self, num_running: int) -> bool:
        """No drafts in a step of more than ``disable_by_batch_size`` running requests."""
        limit = self.config.disable_by_batch_size
        return bool(limit) and num_running > limit

    @staticmethod
    def _eligible(request: Request, in_flight_known: bool = False) -> bool:
        """``request`` decodes (one known token left to compute) and may draft.
        ``in_flight_known``: the tokens of the step in flight counted as known (async
        scheduling completes it before a step with drafts); else a request with one does not."""
        pending = request.num_output_placeholders
        if pending and not in_flight_known:
            return False
        return (
            request.num_computed_tokens == request.num_tokens + pending - 1
            and request.pooling_params is None
            and not request.prompt_logprobs_pending
            and request.sampling_params.speculative
        )

    def record(self, request: Request, num_drafted: int, num_accepted: int) -> None:
        """After a verified step: ``num_accepted`` of ``num_drafted`` drafts were accepted."""
        request.num_spec_steps += 1
        request.num_draft_tokens += num_drafted
        request.num_accepted_draft_tokens += num_accepted
        stats = self._stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_drafted
        stats.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            stats.accepted_per_pos[pos] += 1
        acceptance = self._acceptance.get(request.request_id)
        if acceptance is None:
            acceptance = self._acceptance[request.request_id] = _Acceptance(self._prior)
        acceptance.update(num_drafted, num_accepted)

    def take_stats(self) -> SpecDecodingStats | None:
        """The counters since the last call (None if nothing was verified), reset."""
        stats = self._stats
        if not stats.num_drafts:
            return None
        self._stats = SpecDecodingStats(accepted_per_pos=[0] * self.k)
        return stats
