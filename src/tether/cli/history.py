"""Histories: ``history export`` and ``replay`` (check recorded runs against today's
code before a deploy).
"""

from __future__ import annotations

import importlib.util
from typing import Annotated, Any

import typer

from ._common import (
    MAX_LIMIT,
    UsageError,
    _app_option,
    _client_app,
    _dump,
    _info_dict,
    _opened,
    _run,
    _run_id_argument,
    _store_option,
    load_app,
)


def history_export_command(
    run_id: Annotated[str, _run_id_argument()],
    store: Annotated[str | None, _store_option()] = None,
    app: Annotated[str | None, _app_option()] = None,
    packed: Annotated[
        bool,
        typer.Option(
            "--packed",
            help="Keep model conversations as recorded (by reference) instead of written out.",
        ),
    ] = False,
) -> None:
    """Print a run's info and full history as JSON: {"run": {...}, "events": [...]};
    model steps' conversations are written out in full unless --packed."""

    async def go() -> dict[str, Any]:
        async with _opened(_client_app(store, app)) as a:
            info = await a.get(run_id)
            events = await a.history(run_id)
            rows = [e.to_json() for e in events]
            if not packed and importlib.util.find_spec("pydantic_ai") is not None:
                from ..ai import expand_history

                rows = expand_history(events)
            return {"run": _info_dict(info), "events": rows}

    _dump(_run(go()))


def _parse_age(text: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
    try:
        return float(text[:-1]) * units[text[-1]] if text[-1] in units else float(text)
    except (ValueError, IndexError):
        raise UsageError(f"--since takes an age like 30m, 12h or 7d (got {text!r})") from None


def replay_command(
    files: Annotated[
        list[str] | None,
        typer.Argument(metavar="[HISTORY.json]...", help="Files from `tether history export`."),
    ] = None,
    app: Annotated[
        str, typer.Option("--app", metavar="MODULE:ATTR", help="The App with today's code.")
    ] = "",
    store: Annotated[str | None, _store_option()] = None,
    workflow: Annotated[
        str | None, typer.Option("--workflow", help="With --store: only this workflow.")
    ] = None,
    since: Annotated[
        str | None, typer.Option("--since", help="With --store: runs created within (7d, 12h).")
    ] = None,
    limit: Annotated[
        int, typer.Option("--limit", min=1, max=MAX_LIMIT, help="With --store: at most N runs.")
    ] = 1000,
) -> None:
    """Replay recorded histories against today's code; exit 1 on any non-determinism."""
    from .._errors import ConfigurationError
    from ..testing import check_history, load_files

    if not app:
        raise UsageError("--app MODULE:ATTR is required: it names the code to check")
    code = load_app(app)
    try:
        histories = load_files(files or [])
    except ConfigurationError as exc:  # missing, a directory, not JSON, not a history
        raise UsageError(str(exc)) from None
    if store is not None:
        age = _parse_age(since) if since else None

        async def fetch() -> list[list[Any]]:
            async with _opened(_client_app(store, None)) as a:
                runs = await a.list(workflow=workflow, limit=limit)
                now = a.store.clock()
                picked = [r for r in runs if age is None or now - r.created_at <= age]
                return [await a.history(r.run_id) for r in picked]

        histories += _run(fetch())
    if not histories:
        raise UsageError("nothing to replay: pass exported files or --store")
    failed = 0
    for events in histories:
        report = check_history(code, events)
        if report.ok:
            print(f"ok    {report.run_id} ({report.workflow}, {len(report.recorded)} commands)")
            continue
        failed += 1
        print(f"FAIL  {report.run_id} ({report.workflow}): {report.error}")
        print(report.diff())
    print(f"{len(histories) - failed} passed, {failed} failed")
    if failed:
        raise SystemExit(1)
