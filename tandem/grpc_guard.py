"""A server interceptor that answers INVALID_ARGUMENT to request bodies that do not parse.

grpc's asyncio server deserializes each request message before (unary requests) or
while (streamed requests) the servicer runs; a body that fails to parse raises inside
grpc and the client sees UNKNOWN ("Unexpected <class 'DecodeError'>"). With this
interceptor installed (``grpc.aio.server(interceptors=[MalformedRequestGuard()])``)
each handler's ``request_deserializer`` returns a ``_Malformed`` marker instead of
raising, and the handler's behaviour is wrapped so that the marker ends the call:

- unary requests: ``context.abort(INVALID_ARGUMENT, ...)`` before the servicer runs;
- streamed requests: the servicer's request iterator ends at the bad message (as if
  the client had half-closed) after setting INVALID_ARGUMENT as the call's status, so
  the servicer cleans up as it does for a normal end of input and the call then ends
  with that status.

Handlers of other shapes (synchronous behaviours) are returned unchanged.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

MAX_SHOWN_ERROR = 200  # characters of the parser's message put in the status details


class _Malformed:
    """Stands in for a request message whose bytes did not parse."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def details(self, method: str) -> str:
        reason = f"{type(self.error).__name__}: {self.error}"[:MAX_SHOWN_ERROR]
        return f"invalid request body for {method}: it does not parse as the method's message ({reason})"


def _safe_deserializer(deserialize: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as exc:  # DecodeError, RecursionError, UnicodeDecodeError, ...
            return _Malformed(exc)

    return parse


def _guard_unary(behavior: Callable[..., Any], method: str) -> Callable[..., Any] | None:
    if inspect.isasyncgenfunction(behavior):

        async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            if isinstance(request, _Malformed):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.details(method))
            async for response in behavior(request, context):
                yield response

        return unary_stream
    if inspect.iscoroutinefunction(behavior):

        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, _Malformed):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.details(method))
            return await behavior(request, context)

        return unary
    return None


async def _checked(
    requests: AsyncIterator[Any], context: grpc.aio.ServicerContext, method: str
) -> AsyncIterator[Any]:
    async for request in requests:
        if isinstance(request, _Malformed):
            context.set_code(grpc.StatusCode.INVALID_ARGUMENT)
            context.set_details(request.details(method))
            return
        yield request


def _guard_stream(behavior: Callable[..., Any], method: str) -> Callable[..., Any] | None:
    if inspect.isasyncgenfunction(behavior):

        async def stream_stream(requests: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async for response in behavior(_checked(requests, context, method), context):
                yield response

        return stream_stream
    if inspect.iscoroutinefunction(behavior):

        async def stream_unary(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            return await behavior(_checked(requests, context, method), context)

        return stream_unary
    return None


class MalformedRequestGuard(grpc.aio.ServerInterceptor):
    """Turns unparseable request bodies into INVALID_ARGUMENT for every method of a server."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler  # unknown method (UNIMPLEMENTED) or raw bytes in
        method = handler_call_details.method
        if handler.request_streaming:
            kind = "stream_stream" if handler.response_streaming else "stream_unary"
            guarded = _guard_stream(getattr(handler, kind), method)
        else:
            kind = "unary_stream" if handler.response_streaming else "unary_unary"
            guarded = _guard_unary(getattr(handler, kind), method)
        if guarded is None:
            return handler
        return handler._replace(
            request_deserializer=_safe_deserializer(handler.request_deserializer),
            **{kind: guarded},
        )
