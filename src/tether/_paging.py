"""What the listing calls (``app.list``, ``app.usage``, ``app.dead_letters``...) accept
as page sizes, offsets, keyset cursors and time floors.

Checked before anything reaches the store: a negative limit meant "no limit" to
SQLite and "none" elsewhere, a NaN floor matched nothing, and a float limit failed
deep in the store with "datatype mismatch". Each is now one error naming the value.
"""

from __future__ import annotations

import datetime as _dt
import math
from typing import Any

from ._errors import ConfigurationError
from ._history import INT64_MAX

#: the most rows one listing call returns (the CLI's ``--limit`` has the same bound)
MAX_PAGE = 1_000_000


def check_limit(value: Any, what: str = "limit") -> int:
    """A page size: a whole number from 0 to ``MAX_PAGE``."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_PAGE:
        raise ConfigurationError(
            f"{what} must be a whole number from 0 to {MAX_PAGE:,} (got {value!r})"
        )
    return value


def check_offset(value: Any, what: str = "offset") -> int:
    """Rows to skip: a whole number from 0 (64-bit)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= INT64_MAX:
        raise ConfigurationError(f"{what} must be a whole number, 0 or more (got {value!r})")
    return value


def check_time(value: Any, what: str) -> float | None:
    """A point in time as epoch seconds: a finite number, or an aware datetime (a naive
    one would be read in this machine's time zone, which the caller may not share)."""
    if value is None:
        return None
    if isinstance(value, _dt.datetime):
        if value.tzinfo is None or value.utcoffset() is None:
            raise ConfigurationError(
                f"{what}={value!r} has no time zone: pass an aware datetime "
                "(e.g. datetime.now(timezone.utc)) or epoch seconds"
            )
        return value.timestamp()
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigurationError(
            f"{what} must be epoch seconds (a finite number) or an aware datetime (got {value!r})"
        )
    return float(value)


def check_cursor(value: Any) -> tuple[float, str] | None:
    """A keyset cursor ``(created_at, run_id)`` of the last row of the previous page."""
    if value is None:
        return None
    if not isinstance(value, tuple | list) or len(value) != 2 or not isinstance(value[1], str):
        raise ConfigurationError(
            "before must be the (created_at, run_id) of the previous page's last run "
            f"(got {value!r})"
        )
    at = check_time(value[0], "before's created_at")
    assert at is not None
    return at, value[1]
