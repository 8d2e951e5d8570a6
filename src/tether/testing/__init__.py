"""Tools to test workflows: time skipping, fault injection, crash at every step,
replay checks, cassettes and evaluations (see docs/testing.md)."""

from __future__ import annotations

from . import _faults as faults
from ._cassette import Cassette, CassetteCall, CassetteMismatch
from ._crash import (
    CrashFailure,
    CrashInvariantError,
    CrashReport,
    crash_at_every_step,
)
from ._env import Env, SimulatedCrash, VirtualClock
from ._evaluate import (
    Case,
    CaseResult,
    EvalReport,
    EvaluationFailed,
    aevaluate,
    evaluate,
    load_cases,
)
from ._faults import (
    CRASH_ENV,
    Duplicate,
    Fail,
    Fault,
    Faults,
    Hang,
    InjectedHTTPError,
    Injection,
    Malformed,
    RateLimit,
    StoreCrash,
    crash_after_writes,
    exit_after_writes,
    inject,
    install_crash_from_env,
)
from ._model_server import Answer as ModelAnswer
from ._model_server import ModelServer
from ._model_server import error as model_error
from ._model_server import garbage as model_garbage
from ._model_server import reply as model_reply
from ._replay import ReplayReport, check_history, events_from_json, load_files

__all__ = [
    "ModelAnswer",
    "ModelServer",
    "model_error",
    "model_garbage",
    "model_reply",
    "CRASH_ENV",
    "Case",
    "CaseResult",
    "Cassette",
    "CassetteCall",
    "CassetteMismatch",
    "CrashFailure",
    "CrashInvariantError",
    "CrashReport",
    "Duplicate",
    "Env",
    "EvalReport",
    "EvaluationFailed",
    "Fail",
    "Fault",
    "Faults",
    "Hang",
    "InjectedHTTPError",
    "Injection",
    "Malformed",
    "RateLimit",
    "ReplayReport",
    "SimulatedCrash",
    "StoreCrash",
    "VirtualClock",
    "aevaluate",
    "check_history",
    "crash_after_writes",
    "crash_at_every_step",
    "evaluate",
    "events_from_json",
    "exit_after_writes",
    "faults",
    "inject",
    "install_crash_from_env",
    "load_cases",
    "load_files",
]
