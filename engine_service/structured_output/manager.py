"""Structured output in the engine: constraints compiled off the step loop, a token
bitmask per step, matchers advanced with each accepted token.

Per step (hooks of the core, the scheduler and the runner):
1. Before each schedule the scheduler's ``StructuredOutputs`` feature (scheduling.py)
   resolves finished compiles (``poll()``): a request whose constraint did not compile
   ends with INVALID_ARGUMENT; one still compiling stays waiting (passed over,
   ``StructuredRequest.ready``) without holding the batch.
2. ``start_fill(requests, drafts)`` computes the bitmask of the step's constrained sampling
   rows (with speculative decoding, a row per draft too, as if the drafts before it were
   output; drafts come cut to what the constraint accepts, ``valid_prefix``)
   on a worker thread (llguidance drops the GIL), overlapping the forward pass;
   ``apply(logits, fill)`` waits for it and masks the logits before sampling, so
   logprobs are those of the masked distribution (as vLLM reports them).
3. ``StructuredRequest.advance(token)`` after sampling; a complete constraint stops the
   request (finish reason STOP).

Invariant: a ready request's matcher has consumed exactly its output tokens. Preemption
keeps the output (recompute re-prefills prompt + output), so the matcher stays valid;
a matcher found out of step is rebuilt by replaying the output (``sync``).
"""

from __future__ import annotations

import enum
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engine_service.structured_output.backend import compile_matcher, load_tokenizer
from tandem.protocol.outputs import ErrorCode, RequestError
from tandem.protocol.sampling_params import InvalidRequestError
from tandem.protocol.structured_output import StructuredOutputsParams

if TYPE_CHECKING:
    from engine_service.request import Request

logger = logging.getLogger(__name__)

# How long a step with nothing to run waits for a constraint being compiled.
_IDLE_WAIT_S = 0.005

ApplyBitmask = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


class Advance(enum.Enum):
    """What one accepted token did to a constraint."""

    CONTINUE = enum.auto()
    COMPLETE = enum.auto()  # nothing but EOS may follow: the request stops
    REJECTED = enum.auto()  # the token is outside the constraint (a masking bug)


class StructuredRequest:
    """Constraint state of one request: compiling, then a matcher."""

    def __init__(self, params: StructuredOutputsParams) -> None:
        self.params = params
        self.future: Future[Any] | None = None  # compile in flight
        self.template: Any = None  # the compiled matcher at its start state (shared)
        self.matcher: Any = None  # this request's copy; consumed == output tokens
        self.num_consumed = 0
        self.error: RequestError | None = None

    @property
    def ready(self) -> bool:
        return self.matcher is not None

    def start(self, template: Any) -> None:
        self.template = template
        self.matcher = template.deep_copy()
        self.num_consumed = 0

    def sync(self, output_token_ids: Sequence[int]) -> None:
        """Rebuild the matcher from the start state if it is out of step with the output."""
        if self.num_consumed == len(output_token_ids):
            return
        self.matcher = self.template.deep_copy()
        self.num_consumed = 0
        for token in output_token_ids:
            if self.advance(token) is Advance.REJECTED:
                return

    def valid_prefix(self, output_token_ids: Sequence[int], drafts: list[int]) -> list[int]:
        """The longest prefix of ``drafts`` that the constraint accepts after the output."""
        self.sync(output_token_ids)
        return drafts[: self.matcher.validate_tokens(drafts)] if drafts else drafts

    def advance(self, token: int) -> Advance:
        if not self.matcher.consume_token(token):
            return Advance.REJECTED
        self.num_consumed += 1
        return Advance.COMPLETE if self.matcher.is_stopped() else Advance.CONTINUE


@dataclass
class MaskFill:
    """A step's bitmask, being filled: ``bitmask[k]`` constrains logits row ``rows[k]``."""

    future: Future[None] | None  # None: filled on the caller's thread already
    bitmask: np.ndarray  # [K, ceil(V / 32)] int32
    rows: torch.Tensor  # [K] int64


class StructuredOutputManager:
    """Compiles constraints (cached, LRU-bounded), fills and applies bitmasks."""

    def __init__(
        self,
        model_dir: str,
        vocab_size: int,
        apply_bitmask: ApplyBitmask,
        cache_size: int = 256,
        overlap: bool = True,
    ) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.apply_bitmask = apply_bitmask
        self.cache_size = cache_size
        self.overlap = overlap
        self._compile_pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        self._fill_pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        self._tokenizer: Any = None
        self._tokenizer_lock = threading.Lock()
        self._executor: Any = None
        # (kind, spec) -> compiled template matcher; only touched on the step thread.
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._compiling: list[Request] = []
        self.cache_hits = 0
        self.cache_misses = 0

    # ---- compile ---------------------------------------------------------------

    def tokenizer(self) -> Any:
        with self._tokenizer_lock:
            if self._tokenizer is None:
                self._tokenizer = load_tokenizer(self.model_dir, self.vocab_size)
            return self._tokenizer

    def submit(self, request: Request) -> None:
        """Attach constraint state to a new request: ready at once on a cache hit, else
        compiling on the compile thread."""
        params = request.sampling_params.structured_outputs
        if params is None:
            return
        state = StructuredRequest(params)
        request.structured = state
        template = self._cache.get(params.key)
        if template is not None:
            self._cache.move_to_end(params.key)
            self.cache_hits += 1
            state.start(template)
            return
        self.cache_misses += 1
        state.future = self._compile_pool.submit(lambda: compile_matcher(self.tokenizer(), params))
        self._compiling.append(request)

    def poll(self) -> list[Request]:
        """Resolve finished compiles; return the requests whose constraint failed (their
        ``structured.error`` says why). Finished (aborted) requests are dropped."""
        failed, still = [], []
        for request in self._compiling:
            state = request.structured
            if request.is_finished or state is None:
                continue
            if state.future is None or not state.future.done():
                still.append(request)
                continue
            try:
                template = state.future.result()
            except InvalidRequestError as exc:
                state.error = RequestError(ErrorCode.INVALID_ARGUMENT, str(exc))
            except Exception as exc:  # a backend failure is this request's, not the engine's
                logger.exception("compiling %s failed", state.params.field_name)
                state.error = RequestError(ErrorCode.INTERNAL, f"compiling the constraint failed: {exc}")
            else:
                self._remember(state.params.key, template)
                state.start(template)
            state.future = None
            if state.error is not None:
                failed.append(request)
        self._compiling = still
        return failed

    def _remember(self, key: tuple[str, str], template: Any) -> None:
        if self.cache_size <= 0:
            return
        self._cache[key] = template
        self._cache.move_to_end(key)
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)

    @property
    def num_compiling(self) -> int:
        return len(self._compiling)

    def wait_if_idle(self) -> None:
        """Called for a step with nothing to run: wait briefly (_IDLE_WAIT_S) for a
        constraint being compiled, rather than spin on empty steps."""
        if self._compiling:
            self.wait_for_compile(_IDLE_WAIT_S)

    def wait_for_compile(self, timeout: float) -> None:
        """Block up to ``timeout`` s for any compile in flight to finish."""
        futures = [r.structured.future for r in self._compiling if r.structured and r.structured.future]
        if futures:
            wait(futures, timeout=timeout, return_when=FIRST_COMPLETED)

    # ---- masks -----------------------------------------------------------------

    def start_fill(
        self, requests: Sequence[Request], drafts: Sequence[Sequence[int]] | None = None
    ) -> MaskFill | None:
        """Start filling the bitmask of the constrained rows among ``requests`` (row i of
        the step's logits is requests[i]); None when no row is constrained. With
        ``drafts`` (speculative decoding), ``drafts[i]`` are the draft tokens verified
        after row i, whose rows follow it: each of those rows is masked as if the drafts
        before it were output (the matcher advanced through them, then rolled back)."""
        rows = [i for i, r in enumerate(requests) if r.structured is not None]
        if not rows:
            return None
        matchers: list[tuple[Any, int, list[int]]] = []
        skip = 0  # draft rows of the request before: masked with its first row
        for k, i in enumerate(rows):
            if skip:
                skip -= 1
                continue
            request = requests[i]
            request.structured.sync(request.output_token_ids)
            tokens = list(drafts[i]) if drafts is not None else []
            matchers.append((request.structured.matcher, k, tokens))
            skip = len(tokens)
        # Rows past a draft the grammar refuses are never reached (that draft is rejected):
        # all tokens allowed there, so they sample something.
        with_drafts = any(tokens for _, _, tokens in matchers)
        shape = (len(rows), self.words)
        bitmask = np.full(shape, -1, dtype=np.int32) if with_drafts else np.empty(shape, dtype=np.int32)
        fill = MaskFill(None, bitmask, torch.tensor(rows, dtype=torch.int64))
        if self.overlap:
            fill.future = self._fill_pool.submit(self._fill, matchers, bitmask)
        else:
            self._fill(matchers, bitmask)
        return fill

    def _fill(self, matchers: list[tuple[Any, int, list[int]]], bitmask: np.ndarray) -> None:
        import llguidance
        import llguidance.numpy

        if self._executor is None:
            self._executor = llguidance.LLExecutor(num_threads=1)
        plain = [(m, k) for m, k, tokens in matchers if not tokens]
        if plain:
            llguidance.numpy.fill_next_token_bitmask_par(self._executor, plain, bitmask)
        drafted = [entry for entry in matchers if entry[2]]  # (llguidance refuses empty drafts)
        if drafted:
            llguidance.numpy.fill_next_token_bitmask_par_with_draft_tokens(self._executor, drafted, bitmask)

    def apply(self, logits: torch.Tensor, fill: MaskFill) -> None:
        """Wait for ``fill`` and mask ``logits`` ([B, V], in place) with it."""
        if fill.future is not None:
            fill.future.result()
        bitmask = torch.from_numpy(fill.bitmask).to(logits.device)
        self.apply_bitmask(logits, bitmask, fill.rows.to(logits.device))

    def close(self) -> None:
        self._compile_pool.shutdown(wait=False, cancel_futures=True)
        self._fill_pool.shutdown(wait=False, cancel_futures=True)
