"""The frontend's public ``tandem.v1.Generation`` servicer.

Thin: protobuf in, ``AsyncLLM`` call, protobuf out; every failure goes through
``errors.abort_with`` for its status code.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc

from frontend_service import api
from frontend_service.async_llm import AsyncLLM
from frontend_service.control import PauseMode
from frontend_service.errors import abort_with
from tandem.protocol import convert
from tandem.protocol.sampling_params import RequestOutputKind, SamplingParams
from tandem.v1 import frontend_pb2, frontend_pb2_grpc

logger = logging.getLogger(__name__)

TRACE_METADATA_KEYS = ("traceparent", "tracestate")


class GenerationServicer(frontend_pb2_grpc.GenerationServicer):
    """Registered before the engines answer; see ``attach``."""

    def __init__(self, fingerprint: str) -> None:
        self.llm: AsyncLLM = None  # type: ignore[assignment]  # set by attach()
        self.model_name = ""
        self.info: Any = None
        self.fingerprint = fingerprint
        self.draining = False  # set on SIGTERM/SIGINT: new Generate calls are refused

    def attach(self, llm: AsyncLLM, model_name: str, info: Any) -> None:
        self.llm = llm
        self.model_name = model_name
        self.info = info

    async def _require_ready(self, context: grpc.aio.ServicerContext) -> None:
        if self.llm is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the frontend is still connecting to its engines")

    async def _refuse_while_draining(self, context: grpc.aio.ServicerContext) -> None:
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the frontend is draining")

    async def Generate(
        self, request: frontend_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[frontend_pb2.GenerateResponse]:
        await self._require_ready(context)
        await self._refuse_while_draining(context)
        try:
            args = api.generate_args_from_proto(request, self.llm.sampling_defaults)
            metadata = dict(context.invocation_metadata() or ())
            trace = {k: metadata[k] for k in TRACE_METADATA_KEYS if k in metadata}
            first = True
            stream = self.llm.generate(
                args.sampling_params,
                trace_headers=trace or None,
                timeout_s=context.time_remaining(),  # None without a client deadline
                **args.kwargs,
            )
            async for out in stream:
                yield api.response_to_proto(out, args.sampling_params, first)
                first = False
                if out.finished and any(c.finish_reason == "error" for c in out.outputs):
                    await context.abort(grpc.StatusCode.INTERNAL, "the engine failed this request")
        except asyncio.CancelledError:
            raise  # client cancelled or deadline passed: AsyncLLM already aborted
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await abort_with(context, exc)

    async def GenerateSession(
        self, request_iterator: AsyncIterator[frontend_pb2.GenerateSessionRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[frontend_pb2.GenerateSessionResponse]:
        await self._require_ready(context)
        await self._refuse_while_draining(context)
        inputs = request_iterator.__aiter__()
        try:
            first_msg = await anext(inputs, None)
            if first_msg is None:
                return
            turn = {"params": SamplingParams(output_kind=RequestOutputKind.DELTA), "first": True, "index": -1}

            async def chunks() -> AsyncIterator[Any]:
                msg = first_msg
                while msg is not None:
                    chunk = api.session_chunk_from_proto(msg, self.llm.sampling_defaults)
                    turn["params"] = chunk.sampling_params or turn["params"]
                    turn["first"] = True
                    turn["index"] += 1
                    yield chunk
                    msg = await anext(inputs, None)

            outputs = self.llm.generate_session(
                chunks(),
                request_id=first_msg.request_id if first_msg.HasField("request_id") else None,
                timeout_s=context.time_remaining(),
            )
            async for out in outputs:
                response = api.response_to_proto(out, turn["params"], turn["first"])
                yield frontend_pb2.GenerateSessionResponse(response=response, turn=turn["index"])
                turn["first"] = False
        except asyncio.CancelledError:
            raise
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await abort_with(context, exc)

    async def Embed(
        self, request: frontend_pb2.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> frontend_pb2.EmbedResponse:
        await self._require_ready(context)
        await self._refuse_while_draining(context)
        try:
            inputs = api.embed_inputs_from_proto(request)
            params = convert.pooling_params_from_proto(request.pooling_params)
            params.validate()
            request_id = request.request_id if request.HasField("request_id") else uuid.uuid4().hex
            timeout = context.time_remaining()

            async def one(index: int, kwargs: dict) -> frontend_pb2.Embedding:
                async for out in self.llm.encode(
                    params, request_id=f"{request_id}-{index}", priority=request.priority,
                    timeout_s=timeout, **kwargs,
                ):
                    return frontend_pb2.Embedding(
                        index=index, embedding=out.outputs.data, num_prompt_tokens=len(out.prompt_token_ids)
                    )
                raise RuntimeError("the pooling request ended without an output")

            data = await asyncio.gather(*(one(i, kw) for i, kw in enumerate(inputs)))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            await abort_with(context, exc)
        return frontend_pb2.EmbedResponse(
            request_id=request_id, data=data, num_prompt_tokens=sum(d.num_prompt_tokens for d in data)
        )

    async def Abort(
        self, request: frontend_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> frontend_pb2.AbortResponse:
        await self._require_ready(context)
        self.llm.abort(list(request.request_ids))
        return frontend_pb2.AbortResponse()

    async def Tokenize(
        self, request: frontend_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> frontend_pb2.TokenizeResponse:
        await self._require_ready(context)
        tok = self.llm.tokenizer
        chat = request.WhichOneof("input") == "chat"
        try:
            _, ids = self.llm.input_processor.encode(
                prompt=None if chat else request.prompt,
                messages=[{"role": m.role, "content": m.content} for m in request.chat.messages] if chat else None,
                add_special_tokens=(
                    request.add_special_tokens if request.HasField("add_special_tokens") else None
                ),
                add_generation_prompt=(
                    request.add_generation_prompt if request.HasField("add_generation_prompt") else None
                ),
            )
        except Exception as exc:
            await abort_with(context, exc)
        strings = tok.convert_ids_to_tokens(ids) if request.return_token_strings else []
        return frontend_pb2.TokenizeResponse(
            token_ids=ids, token_strings=strings, max_model_len=self.info.max_model_len
        )

    async def Detokenize(
        self, request: frontend_pb2.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> frontend_pb2.DetokenizeResponse:
        await self._require_ready(context)
        vocab = self.info.vocab_size
        bad = [t for t in request.token_ids if not 0 <= t < vocab]
        if bad:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"invalid token_ids: {bad[0]} is outside the vocabulary [0, {vocab})",
            )
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        text = self.llm.tokenizer.decode(list(request.token_ids), skip_special_tokens=skip)
        return frontend_pb2.DetokenizeResponse(text=text)

    async def GetModelInfo(
        self, request: frontend_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> frontend_pb2.GetModelInfoResponse:
        await self._require_ready(context)
        eos = self.llm.input_processor.eos_token_id
        return frontend_pb2.GetModelInfoResponse(
            model=self.model_name,
            architecture=self.info.architecture,
            max_model_len=self.info.max_model_len,
            vocab_size=self.info.vocab_size,
            max_logprobs=self.info.max_logprobs,
            eos_token_id=eos,
            tokenizer_fingerprint=self.fingerprint,
            num_engines=len(self.llm.engines.engines),
        )

    async def PauseGeneration(
        self, request: frontend_pb2.PauseGenerationRequest, context: grpc.aio.ServicerContext
    ) -> frontend_pb2.PauseGenerationResponse:
        await self._require_ready(context)
        mode = PauseMode.WAIT if request.mode == frontend_pb2.PAUSE_MODE_WAIT else PauseMode.ABORT
        await self.llm.pause(mode)
        return frontend_pb2.PauseGenerationResponse()

    async def ResumeGeneration(
        self, request: frontend_pb2.ResumeGenerationRequest, context: grpc.aio.ServicerContext
    ) -> frontend_pb2.ResumeGenerationResponse:
        await self._require_ready(context)
        self.llm.resume()
        return frontend_pb2.ResumeGenerationResponse()

    async def IsPaused(
        self, request: frontend_pb2.IsPausedRequest, context: grpc.aio.ServicerContext
    ) -> frontend_pb2.IsPausedResponse:
        await self._require_ready(context)
        return frontend_pb2.IsPausedResponse(paused=self.llm.paused)
