"""The server's answers as the interface's errors: a trainer catches the same types over HTTP as
it would in process.

A gen-serve server names the ``gen_interface`` error class of every backend error
(``error.gen_error``): the client raises that class with the server's message (and, for
``RowLostError``, the rows it names). Other errors, and
vLLM's own server, are mapped by status: 400 is the caller's input, 409 a refused weight update,
501 a capability the server lacks, anything else a failed call. A server that cannot be reached
is ``BackendUnavailableError``; one that stops answering or drops the connection mid-call is a
``GenerationError``. Neither marks the client broken: once a server answers again on the same
address, the next call goes through.
"""

from __future__ import annotations

from typing import Any

import httpx
from gen_interface import (
    BackendUnavailableError,
    GenerationConfigError,
    GenerationError,
    GenerationInputError,
    RowLostError,
    WeightUpdateError,
)
from gen_interface import errors as interface_errors

__all__ = ["error_from_answer", "error_from_transport"]

_BY_STATUS: dict[int, type[GenerationError]] = {
    400: GenerationInputError,
    401: GenerationConfigError,
    403: GenerationConfigError,
    404: GenerationConfigError,
    409: WeightUpdateError,
    413: GenerationInputError,
    422: GenerationInputError,
}


def error_from_answer(status: int, body: Any, where: str) -> Exception:
    """The error a server's ``status`` and error ``body`` stand for.

    Args:
        status: the HTTP status (an error inside a stream carries its own ``code``).
        body: the parsed JSON answer (OpenAI's ``{"error": {...}}``), or its text.
        where: the server and route, for the message.
    """
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        message = str(error.get("message") or error)
        code = error.get("code")
        status = code if isinstance(code, int) else status  # a streamed error says its own
        named = error.get("gen_error")
    else:
        message, named = (str(body)[:2000] or f"HTTP {status}"), None
    text = f"{message} ({where} answered {status})"
    cls = getattr(interface_errors, named, None) if isinstance(named, str) else None
    if cls is RowLostError:  # the rows it names, as the server sent them
        rows = error.get("rows") if isinstance(error, dict) else None
        lost = tuple(int(r) for r in rows) if isinstance(rows, list) else ()
        return RowLostError(text, lost)
    if isinstance(cls, type) and issubclass(cls, GenerationError):
        return cls(text)
    if status == 501:
        return NotImplementedError(text)
    return _BY_STATUS.get(status, GenerationError)(text)


def error_from_transport(exc: httpx.HTTPError, where: str, timeout_s: float | None) -> Exception:
    """The error of a call that got no (complete) answer."""
    if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
        return BackendUnavailableError(
            f"cannot reach the generation server at {where}: {exc or type(exc).__name__}. Is it "
            "running, and is remote_cfg.base_url its address?"
        )
    if isinstance(exc, httpx.TimeoutException):
        return GenerationError(
            f"the generation server at {where} sent nothing for {timeout_s} s "
            "(remote_cfg.timeout_s); the call was dropped"
        )
    return GenerationError(
        f"the connection to the generation server at {where} broke mid-call "
        f"({type(exc).__name__}: {exc}); the server may have stopped. Its rows of this call are "
        "lost; call again once it answers"
    )
