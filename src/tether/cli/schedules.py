"""``tether schedules``: list, create, pause, resume, trigger and delete schedules."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.table import Table

from .._errors import PayloadError
from .._schedules import ScheduleInfo
from ._common import (
    EXIT_USAGE,
    UsageError,
    _app_option,
    _client_app,
    _console,
    _dump,
    _fail,
    _note,
    _opened,
    _parse_json,
    _run,
    _store_option,
    _ts,
    cli_actor,
    load_app,
)

_ID = typer.Argument(metavar="SCHEDULE_ID", help="The schedule's id.")


def schedules_list_command(
    store: Annotated[str | None, _store_option()] = None,
    app: Annotated[str | None, _app_option()] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Every schedule: when it fires, its next tick, its last run, runs fired and skipped."""

    async def go() -> list[ScheduleInfo]:
        async with _opened(_client_app(store, app)) as a:
            return await a.schedules()

    found = _run(go())
    if as_json:
        _dump([s.to_json() for s in found])
        return
    table = Table(box=None)
    for col in ("id", "workflow", "when", "overlap", "next", "last run", "fired", "skipped"):
        table.add_column(col)
    for s in found:
        when = f"cron {s.spec.cron} {s.spec.tz}" if s.spec.cron else f"every {s.spec.every:g}s"
        table.add_row(
            s.schedule_id,
            s.workflow,
            when,
            s.spec.overlap,
            "paused" if s.paused else _ts(s.next_at),
            s.last_run_id or "-",
            str(s.fired),
            str(s.skipped),
        )
    _console().print(table)


def schedules_create_command(
    schedule_id: Annotated[str, _ID],
    app_spec: Annotated[
        str, typer.Argument(metavar="MODULE:ATTR", help="The tether.App defining the workflow.")
    ],
    workflow: Annotated[str, typer.Argument(metavar="WORKFLOW", help="The workflow's name.")],
    args: Annotated[
        list[str] | None,
        typer.Argument(metavar="JSON_ARGS", help="Its arguments, as JSON.", show_default=False),
    ] = None,
    cron: Annotated[
        str | None, typer.Option("--cron", help="A five-field cron expression: '0 2 * * *'.")
    ] = None,
    every: Annotated[
        float | None, typer.Option("--every", metavar="SECONDS", help="Or an interval.")
    ] = None,
    tz: Annotated[str | None, typer.Option("--tz", help="The cron's time zone (UTC).")] = None,
    overlap: Annotated[
        str,
        typer.Option(
            "--overlap",
            help="While the last run runs: skip, buffer_one, allow_all, cancel_previous.",
        ),
    ] = "skip",
    catchup_window: Annotated[
        float | None,
        typer.Option("--catchup-window", metavar="SECONDS", help="Missed ticks older: skipped."),
    ] = None,
    jitter: Annotated[
        float | None, typer.Option("--jitter", metavar="SECONDS", help="Spread each tick.")
    ] = None,
    paused: Annotated[bool, typer.Option("--paused", help="Create it paused.")] = False,
    note: Annotated[str | None, typer.Option("--note", help="A note kept with it.")] = None,
) -> None:
    """Create (or change) a schedule that starts WORKFLOW on a cron or an interval."""
    try:
        values = [_parse_json(a, f"argument {i}") for i, a in enumerate(args or [], 1)]
    except UsageError as exc:
        _fail(str(exc), EXIT_USAGE)

    async def go() -> ScheduleInfo:
        async with _opened(load_app(app_spec)) as a:
            try:
                info = await a.schedule(
                    schedule_id,
                    workflow,
                    *values,
                    cron=cron,
                    every=every,
                    tz=tz,
                    overlap=overlap,
                    catchup_window=catchup_window,
                    jitter=jitter,
                    paused=paused,
                    note=note,
                )
            except PayloadError as exc:
                raise UsageError(str(exc)) from None
            await a.store.audit(cli_actor(), "schedule", f"schedule:{schedule_id}", None)
            return info

    info = _run(go())
    when = "paused" if info.paused else f"next tick {_ts(info.next_at)}"
    _note(f"schedule {info.schedule_id} of {info.workflow}: {when}")


def _act(store: str | None, app: str | None, action: str, schedule_id: str) -> Any:
    async def go() -> Any:
        async with _opened(_client_app(store, app)) as a:
            if action == "pause":
                out: Any = await a.pause_schedule(schedule_id, note=f"paused by {cli_actor()}")
            elif action == "resume":
                out = await a.resume_schedule(schedule_id)
            elif action == "trigger":
                out = (await a.trigger_schedule(schedule_id)).run_id
            else:
                await a.delete_schedule(schedule_id)
                out = None
            await a.store.audit(cli_actor(), f"schedule {action}", f"schedule:{schedule_id}")
            return out

    return _run(go())


def schedules_pause_command(
    schedule_id: Annotated[str, _ID],
    store: Annotated[str | None, _store_option()] = None,
    app: Annotated[str | None, _app_option()] = None,
) -> None:
    """Stop firing; ticks that pass while paused never fire."""
    changed = _act(store, app, "pause", schedule_id)
    _note(f"schedule {schedule_id} paused" + ("" if changed else " (it already was)"))


def schedules_resume_command(
    schedule_id: Annotated[str, _ID],
    store: Annotated[str | None, _store_option()] = None,
    app: Annotated[str | None, _app_option()] = None,
) -> None:
    """Fire again from the first tick after now."""
    changed = _act(store, app, "resume", schedule_id)
    _note(f"schedule {schedule_id} resumed" + ("" if changed else " (it was not paused)"))


def schedules_trigger_command(
    schedule_id: Annotated[str, _ID],
    store: Annotated[str | None, _store_option()] = None,
    app: Annotated[str | None, _app_option()] = None,
) -> None:
    """Start the schedule's run now (printed), whatever its ticks and overlap say."""
    print(_act(store, app, "trigger", schedule_id))


def schedules_delete_command(
    schedule_id: Annotated[str, _ID],
    store: Annotated[str | None, _store_option()] = None,
    app: Annotated[str | None, _app_option()] = None,
) -> None:
    """Delete a schedule; the runs it started stay."""
    _act(store, app, "delete", schedule_id)
    _note(f"schedule {schedule_id} deleted")
