"""What a new user types at the ``tether`` command line: a wrong path, a wrong URL, a
file that is not what the command wants. Each gets one ``error:`` line naming the
problem, and nothing on disk or in a database is changed.

Driven as real subprocesses, like tests/test_cli.py.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

import tether
from conftest import PG_URL, with_schema
from tether import StoreError

CMD_TIMEOUT = 60.0

FLOWS = """
import tether

app = tether.App(store={store!r})


@app.activity
async def shout(text: str) -> str:
    return text.upper()


@app.workflow
async def hello(name: str) -> str:
    return f"hello {{name}}"
"""


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("COLUMNS", None)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(tether.__file__).parent.parent), *sys.path])
    return env


def cli(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tether.cli", *args],
        cwd=cwd,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=CMD_TIMEOUT,
        check=False,
    )


def one_line_error(res: subprocess.CompletedProcess[str], code: int, *needles: str) -> str:
    """Assert a clean failure: the exit code, one ``error:`` line, no traceback."""
    assert res.returncode == code, (res.returncode, res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("error: "), res.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "flows.py").write_text(FLOWS.format(store=f"sqlite:///{tmp_path / 'tether.db'}"))
    return tmp_path


def _journal_mode(path: Path) -> str:
    conn = sqlite3.connect(path)
    try:
        return str(conn.execute("PRAGMA journal_mode").fetchone()[0])
    finally:
        conn.close()


def _foreign_sqlite(path: Path, user_version: int = 0) -> bytes:
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE notes (body TEXT)")
    conn.execute("INSERT INTO notes VALUES ('my data')")
    conn.execute(f"PRAGMA user_version = {user_version}")
    conn.commit()
    conn.close()
    return path.read_bytes()


# -- tether demo --store ------------------------------------------------------------


def test_demo_refuses_a_store_it_did_not_make(project: Path) -> None:
    res = cli(project, "start", "flows:app", "hello", '"important"', "--run-id", "keep-me")
    assert res.returncode == 0, res.stderr
    prod = project / "tether.db"
    notes = project / "notes.sqlite"
    content = _foreign_sqlite(notes)
    before = {p.name for p in project.iterdir()}
    for target in (prod, notes):
        res = cli(project, "demo", "--store", str(target), "--fast", "--auto-approve", "--no-crash")
        one_line_error(res, 1, str(target), "not a store the demo made", "did not modify")
    assert {p.name for p in project.iterdir()} == before
    assert notes.read_bytes() == content
    res = cli(project, "get", "keep-me", "--store", str(prod), "--json")
    assert res.returncode == 0 and json.loads(res.stdout)["run_id"] == "keep-me", res.stderr


# -- SQLite paths SQLite cannot open, and other programs' SQLite files ---------------


def test_a_store_path_sqlite_cannot_open_is_one_clear_error(tmp_path: Path) -> None:
    res = cli(tmp_path, "runs", "--store", str(tmp_path))
    one_line_error(res, 1, str(tmp_path), "is a directory")
    with pytest.raises(StoreError, match="is a directory"):
        _ = tether.App(store=str(tmp_path)).store


def test_a_store_in_a_directory_that_refuses_files_is_one_clear_error(tmp_path: Path) -> None:
    # /proc refuses new files even to root (a read-only directory refuses only others)
    places = [Path("/proc/tether-test.db")] if Path("/proc/self").exists() else []
    if os.geteuid() != 0:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        places.append(ro / "t.db")
    if not places:
        pytest.skip("no directory here refuses new files")
    for path in places:
        res = cli(tmp_path, "runs", "--store", f"sqlite:///{path}")
        # (the command line refuses a missing file before opening it)
        one_line_error(res, 1, str(path), "does not exist")
        with pytest.raises(StoreError, match="cannot create or open store"):
            _ = tether.App(store=str(path)).store


@pytest.mark.parametrize("user_version", [0, 2, 9, 10])
def test_another_programs_sqlite_file_is_left_untouched(tmp_path: Path, user_version: int) -> None:
    notes = tmp_path / "notes.db"
    content = _foreign_sqlite(notes, user_version)
    res = cli(tmp_path, "runs", "-s", str(notes))
    line = one_line_error(res, 1, "notes.db", "notes")
    assert "development build" not in line
    assert _journal_mode(notes) == "delete"
    assert notes.read_bytes() == content
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.db"]
    with pytest.raises(StoreError, match="another program"):
        _ = tether.App(store=str(notes)).store
    assert _journal_mode(notes) == "delete"
    assert notes.read_bytes() == content


# -- PostgreSQL --------------------------------------------------------------------


def _pg_tables(schema: str) -> int:
    import psycopg

    with psycopg.connect(PG_URL, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM information_schema.tables WHERE table_schema = %s", (schema,)
        ).fetchone()
        assert row is not None
        return int(row[0])


def _pg_schema_exists(schema: str) -> bool:
    import psycopg

    with psycopg.connect(PG_URL, autocommit=True) as conn:
        return (
            conn.execute("SELECT 1 FROM pg_namespace WHERE nspname = %s", (schema,)).fetchone()
            is not None
        )


def test_read_only_commands_do_not_create_a_postgres_store(tmp_path: Path, pg_schema: str) -> None:
    url = with_schema(PG_URL, pg_schema)
    # a mistyped schema: nothing is created
    for args in (("runs",), ("get", "x"), ("approvals", "list"), ("queues",)):
        res = cli(tmp_path, *args, "--store", url)
        one_line_error(res, 1, pg_schema, "no tether store", "tether worker")
    assert not _pg_schema_exists(pg_schema)
    # an application's own schema: its tables stay the only ones
    import psycopg

    with psycopg.connect(PG_URL, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{pg_schema}"')
        conn.execute(f'CREATE TABLE "{pg_schema}".customers (id int)')
    res = cli(tmp_path, "runs", "--store", url)
    one_line_error(res, 1, pg_schema, "no tether store")
    assert _pg_tables(pg_schema) == 1
    # a tether store there: read as before
    tether.App(store=url).store.close_sync()  # type: ignore[attr-defined]
    res = cli(tmp_path, "runs", "--store", url)
    assert res.returncode == 0 and "no runs found" in res.stderr + res.stdout, res


def test_a_password_in_the_url_query_is_never_printed(tmp_path: Path) -> None:
    from tether.store.postgres import _redact

    for url in (
        "postgresql://127.0.0.1:5999/x?user=postgres&password=s3cretpw",
        "postgresql://127.0.0.1:5999/x?sslpassword=s3cretpw&user=postgres",
        "postgresql://u:s3cretpw@127.0.0.1:5999/x?PASSWORD=s3cretpw",
        # libpq quotes a malformed value in its error
        "postgresql://u:s3cretpw%zz@127.0.0.1:5999/x",
    ):
        assert "s3cretpw" not in _redact(url), _redact(url)
        assert "127.0.0.1:5999/x" in _redact(url)
        res = cli(tmp_path, "runs", "-s", url)
        one_line_error(res, 1, "cannot connect", "127.0.0.1:5999")
        assert "s3cretpw" not in res.stderr + res.stdout


def test_a_malformed_postgres_url_is_one_line(tmp_path: Path) -> None:
    for url in (
        "postgresql://postgres@[::1:5432/probe",
        "postgresql://postgres:s3cretpw@[::1:5432/probe?password=s3cretpw",
    ):
        res = cli(tmp_path, "runs", "-s", url)
        one_line_error(res, 1, "invalid store URL", "postgres")
        assert "s3cretpw" not in res.stderr
        with pytest.raises(StoreError, match="invalid store URL"):
            _ = tether.App(store=url).store


# -- file arguments ------------------------------------------------------------------


def test_replay_and_eval_file_arguments_are_one_line_errors(project: Path) -> None:
    (project / "bad.json").write_text("{bad")
    (project / "list.json").write_text("[1, 2]")
    (project / "dict.json").write_text('{"events": [{"type": "Nope", "seq": 1}]}')
    (project / "evals.py").write_text("def plain(text):\n    return text.upper()\n")
    for name, needle in (
        ("nosuch.json", "does not exist"),
        ("histories/*.json", "does not exist"),
        ("bad.json", "not valid JSON"),
        ("list.json", "not a history"),
        ("dict.json", "not a history"),
        (str(project), "is a directory"),
    ):
        res = cli(project, "replay", name, "--app", "flows:app")
        one_line_error(res, 2, name, needle)
    res = cli(project, "eval", "evals:plain", str(project))
    one_line_error(res, 2, str(project), "is a directory")


def test_keyring_init_in_a_missing_directory(tmp_path: Path) -> None:
    res = cli(tmp_path, "keyring", "init", str(tmp_path / "nonexist" / "k.json"))
    one_line_error(res, 1, "nonexist", "No such file or directory")


# -- options checked before anything starts -------------------------------------------


def test_start_refuses_a_bad_timeout_before_starting_the_run(project: Path) -> None:
    for extra in (
        ("--wait", "--timeout", "-1"),
        ("--wait", "--timeout", "nan"),
        ("--timeout", "5"),
    ):
        res = cli(project, "start", "flows:app", "hello", '"ada"', *extra)
        one_line_error(res, 2, "--timeout")
        assert res.stdout == ""
    assert not (project / "tether.db").exists()  # not even the store was opened


def test_names_and_values_nothing_uses_are_refused(project: Path) -> None:
    res = cli(project, "start", "flows:app", "hello", '"x"')  # creates the store
    assert res.returncode == 0, res.stderr
    db = str(project / "tether.db")
    # with --app the workflows and activities are known: a typo is refused, listing them
    res = cli(project, "switch", "off", "workflow", "helo", "--app", "flows:app")
    one_line_error(res, 2, "'helo'", "hello")
    res = cli(project, "switch", "off", "activity", "shoutt", "--app", "flows:app")
    one_line_error(res, 2, "'shoutt'", "shout")
    # the App's own refusals are usage errors too (exit 2), with or without --app
    res = cli(project, "switch", "off", "flow", "hello", "--store", db)
    one_line_error(res, 2, "'flow'", "workflow", "tenant")
    res = cli(project, "switch", "on", "flow", "hello", "--store", db)
    one_line_error(res, 2, "'flow'", "workflow", "tenant")
    res = cli(project, "switch", "off", "workflow", " ", "--app", "flows:app")
    one_line_error(res, 2, "needs a name")
    assert cli(project, "switch", "list", "--store", db).stdout.strip() == "[]"
    res = cli(project, "switch", "off", "workflow", "hello", "--app", "flows:app")
    assert res.returncode == 0, res.stderr
    res = cli(project, "approvals", "list", "--status", "bogus", "--store", db)
    one_line_error(res, 2, "'bogus'", "expired_rejected", "closed")
    res = cli(project, "approvals", "list", "--status", "closed", "--store", db)
    assert res.returncode == 0 and "no reviews found" in res.stderr, res.stderr
    for worker_id in ("", " "):
        res = cli(project, "worker", "flows:app", "--id", worker_id)
        one_line_error(res, 2, "--id")
