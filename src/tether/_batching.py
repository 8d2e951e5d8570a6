"""How calls of one activity are batched (``tether.Batch``): a definition, like a retry
policy, that activities carry and the store and worker act on."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from ._errors import ConfigurationError
from ._policy import seconds


class Batch:
    """How calls of one activity are batched: ``tether.Batch(max_items=, max_wait=, key=)``.

    A batch is run when ``max_items`` calls with the same key are ready, or when
    the oldest of them has waited ``max_wait`` (seconds or a timedelta). ``key``
    is a function of the item returning a string (e.g. the model); calls with
    different keys never share a batch. Without it, every call of the activity
    may join the same batch.
    """

    def __init__(
        self,
        *,
        max_items: int,
        max_wait: float | timedelta,
        key: Callable[[Any], str] | None = None,
    ) -> None:
        if isinstance(max_items, bool) or not isinstance(max_items, int):
            raise ConfigurationError(
                f"max_items of tether.Batch must be an integer (got {max_items!r})"
            )
        if max_items < 1:
            raise ConfigurationError(
                f"max_items of tether.Batch must be at least 1 (got {max_items})"
            )
        wait = seconds(max_wait, "max_wait of tether.Batch")
        if wait is None or wait <= 0:
            raise ConfigurationError(
                f"max_wait of tether.Batch must be a positive duration (got {max_wait!r}): "
                "how long the oldest waiting call may wait for its batch to fill"
            )
        if key is not None and not callable(key):
            raise ConfigurationError(
                "key of tether.Batch takes a function of the item returning a string "
                f"(e.g. lambda req: req.model), got {type(key).__name__}"
            )
        self.max_items = max_items
        self.max_wait = wait
        self.key = key

    def __repr__(self) -> str:
        return f"<tether.Batch max_items={self.max_items} max_wait={self.max_wait}s>"

    def scheduling(self, activity: str, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        """What one call records in ActivityScheduled: its batch key and the batch limits.

        The key function runs here, in the workflow, once; the store groups tasks
        by the recorded key, so replay, retry and fork never call user code again.
        """
        item = args[0] if args else next(iter(kwargs.values()), None)
        value: str | None = None
        if self.key is not None:
            try:
                value = self.key(item)
            except Exception as exc:
                raise ConfigurationError(
                    f"batch key of activity {activity!r} failed on this call's item: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            if not isinstance(value, str):
                raise ConfigurationError(
                    f"batch key of activity {activity!r} must return a string, "
                    f"got {type(value).__name__} ({value!r})"
                )
        group = [activity] if value is None else [activity, value]
        return {
            "key": json.dumps(group, separators=(",", ":")),
            "max_items": self.max_items,
            "max_wait": self.max_wait,
        }
