"""Turning recorded runs into tests: ``cassette export`` and ``eval``."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Annotated, Any

import typer

from .._app import App
from .._errors import ConfigurationError
from ._common import (
    EXIT_ERROR,
    EXIT_USAGE,
    UsageError,
    _app_option,
    _client_app,
    _describe_exception,
    _dump,
    _fail,
    _opened,
    _run,
    _run_id_argument,
    _store_option,
    load_app,
)


def cassette_export_command(
    run_id: Annotated[str, _run_id_argument()],
    store: Annotated[str | None, _store_option()] = None,
    app: Annotated[str | None, _app_option()] = None,
) -> None:
    """Print a run's activity calls as a cassette (JSON) to replay in a regression test."""
    from ..testing import Cassette

    async def go() -> dict[str, Any]:
        async with _opened(_client_app(store, app)) as a:
            events = await a.history(run_id)
            return Cassette.from_history(events).to_json()

    _dump(_run(go()))


def _load_target(spec: str) -> tuple[Any, App | None]:
    """``MODULE:ATTR`` naming an activity, workflow or function, and the App defining it."""
    from .._definitions import Workflow

    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise UsageError(f"{spec!r} is not of the form MODULE:TARGET (e.g. 'evals:classify')")
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise ConfigurationError(
            f"cannot import {module_name!r}: {_describe_exception(exc)}"
        ) from None
    target = getattr(module, attr, None)
    if target is None or not callable(target):
        raise UsageError(f"{module_name!r} has no activity, workflow or function named {attr!r}")
    owner = None
    if isinstance(target, Workflow):
        for value in vars(module).values():
            if isinstance(value, App) and value._workflows.get(target.name) is not None:
                owner = value
                break
    return target, owner


def eval_command(
    target: Annotated[
        str,
        typer.Argument(
            metavar="MODULE:TARGET", help="The activity, workflow or function to evaluate."
        ),
    ],
    cases: Annotated[
        str,
        typer.Argument(
            metavar="CASES.jsonl",
            help='One case per line: {"input": ..., "expected": ...} or {"args": [...], ...}.',
        ),
    ],
    min_accuracy: Annotated[
        float | None, typer.Option("--min-accuracy", help="Exit 1 if accuracy is lower.")
    ] = None,
    max_p95_ms: Annotated[
        float | None, typer.Option("--max-p95-ms", help="Exit 1 if p95 latency is higher.")
    ] = None,
    max_error_rate: Annotated[
        float | None,
        typer.Option("--max-error-rate", help="Exit 1 if more cases raise (0..1)."),
    ] = None,
    app: Annotated[
        str | None,
        typer.Option(
            "--app",
            metavar="MODULE:ATTR",
            help="The App of a workflow target (default: the App in the target's module).",
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print metrics as JSON.")] = False,
) -> None:
    """Evaluate a target over labelled cases; exit 1 below the thresholds."""
    from ..testing import EvaluationFailed, aevaluate, load_cases

    thresholds: dict[str, float] = {}
    if min_accuracy is not None:
        thresholds["accuracy"] = min_accuracy
    if max_p95_ms is not None:
        thresholds["p95_ms"] = max_p95_ms
    if max_error_rate is not None:
        thresholds["error_rate"] = max_error_rate
    if not os.path.exists(cases):
        _fail(f"no cases file at {cases!r}", EXIT_USAGE)
    try:
        loaded = load_cases(cases)
    except ConfigurationError as exc:  # a directory, not text, not JSON Lines of cases
        _fail(str(exc), EXIT_USAGE)

    async def go() -> Any:
        fn, owner = _load_target(target)
        code = load_app(app) if app else owner
        try:
            return await aevaluate(fn, loaded, app=code, thresholds=thresholds)
        except EvaluationFailed as exc:
            return exc.report

    report = _run(go())
    if as_json:
        _dump(
            {
                "target": report.target,
                "cases": report.total,
                "accuracy": report.accuracy,
                "error_rate": report.error_rate,
                "errors_by_type": report.errors_by_type,
                "p50_ms": report.p50_ms,
                "p95_ms": report.p95_ms,
                "total_cost": report.total_cost,
                "confusion": report.confusion,
                "thresholds": report.thresholds,
                "shortfalls": report.shortfalls(),
            }
        )
    else:
        print(report.table())
    if not report.ok:
        raise SystemExit(EXIT_ERROR)
