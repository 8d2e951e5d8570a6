"""The failure policy of one activity attempt: retries, layered timeouts, the step's deadline;
and the attempt's span in its run's trace.

Used by the worker for every attempt and by batch runs for every item.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from ._classify import classify, ratelimit_pause
from ._history import Task
from ._policy import Retry
from ._tracing import activity_span


def attempt_span(task: Task, began: int | None = None) -> contextlib.AbstractContextManager[Any]:
    """The span of one attempt of ``task`` in its run's trace, from ``began`` (epoch ns;
    None: now); nothing when the run is not traced (the common, cheap case)."""
    opts = task.options or {}
    carrier = opts.get("trace")
    if carrier is None:
        return contextlib.nullcontext()
    return activity_span(
        task.name or "",
        task.run_id,
        task.step,
        task.attempt,
        task.queue,
        carrier,
        opts.get("tenant"),
        began=began,
    )


class _StepTimeout(TimeoutError):
    """The step ran out of its schedule-to-close time or its retry policy's max_elapsed."""


class _Plan:
    """The failure policy of one activity task: retries, layered timeouts, deadline."""

    def __init__(self, retry: Retry, opts: dict[str, Any]) -> None:
        self.retry = retry
        self.timeout: float | None = opts.get("timeout")
        scheduled = opts.get("scheduled_at")
        limits: list[tuple[float, str]] = []
        if scheduled is not None:
            if opts.get("schedule_timeout"):
                limits.append(
                    (
                        scheduled + float(opts["schedule_timeout"]),
                        f"schedule-to-close timeout of {opts['schedule_timeout']}s",
                    )
                )
            max_elapsed = (opts.get("retry") or {}).get("max_elapsed")
            if max_elapsed:
                limits.append((scheduled + float(max_elapsed), f"max_elapsed of {max_elapsed}s"))
        first = min(limits) if limits else None
        self.deadline: float | None = first[0] if first else None
        self.deadline_reason = (
            f"step exceeded its {first[1]}" if first else "step exceeded its deadline"
        )

    def attempt_timeout(self, now: float) -> float | None:
        """Seconds this attempt may take: its own timeout, capped by the step deadline."""
        limits = [t for t in (self.timeout,) if t]
        if self.deadline is not None:
            limits.append(max(0.001, self.deadline - now))
        return min(limits) if limits else None

    def decide(
        self, attempt: int, exc: BaseException, now: float, cancelled: bool
    ) -> tuple[dict[str, Any], float | None]:
        """The error to record and when to retry (None: the step has failed for good)."""
        verdict = classify(exc, self.retry.non_retryable, now)
        delay = (
            verdict.retry_after if verdict.retry_after is not None else self.retry.delay(attempt)
        )
        reason = verdict.reason
        retry = verdict.retryable
        if isinstance(exc, _StepTimeout):
            retry, reason = False, str(exc)
        elif cancelled or isinstance(exc, asyncio.CancelledError):
            retry, reason = False, "cancelled"
        elif retry and attempt >= self.retry.attempts:
            retry, reason = False, f"gave up after {attempt} attempt(s): {verdict.reason}"
        elif retry and self.deadline is not None and now + delay >= self.deadline:
            retry, reason = False, f"{self.deadline_reason} before the next attempt"
        error: dict[str, Any] = {
            "type": type(exc).__name__,
            "message": str(exc),
            "retryable": retry,
            "reason": reason,
            "attempts": attempt,
        }
        pause = ratelimit_pause(exc)
        if pause is not None:
            # x-ratelimit-remaining-* is 0: a dependency limiter waits until the reset
            error["ratelimit_pause"] = pause
        if verdict.retry_after is not None:
            error["retry_after"] = verdict.retry_after
            if verdict.reason.startswith("HTTP 429"):
                # the store pauses the queue (if it has pause_on_429) until then
                error["rate_limited"] = True
        return error, (now + delay if retry else None)
