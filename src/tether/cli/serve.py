"""``tether serve``: the HTTP API (and, optionally, workers) of an App on uvicorn."""

from __future__ import annotations

import importlib.util
import logging
import signal
import sys
from typing import Annotated

import typer

from ._common import EXIT_USAGE, _fail, _note, load_app


def serve_command(
    app_spec: Annotated[
        str,
        typer.Argument(metavar="MODULE:ATTR", help="The tether.App to serve, e.g. flows:app."),
    ],
    host: Annotated[str, typer.Option("--host", help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", "-p", help="Port to listen on.")] = 8000,
    workers: Annotated[
        int,
        typer.Option(
            "--workers",
            "-w",
            min=0,
            help="In-process tether workers serving the App's queues (0: run `tether worker` "
            "processes beside it on the same store).",
        ),
    ] = 0,
    grace: Annotated[
        float,
        typer.Option("--grace", help="Seconds in-flight work may take to finish on SIGTERM."),
    ] = 10.0,
    log_level: Annotated[
        str, typer.Option("--log-level", help="Logging level: debug, info, warning, error.")
    ] = "info",
    auth: Annotated[
        bool | None,
        typer.Option(
            "--auth/--no-auth",
            help="Require API keys (default: when the store has a live key at start-up).",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Serve MODULE:ATTR's HTTP API until SIGTERM or Ctrl+C (OpenAPI at /docs)."""
    missing = [m for m in ("fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        _fail(
            f"tether serve needs {' and '.join(missing)}: pip install 'tether[server]'",
            EXIT_USAGE,
        )
    import uvicorn

    from ..server import create_api

    level = logging.getLevelName(log_level.upper())
    if not isinstance(level, int):
        _fail(f"unknown --log-level {log_level!r}", EXIT_USAGE)
    logging.basicConfig(
        level=level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    app = load_app(app_spec)
    api = create_api(app, workers=workers, grace=grace, auth=auth)
    _note(
        f"tether serve {app_spec} on http://{host}:{port} ({workers} in-process worker(s); "
        f"API docs at /docs)"
    )
    # uvicorn stops on SIGTERM/SIGINT (the API's shutdown stops the workers with
    # ``grace``), then raises the signal again for whoever handled it before: here, so a
    # graceful stop exits 0
    previous = {sig: signal.signal(sig, _stopped) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        uvicorn.run(api, host=host, port=port, log_level=log_level.lower(), lifespan="on")
    except _Stopped:
        pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    _note(f"tether serve {app_spec} stopped")


class _Stopped(Exception):
    """uvicorn finished a graceful shutdown on a signal."""


def _stopped(signum: int, _frame: object) -> None:
    raise _Stopped()
