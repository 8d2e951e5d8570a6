"""What every command shares: loading an App, opening a store, errors and exit
codes, JSON and rich output, common options.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import getpass
import importlib
import json
import logging
import os
import re
import socket
import sqlite3
import sys
import traceback
import urllib.parse
from collections.abc import AsyncIterator, Coroutine
from typing import Annotated, Any, NoReturn, TypeVar

import typer
from rich.console import Console
from rich.text import Text

from .._app import App
from .._errors import ConfigurationError, StoreError, TetherError
from .._history import RunInfo, RunStatus
from .._paging import MAX_PAGE
from ..store._open import _PG_SCHEMES
from ..store.base import Store

T = TypeVar("T")


EXIT_ERROR = 1


EXIT_USAGE = 2
#: the most rows one listing asks the store for (``--limit``)
MAX_LIMIT = MAX_PAGE
#: the most rows one transaction of a bulk command touches (``--batch``): more would
#: hold the store's writer long enough to stall workers
MAX_BATCH = 100_000


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


#: the units an age given on the command line takes (``--older-than``, ``--since``)
_AGE_UNITS = {"w": 604_800, "d": 86_400, "h": 3600, "m": 60, "s": 1}
_AGE_HINT = "e.g. 30d, 12h, 90m or 45s"


def parse_age(text: str, option: str) -> float:
    """``30d``, ``12h``, ``90m``, ``45s``, ``2w`` in seconds. A bare number is refused:
    seconds, minutes or days, each is somebody's guess, and these ages decide what is
    deleted."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", text)
    if m is None:
        raise UsageError(f"{option} {text!r} is not an age: write it with a unit, {_AGE_HINT}")
    if not m.group(2):
        raise UsageError(f"{option} {text.strip()}: give a unit, {_AGE_HINT}")
    return float(m.group(1)) * _AGE_UNITS[m.group(2)]


def format_age(seconds: float) -> str:
    """An age as it was understood: its largest whole unit and the seconds
    (``30d (2592000 s)``)."""
    exact = f"{seconds:g}" if seconds != int(seconds) else str(int(seconds))
    for unit, size in _AGE_UNITS.items():
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit} ({exact} s)"
    return f"{exact} s"


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
    if module_name.endswith(".py") or "/" in module_name or os.sep in module_name:
        dotted = module_name.removesuffix(".py").replace(os.sep, "/")
        if dotted.startswith(("/", "../")):  # run from the file's own folder: its name
            dotted = dotted.rsplit("/", 1)[-1]
        dotted = dotted.strip("./")
        raise UsageError(
            f"{spec!r} names a file: MODULE is the module's name as Python imports it, "
            f"for example '{dotted.replace('/', '.')}:{attr}' run from the directory that "
            "holds it"
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


def cli_actor() -> str:
    """How the audit log names a person acting from this shell: ``cli user@host``."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (a bare container)
        user = f"uid {os.getuid()}"
    return f"cli {user}@{socket.gethostname()}"


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
    elif spec.startswith(_PG_SCHEMES):
        _refuse_missing_pg_store(spec)
    return App(store=spec)


def _refuse_missing_pg_store(url: str) -> None:
    """Refuse a PostgreSQL database or schema without tether's tables: opening it would
    create them (a mistyped ``?schema=``, an application's own database)."""
    try:
        import psycopg

        from ..store.postgres import _cannot_connect, _redact, _split_url
    except ImportError:
        return  # opening the store explains what to install
    try:
        conninfo, schema = _split_url("postgresql://" + url.split("://", 1)[1])
    except ValueError:
        return  # opening the store reports the bad URL
    try:
        conn = psycopg.connect(conninfo, autocommit=True, connect_timeout=10)
    except psycopg.Error as exc:  # said now: the store would wait for the same again
        raise StoreError(_cannot_connect(conninfo, exc)) from None
    try:
        with conn:
            if schema is None:
                row = conn.execute("SELECT to_regclass('tether_meta'), current_schema()")
            else:
                row = conn.execute(
                    "SELECT to_regclass(quote_ident(%s::text) || '.tether_meta'), %s::text",
                    (schema, schema),
                )
            found, where = row.fetchone() or (None, None)
    except psycopg.Error:
        return  # opening the store reports why, with its advice
    if found is None:
        raise StoreError(
            f"no tether store in PostgreSQL {_redact(conninfo)} (schema {where or 'public'!r}): "
            "it has no tether tables, and this command does not create them; point --store at the "
            "database (and ?schema=) your workers use. A store is created by the first "
            "worker or App that opens it (e.g. `tether worker MODULE:ATTR`)"
        )


def _schema_of(path: str) -> tuple[int, int]:
    """(tether schema version, tables) of the SQLite file at ``path``, read-only;
    ``sqlite3.Error`` when it is not an SQLite database."""
    conn = sqlite3.connect(f"file:{urllib.parse.quote(path)}?mode=ro", uri=True)
    try:
        (version,) = conn.execute("PRAGMA user_version").fetchone()
        (tables,) = conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
    finally:
        conn.close()
    return int(version), int(tables)


def _refuse_foreign_database(path: str) -> None:
    """Refuse an SQLite file without tether's schema: opening it would add tether's tables
    (to another application's database, or to an empty file: a `touch`, a failed tool)."""
    try:
        version, tables = _schema_of(path)
    except sqlite3.Error:
        return  # not readable as SQLite: the store reports it (and leaves it alone)
    if version == 0 and not tables:
        raise StoreError(
            f"no tether store at {path!r}: the file is empty (no tables), and this command "
            "does not create a store; point --store at the database your workers use. A "
            "store is created by the first worker or App that opens it"
        )
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
    try:
        return datetime.datetime.fromtimestamp(value).strftime("%Y-%m-%d %H:%M:%S")
    except (OverflowError, ValueError, OSError):  # a stored time no calendar shows
        return repr(value)


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


def _log_level_option() -> Any:
    return typer.Option("--log-level", help="Logging level: debug, info, warning, error.")


#: ``--thread-grace`` of ``tether worker`` and ``tether serve`` (one definition)
ThreadGraceOption = Annotated[
    float,
    typer.Option(
        "--thread-grace",
        metavar="SECONDS",
        min=0.0,
        max=86_400.0,
        help="After --grace, how much longer a sync activity's thread is waited for; "
        "then the process exits without it and its attempt is retried by another worker "
        "once its lease expires.",
    ),
]


def _log_format_option() -> Any:
    return typer.Option(
        "--log-format",
        help="text, or json: one JSON object per line with the run and step (tether.logs).",
    )


def _setup_logging(log_level: str, log_format: str) -> None:
    """Log to stderr at ``log_level``, as text lines or as JSON (``tether.logs``)."""
    level = logging.getLevelName(log_level.upper())
    if not isinstance(level, int):
        _fail(f"unknown --log-level {log_level!r}", EXIT_USAGE)
    if log_format not in ("text", "json"):
        _fail(f"--log-format is text or json (got {log_format!r})", EXIT_USAGE)
    if log_format == "json":
        from ..logs import configure

        configure(level)
    else:
        logging.basicConfig(
            level=level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
