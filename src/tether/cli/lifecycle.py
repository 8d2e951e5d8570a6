"""Data lifecycle from a shell: ``tether purge`` (retention), ``tether erase-tenant``,
``tether store backup|restore|check``."""

from __future__ import annotations

import contextlib
import difflib
import os
import shutil
import sqlite3
import time
from typing import Annotated, Any

import typer

from .._errors import ConfigurationError
from ..blobs import BlobError, BlobStore, default_root
from ._common import (
    EXIT_USAGE,
    MAX_BATCH,
    UsageError,
    _app_option,
    _client_app,
    _dump,
    _fail,
    _note,
    _opened,
    _refuse_foreign_database,
    _run,
    _schema_of,
    _sqlite_path,
    _store_option,
    cli_actor,
    format_age,
    load_app,
    parse_age,
)
from .keyring import fingerprint_of, mismatch_problem


def purge_command(
    older_than: Annotated[
        str, typer.Option("--older-than", metavar="AGE", help="Ended more than AGE ago: 30d.")
    ],
    workflow: Annotated[str | None, typer.Option("--workflow", help="Only this workflow.")] = None,
    tenant: Annotated[str | None, typer.Option("--tenant", help="Only this tenant.")] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Count what the first batch would remove.")
    ] = False,
    batch: Annotated[
        int, typer.Option("--batch", min=1, max=MAX_BATCH, help="Runs per transaction.")
    ] = 500,
    store: Annotated[str | None, _store_option()] = None,
    app: Annotated[str | None, _app_option()] = None,
) -> None:
    """Remove ended runs older than AGE, with everything of theirs.

    That is their history, tasks, dead letters, reviews, webhook deliveries and audit
    entries, removed in short transactions that do not block workers. Their ids then
    answer "purged". Live runs are never touched."""
    age = parse_age(older_than, "--older-than")

    async def go() -> tuple[dict[str, int], bool, list[str] | None]:
        async with _opened(_client_app(store, app)) as a:
            counts = await a.purge(
                age, workflow=workflow, tenant=tenant, dry_run=dry_run, batch=batch
            )
            if not dry_run and counts["runs"]:
                detail = {"older_than": older_than, "workflow": workflow, "tenant": tenant}
                await a.store.audit(cli_actor(), "purge", "runs", {**detail, **counts})
            # nothing old enough is normal; a tenant or workflow the store has no run of
            # is a typo
            unknown = (
                tenant is not None
                and not counts["runs"]
                and not await a.list(tenant=tenant, limit=1)
            )
            names = None
            if (
                workflow is not None
                and not counts["runs"]
                and not await a.list(workflow=workflow, limit=1)
            ):
                names = await a.store.workflow_names()
            return counts, unknown, names

    counts, unknown, names = _run(go())
    _dump(counts)
    _note(
        ("would remove " if dry_run else "removed ")
        + f"{counts['runs']} run(s) ended more than {format_age(age)} ago"
    )
    if unknown:
        _note(f"no runs of tenant {tenant!r} in this store: is the name right?")
    if names is not None:
        _note(f"no runs of workflow {workflow!r} in this store: {_names_hint(workflow, names)}")


def _names_hint(name: str | None, names: list[str]) -> str:
    """What to say of a workflow name the store has no run of: the closest one it has
    runs of, else the ones it has (a few)."""
    if not names:
        return "it has no runs at all; is it the store your workers use?"
    close = difflib.get_close_matches(name or "", names, n=1)
    if close:
        return f"did you mean {close[0]!r}?"
    shown = ", ".join(repr(n) for n in names[:10])
    more = f" and {len(names) - 10} more" if len(names) > 10 else ""
    return f"is the name right? It has runs of {shown}{more}"


def erase_tenant_command(
    tenant: Annotated[str, typer.Argument(metavar="TENANT", help="The tenant to erase.")],
    yes: Annotated[bool, typer.Option("--yes", help="Really erase (it cannot be undone).")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Count, change nothing.")] = False,
    store: Annotated[str | None, _store_option()] = None,
    app: Annotated[str | None, _app_option()] = None,
) -> None:
    """Erase a tenant: its runs with all their rows, its limits, keys and spend.

    This terminates its live runs, removes every run of it with all their rows, and
    its admission limit, API keys, switch and model budgets and spend. With
    per-tenant keys, make it a fresh key (every process sealing under it within a
    second or so) before rows go, do it again for a last pass, then destroy every key
    but the last: what is started after the erasure stays readable under it. A tenant
    the store has nothing of is noted on stderr (it still succeeds, as an erasure run
    again after it finished does), and so are its blobs left in the default blob
    store PostgreSQL stores share (blobs_left: give the store its own, TETHER_BLOBS)."""
    if not yes and not dry_run:
        _fail(f"erasing tenant {tenant!r} cannot be undone: add --yes (or --dry-run)", EXIT_USAGE)

    async def go() -> tuple[dict[str, int], str]:
        async with _opened(_client_app(store, app)) as a:
            counts = await a.erase_tenant(tenant, dry_run=dry_run)
            if not dry_run:
                await a.store.audit(cli_actor(), "erase tenant", f"tenant:{tenant}", counts)
            blobs = a.store.blobs
            return counts, blobs.root if blobs is not None else ""

    counts, root = _run(go())
    root = os.path.abspath(root)
    _dump(counts)
    if not any(counts.values()):
        _note(
            f"nothing of tenant {tenant!r} in this store (no runs, limits, keys, "
            "budgets or spend): is the name right?"
        )
    if counts.get("blobs_left"):
        _note(
            f"warning: {counts['blobs_left']} blob(s) of tenant {tenant!r} were left in "
            f"{root}: it is the default blob store, shared by every PostgreSQL store whose "
            "processes start in that folder, so whether another store refers to them cannot "
            "be told and they were not deleted. If only this store uses that folder, run "
            f"`tether store gc-blobs` for it with TETHER_BLOBS={root}: it removes the blobs "
            "this store no longer refers to (once older than its --older-than). And give the "
            "store a blob store of its own (App(blobs=...) or TETHER_BLOBS, the same for all "
            "its processes)"
        )


def retention_set_command(
    tenant: Annotated[str, typer.Argument(metavar="TENANT", help="The tenant.")],
    older_than: Annotated[
        str | None,
        typer.Option("--older-than", metavar="AGE", help="Keep ended runs this long: 30d."),
    ] = None,
    off: Annotated[bool, typer.Option("--off", help="Keep its runs until purged by hand.")] = False,
    store: Annotated[str | None, _store_option()] = None,
    app: Annotated[str | None, _app_option()] = None,
) -> None:
    """Set how long a tenant's ended runs are kept.

    Every worker purges older ones in the background (the setting is kept in the
    store, shared by every process)."""
    if (older_than is None) == (not off):
        _fail("give --older-than AGE or --off", EXIT_USAGE)
    age = None if off else parse_age(older_than or "", "--older-than")

    async def go() -> None:
        async with _opened(_client_app(store, app)) as a:
            await a.configure_retention(tenant, age)
            await a.store.audit(cli_actor(), "retention", f"tenant:{tenant}", {"seconds": age})

    _run(go())
    kept = "runs kept" if age is None else f"ended runs kept {format_age(age)}"
    _note(f"tenant {tenant!r}: {kept}")


def retention_list_command(
    store: Annotated[str | None, _store_option()] = None,
    app: Annotated[str | None, _app_option()] = None,
) -> None:
    """Every tenant's retention, in seconds, as JSON."""

    async def go() -> dict[str, float]:
        async with _opened(_client_app(store, app)) as a:
            return await a.retentions()

    _dump(_run(go()))


def store_reseal_command(
    batch: Annotated[
        int, typer.Option("--batch", min=1, max=MAX_BATCH, help="Rows per transaction.")
    ] = 500,
    store: Annotated[str | None, _store_option()] = None,
    app: Annotated[str | None, _app_option()] = None,
) -> None:
    """Seal every stored payload under the current keys (TETHER_KEYRING).

    That is what an older key sealed, so that key can be retired, and what was
    written before encryption was turned on; offloaded payloads go to new blobs and
    the old blobs are deleted. Workers may keep running. On SQLite, VACUUM afterwards
    so no old bytes stay in the file's free pages."""

    async def go() -> dict[str, int]:
        async with _opened(_client_app(store, app)) as a:
            try:
                counts = await a.reseal(batch=batch)
            except ConfigurationError as exc:
                raise UsageError(str(exc)) from None
            await a.store.audit(cli_actor(), "reseal", "store", counts)
            return counts

    counts = _run(go())
    _dump(counts)
    _note(reseal_summary(counts))


def reseal_summary(counts: dict[str, int]) -> str:
    """One line for what ``App.reseal`` did: values by table, blobs sealed again in
    place (``blobs_resealed``), old blobs deleted (``blobs``)."""
    blobs, resealed = counts.get("blobs", 0), counts.get("blobs_resealed", 0)
    values = sum(counts.values()) - blobs - resealed
    return (
        f"resealed {values} value(s) and {resealed} blob(s) in place, {blobs} old blob(s) deleted"
    )


def store_gc_blobs_command(
    older_than: Annotated[
        str, typer.Option("--older-than", metavar="AGE", help="Grace period: 1h.")
    ] = "1h",
    store: Annotated[str | None, _store_option()] = None,
    app: Annotated[str | None, _app_option()] = None,
) -> None:
    """Remove blobs no payload refers to, once older than AGE.

    They are left by an attempt that crashed before its commit, or by runs purged
    since; the age keeps the blobs of attempts still running. Half-written blobs a
    killed process left are removed too. The blob store is the App's (--app) or the
    one beside the SQLite file."""
    age = parse_age(older_than, "--older-than")

    async def go() -> dict[str, int]:
        async with _opened(_client_app(store, app)) as a:
            return await a.gc_blobs(older_than=age)

    _dump(_run(go()))


def store_backup_command(
    path: Annotated[str, typer.Argument(metavar="BACKUP", help="The file to write.")],
    store: Annotated[str | None, _store_option()] = None,
    blobs: Annotated[
        str | None,
        typer.Option(
            "--blobs",
            metavar="DIR|URL",
            help="The store's blob store (default: TETHER_BLOBS, else <store>.blobs).",
        ),
    ] = None,
) -> None:
    """Copy a SQLite store and its blobs to BACKUP while workers run.

    First one consistent snapshot (SQLite's online backup), then its blob store
    (offloaded payloads, put_blob documents) into BACKUP.blobs, written under
    .partial names and renamed when whole (BACKUP last): a backup killed part-way is
    none. PostgreSQL: use pg_dump or PITR (docs/deploy.md)."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        _fail(
            f"the backup's folder {folder!r} does not exist: create it first, or choose "
            "another path for the backup",
            EXIT_USAGE,
        )
    src = _local_store(store)
    if os.path.exists(path):
        _fail(f"{path!r} exists: choose a new file for the backup", EXIT_USAGE)
    partial, partial_blobs = f"{path}{PARTIAL}", f"{path}.blobs{PARTIAL}"
    _refuse_in_the_way(partial, folder=False, then="choose another path for the backup")
    _refuse_in_the_way(partial_blobs, folder=True, then="choose another path for the backup")
    if os.path.exists(partial):  # a backup killed part-way: what it left is no backup
        _remove_database(partial)
        shutil.rmtree(partial_blobs, ignore_errors=True)
        shutil.rmtree(f"{path}.blobs", ignore_errors=True)  # killed between its renames
    if os.path.lexists(f"{path}.blobs"):
        _fail(
            f"{path}.blobs exists but {path!r} does not: the blobs of an earlier backup to "
            "that path whose database was removed (or something else of that name): remove "
            "it, or choose another path for the backup",
            EXIT_USAGE,
        )
    shutil.rmtree(partial_blobs, ignore_errors=True)
    # written under temporary names, BACKUP renamed last: a backup killed part-way is no
    # backup (restore finds none), never one that looks whole and lacks blobs
    _copy_database(src, partial, "the store", timeout=30, named=path)  # one consistent read
    try:
        # then the blobs: each is written before the commit that refers to it, so every
        # blob the snapshot refers to is there by now (unless purged or erased meanwhile)
        copied = _copy_blobs(_blob_store(blobs, src), BlobStore(partial_blobs))
        if os.path.isdir(partial_blobs):
            _publish(partial_blobs, f"{path}.blobs")
        _publish(partial, path)
    except OSError as exc:  # disk full, no permission, something put in the way meanwhile
        _remove_database(partial)
        shutil.rmtree(partial_blobs, ignore_errors=True)
        _fail(f"could not write the backup {path!r}: {exc}; no backup was made", 1)
    _note(
        f"backed up {src} to {path} ({os.path.getsize(path):,} bytes)"
        + (f" and {copied} blob(s) to {path}.blobs" if copied else " (no blobs)")
    )


def _refuse_in_the_way(name: str, *, folder: bool, then: str) -> None:
    """Fail (one line, exit 2) when ``name``, where backup or restore writes a file
    (``folder``: a folder), is something else: not what a killed run of theirs leaves,
    so not theirs to remove."""
    if not os.path.lexists(name):
        return
    if folder and os.path.isdir(name) and not os.path.islink(name):
        return
    if not folder and os.path.isfile(name) and not os.path.islink(name):
        return
    what = "a folder" if os.path.isdir(name) else "a link" if os.path.islink(name) else "a file"
    if folder and not os.path.isdir(name):
        what = f"{what}, not a folder"
    _fail(
        f"{name} is {what}: it is in the way of what this command writes there, and not "
        f"what an interrupted run of it leaves; remove it, or {then}",
        EXIT_USAGE,
    )


def store_restore_command(
    backup: Annotated[str, typer.Argument(metavar="BACKUP", help="A file from backup.")],
    target: Annotated[str, typer.Option("--to", metavar="PATH", help="The store file to create.")],
    blobs: Annotated[
        str | None,
        typer.Option(
            "--blobs",
            metavar="DIR|URL",
            help="Where the new store's blobs go (default: TETHER_BLOBS, else PATH.blobs).",
        ),
    ] = None,
) -> None:
    """Restore a backup, and the blobs backed up beside it, into a new store file.

    The blobs (BACKUP.blobs) go into the new store's blob store. Then start workers
    on it: runs in flight at the backup resume from their last recorded step. PATH
    appears only once every blob is copied: a restore killed part-way can simply be
    run again."""
    if not os.path.exists(backup):
        if os.path.exists(f"{backup}{PARTIAL}"):
            _fail(
                f"no backup at {backup!r}: {backup}{PARTIAL} is what a backup killed part-way "
                "left, not a backup (take the backup again); nothing was restored",
                1,
            )
        _fail(f"no backup at {backup!r}", EXIT_USAGE)
    if os.path.exists(target):
        _fail(f"{target!r} exists: restore into a new file (or move it away first)", EXIT_USAGE)
    problem = _not_a_store(backup)
    if problem is not None:
        _fail(f"{backup!r} is not a tether backup: {problem}; nothing was restored", 1)
    # into a temporary file renamed to TARGET last: a restore killed part-way leaves no
    # store that looks whole, and running it again starts afresh (blobs already copied
    # are kept: each was written whole)
    partial = f"{target}{PARTIAL}"
    _refuse_in_the_way(partial, folder=False, then="restore into another file")
    into = _blob_store(blobs, target)
    if "://" not in (blobs or os.environ.get("TETHER_BLOBS") or ""):  # a local folder
        _refuse_in_the_way(into.root, folder=True, then="pass --blobs DIR")
    _remove_database(partial)
    ok = _copy_database(backup, partial, "the backup", check=True, named=target)
    if ok != "ok":
        _remove_database(partial)
        _fail(f"the backup {backup!r} is damaged ({ok}); nothing was restored", 1)
    try:
        if os.path.isdir(f"{backup}.blobs"):
            copied = _copy_blobs(BlobStore(f"{backup}.blobs"), into, keep_present=True)
            done = f"restored {backup} into {target} and {copied} blob(s) into {into.root}"
        else:
            done = (
                f"restored {backup} into {target}; no {backup}.blobs beside it: no blobs restored"
            )
        _publish(partial, target)
    except OSError as exc:  # disk full, no permission, something put in the way meanwhile
        _remove_database(partial)
        _fail(f"could not restore into {target!r}: {exc}; nothing was restored", 1)
    _note(done)
    _note(f"check it with: tether store check --store {target}")


#: the suffix of what backup and restore write before renaming it to its name
PARTIAL = ".partial"


def _remove_database(path: str) -> None:
    """Remove the SQLite file at ``path`` and its journals (a leftover hot journal would
    be rolled back into a new file of that name)."""
    for name in (path, f"{path}-journal", f"{path}-wal", f"{path}-shm"):
        with contextlib.suppress(FileNotFoundError):
            os.remove(name)


def _publish(partial: str, final: str) -> None:
    """Rename ``partial`` (a file or folder written whole) to ``final``, durably."""
    os.replace(partial, final)
    with contextlib.suppress(OSError):  # no directory fsync on some systems
        fd = os.open(os.path.dirname(os.path.abspath(final)), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _blob_store(named: str | None, store_path: str) -> BlobStore:
    """The blob store of the SQLite store at ``store_path``, where an App on it looks:
    ``named``, else ``TETHER_BLOBS``, else beside the file."""
    return BlobStore(named or os.environ.get("TETHER_BLOBS") or default_root(store_path))


def _copy_blobs(source: BlobStore, target: BlobStore, *, keep_present: bool = False) -> int:
    """Copy every blob of ``source`` as kept (sealed or not) into ``target``; with
    ``keep_present`` a blob ``target`` has already is left as it is. How many."""
    copied = 0
    for ref, mtime in source.refs():
        if keep_present and target.modified(ref) is not None:
            continue
        try:
            data = source.kept(ref)
        except BlobError:  # deleted since the listing (gc, purge): nothing refers to it
            continue
        target.keep(ref, data, mtime)  # its time kept: a pending deletion still applies
        copied += 1
    return copied


def store_check_command(
    store: Annotated[str | None, _store_option()] = None,
    app: Annotated[
        str | None,
        typer.Option("--app", metavar="MODULE:ATTR", help="Also replay every unfinished run."),
    ] = None,
) -> None:
    """Check a store (a restored one above all); exit 1 on any problem.

    It runs SQLite's integrity check and checks: no row naming a run that is not
    there (nor a continue-as-new chain's row naming a run that continued since),
    every blob its payloads refer to in its blob store (the runs missing one are
    named), every stored blob whole (read once and checked against its hash; sealed
    ones opened with the keyring given), each key id the store was sealed under
    against the keyring given (TETHER_KEYRING: a key of that id with another
    fingerprint is named), and with --app every unfinished run's history replays with
    that code. Blobs no payload refers to and blob deletions a stopped purge left
    pending are reported, not problems: gc-blobs or the next purge removes them."""
    problems: list[str] = []
    path = _sqlite_path(store) if store else None
    if path is not None:
        if not os.path.exists(path):
            _fail(f"no tether store at {path!r}", EXIT_USAGE)
        problem = _not_a_store(path)
        if problem is not None:  # nothing more can be read from it
            _dump({"problems": [problem], "replayed": 0, "orphans": {}})
            _fail(f"{path!r} is not a tether store: {problem}", 1)
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            (ok,) = conn.execute("PRAGMA integrity_check").fetchone()
        except sqlite3.DatabaseError as exc:  # damaged past what the check can walk
            ok = str(exc)
        finally:
            conn.close()
        if ok != "ok":
            problems.append(f"integrity: {ok}")

    async def go() -> dict[str, Any]:
        # with --app its store (and its code for the replays), else --store
        a = load_app(app) if app else _client_app(store, None)
        async with _opened(a) as opened:
            orphans = await opened.store.orphans()
            keys = await _key_states(opened)
            lost = await _missing_blobs(opened)
            blob_state = await _blob_state(opened)
            replayed, failed = 0, []
            if app:
                from ..testing._replay import check_history

                for status in ("pending", "running", "suspended", "queued"):
                    before: tuple[float, str] | None = None
                    while True:  # a page at a time: a million live runs never sit in memory
                        page = await opened.list(status=status, limit=500, before=before)
                        for run in page:
                            replayed += 1
                            try:
                                report = check_history(opened, await opened.history(run.run_id))
                            except Exception as exc:  # unreadable (a missing blob, a key)
                                failed.append(f"{run.run_id}: cannot be read: {exc}")
                                continue
                            if not report.ok:
                                failed.append(f"{run.run_id}: {report.error}")
                        if len(page) < 500:
                            break
                        before = (page[-1].created_at, page[-1].run_id)
            return {
                "orphans": orphans,
                "replayed": replayed,
                "replay_failures": failed,
                "blobs": lost,
                "blob_state": blob_state,
                "keys": keys,
            }

    found = _run(go())
    orphans = found["orphans"].items()
    problems += [
        f"{n} {table} row(s) name "
        + (
            "a run that continued as new (not its chain's head)"
            if table == "stale chains"
            else "a missing run"
        )
        for table, n in orphans
        if n
    ]
    problems += [mismatch_problem(k) for k, state in found["keys"].items() if state == "mismatch"]
    problems += found["blobs"]
    state = found["blob_state"]
    problems += state.pop("problems", [])
    notes = state.pop("notes", [])
    problems += found["replay_failures"]
    _dump(
        {
            "problems": problems,
            "replayed": found["replayed"],
            "orphans": found["orphans"],
            "keys": found["keys"],
            "blobs": state,
        }
    )
    for note in notes:
        _note(note)
    if problems:
        raise typer.Exit(1)
    _note("the store is sound")


async def _key_states(app: Any) -> dict[str, str]:
    """Each key id the store was sealed under, compared with this process's keyring:
    ``matches``, ``mismatch`` (another key under that id), ``not in keyring`` (or
    destroyed, retired), ``no keyring``."""
    recorded = await app.store.seal_keys()
    sealer = app.store.codec.sealer if app.store.codec is not None else None
    states: dict[str, str] = {}
    for key_id, theirs in recorded.items():
        mine = fingerprint_of(sealer, key_id) if sealer is not None else None
        if sealer is None:
            states[key_id] = "no keyring"
        elif mine is None:
            states[key_id] = "not in keyring"
        else:
            states[key_id] = "matches" if mine == theirs else "mismatch"
    return states


async def _missing_blobs(app: Any) -> list[str]:
    """A problem for each run whose payloads refer to a blob its blob store lacks (and
    one for those only rows of no run refer to: schedules, caches)."""
    blobs = app.store.blobs
    if blobs is None:
        return []
    try:
        refs = await app.store.blob_refs()
    except Exception as exc:  # a sealed payload this process has no key for
        return [f"blob references could not be read: {exc}"]
    missing = {r for r in refs if blobs.modified(r) is None}
    if not missing:
        return []
    where = f"missing from the blob store at {blobs.root!r}"
    problems: list[str] = []
    named: set[str] = set()
    before: tuple[float, str] | None = None
    while page := await app.list(limit=500, before=before):  # (a run's unreadable fields
        before = (page[-1].created_at, page[-1].run_id)  # are only marked, never raised)
        ids = [r.run_id for r in page]
        if not (await app.store.blob_refs(run_ids=ids)) & missing:
            continue
        for rid in ids:  # the page refers to one: which of its runs
            theirs = (await app.store.blob_refs(run_ids=[rid])) & missing
            if theirs:
                named |= theirs
                problems.append(
                    f"{rid}: {len(theirs)} blob(s) {where}: {', '.join(sorted(theirs))}"
                )
    if missing - named:
        rest = sorted(missing - named)
        problems.append(
            f"{len(rest)} blob(s) rows of no run refer to are {where}: {', '.join(rest)}"
        )
    return problems


#: refs named per kind of blob finding in ``tether store check``'s report
_NAMED_REFS = 5
#: seconds an unreferenced blob is spared (``gc-blobs``' default grace): younger ones
#: may be an attempt's whose commit is in flight
BLOB_GRACE = 3600.0


async def _blob_state(app: Any) -> dict[str, Any]:
    """What the blob store holds beyond the references (``tether store check``): blob
    deletions a stopped purge or erasure left pending, blobs no payload refers to, and
    blobs whose bytes do not match their hash or cannot be read (problems). Each blob
    is read once (as a backup would) and only sealed ``put_blob`` blobs are opened,
    with the keyring given; without it they are counted ``unverified`` (and those of an
    erased tenant ``shredded``)."""
    blobs = app.store.blobs
    if blobs is None:
        return {}
    noted = await app.store.blob_deletions()  # before the scan, as gc-blobs reads them
    try:
        used: set[str] | None = await app.store.blob_refs()
    except Exception:  # a sealed payload this process has no key for (named above)
        used = None
    now = time.time()
    unused: list[str] = []
    old: list[str] = []
    damaged: dict[str, str] = {}
    unverified = shredded = stored = 0
    for ref, mtime in list(blobs.refs()):
        stored += 1
        if used is not None and ref not in used and ref not in noted:
            unused.append(ref)
            if mtime < now - BLOB_GRACE:
                old.append(ref)
        problem = blobs.verify(ref)
        if problem == "unverified":
            unverified += 1
        elif problem == "shredded":  # a document of an erased tenant: as meant
            shredded += 1
        elif problem is not None:
            damaged[ref] = problem
    state: dict[str, Any] = {
        "stored": stored,
        "pending_deletions": len(noted),
        "unreferenced": None if used is None else len(unused),
        "damaged": len(damaged),
        "unverified": unverified,
        "shredded": shredded,
    }
    notes: list[str] = []
    problems: list[str] = []
    if noted:
        state["pending_examples"] = sorted(noted)[:_NAMED_REFS]
        notes.append(
            f"{len(noted)} blob deletion(s) pending: a purge or erasure was stopped after "
            "removing the runs that referred to them; the next `tether purge` (or "
            "`tether store gc-blobs`) deletes those nothing refers to"
        )
    if unused:
        state["unreferenced_examples"] = sorted(unused)[:_NAMED_REFS]
        where = (
            " (the shared default blob store: other stores' payloads may refer to them)"
            if blobs.shared
            else ""
        )
        notes.append(
            f"{len(unused)} blob(s) no payload refers to{where}, {len(old)} older than "
            f"{int(BLOB_GRACE)} s: `tether store gc-blobs` removes those (younger ones may "
            "be an attempt's, about to commit)"
        )
    if unverified:
        notes.append(
            f"{unverified} sealed blob(s) not verified: sealed under a key this process "
            "lacks (give the keyring: TETHER_KEYRING)"
        )
    if shredded:
        notes.append(
            f"{shredded} sealed blob(s) shredded: their tenant was erased (its keys "
            "destroyed); `tether store gc-blobs` removes those nothing refers to"
        )
    if damaged:
        shown = sorted(damaged)[:_NAMED_REFS]
        state["damaged_examples"] = {ref: damaged[ref] for ref in shown}
        problems.append(
            f"{len(damaged)} blob(s) damaged or unreadable at {blobs.shown_root!r} "
            f"({', '.join(f'{r}: {damaged[r]}' for r in shown)}): a run that reads one "
            "fails; restore them from a backup of the blob store (putting the same bytes "
            "again rewrites one), or, if nothing refers to them, `tether store gc-blobs` "
            "removes them"
        )
    state["problems"] = problems
    state["notes"] = notes
    return state


def _not_a_store(path: str) -> str | None:
    """Why the file at ``path`` is no tether SQLite store (None when it is one)."""
    try:
        version, _tables = _schema_of(path)
    except sqlite3.Error as exc:
        return f"not an SQLite database ({exc})"
    return None if version else "an SQLite database without tether's schema"


def _copy_database(
    src: str,
    dest: str,
    what: str,
    *,
    timeout: float = 5.0,
    check: bool = False,
    named: str | None = None,
) -> str:
    """Copy the SQLite database ``src`` into the new file ``dest`` with SQLite's online
    backup; with ``check``, return the copy's integrity check. On an error ``dest`` is
    removed and the command fails with one line naming ``what`` was being read (and
    ``named``, the file ``dest`` is to become, as the target)."""
    ok = "ok"
    try:
        source = sqlite3.connect(f"file:{src}?mode=ro", uri=True, timeout=timeout)
        target = sqlite3.connect(dest)
        try:
            source.backup(target)  # all pages in one step: a single consistent read
            if check:
                (ok,) = target.execute("PRAGMA integrity_check").fetchone()
        finally:
            target.close()
            source.close()
    except sqlite3.Error as exc:
        _remove_database(dest)
        _fail(f"could not copy {what} {src!r} to {named or dest!r}: {exc}; nothing was written", 1)
    return str(ok)


def _local_store(store: str | None) -> str:
    path = _sqlite_path(store) if store else None
    if path is None:
        from ._common import DEFAULT_STORE

        path = _sqlite_path(store or DEFAULT_STORE)
    if path is None:
        _fail(
            "tether store backup copies SQLite stores; back up PostgreSQL with pg_dump or "
            "point-in-time recovery (docs/deploy.md)",
            EXIT_USAGE,
        )
    if not os.path.exists(path):
        _fail(f"no tether store at {path!r}", EXIT_USAGE)
    _refuse_foreign_database(path)
    return path
