"""The in-process offline API: ``LLM(model=DIR).generate(prompts, sampling_params)``.

Same input and output processing as the frontend service, with the EngineCore in
this process instead of behind gRPC: for batch jobs, tests and benchmarks.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any

from engine_service.config import EngineConfig
from engine_service.core import EngineCore
from frontend_service.input_processor import InputProcessor
from frontend_service.output_processor import OutputProcessor
from frontend_service.outputs import PoolingOutput, PoolingRequestOutput, RequestOutput
from tandem.model_source import resolve_model
from tandem.protocol.lora import LoRARequest
from tandem.protocol.pooling_params import PoolingParams
from tandem.protocol.sampling_params import InvalidRequestError, RequestOutputKind, SamplingParams

# A prompt: text, {"prompt_token_ids": [...]} or {"prompt": "..."}, or chat messages.
PromptType = str | Mapping[str, Any] | Sequence[Mapping[str, Any]]


class LLM:
    """An engine in this process. Close it with ``shutdown()`` or ``with LLM(...) as llm:``;
    one that is garbage-collected or still open at interpreter exit is shut down then.
    Closed, its workers are joined, the process group destroyed and its memory
    released, so a new ``LLM`` of any kind can start in the same process."""

    def __init__(self, model: str, tokenizer: str | None = None, **engine_args: Any) -> None:
        """``model``: a checkpoint directory, a .gguf file, "demo", or "" for the default
        model; ``tokenizer``: one to use instead of the model's (the same kinds)."""
        from transformers import AutoTokenizer

        model = resolve_model(model)  # a GGUF file, "demo" or "" -> its checkpoint directory
        tokenizer_dir = resolve_model(tokenizer) if tokenizer else model
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        self.engine = EngineCore(EngineConfig(model=model, tokenizer=tokenizer or "", **engine_args))
        # Holds the engine, not self: runs once, on shutdown(), collection or exit.
        self._finalizer = weakref.finalize(self, self.engine.shutdown)
        mc = self.engine.model_config
        self.input_processor = InputProcessor(
            self.tokenizer,
            self.engine.max_model_len,
            mc.vocab_size,
            self.engine.config.max_logprobs,
            self.tokenizer.eos_token_id,
            mc.eos_token_ids,
            max_num_seqs=self.engine.config.max_num_seqs,
        )
        self._counter = 0

    def shutdown(self) -> None:
        """Stop the engine and release what it holds; idempotent. The LLM is unusable
        afterwards."""
        self._finalizer()

    def _check_open(self) -> None:
        if not self._finalizer.alive:
            raise RuntimeError("this LLM was shut down: make a new one")

    def __enter__(self) -> LLM:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.shutdown()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order.

        ``lora_request``: one adapter for every prompt, or a list with one per prompt
        (None entries: the base model)."""
        self._check_open()
        if isinstance(prompts, str | Mapping) or _is_chat(prompts):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise InvalidRequestError(
                    "sampling_params", len(params_list), f"needs one per prompt ({len(prompts)})"
                )
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise InvalidRequestError("lora_request", len(loras), f"needs one per prompt ({len(prompts)})")
        processor = OutputProcessor(self.tokenizer)
        order: list[str] = []
        added: list[str] = []
        try:
            for prompt, params, lora in zip(prompts, params_list, loras, strict=True):
                order.append(self._add(processor, prompt, params, lora, added))
        except Exception:
            self.engine.abort_requests(added)  # none of this call's requests run: blocks back
            self.engine.take_ended_outputs()
            raise
        results: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            step = self.engine.step()
            processed_outputs = processor.process_outputs(step.outputs, step.token_columns)
            for user_id, out in processed_outputs.request_outputs:
                if out.finished:
                    results[user_id] = out
            if processed_outputs.reqs_to_abort:
                self.engine.abort_requests(processed_outputs.reqs_to_abort)
        return [results[rid] for rid in order]

    def _add(
        self,
        processor: OutputProcessor,
        prompt: PromptType,
        params: SamplingParams,
        lora: LoRARequest | None,
        added: list[str],
    ) -> str:
        request_id = str(self._counter)
        self._counter += 1
        final_only = dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
        processed = self.input_processor.process(
            request_id, final_only, lora_request=lora, **_prompt_kwargs(prompt)
        )
        processor.add_processed(processed)
        for req in processed.engine_requests:
            self.engine.add_request(req)
            added.append(req.request_id)
        return request_id

    # ---- LoRA adapters ----------------------------------------------------------------

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load a LoRA adapter for later requests; True if it was new."""
        return self.engine.add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self.engine.remove_lora(lora_id)

    def list_loras(self) -> set[int]:
        return set(self.engine.list_loras())

    def pin_lora(self, lora_id: int) -> bool:
        """Keep the adapter resident in a device slot (never evicted)."""
        return self.engine.pin_lora(lora_id)

    def encode(
        self,
        prompts: str | Mapping[str, Any] | Sequence[str | Mapping[str, Any]],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
    ) -> list[PoolingRequestOutput]:
        """One vector per prompt (text or {"prompt_token_ids": [...]}), in prompt order."""
        self._check_open()
        if isinstance(prompts, str | Mapping):
            prompts = [prompts]
        prompts = list(prompts)
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            params_list = [pooling_params or PoolingParams()] * len(prompts)
        else:
            params_list = list(pooling_params)
            if len(params_list) != len(prompts):
                raise InvalidRequestError(
                    "pooling_params", len(params_list), f"needs one per prompt ({len(prompts)})"
                )
        order = []
        for prompt, params in zip(prompts, params_list):
            request_id = str(self._counter)
            self._counter += 1
            request = self.input_processor.process_pooling(request_id, params, **_prompt_kwargs(prompt))
            self.engine.add_request(request)
            order.append(request)
        results: dict[str, PoolingRequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step().outputs:
                if out.pooling_output is None:
                    raise RuntimeError(f"pooling request {out.request_id} failed: {out.error}")
                req = next(r for r in order if r.request_id == out.request_id)
                results[out.request_id] = PoolingRequestOutput(
                    out.request_id, PoolingOutput(out.pooling_output), req.prompt_token_ids, out.num_cached_tokens
                )
        return [results[r.request_id] for r in order]

    def embed(
        self,
        prompts: str | Mapping[str, Any] | Sequence[str | Mapping[str, Any]],
        pooling_params: PoolingParams | None = None,
    ) -> list[PoolingRequestOutput]:
        """``encode`` with the embed task (``.outputs.embedding`` is the vector)."""
        params = pooling_params or PoolingParams()
        if params.task != "embed":
            raise InvalidRequestError("pooling_params.task", params.task, "embed() runs the embed task")
        return self.encode(prompts, params)

    # ---- the engine API beyond generation (vLLM's names) ------------------------------

    def sleep(self, level: int = 1) -> None:
        """Give back the KV cache (level 1) and the weights too (level 2) until wake_up."""
        self.engine.sleep(level)

    def wake_up(self) -> None:
        self.engine.wake_up()

    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping()

    def reset_prefix_cache(self) -> int:
        """Drop the cached prefixes; returns how many blocks were dropped."""
        return self.engine.reset_prefix_cache()

    def start_profile(self) -> None:
        """Start a torch profiler trace (needs ``profiler_dir=``)."""
        self.engine.profiler.start()

    def stop_profile(self) -> str:
        """Stop the trace; returns the file written."""
        return self.engine.profiler.stop()

    def get_supported_tasks(self) -> tuple[str, ...]:
        return self.engine.supported_tasks

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        """An allow-listed engine method on every worker; one result per worker."""
        from engine_service.core_loop import UTILITY_METHODS

        return UTILITY_METHODS["collective_rpc"](self.engine, method, *args)


def _is_chat(value: Any) -> bool:
    return (
        isinstance(value, Sequence)
        and not isinstance(value, str)
        and bool(value)
        and isinstance(value[0], Mapping)
        and "role" in value[0]
    )


def _prompt_kwargs(prompt: PromptType) -> dict[str, Any]:
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if isinstance(prompt, Mapping):
        if "prompt_token_ids" in prompt:
            return {"prompt_token_ids": list(prompt["prompt_token_ids"])}
        if "prompt" in prompt:
            return {"prompt": prompt["prompt"]}
        raise InvalidRequestError("prompt", dict(prompt), "needs prompt or prompt_token_ids")
    if _is_chat(prompt):
        return {"messages": list(prompt)}
    raise InvalidRequestError("prompt", prompt, "must be text, a token-id dict or chat messages")
