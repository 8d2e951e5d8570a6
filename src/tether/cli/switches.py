"""``tether switch``: kill switches that stop a workflow, activity, model or tenant on
every worker of a store (off, on, list)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Annotated, Any

import typer

from .._errors import ConfigurationError
from ..encryption import KeyringMismatchError
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

_KIND = typer.Argument(metavar="KIND", help="workflow, activity, model or tenant.")
_NAME = typer.Argument(metavar="NAME", help="Its name (a model as registered with the gateway).")


@contextlib.contextmanager
def _usage() -> Iterator[None]:
    """The App's refusal of a switch (an unknown kind, a blank name, a name the App does
    not register: ``App.disable``) as a usage error (exit 2). A store's refusal to write
    (``KeyringMismatchError``) stays an error."""
    try:
        yield
    except KeyringMismatchError:
        raise
    except ConfigurationError as exc:
        raise UsageError(str(exc)) from None


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
            with _usage():  # with --app, a name it does not register is refused
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
            with _usage():
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
