"""``tether switch``: kill switches that stop a workflow, activity, model or tenant on
every worker of a store (off, on, list)."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from .._app import App
from ._common import (
    UsageError,
    _app_option,
    _client_app,
    _dump,
    _note,
    _opened,
    _run,
    _store_option,
    cli_actor,
)

_KIND = typer.Argument(help="workflow, activity, model or tenant.")
_NAME = typer.Argument(help="Its name (a model as registered with the gateway).")


def _refuse_unknown(a: App, spec: str, kind: str, name: str) -> None:
    """With --app the workflows and activities are known: a name none has is a typo
    (a switch on it would stop nothing)."""
    known = {
        "workflow": list(a._workflows),
        "activity": list(a._activities),
    }.get(kind)
    if known is not None and name not in known:
        raise UsageError(
            f"{spec} has no {kind} {name!r} (a switch on it would stop nothing); its {kind} "
            f"names: {', '.join(sorted(known)) or 'none'}"
        )


def switch_off_command(
    kind: Annotated[str, _KIND],
    name: Annotated[str, _NAME],
    store: Annotated[str | None, _store_option()] = None,
    app: Annotated[str | None, _app_option()] = None,
    reason: Annotated[str | None, typer.Option("--reason", help="Why (recorded).")] = None,
) -> None:
    """Switch it off: no new task of it starts on any worker until switched on."""

    async def go() -> bool:
        async with _opened(_client_app(store, app)) as a:
            if app is not None:
                _refuse_unknown(a, app, kind, name)
            return await a.disable(kind, name, reason=reason, by=cli_actor())

    changed = _run(go())
    _note(f"{kind} {name} is off" + ("" if changed else " (it already was)"))


def switch_on_command(
    kind: Annotated[str, _KIND],
    name: Annotated[str, _NAME],
    store: Annotated[str | None, _store_option()] = None,
    app: Annotated[str | None, _app_option()] = None,
) -> None:
    """Switch it back on (held tasks go within about 5 s)."""

    async def go() -> bool:
        async with _opened(_client_app(store, app)) as a:
            return await a.enable(kind, name, by=cli_actor())

    changed = _run(go())
    _note(f"{kind} {name} is on" + ("" if changed else " (it already was)"))


def switch_list_command(
    store: Annotated[str | None, _store_option()] = None,
    app: Annotated[str | None, _app_option()] = None,
) -> None:
    """List the switches that are off, as JSON."""

    async def go() -> list[dict[str, Any]]:
        async with _opened(_client_app(store, app)) as a:
            return await a.switches()

    _dump(_run(go()))
