"""Every way a VllmEngine call fails, as the status code its clients act on (one place).

SMG reads them so: INVALID_ARGUMENT -> HTTP 400, not retried; RESOURCE_EXHAUSTED ->
429, retried on another worker without counting against this one; UNAVAILABLE /
INTERNAL / DEADLINE_EXCEEDED -> retried, and fed to its circuit breaker.
"""

from __future__ import annotations

import grpc

from tandem.protocol.outputs import ErrorCode, RequestError
from tandem.protocol.sampling_params import InvalidRequestError

_CODES = {
    ErrorCode.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
    ErrorCode.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorCode.INTERNAL: grpc.StatusCode.INTERNAL,
    ErrorCode.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
}


class CallFailed(Exception):
    """Ends a call with ``code`` and ``message`` (raised inside the servicer)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    @classmethod
    def from_request_error(cls, error: RequestError | None, fallback: str) -> CallFailed:
        """A request the engine ended with FinishReason.ERROR (``error`` None: INTERNAL)."""
        if error is None:
            return cls(grpc.StatusCode.INTERNAL, fallback)
        return cls(_CODES.get(error.code, grpc.StatusCode.INTERNAL), error.message)

    @classmethod
    def unavailable(cls, message: str) -> CallFailed:
        return cls(grpc.StatusCode.UNAVAILABLE, message)


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The (code, message) a failed call ends with."""
    if isinstance(exc, CallFailed):
        return exc.code, exc.message
    if isinstance(exc, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"


async def abort_with(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    code, message = status_of(exc)
    await context.abort(code, message)
