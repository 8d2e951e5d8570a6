"""Histories: ``history export`` and ``replay`` (check recorded runs against today's
code before a deploy).
"""

from __future__ import annotations

import importlib.util
from typing import Annotated, Any

import typer

from .._errors import RunNotFoundError
from ._common import (
    MAX_LIMIT,
    UsageError,
    _app_option,
    _client_app,
    _dump,
    _info_dict,
    _note,
    _opened,
    _run,
    _run_id_argument,
    _store_option,
    load_app,
    parse_age,
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
    """Print a run's info and full history as JSON.

    Its shape is {"run": {...}, "events": [...]}; model steps' conversations are
    written out in full unless --packed."""

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


#: statuses of runs that may still run code: ``tether replay --store`` checks every one
_UNFINISHED = ("pending", "running", "suspended", "queued")
#: runs read per page from the store
_PAGE = 500


def replay_command(
    files: Annotated[
        list[str] | None,
        typer.Argument(metavar="HISTORY.json", help="Files from `tether history export`."),
    ] = None,
    app: Annotated[
        str, typer.Option("--app", metavar="MODULE:ATTR", help="The App with today's code.")
    ] = "",
    store: Annotated[str | None, _store_option()] = None,
    workflow: Annotated[
        str | None, typer.Option("--workflow", help="With --store: only this workflow.")
    ] = None,
    finished: Annotated[
        bool,
        typer.Option(
            "--finished",
            help="With --store: also replay finished runs (the newest --limit of them).",
        ),
    ] = False,
    since: Annotated[
        str | None,
        typer.Option(
            "--since",
            help="With --store: also replay the finished runs created within AGE (7d, 12h).",
        ),
    ] = None,
    limit: Annotated[
        int,
        typer.Option(
            "--limit",
            min=1,
            max=MAX_LIMIT,
            help="With --finished or --since: at most N finished runs, newest first.",
        ),
    ] = 1000,
) -> None:
    """Replay recorded histories against today's code; exit 1 on any non-determinism.

    With --store: every unfinished run (pending, running, suspended, queued), however
    old, and finished runs only with --finished or --since."""
    from .._errors import ConfigurationError
    from ..testing import check_history, load_files

    if not app:
        raise UsageError("--app MODULE:ATTR is required: it names the code to check")
    age = parse_age(since, "--since") if since else None
    code = load_app(app)
    try:
        histories = load_files(files or [])
    except ConfigurationError as exc:  # missing, a directory, not JSON, not a history
        raise UsageError(str(exc)) from None
    if store is None and not histories:
        raise UsageError("nothing to replay: pass exported files or --store")
    counts = {"passed": 0, "failed": 0}

    def check(events: list[Any]) -> None:
        report = check_history(code, events)
        if report.ok:
            counts["passed"] += 1
            print(f"ok    {report.run_id} ({report.workflow}, {len(report.recorded)} commands)")
            return
        counts["failed"] += 1
        print(f"FAIL  {report.run_id} ({report.workflow}): {report.error}")
        print(report.diff())

    for events in histories:
        check(events)
    if store is not None:

        async def walk() -> None:
            async with _opened(_client_app(store, None)) as a:

                async def replay(run_id: str) -> None:
                    try:
                        events = await a.history(run_id, follow=False)
                    except RunNotFoundError:
                        return  # purged since it was listed
                    check(events)

                unfinished = 0
                for status in _UNFINISHED:
                    # a page at a time: a million live runs never sit in memory
                    before: tuple[float, str] | None = None
                    while True:
                        page = await a.list(
                            status=status, workflow=workflow, limit=_PAGE, before=before
                        )
                        for run in page:
                            await replay(run.run_id)
                        unfinished += len(page)
                        if len(page) < _PAGE:
                            break
                        before = (page[-1].created_at, page[-1].run_id)
                if not (finished or since):
                    if not unfinished:
                        _note("no unfinished runs in the store (--finished replays ended ones)")
                    return
                cutoff = a.store.clock() - age if age is not None else None
                taken = 0
                before = None
                while taken < limit:
                    page = await a.list(workflow=workflow, limit=_PAGE, before=before, since=cutoff)
                    for run in page:
                        if run.status.value in _UNFINISHED:
                            continue  # replayed above
                        await replay(run.run_id)
                        taken += 1
                        if taken >= limit:
                            break
                    if len(page) < _PAGE:
                        break
                    before = (page[-1].created_at, page[-1].run_id)

        _run(walk())
    failed = counts["failed"]
    print(f"{counts['passed']} passed, {failed} failed")
    if failed:
        raise SystemExit(1)
