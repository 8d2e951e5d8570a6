"""Kill switches as a worker sees them: which tasks to hold back, from the store's
``switches`` table read every ``REFRESH`` seconds.

A held task is given back unstarted (its attempt is not used) to be looked at again in
``HOLD`` seconds, so turning a switch back on takes effect within about that long.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from ._history import Task

#: seconds between reads of the switches table by a worker
REFRESH = 2.0
#: seconds a held task waits before a worker looks at it again
HOLD = 5.0
#: the activity of every model call (``tether.ai``): a model switch holds its tasks
MODEL_ACTIVITY = "tether.ai.call"


def model_of_args(args: Any) -> str | None:
    """The model name in a ``tether.ai.call`` step's arguments (its first one)."""
    positional = args.get("args") if isinstance(args, dict) else None
    if isinstance(positional, list) and positional and isinstance(positional[0], str):
        return positional[0]
    return None


class Switches:
    """The switches that are off, by kind."""

    def __init__(self, rows: Iterable[tuple[Any, ...]] = ()) -> None:
        self.off: dict[str, set[str]] = {}
        for row in rows:
            self.off.setdefault(row[0], set()).add(row[1])

    def __bool__(self) -> bool:
        return bool(self.off)

    def blocks(self, task: Task) -> bool:
        """Whether ``task`` must wait: its workflow, activity or model is off."""
        return self.holder(task) is not None

    def holder(self, task: Task) -> str | None:
        """The switch that holds ``task`` back (``"workflow 'name'"``), or None."""
        if task.kind == "workflow":
            return f"workflow {task.name!r}" if task.name in self.off.get("workflow", ()) else None
        if task.kind != "activity":
            return None
        if task.name in self.off.get("activity", ()):
            return f"activity {task.name!r}"
        models = self.off.get("model")
        if models and task.name == MODEL_ACTIVITY and task.payload:
            try:
                model = model_of_args(json.loads(task.payload))
            except ValueError:
                return None
            return f"model {model!r}" if model in models else None
        return None

    def stops_run(self, workflow: str, tenant: str | None) -> bool:
        """Whether a run of ``workflow`` (of ``tenant``) may take no step now."""
        return workflow in self.off.get("workflow", ()) or (
            tenant is not None and tenant in self.off.get("tenant", ())
        )


def held_note(task: Task, switch: str) -> str:
    """What a run held back by a switch says (its ``task_error`` until it moves on)."""
    what = "workflow task" if task.kind == "workflow" else f"step {task.step}"
    return (
        f"SwitchedOff: {switch} is switched off; the run's {what} waits (no attempt "
        "spent) until it is switched on"
    )
