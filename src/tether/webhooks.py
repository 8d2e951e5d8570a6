"""Signed webhooks: how ``tether serve`` signs a run's outcome, and how a receiver checks it.

A run started with a webhook URL gets one POST of its outcome when it ends. The
delivery is queued in the commit that ends the run and posted at least once, so a
receiver must dedupe by the ``webhook-id`` header (the same for every retry of one
delivery: ``"{run id}:{delivery number}"``, the run id percent-encoded so the header
is ASCII). Each post is signed with HMAC-SHA256 over ``"{id}.{timestamp}.{body}"``
(the id as the header carries it) under a shared secret (the Standard Webhooks
scheme, so receivers in other languages can use that ecosystem's libraries)::

    from tether.webhooks import verify, WebhookError

    try:
        outcome = verify(secret, request.body, request.headers)
    except WebhookError:
        return 400

Secrets look like ``whsec_<base64>``; ``new_secret()`` makes one.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote, urlsplit

from ._errors import ConfigurationError

__all__ = ["WebhookError", "check_webhook_url", "new_secret", "sign", "verify"]

#: how far a delivery's timestamp may be from the receiver's clock (replayed posts fail)
TOLERANCE = 300.0
_PREFIX = "whsec_"
#: what a run id keeps unencoded in ``webhook-id`` (besides letters, digits and ``_.-~``)
_ID_SAFE = "/:@!$&'()*+,;="


class WebhookError(Exception):
    """A delivery that does not verify: wrong signature, stale timestamp, missing headers."""


def new_secret() -> str:
    """A fresh signing secret (``whsec_`` and 32 random bytes in base64)."""
    return _PREFIX + base64.b64encode(secrets.token_bytes(32)).decode()


def _key(secret: str) -> bytes:
    if secret.startswith(_PREFIX):
        try:
            return base64.b64decode(secret[len(_PREFIX) :], validate=True)
        except ValueError as exc:
            raise ConfigurationError(
                "webhook secret starts with whsec_ but is not base64 after it: "
                "make one with tether.webhooks.new_secret()"
            ) from exc
    return secret.encode()


def _signature(secret: str, delivery_id: str, timestamp: int, body: bytes) -> str:
    signed = f"{delivery_id}.{timestamp}.".encode() + body
    digest = hmac.new(_key(secret), signed, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def sign(
    secret: str, delivery_id: str, body: bytes, timestamp: int | None = None
) -> dict[str, str]:
    """The headers that sign ``body`` as delivery ``delivery_id``."""
    ts = int(time.time()) if timestamp is None else timestamp
    return {
        "webhook-id": delivery_id,
        "webhook-timestamp": str(ts),
        "webhook-signature": _signature(secret, delivery_id, ts, body),
    }


def verify(
    secret: str,
    body: bytes | str,
    headers: Mapping[str, str],
    *,
    tolerance: float = TOLERANCE,
    now: float | None = None,
) -> dict[str, Any]:
    """The delivery's JSON body, if ``headers`` sign exactly ``body`` with ``secret``
    and its timestamp is within ``tolerance`` seconds; else ``WebhookError``."""
    raw = body.encode() if isinstance(body, str) else body
    lower = {k.lower(): v for k, v in headers.items()}
    try:
        delivery_id = lower["webhook-id"]
        ts = int(lower["webhook-timestamp"])
        given = lower["webhook-signature"]
    except (KeyError, ValueError) as exc:
        raise WebhookError(
            "missing or malformed webhook-id, webhook-timestamp or webhook-signature header"
        ) from exc
    clock = time.time() if now is None else now
    if abs(clock - ts) > tolerance:
        raise WebhookError(
            f"timestamp {ts} is more than {tolerance:g} s from now: stale or replayed"
        )
    expected = _signature(secret, delivery_id, ts, raw)
    # several space-separated signatures may be sent while a secret is rotated
    if not any(hmac.compare_digest(expected, s) for s in given.split()):
        raise WebhookError("signature does not match the body: tampered, or another secret")
    try:
        out: dict[str, Any] = json.loads(raw)
    except ValueError as exc:
        raise WebhookError("body is not JSON") from exc
    return out


def _delivery_id(run_id: str, number: int) -> str:
    """The ``webhook-id`` of a run's delivery: ``"{run id}:{number}"``, the run id
    percent-encoded (as UTF-8) where it is not plain ASCII or would not be one token:
    a header carries ASCII only, and ``verify`` checks the id as the header carries it."""
    return f"{quote(run_id, safe=_ID_SAFE)}:{number}"


def check_webhook_url(url: str) -> str:
    """``url`` if an absolute http(s) URL with a host and a port in 1-65535 that an HTTP
    client can post to, else ``ConfigurationError`` saying why."""
    try:
        parts = urlsplit(url) if isinstance(url, str) else None
        port = None if parts is None else parts.port
    except ValueError as exc:  # a port that is no number or above 65535, a bad IPv6 host
        raise ConfigurationError(
            f"webhook must be an http(s) URL with a port in 1-65535 ({exc}; got {url!r})"
        ) from None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigurationError(
            f"webhook must be an absolute http:// or https:// URL with a host (got {url!r})"
        )
    if port == 0:
        raise ConfigurationError(f"webhook URL's port must be in 1-65535 (got {url!r})")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in url) or any(
        c.isspace() for c in parts.hostname
    ):
        raise ConfigurationError(
            f"webhook URL holds a control character or a space in its host (got {url!r})"
        )
    if not parts.hostname.isascii():
        try:
            parts.hostname.encode("idna")
        except UnicodeError as exc:
            raise ConfigurationError(
                f"webhook URL's host is no valid domain name ({exc}; got {url!r})"
            ) from None
    return url
