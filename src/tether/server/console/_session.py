"""Who uses the console: an API key kept in an HttpOnly, SameSite=Strict cookie, and a
CSRF token every form posts back.

The cookie holds the key itself, so the console needs no session table and a revoked
key logs its sessions out on their next request. Pages are only readable by the
browser holding the cookie; a form's token is an HMAC of the cookie under a secret,
which another site can neither read nor compute; a POST without the right token is
refused even though SameSite already keeps the cookie off cross-site requests. The
secret is ``TETHER_CONSOLE_SECRET`` when set (give every replica behind a balancer the
same one, so a form served by one is accepted by another), else one per process.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets

from fastapi import Request

from ...store.base import Store
from .._auth import AuthError, Principal, authenticate

COOKIE = "tether_console"
_SECRET = (
    hashlib.sha256(os.environ["TETHER_CONSOLE_SECRET"].encode()).digest()
    if os.environ.get("TETHER_CONSOLE_SECRET")
    else secrets.token_bytes(32)
)


class LoginRequired(Exception):
    """The page needs a signed-in key (redirect to the login page)."""


async def principal_of(request: Request, store: Store, auth: bool) -> Principal | None:
    """The cookie's principal (None with auth off); ``LoginRequired`` without one."""
    if not auth:
        return None
    key = request.cookies.get(COOKIE)
    if not key:
        raise LoginRequired()
    try:
        return await authenticate(store, f"Bearer {key}")
    except AuthError as exc:
        raise LoginRequired() from exc


def csrf_token(request: Request) -> str:
    """The token this browser's forms must post back (``csrf`` field)."""
    basis = (request.cookies.get(COOKIE) or "anonymous").encode()
    return hmac.new(_SECRET, basis, hashlib.sha256).hexdigest()[:40]


def check_csrf(request: Request, token: str | None) -> None:
    """Refuse a POST whose token is not this browser's (403)."""
    if not token or not hmac.compare_digest(token, csrf_token(request)):
        raise AuthError(
            403,
            "CSRF check failed",
            "the form's token does not match this session: reload the page and try again",
        )
