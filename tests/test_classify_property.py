"""Properties of how tether reads what a provider says about waiting and failing.

A server's headers and errors are input tether does not control: a proxy may send any
text. Whatever it sends, the wait tether takes from it is None (use the backoff) or a
finite number of seconds in 0..MAX_WAIT, and classifying the failure never raises.
"""

from __future__ import annotations

import math
import time
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from tether._classify import (
    MAX_WAIT,
    RetryAfter,
    classify,
    parse_reset,
    parse_retry_after,
    ratelimit_pause,
)

NOW = time.time()

#: what a header may hold: numbers in any form, durations, HTTP dates, any text
header_text = st.one_of(
    st.text(max_size=40),
    st.from_regex(r"\A-?[0-9]{1,30}(\.[0-9]{0,20})?(e[+-]?[0-9]{1,4})?\Z"),
    st.from_regex(r"\A([0-9]{1,12}(\.[0-9]{1,6})?(ms|s|m|h)){1,4}\Z"),
    st.sampled_from(["inf", "-inf", "nan", "Infinity", "1e400", "-0", "0x10", "1_000"]),
    st.datetimes().map(lambda d: d.strftime("%a, %d %b %Y %H:%M:%S GMT")),
)
header_value = st.one_of(
    header_text,
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.none(),
)


def _a_wait(value: float | None) -> bool:
    return value is None or (
        isinstance(value, float) and math.isfinite(value) and 0.0 <= value <= MAX_WAIT
    )


@settings(max_examples=400, deadline=None)
@given(header_value)
def test_a_retry_after_header_is_a_bounded_wait_or_none(value: Any) -> None:
    assert _a_wait(parse_retry_after(value, NOW))


@settings(max_examples=400, deadline=None)
@given(header_value)
def test_a_ratelimit_reset_header_is_a_bounded_wait_or_none(value: Any) -> None:
    assert _a_wait(parse_reset(value))


class _Response:
    def __init__(self, status: Any, headers: dict[str, Any]) -> None:
        self.status_code = status
        self.headers = headers


class _ProviderError(Exception):
    def __init__(self, status: Any, headers: dict[str, Any], code: Any) -> None:
        super().__init__("provider said no")
        self.response = _Response(status, headers)
        self.code = code


names = st.sampled_from(
    [
        "retry-after",
        "Retry-After",
        "x-ratelimit-remaining-requests",
        "x-ratelimit-reset-requests",
        "x-ratelimit-remaining-tokens",
        "x-ratelimit-reset-tokens",
    ]
)


@settings(max_examples=400, deadline=None)
@given(
    status=st.one_of(st.integers(-1000, 1000), st.text(max_size=5), st.none(), st.booleans()),
    headers=st.dictionaries(names, header_value, max_size=6),
    code=st.one_of(st.none(), st.text(max_size=20), st.integers()),
)
def test_classifying_any_provider_error_gives_a_verdict_and_bounded_waits(
    status: Any, headers: dict[str, Any], code: Any
) -> None:
    exc = _ProviderError(status, headers, code)
    verdict = classify(exc, now=NOW)
    assert isinstance(verdict.retryable, bool) and verdict.reason
    assert _a_wait(verdict.retry_after)
    assert _a_wait(ratelimit_pause(exc))


def test_a_wait_far_beyond_reason_is_held_to_the_bound_not_taken_as_asked() -> None:
    """A date in the year 9999 or a reset of a million hours would pause a step, or every
    call of a model, for ever: it is held to MAX_WAIT (a day), and a reasonable wait is
    taken as it is."""
    assert parse_retry_after("Fri, 31 Dec 9999 23:59:59 GMT", NOW) == MAX_WAIT
    assert parse_retry_after("1e12", NOW) == MAX_WAIT
    assert parse_reset("1000000h") == MAX_WAIT
    assert parse_retry_after("120", NOW) == 120.0
    assert parse_reset("6h0m0s") == 6 * 3600.0


def test_an_activitys_own_retry_after_is_taken_as_asked_unless_it_is_not_a_number() -> None:
    """``RetryAfter(seconds)`` is the activity's own word: two days means two days. NaN
    or infinity would leave the step due never (or at a time no comparison matches):
    the backoff is used instead, and a negative wait is no wait."""
    waits = [classify(RetryAfter(s)).retry_after for s in (172_800, -5, math.nan, math.inf)]
    assert waits == [172_800.0, 0.0, None, None]
