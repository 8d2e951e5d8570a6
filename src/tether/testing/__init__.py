"""Tools to prove workflows recover: a time-skipping environment and replay checks."""

from __future__ import annotations

from ._env import Env, VirtualClock
from ._replay import ReplayReport, check_history, events_from_json, load_files

__all__ = [
    "Env",
    "ReplayReport",
    "VirtualClock",
    "check_history",
    "events_from_json",
    "load_files",
]
