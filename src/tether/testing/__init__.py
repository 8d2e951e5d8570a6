"""Tools to prove workflows recover: a time-skipping environment and replay checks."""

from __future__ import annotations

from ._crash import (
    CrashFailure,
    CrashInvariantError,
    CrashReport,
    crash_at_every_step,
)
from ._env import Env, SimulatedCrash, VirtualClock
from ._replay import ReplayReport, check_history, events_from_json, load_files

__all__ = [
    "CrashFailure",
    "CrashInvariantError",
    "CrashReport",
    "Env",
    "ReplayReport",
    "SimulatedCrash",
    "VirtualClock",
    "check_history",
    "crash_at_every_step",
    "events_from_json",
    "load_files",
]
