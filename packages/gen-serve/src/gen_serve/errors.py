"""Errors in OpenAI's shape, as vLLM's server answers them: ``{"error": {message, type, param,
code}}`` with the HTTP status in ``code``; every malformed request is a 400, never a 422.

A failure worth retrying (the server full or shutting down, a backend's ``retryable`` error:
``RowLostError``, ``NoReplicaServingError``) is a 503 with a ``Retry-After`` header, which the
``openai`` client and most HTTP clients honour."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from gen_interface import (
    BackendBrokenError,
    GenerationConfigError,
    GenerationError,
    GenerationInputError,
    NoReplicaServingError,
    RowLostError,
    StaleWeightsError,
    WeightsAbsentError,
    WeightUpdateError,
)
from starlette.exceptions import HTTPException as StarletteHTTPException

__all__ = ["ApiError", "error_body", "install_error_handlers", "retry_after_of", "status_of"]

logger = logging.getLogger(__name__)

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    409: "ConflictError",
    413: "RequestTooLargeError",
    429: "RateLimitError",
    500: "InternalServerError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
}

#: Seconds a client should wait before retrying, by cause: a lost row can run again at once on
#: the replicas left; a fleet with no replica serving needs a replacement admitted first.
RETRY_LOST_ROW_S = 1
RETRY_NO_REPLICA_S = 5


class ApiError(Exception):
    """A request the server answers with ``status`` and an OpenAI error object.

    Args:
        status: the HTTP status.
        message: what went wrong and what to do.
        param: the request field at fault, if one is.
        retry_after: seconds a client should wait before retrying, sent as ``Retry-After``
            (None: not worth retrying unchanged).
    """

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        *,
        retry_after: int | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.retry_after = retry_after


def error_body(
    status: int, message: str, param: str | None = None, exc: BaseException | None = None
) -> dict[str, Any]:
    """OpenAI's error object; for a backend's error also ``gen_error``, the name of its
    ``gen_interface`` error class, so that a client of this project raises the same type, and
    for ``RowLostError`` ``rows``, the indices in the request of the rows lost."""
    body: dict[str, Any] = {
        "message": message,
        "type": _TYPES.get(status, "Error"),
        "param": param,
        "code": status,
    }
    if isinstance(exc, GenerationError):
        body["gen_error"] = _interface_class(exc)
    if isinstance(exc, RowLostError):
        body["rows"] = [int(row) for row in exc.rows]
    return {"error": body}


def _interface_class(exc: GenerationError) -> str:
    """The most derived class of ``exc`` that ``gen_interface`` itself defines."""
    for cls in type(exc).__mro__:
        if cls.__module__ == "gen_interface.errors":
            return cls.__name__
    return "GenerationError"


def status_of(exc: BaseException) -> int:
    """The HTTP status of a backend's error: what the client did wrong is 4xx, what is worth
    retrying (``retry_after_of``) 503."""
    if isinstance(exc, ApiError):
        return exc.status
    if retry_after_of(exc) is not None:
        return 503
    if isinstance(exc, GenerationInputError | GenerationConfigError | ValueError):
        return 400
    if isinstance(exc, StaleWeightsError):
        return 409
    if isinstance(exc, WeightsAbsentError):
        return 503
    if isinstance(exc, NotImplementedError):
        return 501
    if isinstance(exc, WeightUpdateError) and not isinstance(exc, BackendBrokenError):
        return 409
    return 500


def retry_after_of(exc: BaseException) -> int | None:
    """Seconds to wait before retrying the request that failed with ``exc``; None when a retry
    unchanged would fail the same way."""
    if isinstance(exc, ApiError):
        return exc.retry_after
    if isinstance(exc, NoReplicaServingError):
        return RETRY_NO_REPLICA_S
    if isinstance(exc, RowLostError) or getattr(exc, "retryable", False) is True:
        return RETRY_LOST_ROW_S
    return None


def _json(
    status: int, message: str, param: str | None = None, exc: BaseException | None = None
) -> JSONResponse:
    retry_after = retry_after_of(exc) if exc is not None else None
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return JSONResponse(
        error_body(status, message, param, exc), status_code=status, headers=headers
    )


def install_error_handlers(app: FastAPI) -> None:
    """Answer every failure with the OpenAI error shape; nothing leaves the server as a trace."""

    async def api_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ApiError)
        return _json(exc.status, exc.message, exc.param, exc)

    async def validation_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
        message = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg')}"
            for e in errors[:10]
        )
        return _json(400, f"{len(errors)} validation error(s): {message}", loc or None)

    async def http_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        return _json(exc.status_code, str(exc.detail))

    async def generation_error(_: Request, exc: Exception) -> JSONResponse:
        status = status_of(exc)
        if status >= 500:
            logger.error("request failed: %s", exc)
        return _json(status, str(exc), exc=exc)

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    for error in (GenerationError, ValueError, NotImplementedError):
        app.add_exception_handler(error, generation_error)
