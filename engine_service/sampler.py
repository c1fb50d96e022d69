"""The batched sampler: one pass over a step's logits turns them into token ids.

Order of work (as vLLM v1):
1. logprobs from the raw logits (before any processing; vLLM's "raw_logprobs");
2. allowed_token_ids mask, logit_bias, min_tokens mask, then penalties
   (repetition, frequency, presence): these change what greedy rows pick too. However
   extreme the knobs, every row keeps a token of finite logit: a mask never empties a
   row (the structured-output mask, applied before the sampler, wins), and biased or
   penalised logits saturate at +-MAX_LOGIT (``logits_processors``);
3. greedy rows take the argmax;
4. random rows (as one sub-batch): temperature (at most float32's largest: 1e300 is a
   uniform draw over the tokens left), min-p, top-k, then top-p on what is
   left, then the exponential race (argmax of probs / q with q ~ Exp(1)). Seeded rows
   draw q from a counter-based stream keyed by (seed, output position) (see
   ``kernels.reference.seeded_uniform``), so a seeded request gets the same tokens
   whatever batch or engine it runs in, and after preemption or migration; greedy rows
   draw nothing.

Every step is skipped when no row of the batch needs it: the common batch (plain
temperature sampling, no penalties) costs a softmax, one [R, V] uniform draw, a log and
an argmax. On CPU the uniform draw dominates.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine_service.logits_processors import (
    SeededUniform,
    apply_allowed_token_ids_,
    apply_logit_bias_,
    apply_min_p,
    apply_min_tokens_,
    apply_penalties_,
    apply_top_k_top_p,
    exponential_race,
)
from kernels.reference import seeded_uniform as reference_seeded_uniform
from tandem.protocol.outputs import Logprobs
from tandem.protocol.sampling_params import SamplingParams

_SAMPLING_EPS = 1e-5  # temperature below this is greedy (as SamplingParams.greedy)
_MAX_TEMPERATURE = torch.finfo(torch.float32).max


@dataclass
class SamplingMetadata:
    """Per-step sampling inputs for B rows (one row per request being sampled this step).

    Invariants: every tensor is [B] on the logits' device; optional tensors are None when
    no row uses the feature; ``seeds`` holds only rows sampled randomly.
    """

    temperature: torch.Tensor  # [B] float32; 0 = greedy row
    all_greedy: bool
    all_random: bool
    top_p: torch.Tensor | None  # [B] float32 in (0, 1]; 1 = disabled
    top_k: torch.Tensor | None  # [B] int64 in [1, V]; V = disabled
    min_p: torch.Tensor | None  # [B] float32 in [0, 1]; 0 = disabled
    seeds: dict[int, tuple[int, int]]  # random row -> (its seed, output position sampled)
    max_num_logprobs: int | None  # largest `logprobs` asked in the batch; None: none asked
    presence_penalties: torch.Tensor | None  # [B] float32; 0 = disabled
    frequency_penalties: torch.Tensor | None  # [B] float32; 0 = disabled
    repetition_penalties: torch.Tensor | None  # [B] float32; 1 = disabled
    prompt_token_ids: list[list[int]]  # per row (repetition penalty)
    output_token_ids: list[list[int]]  # per row, generated so far (all penalties)
    logit_bias: list[dict[int, float] | None]  # per row
    allowed_token_ids: list[list[int] | None]  # per row
    min_tokens_block: list[set[int] | None]  # per row: ids masked while output < min_tokens

    def __post_init__(self) -> None:
        if self.temperature.dim() != 1:
            raise ValueError(
                f"temperature must be 1-D [B], got shape {tuple(self.temperature.shape)}"
            )
        num_rows = self.temperature.shape[0]
        for name in (
            "prompt_token_ids",
            "output_token_ids",
            "logit_bias",
            "allowed_token_ids",
            "min_tokens_block",
        ):
            if len(getattr(self, name)) != num_rows:
                raise ValueError(f"{name} has {len(getattr(self, name))} rows, expected {num_rows}")
        for row in self.seeds:
            if not 0 <= row < num_rows:
                raise ValueError(f"seed for row {row} outside the batch of {num_rows}")
        if self.max_num_logprobs is not None and self.max_num_logprobs < 0:
            raise ValueError(f"max_num_logprobs must be >= 0, got {self.max_num_logprobs}")

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalties is not None
            or self.frequency_penalties is not None
            or self.repetition_penalties is not None
        )

    @classmethod
    def from_requests(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        seeds: list[int | None],
        eos_token_ids: list[int | None],
        vocab_size: int,
        device: torch.device | str,
        num_outputs: list[int] | None = None,
    ) -> SamplingMetadata:
        """Build one step's metadata; row i is request i of every list.

        A row with top_k = 1 is made greedy: same token, no random draw. A seeded row
        samples its output position ``num_outputs[row]`` (the tokens it already has,
        counted; by default ``len(output_token_ids[row])``), which min_tokens also reads.
        """
        if num_outputs is None:
            num_outputs = [len(ids) for ids in output_token_ids]
        num_rows = len(params)
        for name, values in (
            ("prompt_token_ids", prompt_token_ids),
            ("output_token_ids", output_token_ids),
            ("seeds", seeds),
            ("eos_token_ids", eos_token_ids),
            ("num_outputs", num_outputs),
        ):
            if len(values) != num_rows:
                raise ValueError(f"{name} has {len(values)} rows, expected {num_rows}")
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")

        temperature: list[float] = []
        top_p: list[float] = []
        top_k: list[int] = []
        min_p: list[float] = []
        seeded: dict[int, tuple[int, int]] = {}
        min_tokens_block: list[set[int] | None] = []
        for row, p in enumerate(params):
            k = p.top_k if p.top_k_enabled and p.top_k is not None else vocab_size
            k = min(k, vocab_size)
            greedy = p.greedy or k == 1
            temperature.append(0.0 if greedy else p.temperature)
            # Greedy rows never reach the random path: keep their knobs neutral.
            top_p.append(1.0 if greedy else p.top_p)
            top_k.append(vocab_size if greedy else k)
            min_p.append(0.0 if greedy else p.min_p)
            seed = seeds[row]
            if seed is not None and not greedy:
                seeded[row] = (seed, num_outputs[row])
            min_tokens_block.append(_min_tokens_block(p, num_outputs[row], eos_token_ids[row]))

        def tensor_if(
            values: list[float] | list[int], neutral: float, dtype: torch.dtype
        ) -> torch.Tensor | None:
            if all(v == neutral for v in values):
                return None
            return torch.tensor(values, dtype=dtype, device=device)

        num_greedy = sum(t == 0.0 for t in temperature)
        max_logprobs = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            temperature=torch.tensor(temperature, dtype=torch.float32, device=device),
            all_greedy=num_greedy == num_rows,
            all_random=num_greedy == 0,
            top_p=tensor_if(top_p, 1.0, torch.float32),
            top_k=tensor_if(top_k, vocab_size, torch.int64),
            min_p=tensor_if(min_p, 0.0, torch.float32),
            seeds=seeded,
            max_num_logprobs=max(max_logprobs) if max_logprobs else None,
            presence_penalties=tensor_if([p.presence_penalty for p in params], 0.0, torch.float32),
            frequency_penalties=tensor_if(
                [p.frequency_penalty for p in params], 0.0, torch.float32
            ),
            repetition_penalties=tensor_if(
                [p.repetition_penalty for p in params], 1.0, torch.float32
            ),
            prompt_token_ids=prompt_token_ids,
            output_token_ids=output_token_ids,
            logit_bias=[p.logit_bias or None for p in params],
            allowed_token_ids=[p.allowed_token_ids for p in params],
            min_tokens_block=min_tokens_block,
        )


def reads_outputs_on_host(p: SamplingParams) -> bool:
    """Whether sampling a row of ``p`` reads the request's earlier output tokens on the
    host (presence, frequency and repetition penalties count them) or sends logprobs
    back: such a row cannot take its input token from a step still on the device
    (async scheduling), nor skip ``SamplingMetadata``."""
    return (
        p.logprobs is not None
        or p.presence_penalty != 0.0
        or p.frequency_penalty != 0.0
        or p.repetition_penalty != 1.0
    )


def argmax_suffices(p: SamplingParams, num_output: int, eos_token_id: int | None) -> bool:
    """Whether a row's token is the first argmax of its raw logits, as the sampler would
    pick it: greedy (or top_k = 1), no logprobs asked, and no mask, bias or penalty that
    edits the row. A decode batch of only such rows skips ``SamplingMetadata``."""
    if not (p.greedy or (p.top_k_enabled and p.top_k == 1)):
        return False
    return (
        not reads_outputs_on_host(p)
        and not p.logit_bias
        and p.allowed_token_ids is None
        and _min_tokens_block(p, num_output, eos_token_id) is None
    )


def _min_tokens_block(
    p: SamplingParams, num_output: int, eos_token_id: int | None
) -> set[int] | None:
    """Token ids to mask while the request has fewer than min_tokens outputs (None: none)."""
    if num_output >= p.min_tokens:
        return None
    block = set(p.stop_token_ids)
    if eos_token_id is not None and not p.ignore_eos:
        block.add(eos_token_id)
    return block or None


@dataclass
class LogprobsTensors:
    """Logprobs of N positions: the chosen token first, then the top-k tokens."""

    token_ids: torch.Tensor  # [N, k + 1] int64: column 0 is the chosen token, then top-k
    logprobs: torch.Tensor  # [N, k + 1] float32
    ranks: torch.Tensor  # [N] int64: rank of the chosen token (1 = argmax)

    def to_logprobs(
        self, rows: slice | Sequence[int] | None = None, num_logprobs: int | None = None
    ) -> Logprobs:
        """Python lists for outputs: the given rows, with the first ``num_logprobs`` top entries."""
        token_ids, logprobs, ranks = self.token_ids, self.logprobs, self.ranks
        if rows is not None:
            index = (
                rows if isinstance(rows, slice) else torch.as_tensor(list(rows), dtype=torch.long)
            )
            token_ids, logprobs, ranks = token_ids[index], logprobs[index], ranks[index]
        if num_logprobs is not None:
            if not 0 <= num_logprobs <= self.token_ids.shape[1] - 1:
                raise ValueError(
                    f"num_logprobs={num_logprobs} outside [0, {self.token_ids.shape[1] - 1}]"
                )
            token_ids = token_ids[:, : num_logprobs + 1]
            logprobs = logprobs[:, : num_logprobs + 1]
        return Logprobs(
            token_ids=token_ids.tolist(), logprobs=logprobs.tolist(), ranks=ranks.tolist()
        )


def compute_logprobs_tensors(
    logprobs: torch.Tensor,  # [N, V] float32, log_softmax already applied
    num_logprobs: int,
    token_ids: torch.Tensor,  # [N] int64: the chosen token of each row
) -> LogprobsTensors:
    """Gather the chosen token's logprob and rank, and the top ``num_logprobs`` tokens."""
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [N, V], got shape {tuple(logprobs.shape)}")
    num_rows, vocab_size = logprobs.shape
    if token_ids.shape != (num_rows,):
        raise ValueError(f"token_ids must be [{num_rows}], got shape {tuple(token_ids.shape)}")
    if not 0 <= num_logprobs <= vocab_size:
        raise ValueError(f"num_logprobs={num_logprobs} outside [0, {vocab_size}]")
    chosen = token_ids.long().unsqueeze(1)  # [N, 1]
    chosen_logprobs = logprobs.gather(1, chosen)  # [N, 1]
    top_logprobs, top_ids = logprobs.topk(num_logprobs, dim=-1)  # [N, k]
    # Rank 1 is the most likely token; ties rank the chosen token first.
    ranks = (logprobs > chosen_logprobs).sum(dim=-1, dtype=torch.int32) + 1  # [N]
    return LogprobsTensors(
        token_ids=torch.cat([chosen, top_ids], dim=1),
        logprobs=torch.cat([chosen_logprobs, top_logprobs], dim=1).float(),
        ranks=ranks.long(),
    )


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    logprobs: LogprobsTensors | None  # sampled token + top-N (N = max_num_logprobs)


# ---------------------------------------------------------------------------------------
# Logits processors that also change greedy picks. All work in place on [B, V] logits the
# caller owns, and touch only the rows that use them.


def _torch_argmax(logits: torch.Tensor) -> torch.Tensor:  # [B, V] -> [B]
    return logits.argmax(dim=-1)


class Sampler:
    """Turns a step's logits into one token per row (plus logprobs when asked).

    ``argmax``: picks greedy rows' tokens, ``[B, V] -> [B]`` first index of the max;
    ``seeded_uniform``: seeded rows' uniforms (``kernels.reference.seeded_uniform``'s
    contract). The CPU backend passes its native ones.
    """

    def __init__(
        self,
        argmax: Callable[[torch.Tensor], torch.Tensor] = _torch_argmax,
        seeded_uniform: SeededUniform = reference_seeded_uniform,
    ) -> None:
        self.argmax = argmax
        self.seeded_uniform = seeded_uniform

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """logits: [B, V] float32, row i is request i of ``metadata``."""
        if logits.dim() != 2:
            raise ValueError(f"logits must be [B, V], got shape {tuple(logits.shape)}")
        if logits.shape[0] != metadata.num_rows:
            raise ValueError(f"logits has {logits.shape[0]} rows, metadata has {metadata.num_rows}")
        logits = logits.float()
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            raw_logprobs = logits.log_softmax(dim=-1)  # [B, V]
        if logits.shape[0] == 0:
            sampled = torch.empty(0, dtype=torch.long, device=logits.device)
        else:
            logits = self._process(logits, metadata)
            sampled = self._sample(logits, metadata)
        logprobs = None
        if raw_logprobs is not None and metadata.max_num_logprobs is not None:
            logprobs = compute_logprobs_tensors(raw_logprobs, metadata.max_num_logprobs, sampled)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    @staticmethod
    def _process(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """Masks, bias and penalties; copies the logits only when one applies."""
        has_allowed = any(ids is not None for ids in md.allowed_token_ids)
        has_bias = any(md.logit_bias)
        has_block = any(md.min_tokens_block)
        if not (has_allowed or has_bias or has_block or md.needs_penalties):
            return logits
        logits = logits.clone()  # [B, V], ours to edit
        if has_allowed:
            apply_allowed_token_ids_(logits, md.allowed_token_ids)
        if has_bias:
            apply_logit_bias_(logits, md.logit_bias)
        if has_block:
            apply_min_tokens_(logits, md.min_tokens_block)
        if md.needs_penalties:
            apply_penalties_(
                logits,
                md.presence_penalties,
                md.frequency_penalties,
                md.repetition_penalties,
                md.prompt_token_ids,
                md.output_token_ids,
            )
        return logits

    def _sample(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """Greedy rows: argmax; random rows: sampled on their own [R, V] sub-batch."""
        if md.all_greedy:
            return self.argmax(logits)  # [B]
        if md.all_random:
            return _sample_random(
                logits, md.temperature, md.min_p, md.top_k, md.top_p, md.seeds, self.seeded_uniform
            )
        sampled = self.argmax(logits)  # [B]
        rows = (md.temperature >= _SAMPLING_EPS).nonzero().flatten()  # [R]
        position = {row: i for i, row in enumerate(rows.tolist())}
        seeds = {position[r]: s for r, s in md.seeds.items() if r in position}

        def pick(values: torch.Tensor | None) -> torch.Tensor | None:
            return None if values is None else values[rows]

        sampled[rows] = _sample_random(
            logits[rows],
            md.temperature[rows],
            pick(md.min_p),
            pick(md.top_k),
            pick(md.top_p),
            seeds,
            self.seeded_uniform,
        )
        return sampled


def _sample_random(
    logits: torch.Tensor,  # [R, V]
    temperature: torch.Tensor,  # [R], all > 0
    min_p: torch.Tensor | None,  # [R]
    top_k: torch.Tensor | None,  # [R]
    top_p: torch.Tensor | None,  # [R]
    seeds: dict[int, tuple[int, int]],  # keyed by row of this sub-batch
    seeded_uniform: SeededUniform,
) -> torch.Tensor:  # [R] int64
    # A temperature past float32's range (e.g. 1e300) would be inf, and -inf / inf NaN.
    scaled = logits / temperature.clamp(max=_MAX_TEMPERATURE)[:, None]  # [R, V]
    if min_p is not None:
        scaled = apply_min_p(scaled, min_p)
    scaled = apply_top_k_top_p(scaled, top_k, top_p)
    return exponential_race(scaled.softmax(dim=-1), seeds, seeded_uniform)
