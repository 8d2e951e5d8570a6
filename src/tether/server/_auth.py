"""API keys of the HTTP service: who calls, for which tenant, in which role.

A key is ``tether_<key id>.<secret>``; the store keeps only a SHA-256 of the secret
(secrets are 256 random bits, so a fast hash is enough). Each key has a role:

- ``monitor``: look at runs, histories and event streams without their payloads
  (inputs, results, arguments, signals, custom status, proposals and error messages
  are withheld; statuses, steps, times and error types are shown), for dashboards
  and people who must not see the data;
- ``read``: look at runs, histories, event streams, reviews and dead letters;
- ``operate``: also start, signal, cancel, suspend, resume and retry runs, decide
  reviews and replay dead letters;
- ``admin``: also terminate and fork runs.

A key bound to a tenant acts for that tenant only: runs it starts carry the tenant,
and another tenant's runs do not exist for it (404). Only an admin key may be unbound
(acting for every tenant). While no key exists (and ``--auth`` is not forced) the API
is open, for a service on a private network; the first key created closes it.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .._errors import RunNotFoundError, RunPurgedError
from ..store.base import Store

if TYPE_CHECKING:
    from .._app import App
    from .._history import RunInfo

ROLES = ("monitor", "read", "operate", "admin")
#: the role keys created before roles were split were called (it operates)
_LEGACY = {"client": "operate"}
PREFIX = "tether_"


class AuthError(Exception):
    """The request's credentials are missing, wrong or not enough (401 or 403), or its
    key is over its rate limit (429, with ``retry_after`` seconds)."""

    def __init__(
        self, status: int, title: str, detail: str, *, retry_after: int | None = None
    ) -> None:
        super().__init__(detail)
        self.status, self.title, self.detail = status, title, detail
        self.retry_after = retry_after


@dataclass(frozen=True, slots=True)
class Principal:
    """Who a request acts as."""

    key_id: str
    tenant: str | None
    role: str

    def sees(self, tenant: str | None) -> bool:
        """Whether a run of ``tenant`` exists for this key."""
        return self.tenant is None or tenant == self.tenant

    @property
    def sees_payloads(self) -> bool:
        """Whether this key may see what runs carry (every role but ``monitor``)."""
        return self.role != "monitor"

    def allows(self, role: str) -> bool:
        """Whether this key's role includes ``role`` (``operate`` includes ``read``)."""
        return ROLES.index(self.role) >= ROLES.index(role)

    def require(self, role: str, action: str) -> None:
        """Raise 403 unless this key's role includes ``role``."""
        if not self.allows(role):
            raise AuthError(
                403,
                f"{role.title()} key required",
                f"{action} needs a key with role {role} or above (this key: {self.role})",
            )


def actor_of(principal: Principal | None, where: str) -> str:
    """How the audit log names who acted: the key, or where (auth off)."""
    return f"key {principal.key_id}" if principal is not None else f"{where} (no auth)"


async def visible_run(
    app: App, principal: Principal | None, run_id: str, *, follow: bool = True
) -> RunInfo:
    """The run, if ``principal`` may see it (for the API and the console alike): to a
    tenant's key another tenant's run, and any purged run, is not found at all."""
    try:
        info = await app._peek(run_id, follow=follow)
    except RunPurgedError:
        if principal is not None and principal.tenant is not None:
            raise RunNotFoundError(run_id) from None  # whose it was is not theirs to know
        raise
    if principal is not None and not principal.sees(info.tenant):
        raise RunNotFoundError(run_id)  # another tenant's run does not exist for it
    return info


def _hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


async def create_key(
    store: Store, *, role: str, tenant: str | None, name: str | None = None
) -> tuple[str, str]:
    """Create a key; return (key id, the whole key). The key is shown once, never stored."""
    role = _LEGACY.get(role, role)
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)} (got {role!r})")
    if role not in ("admin", "monitor") and not tenant:  # a monitor sees no payloads
        article = "an" if role[0] in "aeiou" else "a"
        raise ValueError(f"{article} {role} key acts for one tenant: give --tenant")
    key_id = secrets.token_hex(6)
    secret = secrets.token_urlsafe(32)
    await store.create_api_key(key_id, _hash(secret), name, tenant, role)
    return key_id, f"{PREFIX}{key_id}.{secret}"


async def authenticate(store: Store, authorization: str | None) -> Principal:
    """The principal of an ``Authorization: Bearer <key>`` header, or ``AuthError``."""
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not token.startswith(PREFIX) or "." not in token:
        raise AuthError(
            401,
            "API key required",
            "send `Authorization: Bearer tether_...` with a key from `tether keys create`",
        )
    key_id, _, secret = token[len(PREFIX) :].partition(".")
    row = await store.api_key(key_id)
    if row is None or not hmac.compare_digest(row[1], _hash(secret)):
        raise AuthError(401, "Unknown API key", "this key does not exist in the store")
    if row[6] is not None:
        raise AuthError(401, "Revoked API key", f"key {key_id} was revoked")
    return Principal(key_id=key_id, tenant=row[3], role=_LEGACY.get(row[4], row[4]))
