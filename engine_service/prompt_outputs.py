"""What a step computes from prompts beyond sampled tokens, for the ModelRunner:
pooled vectors of pooling requests (embeddings) and prompt logprobs, each gathered
chunk by chunk over a chunked prefill."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine_service.sampler import LogprobsTensors, compute_logprobs_tensors
from tandem.protocol.outputs import Logprobs

if TYPE_CHECKING:
    from engine_service.batch import BatchInputs, RunnerOutput
    from engine_service.request import Request
    from engine_service.scheduler import SchedulerOutput


def pool(sched: SchedulerOutput, batch: BatchInputs, hidden: torch.Tensor, out: RunnerOutput) -> None:
    """Pooling requests: their rows of ``hidden`` ([num_tokens, H]) this step."""
    qsl = batch.attn.query_start_loc.tolist()
    for i in batch.pool_idx:
        entry = sched.scheduled[i]
        request = entry.request
        vector = _pool_chunk(request, hidden[qsl[i] : qsl[i + 1]], entry.start, entry.samples)
        if vector is not None:
            out.pooled[request.request_id] = vector


def prompt_logprobs(
    sched: SchedulerOutput, batch: BatchInputs, all_logits: torch.Tensor | None, out: RunnerOutput
) -> None:
    """Logprobs of each prompt token given its prefix, gathered chunk by chunk.

    The logit at token index j predicts token j + 1, so a chunk [c, c + n) scores
    prompt tokens c + 1 .. min(c + n, P - 1).
    """
    for i, entry in enumerate(sched.scheduled):
        request = entry.request
        if not request.prompt_logprobs_pending:
            continue
        num = request.sampling_params.prompt_logprobs or 0
        start, n = entry.start, entry.num_new_tokens
        end = min(start + n, request.num_prompt_tokens - 1)
        if end > start:
            first, count = batch.prompt_logit_spans[i]
            logits = all_logits[first : first + count]
            targets = torch.tensor(
                request.prompt_token_ids[start + 1 : end + 1], device=logits.device
            )
            request.prompt_logprobs_chunks.append(
                compute_logprobs_tensors(torch.log_softmax(logits, dim=-1), num, targets)
            )
        if start + n >= request.num_prompt_tokens:
            out.prompt_logprobs[request.request_id] = _join_logprobs(
                request.prompt_logprobs_chunks, num
            )
            request.prompt_logprobs_chunks.clear()
            request.prompt_logprobs_pending = False


def _pool_chunk(
    request: Request, hidden: torch.Tensor, start: int, completes: bool  # hidden: [n, H]
) -> list[float] | None:
    """Fold one prefill chunk ``[start, start + n)`` of a pooling request into its state;
    the finished vector when ``completes`` (the chunk ends the prompt), else None."""
    params = request.pooling_params
    if start == 0:  # the prompt's first chunk (also after a preemption restarted it)
        request.pooling_state = None
    if params.pooling_type == "MEAN":
        chunk_sum = hidden.float().sum(dim=0)  # [H]
        state = request.pooling_state
        request.pooling_state = chunk_sum if state is None else state + chunk_sum
    elif params.pooling_type == "CLS" and start == 0:
        request.pooling_state = hidden[0].float().clone()
    if not completes:
        return None
    if params.pooling_type == "MEAN":
        vector = request.pooling_state / request.num_prompt_tokens
    elif params.pooling_type == "CLS":
        vector = request.pooling_state
    else:  # LAST
        vector = hidden[-1].float()
    if params.dimensions is not None:
        vector = vector[: params.dimensions]
    if params.normalize:
        vector = torch.nn.functional.normalize(vector, dim=0)
    request.pooling_state = None
    return vector.tolist()


def _join_logprobs(chunks: list[LogprobsTensors], num: int) -> Logprobs:
    joined = Logprobs(token_ids=[], logprobs=[], ranks=[])
    for chunk in chunks:
        part = chunk.to_logprobs(None, num)
        joined.token_ids.extend(part.token_ids)
        joined.logprobs.extend(part.logprobs)
        joined.ranks.extend(part.ranks)
    return joined
