"""The one place where exceptions become gRPC status codes.

A ``RequestFailedError`` (an engine's ``RequestError``, or the frontend's own bound or
deadline) keeps its code. With a retry hint (RESOURCE_EXHAUSTED) the status also
carries it twice: as ``google.rpc.RetryInfo`` in the rich status details
(``grpc-status-details-bin``, read with ``grpc_status.rpc_status.from_call``), and as
the ``grpc-retry-pushback-ms`` trailer that gRPC clients' retry policies honour.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from google.protobuf import duration_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from frontend_service.admission import RequestFailedError
from frontend_service.discovery import InvalidTargetError
from frontend_service.engine_client import (
    EngineUnavailableError,
    TokenizerMismatchError,
    UtilityCallError,
)
from frontend_service.engine_group import EngineExistsError, EngineNotFoundError
from tandem.protocol.convert import ConversionError, EngineDeadError
from tandem.protocol.sampling_params import InvalidRequestError

logger = logging.getLogger(__name__)

RETRY_PUSHBACK_KEY = "grpc-retry-pushback-ms"
_CODES_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """Map an exception to (status code, message) for the client."""
    if isinstance(exc, RequestFailedError):
        return _CODES_BY_NUMBER.get(int(exc.code), grpc.StatusCode.INTERNAL), exc.error.message
    if isinstance(exc, InvalidRequestError | ConversionError | InvalidTargetError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, EngineUnavailableError | EngineDeadError):
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    if isinstance(exc, MemoryError):  # a size no validation foresaw: too big, not a bug
        return grpc.StatusCode.RESOURCE_EXHAUSTED, "the request needs more memory than the server has"
    if isinstance(exc, UtilityCallError):
        if exc.invalid:
            return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
        if exc.precondition:
            return grpc.StatusCode.FAILED_PRECONDITION, str(exc)
        return grpc.StatusCode.INTERNAL, str(exc)
    if isinstance(exc, EngineExistsError):
        return grpc.StatusCode.ALREADY_EXISTS, str(exc)
    if isinstance(exc, EngineNotFoundError):
        return grpc.StatusCode.NOT_FOUND, str(exc)
    if isinstance(exc, TokenizerMismatchError):
        return grpc.StatusCode.FAILED_PRECONDITION, str(exc)
    if isinstance(exc, asyncio.CancelledError):
        return grpc.StatusCode.CANCELLED, "the request was cancelled"
    if isinstance(exc, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded"
    logger.exception("internal error", exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


def retry_after_ms_for(exc: BaseException) -> int:
    """The retry hint that goes with ``exc``'s status in milliseconds; 0: none."""
    if isinstance(exc, RequestFailedError):
        return max(exc.error.retry_after_ms, 0)
    return 0


def trailing_metadata_for(
    code: grpc.StatusCode, message: str, retry_after_ms: int
) -> tuple[tuple[str, str | bytes], ...]:
    """RetryInfo in the rich status details, and the pushback trailer (ms as text)."""
    seconds, millis = divmod(retry_after_ms, 1000)
    retry = error_details_pb2.RetryInfo(
        retry_delay=duration_pb2.Duration(seconds=seconds, nanos=millis * 1_000_000)
    )
    status = status_pb2.Status(code=code.value[0], message=message)
    status.details.add().Pack(retry)
    rich = rpc_status.to_status(status)
    return (*rich.trailing_metadata, (RETRY_PUSHBACK_KEY, str(retry_after_ms)))


async def abort_with(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """End the RPC with the status that fits ``exc`` (raises, as context.abort does)."""
    code, message = status_for(exc)
    retry_after_ms = retry_after_ms_for(exc)
    if retry_after_ms:
        await context.abort(code, message, trailing_metadata_for(code, message, retry_after_ms))
    await context.abort(code, message)
