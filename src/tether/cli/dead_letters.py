"""``tether dead-letters``: steps and runs that exhausted their failure policy (list,
replay, resolve)."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any

import typer
from rich.table import Table
from rich.text import Text

from .._history import DeadLetter
from ._common import (
    MAX_LIMIT,
    _app_option,
    _client_app,
    _console,
    _dump,
    _note,
    _opened,
    _run,
    _store_option,
    _ts,
    cli_actor,
)

_LETTER = typer.Argument(metavar="LETTER_ID", help="The letter's id (tether dead-letters list).")


def _as_dict(letter: DeadLetter) -> dict[str, Any]:
    out = dataclasses.asdict(letter)
    for key in ("created_at", "resolved_at"):
        out[key] = _ts(out[key]) if out[key] else None
    return out


def dead_letters_list_command(
    store: Annotated[str | None, _store_option()] = None,
    app: Annotated[str | None, _app_option()] = None,
    run_id: Annotated[str | None, typer.Option("--run", help="Only this run's letters.")] = None,
    include_resolved: Annotated[
        bool, typer.Option("--all", help="Also the resolved, replayed and retried ones.")
    ] = False,
    limit: Annotated[
        int, typer.Option("--limit", "-n", min=1, max=MAX_LIMIT, help="At most N letters.")
    ] = 50,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """List dead letters, oldest first (open ones by default)."""

    async def go() -> list[DeadLetter]:
        async with _opened(_client_app(store, app)) as a:
            return await a.dead_letters(
                include_resolved=include_resolved, run_id=run_id, limit=limit
            )

    letters = _run(go())
    if as_json:
        _dump([_as_dict(d) for d in letters])
        return
    if not letters:
        _note("no dead letters found")
        return
    table = Table(show_edge=False, header_style="bold")
    for column in ("id", "run", "step", "kind", "name", "reason", "since", "state"):
        table.add_column(column, no_wrap=column not in ("reason", "run"))
    for d in letters:
        state = (d.resolution or {}).get("state") if isinstance(d.resolution, dict) else None
        table.add_row(
            str(d.id),
            Text(d.run_id),
            "" if d.step is None else str(d.step),
            d.kind,
            Text(d.name),
            Text(d.reason or ""),
            _ts(d.created_at),
            Text(state or ("open" if d.resolved_at is None else "closed")),
        )
    _console().print(table)


def dead_letters_replay_command(
    letter_id: Annotated[int, _LETTER],
    store: Annotated[str | None, _store_option()] = None,
    app: Annotated[str | None, _app_option()] = None,
    force: Annotated[
        bool,
        typer.Option(
            "--force",
            help="Run a step whose run caught its failure and went on anyway (or retry "
            "a failed child run whose parent did): this re-executes its side effect (a "
            "charge, an email) once more.",
        ),
    ] = False,
) -> None:
    """Replay a letter once: a failed run's is retried, a tether.map item runs here (--app).

    A failed (or needs-intervention) run is retried from its failed step; a poison item
    of tether.map runs again in this process with its recorded input and idempotency
    key (it needs --app, for its code), and its result is printed. A step whose run
    caught its failure and went on is refused, as is a failed child run whose parent
    caught it (see --force)."""

    async def go() -> Any:
        async with _opened(_client_app(store, app)) as a:
            found = await a.dead_letters(include_resolved=True, letter_id=letter_id, limit=1)
            value = await a.replay_dead_letter(letter_id, force=force)  # refuses a missing one
            detail: dict[str, Any] = {"letter": letter_id, **({"force": True} if force else {})}
            await a.store.audit(cli_actor(), "replay dead letter", f"run:{found[0].run_id}", detail)
            return value

    value = _run(go())
    _note(f"dead letter {letter_id} replayed")
    if value is not None:
        _dump(value)


def dead_letters_resolve_command(
    letter_id: Annotated[int, _LETTER],
    note: Annotated[str, typer.Option("--note", help="What was done about it (recorded).")],
    store: Annotated[str | None, _store_option()] = None,
    app: Annotated[str | None, _app_option()] = None,
) -> None:
    """Close an open letter with a note, running nothing.

    For a step whose run dealt with the failure, or one an operator settled by hand: the
    note and who resolved it are stored on the letter and in the audit log."""

    async def go() -> DeadLetter:
        async with _opened(_client_app(store, app)) as a:
            return await a.resolve_dead_letter(letter_id, note=note, by=cli_actor())

    letter = _run(go())
    _note(f"dead letter {letter_id} (run {letter.run_id}) resolved")
