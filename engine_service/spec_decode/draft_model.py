"""Draft-model proposer: a smaller checkpoint with the target's vocabulary drafts greedily.

The draft model runs in the engine's process on the engine's device, with a paged KV cache
of its own (``num_blocks`` blocks of ``block_size`` tokens, from its own free list). Per
request it holds the KV of a token prefix, ``_Seq.tokens``; a draft step

1. catches up: the request's tokens after the longest prefix still equal to its own (the
   accepted drafts and the target's token since the last step; the whole prompt the first
   time) run as one chunk per request, the last row giving the first draft token;
2. decodes ``k - 1`` more tokens, one batched decode per token.

Drafts are the draft model's argmax: a point-mass proposer, so verification
(rejection.py) keeps the target's distribution exactly for every sampling setting. A
rejected draft's KV needs no undo: the next catch-up starts where the tokens differ and
writes over it. Requests draft together (``propose`` takes every drafting request of the
step), so the draft's forwards are batched like the target's.

A request's draft KV lives from its first draft to its end (``release``); when blocks run
short, the sequences not drafting in this step give theirs back (least recently used
first), and a request that still does not fit drafts nothing this step. The draft catches
up a request's whole prompt, but at most ``MAX_OUTPUT_LAG`` tokens of its output: a request
that decoded longer without drafts (speculation off under load) does not draft.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine_service.attention import AttentionMetadata

if TYPE_CHECKING:
    from engine_service.config import EngineConfig
    from engine_service.request import Request
    from kernels.dispatch import KernelOps
    from tandem.protocol.model_config import ModelConfig

SPLIT_ROWS = 8  # catch-ups of at most this many tokens a request run as a decode batch
# Output tokens of a request the draft may have to catch up on: more (a request that decoded
# while speculation was off, above disable_by_batch_size) would cost a prefill of the draft
# for what is left of the request, and it drafts no more. (SmolLM2-135M, float32 target, its
# 4-bit file as the draft: catching up the tail of a 64-request batch cost 25% of its
# throughput, benchmarks/NOTES.md, issue 46.)
MAX_OUTPUT_LAG = 32


@dataclass
class _Seq:
    """One request's draft KV: ``tokens[i]``'s KV is at position i, in ``blocks``."""

    blocks: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    stable: int = 0  # tokens[:stable] are the request's own (immutable) tokens
    last_used: int = 0  # the draft step that last used it (eviction order)


@dataclass
class _Plan:
    """One request's drafting this step."""

    seq: _Seq
    tokens: list[int]  # the request's tokens; the draft computes up to the last one
    cursor: int  # the next position to catch up
    k: int  # drafts wanted
    drafts: list[int] = field(default_factory=list)


class DraftModel:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        max_chunk_tokens: int,
        device: torch.device,
        reload: Callable[[], torch.nn.Module] | None = None,
        allocate: Callable[[], list[tuple[torch.Tensor, torch.Tensor]]] | None = None,
    ) -> None:
        """``kv_caches``: per layer (key, value), each ``[num_blocks, block_size, kv_heads,
        head_dim]``; ``max_model_len``: the most positions the draft model drafts at;
        ``max_chunk_tokens``: most tokens of one catch-up forward (longer catch-ups take
        several); ``reload`` and ``allocate``: the weights and the KV cache made again
        (sleep mode's wake-up)."""
        self.model = model
        self.kv_caches = kv_caches
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_chunk_tokens = max_chunk_tokens
        self.device = device
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: pop() takes block 0 first
        self._seqs: dict[str, _Seq] = {}
        self._step = 0
        self._reload = reload
        self._allocate = allocate

    # ---- sleep mode: the draft's memory goes and comes back with the engine's ------------

    def sleep(self, level: int) -> None:
        """Level 1: the KV cache goes (on CUDA the weights move to host memory); level 2:
        the weights too."""
        self.release_all()
        self.kv_caches = []
        if level == 2:
            self.model = None  # type: ignore[assignment]
        elif self.device.type == "cuda":
            self.model.to("cpu")

    def wake_up(self) -> None:
        if self.model is None:
            if self._reload is None:
                raise RuntimeError("the draft model cannot be reloaded")
            self.model = self._reload()
        elif self.device.type == "cuda":
            self.model.to(self.device)
        if not self.kv_caches and self._allocate is not None:
            self.kv_caches = self._allocate()

    # ---- the requests' KV ----------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def release(self, request_id: str) -> None:
        """The request ended: its draft KV goes back."""
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            self._free.extend(reversed(seq.blocks))

    def release_all(self) -> None:
        """Every request's draft KV goes (before the cache itself is released)."""
        for rid in list(self._seqs):
            self.release(rid)

    def _reserve(self, rid: str, num_positions: int, drafting: set[str]) -> _Seq | None:
        """``rid``'s sequence with blocks for ``num_positions`` positions, evicting
        sequences outside ``drafting`` (least recently used first) where blocks run
        short; None if it still does not fit."""
        seq = self._seqs.get(rid)
        if seq is None:
            seq = self._seqs[rid] = _Seq()
        needed = -(-num_positions // self.block_size) - len(seq.blocks)
        if needed > len(self._free):
            idle = sorted((s.last_used, r) for r, s in self._seqs.items() if r not in drafting)
            for _, victim in idle:
                self.release(victim)
                if needed <= len(self._free):
                    break
        if needed > len(self._free):
            if not seq.blocks:
                del self._seqs[rid]
            return None
        for _ in range(max(0, needed)):
            seq.blocks.append(self._free.pop())
        seq.last_used = self._step
        return seq

    # ---- drafting ------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, wanted: Sequence[tuple[Request, int]]) -> dict[str, list[int]]:
        """Up to ``k`` greedy draft tokens after each ``(request, k)``'s tokens (every
        request's known tokens are all but its last computed by the target); a request
        left out of the answer drafts nothing this step."""
        self._step += 1
        drafting = {r.request_id for r, _ in wanted}
        plans: dict[str, _Plan] = {}
        for request, k in wanted:
            tokens = request.all_token_ids
            k = min(k, self.max_model_len - len(tokens))
            held = self._seqs.get(request.request_id)
            start = 0 if held is None else _still_valid(held, tokens)  # where its catch-up starts
            if k <= 0 or len(tokens) - max(start, request.num_prompt_tokens) > MAX_OUTPUT_LAG:
                continue  # (the second: output tokens the draft would have to catch up on)
            # Positions written: the catch-up's, up to len(tokens) - 1, then drafts 1..k-1.
            seq = self._reserve(request.request_id, len(tokens) + k - 1, drafting)
            if seq is not None:
                plans[request.request_id] = _Plan(seq, tokens, start, k)
        # 1. Catch up to each request's last token, at most max_chunk_tokens a forward; the
        #    last token's row gives the first draft.
        while True:
            batch: list[tuple[_Plan, list[int]]] = []
            budget = self.max_chunk_tokens
            for plan in plans.values():
                if plan.cursor < len(plan.tokens) and budget > 0:
                    n = min(len(plan.tokens) - plan.cursor, budget)
                    batch.append((plan, plan.tokens[plan.cursor : plan.cursor + n]))
                    budget -= n
            if not batch:
                break
            out = self._forward([(plan.seq, chunk, plan.cursor) for plan, chunk in batch])
            for (plan, chunk), token in zip(batch, out, strict=True):
                plan.seq.tokens[plan.cursor :] = chunk
                plan.cursor += len(chunk)
                if plan.cursor == len(plan.tokens):
                    plan.drafts.append(token)
        for plan in plans.values():
            plan.seq.stable = len(plan.tokens)
        # 2. Decode: each request's newest draft in, the next one out, until it has k.
        while True:
            decoding = [plan for plan in plans.values() if len(plan.drafts) < plan.k]
            if not decoding:
                break
            out = self._forward([(plan.seq, [plan.drafts[-1]], len(plan.seq.tokens)) for plan in decoding])
            for plan, token in zip(decoding, out, strict=True):
                plan.seq.tokens.append(plan.drafts[-1])
                plan.drafts.append(token)
        return {rid: plan.drafts for rid, plan in plans.items()}

    def _forward(self, feed: Sequence[tuple[_Seq, list[int], int]]) -> list[int]:
        """One batched forward: each ``(seq, tokens, start)`` computes ``tokens`` at positions
        ``start...`` into its blocks; the greedy next token after each one's last row.
        Short chunks (a catch-up after verification) run as a decode: each row its own
        sequence, its context ending at its position (every row's KV is written before
        attention reads any), so the native decode loop takes them."""
        bs = self.block_size
        split = max(len(tokens) for _, tokens, _ in feed) <= SPLIT_ROWS
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        last_rows: list[int] = []
        width = max(len(seq.blocks) for seq, _, _ in feed)
        table: list[int] = []
        for seq, tokens, start in feed:
            ids.extend(tokens)
            row_table = seq.blocks + [0] * (width - len(seq.blocks))
            for p in range(start, start + len(tokens)):
                positions.append(p)
                slots.append(seq.blocks[p // bs] * bs + p % bs)
                if split:
                    query_start.append(len(positions))
                    seq_lens.append(p + 1)
                    table += row_table
            if not split:
                query_start.append(len(ids))
                seq_lens.append(start + len(tokens))
                table += row_table
            last_rows.append(len(ids) - 1)
        dev = self.device
        attn = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=torch.tensor(table, dtype=torch.int32, device=dev).view(len(seq_lens), width),
            query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            max_query_len=1 if split else max(len(t) for _, t, _ in feed),
            max_seq_len=max(seq_lens),
        )
        hidden = self.model(
            torch.tensor(ids, dtype=torch.int64, device=dev),
            torch.tensor(positions, dtype=torch.int64, device=dev),
            self.kv_caches,
            attn,
        )
        if len(last_rows) != hidden.shape[0]:
            hidden = hidden[last_rows]
        tokens = self.model.greedy_tokens(hidden)
        if tokens is None:
            tokens = self.model.compute_logits(hidden).argmax(dim=-1)
        return tokens.tolist()


def _still_valid(seq: _Seq, tokens: list[int]) -> int:
    """Where ``seq``'s catch-up starts: its longest prefix equal to ``tokens``, short of the
    last token (whose row gives the first draft). ``seq.tokens[:seq.stable]`` were the
    request's tokens at the last draft step, which never change."""
    start = min(seq.stable, len(seq.tokens), len(tokens) - 1)
    end = min(len(seq.tokens), len(tokens) - 1)
    while start < end and seq.tokens[start] == tokens[start]:
        start += 1
    return start


def load_draft_model(config: EngineConfig, ops: KernelOps, target: ModelConfig,
                     max_model_len: int) -> tuple[torch.nn.Module, ModelConfig, int]:
    """The draft checkpoint of ``config.speculative``, loaded and packed as the engine's
    own model would be (its ``quantization``), checked against the ``target``: the same
    vocabulary. (Sliding-window layers read the draft's one block table, masked to their
    window.) Returns (model, its config, the positions it drafts at)."""
    from engine_service.config import ConfigError
    from engine_service.startup import ModelLoader
    from tandem.model_source import resolve_model

    spec = config.speculative
    assert spec is not None and spec.method == "draft_model"
    draft_config = dataclasses.replace(
        config, model=resolve_model(spec.model), tokenizer="", quantization=spec.quantization,
        speculative_config="",
    )
    model, model_config = ModelLoader(draft_config, ops, None).load()
    if model_config.vocab_size != target.vocab_size:
        raise ConfigError(
            f"the draft model {spec.model} has a vocabulary of {model_config.vocab_size} tokens, the "
            f"target {target.vocab_size}: a draft must share the target's tokenizer"
        )
    return model, model_config, min(max_model_len, model_config.max_position_embeddings)
