"""``tether queues``: every queue's depth, running work, limits and pauses."""

from __future__ import annotations

import dataclasses
from typing import Annotated

import typer
from rich.table import Table
from rich.text import Text

from .._queues import QueueStats
from ._common import (
    _app_option,
    _client_app,
    _console,
    _dump,
    _note,
    _opened,
    _run,
    _short_json,
    _store_option,
    _ts,
)


def queues_command(
    store: Annotated[str | None, _store_option()] = None,
    app: Annotated[str | None, _app_option()] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Show every queue: ready depth, oldest wait, running work, limits, pause, tokens."""

    async def go() -> list[QueueStats]:
        async with _opened(_client_app(store, app)) as a:
            return await a.queue_stats()

    stats = _run(go())
    if as_json:
        _dump([dataclasses.asdict(q) for q in stats])
        return
    if not stats:
        _note("no queues found")
        return
    table = Table(show_edge=False, header_style="bold")
    table.add_column("queue", no_wrap=True)
    table.add_column("ready", justify="right")
    table.add_column("oldest", justify="right", no_wrap=True)
    table.add_column("running", justify="right")
    table.add_column("scheduled", justify="right")
    table.add_column("limits")
    table.add_column("tokens", justify="right")
    table.add_column("paused until", no_wrap=True)
    table.add_column("running per key")
    for q in stats:
        limits = []
        if q.max_concurrency is not None:
            limits.append(f"max {q.max_concurrency}")
        if q.rate is not None:
            limits.append(f"{q.rate:g}/s burst {q.burst:g}")
        if q.key_concurrency is not None:
            limits.append(f"{q.key_concurrency} per key")
        if q.fair:
            limits.append("fair")
        table.add_row(
            Text(q.queue),
            str(q.ready),
            "-" if q.oldest_ready_age is None else f"{q.oldest_ready_age:.1f}s",
            str(q.running),
            str(q.scheduled),
            Text(", ".join(limits) or "-"),
            "-" if q.tokens is None else f"{q.tokens:.1f}",
            Text(_ts(q.paused_until), style="yellow" if q.paused_until else ""),
            Text(_short_json(q.running_by_key) if q.running_by_key else ""),
        )
    _console().print(table)
