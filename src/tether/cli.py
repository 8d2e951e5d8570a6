"""The ``tether`` command line: serve workers, start runs, inspect and steer them.

    tether worker myproject.flows:app
    tether start myproject.flows:app summarise '"https://example.com"' --wait
    tether runs --status running
    tether queues --store postgresql://db/tether
    tether signal RUN_ID approve '{"by": "ada"}'

Needs the ``cli`` extra (typer and rich): ``pip install 'tether[cli]'``.
Exit codes: 0 success, 1 a tether error (unknown run, unreadable store, failed
run...), 2 a usage error (bad arguments, bad JSON, bad MODULE:ATTR).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import importlib
import json
import logging
import os
import signal
import sqlite3
import sys
import traceback
import urllib.parse
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Annotated, Any, NoReturn, TypeVar

from ._app import App, Run
from ._errors import ConfigurationError, PayloadError, StoreError, TetherError
from ._history import RunInfo, RunStatus, describe_waiting
from ._queues import QueueStats
from ._serde import encode
from ._worker import Worker
from .store.base import Store

try:
    import typer
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text
except ImportError as _exc:  # the optional ``cli`` extra is not installed
    _MISSING: ImportError | None = _exc
else:
    _MISSING = None

T = TypeVar("T")

EXIT_ERROR = 1
EXIT_USAGE = 2
DEFAULT_STORE = "./tether.db"

_STATUS_STYLE = {
    RunStatus.QUEUED: "dim yellow",
    RunStatus.PENDING: "yellow",
    RunStatus.RUNNING: "cyan",
    RunStatus.SUSPENDED: "magenta",
    RunStatus.COMPLETED: "green",
    RunStatus.FAILED: "bold red",
    RunStatus.CANCELLED: "red",
    RunStatus.TERMINATED: "red",
    RunStatus.CONTINUED_AS_NEW: "blue",
}


class UsageError(Exception):
    """A bad argument the user must fix; reported with exit code 2."""


# -- plumbing ---------------------------------------------------------------------


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _fail(message: str, code: int) -> NoReturn:
    """Print ``error: message`` on one line to stderr and exit with ``code``."""
    print(f"error: {_one_line(message)}", file=sys.stderr)
    raise SystemExit(code)


def _note(message: str) -> None:
    """A progress line on stderr (keeps stdout for results)."""
    print(message, file=sys.stderr, flush=True)


def _run(coro: Coroutine[Any, Any, T]) -> T:
    """Run one command's coroutine, turning tether errors into one-line messages."""
    try:
        return asyncio.run(coro)
    except UsageError as exc:
        _fail(str(exc), EXIT_USAGE)
    except TetherError as exc:
        _fail(str(exc), EXIT_ERROR)
    except KeyboardInterrupt:
        _note("interrupted (runs already started go on)")
        raise SystemExit(130) from None


def _describe_exception(exc: BaseException) -> str:
    """``Type: message (file, line N)`` for an exception raised by user code."""
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, SyntaxError) and exc.filename:
        return f"{type(exc).__name__}: {exc.msg} ({exc.filename}, line {exc.lineno})"
    frames = traceback.extract_tb(exc.__traceback__)
    if frames:
        last = frames[-1]
        text += f" ({last.filename}, line {last.lineno})"
    return text


def load_app(spec: str) -> App:
    """Import ``MODULE:ATTR`` (from the current directory first) and return that App."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise UsageError(
            f"{spec!r} is not of the form MODULE:ATTR (for example 'myproject.flows:app')"
        )
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if missing and (module_name == missing or module_name.startswith(missing + ".")):
            raise ConfigurationError(
                f"cannot import {module_name!r}: no module named {missing!r} in the current "
                f"directory ({cwd}) or on PYTHONPATH"
            ) from None
        raise ConfigurationError(
            f"importing {module_name!r} failed: {_describe_exception(exc)}"
        ) from None
    except Exception as exc:
        raise ConfigurationError(
            f"importing {module_name!r} failed: {_describe_exception(exc)}"
        ) from None
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigurationError(
                f"module {module_name!r} has no attribute {attr!r}; "
                "point MODULE:ATTR at the tether.App instance"
            ) from None
    if not isinstance(obj, App):
        raise ConfigurationError(
            f"{spec} is not a tether.App (it is of type {type(obj).__name__}); "
            "point MODULE:ATTR at the tether.App instance"
        )
    return obj


def _sqlite_path(spec: str) -> str | None:
    """The file a store spec names, or None for in-memory and non-file URLs."""
    if spec in (":memory:", "sqlite://:memory:"):
        return None
    if spec.startswith("sqlite:///"):
        return spec[len("sqlite:///") :]
    if "://" in spec:
        return None  # open_store explains what it does not support
    return spec


def _client_app(store: str | None, app_spec: str | None) -> App:
    """The App a client command talks to: from ``--app`` or a bare store ``--store``."""
    if store is not None and app_spec is not None:
        raise UsageError("pass either --store or --app, not both")
    if app_spec is not None:
        return load_app(app_spec)
    spec = store if store is not None else DEFAULT_STORE
    path = _sqlite_path(spec)
    if path is not None and not os.path.exists(path):
        # opening would create an empty store; a typo should not do that
        raise StoreError(
            f"no tether store at {path!r}: the file does not exist; pass --store PATH "
            "(or --app MODULE:ATTR) to point at the database your workers use"
        )
    if path is not None:
        _refuse_foreign_database(path)
    return App(store=spec)


def _refuse_foreign_database(path: str) -> None:
    """Refuse an SQLite file without tether's schema: opening it would add tether's tables."""
    try:
        conn = sqlite3.connect(f"file:{urllib.parse.quote(path)}?mode=ro", uri=True)
        try:
            (version,) = conn.execute("PRAGMA user_version").fetchone()
            tables = conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]
        finally:
            conn.close()
    except sqlite3.Error:
        return  # not readable as SQLite: the store reports it (and leaves it alone)
    if version == 0 and tables:
        raise StoreError(
            f"store {path!r} is an SQLite database but not a tether store (it has other "
            "tables and no tether schema); tether did not modify it: point --store at the "
            "database your workers use"
        )


@contextlib.asynccontextmanager
async def _opened(app: App) -> AsyncIterator[App]:
    """Open the app's store (errors surface here) and close it when done."""
    try:
        _ = app.store  # opening raises StoreError for a bad path or file
        yield app
    finally:
        await app.close()


def _describe_store(store: Store) -> str:
    path = getattr(store, "path", None)
    if isinstance(path, str):
        return path if path == ":memory:" else os.path.abspath(path)
    return type(store).__name__


def _parse_json(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(
            f"{what} is not valid JSON ({exc.msg}): {text!r}; quote strings as JSON, "
            """e.g. '"hello"'"""
        ) from None


def _maybe_json(text: str | None) -> Any:
    if text is None:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _info_dict(info: RunInfo) -> dict[str, Any]:
    """A run's info as plain JSON values (input and output decoded)."""
    data = dataclasses.asdict(info)
    data["status"] = info.status.value
    data["input"] = _maybe_json(info.input)
    data["output"] = _maybe_json(info.output)
    return data


def _dump(value: Any) -> None:
    sys.stdout.write(json.dumps(value, indent=2, default=str) + "\n")


def _ts(value: float | None) -> str:
    if value is None:
        return "-"
    return datetime.datetime.fromtimestamp(value).strftime("%Y-%m-%d %H:%M:%S")


def _short_json(value: Any, limit: int = 60) -> str:
    if value is None:
        return ""
    text = json.dumps(value, separators=(",", ":"), default=str)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _console() -> Console:
    # not a terminal: don't squeeze tables to 80 columns (ids must survive `| grep`)
    wide = not sys.stdout.isatty() and "COLUMNS" not in os.environ
    return Console(width=1000 if wide else None, highlight=False)


def _status_text(status: RunStatus) -> Text:
    return Text(status.value, style=_STATUS_STYLE.get(status, ""))


# -- shared options ---------------------------------------------------------------
# (called lazily, when typer evaluates the annotations, so typer may be missing)


def _store_option() -> Any:
    return typer.Option(
        "--store",
        "-s",
        metavar="URL",
        help=f"Store to read: a SQLite path or sqlite:///path (default {DEFAULT_STORE}).",
        show_default=False,
    )


def _app_option() -> Any:
    return typer.Option(
        "--app",
        "-a",
        metavar="MODULE:ATTR",
        help="Use the store of this tether.App instead of --store.",
        show_default=False,
    )


def _run_id_argument() -> Any:
    return typer.Argument(metavar="RUN_ID", help="The run's id.", show_default=False)


def _reason_option() -> Any:
    return typer.Option("--reason", "-r", help="Recorded in the run's history.")


# -- worker -----------------------------------------------------------------------


def worker_command(
    app_spec: Annotated[
        str,
        typer.Argument(
            metavar="MODULE:ATTR", help="The tether.App to serve, e.g. myproject.flows:app."
        ),
    ],
    queue: Annotated[
        list[str] | None,
        typer.Option(
            "--queue",
            "-q",
            metavar="Q",
            help="Queue to serve; repeat for several (default: every queue the app uses).",
            show_default=False,
        ),
    ] = None,
    concurrency: Annotated[
        int, typer.Option("--concurrency", "-c", min=1, help="Tasks run at once, at most.")
    ] = 100,
    lease: Annotated[
        float,
        typer.Option(
            "--lease",
            metavar="SECONDS",
            help="How long a claimed task stays ours without renewal.",
        ),
    ] = 15.0,
    grace: Annotated[
        float,
        typer.Option(
            "--grace",
            metavar="SECONDS",
            min=0.0,
            help="On SIGTERM/Ctrl+C, how long in-flight work may take to finish.",
        ),
    ] = 10.0,
    log_level: Annotated[
        str, typer.Option("--log-level", help="Logging level: debug, info, warning, error.")
    ] = "info",
    worker_id: Annotated[
        str | None,
        typer.Option(
            "--id",
            metavar="NAME",
            help="A stable, unique name for this worker (e.g. worker-1): after a crash its "
            "restart takes back the tasks it held at once instead of waiting for leases.",
        ),
    ] = None,
    version: Annotated[
        list[str] | None,
        typer.Option(
            "--version",
            metavar="V",
            help="Only continue runs recorded by these workflow versions; repeat for several.",
        ),
    ] = None,
) -> None:
    """Serve MODULE:ATTR's workflows and activities until SIGTERM or Ctrl+C."""
    if lease <= 0:
        _fail("--lease must be positive", EXIT_USAGE)
    level = logging.getLevelName(log_level.upper())
    if not isinstance(level, int):
        _fail(f"unknown --log-level {log_level!r}", EXIT_USAGE)
    logging.basicConfig(
        level=level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    code = _run(
        _serve(app_spec, queue or None, concurrency, lease, grace, worker_id, version or None)
    )
    raise SystemExit(code)


def _add_signal_handlers(
    loop: asyncio.AbstractEventLoop, handler: Callable[[signal.Signals], None]
) -> list[signal.Signals]:
    installed = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, handler, sig)
        except (NotImplementedError, RuntimeError):  # e.g. Windows: plain handler
            signal.signal(sig, lambda s, _f: loop.call_soon_threadsafe(handler, signal.Signals(s)))
        else:
            installed.append(sig)
    return installed


async def _hint_foreign_leases(app: App, w: Worker) -> None:
    """Say plainly when work waits for other workers' leases (a crashed worker's tasks
    resume only when they expire, unless it restarts with the same --id)."""
    probe = getattr(app.store, "foreign_leases", None)
    if probe is None:
        return
    count, until = await probe(w.queues, w.id)
    if count and until is not None:
        left = max(0.0, until - app.store.clock())
        _note(
            f"tether worker {w.id}: {count} task(s) on these queues are leased to other "
            f"worker ids for up to {left:.0f}s more; if those workers are gone, their work "
            "resumes here when the leases expire (start workers with a stable --id NAME and "
            "a restarted one takes its tasks back at once)"
        )


async def _serve(
    app_spec: str,
    queues: list[str] | None,
    concurrency: int,
    lease: float,
    grace: float,
    worker_id: str | None = None,
    versions: list[str] | None = None,
) -> int:
    app = load_app(app_spec)
    async with _opened(app):
        w = app.worker(
            queues=queues,
            concurrency=concurrency,
            lease=lease,
            worker_id=worker_id,
            versions=versions,
        )
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()

        def on_signal(sig: signal.Signals) -> None:
            if stop.is_set():
                _note(f"tether worker {w.id}: {sig.name} again, exiting without waiting")
                os._exit(EXIT_ERROR)  # leases expire and other workers take the work over
            _note(
                f"tether worker {w.id}: {sig.name} received, finishing in-flight work "
                f"(up to {grace:g}s; send it again to exit at once)"
            )
            stop.set()

        installed = _add_signal_handlers(loop, on_signal)
        try:
            await w.start()
            _note(
                f"tether worker {w.id} serving queues {', '.join(w.queues)} on store "
                f"{_describe_store(app.store)} (concurrency {concurrency}, lease {lease:g}s)"
            )
            await _hint_foreign_leases(app, w)
            serving = asyncio.create_task(w.run())
            stopping = asyncio.create_task(stop.wait())
            await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
            stopping.cancel()
            code = 0
            if serving.done() and not serving.cancelled() and serving.exception() is not None:
                exc = serving.exception()
                assert exc is not None
                _note(f"error: tether worker {w.id} crashed: {_describe_exception(exc)}")
                code = EXIT_ERROR
            try:
                await w.stop(grace=grace)
            except Exception as exc:
                if code == 0:
                    _note(f"error: tether worker {w.id} failed to stop cleanly: {exc}")
                code = EXIT_ERROR
            serving.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await serving
        finally:
            for sig in installed:
                loop.remove_signal_handler(sig)
    _note(f"tether worker {w.id} stopped")
    return code


# -- client commands ----------------------------------------------------------------


def runs_command(
    store: Annotated[str | None, _store_option()] = None,
    app: Annotated[str | None, _app_option()] = None,
    status: Annotated[
        RunStatus | None, typer.Option("--status", help="Only runs with this status.")
    ] = None,
    workflow: Annotated[
        str | None, typer.Option("--workflow", "-w", help="Only runs of this workflow.")
    ] = None,
    limit: Annotated[int, typer.Option("--limit", "-n", min=1, help="Show at most N runs.")] = 50,
    waiting_for: Annotated[
        str | None,
        typer.Option(
            "--waiting-for",
            metavar="KIND",
            help="Only live runs waiting for: signal (or signal:NAME), timer, activity, "
            "child, admission.",
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """List runs, newest first, with what each live run waits for."""

    async def go() -> list[RunInfo]:
        async with _opened(_client_app(store, app)) as a:
            return await a.list(
                status=status, workflow=workflow, limit=limit, waiting_for=waiting_for
            )

    infos = _run(go())
    if as_json:
        _dump([_info_dict(i) for i in infos])
        return
    if not infos:
        _note("no runs found")
        return
    table = Table(show_edge=False, header_style="bold")
    table.add_column("run id", no_wrap=True)
    table.add_column("workflow")
    table.add_column("status", no_wrap=True)
    table.add_column("custom status")
    table.add_column("waiting for")
    table.add_column("created", no_wrap=True)
    table.add_column("updated", no_wrap=True)
    for info in infos:
        table.add_row(
            Text(info.run_id),
            Text(info.workflow),
            _status_text(info.status),
            Text(_short_json(info.custom_status)),
            Text(describe_waiting(info.waiting_on)),
            _ts(info.created_at),
            _ts(info.updated_at),
        )
    _console().print(table)


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


def get_command(
    run_id: Annotated[str, _run_id_argument()],
    store: Annotated[str | None, _store_option()] = None,
    app: Annotated[str | None, _app_option()] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Show one run: status, custom status, input, result or error, timestamps."""

    async def go() -> RunInfo:
        async with _opened(_client_app(store, app)) as a:
            return await a.get(run_id)

    info = _run(go())
    if as_json:
        _dump(_info_dict(info))
        return
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column()
    rows: list[tuple[str, Text | str]] = [
        ("run id", Text(info.run_id)),
        ("workflow", Text(info.workflow)),
        ("status", _status_text(info.status)),
        ("custom status", Text(_short_json(info.custom_status, 500))),
        ("queue", Text(info.queue)),
        ("created", _ts(info.created_at)),
        ("updated", _ts(info.updated_at)),
        ("completed", _ts(info.completed_at)),
        ("input", Text(info.input)),
    ]
    if info.output is not None:
        rows.append(("output", Text(info.output)))
    if info.error:
        err = info.error
        rows.append(("error", Text(f"{err.get('type', 'Error')}: {err.get('message', '')}")))
    if info.task_error:
        rows.append(("task error", Text(info.task_error)))
    if info.parent_run_id:
        rows.append(("parent run", Text(info.parent_run_id)))
    if info.continued_to:
        rows.append(("continued to", Text(info.continued_to)))
    for key, value in rows:
        grid.add_row(key, value)
    _console().print(grid)


def history_export_command(
    run_id: Annotated[str, _run_id_argument()],
    store: Annotated[str | None, _store_option()] = None,
    app: Annotated[str | None, _app_option()] = None,
) -> None:
    """Print a run's info and full history as JSON: {"run": {...}, "events": [...]}."""

    async def go() -> dict[str, Any]:
        async with _opened(_client_app(store, app)) as a:
            info = await a.get(run_id)
            events = await a.history(run_id)
            return {"run": _info_dict(info), "events": [e.to_json() for e in events]}

    _dump(_run(go()))


def signal_command(
    run_id: Annotated[str, _run_id_argument()],
    name: Annotated[str, typer.Argument(metavar="NAME", help="The signal's name.")],
    payload: Annotated[
        str | None,
        typer.Argument(metavar="JSON_PAYLOAD", help="The payload as JSON (default null)."),
    ] = None,
    store: Annotated[str | None, _store_option()] = None,
    app: Annotated[str | None, _app_option()] = None,
) -> None:
    """Send the signal NAME (with an optional JSON payload) to a run."""
    value = None
    if payload is not None:
        try:
            value = _parse_json(payload, "JSON_PAYLOAD")
        except UsageError as exc:
            _fail(str(exc), EXIT_USAGE)

    _act(
        store, app, lambda a: a.signal(run_id, name, value), f"signal {name!r} sent to run {run_id}"
    )


def _act(
    store: str | None,
    app: str | None,
    action: Callable[[App], Coroutine[Any, Any, None]],
    done: str,
) -> None:
    """Open the store, do one thing to a run, say what was done."""

    async def go() -> None:
        async with _opened(_client_app(store, app)) as a:
            await action(a)

    _run(go())
    print(done)


def cancel_command(
    run_id: Annotated[str, _run_id_argument()],
    reason: Annotated[str | None, _reason_option()] = None,
    store: Annotated[str | None, _store_option()] = None,
    app: Annotated[str | None, _app_option()] = None,
) -> None:
    """Ask a run to cancel; its code sees the cancellation at its next await."""
    _act(store, app, lambda a: a.cancel(run_id, reason), f"cancellation requested for run {run_id}")


def terminate_command(
    run_id: Annotated[str, _run_id_argument()],
    reason: Annotated[str | None, _reason_option()] = None,
    store: Annotated[str | None, _store_option()] = None,
    app: Annotated[str | None, _app_option()] = None,
) -> None:
    """End a run (and its running children) now, running none of its code."""
    _act(store, app, lambda a: a.terminate(run_id, reason), f"run {run_id} terminated")


def suspend_command(
    run_id: Annotated[str, _run_id_argument()],
    store: Annotated[str | None, _store_option()] = None,
    app: Annotated[str | None, _app_option()] = None,
) -> None:
    """Pause a run: no new steps are dispatched until resume."""
    _act(store, app, lambda a: a.suspend(run_id), f"run {run_id} suspended")


def resume_command(
    run_id: Annotated[str, _run_id_argument()],
    store: Annotated[str | None, _store_option()] = None,
    app: Annotated[str | None, _app_option()] = None,
) -> None:
    """Continue a suspended run."""
    _act(store, app, lambda a: a.resume(run_id), f"run {run_id} resumed")


def start_command(
    app_spec: Annotated[
        str,
        typer.Argument(metavar="MODULE:ATTR", help="The tether.App defining the workflow."),
    ],
    workflow: Annotated[str, typer.Argument(metavar="WORKFLOW", help="The workflow's name.")],
    args: Annotated[
        list[str] | None,
        typer.Argument(
            metavar="JSON_ARGS",
            help="Positional arguments, each as JSON (strings quoted: '\"text\"'; put -- "
            "before negative numbers).",
            show_default=False,
        ),
    ] = None,
    run_id: Annotated[
        str | None,
        typer.Option(
            "--run-id", help="Run id to use; starting again with the same input is a no-op."
        ),
    ] = None,
    wait: Annotated[
        bool,
        typer.Option(
            "--wait",
            help="Wait for the run to finish and print its result as JSON. Needs a worker "
            "running elsewhere (tether worker MODULE:ATTR); this command does not run it.",
        ),
    ] = False,
    timeout: Annotated[
        float | None,
        typer.Option(
            "--timeout",
            metavar="SECONDS",
            help="With --wait: give up waiting after this long (the run goes on).",
        ),
    ] = None,
) -> None:
    """Start a run of WORKFLOW and print its id (and its result with --wait)."""
    try:
        values = [_parse_json(a, f"argument {i}") for i, a in enumerate(args or [], 1)]
    except UsageError as exc:
        _fail(str(exc), EXIT_USAGE)

    async def go() -> None:
        async with _opened(load_app(app_spec)) as a:
            try:
                run: Run[Any] = await a.start(workflow, *values, run_id=run_id)
            except PayloadError as exc:  # arguments do not bind or do not match the types
                raise UsageError(str(exc)) from None
            print(run.run_id, flush=True)
            if wait:
                result = await run.result(timeout)
                print(encode(result, "the run's result"))

    _run(go())


def _parse_age(text: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
    try:
        return float(text[:-1]) * units[text[-1]] if text[-1] in units else float(text)
    except (ValueError, IndexError):
        raise UsageError(f"--since takes an age like 30m, 12h or 7d (got {text!r})") from None


def replay_command(
    files: Annotated[
        list[str] | None,
        typer.Argument(metavar="[HISTORY.json]...", help="Files from `tether history export`."),
    ] = None,
    app: Annotated[
        str, typer.Option("--app", metavar="MODULE:ATTR", help="The App with today's code.")
    ] = "",
    store: Annotated[str | None, _store_option()] = None,
    workflow: Annotated[
        str | None, typer.Option("--workflow", help="With --store: only this workflow.")
    ] = None,
    since: Annotated[
        str | None, typer.Option("--since", help="With --store: runs created within (7d, 12h).")
    ] = None,
    limit: Annotated[int, typer.Option("--limit", help="With --store: at most N runs.")] = 1000,
) -> None:
    """Replay recorded histories against today's code; exit 1 on any non-determinism."""
    from .testing import check_history, load_files

    if not app:
        raise UsageError("--app MODULE:ATTR is required: it names the code to check")
    code = load_app(app)
    histories = load_files(files or [])
    if store is not None:
        age = _parse_age(since) if since else None

        async def fetch() -> list[list[Any]]:
            async with _opened(_client_app(store, None)) as a:
                runs = await a.list(workflow=workflow, limit=limit)
                now = a.store.clock()
                picked = [r for r in runs if age is None or now - r.created_at <= age]
                return [await a.history(r.run_id) for r in picked]

        histories += _run(fetch())
    if not histories:
        raise UsageError("nothing to replay: pass exported files or --store")
    failed = 0
    for events in histories:
        report = check_history(code, events)
        if report.ok:
            print(f"ok    {report.run_id} ({report.workflow}, {len(report.recorded)} commands)")
            continue
        failed += 1
        print(f"FAIL  {report.run_id} ({report.workflow}): {report.error}")
        print(report.diff())
    print(f"{len(histories) - failed} passed, {failed} failed")
    if failed:
        raise SystemExit(1)


# -- testing --------------------------------------------------------------------------


def cassette_export_command(
    run_id: Annotated[str, _run_id_argument()],
    store: Annotated[str | None, _store_option()] = None,
    app: Annotated[str | None, _app_option()] = None,
) -> None:
    """Print a run's activity calls as a cassette (JSON) to replay in a regression test."""
    from .testing import Cassette

    async def go() -> dict[str, Any]:
        async with _opened(_client_app(store, app)) as a:
            events = await a.history(run_id)
            return Cassette.from_history(events).to_json()

    _dump(_run(go()))


def _load_target(spec: str) -> tuple[Any, App | None]:
    """``MODULE:ATTR`` naming an activity, workflow or function, and the App defining it."""
    from ._definitions import Workflow

    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise UsageError(f"{spec!r} is not of the form MODULE:TARGET (e.g. 'evals:classify')")
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise ConfigurationError(
            f"cannot import {module_name!r}: {_describe_exception(exc)}"
        ) from None
    target = getattr(module, attr, None)
    if target is None or not callable(target):
        raise UsageError(f"{module_name!r} has no activity, workflow or function named {attr!r}")
    owner = None
    if isinstance(target, Workflow):
        for value in vars(module).values():
            if isinstance(value, App) and value._workflows.get(target.name) is not None:
                owner = value
                break
    return target, owner


def eval_command(
    target: Annotated[
        str,
        typer.Argument(
            metavar="MODULE:TARGET", help="The activity, workflow or function to evaluate."
        ),
    ],
    cases: Annotated[
        str,
        typer.Argument(
            metavar="CASES.jsonl",
            help='One case per line: {"input": ..., "expected": ...} or {"args": [...], ...}.',
        ),
    ],
    min_accuracy: Annotated[
        float | None, typer.Option("--min-accuracy", help="Exit 1 if accuracy is lower.")
    ] = None,
    max_p95_ms: Annotated[
        float | None, typer.Option("--max-p95-ms", help="Exit 1 if p95 latency is higher.")
    ] = None,
    max_error_rate: Annotated[
        float | None,
        typer.Option("--max-error-rate", help="Exit 1 if more cases raise (0..1)."),
    ] = None,
    app: Annotated[
        str | None,
        typer.Option(
            "--app",
            metavar="MODULE:ATTR",
            help="The App of a workflow target (default: the App in the target's module).",
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print metrics as JSON.")] = False,
) -> None:
    """Evaluate a target over labelled cases; exit 1 below the thresholds."""
    from .testing import EvaluationFailed, aevaluate, load_cases

    thresholds: dict[str, float] = {}
    if min_accuracy is not None:
        thresholds["accuracy"] = min_accuracy
    if max_p95_ms is not None:
        thresholds["p95_ms"] = max_p95_ms
    if max_error_rate is not None:
        thresholds["error_rate"] = max_error_rate
    if not os.path.exists(cases):
        _fail(f"no cases file at {cases!r}", EXIT_USAGE)

    async def go() -> Any:
        fn, owner = _load_target(target)
        code = load_app(app) if app else owner
        try:
            return await aevaluate(fn, load_cases(cases), app=code, thresholds=thresholds)
        except EvaluationFailed as exc:
            return exc.report

    report = _run(go())
    if as_json:
        _dump(
            {
                "target": report.target,
                "cases": report.total,
                "accuracy": report.accuracy,
                "error_rate": report.error_rate,
                "errors_by_type": report.errors_by_type,
                "p50_ms": report.p50_ms,
                "p95_ms": report.p95_ms,
                "total_cost": report.total_cost,
                "confusion": report.confusion,
                "thresholds": report.thresholds,
                "shortfalls": report.shortfalls(),
            }
        )
    else:
        print(report.table())
    if not report.ok:
        raise SystemExit(EXIT_ERROR)


# -- store ----------------------------------------------------------------------------


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
    exists in the target; exits 1 if the copy does not match its source.
    """
    from .store.migrate import MigrationReport, migrate

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


# -- wiring ---------------------------------------------------------------------------


def _build() -> typer.Typer:
    cli = typer.Typer(
        name="tether",
        help="Durable workflows: run workers, start runs, inspect and steer them.",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_show_locals=False,
        context_settings={"help_option_names": ["-h", "--help"]},
    )
    cli.command("worker")(worker_command)
    cli.command("start")(start_command)
    cli.command("runs")(runs_command)
    cli.command("queues")(queues_command)
    cli.command("get")(get_command)
    cli.command("signal")(signal_command)
    cli.command("cancel")(cancel_command)
    cli.command("terminate")(terminate_command)
    cli.command("suspend")(suspend_command)
    cli.command("resume")(resume_command)
    cli.command("replay")(replay_command)
    history = typer.Typer(
        help="Inspect run histories.",
        no_args_is_help=True,
        context_settings={"help_option_names": ["-h", "--help"]},
    )
    history.command("export")(history_export_command)
    cli.add_typer(history, name="history")
    store = typer.Typer(
        help="Manage stores: copy runs between them.",
        no_args_is_help=True,
        context_settings={"help_option_names": ["-h", "--help"]},
    )
    store.command("migrate")(store_migrate_command)
    cli.add_typer(store, name="store")
    cli.command("eval")(eval_command)
    cassette = typer.Typer(
        help="Turn recorded runs into regression tests.",
        no_args_is_help=True,
        context_settings={"help_option_names": ["-h", "--help"]},
    )
    cassette.command("export")(cassette_export_command)
    cli.add_typer(cassette, name="cassette")
    return cli


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``tether`` console script."""
    if _MISSING is not None:
        print(
            f"error: the tether command line needs typer and rich ({_MISSING}); "
            "install them with: pip install 'tether[cli]'",
            file=sys.stderr,
        )
        raise SystemExit(EXIT_USAGE)
    _build()(args=argv, prog_name="tether")


if __name__ == "__main__":
    main()
