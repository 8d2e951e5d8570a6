"""``tether keys``: API keys of the HTTP service (create, list, revoke)."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from ._common import (
    EXIT_USAGE,
    UsageError,
    _app_option,
    _client_app,
    _dump,
    _fail,
    _note,
    _opened,
    _run,
    _store_option,
    _ts,
)


def keys_create_command(
    store: Annotated[str | None, _store_option()] = None,
    app: Annotated[str | None, _app_option()] = None,
    role: Annotated[
        str,
        typer.Option(
            "--role",
            help="monitor (look, payloads withheld; may act for every tenant: dashboards, "
            "a Prometheus scraper), read (look), operate (also start, signal, cancel, "
            "decide) or admin (also terminate, fork; may act for every tenant).",
        ),
    ] = "operate",
    tenant: Annotated[
        str | None,
        typer.Option(
            "--tenant",
            help="The tenant the key acts for (required but for admin and monitor keys).",
        ),
    ] = None,
    name: Annotated[str | None, typer.Option("--name", help="What the key is for.")] = None,
) -> None:
    """Create an API key and print it once (only its hash is stored)."""
    # imported here: the server package loads FastAPI, which every other command spares
    from ..server._auth import ROLES, create_key

    if role not in (*ROLES, "client"):
        _fail(f"--role must be one of {', '.join(ROLES)} (got {role!r})", EXIT_USAGE)

    async def go() -> tuple[str, str]:
        async with _opened(_client_app(store, app)) as a:
            try:
                return await create_key(a.store, role=role, tenant=tenant, name=name)
            except ValueError as exc:
                raise UsageError(str(exc)) from None

    key_id, key = _run(go())
    _note(f"created {role} key {key_id}; it is shown once, store it now:")
    print(key)


def keys_list_command(
    store: Annotated[str | None, _store_option()] = None,
    app: Annotated[str | None, _app_option()] = None,
) -> None:
    """List API keys (never their secrets), as JSON."""

    async def go() -> list[tuple[Any, ...]]:
        async with _opened(_client_app(store, app)) as a:
            return await a.store.list_api_keys()

    rows = _run(go())
    _dump(
        [
            {
                "key_id": r[0],
                "name": r[2],
                "tenant": r[3],
                "role": r[4],
                "created": _ts(r[5]),
                "revoked": _ts(r[6]) if r[6] else None,
            }
            for r in rows
        ]
    )


def keys_revoke_command(
    key_id: Annotated[str, typer.Argument(metavar="KEY_ID", help="The key to revoke.")],
    store: Annotated[str | None, _store_option()] = None,
    app: Annotated[str | None, _app_option()] = None,
) -> None:
    """Revoke an API key: requests with it are refused from now on."""

    async def go() -> bool:
        async with _opened(_client_app(store, app)) as a:
            return await a.store.revoke_api_key(key_id)

    if not _run(go()):
        _fail(f"no live key {key_id!r} (see `tether keys list`)", EXIT_USAGE)
    _note(f"revoked key {key_id}")
