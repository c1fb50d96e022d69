"""Turns a SchedulerOutput into one forward pass and the tokens sampled from it."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from itertools import pairwise
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine_service.attention import AttentionMetadata
from engine_service.batch import BatchInputs, ForwardTimer, InFlight, RunnerOutput
from engine_service.config import EngineConfig
from engine_service.cuda_graphs import DecodeGraphs
from engine_service.input_staging import InputStaging
from engine_service.kv_cache.manager import KVCacheManager
from engine_service.lora import LoRAManager
from engine_service.prompt_outputs import pool, prompt_logprobs
from engine_service.request import Request
from engine_service.sampler import (
    LogprobsTensors,
    Sampler,
    SamplingMetadata,
    argmax_suffices,
    reads_outputs_on_host,
)
from engine_service.scheduler import ScheduledRequest, SchedulerOutput
from engine_service.spec_decode.rejection import verify
from engine_service.structured_output import StructuredOutputManager
from tandem.protocol.model_config import ModelConfig

if TYPE_CHECKING:
    from engine_service.distributed.executor import TensorParallelExecutor

logger = logging.getLogger(__name__)


class ModelRunner:
    """Owns the model, its KV cache tensors and the sampler."""

    def __init__(
        self,
        config: EngineConfig,
        model: torch.nn.Module,
        model_config: ModelConfig,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        kv_manager: KVCacheManager,
        structured: StructuredOutputManager | None = None,
        lora: LoRAManager | None = None,
        executor: TensorParallelExecutor | None = None,
        max_blocks_per_seq: int = 1,
    ) -> None:
        """``executor``: with tensor parallelism, ``model`` is rank 0's shard and every
        forward is first broadcast to the other ranks; None: one process.
        ``max_blocks_per_seq``: KV blocks of the longest sequence (the graphs' block-table width)."""
        self.config = config
        self.model = model
        self.model_config = model_config
        self.kv_caches = kv_caches
        self.kv = kv_manager
        self.device = config.torch_device
        self.block_size = config.block_size
        self.sampler = _sampler_for(config)
        self.structured = structured
        self.lora = lora  # None: LoRA off, the forward never looks at adapters
        self.executor = executor
        # CUDA decode graphs (see engine_service/cuda_graphs.py); None: every step eager.
        self.graphs: DecodeGraphs | None = None
        rows = decode_rows(config)
        if config.torch_device.type == "cuda" and not config.enforce_eager and lora is None and executor is None:
            self.graphs = DecodeGraphs(rows, max_blocks_per_seq, config.torch_device)
        # Eager steps' inputs through persistent pinned buffers (input_staging.py); None:
        # a tensor per list (CPU, where the "copy" is the tensor's construction).
        self.staging: InputStaging | None = None
        if config.torch_device.type == "cuda":
            self.staging = InputStaging(config.torch_device, config.max_num_batched_tokens, rows, max_blocks_per_seq)

    def capture_cuda_graphs(self) -> None:
        """(Re)capture the decode graphs over the current model and KV cache."""
        if self.graphs is not None and self.kv.window is None:  # (graphs address one block table)
            start = time.perf_counter()
            self.graphs.capture(self.model, self.kv_caches)
            logger.info("captured %d decode CUDA graphs in %.1fs", len(self.graphs.sizes), time.perf_counter() - start)

    def release_cuda_graphs(self) -> None:
        """Drop the graphs before the weights or the KV cache move (sleep mode)."""
        if self.graphs is not None:
            self.graphs.release()

    # ---- inputs --------------------------------------------------------------

    def _prepare(self, sched: SchedulerOutput) -> BatchInputs:
        bs = self.block_size
        # Flat token-level inputs. A decode row (one token) is a few Python int ops; a
        # chunk of many tokens computes its slots with numpy. Attention sequences are
        # the scheduled entries, except in a decode step with drafts: there each row of
        # a verified decode is a decode sequence of its own (its context ends at its
        # position; the step writes every row's KV before any attention reads it), so
        # the step stays a decode batch (native decode loop, CUDA graphs).
        split = any(e.spec_token_ids for e in sched.scheduled) and self._decode_like(sched)
        tokens: list[int] = []
        positions_l: list[int] = []
        slots: list[int] = []
        tables: list[list[int]] = []  # per attention sequence
        query_start = [0]  # per attention sequence, + 1
        seq_lens: list[int] = []  # per attention sequence
        entry_rows: list[int] = []  # first row of each scheduled entry
        sample_rows: list[int] = []
        sample_idx: list[int] = []
        sample_offsets: list[int] = []
        pool_idx: list[int] = []
        pending: list[tuple[int, str]] = []  # (row, request id) of placeholder input tokens
        window = self.kv.window is not None
        window_slots: list[int] = []
        window_tables: list[list[int]] = []
        for i, entry in enumerate(sched.scheduled):
            request = entry.request
            start, n = entry.start, entry.num_new_tokens
            spec = entry.spec_token_ids
            block_ids = self.kv.block_ids(request.request_id)
            row0 = len(tokens)
            entry_rows.append(row0)
            if window:
                ids = self.kv.window_block_ids(request.request_id)
                window_tables.append(ids)
                window_slots.extend(ids[p // bs] * bs + p % bs for p in range(start, start + n))
            if n == 1:
                if start < request.num_tokens:
                    tokens.append(request.all_token_ids[start])
                else:  # async: an output placeholder, its token still on the device
                    pending.append((len(tokens), request.request_id))
                    tokens.append(0)
                positions_l.append(start)
                slots.append(block_ids[start // bs] * bs + start % bs)
            else:
                if spec:
                    tokens.extend(request.all_token_ids[start : start + n - len(spec)])
                    tokens.extend(spec)
                else:
                    tokens.extend(request.all_token_ids[start : start + n])
                pos = np.arange(start, start + n, dtype=np.int64)
                positions_l.extend(range(start, start + n))
                slots.extend((np.asarray(block_ids, dtype=np.int64)[pos // bs] * bs + pos % bs).tolist())
            if split and spec:
                for j in range(n):
                    tables.append(block_ids)
                    query_start.append(query_start[-1] + 1)
                    seq_lens.append(start + j + 1)
                if window:  # (the entry's table is there once already)
                    window_tables.extend([window_tables[-1]] * (n - 1))
            else:
                tables.append(block_ids)
                query_start.append(query_start[-1] + n)
                seq_lens.append(start + n)
            if request.pooling_params is not None:
                pool_idx.append(i)
            elif entry.samples:
                first = n - 1 - len(spec)  # the known token's row: sample it and every draft row
                for j in range(len(spec) + 1):
                    sample_rows.append(row0 + first + j)
                    sample_idx.append(i)
                    sample_offsets.append(j)
        num_seqs = len(seq_lens)
        max_blocks = max(len(t) for t in tables)
        block_table: list[int] = []  # [num_seqs * max_blocks], rows zero-padded
        for t in tables:
            block_table += t
            block_table += [0] * (max_blocks - len(t))
        max_query_len = max(b - a for a, b in pairwise(query_start))
        graph_size = None
        if self.graphs is not None and max_query_len == 1 and not window:  # decode only: straight into a graph's inputs
            graph_size = self.graphs.stage(tokens, positions_l, slots, seq_lens, block_table, max_blocks)
        if graph_size is not None:
            input_ids, positions, attn = self.graphs.batch_views(num_seqs, max(seq_lens))
        else:
            staged = None
            if self.staging is not None and not window:
                staged = self.staging.put(tokens, positions_l, slots, block_table, max_blocks, query_start, seq_lens)
            if staged is None:
                put = self._to_device
                staged = (
                    put(tokens, torch.int64), put(positions_l, torch.int64), put(slots, torch.int64),
                    put(block_table, torch.int32).view(num_seqs, max_blocks), put(query_start, torch.int32),
                    put(seq_lens, torch.int32),
                )
            input_ids, positions, slot_t, tables_t, query_start_t, seq_lens_t = staged
            attn = AttentionMetadata(
                slot_mapping=slot_t,
                block_tables=tables_t,
                query_start_loc=query_start_t,
                seq_lens=seq_lens_t,
                max_query_len=max_query_len,
                max_seq_len=max(seq_lens),
            )
            if window:
                width = max(len(t) for t in window_tables)
                flat = [i for t in window_tables for i in (*t, *[0] * (width - len(t)))]
                attn.window_slot_mapping = self._to_device(window_slots, torch.int64)
                attn.window_block_tables = self._to_device(flat, torch.int32).view(num_seqs, width)
        batch = BatchInputs(
            input_ids, positions, attn, sample_rows, sample_idx, pool_idx, graph_size=graph_size, pending=pending,
            sample_offsets=sample_offsets,
        )
        for i, entry in enumerate(sched.scheduled):
            request = entry.request
            if not request.prompt_logprobs_pending:
                continue
            start = entry.start
            count = min(start + entry.num_new_tokens, request.num_prompt_tokens - 1) - start
            if count > 0:
                batch.prompt_logit_spans[i] = (len(batch.logit_rows), count)
                row0 = entry_rows[i]
                batch.logit_rows.extend(range(row0, row0 + count))
        batch.logit_rows.extend(sample_rows)
        return batch

    @staticmethod
    def _decode_like(sched: SchedulerOutput) -> bool:
        """Every entry is a decode (one known token, maybe drafts after it) of a sampling
        request: the step can run as a decode batch with a sequence per row."""
        return all(
            e.num_new_tokens - len(e.spec_token_ids) == 1 and e.samples and e.request.pooling_params is None
            and not e.request.prompt_logprobs_pending
            for e in sched.scheduled
        )

    def _to_device(self, values: list[int], dtype: torch.dtype) -> torch.Tensor:
        """A host list as a device tensor. On CUDA through pinned memory without blocking:
        a copy from pageable memory waits for the stream's earlier work, which would end
        the overlap of async scheduling (the previous step's forward)."""
        if self.device.type != "cuda":
            return torch.tensor(values, dtype=dtype, device=self.device)
        return torch.tensor(values, dtype=dtype).pin_memory().to(self.device, non_blocking=True)

    # ---- forward + sampling --------------------------------------------------------

    def _forward(self, batch: BatchInputs) -> torch.Tensor:
        """``[num_tokens, hidden_size]``: the decode graph's replay where ``_prepare``
        staged the batch into one, else the eager forward."""
        if batch.graph_size is not None:
            return self.graphs.replay(batch.graph_size, batch.input_ids.shape[0])
        return self.model(batch.input_ids, batch.positions, self.kv_caches, batch.attn)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        batch = self._prepare(sched)
        timer = ForwardTimer(self.device)
        sampling = [SampleRow(sched.scheduled[i], j) for i, j in zip(batch.sample_idx, batch.sample_offsets, strict=True)]
        requests = [e.request for e in sampling]
        # Structured-output masks are filled on a worker thread during the forward.
        mask = None
        if self.structured is not None:
            drafts = [e.entry.spec_token_ids if e.offset == 0 else () for e in sampling]
            mask = self.structured.start_fill(requests, drafts)
        if self.lora is not None:
            self.lora.begin_step(
                [e.request.lora_int_id for e in sched.scheduled], [e.num_new_tokens for e in sched.scheduled]
            )
        if self.executor is not None:
            self.executor.broadcast_step(batch.input_ids, batch.positions, batch.attn, batch.logit_rows)
        try:
            hidden = self._forward(batch)
        finally:
            if self.lora is not None:
                self.lora.end_step()
        out = self._outputs(sched, batch, hidden, sampling, mask)
        timer.stop()
        out.forward_seconds = timer.seconds()
        return out

    def _outputs(
        self,
        sched: SchedulerOutput,
        batch: BatchInputs,
        hidden: torch.Tensor,
        sampling: list[SampleRow],
        mask: object,
    ) -> RunnerOutput:
        """The step's tokens, logprobs, prompt logprobs and pooled vectors from ``hidden``
        ([num_tokens, H]); ``sampling``: the rows that sample, in row order."""
        requests = [e.request for e in sampling]
        rows = batch.logit_rows
        out = RunnerOutput()
        # A decode batch asks for every row in order: no gather.
        identity = len(rows) == hidden.shape[0] and rows == list(range(len(rows)))
        only_sampled = bool(rows) and len(rows) == len(batch.sample_rows) and not batch.pool_idx
        if only_sampled and mask is None and not any(r.sampling_params.logprobs is not None for r in requests):
            tokens = self._sample(sampling, hidden if identity else hidden[rows])
            _take_tokens(sampling, tokens.tolist(), out)
            return out
        # [len(logit_rows), vocab] float32; one LM-head call (a collective under TP)
        all_logits = self.model.compute_logits(hidden if identity else hidden[rows]) if rows else None
        prompt_logprobs(sched, batch, all_logits, out)
        if batch.pool_idx:
            pool(sched, batch, hidden, out)
        if not batch.sample_rows:
            return out
        logits = all_logits[len(batch.logit_rows) - len(batch.sample_rows) :]  # [B, vocab]
        if mask is not None:
            self.structured.apply(logits, mask)  # before sampling: logprobs see the mask
        if mask is None and self._argmax_suffices(sampling):
            _take_tokens(sampling, self.sampler.argmax(logits).tolist(), out)
            return out
        result = self.sampler(logits, self._sampling_metadata(sampling, logits.device))
        _take_tokens(sampling, result.sampled_token_ids.tolist(), out, result.logprobs)
        return out

    def _sample(self, sampling: list[SampleRow], hidden: torch.Tensor) -> torch.Tensor:
        """``[B]`` tokens on the device for the ``sampling`` rows from their rows of ``hidden``
        ([B, H]). Where every row takes the argmax of its raw logits, the LM head may
        hand back the tokens alone (``greedy_tokens``; None: compute the logits, as a
        tensor-parallel shard always answers, since its logits are a collective)."""
        if self._argmax_suffices(sampling):
            tokens = self.model.greedy_tokens(hidden)
            if tokens is not None:
                return tokens
            return self.sampler.argmax(self.model.compute_logits(hidden))
        logits = self.model.compute_logits(hidden)
        return self.sampler(logits, self._sampling_metadata(sampling, logits.device)).sampled_token_ids

    @staticmethod
    def _argmax_suffices(sampling: Sequence[SampleRow]) -> bool:
        return all(
            argmax_suffices(e.request.sampling_params, e.num_outputs_before, e.request.eos_token_id) for e in sampling
        )

    # ---- async scheduling: launch now, read the tokens back later ----------------------

    def pipelinable(self, sched: SchedulerOutput) -> bool:
        """Whether ``launch`` can run this step while the previous one's tokens are still
        on the device: nothing in it reads a request's earlier tokens on the host
        (penalties, structured output, logprobs) or returns more than a token (pooling,
        prompt logprobs), on one process without adapters."""
        if self.lora is not None or self.executor is not None or sched.is_empty:
            return False
        for entry in sched.scheduled:
            request = entry.request
            if request.pooling_params is not None or request.structured is not None or entry.spec_token_ids:
                return False
            if request.prompt_logprobs_pending:
                return False
            if reads_outputs_on_host(request.sampling_params):
                return False
        return True

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput, previous: InFlight | None) -> InFlight:
        """Queue a ``pipelinable`` step's forward and sampling on the device and return
        without waiting for it. Input tokens of output placeholders are taken from
        ``previous``'s sampled tokens on the device."""
        batch = self._prepare(sched)
        timer = ForwardTimer(self.device)
        if batch.pending:
            if previous is None:
                raise RuntimeError("an output placeholder without the step that samples it")
            rows = self._to_device([row for row, _ in batch.pending], torch.int64)
            src = self._to_device([previous.index[rid] for _, rid in batch.pending], torch.int64)
            batch.input_ids[rows] = previous.tokens[src].to(batch.input_ids.dtype)
        sampling = [SampleRow(sched.scheduled[i]) for i in batch.sample_idx]
        requests = [e.request for e in sampling]
        hidden = self._forward(batch)
        rows = batch.sample_rows
        if not rows:  # prefill chunks only: nothing sampled
            tokens = torch.empty(0, dtype=torch.int64, device=hidden.device)
        else:
            h = hidden if rows == list(range(hidden.shape[0])) else hidden[self._to_device(rows, torch.int64)]
            tokens = self._sample(sampling, h)
        timer.stop()
        return InFlight([r.request_id for r in requests], tokens, timer)

    def _sampling_metadata(self, sampling: Sequence[SampleRow], device: torch.device) -> SamplingMetadata:
        requests = [e.request for e in sampling]
        return SamplingMetadata.from_requests(
            [r.sampling_params for r in requests],
            [r.prompt_token_ids for r in requests],
            [e.output_token_ids for e in sampling],
            [r.sampling_params.seed for r in requests],
            [r.eos_token_id for r in requests],
            self.model_config.vocab_size,
            device,
            [e.num_outputs_before for e in sampling],
        )


class SampleRow:
    """One sampled row of a step: ``entry``'s known token (``offset`` 0), or with drafts
    the row after its first ``offset`` drafts, sampled as if they were the output."""

    __slots__ = ("entry", "offset")

    def __init__(self, entry: ScheduledRequest, offset: int = 0) -> None:
        self.entry = entry
        self.offset = offset

    @property
    def request(self) -> Request:
        return self.entry.request

    @property
    def num_outputs_before(self) -> int:
        """The output position this row samples."""
        return self.entry.num_outputs_before + self.offset

    @property
    def output_token_ids(self) -> list[int]:
        """The output before this row's position (the drafts before it included)."""
        outputs = self.entry.request.output_token_ids
        return outputs + self.entry.spec_token_ids[: self.offset] if self.offset else outputs


def _take_tokens(
    sampling: list[SampleRow], tokens: list[int], out: RunnerOutput, logprobs: LogprobsTensors | None = None
) -> None:
    """Each request's sampled token into ``out``; a request with drafts verifies them
    against its rows' tokens (``verify``): the accepted ones, then the row's token after them.
    With ``logprobs``, a request that asked for them gets those of each token it emits (its
    rows are consecutive: the accepted drafts' and the one after them)."""
    i = 0
    while i < len(sampling):
        entry = sampling[i].entry
        rid = entry.request.request_id
        drafts = entry.spec_token_ids
        if drafts:
            out.accepted[rid], out.sampled[rid] = verify(drafts, tokens[i : i + len(drafts) + 1])
        else:
            out.sampled[rid] = tokens[i]
        num = entry.request.sampling_params.logprobs
        if logprobs is not None and num is not None:
            kept = len(out.accepted.get(rid, ())) + 1
            out.logprobs[rid] = logprobs.to_logprobs(range(i, i + kept), num)
        i += len(drafts) + 1


def decode_rows(config: EngineConfig) -> int:
    """The most sequences of a decode step: ``max_num_seqs``, or with speculative decoding
    the verified rows of the requests that may draft (each its own sequence), within the
    step's token budget: the CUDA graphs' and the staging buffers' batch."""
    rows, spec = config.max_num_seqs, config.speculative
    if spec is not None:
        drafting = min(spec.disable_by_batch_size or rows, rows)
        rows = min(max(rows, drafting * (1 + spec.num_speculative_tokens)), max(rows, config.max_num_batched_tokens))
    return rows


def _sampler_for(config: EngineConfig) -> Sampler:
    """Where the native CPU kernels are in use, the sampler takes their argmax and
    seeded uniforms too."""
    if config.resolved_attention_backend == "cpu":
        from kernels import cpu_ops

        return Sampler(argmax=cpu_ops.argmax, seeded_uniform=cpu_ops.seeded_uniform)
    return Sampler()
