"""Errors as RFC 9457 problem documents (``application/problem+json``).

Every failure the API reports names what is wrong and what to do, with the HTTP
status that fits it; nothing answers with a stack trace.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .._errors import (
    AdmissionLimitError,
    ApprovalEditError,
    ApprovalError,
    ApprovalNotFoundError,
    ConfigurationError,
    DeadLetterNotFoundError,
    LeaseLostError,
    PayloadError,
    QueryError,
    RunFinishedError,
    RunIdConflictError,
    RunNotFoundError,
    RunPurgedError,
    ScheduleNotFoundError,
    SignalIdConflictError,
    StoreError,
    SwitchedOffError,
    TetherError,
    UnknownActivityError,
    UnknownWorkflowError,
    UpdateFailedError,
    UpdateRejectedError,
)
from ..blobs import BlobError
from ..encryption import KeyringMismatchError, KeyUnavailableError
from ..store.ops.recovery import RecoveryError
from ._auth import AuthError

PROBLEM = "application/problem+json"

log = logging.getLogger("tether.server")

#: tether's errors, most specific first: (type, HTTP status, title)
_MAP: list[tuple[type[BaseException], int, str]] = [
    (RunPurgedError, 410, "The run was purged"),
    (RunNotFoundError, 404, "No such run"),
    (ApprovalNotFoundError, 404, "No such review"),
    (DeadLetterNotFoundError, 404, "No such dead letter"),
    (ApprovalEditError, 422, "The edit is not of the shape the review takes (nothing recorded)"),
    (ApprovalError, 409, "The review cannot take this decision"),
    (UnknownWorkflowError, 404, "No such workflow"),
    (RunIdConflictError, 409, "Run id or idempotency key already used for other input"),
    (RunFinishedError, 409, "The run has finished"),
    (SwitchedOffError, 409, "Switched off by an operator"),
    (AdmissionLimitError, 429, "The tenant is at its limit of live runs"),
    (RecoveryError, 409, "The run cannot be recovered that way"),
    # a dead letter's replay in a service that does not load the activity's module
    (UnknownActivityError, 409, "The activity is not registered in this service"),
    (SignalIdConflictError, 409, "Id already used by another signal or update"),
    # the service cannot open a stored payload (its keyring lacks the key, or a blob is
    # gone), or may not seal one (its keyring does not match the store's): the
    # service's setup, not the request; the detail names the key id or the blob
    (KeyUnavailableError, 503, "Payload unavailable"),
    (KeyringMismatchError, 503, "Payload unavailable"),
    (BlobError, 503, "Payload unavailable"),
    (PayloadError, 400, "The input does not match the workflow's parameters"),
    (ScheduleNotFoundError, 404, "No such schedule"),
    (QueryError, 422, "The query could not be answered"),
    (UpdateRejectedError, 422, "The update was refused (nothing was recorded)"),
    (UpdateFailedError, 422, "The update's handler failed"),
    (ConfigurationError, 400, "Invalid request"),
]


#: seconds a start refused at a tenant's admission limit is told to wait (Retry-After)
ADMISSION_RETRY_AFTER = 5

#: seconds a request the store could not answer (an outage, a lost connection) is told
#: to wait before trying again (Retry-After)
STORE_RETRY_AFTER = 2

_HTTP_TITLES = {
    404: "Not found",
    405: "Method not allowed",
    413: "Request body too large",
    415: "Send JSON",
    429: "Too many requests",
}


#: what FastAPI says of a JSON body it could not decode (not UTF-8, say)
_UNPARSED = "There was an error parsing the body"


def problem(status: int, title: str, detail: str, **extra: Any) -> JSONResponse:
    """A problem document response."""
    body = {"type": "about:blank", "title": title, "status": status, "detail": detail, **extra}
    return JSONResponse(body, status_code=status, media_type=PROBLEM)


#: what a request cut off by the server's stop is told (``CutOffAtStop``)
CUT_OFF = (
    "the server stopped before this request was done (its --grace ran out while it "
    "waited, e.g. for its store), so it may or may not have taken effect: try again "
    "shortly (a request repeated with the same run_id or Idempotency-Key is safe)"
)


class CutOffAtStop:
    """ASGI middleware: a request the server cancels as it stops (uvicorn cancels the
    requests still open when its graceful-shutdown timeout, ``--grace``, runs out) is
    answered ``503`` with Retry-After, like a store that does not answer, instead of
    uvicorn's bare ``500 Internal Server Error``. ``stopping()`` says whether the server
    is stopping: a cancel at any other time is left as it is."""

    def __init__(self, app: ASGIApp, stopping: Callable[[], bool]) -> None:
        self.app = app
        self.stopping = stopping

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking)
        except asyncio.CancelledError:
            if started or not self.stopping():
                raise
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()  # answered here: the request's task ends normally
            log.warning(
                "request cut off as the server stops (%s %s): answered 503",
                scope.get("method"),
                scope.get("path"),
            )
            body = json.dumps(
                {
                    "type": "about:blank",
                    "title": "Service stopping",
                    "status": 503,
                    "detail": CUT_OFF,
                }
            ).encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": 503,
                    "headers": [
                        (b"content-type", PROBLEM.encode()),
                        (b"content-length", str(len(body)).encode()),
                        (b"retry-after", str(STORE_RETRY_AFTER).encode()),
                        (b"connection", b"close"),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": body})


#: seconds between two log lines of requests the store could not answer (an outage)
STORE_WARN_EVERY = 5.0


class _StoreWarnings:
    """Logs requests the store could not answer: the first at once, then at most one
    line per ``STORE_WARN_EVERY`` seconds saying how many more there were, so a busy
    client during an outage does not flood the log."""

    def __init__(self) -> None:
        self._last = -float("inf")
        self._since = 0

    def warn(self, method: str, path: str, exc: BaseException) -> None:
        now = time.monotonic()
        if now - self._last < STORE_WARN_EVERY:
            self._since += 1
            return
        more = f" (and {self._since} more since the last line)" if self._since else ""
        log.warning("store unavailable (%s %s)%s: %s", method, path, more, exc)
        self._last, self._since = now, 0


_store_warnings = _StoreWarnings()


def problem_of(exc: BaseException) -> tuple[int, str]:
    """The HTTP status and title tether's error ``exc`` is answered with."""
    for kind, status, title in _MAP:
        if isinstance(exc, kind):
            return status, title
    return 500, "tether error"


def install(api: FastAPI) -> None:
    """Answer tether's errors and request validation errors with problem documents."""

    async def on_tether(request: Request, exc: Exception) -> JSONResponse:
        if isinstance(exc, StoreError) and not isinstance(exc, LeaseLostError):
            # the store's message names its URL (host, port, user, database): the
            # operator's log gets it, the client a retryable 503 without it
            _store_warnings.warn(request.method, request.url.path, exc)
            response = problem(
                503,
                "Store unavailable",
                # (said by StoreOpening.check: no request reached the store)
                f"the service cannot open its store: {exc.permanent}"
                if exc.permanent
                else "the service could not reach its store, so the request may or may not "
                "have taken effect: try again shortly (a start repeated with the same "
                "run_id or idempotency key is safe)",
            )
            response.headers["Retry-After"] = str(STORE_RETRY_AFTER)
            return response
        status, title = problem_of(exc)
        response = problem(status, title, str(exc))
        if isinstance(exc, AdmissionLimitError):
            response.headers["Retry-After"] = str(ADMISSION_RETRY_AFTER)
        return response

    async def on_validation(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        errors = [
            {"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")}
            for e in exc.errors()
        ]
        if any(e["type"] == "json_invalid" for e in errors):
            return problem(
                400,
                "Malformed JSON",
                "the request body is not valid JSON: "
                + "; ".join(str(e["msg"]) for e in errors if e["type"] == "json_invalid"),
                errors=errors,
            )
        first = errors[0] if errors else {"loc": [], "msg": "invalid request"}
        where = ".".join(str(p) for p in first["loc"])
        return problem(
            422,
            "The request does not match the API's schema",
            f"{where}: {first['msg']} (see the OpenAPI document at /openapi.json)",
            errors=errors,
        )

    async def on_auth(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, AuthError)
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else {}
        if exc.retry_after is not None:
            headers["Retry-After"] = str(exc.retry_after)
        response = problem(exc.status, exc.title, exc.detail)
        response.headers.update(headers)
        return response

    async def on_http(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        title = _HTTP_TITLES.get(exc.status_code, "HTTP error")
        detail = exc.detail if isinstance(exc.detail, str) else title
        if exc.status_code == 400 and detail == _UNPARSED:  # not UTF-8, or not text
            title = "Malformed JSON"
            detail = "the request body is not JSON text: send JSON encoded as UTF-8"
        response = problem(exc.status_code, title, detail)
        response.headers.update(exc.headers or {})
        return response

    api.add_exception_handler(StarletteHTTPException, on_http)
    api.add_exception_handler(TetherError, on_tether)
    api.add_exception_handler(AuthError, on_auth)
    api.add_exception_handler(RequestValidationError, on_validation)
