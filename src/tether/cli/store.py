"""``tether store migrate``: copy every run to another store and prove the copy."""

from __future__ import annotations

import os
from typing import Annotated

import typer

from .._errors import StoreError
from ._common import _note, _refuse_foreign_database, _run, _sqlite_path, load_app


def store_migrate_command(
    source: Annotated[
        str,
        typer.Option("--from", metavar="URL", help="The store to copy from.", show_default=False),
    ],
    target: Annotated[
        str,
        typer.Option(
            "--to",
            metavar="URL",
            help="The store to copy into (e.g. postgresql://host/db?schema=NAME).",
            show_default=False,
        ),
    ],
    app: Annotated[
        str | None,
        typer.Option(
            "--app",
            metavar="MODULE:ATTR",
            help="Also replay every copied history against this App's code.",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Copy every run (in flight or finished) to another store and verify the copy.

    Stop the source's workers first. Refuses (copying nothing) when a run already
    exists in the target; exits 1 if the copy does not match its source. A SQLite
    source is read as it is, never upgraded or written.
    """
    from ..store.migrate import MigrationReport, migrate

    path = _sqlite_path(source)
    missing = path is not None and not os.path.exists(path)

    async def go() -> MigrationReport:
        code = load_app(app) if app else None
        if missing:
            raise StoreError(f"no tether store at {path!r} to migrate from: check --from")
        if path is not None:
            _refuse_foreign_database(path)
        return await migrate(source, target, app=code, progress=_note)

    print(_run(go()).summary())
