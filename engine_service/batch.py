"""What passes between the scheduler's step and the runner: a step's staged inputs
(``BatchInputs``), its results (``RunnerOutput``), and a launched step whose tokens are
still on the device (``InFlight``, async scheduling)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from engine_service.attention import AttentionMetadata
from tandem.protocol.outputs import Logprobs


@dataclass
class RunnerOutput:
    sampled: dict[str, int] = field(default_factory=dict)  # request id -> sampled token
    # Speculative decoding: request id -> its drafts accepted this step, which come before
    # its sampled token (spec_decode/rejection.py); requests without drafts are not here.
    accepted: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, Logprobs] = field(default_factory=dict)
    prompt_logprobs: dict[str, Logprobs] = field(default_factory=dict)  # complete ones only
    pooled: dict[str, list[float]] = field(default_factory=dict)  # pooling request id -> vector
    forward_seconds: float = 0.0  # the forward and sampling (async scheduling: on the device)


@dataclass
class BatchInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    attn: AttentionMetadata
    # Row of the last token of each sampling request, in batch order; a request with drafts
    # has a row for its known token and each draft (``sample_offsets`` 0..k).
    sample_rows: list[int]
    sample_idx: list[int]  # index into SchedulerOutput.scheduled of each sample row
    pool_idx: list[int]  # index into SchedulerOutput.scheduled of each pooling request
    # Rows of the hidden state the LM head reads this step, in one call: each prompt-
    # logprobs chunk's rows (request order), then ``sample_rows``.
    logit_rows: list[int] = field(default_factory=list)
    # scheduled index -> (first row in the logits, row count) of its prompt-logprobs chunk
    prompt_logit_spans: dict[int, tuple[int, int]] = field(default_factory=dict)
    # The decode graph's padded size when the inputs were staged into its buffers
    # (DecodeGraphs.stage; the tensors above are views of them); None: run eagerly.
    graph_size: int | None = None
    # Async scheduling: (row, request id) of the input tokens that are placeholders for
    # the previous step's sampled tokens, filled in on the device (``launch``).
    pending: list[tuple[int, str]] = field(default_factory=list)
    # Per sample row: its draft offset j (0 without drafts): it samples the output position
    # ``num_outputs_before + j``, as if the drafts before it were the output.
    sample_offsets: list[int] = field(default_factory=list)


class ForwardTimer:
    """Times a step's forward and sampling where they run: the wall clock on the CPU
    (the work is done when the call returns), CUDA events on a GPU (the work is only
    queued)."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._start_wall = time.perf_counter()
        self._wall = 0.0
        self._events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        if self._cuda:
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()

    def stop(self) -> None:
        if self._events is not None:
            self._events[1].record()
        else:
            self._wall = time.perf_counter() - self._start_wall

    def seconds(self) -> float:
        """Call once the work is done (on CUDA: after a synchronize)."""
        if self._events is not None:
            return self._events[0].elapsed_time(self._events[1]) / 1000.0
        return self._wall


class InFlight:
    """The sampled tokens of a launched step: ``tokens`` [B] on the device, in the order
    of ``request_ids``, copied to the host without blocking; ``wait`` reads them."""

    def __init__(self, request_ids: list[str], tokens: torch.Tensor, timer: ForwardTimer) -> None:
        self.request_ids = request_ids
        self.tokens = tokens
        self.index = {rid: i for i, rid in enumerate(request_ids)}
        self._timer = timer
        self._event: torch.cuda.Event | None = None
        if tokens.is_cuda:
            self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self._host.copy_(tokens, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = tokens

    def wait(self) -> RunnerOutput:
        if self._event is not None:
            self._event.synchronize()
        sampled = dict(zip(self.request_ids, self._host.tolist(), strict=True))
        return RunnerOutput(sampled=sampled, forward_seconds=self._timer.seconds())


