"""Error classification: is a failure worth retrying, and when?

One function decides for every activity failure, so the rules are in one place:

* ``tether.NonRetryable`` and the policy's ``non_retryable`` types: permanent.
* ``tether.RetryAfter(seconds)``: transient, retry after exactly that long.
* HTTP errors (anything carrying ``status_code``, or a ``response`` with one, as
  httpx, requests and model SDKs raise): 408, 425, 429 and 5xx are transient;
  other 4xx (400, 401, 403, 404, 422, ...) are permanent. A ``Retry-After``
  header (seconds or an HTTP date) or a ``retry_after`` attribute sets the delay.
* Timeouts and connection errors: transient.
* Validation errors (pydantic) and content-policy refusals: permanent — the
  same input gets the same answer.
* Anything else: transient, bounded by the policy's attempts and elapsed time.
"""

from __future__ import annotations

import email.utils
import math
import time
from dataclasses import dataclass
from typing import Any

from ._errors import NonRetryable, TetherError

TRANSIENT_STATUS = frozenset({408, 425, 429})


class RetryAfter(TetherError):
    """Raise from an activity to retry it after ``seconds`` (overrides the backoff)."""

    def __init__(self, seconds: float, message: str | None = None) -> None:
        self.retry_after = float(seconds)
        super().__init__(message or f"retry requested after {seconds}s")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.retry_after, str(self)))


@dataclass(frozen=True, slots=True)
class Verdict:
    """The classification of one failure."""

    retryable: bool
    reason: str  #: short, for history and dead letters
    retry_after: float | None = None  #: seconds the caller asked us to wait


def http_status(exc: BaseException) -> int | None:
    """The HTTP status an exception (or its ``response``) carries, if any."""
    for obj in (exc, getattr(exc, "response", None)):
        if obj is None:
            continue
        for attr in ("status_code", "status"):
            value = getattr(obj, attr, None)
            if isinstance(value, int) and 100 <= value <= 599:
                return value
    return None


#: the longest wait tether takes from what a server says (a day): a date in the year 9999
#: or a reset a million hours away would pause a step, or every call of a model, for ever
MAX_WAIT = 86_400.0


def _seconds(value: float) -> float | None:
    """A wait a server asked for, held to 0..MAX_WAIT; None when it is not a finite
    number (``inf``, ``nan``, ``1e400``: garbage, never a pause that would last for ever)."""
    return min(MAX_WAIT, max(0.0, value)) if math.isfinite(value) else None


def parse_retry_after(value: Any, now: float | None = None) -> float | None:
    """Seconds to wait from a Retry-After value: a number of seconds or an HTTP date."""
    if value is None:
        return None
    if isinstance(value, int | float):
        return _seconds(float(value))
    text = str(value).strip()
    try:
        return _seconds(float(text))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError):
        return None
    return _seconds(when.timestamp() - (now if now is not None else time.time()))


def _retry_after(exc: BaseException, now: float | None) -> float | None:
    direct = getattr(exc, "retry_after", None)
    if direct is not None:
        return parse_retry_after(direct, now)
    response = getattr(exc, "response", None)
    headers = getattr(response, "headers", None) or getattr(exc, "headers", None)
    if headers is not None:
        try:
            raw = headers.get("retry-after") or headers.get("Retry-After")
        except Exception:
            raw = None
        return parse_retry_after(raw, now)
    return None


def _is_content_refusal(exc: BaseException) -> bool:
    code = str(getattr(exc, "code", "") or "").lower()
    if code in {"content_filter", "content_policy_violation"}:
        return True
    name = type(exc).__name__.lower()
    if "contentpolicy" in name or "contentfilter" in name or "refusal" in name:
        return True
    text = str(exc).lower()
    return "content_policy" in text or "content policy" in text or "content_filter" in text


def classify(
    exc: BaseException,
    non_retryable: tuple[type[BaseException], ...] = (),
    now: float | None = None,
) -> Verdict:
    """Classify ``exc`` as transient (retry, maybe after a given delay) or permanent."""
    if isinstance(exc, NonRetryable):
        return Verdict(False, "non-retryable")
    if non_retryable and isinstance(exc, non_retryable):
        return Verdict(False, f"{type(exc).__name__} is listed as non-retryable")
    if isinstance(exc, RetryAfter):
        # the activity's own word, taken as asked (even beyond MAX_WAIT); not a number
        # (nan, inf) falls back to the backoff, as a server's would
        asked = exc.retry_after
        return Verdict(True, str(exc), max(0.0, asked) if math.isfinite(asked) else None)
    status = http_status(exc)
    if status is not None:
        after = _retry_after(exc, now)
        if status in TRANSIENT_STATUS or status >= 500:
            return Verdict(True, f"HTTP {status}", after)
        if 400 <= status < 500:
            return Verdict(False, f"HTTP {status}")
    if _is_content_refusal(exc):
        return Verdict(False, "content-policy refusal")
    if isinstance(exc, TimeoutError | ConnectionError):
        return Verdict(True, type(exc).__name__, _retry_after(exc, now))
    try:
        import pydantic

        if isinstance(exc, pydantic.ValidationError):
            return Verdict(False, "validation error")
    except ImportError:  # pragma: no cover - pydantic is a dependency
        pass
    return Verdict(True, type(exc).__name__, _retry_after(exc, now))


_RESET_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_reset(value: Any) -> float | None:
    """Seconds from an ``x-ratelimit-reset-*`` value: ``"20ms"``, ``"6m0s"``, ``"1.5"``."""
    if value is None:
        return None
    if isinstance(value, int | float):
        return _seconds(float(value))
    text = str(value).strip().lower()
    try:
        return _seconds(float(text))
    except ValueError:
        pass
    total, num, i = 0.0, "", 0
    while i < len(text):
        ch = text[i]
        if ch.isdigit() or ch == ".":
            num += ch
            i += 1
            continue
        unit = "ms" if text.startswith("ms", i) else ch
        if unit not in _RESET_UNITS or not num:
            return None
        try:
            total += float(num) * _RESET_UNITS[unit]
        except ValueError:
            return None
        num, i = "", i + len(unit)
    if num:  # trailing bare number: seconds
        return None
    return _seconds(total)


def _headers(obj: Any) -> Any:
    for holder in (getattr(obj, "response", None), obj):
        headers = getattr(holder, "headers", None)
        if headers is not None and hasattr(headers, "get"):
            return headers
    return None


def ratelimit_pause(obj: Any) -> float | None:
    """Seconds to stop calling a dependency, from the rate-limit headers on ``obj``.

    ``obj`` is an exception (its ``response.headers`` or ``headers``) or a value an
    activity returned (same attributes). A budget reported exhausted
    (``x-ratelimit-remaining-requests`` or ``-tokens`` equal to 0) gives the time
    until its ``x-ratelimit-reset-requests`` / ``-tokens``. None: nothing to wait.
    """
    headers = _headers(obj)
    if headers is None:
        return None
    waits: list[float] = []
    for budget in ("requests", "tokens"):
        # the reset is looked up only for a budget reported exhausted (every successful
        # model step asks: a header lookup scans the response's headers)
        try:
            remaining = headers.get(f"x-ratelimit-remaining-{budget}")
        except Exception:
            continue
        if remaining is None:
            continue
        try:
            left = float(str(remaining).strip())
        except ValueError:
            continue
        if not left <= 0:
            continue
        try:
            reset = headers.get(f"x-ratelimit-reset-{budget}")
        except Exception:
            continue
        seconds = parse_reset(reset)
        if seconds:
            waits.append(seconds)
    return max(waits) if waits else None
