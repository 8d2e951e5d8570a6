"""``tether serve``: the HTTP API (and, optionally, workers) of an App on uvicorn."""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import math
import os
import signal
import socket
import sys
from collections.abc import Callable
from typing import Annotated, Any

import typer

from .._errors import TetherError
from ..store._open import _PG_SCHEMES
from ._common import (
    EXIT_USAGE,
    ThreadGraceOption,
    _fail,
    _log_format_option,
    _log_level_option,
    _note,
    _setup_logging,
    load_app,
)
from .worker import check_worker_options


def serve_command(
    app_spec: Annotated[
        str,
        typer.Argument(metavar="MODULE:ATTR", help="The tether.App to serve, e.g. flows:app."),
    ],
    host: Annotated[str, typer.Option("--host", help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[
        int, typer.Option("--port", "-p", min=0, max=65_535, help="Port to listen on.")
    ] = 8000,
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
        typer.Option(
            "--grace",
            min=0.0,
            max=86_400.0,
            help="Seconds in-flight work may take to finish on SIGTERM.",
        ),
    ] = 10.0,
    lease: Annotated[
        float,
        typer.Option(
            "--lease",
            metavar="SECONDS",
            help="How long a task claimed by an in-process worker stays ours without "
            "renewal (at least 1).",
        ),
    ] = 15.0,
    worker_id: Annotated[
        str | None,
        typer.Option(
            "--worker-id",
            metavar="NAME",
            help="A stable, unique name for the in-process workers (with --workers N over "
            "1, each is NAME-1 ... NAME-N): after a crash a restart takes back the tasks "
            "they held within seconds instead of waiting for leases.",
        ),
    ] = None,
    thread_grace: ThreadGraceOption = 60.0,
    log_level: Annotated[str, _log_level_option()] = "info",
    log_format: Annotated[str, _log_format_option()] = "text",
    auth: Annotated[
        bool,
        typer.Option(
            "--auth/--no-auth",
            help="Require API keys (the default; create them with `tether keys create`). "
            "--no-auth lets anyone who reaches the port act as admin: a private network or "
            "a test only.",
        ),
    ] = True,
    rate_limit: Annotated[
        float | None,
        typer.Option(
            "--rate-limit", min=0.001, help="Requests per second per API key (429 beyond)."
        ),
    ] = None,
    max_body: Annotated[
        int,
        typer.Option("--max-body", min=1, help="Largest request body in bytes (413 beyond)."),
    ] = 4 * 1024 * 1024,
    webhook_secret: Annotated[
        str | None,
        typer.Option(
            "--webhook-secret",
            envvar="TETHER_WEBHOOK_SECRET",
            help="Signs the outcomes posted to runs' callback URLs (whsec_...; make one with "
            "`python -c 'import tether.webhooks as w; print(w.new_secret())'`). Without "
            "it, starts with a callback_url are refused.",
            show_default=False,
        ),
    ] = None,
    max_wait: Annotated[
        float,
        typer.Option(
            "--max-wait",
            min=0.1,
            max=86_400.0,
            help="Longest a GET .../result?wait= holds its connection, in seconds (keep it "
            "under your proxies' idle timeout).",
        ),
    ] = 60.0,
    webhook_max_backoff: Annotated[
        float,
        typer.Option(
            "--webhook-max-backoff",
            min=0.1,
            max=86_400.0,
            help="Longest wait in seconds between attempts to post one webhook (exponential "
            "from 1 s; deliveries are given up 3 days after the run ended).",
        ),
    ] = 300.0,
) -> None:
    """Serve MODULE:ATTR's HTTP API until SIGTERM or Ctrl+C (OpenAPI at /docs)."""
    missing = [m for m in ("fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        _fail(
            f"tether serve needs {' and '.join(missing)}: pip install 'tether[server]'",
            EXIT_USAGE,
        )
    check_worker_options(lease, worker_id, "--worker-id")
    if worker_id is not None and workers == 0:
        _fail(
            "--worker-id names the in-process workers: give --workers N too (a "
            "`tether worker` process takes its own --id)",
            EXIT_USAGE,
        )
    import uvicorn

    from ..server import create_api

    _setup_logging(log_level, log_format)
    app = load_app(app_spec)
    _check_store(app)
    api = create_api(
        app,
        workers=workers,
        worker_options={"lease": lease, "worker_id": worker_id},
        grace=grace,
        thread_grace=thread_grace,
        auth=auth,
        rate_limit=rate_limit,
        max_body=max_body,
        webhook_secret=webhook_secret,
        webhook_options={"max_backoff": webhook_max_backoff},
        max_wait=max_wait,
    )

    def announce(bound: int) -> None:
        """Say where the API listens, once the socket is bound (``--port 0``: the port
        the OS chose)."""
        where = f"[{host}]:{bound}" if ":" in host else f"{host}:{bound}"
        if not auth:
            _note(
                f"WARNING: --no-auth: API keys are OFF. Anyone who can reach {where} can "
                "start, read, cancel and terminate every tenant's runs. Use this on a "
                "private network or in a test only."
            )
        _note(
            f"tether serve {app_spec} on http://{where} ({workers} in-process worker(s); "
            f"API docs at /docs)"
        )

    # uvicorn stops on SIGTERM/SIGINT: it stops accepting, tells the API (event streams
    # end with a message to reconnect, the workers stop claiming and in-flight work gets
    # ``grace``), waits at most ``grace`` for open requests (then cancels them), then the
    # API's shutdown waits for the workers and releases what they still held. It raises
    # the signal again for whoever handled it before: here, so a graceful stop exits 0
    # uvicorn's loggers go through the root's JSON handler
    logs: dict[str, Any] = {"log_config": None} if log_format == "json" else {}
    config = uvicorn.Config(
        _quiet_start_failure(api),
        host=host,
        port=port,
        log_level=log_level.lower(),
        lifespan="on",
        timeout_graceful_shutdown=math.ceil(grace),
        **logs,
    )
    begin: Callable[[], None] = api.state.begin_shutdown

    class Server(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            # a failed start returns with should_exit set (and, before uvicorn 0.50,
            # without ``servers``): nothing was bound, so nothing is announced
            if self.should_exit or not getattr(self, "servers", None):
                return
            announce(_bound_port(self.servers, port))

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            begin()  # before uvicorn waits for open connections
            await super().shutdown(sockets)

    server = Server(config)
    previous = {sig: signal.signal(sig, _stopped) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run()
    except _Stopped:
        pass
    except SystemExit:  # uvicorn's, when the start failed (code 3)
        _say_why(api)
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    _say_why(api)
    if not server.started or api.state.start_failed:
        # e.g. the port is taken (uvicorn logged why; its exit code), or the store opened
        # late and the workers could not start then (logged)
        raise typer.Exit(3)
    _note(f"tether serve {app_spec} stopped")
    left: list[str] = api.state.left_threads
    if left:
        # Python would wait for these threads at exit (it joins them), perhaps forever:
        # the store is closed and their attempts are left to their leases, so exit now
        _note(
            f"tether serve: exiting with {len(left)} sync activity thread(s) still running "
            f"({', '.join(left)}); each step is retried by a worker once its lease expires"
        )
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _check_store(app: Any) -> None:
    """Open (then close) a store that is not PostgreSQL's, before the server starts: a
    SQLite path that cannot be opened is said in one line, as ``tether worker`` says it,
    with exit code 3. A PostgreSQL store is opened by the server as it starts (and, while
    the database is down, again in the background: ``server._opening``)."""
    spec = app._store_spec
    if not isinstance(spec, str | None) or (spec or "").startswith(_PG_SCHEMES):
        return  # a Store object given as it is, or PostgreSQL
    try:
        _ = app.store
    except TetherError as exc:
        _fail(str(exc), 3)
    finally:
        asyncio.run(app.close())


def _bound_port(servers: list[Any], asked: int) -> int:
    """The port uvicorn's listening socket is bound to (``asked`` if none is known)."""
    for server in servers:
        for sock in server.sockets or ():
            return int(sock.getsockname()[1])
    return asked


def _say_why(api: Any) -> None:
    """When the start failed for a reason tether knows (the store cannot be opened...),
    say it in one line and exit with code 3."""
    failure = api.state.start_error
    if isinstance(failure, TetherError):
        _fail(str(failure), 3)


def _quiet_start_failure(api: Any) -> Any:
    """``api`` for uvicorn, whose failed start, when tether says why (a ``TetherError``:
    the store cannot be opened), is not also logged as a traceback."""

    async def asgi(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "lifespan":
            await api(scope, receive, send)
            return

        async def quiet(message: Any) -> None:
            failed = message["type"] == "lifespan.startup.failed"
            if failed and isinstance(api.state.start_error, TetherError):
                message = {**message, "message": ""}
            await send(message)

        await api(scope, receive, quiet)

    return asgi


class _Stopped(Exception):
    """uvicorn finished a graceful shutdown on a signal."""


def _stopped(signum: int, _frame: object) -> None:
    raise _Stopped()
