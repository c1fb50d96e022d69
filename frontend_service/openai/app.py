"""The FastAPI app of the OpenAI-compatible API, and the one place where exceptions become
OpenAI error JSON with an HTTP status.

Errors: ``{"error": {"message", "type", "param", "code"}}``. The classification is
``frontend_service.errors.status_for`` (the gRPC servicer's, so both edges agree); its
google.rpc code picks the HTTP status (INVALID_ARGUMENT 400, NOT_FOUND 404,
RESOURCE_EXHAUSTED 429 with ``Retry-After``, UNAVAILABLE 503, DEADLINE_EXCEEDED 504, else
500). ``param`` is the field an ``InvalidRequestError`` names; pydantic's validation errors
(FastAPI's 422) are 400s naming the field too.

With ``--api-key`` every route but ``OPEN_PATHS`` (probes, scrapers) needs
``Authorization: Bearer <key>``; ``tandem.security.ApiKeys`` decides, as for gRPC, and a
refusal is a 401 in the same error shape.

A client that goes away aborts its request: the handler races the generation against the
connection's ``http.disconnect``, for streams during the whole response.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from frontend_service.errors import retry_after_ms_for, status_for
from frontend_service.openai import ChatParsing, chat_tools, embeddings, serving, shapes
from frontend_service.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeRequest,
    warn_unknown,
)
from tandem.protocol.sampling_params import InvalidRequestError
from tandem.security import ApiKeys

logger = logging.getLogger(__name__)

T = TypeVar("T")
TRACE_HEADERS = ("traceparent", "tracestate")

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
              404: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable"}


class ApiError(Exception):
    """A refusal decided at the HTTP edge (unknown model, not ready, ...)."""

    def __init__(self, code: grpc.StatusCode, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.param = param


class ClientGoneError(Exception):
    """The client closed the connection before the response was ready."""


def error_parts(exc: BaseException) -> tuple[int, dict[str, Any], dict[str, str]]:
    """(HTTP status, OpenAI error body, headers) for ``exc``."""
    if isinstance(exc, ApiError):
        code, message, param = exc.code, str(exc), exc.param
    else:
        code, message = status_for(exc)
        param = exc.field if isinstance(exc, InvalidRequestError) else None
    status = HTTP_STATUS.get(code, 500)
    body = {"error": {"message": message, "type": ERROR_TYPE.get(status, "server_error"),
                      "param": param, "code": status}}
    headers = {}
    retry_ms = retry_after_ms_for(exc)
    if status == 429:
        headers["Retry-After"] = str(max(1, math.ceil(retry_ms / 1000)))
    return status, body, headers


def error_response(exc: BaseException) -> JSONResponse:
    status, body, headers = error_parts(exc)
    return JSONResponse(body, status_code=status, headers=headers)


def error_event(exc: BaseException) -> bytes:
    """A failure after a stream started: its last event before [DONE]."""
    return shapes.sse(shapes.dumps(error_parts(exc)[1]))


def _validation_error(exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0] if exc.errors() else {}
    param = _field_path(first.get("loc", ()))
    what = first.get("msg", "invalid request body")
    message = f"invalid {param}: {what}" if param else f"invalid request body: {what}"
    return error_response(ApiError(grpc.StatusCode.INVALID_ARGUMENT, message, param))


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict"})


def _field_path(loc: Any) -> str | None:
    """pydantic's error location as a field path ("messages[0].content"), without the
    "body" root and the union-member tags ("str", "list[int]") pydantic puts in it."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part != "body" and part not in _TYPE_TAGS and part.isidentifier():
            path += f".{part}" if path else part
    return path or None


async def _disconnected(receive: Receive) -> None:
    """Return once the client has closed the connection (the body was already read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(receive: Receive, work: Awaitable[T]) -> T:
    """``work``'s result, or ClientGoneError (``work`` cancelled) if the client leaves first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    if task.cancelled():
        raise ClientGoneError()
    return task.result()


class SSEResponse(Response):
    """``first`` then ``rest`` as server-sent events; closes ``rest`` (aborting the
    request) when the client disconnects."""

    media_type = "text/event-stream"

    def __init__(self, first: bytes, rest: AsyncGenerator[bytes, None]) -> None:
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-cache"})  # no body: chunked, no content-length
        self.first = first
        self.rest = rest

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def stream() -> None:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            await send({"type": "http.response.body", "body": self.first, "more_body": True})
            async for event in self.rest:
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        try:
            await until_disconnect(receive, stream())
        except ClientGoneError:
            logger.debug("client went away mid-stream: request aborted")
        finally:
            await self.rest.aclose()


def guarded(route: Callable[..., Awaitable[Response]]) -> Callable[..., Awaitable[Response]]:
    """Every failure of ``route`` answered as OpenAI error JSON (not re-raised to the server)."""

    @functools.wraps(route)
    async def wrapper(*args: Any, **kwargs: Any) -> Response:
        try:
            return await route(*args, **kwargs)
        except Exception as exc:
            return error_response(exc)

    return wrapper


OPEN_PATHS = frozenset({"/health", "/metrics"})  # served without an API key


class RequireApiKey:
    """ASGI middleware: refuses HTTP requests outside ``OPEN_PATHS`` that lack one of ``keys``."""

    def __init__(self, app: ASGIApp, keys: ApiKeys) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            refusal = self.keys.refusal(Headers(scope=scope).get("authorization"))
            if refusal is not None:
                response = error_response(ApiError(*refusal))
                response.headers["WWW-Authenticate"] = "Bearer"
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


@dataclass
class FrontendView:
    """What the HTTP edge reads from the running frontend (the gRPC servicer's state)."""

    servicer: Any  # GenerationServicer: .llm (None until engines answer), .model_name, .info, .draining
    model_path: str  # the checkpoint directory: accepted as a model name too
    ready: Callable[[], bool]  # readiness, as grpc.health.v1 reports it
    registry: Any = None  # the frontend's prometheus CollectorRegistry (None: no /metrics)
    created: int = 0
    api_keys: ApiKeys = field(default_factory=ApiKeys)  # --api-key; none: the API is open
    chat_parsing: ChatParsing = field(default_factory=ChatParsing)  # --tool-call-parser, --reasoning-parser


def build_app(view: FrontendView) -> FastAPI:
    app = FastAPI(title="tandem", docs_url=None, redoc_url=None, openapi_url=None)
    view.created = view.created or int(time.time())
    if view.api_keys:
        app.add_middleware(RequireApiKey, keys=view.api_keys)

    @app.exception_handler(RequestValidationError)
    async def on_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def on_http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: grpc.StatusCode.NOT_FOUND, 405: grpc.StatusCode.UNIMPLEMENTED}.get(
            exc.status_code, grpc.StatusCode.INVALID_ARGUMENT)
        response = error_response(ApiError(code, str(exc.detail)))
        response.status_code = exc.status_code
        return response

    def llm_for(model: str | None, generating: bool = False) -> Any:
        s = view.servicer
        if s.llm is None:
            raise ApiError(grpc.StatusCode.UNAVAILABLE, "the frontend is still connecting to its engines")
        if generating and s.draining:
            raise ApiError(grpc.StatusCode.UNAVAILABLE, "the frontend is draining")
        if model and model not in (s.model_name, view.model_path) and s.llm.loras.get(model) is None:
            raise ApiError(grpc.StatusCode.NOT_FOUND, f"the model {model!r} does not exist; "
                           f"this server serves {s.model_name!r}", "model")
        return s.llm

    async def generate(request: Request, body: Any, handler: Callable[..., Any]) -> Response:
        warn_unknown(body, request.url.path)
        llm = llm_for(body.model, generating=True)
        trace = {k: request.headers[k] for k in TRACE_HEADERS if k in request.headers}
        # A "model" naming a LoRA adapter the engines know runs with it (as vLLM does).
        lora = llm.loras.get(body.model) if body.model else None
        name = body.model if lora is not None else view.servicer.model_name
        call = serving.Call(llm, name, trace or None, error_event, lora, view.chat_parsing)
        try:
            result = await until_disconnect(request.receive, handler(call, body))
        except ClientGoneError:
            return Response(status_code=499)
        if isinstance(result, dict):
            return JSONResponse(result)
        try:
            # No 200 before the first event: a refusal still gets its HTTP status.
            first = await until_disconnect(request.receive, anext(result))
        except ClientGoneError:
            return Response(status_code=499)
        except BaseException:
            await result.aclose()
            raise
        return SSEResponse(first, result)

    @app.post("/v1/completions")
    @guarded
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        return await generate(request, body, serving.completions)

    @app.post("/v1/chat/completions")
    @guarded
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        return await generate(request, body, serving.chat)

    @app.post("/v1/embeddings")
    @guarded
    async def create_embedding(body: EmbeddingRequest, request: Request) -> Response:
        warn_unknown(body, request.url.path)
        llm = llm_for(body.model, generating=True)
        try:
            result = await until_disconnect(
                request.receive, embeddings.create(llm, view.servicer.model_name, body)
            )
        except ClientGoneError:
            return Response(status_code=499)
        return JSONResponse(result)

    @app.get("/v1/models")
    @guarded
    async def list_models() -> JSONResponse:
        llm_for(None)
        s = view.servicer
        card = {"id": s.model_name, "object": "model", "created": view.created, "owned_by": "tandem",
                "root": view.model_path, "parent": None, "max_model_len": s.info.max_model_len}
        adapters = [
            {"id": name, "object": "model", "created": view.created, "owned_by": "tandem",
             "root": lora.lora_path, "parent": s.model_name, "max_model_len": s.info.max_model_len}
            for name, lora in sorted(s.llm.loras.by_name.items())
        ]
        return JSONResponse({"object": "list", "data": [card, *adapters]})

    @app.post("/tokenize")
    @guarded
    async def tokenize(body: TokenizeRequest) -> JSONResponse:
        llm = llm_for(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise InvalidRequestError("prompt", None, "give exactly one of prompt, messages")
        messages = None
        prompt, special = body.prompt, body.add_special_tokens
        if body.messages is not None:
            messages = ChatCompletionRequest(messages=body.messages).chat_messages()
            if body.tools or body.chat_template_kwargs:  # rendered as chat completions render them
                prompt = chat_tools.render_chat(
                    llm.tokenizer, messages, chat_tools.check_tools(body.tools) or None,
                    body.add_generation_prompt is not False, body.chat_template_kwargs or {},
                )
                messages, special = None, bool(special)
        _, ids = llm.input_processor.encode(
            prompt=prompt, messages=messages, add_special_tokens=special,
            add_generation_prompt=body.add_generation_prompt,
        )
        out: dict[str, Any] = {"count": len(ids), "max_model_len": view.servicer.info.max_model_len,
                               "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = llm.tokenizer.convert_ids_to_tokens(ids)
        return JSONResponse(out)

    @app.post("/detokenize")
    @guarded
    async def detokenize(body: DetokenizeRequest) -> JSONResponse:
        llm = llm_for(body.model)
        vocab = view.servicer.info.vocab_size
        for i, token in enumerate(body.tokens):
            if not 0 <= token < vocab:
                raise InvalidRequestError(f"tokens[{i}]", token, f"token id outside the vocabulary [0, {vocab})")
        text = llm.tokenizer.decode(body.tokens, skip_special_tokens=body.skip_special_tokens)
        return JSONResponse({"prompt": text})

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if view.ready() else 503)

    @app.get("/metrics")
    @guarded
    async def metrics() -> Response:
        if view.registry is None:
            raise ApiError(grpc.StatusCode.NOT_FOUND, "metrics are off")
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(view.registry), media_type=CONTENT_TYPE_LATEST)

    return app
