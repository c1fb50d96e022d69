"""The one place where exceptions become gRPC status codes."""

from __future__ import annotations

import asyncio
import logging

import grpc

from frontend_service.discovery import InvalidTargetError
from frontend_service.engine_client import EngineUnavailableError, TokenizerMismatchError
from frontend_service.engine_group import EngineExistsError, EngineNotFoundError
from tandem.protocol.convert import ConversionError, EngineDeadError
from tandem.protocol.sampling_params import InvalidRequestError

logger = logging.getLogger(__name__)


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """Map an exception to (status code, message) for the client."""
    if isinstance(exc, InvalidRequestError | ConversionError | InvalidTargetError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, EngineUnavailableError | EngineDeadError):
        return grpc.StatusCode.UNAVAILABLE, str(exc)
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


async def abort_with(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """End the RPC with the status that fits ``exc`` (raises, as context.abort does)."""
    code, message = status_for(exc)
    await context.abort(code, message)
