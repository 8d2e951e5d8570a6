"""Request limits of the HTTP service: body size (413) and requests per key (429).

The rate limit is a token bucket per API key (per client address while auth is off),
kept in this process: with several ``tether serve`` processes behind a balancer each
enforces it on its own share of the traffic. Failed authentications (a wrong or missing
key, a refused console sign-in) have a bucket per client address too: beyond it a
failure is answered 429 instead of 401. The key is looked up before the bucket is asked,
so a valid key is never refused for other clients' failures from the same address.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..store.base import Store
from ._auth import AuthError, Principal, authenticate
from ._problems import PROBLEM


class RateLimiter:
    """``rate`` requests per second per key, in bursts of up to ``burst``."""

    def __init__(self, rate: float, burst: int | None = None) -> None:
        if rate <= 0:
            raise ValueError(f"rate limit must be positive (got {rate})")
        self.rate = rate
        self.burst = float(burst if burst is not None else max(1, math.ceil(rate)))
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, at)

    def take(self, key: str, now: float | None = None) -> float:
        """Take a token for ``key``: 0 if allowed, else seconds until one is free."""
        t = time.monotonic() if now is None else now
        tokens, at = self._buckets.get(key, (self.burst, t))
        tokens = min(self.burst, tokens + (t - at) * self.rate)
        if tokens >= 1:
            self._buckets[key] = (tokens - 1, t)
            return 0.0
        self._buckets[key] = (tokens, t)
        if len(self._buckets) > 100_000:  # forget idle keys (they are full again anyway)
            self._buckets = {k: v for k, v in self._buckets.items() if t - v[1] < 60}
        return (1 - tokens) / self.rate


async def authenticate_limited(
    store: Store, authorization: str | None, limiter: RateLimiter | None, client: str
) -> Principal:
    """``authenticate``, with failed attempts from ``client`` limited by ``limiter``
    (``rate`` a second per address): a failure beyond it is answered 429, not 401.

    The key is always looked up first: many clients can share one address (a proxy, a
    NAT), and one client's wrong keys must never lock out another's valid key. So a
    guess costs one key lookup (by primary key, like any request) even over the rate."""
    if limiter is None:
        return await authenticate(store, authorization)
    try:
        return await authenticate(store, authorization)
    except AuthError as exc:
        if exc.status != 401:
            raise
        wait = limiter.take(f"failed:{client}")
        if not wait:
            raise
        after = math.ceil(wait)
        raise AuthError(
            429,
            "Too many failed authentications",
            f"requests from {client} with wrong or missing keys are limited to "
            f"{limiter.rate:g}/s; retry after {after} s",
            retry_after=after,
        ) from exc


class BodyLimit:
    """ASGI middleware: a request body over ``max_bytes`` is refused with 413, whether
    it says its length up front or streams past the limit."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(send)
            return
        seen = 0
        started = False

        async def counting() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge(413, self._detail())
            return message

        async def tracking(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting, tracking)
        except _TooLarge:
            if not started:
                await self._refuse(send)

    def _detail(self) -> str:
        return (
            f"the body is over this service's limit of {self.max_bytes} bytes; "
            "send large documents by reference (a URL or a blob) instead"
        )

    async def _refuse(self, send: Send) -> None:
        body: dict[str, Any] = {
            "type": "about:blank",
            "title": "Request body too large",
            "status": 413,
            "detail": self._detail(),
        }
        data = json.dumps(body).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", PROBLEM.encode()),
                    (b"content-length", str(len(data)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": data})


class _TooLarge(HTTPException):
    """The streamed body passed the limit (an HTTPException, so that FastAPI's body
    reading passes it on rather than calling it a parse error)."""
