"""The data-lifecycle commands (purge, erase-tenant, store backup/restore) at their
edges, as an operator meets them: a mistyped name, what an earlier backup left, a blob
store shared by several PostgreSQL stores, a file that is no store."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import tether

SRC = Path(__file__).parent.parent / "src"


def _cli(
    cwd: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``tether ARGS`` in a subprocess in ``cwd``, with this checkout's tether."""
    base = {**os.environ, "PYTHONPATH": str(SRC)}
    base.pop("TETHER_BLOBS", None)
    return subprocess.run(
        [sys.executable, "-m", "tether.cli", *args],
        env={**base, **(env or {})},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _one_line_error(done: subprocess.CompletedProcess[str], code: int, *needles: str) -> None:
    assert done.returncode == code, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("error: "), done.stderr
    for needle in needles:
        assert needle in done.stderr, (needle, done.stderr)


def _seed(store: str, tenant: str | None = None, n: int = 3) -> None:
    """``n`` ended runs of workflow ``big`` whose results are offloaded to blobs."""
    app = tether.App(store=store, offload_above=1024)

    @app.activity
    def make(n: int) -> str:
        return "D" * n

    @app.workflow
    async def big(n: int) -> int:
        return len(await make(n))

    async def go() -> None:
        async with app.worker(poll_interval=0.02):
            for i in range(n):
                run = await app.start(big, 5000 + i, tenant=tenant)
                assert await run.result(30) == 5000 + i
        await app.close()

    asyncio.run(go())


def _blob_files(root: Path) -> set[Path]:
    return {p for p in root.rglob("*") if p.is_file()} if root.exists() else set()


def test_purge_names_a_workflow_the_store_has_no_run_of(tmp_path: Path) -> None:
    """`tether purge --workflow bgi` (a typo of `big`) removed nothing, printed zero
    counts and exited 0 with no hint. It now says on stderr that the store has no run of
    that workflow and names the closest one it has runs of (still exit 0, as an
    unknown --tenant is)."""
    db = tmp_path / "t.db"
    _seed(f"sqlite:///{db}", n=1)
    store = ("--store", str(db))
    for extra in ((), ("--dry-run",)):
        typo = _cli(tmp_path, "purge", "--older-than", "30d", "--workflow", "bgi", *store, *extra)
        assert typo.returncode == 0, typo.stderr
        assert json.loads(typo.stdout)["runs"] == 0
        assert "no runs of workflow 'bgi' in this store" in typo.stderr, typo.stderr
        assert "did you mean 'big'?" in typo.stderr, typo.stderr
    known = _cli(tmp_path, "purge", "--older-than", "30d", "--workflow", "big", *store)
    assert known.returncode == 0 and "no runs of workflow" not in known.stderr, known.stderr
    # nothing like any name it has: the names it has runs of are listed
    far = _cli(tmp_path, "purge", "--older-than", "30d", "--workflow", "zzzz", *store)
    assert far.returncode == 0, far.stderr
    assert "no runs of workflow 'zzzz'" in far.stderr and "'big'" in far.stderr, far.stderr


def test_erase_tenant_says_what_it_left_in_the_shared_default_blob_store(
    tmp_path: Path, pg_schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On PostgreSQL without a blob store of its own (the default ./tether-blobs, which
    every PostgreSQL store started in that folder shares), `tether erase-tenant` left
    the tenant's blobs there, said nothing of it and reported the tenant erased. It
    still leaves them (another store may refer to the same bytes), but counts them
    (``blobs_left``) and says on stderr where they are and what to do. With a blob store
    of its own (TETHER_BLOBS) the erasure deletes them, and says nothing more."""
    from conftest import PG_URL, with_schema

    url = with_schema(PG_URL, pg_schema)
    monkeypatch.chdir(tmp_path)  # the shared default is ./tether-blobs
    monkeypatch.delenv("TETHER_BLOBS", raising=False)
    _seed(url, tenant="acme")
    shared = tmp_path / "tether-blobs"
    left = _blob_files(shared)
    assert len(left) == 3, left
    done = _cli(tmp_path, "erase-tenant", "acme", "--yes", "--store", url)
    assert done.returncode == 0, done.stderr
    counts = json.loads(done.stdout)
    assert counts["runs"] == 3 and counts["blobs_left"] == 3, counts
    assert _blob_files(shared) == left  # not deleted: another store may refer to them
    note = " ".join(done.stderr.split())
    assert "3 blob(s) of tenant 'acme' were left" in note, note
    assert str(shared.resolve()) in note and "TETHER_BLOBS" in note, note
    assert "Traceback" not in done.stderr

    own = tmp_path / "own-blobs"
    monkeypatch.setenv("TETHER_BLOBS", str(own))
    _seed(url, tenant="beta")
    assert len(_blob_files(own)) == 3
    done = _cli(
        tmp_path, "erase-tenant", "beta", "--yes", "--store", url, env={"TETHER_BLOBS": str(own)}
    )
    assert done.returncode == 0, done.stderr
    counts = json.loads(done.stdout)
    assert counts["runs"] == 3 and counts["blobs"] == 3 and "blobs_left" not in counts, counts
    assert _blob_files(own) == set() and "left" not in done.stderr, done.stderr


def test_maintenance_commands_never_make_a_store_of_an_empty_file(tmp_path: Path) -> None:
    """`tether purge --store empty.db` on an empty file (`touch`ed, or left by a tool
    that failed) made it a 270 KB tether store and reported "removed 0 run(s)"; backup
    then copied that. An empty file is no store: each command says so on one line,
    exits non-zero and leaves the file as it was (empty)."""
    empty = tmp_path / "empty.db"
    empty.touch()
    store = ("--store", str(empty))
    for args in (
        ("purge", "--older-than", "30d"),
        ("erase-tenant", "acme", "--yes"),
        ("store", "gc-blobs"),
        ("retention", "list"),
    ):
        done = _cli(tmp_path, *args, *store)
        _one_line_error(done, 1, "no tether store", str(empty))
        assert empty.stat().st_size == 0, args
    done = _cli(tmp_path, "store", "backup", str(tmp_path / "bk.db"), *store)
    _one_line_error(done, 1, "no tether store", str(empty))
    assert empty.stat().st_size == 0 and not (tmp_path / "bk.db").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.db"]


def test_backup_and_restore_name_what_an_earlier_one_left(tmp_path: Path) -> None:
    """What an earlier backup or restore left in the way (the blobs of a backup whose
    database was deleted by hand, a folder where a .partial file goes, a file where the
    blob folder goes) made `tether store backup`/`restore` fail with a bare "exists" or
    a traceback (IsADirectoryError, NotADirectoryError). Each is now one line naming
    what is in the way and what to do; what a killed backup left is replaced."""
    db = tmp_path / "t.db"
    _seed(f"sqlite:///{db}")
    store = ("--store", str(db))
    # the blobs of an earlier backup whose database was removed
    (tmp_path / "a.db.blobs" / "ab").mkdir(parents=True)
    (tmp_path / "a.db.blobs" / "ab" / "cd").write_text("x")
    done = _cli(tmp_path, "store", "backup", str(tmp_path / "a.db"), *store)
    _one_line_error(done, 2, "a.db.blobs", "remove it", "another path")
    assert not (tmp_path / "a.db").exists()
    # a killed backup's blobs (.partial) are no backup: replaced
    (tmp_path / "b.db.blobs.partial" / "zz").mkdir(parents=True)
    done = _cli(tmp_path, "store", "backup", str(tmp_path / "b.db"), *store)
    assert done.returncode == 0, done.stderr
    assert len(_blob_files(tmp_path / "b.db.blobs")) == 3
    assert not (tmp_path / "b.db.blobs.partial").exists()
    # a folder where the backup's .partial file goes: not tether's, so not removed
    (tmp_path / "c.db.partial").mkdir()
    done = _cli(tmp_path, "store", "backup", str(tmp_path / "c.db"), *store)
    _one_line_error(done, 2, "c.db.partial", "is a folder")
    assert not (tmp_path / "c.db").exists()
    # a dangling link where the blob folder goes
    (tmp_path / "d.db.blobs").symlink_to(tmp_path / "nowhere")
    done = _cli(tmp_path, "store", "backup", str(tmp_path / "d.db"), *store)
    _one_line_error(done, 2, "d.db.blobs")
    assert not (tmp_path / "d.db").exists()

    backup = tmp_path / "b.db"
    (tmp_path / "r1.db.partial").mkdir()
    done = _cli(tmp_path, "store", "restore", str(backup), "--to", str(tmp_path / "r1.db"))
    _one_line_error(done, 2, "r1.db.partial", "is a folder")
    assert not (tmp_path / "r1.db").exists()
    (tmp_path / "r2.db.blobs").write_text("not a folder")
    done = _cli(tmp_path, "store", "restore", str(backup), "--to", str(tmp_path / "r2.db"))
    _one_line_error(done, 2, "r2.db.blobs", "not a folder")
    assert not (tmp_path / "r2.db").exists()
    done = _cli(tmp_path, "store", "restore", str(backup), "--to", str(tmp_path / "r3.db"))
    assert done.returncode == 0, done.stderr
    assert len(_blob_files(tmp_path / "r3.db.blobs")) == 3


def test_a_backup_or_restore_that_cannot_write_says_so_in_a_line_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An OS error while copying the blobs (disk full) ended backup and restore in a
    traceback, leaving their .partial files. Now one line, and nothing half written."""
    from tether.blobs import BlobStore
    from tether.cli import main

    db = tmp_path / "t.db"
    _seed(f"sqlite:///{db}", n=1)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TETHER_BLOBS", raising=False)
    with pytest.raises(SystemExit) as exited:
        main(["store", "backup", "good.db", "--store", str(db)])
    assert exited.value.code == 0, capsys.readouterr().err
    capsys.readouterr()

    def full(self: BlobStore, ref: str, data: bytes, mtime: float | None = None) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(BlobStore, "keep", full)
    for args, names in (
        (["store", "backup", "bk.db", "--store", str(db)], ("bk.db", "no backup was made")),
        (["store", "restore", "good.db", "--to", "r.db"], ("r.db", "nothing was restored")),
    ):
        with pytest.raises(SystemExit) as exited:
            main(args)
        assert exited.value.code == 1
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1, err
        assert "No space left on device" in err and all(n in err for n in names), err
    left = sorted(p.name for p in tmp_path.iterdir() if "partial" in p.name or "bk" in p.name)
    assert left == [] and not (tmp_path / "r.db").exists(), left


def _main(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[object, str, str]:
    """``tether ARGS`` in this process: (exit code, stderr, stdout)."""
    from tether.cli import main

    with pytest.raises(SystemExit) as exited:
        main(args)
    out, err = capsys.readouterr()
    return exited.value.code, err, out


def test_an_age_without_a_unit_is_refused_not_taken_as_seconds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`tether retention set acme --older-than 30` stored 30 seconds (workers then
    purged the tenant's ended runs 30 s after they ended), and `tether purge
    --older-than 1` removed every run ended more than a second ago, while the help said
    "AGE ... 30d". A bare number is now refused as a usage error naming the units, on
    every command that takes an age, and nothing is changed; an age with a unit is
    echoed back as what was understood."""
    db = tmp_path / "t.db"
    _seed(f"sqlite:///{db}", n=1)
    store = ["--store", str(db)]
    for args, option, text in (
        (["retention", "set", "acme", "--older-than", "30"], "--older-than", "30"),
        (["purge", "--older-than", "1"], "--older-than", "1"),
        (["purge", "--older-than", "0.5"], "--older-than", "0.5"),
        (["store", "gc-blobs", "--older-than", "3600"], "--older-than", "3600"),
        (["replay", "--app", "nowhere:app", "--since", "7"], "--since", "7"),
    ):
        code, err, _ = _main([*args, *store], capsys)
        assert code == 2, (args, err)
        assert err == f"error: {option} {text}: give a unit, e.g. 30d, 12h, 90m or 45s\n", err
    code, _, out = _main(["retention", "list", *store], capsys)
    assert code == 0 and json.loads(out) == {}
    code, _, out = _main(["runs", "--json", *store], capsys)
    assert code == 0 and "big" in out  # the run is still there
    # with a unit: taken, and said back
    code, err, _ = _main(["retention", "set", "acme", "--older-than", "720h", *store], capsys)
    assert code == 0 and "ended runs kept 30d (2592000 s)" in err, err
    code, _, out = _main(["retention", "list", *store], capsys)
    assert json.loads(out) == {"acme": 2592000.0}
    code, err, _ = _main(["purge", "--older-than", "2w", "--dry-run", *store], capsys)
    assert code == 0 and "ended more than 2w (1209600 s) ago" in err, err
