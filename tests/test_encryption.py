"""Encryption at rest (tether.encryption): nothing readable in the store's bytes, every
payload readable through tether, rotation, per-tenant shredding, clear errors."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import glob
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import tether
from conftest import PG_URL
from tether._history import EventType
from tether.cli.lifecycle import reseal_summary
from tether.encryption import (
    FileKeyring,
    KeyUnavailableError,
    KeyWrapper,
    LocalKeyWrapper,
    Sealer,
    StaticKeyring,
    new_key,
)

CANARY = "CANARY-7f3c2a-secret"


def _keyring(tmp_path: Path, per_tenant: bool = False) -> FileKeyring:
    return FileKeyring.create(tmp_path / "keys.json", per_tenant=per_tenant)


def _pg_text(schema: str) -> str:
    """Every row of every table of ``schema``, as text."""
    import psycopg
    from psycopg import sql

    out: list[str] = []
    with psycopg.connect(PG_URL, autocommit=True) as conn:
        tables = [
            r[0]
            for r in conn.execute(
                "SELECT table_name FROM information_schema.tables WHERE table_schema = %s",
                (schema,),
            )
        ]
        for table in tables:
            q = sql.SQL("SELECT t::text FROM {}.{} t").format(
                sql.Identifier(schema), sql.Identifier(table)
            )
            out += [r[0] for r in conn.execute(q)]
    return "\n".join(out)


def _stored_bytes(store_url: str) -> bytes:
    """What the store holds, as raw bytes: the SQLite files, or PostgreSQL's rows."""
    if store_url.startswith("sqlite:///"):
        path = store_url[len("sqlite:///") :]
        return b"".join(Path(p).read_bytes() for p in glob.glob(path + "*") if os.path.isfile(p))
    schema = store_url.rsplit("schema=", 1)[1]
    return _pg_text(schema).encode()


def _column(store_url: str, query: str) -> list[Any]:
    """The first column of ``query``'s rows, read from the store's database directly."""
    if store_url.startswith("sqlite:///"):
        import sqlite3

        with contextlib.closing(sqlite3.connect(store_url[len("sqlite:///") :])) as conn:
            return [r[0] for r in conn.execute(query)]
    import psycopg

    schema = store_url.rsplit("schema=", 1)[1]
    with psycopg.connect(PG_URL, autocommit=True) as conn:
        conn.execute(f'SET search_path TO "{schema}"')
        return [r[0] for r in conn.execute(query)]


def _register(app: tether.App) -> None:
    @app.activity
    def shout(text: str) -> str:
        return text.upper() + " " + CANARY

    @app.activity
    def explode(text: str) -> str:
        raise tether.NonRetryable(f"cannot handle {text}")

    @app.workflow
    async def flow(text: str) -> dict[str, Any]:
        tether.set_status({"seen": text})
        loud = await shout(text)
        note = await tether.wait_event("note", timeout=60)
        return {"loud": loud, "note": note}

    @app.workflow
    async def failing(text: str) -> str:
        return await explode(text)

    @app.workflow
    async def echo(text: str) -> str:
        return await shout(text)


async def test_nothing_of_inputs_outputs_signals_or_errors_is_readable_in_the_store(
    store_url: str, tmp_path: Path
) -> None:
    app = tether.App(store=store_url, encryption=_keyring(tmp_path))
    _register(app)
    async with app.worker(poll_interval=0.05):
        run = await app.start("flow", f"hello {CANARY}", run_id="r1")
        await app.signal("r1", "note", {"text": f"signal {CANARY}"})
        result = await run.result(timeout=30)
        bad = await app.start("failing", f"input {CANARY}", run_id="r2")
        with pytest.raises(tether.WorkflowFailedError):
            await bad.result(timeout=30)
    # every payload reads back through tether...
    assert result == {
        "loud": f"HELLO {CANARY.upper()} {CANARY}",
        "note": {"text": f"signal {CANARY}"},
    }
    info = await app.get("r1")
    assert CANARY in (info.input or "") and info.custom_status == {"seen": f"hello {CANARY}"}
    history = await app.history("r1")
    assert any(CANARY in str(e.data) for e in history)
    failed = await app.get("r2")
    assert failed.error is not None and CANARY in failed.error["message"]
    letters = await app.dead_letters()
    assert letters and CANARY in (letters[0].input or "")
    # the error's type stays outside the seal: runs are still filtered by it
    assert [r.run_id for r in await app.list(error_type=failed.error["type"])] == ["r2"]
    app.store.close_sync()  # type: ignore[attr-defined]
    # ...and none of it is in the store's bytes
    raw = _stored_bytes(store_url)
    assert raw and CANARY.encode() not in raw
    assert CANARY.upper().encode() not in raw
    # without the keyring, a sealed dead letter is listed with why its input is not,
    # naming the letter and its run once
    bare = tether.App(store=store_url, encryption=StaticKeyring({"k0": os.urandom(32)}, "k0"))
    unread = await bare.dead_letters()
    assert unread and all(d.input is None and d.unavailable for d in unread)
    reason = (unread[0].unavailable or {})["input"]
    assert reason.count("run 'r2'") == 1 and "dead letter" in reason, reason
    bare.store.close_sync()  # type: ignore[attr-defined]


async def test_a_store_sealed_under_a_key_says_so_to_a_process_without_it(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TETHER_KEYRING", raising=False)
    monkeypatch.delenv("TETHER_ENCRYPTION_KEYS", raising=False)
    ring = _keyring(tmp_path)
    key_id = ring.current(None)
    app = tether.App(store=store_url, encryption=ring)
    _register(app)
    async with app.worker(poll_interval=0.05):
        await app.start("flow", "x", run_id="r1")
        await app.signal("r1", "note", "n")
        await app.get_run("r1").result(timeout=30)
    app.store.close_sync()  # type: ignore[attr-defined]

    plain = tether.App(store=store_url)  # no keyring
    with pytest.raises(KeyUnavailableError) as err:
        await plain.get("r1")
    message = str(err.value)
    assert "run 'r1'" in message and f"{key_id!r}" in message and "TETHER_KEYRING" in message
    plain.store.close_sync()  # type: ignore[attr-defined]

    # the same key id holding other bytes: an error, never a wrong value
    other = StaticKeyring({key_id: os.urandom(32)}, key_id)
    wrong = tether.App(store=store_url, encryption=other)
    with pytest.raises(KeyUnavailableError, match="does not open"):
        await wrong.history("r1")
    wrong.store.close_sync()  # type: ignore[attr-defined]

    # the keyring given in the environment opens it, as it would for the CLI or server
    monkeypatch.setenv("TETHER_KEYRING", str(tmp_path / "keys.json"))
    env = tether.App(store=store_url)
    assert (await env.get("r1")).input == '{"args":["x"],"kwargs":{}}'
    env.store.close_sync()  # type: ignore[attr-defined]


async def test_rotation_keeps_old_data_readable_and_shredding_a_tenant_erases_only_it(
    store_url: str, tmp_path: Path
) -> None:
    keys = _keyring(tmp_path, per_tenant=True)
    app = tether.App(store=store_url, encryption=keys)
    _register(app)
    async with app.worker(poll_interval=0.05):
        a1 = await app.start("echo", "acme one", run_id="a1", tenant="acme")
        b1 = await app.start("echo", "beta one", run_id="b1", tenant="beta")
        n1 = await app.start("echo", "shared one", run_id="n1")
        for r in (a1, b1, n1):
            await r.result(timeout=30)
        acme_first, shared_first = keys.current("acme"), keys.current(None)
        shared_second = keys.rotate()
        acme_second = keys.rotate("acme")
        a2 = await app.start("echo", "acme two", run_id="a2", tenant="acme")
        n2 = await app.start("echo", "shared two", run_id="n2")
        for r in (a2, n2):
            await r.result(timeout=30)
    assert shared_second.startswith("k2-") and acme_second != acme_first
    stored = _stored_bytes(store_url)
    for key_id in (shared_first, shared_second, acme_first, acme_second, keys.current("beta")):
        assert f"~e1:{key_id}:".encode() in stored, key_id
    # written under old and new keys alike, all of it reads
    for run_id, text in (("a1", "acme one"), ("a2", "acme two"), ("n1", "shared one")):
        assert (await app.get(run_id)).input == f'{{"args":["{text}"],"kwargs":{{}}}}'

    gone = keys.shred("acme")
    assert sorted(gone) == sorted([acme_first, acme_second])
    for run_id in ("a1", "a2"):
        with pytest.raises(KeyUnavailableError) as err:
            await app.get(run_id)
        assert err.value.destroyed and "tenant 'acme' erased" in str(err.value)
        assert f"run {run_id!r}" in str(err.value)
    # another process's keyring sees the shred too
    fresh = FileKeyring(tmp_path / "keys.json")
    with pytest.raises(KeyUnavailableError):
        fresh.key(acme_first)
    assert (await app.get("b1")).input == '{"args":["beta one"],"kwargs":{}}'
    assert (await app.get("n2")).output == f'"SHARED TWO {CANARY}"'
    app.store.close_sync()  # type: ignore[attr-defined]


def test_a_sealed_value_is_authenticated_and_compressed_when_that_pays() -> None:
    key = base64.b64decode(new_key())
    sealer = Sealer(StaticKeyring({"main": key}, "main"))
    text = '{"text": "' + "abc " * 1000 + '"}'
    sealed = sealer.seal(text)
    assert sealed.startswith("~e1:main:z:") and len(sealed) < len(text) / 4
    assert sealer.open(sealed) == text
    small = sealer.seal('"hi"')
    assert small.startswith("~e1:main:n:") and sealer.open(small) == '"hi"'
    # the key id and flag are authenticated: changing them is an error, never a value
    with pytest.raises(KeyUnavailableError):
        sealer.open(sealed.replace(":z:", ":n:", 1))
    body = base64.b64decode(small.rsplit(":", 1)[1])
    flipped = bytes([body[0]]) + bytes([body[1] ^ 1]) + body[2:]
    tampered = small.rsplit(":", 1)[0] + ":" + base64.b64encode(flipped).decode()
    with pytest.raises(KeyUnavailableError):
        sealer.open(tampered)
    assert sealer.open('{"plain": 1}') == '{"plain": 1}'  # written before encryption: as is


def test_keyring_configuration_errors_say_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(tether.ConfigurationError, match="tether keyring init"):
        FileKeyring(tmp_path / "missing.json")
    FileKeyring.create(tmp_path / "k.json")
    with pytest.raises(tether.ConfigurationError, match="never overwritten"):
        FileKeyring.create(tmp_path / "k.json")
    assert oct(os.stat(tmp_path / "k.json").st_mode & 0o777) == "0o600"
    with pytest.raises(tether.ConfigurationError, match="32"):
        StaticKeyring({"k": b"short"}, "k")
    with pytest.raises(tether.ConfigurationError, match="id=base64"):
        StaticKeyring.parse("justtext")
    parsed = StaticKeyring.parse(f"new={new_key()},old={new_key()}")
    assert parsed.current(None) == "new"
    monkeypatch.setenv("TETHER_ENCRYPTION_KEYS", f"k9={new_key()}")
    from tether.encryption import keyring_from_env

    found = keyring_from_env()
    assert found is not None and found.current("anyone") == "k9"


async def test_per_tenant_keys_are_made_once_by_concurrent_processes(tmp_path: Path) -> None:
    FileKeyring.create(tmp_path / "keys.json", per_tenant=True)
    rings = [FileKeyring(tmp_path / "keys.json") for _ in range(4)]
    got = await asyncio.gather(*(asyncio.to_thread(r.current, "acme") for r in rings))
    # the first to take the file's lock made the key; the others found it there
    assert len(set(got)) == 1
    assert len(FileKeyring(tmp_path / "keys.json").key(got[0])) == 32


async def test_a_worker_without_the_key_leaves_the_run_intact_until_one_with_it_comes(
    store_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.delenv("TETHER_KEYRING", raising=False)
    monkeypatch.delenv("TETHER_ENCRYPTION_KEYS", raising=False)
    monkeypatch.setattr("tether._worker.KEY_HOLD", 0.3)
    caplog.set_level("ERROR", logger="tether")
    calls: list[str] = []

    def build(app: tether.App) -> None:
        @app.activity(queue="acts")
        def double(x: str) -> str:
            calls.append(x)
            return x * 2

        @app.workflow
        async def wf(x: str) -> str:
            return await double(x)

    ring = _keyring(tmp_path)
    keyed = tether.App(store=store_url, encryption=ring)
    keyless = tether.App(store=store_url)
    build(keyed)
    build(keyless)
    # a workflow task it cannot read: a task error, the run left pending
    await keyed.start("wf", "ab", run_id="r1")
    async with keyless.worker(poll_interval=0.05):
        for _ in range(400):
            info = await keyed.get("r1")
            if info.task_error:
                break
            await asyncio.sleep(0.05)
    assert info.status is tether.RunStatus.PENDING and repr(ring.current(None)) in (
        info.task_error or ""
    )
    # its workflow task done by a worker with the key, its activity is claimed by one
    # without: held back again and again, never run, no attempt spent, no dead letter
    async with keyed.worker(queues=["default"], poll_interval=0.05):
        for _ in range(400):
            if [e for e in await keyed.history("r1") if e.type is EventType.ACTIVITY_SCHEDULED]:
                break
            await asyncio.sleep(0.05)
    async with keyless.worker(queues=["acts"], poll_interval=0.05) as w:
        for _ in range(400):
            if w.stats["held_unreadable"] >= 2:
                break
            await asyncio.sleep(0.05)
    assert w.stats["held_unreadable"] >= 2 and calls == []
    # each try logged once, naming the key, the step's waits doubling
    waits = [r.getMessage() for r in caplog.records if "waits (try" in r.getMessage()]
    assert (
        "(try 1: tried again in 0.3 s)" in waits[0]
        and "(try 2: tried again in 0.6 s)" in (waits[1])
    ), waits
    assert all(repr(ring.current(None)) in m for m in waits), waits
    assert (await keyed.get("r1")).status is tether.RunStatus.RUNNING
    assert await keyed.dead_letters() == []
    async with keyed.worker(poll_interval=0.05):
        assert await keyed.get_run("r1").result(timeout=30) == "abab"
    assert calls == ["ab"]
    starts = [e for e in await keyed.history("r1") if e.type is EventType.ACTIVITY_COMPLETED]
    assert len(starts) == 1 and starts[0].data["attempt"] == 1
    for a in (keyed, keyless):
        a.store.close_sync()  # type: ignore[attr-defined]


def _tether(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tether.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def test_the_keyring_commands_make_rotate_list_and_shred_keys(tmp_path: Path) -> None:
    path = str(tmp_path / "keys.json")
    made = _tether("keyring", "init", path, "--per-tenant")
    assert made.returncode == 0, made.stderr
    # not "keep a copy somewhere safe": a copy kept elsewhere defeats shredding
    assert "a backup of the keyring defeats tether keyring shred" in made.stderr
    again = _tether("keyring", "init", path)
    assert again.returncode == 2 and "never overwritten" in again.stderr
    ring = FileKeyring(path)
    acme, first = ring.current("acme"), ring.current(None)
    assert first in made.stderr
    env = {"TETHER_KEYRING": path}
    assert _tether("keyring", "rotate", env=env).returncode == 0
    rotated_id = FileKeyring(path).current(None)
    rotated = _tether("keyring", "rotate", "--tenant", "acme", env=env)
    assert rotated.returncode == 0 and "acme" in rotated.stderr
    listed = json.loads(_tether("keyring", "list", env=env).stdout)
    second = ring.current("acme")
    assert second != acme and {k["key_id"] for k in listed} == {first, rotated_id, acme, second}
    assert "key" not in listed[0]  # never the key bytes
    # a key no longer in use is retired: its id stays listed, never given out again
    current = _tether("keyring", "retire", rotated_id, "--yes", env=env)
    assert current.returncode == 2 and "current" in current.stderr
    unconfirmed = _tether("keyring", "retire", first, env=env)
    assert unconfirmed.returncode == 2 and "--yes" in unconfirmed.stderr
    retired = _tether("keyring", "retire", first, "--yes", "--keyring", path)
    assert retired.returncode == 0, retired.stderr
    listed = json.loads(_tether("keyring", "list", env=env).stdout)
    assert [k["key_id"] for k in listed if k["retired_at"]] == [first]
    with pytest.raises(KeyUnavailableError, match="retired"):
        FileKeyring(path).key(first)
    refused = _tether("keyring", "shred", "acme", env=env)
    assert refused.returncode == 2 and "--yes" in refused.stderr
    shredded = _tether("keyring", "shred", "acme", "--yes", "--keyring", path)
    assert shredded.returncode == 0
    assert sorted(json.loads(shredded.stdout)["destroyed"]) == sorted([acme, second])
    with pytest.raises(KeyUnavailableError, match="destroyed"):
        FileKeyring(path).key(acme)
    key = _tether("keyring", "new-key").stdout.strip()
    assert len(base64.b64decode(key)) == 32
    missing = _tether("keyring", "list", str(tmp_path / "nope.json"))
    assert missing.returncode == 2 and "tether keyring init" in missing.stderr


async def test_keyring_list_and_store_check_show_each_key_fingerprint_against_the_store(
    store_url: str, tmp_path: Path
) -> None:
    from tether.encryption import Sealer

    ring = _keyring(tmp_path)
    key_id = ring.current(None)
    mine = Sealer(ring).fingerprint(key_id)
    app = tether.App(store=store_url, encryption=ring)
    _register(app)
    await app.start("echo", "one", run_id="r1")  # sealing records the key's fingerprint
    await app.close()
    # a second keyring file holding another key under the same id (made by hand)
    data = json.loads(Path(ring.path).read_text())
    data["keys"][key_id]["key"] = base64.b64encode(os.urandom(32)).decode()
    other = tmp_path / "other.json"
    other.write_text(json.dumps(data))
    other.chmod(0o600)

    listed = _tether("keyring", "list", ring.path)
    assert listed.returncode == 0, listed.stderr
    (entry,) = json.loads(listed.stdout)
    assert entry["fingerprint"] == mine  # never the key: an HMAC under it
    compared = _tether("keyring", "list", ring.path, "--store", store_url)
    assert compared.returncode == 0, compared.stderr
    (entry,) = json.loads(compared.stdout)
    assert entry["store_fingerprint"] == mine and entry["matches"] is True
    wrong = _tether("keyring", "list", str(other), "--store", store_url)
    assert wrong.returncode == 0, wrong.stderr
    (entry,) = json.loads(wrong.stdout)
    assert entry["fingerprint"] != mine and entry["store_fingerprint"] == mine
    assert entry["matches"] is False and key_id in wrong.stderr

    check = _tether("store", "check", "--store", store_url, env={"TETHER_KEYRING": ring.path})
    assert check.returncode == 0, check.stdout + check.stderr
    assert json.loads(check.stdout)["keys"] == {key_id: "matches"}
    bad = _tether("store", "check", "--store", store_url, env={"TETHER_KEYRING": str(other)})
    assert bad.returncode == 1, bad.stdout + bad.stderr
    found = json.loads(bad.stdout)
    assert found["keys"] == {key_id: "mismatch"}
    problem = found["problems"][0]  # first: what the payloads it cannot open come from
    assert key_id in problem and "another key" in problem and "TETHER_KEYRING" in problem


def _rows_text(store_url: str) -> str:
    """Every row of every table, as text (not the file's free pages)."""
    if store_url.startswith("sqlite:///"):
        import sqlite3

        conn = sqlite3.connect(store_url[len("sqlite:///") :])
        try:
            return "\n".join(conn.iterdump())
        finally:
            conn.close()
    return _pg_text(store_url.rsplit("schema=", 1)[1])


async def test_reseal_seals_old_plaintext_and_moves_everything_to_the_current_key(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TETHER_KEYRING", raising=False)
    monkeypatch.delenv("TETHER_ENCRYPTION_KEYS", raising=False)
    plain = tether.App(store=store_url)  # before encryption was turned on
    _register(plain)
    async with plain.worker(poll_interval=0.05):
        run = await plain.start("flow", f"hello {CANARY}", run_id="r1")
        await plain.signal("r1", "note", {"text": f"signal {CANARY}"})
        await run.result(timeout=30)
        with pytest.raises(tether.WorkflowFailedError):
            await (await plain.start("failing", f"input {CANARY}", run_id="r2")).result(30)
    plain.store.close_sync()  # type: ignore[attr-defined]
    assert CANARY in _rows_text(store_url)

    keys = _keyring(tmp_path)
    app = tether.App(store=store_url, encryption=keys)
    _register(app)
    k1 = keys.current(None)
    first = await app.reseal(batch=3)  # small batches: the paging is exercised
    assert first["runs"] and first["events"] and first["dead_letters"]
    assert CANARY not in _rows_text(store_url)
    assert await app.reseal() == dict.fromkeys(first, 0)  # nothing left to do
    k2 = keys.rotate()  # new data under it; reseal moves the old
    moved = await app.reseal()
    assert sum(moved.values()) == sum(first.values())
    text = _rows_text(store_url)
    assert f"~e1:{k1}:" not in text and f"~e1:{k2}:" in text
    app.store.close_sync()  # type: ignore[attr-defined]
    # k1 can go: everything reads with k2 alone
    only_k2 = tether.App(store=store_url, encryption=StaticKeyring({k2: keys.key(k2)}, k2))
    assert CANARY in (await only_k2.get("r1")).input
    assert any(CANARY in str(e.data) for e in await only_k2.history("r1"))
    failed = await only_k2.get("r2")
    assert failed.error is not None and CANARY in failed.error["message"]
    assert [r.run_id for r in await only_k2.list(error_type=failed.error["type"])] == ["r2"]
    only_k2.store.close_sync()  # type: ignore[attr-defined]
    without = tether.App(store=store_url)
    with pytest.raises(tether.ConfigurationError, match="keyring"):
        await without.reseal()
    without.store.close_sync()  # type: ignore[attr-defined]
    # from a shell, with the keyring in the environment: nothing left to reseal
    done = _tether("store", "reseal", "--store", store_url, env={"TETHER_KEYRING": str(keys.path)})
    assert done.returncode == 0, done.stderr
    assert set(json.loads(done.stdout).values()) == {0}
    refused = _tether("store", "reseal", "--store", store_url)
    assert refused.returncode == 2 and "keyring" in refused.stderr


def test_a_steps_arguments_are_sealed_once_for_its_event_and_its_task_row() -> None:
    from tether._codec import Codec, open_fields
    from tether.store.ops._tx import _Tx

    codec = Codec(Sealer(StaticKeyring({"k1": os.urandom(32)}, "k1")))
    tx = _Tx(conn=None, now=0.0, codec=codec)
    args = f'{{"args":["{CANARY}"],"kwargs":{{}}}}'
    stored = tx.data("r1", {"name": "shout", "error": {"message": CANARY}}, {"args": args})
    assert CANARY not in stored
    event = json.loads(stored)
    assert event["name"] == "shout" and event["~args"] == tx.seal(args, "r1")  # one seal
    assert open_fields(codec, event, "here") == {
        "name": "shout",
        "args": {"args": [CANARY], "kwargs": {}},
        "error": {"message": CANARY},
    }
    # another transaction seals afresh (a new nonce)
    assert _Tx(conn=None, now=0.0, codec=codec).seal(args, "r1") != tx.seal(args, "r1")


async def test_events_sealed_together_by_the_first_version_read_and_reseal_into_fields(
    tmp_path: Path,
) -> None:
    import sqlite3

    keys = _keyring(tmp_path)
    db = tmp_path / "old.db"
    url = f"sqlite:///{db}"
    app = tether.App(store=url, encryption=keys)
    _register(app)
    async with app.worker(poll_interval=0.05):
        await (await app.start("echo", f"old {CANARY}", run_id="r1")).result(timeout=30)
    before = [e.data for e in await app.history("r1")]
    app.store.close_sync()  # type: ignore[attr-defined]
    # rewrite the events as the first encrypting version stored them: one "~" field
    sealer = Sealer(keys)
    conn = sqlite3.connect(db)
    grouped = 0
    rows = conn.execute("SELECT seq, data FROM events WHERE run_id = 'r1'").fetchall()
    for seq, data in rows:
        value = json.loads(data)
        inner = {k[1:]: json.loads(sealer.open(v)) for k, v in value.items() if k[:1] == "~"}
        if inner:
            shown = {k: v for k, v in value.items() if k[:1] != "~"}
            shown["~"] = sealer.seal(json.dumps(inner))
            conn.execute(
                "UPDATE events SET data = ? WHERE run_id = 'r1' AND seq = ?",
                (json.dumps(shown), seq),
            )
            grouped += 1
    conn.commit()
    conn.close()
    assert grouped >= 3 and '"~":' in _rows_text(url)

    app = tether.App(store=url, encryption=keys)
    assert [e.data for e in await app.history("r1")] == before
    assert (await app.reseal())["events"] == grouped
    text = _rows_text(url)
    assert '"~":' not in text and '"~args":' in text and CANARY not in text
    assert [e.data for e in await app.history("r1")] == before
    assert (await app.reseal())["events"] == 0
    app.store.close_sync()  # type: ignore[attr-defined]


async def test_reseal_moves_offloaded_payloads_to_new_blobs_under_the_current_key(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TETHER_KEYRING", raising=False)
    monkeypatch.delenv("TETHER_ENCRYPTION_KEYS", raising=False)
    blobs = tmp_path / "blobs"
    big = f"{CANARY} " * 400  # above offload_above: input, step result, signal, output

    def kept() -> dict[str, bytes]:
        return {p.name: p.read_bytes()[:16] for p in blobs.rglob("*") if p.is_file()}

    plain = tether.App(store=store_url, blobs=str(blobs), offload_above=1024)
    _register(plain)
    async with plain.worker(poll_interval=0.05):
        run = await plain.start("flow", big, run_id="r1")
        await plain.signal("r1", "note", {"text": big})
        await run.result(timeout=30)
    plain.store.close_sync()  # type: ignore[attr-defined]
    written = kept()
    assert written and all(
        CANARY.encode()[:8] in b or b.startswith(b'{"') for b in written.values()
    )

    keys = _keyring(tmp_path)
    app = tether.App(store=store_url, blobs=str(blobs), offload_above=1024, encryption=keys)
    _register(app)
    k1 = keys.current(None)
    first = await app.reseal(batch=2)
    assert first["blobs"] == len(written)  # every plain blob was replaced, then deleted
    now = kept()
    assert now and not set(now) & set(written)
    assert all(b.startswith(f"~e1:{k1[:8]}".encode()) for b in now.values())
    assert CANARY not in _rows_text(store_url)
    assert (await app.reseal()).get("blobs", 0) == 0  # nothing left to do
    k2 = keys.rotate()
    moved = await app.reseal()
    assert moved["blobs"] == len(now)
    assert all(b.startswith(f"~e1:{k2[:8]}".encode()) for b in kept().values())
    app.store.close_sync()  # type: ignore[attr-defined]
    # k1 can go: the run, its history and its blobs read with k2 alone
    only_k2 = tether.App(
        store=store_url, blobs=str(blobs), encryption=StaticKeyring({k2: keys.key(k2)}, k2)
    )
    info = await only_k2.get("r1")
    assert CANARY in info.input and info.output is not None and CANARY in info.output
    assert sum(CANARY in str(e.data) for e in await only_k2.history("r1")) >= 3
    assert set((await only_k2.store.orphans()).values()) == {0}
    assert await only_k2.store.blob_refs() == {
        f"sha256:{p.parent.name}{p.name}" for p in blobs.rglob("*") if p.is_file()
    }
    only_k2.store.close_sync()  # type: ignore[attr-defined]


async def test_reseal_by_a_process_with_a_higher_offload_threshold_keeps_payloads_offloaded(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the CLI's reseal (no --app) has the default threshold, 256 KiB; the app offloaded
    # above 1 KiB: what was offloaded stays in the blob store, sealed, not inline
    monkeypatch.delenv("TETHER_KEYRING", raising=False)
    monkeypatch.delenv("TETHER_ENCRYPTION_KEYS", raising=False)
    blobs = tmp_path / "blobs"
    big = f"{CANARY} " * 400  # 4.4 KB: over 1 KiB, far under 256 KiB
    plain = tether.App(store=store_url, blobs=str(blobs), offload_above=1024)
    _register(plain)
    async with plain.worker(poll_interval=0.05):
        run = await plain.start("flow", big, run_id="r1")
        await plain.signal("r1", "note", {"text": big})
        await run.result(timeout=30)
    refs_before = await plain.store.blob_refs()
    plain.store.close_sync()  # type: ignore[attr-defined]
    assert len(refs_before) >= 3

    keys = _keyring(tmp_path)
    app = tether.App(store=store_url, blobs=str(blobs), encryption=keys)  # default threshold
    _register(app)
    moved = await app.reseal()
    assert moved["blobs"] == len(refs_before)
    assert len(await app.store.blob_refs()) == len(refs_before)  # none pulled inline
    assert CANARY not in _rows_text(store_url)
    assert all(p.read_bytes().startswith(b"~e1:") for p in blobs.rglob("*") if p.is_file())
    info = await app.get("r1")
    assert info.input is not None and CANARY in info.input
    assert sum(CANARY in str(e.data) for e in await app.history("r1")) >= 3
    app.store.close_sync()  # type: ignore[attr-defined]


def test_a_value_sealed_here_opens_from_memory_until_its_key_is_destroyed(
    tmp_path: Path,
) -> None:
    keys = _keyring(tmp_path, per_tenant=True)
    sealer = Sealer(keys)
    sealed = sealer.seal('{"args":[1]}', "acme")
    assert sealed in sealer._recent  # the step's worker opens it without decrypting
    assert sealer.open(sealed) == '{"args":[1]}'
    i = len(sealed) - 10  # a character of the tag: the value no longer authenticates
    tampered = sealed[:i] + ("B" if sealed[i] == "A" else "A") + sealed[i + 1 :]
    with pytest.raises(KeyUnavailableError):
        sealer.open(tampered)  # another text: not remembered, and it does not open
    keys.shred("acme")
    with pytest.raises(KeyUnavailableError, match="destroyed"):
        sealer.open(sealed)  # forgotten with the key


def test_values_sealed_here_still_open_from_memory_when_the_keyring_gains_a_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = _keyring(tmp_path, per_tenant=True)
    sealer = Sealer(keys)
    sealed = sealer.seal('{"args":[1]}', "acme")

    def no_decrypt(*a: object, **k: object) -> bytes:
        raise AssertionError("decrypted a value sealed moments ago")

    monkeypatch.setattr(sealer, "_open", no_decrypt)
    keys.current("globex")  # a new tenant's key: the file changes, acme's key stays
    old_key = sealer.keyring.current("acme")
    keys.rotate("acme")  # a new current key for acme; the old one stays too
    assert sealer.open(sealed) == '{"args":[1]}'
    again = sealer.seal('{"args":[2]}', "acme")
    assert again.startswith(f"~e1:{keys.current('acme')}:") and old_key not in again


class _SwappableKeyring(StaticKeyring):
    """One key id whose key bytes can be replaced (a keyring file swapped for another)."""

    def __init__(self) -> None:
        super().__init__({"k1": os.urandom(32)}, "k1")
        self.version = 0

    def generation(self) -> object:
        return self.version

    def swap(self) -> None:
        self._keys["k1"] = os.urandom(32)
        self.version += 1


def test_a_value_sealed_here_is_forgotten_when_its_key_changes_under_its_id() -> None:
    ring = _SwappableKeyring()
    sealer = Sealer(ring)
    sealed = sealer.seal('{"args":[1]}')
    assert sealer.open(sealed) == '{"args":[1]}'
    ring.swap()
    with pytest.raises(KeyUnavailableError, match="does not open"):
        sealer.open(sealed)  # not from memory: the key that sealed it is not this one


def test_the_latest_sealed_values_stay_remembered_when_the_memory_fills(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tether import encryption

    sealer = Sealer(StaticKeyring.parse(f"k1={new_key()}"))
    values = [f'{{"args":[{i}]}}' for i in range(encryption._RECENT + 10)]
    sealed = [sealer.seal(v) for v in values]

    def no_decrypt(*a: object, **k: object) -> bytes:
        raise AssertionError("decrypted a value sealed moments ago")

    monkeypatch.setattr(sealer, "_open", no_decrypt)
    # the memory filled up 10 values ago: the values sealed just before are still known
    for i in (encryption._RECENT - 1, encryption._RECENT - 100, encryption._RECENT + 9):
        assert sealer.open(sealed[i]) == values[i]


class _FakeKms(KeyWrapper):
    """A KMS stand-in: wraps under a master key, counts calls, can be told to refuse."""

    def __init__(self, master: bytes, name: str = "kms-key-1") -> None:
        self.inner = LocalKeyWrapper(master, name)
        self.name = name
        self.unwraps = 0
        self.down = False

    def wrap(self, key: bytes) -> bytes:
        return self.inner.wrap(key)

    def unwrap(self, wrapped: bytes) -> bytes:
        if self.down:
            raise ConnectionError("kms unreachable")
        self.unwraps += 1
        return self.inner.unwrap(wrapped)


async def test_a_wrapped_keyring_keeps_no_key_in_the_clear_and_needs_its_wrapper(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    master = os.urandom(32)
    kms = _FakeKms(master)
    ring = FileKeyring.create(tmp_path / "keys.json", per_tenant=True, wrapper=kms)
    app = tether.App(store=store_url, encryption=ring)
    _register(app)
    async with app.worker(poll_interval=0.05):
        out = await (await app.start("echo", f"hi {CANARY}", tenant="acme")).result(timeout=30)
    assert CANARY in out and CANARY not in _rows_text(store_url)
    app.store.close_sync()  # type: ignore[attr-defined]
    stored = json.loads((tmp_path / "keys.json").read_text())
    assert stored["wrapped_by"] == "kms-key-1"
    entries = list(stored["keys"].values())
    assert len(entries) == 2 and all("key" not in e and "wrapped" in e for e in entries)
    assert kms.unwraps == 1  # acme's key, once for the process (not once per value)

    # another process: the keyring file alone opens nothing, and says what is missing
    monkeypatch.setenv("TETHER_KEYRING", str(tmp_path / "keys.json"))
    monkeypatch.delenv("TETHER_KEY_WRAPPER", raising=False)
    with pytest.raises(tether.ConfigurationError, match="TETHER_KEY_WRAPPER"):
        await tether.App(store=store_url).list()  # the store opens on first use
    bare = FileKeyring(tmp_path / "keys.json")  # listing and shredding need no wrapper
    assert {k["key_id"] for k in bare.listing()} == set(stored["keys"])
    k1 = bare.current(None)
    with pytest.raises(KeyUnavailableError, match="no wrapper"):
        bare.key(k1)
    wrong = _FakeKms(os.urandom(32))  # the same name, another master key
    with pytest.raises(KeyUnavailableError, match="did not unwrap"):
        FileKeyring(tmp_path / "keys.json", wrapper=wrong).key(k1)
    down = _FakeKms(master)
    down.down = True
    with pytest.raises(KeyUnavailableError, match="ConnectionError"):
        FileKeyring(tmp_path / "keys.json", wrapper=down).key(k1)
    with pytest.raises(tether.ConfigurationError, match="wrapped by 'kms-key-1', not 'other'"):
        FileKeyring(tmp_path / "keys.json", wrapper=_FakeKms(master, "other"))

    # with the wrapper named in the environment, a process reads everything back
    name = f"kms_{os.urandom(4).hex()}"  # a module of its own per test (imports are cached)
    (tmp_path / f"{name}.py").write_text(
        "from tether.encryption import LocalKeyWrapper\n"
        f"wrapper = LocalKeyWrapper(bytes.fromhex({master.hex()!r}), 'kms-key-1')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("TETHER_KEY_WRAPPER", f"{name}:wrapper")
    reader = tether.App(store=store_url)
    (info,) = await reader.list(tenant="acme")
    assert CANARY in info.input
    reader.store.close_sync()  # type: ignore[attr-defined]


def test_keyring_wrap_wraps_the_keys_of_a_plain_keyring_in_place(tmp_path: Path) -> None:
    path = str(tmp_path / "keys.json")
    assert _tether("keyring", "init", path).returncode == 0
    plain = FileKeyring(path)
    sealed = Sealer(plain).seal(f"before {CANARY}")
    master = os.urandom(32)
    (tmp_path / "kms_wrapper.py").write_text(
        "from tether.encryption import LocalKeyWrapper\n"
        f"wrapper = LocalKeyWrapper(bytes.fromhex({master.hex()!r}), 'kms-key-1')\n"
    )
    env = {"TETHER_KEYRING": path, "PYTHONPATH": str(tmp_path)}
    refused = _tether("keyring", "wrap", env=env)
    assert refused.returncode == 2 and "--wrapper" in refused.stderr
    done = _tether("keyring", "wrap", "--wrapper", "kms_wrapper:wrapper", env=env)
    assert done.returncode == 0, done.stderr
    assert "wrapped 1 key(s)" in done.stderr
    text = (tmp_path / "keys.json").read_text()
    assert '"key":' not in text and '"wrapped_by": "kms-key-1"' in text
    kms = _FakeKms(master)
    wrapped = FileKeyring(path, wrapper=kms)
    assert Sealer(wrapped).open(sealed) == f"before {CANARY}"  # data sealed before reads
    rotated = _tether("keyring", "rotate", env={**env, "TETHER_KEY_WRAPPER": "kms_wrapper:wrapper"})
    assert rotated.returncode == 0, rotated.stderr
    assert all("wrapped" in e for e in json.loads(Path(path).read_text())["keys"].values())
    no_wrapper = _tether("keyring", "rotate", env=env)  # a new key must be wrapped too
    assert no_wrapper.returncode == 2 and "TETHER_KEY_WRAPPER" in no_wrapper.stderr
    bad = _tether("keyring", "init", str(tmp_path / "k2.json"), "--wrapper", "nope:thing")
    assert bad.returncode == 2 and "cannot load it" in bad.stderr


async def test_reseal_seals_put_blob_blobs_so_the_old_key_can_go(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Blobs from ``put_blob`` keep their reference (the hash of their bytes): reseal
    seals them again in place under the current key, and seals those put before
    encryption was on. A blob under a key the keyring lacks fails the step's attempt
    retryably: given the key back, the run goes on."""
    monkeypatch.delenv("TETHER_KEYRING", raising=False)
    monkeypatch.delenv("TETHER_ENCRYPTION_KEYS", raising=False)
    blobs = tmp_path / "blobs"
    k1, k2 = os.urandom(32), os.urandom(32)

    def build(keys: StaticKeyring | None) -> tether.App:
        app = tether.App(store=store_url, blobs=str(blobs), encryption=keys)

        @app.activity
        def fetch(text: str) -> tether.Blob:
            return tether.put_blob(text.encode() * 100)

        @app.activity(retry=tether.Retry(attempts=50, initial=0.05, max_interval=0.05))
        def size(b: tether.Blob) -> int:
            return len(tether.read_blob(b))

        @app.workflow
        async def flow() -> int:
            old = await fetch("before encryption ")
            await tether.wait_event("on")
            new = await fetch("contract text ")
            await tether.wait_event("go")
            return await size(old) + await size(new)

        return app

    def heads() -> list[bytes]:
        return sorted(p.read_bytes()[:8] for p in blobs.rglob("*") if p.is_file())

    plain = build(None)
    async with plain.worker(poll_interval=0.05):
        await plain.start("flow", run_id="r1")
        await _until_waiting(plain, "r1", 1)
    plain.store.close_sync()  # type: ignore[attr-defined]
    sealed = build(StaticKeyring({"k1": k1}, "k1"))
    async with sealed.worker(poll_interval=0.05):
        await sealed.signal("r1", "on", 1)
        await _until_waiting(sealed, "r1", 2)
    sealed.store.close_sync()  # type: ignore[attr-defined]
    assert heads() == sorted([b"before e", b"~e1:k1:z"])
    rotated = build(StaticKeyring({"k2": k2, "k1": k1}, "k2"))
    counts = await rotated.reseal()
    assert counts["blobs_resealed"] == 2
    # what `tether store reseal` says: the two blobs are not counted as values
    assert reseal_summary(counts).startswith(
        f"resealed {sum(counts.values()) - 2 - counts.get('blobs', 0)} value(s) and 2 blob(s)"
    )
    assert heads() == [b"~e1:k2:z"] * 2
    assert (await rotated.reseal())["blobs_resealed"] == 0  # nothing left to do
    rotated.store.close_sync()  # type: ignore[attr-defined]
    retired = build(StaticKeyring({"k2": k2}, "k2"))  # k1 retired: everything reads
    async with retired.worker(poll_interval=0.05):
        await retired.signal("r1", "go", 1)
        assert await retired.get_run("r1").result(timeout=20) == 18 * 100 + 14 * 100
    retired.store.close_sync()  # type: ignore[attr-defined]


def test_a_blob_under_a_key_this_keyring_lacks_is_a_retryable_blob_error(
    tmp_path: Path,
) -> None:
    from tether.blobs import BlobError, BlobStore
    from tether.encryption import Sealer

    store = BlobStore(str(tmp_path))
    store.sealer = Sealer(StaticKeyring({"k1": os.urandom(32)}, "k1"))
    blob = store.put(b"the contract")
    store.sealer = Sealer(StaticKeyring({"k2": os.urandom(32)}, "k2"))
    with pytest.raises(BlobError, match="k1"):  # not a PayloadError: retried
        store.get(blob)


async def _until_waiting(app: tether.App, run_id: str, fetched: int) -> None:
    for _ in range(400):
        h = await app.history(run_id)
        done = [e for e in h if e.type is tether.EventType.ACTIVITY_COMPLETED]
        if len(done) == fetched and h[-1].type is tether.EventType.WORKFLOW_TASK_COMPLETED:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the run did not come to wait")


def test_a_plain_blob_sealed_in_place_still_reads_as_an_offloaded_payload(tmp_path: Path) -> None:
    """Reseal seals every plain blob in place; one an offloaded payload still names (its
    row not yet rewritten) reads back as the plain bytes it was."""
    from tether.blobs import BlobStore
    from tether.encryption import Sealer

    store = BlobStore(str(tmp_path))
    blob = store.put(b'"a payload offloaded before encryption"', sealed=True)
    store.sealer = Sealer(StaticKeyring({"k1": os.urandom(32)}, "k1"))
    assert store.reseal(blob.ref) and not store.reseal(blob.ref)
    assert store.head(blob.ref).startswith(b"~e1:k1:")
    assert store.get(blob, sealed=True) == b'"a payload offloaded before encryption"'
    assert store.get(blob) == b'"a payload offloaded before encryption"'


_RESEAL_KILLED = """
import asyncio, base64, os, sys
import tether
from tether.encryption import StaticKeyring

keys = StaticKeyring({"k1": base64.b64decode(sys.argv[3])}, "k1")
app = tether.App(store=sys.argv[1], blobs=sys.argv[2], offload_above=1024, encryption=keys)
batches = 0
real = app.store.reseal_batch


async def dies(*args, **kwargs):
    global batches
    batches += 1
    if batches == 3:  # some payloads moved to new blobs, their old ones not deleted yet
        os._exit(9)
    return await real(*args, **kwargs)


app.store.reseal_batch = dies
asyncio.run(app.reseal(batch=2))
"""


async def test_a_reseal_killed_half_way_and_run_again_leaves_no_old_blob(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reseal killed after moving some offloaded payloads to new blobs, run again to
    its end, leaves on disk only blobs a payload refers to, none of them plain."""
    monkeypatch.delenv("TETHER_KEYRING", raising=False)
    monkeypatch.delenv("TETHER_ENCRYPTION_KEYS", raising=False)
    blobs = tmp_path / "blobs"
    plain = tether.App(store=store_url, blobs=str(blobs), offload_above=1024)
    _register(plain)
    async with plain.worker(poll_interval=0.05):
        for i in range(6):
            assert await (await plain.start("echo", f"{CANARY}-{i} " * 100)).result(timeout=30)
    plain.store.close_sync()  # type: ignore[attr-defined]
    old = time.time() - 7200  # written long before the reseal
    for p in blobs.rglob("*"):
        if p.is_file():
            os.utime(p, (old, old))
    key = os.urandom(32)
    killed = subprocess.run(
        [
            sys.executable,
            "-c",
            _RESEAL_KILLED,
            store_url,
            str(blobs),
            base64.b64encode(key).decode(),
        ],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent / "src")},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert killed.returncode == 9, killed.stderr
    app = tether.App(
        store=store_url,
        blobs=str(blobs),
        offload_above=1024,
        encryption=StaticKeyring({"k1": key}, "k1"),
    )
    await app.reseal()
    stored = {f"sha256:{p.parent.name}{p.name}" for p in blobs.rglob("*") if p.is_file()}
    assert stored == await app.store.blob_refs()
    assert all(p.read_bytes().startswith(b"~e1:k1:") for p in blobs.rglob("*") if p.is_file())
    app.store.close_sync()  # type: ignore[attr-defined]


async def test_a_dead_letter_s_resolution_is_sealed_under_its_tenant_s_key(
    store_url: str, tmp_path: Path
) -> None:
    """A replayed dead letter's result was sealed under the shared key: shredding the
    tenant left it readable. It is sealed under the tenant's key, so it goes too."""
    keys = _keyring(tmp_path, per_tenant=True)
    app = tether.App(store=store_url, encryption=keys)
    fixed = {"v": False}

    @app.activity(retry=tether.Retry(attempts=1))
    def work(x: str) -> str:
        if x == "poison" and not fixed["v"]:
            raise tether.NonRetryable("bad item")
        return f"RESULT-OF-{x}"

    @app.workflow
    async def batch(items: list[str]) -> int:
        outs = await tether.map(work, items)
        return sum(1 for o in outs if o.ok)

    try:
        async with app.worker(poll_interval=0.02):
            run = await app.start(batch, ["a", "poison"], tenant="acme")
            assert await run.result(timeout=30) == 1
        (letter,) = await app.dead_letters()
        fixed["v"] = True
        assert await app.replay_dead_letter(letter.id) == "RESULT-OF-poison"
        (done,) = await app.dead_letters(include_resolved=True)
        assert done.resolution == {"state": "replayed", "result": "RESULT-OF-poison"}
        (stored,) = _column(store_url, "SELECT resolution FROM dead_letters")
        assert stored.startswith(f"~e1:{keys.current('acme')}:"), stored[:40]
    finally:
        await app.close()


def test_key_ids_carry_randomness_and_are_never_used_again(tmp_path: Path) -> None:
    # two keyrings made apart never mint the same id
    a = FileKeyring.create(tmp_path / "a.json", per_tenant=True)
    b = FileKeyring.create(tmp_path / "b.json", per_tenant=True)
    assert a.current(None) != b.current(None)
    assert a.current("acme") != b.current("acme")
    first, acme_first = a.current(None), a.current("acme")
    assert first.startswith("k1-") and acme_first.split("-")[1] == "1"
    second = a.rotate()
    assert second.startswith("k2-")
    # a retired key's id stays listed: no later key takes it, and it says why it is gone
    with pytest.raises(tether.ConfigurationError, match="current"):
        a.retire(second)
    a.retire(first)
    with pytest.raises(KeyUnavailableError, match="retired"):
        FileKeyring(tmp_path / "a.json").key(first)
    listed = {k["key_id"]: k for k in a.listing()}
    assert listed[first]["retired_at"] is not None and listed[second]["retired_at"] is None
    third = a.rotate()
    assert third.startswith("k3-") and third not in (first, second)
    # a key removed from the file by hand: its number is not taken again either
    data = json.loads((tmp_path / "a.json").read_text())
    del data["keys"][third]
    (tmp_path / "a.json").write_text(json.dumps(data))
    fourth = FileKeyring(tmp_path / "a.json").rotate()
    assert fourth != third and fourth.startswith("k3-")


async def test_a_second_keyring_with_the_same_key_ids_is_refused_before_it_seals(
    store_url: str, tmp_path: Path
) -> None:
    from tether.encryption import KeyringMismatchError

    right = _keyring(tmp_path)
    key_id = right.current(None)
    app = tether.App(store=store_url, encryption=right)
    _register(app)
    await app.start("echo", "one", run_id="r1")
    # another keyring holding another key under the same id (made anew by mistake)
    other = StaticKeyring({key_id: os.urandom(32)}, key_id)
    wrong = tether.App(store=store_url, encryption=other)
    _register(wrong)
    for attempt in (
        lambda: wrong.start("echo", "two", run_id="r2"),
        lambda: wrong.signal("r1", "note", {"x": 1}),
    ):
        with pytest.raises(KeyringMismatchError) as err:
            await attempt()
        assert err.value.key_id == key_id and key_id in str(err.value)
        assert "another keyring" in str(err.value) and "Nothing was written" in str(err.value)
    with pytest.raises(tether.RunNotFoundError):
        await app.get("r2")
    assert [e for e in await app.history("r1") if e.type is EventType.SIGNAL_RECEIVED] == []
    wrong.store.close_sync()  # type: ignore[attr-defined]
    # the right keyring goes on as before
    async with app.worker(poll_interval=0.05):
        assert await app.get_run("r1").result(timeout=30) == f"ONE {CANARY}"
        assert await (await app.start("echo", "three", run_id="r3")).result(timeout=30)
    app.store.close_sync()  # type: ignore[attr-defined]


async def test_a_worker_with_another_keyring_stops_claiming_and_leaves_the_queue_to_others(
    store_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # it opens what is there (k1) but its new key k2 is not the k2 that sealed the store
    k1, k2 = os.urandom(32), os.urandom(32)
    seeder = tether.App(store=store_url, encryption=StaticKeyring({"k1": k1, "k2": k2}, "k2"))
    _register(seeder)
    await seeder.start("echo", "zero", run_id="r0")  # k2 seals something: its fingerprint
    seeder.store.close_sync()  # type: ignore[attr-defined]
    app = tether.App(store=store_url, encryption=StaticKeyring({"k1": k1, "k2": k2}, "k1"))
    _register(app)
    await app.start("echo", "one", run_id="r1")
    await app.start("echo", "two", run_id="r2")
    key_id = "k2"
    other = StaticKeyring({"k1": k1, "k2": os.urandom(32)}, "k2")
    wrong = tether.App(store=store_url, encryption=other)
    _register(wrong)
    claims: list[str] = []
    real_claim = wrong.store.claim_with_wake

    async def counted(**kwargs: Any) -> Any:
        tasks, until = await real_claim(**kwargs)
        claims.extend(t.run_id for t in tasks)
        return tasks, until

    wrong.store.claim_with_wake = counted  # type: ignore[method-assign]
    caplog.set_level("ERROR", logger="tether")
    async with wrong.worker(poll_interval=0.05, concurrency=1) as worker:
        deadline = time.monotonic() + 20
        while not claims and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert claims, "the worker claimed nothing"
        await asyncio.sleep(2.5)
        # it stopped claiming: the run it could not serve is not churned through it
        assert len(claims) == 1, claims
        assert worker.stats["keyring_mismatches"] == 1
        # and what it gave back is at once another worker's, not held for seconds
        async with app.worker(poll_interval=0.05):
            for run_id in ("r1", "r2"):
                assert await app.get_run(run_id).result(timeout=5)
    # the mismatch said once (the failed workflow task's own line names the key too:
    # the engine made its message from ids alone, so it is logged whole)
    said = [
        r
        for r in caplog.records
        if key_id in r.getMessage() and not r.getMessage().startswith("workflow task for run")
    ]
    assert len(said) == 1 and "claims" in said[0].getMessage(), [r.getMessage() for r in said]
    wrong.store.close_sync()  # type: ignore[attr-defined]
    app.store.close_sync()  # type: ignore[attr-defined]


async def test_a_store_sealed_before_fingerprints_were_kept_refuses_a_key_that_does_not_open_it(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tether.encryption import KeyringMismatchError

    monkeypatch.delenv("TETHER_KEYRING", raising=False)
    monkeypatch.delenv("TETHER_ENCRYPTION_KEYS", raising=False)

    right = _keyring(tmp_path)
    key_id = right.current(None)
    app = tether.App(store=store_url, encryption=right)
    _register(app)
    await app.start("echo", "one", run_id="r1")
    app.store.close_sync()  # type: ignore[attr-defined]
    _forget_fingerprints(store_url)  # as a store sealed by an earlier version
    bare = tether.App(store=store_url)
    _register(bare)
    # the upgrade marks it encrypted: no payload in the clear from a keyless process
    with pytest.raises(KeyringMismatchError, match="TETHER_KEYRING"):
        await bare.start("echo", CANARY, run_id="r9")
    bare.store.close_sync()  # type: ignore[attr-defined]
    wrong = tether.App(store=store_url, encryption=StaticKeyring({key_id: os.urandom(32)}, key_id))
    _register(wrong)
    with pytest.raises(KeyringMismatchError, match="another keyring"):
        await wrong.start("echo", "two", run_id="r2")
    wrong.store.close_sync()  # type: ignore[attr-defined]
    # sealing under an id the store has not seen, with another key under one it has
    # (an old keyring's tenant ids came from the tenant's name): refused too
    mixed = tether.App(
        store=store_url,
        encryption=StaticKeyring({"fresh": os.urandom(32), key_id: os.urandom(32)}, "fresh"),
    )
    _register(mixed)
    with pytest.raises(KeyringMismatchError, match=key_id):
        await mixed.start("echo", "two", run_id="r2")
    mixed.store.close_sync()  # type: ignore[attr-defined]
    again = tether.App(store=store_url, encryption=FileKeyring(tmp_path / "keys.json"))
    _register(again)
    await again.start("echo", "two", run_id="r2")  # the right key: recorded, accepted
    again.store.close_sync()  # type: ignore[attr-defined]


async def test_a_store_sealed_before_fingerprints_with_every_payload_offloaded_is_encrypted(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # an older encrypted store whose sealed inputs all went to blobs: its rows hold
    # references (~b1:), no sealed value; the upgrade still marks it encrypted
    from tether.encryption import KeyringMismatchError

    monkeypatch.delenv("TETHER_KEYRING", raising=False)
    monkeypatch.delenv("TETHER_ENCRYPTION_KEYS", raising=False)
    blobs = tmp_path / "blobs"
    big = f"{CANARY} " * 400
    right = _keyring(tmp_path)
    key_id = right.current(None)
    app = tether.App(store=store_url, blobs=str(blobs), offload_above=1024, encryption=right)
    _register(app)
    await app.start("echo", big, run_id="r1")
    app.store.close_sync()  # type: ignore[attr-defined]
    _forget_fingerprints(store_url)  # as a store sealed by an earlier version
    bare = tether.App(store=store_url, blobs=str(blobs), offload_above=1024)
    _register(bare)
    with pytest.raises(KeyringMismatchError, match="TETHER_KEYRING"):
        await bare.start("echo", CANARY, run_id="r9")
    with pytest.raises(KeyringMismatchError, match="TETHER_KEYRING"):
        await bare.start("echo", big, run_id="r9")
    bare.store.close_sync()  # type: ignore[attr-defined]
    assert CANARY.encode() not in _stored_bytes(store_url)
    # a keyring holding another key under the id its blobs were sealed with: refused
    wrong = tether.App(
        store=store_url,
        blobs=str(blobs),
        offload_above=1024,
        encryption=StaticKeyring({key_id: os.urandom(32)}, key_id),
    )
    _register(wrong)
    with pytest.raises(KeyringMismatchError, match="another keyring"):
        await wrong.start("echo", "two", run_id="r2")
    wrong.store.close_sync()  # type: ignore[attr-defined]
    again = tether.App(
        store=store_url,
        blobs=str(blobs),
        offload_above=1024,
        encryption=FileKeyring(tmp_path / "keys.json"),
    )
    _register(again)
    await again.start("echo", "two", run_id="r2")  # the right key: recorded, accepted
    again.store.close_sync()  # type: ignore[attr-defined]


async def test_a_plain_store_with_offloaded_payloads_stays_plain_after_the_upgrade(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TETHER_KEYRING", raising=False)
    monkeypatch.delenv("TETHER_ENCRYPTION_KEYS", raising=False)
    blobs = tmp_path / "blobs"
    big = "plain words " * 400
    app = tether.App(store=store_url, blobs=str(blobs), offload_above=1024)
    _register(app)
    await app.start("echo", big, run_id="r1")
    app.store.close_sync()  # type: ignore[attr-defined]
    _forget_fingerprints(store_url)
    for attempt in range(2):  # the second process reads what the first decided
        bare = tether.App(store=store_url, blobs=str(blobs), offload_above=1024)
        _register(bare)
        await bare.start("echo", "in the clear", run_id=f"p{attempt}")
        assert (await bare.get(f"p{attempt}")).input == '{"args":["in the clear"],"kwargs":{}}'
        bare.store.close_sync()  # type: ignore[attr-defined]


async def test_a_plain_store_offloading_inputs_is_written_by_a_process_that_cannot_read_its_blobs(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The upgrade to schema 12 marked every store whose latest input was offloaded to a
    blob as maybe encrypted, plain ones too: a process without a keyring that could not
    read the blob (its blob root elsewhere, the blob collected) was refused every write,
    for good once the blobs were gone. A store holding a plain inline input or output was
    written plain: it is no longer marked (one that holds nothing else is still refused,
    below)."""

    monkeypatch.delenv("TETHER_KEYRING", raising=False)
    monkeypatch.delenv("TETHER_ENCRYPTION_KEYS", raising=False)
    blobs = tmp_path / "blobs"
    big = "plain words " * 400
    app = tether.App(store=store_url, blobs=str(blobs), offload_above=1024)
    _register(app)
    await app.start("echo", "small", run_id="r0")  # a plain inline input
    await app.start("echo", big, run_id="r1")  # the latest: offloaded
    app.store.close_sync()  # type: ignore[attr-defined]
    _forget_fingerprints(store_url)
    elsewhere = tether.App(store=store_url, blobs=str(tmp_path / "other"), offload_above=1024)
    _register(elsewhere)
    await elsewhere.start("echo", "in the clear", run_id="p1")
    assert (await elsewhere.get("p1")).input == '{"args":["in the clear"],"kwargs":{}}'
    elsewhere.store.close_sync()  # type: ignore[attr-defined]


async def test_a_store_whose_inputs_were_all_offloaded_and_whose_blobs_are_gone_says_the_way_out(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tether.encryption import KeyringMismatchError

    monkeypatch.delenv("TETHER_KEYRING", raising=False)
    monkeypatch.delenv("TETHER_ENCRYPTION_KEYS", raising=False)
    blobs = tmp_path / "blobs"
    big = "plain words " * 400
    url = store_url
    app = tether.App(store=url, blobs=str(blobs), offload_above=1024)
    _register(app)
    await app.start("echo", big, run_id="r1")  # every input offloaded, nothing inline
    app.store.close_sync()  # type: ignore[attr-defined]
    _forget_fingerprints(url)
    shutil.rmtree(blobs)  # collected
    bare = tether.App(store=url, blobs=str(blobs), offload_above=1024)
    _register(bare)
    with pytest.raises(KeyringMismatchError) as err:
        await bare.start("echo", "in the clear", run_id="p1")
    said = str(err.value)
    assert "TETHER_BLOBS" in said and "TETHER_KEYRING" in said, said
    clear = "DELETE FROM seal_keys WHERE key_id = '' AND fingerprint <> ''"
    assert clear in said, said
    bare.store.close_sync()  # type: ignore[attr-defined]
    _execute(url, clear)  # the store is known to be plain
    bare = tether.App(store=url, blobs=str(blobs), offload_above=1024)
    _register(bare)
    await bare.start("echo", "in the clear", run_id="p1")
    bare.store.close_sync()  # type: ignore[attr-defined]


def _execute(store_url: str, statement: str) -> None:
    """Run one SQL statement in the store (its schema, on PostgreSQL)."""
    if store_url.startswith("sqlite:///"):
        import sqlite3

        with sqlite3.connect(store_url[len("sqlite:///") :]) as conn:
            conn.execute(statement)
        return
    import psycopg
    from psycopg import sql

    schema = store_url.rsplit("schema=", 1)[1]
    with psycopg.connect(PG_URL, autocommit=True) as conn:
        conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(schema)))
        conn.execute(statement.encode())


def _forget_fingerprints(store_url: str) -> None:
    """Take the store back to schema version 11, before ``seal_keys``."""
    if store_url.startswith("sqlite:///"):
        import sqlite3

        with sqlite3.connect(store_url[len("sqlite:///") :]) as conn:
            conn.execute("DROP TABLE seal_keys")
            conn.execute("PRAGMA user_version = 11")
        return
    import psycopg
    from psycopg import sql

    schema = store_url.rsplit("schema=", 1)[1]
    with psycopg.connect(PG_URL, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP TABLE {}.seal_keys").format(sql.Identifier(schema)))
        meta = sql.Identifier(schema, "tether_meta")
        conn.execute(sql.SQL("DELETE FROM {}").format(meta))
        conn.execute(sql.SQL("INSERT INTO {} VALUES (11, 0)").format(meta))


async def test_a_process_without_a_keyring_writes_no_payload_into_an_encrypted_store(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tether.encryption import KeyringMismatchError

    monkeypatch.delenv("TETHER_KEYRING", raising=False)
    monkeypatch.delenv("TETHER_ENCRYPTION_KEYS", raising=False)
    keyed = tether.App(store=store_url, encryption=_keyring(tmp_path))
    _register(keyed)
    await keyed.start("flow", "x", run_id="r1")
    keyed.store.close_sync()  # type: ignore[attr-defined]

    bare = tether.App(store=store_url)
    _register(bare)
    for attempt in (
        lambda: bare.signal("r1", "note", {"secret": CANARY}),
        lambda: bare.start("echo", CANARY, run_id="r2", tenant="acme"),
    ):
        with pytest.raises(KeyringMismatchError, match="TETHER_KEYRING") as err:
            await attempt()
        assert "encrypted" in str(err.value) and err.value.key_id is None
    bare.store.close_sync()  # type: ignore[attr-defined]
    raw = _stored_bytes(store_url)
    assert CANARY.encode() not in raw
    # a plain store stays writable without a keyring
    if store_url.startswith("sqlite:///"):
        plain = tether.App(store=f"sqlite:///{tmp_path / 'plain.db'}")
        _register(plain)
        await plain.start("echo", "in the clear", run_id="p1")
        assert (await plain.get("p1")).input == '{"args":["in the clear"],"kwargs":{}}'
        plain.store.close_sync()  # type: ignore[attr-defined]


async def test_a_reseal_during_a_replay_leaves_its_claim_so_the_replay_records_its_outcome(
    store_url: str, tmp_path: Path
) -> None:
    """A reseal between a dead-letter replay's claim and its outcome sealed the claim (the
    letter's resolution, ``replaying`` with the replay's token): the replay, matching its
    claim as plain text, recorded nothing; the letter stayed "replaying", went stale, and
    a second replay ran the step again. A reseal now leaves claims (live or of an earlier
    version) as they are."""
    from test_recovery import _set_letter
    from tether.store.ops import recovery

    keys = _keyring(tmp_path)
    app = tether.App(store=store_url, encryption=keys)
    broken = {"on": True}
    gate, started = threading.Event(), threading.Event()
    calls: list[int] = []

    @app.activity(retry=tether.Retry(attempts=1, initial=0.01, jitter=0))
    def poison(item: int) -> int:
        calls.append(item)
        if broken["on"]:
            raise tether.NonRetryable("bad")
        started.set()
        gate.wait(20)
        return item * 10

    @app.workflow
    async def batch(items: list[int]) -> int:
        outs = await tether.map(poison, items)
        return sum(1 for o in outs if not o.ok)

    async with app.worker(poll_interval=0.05):
        assert await (await app.start(batch, [7], run_id="b")).result(timeout=10) == 1
        assert await (await app.start(batch, [8], run_id="c")).result(timeout=10) == 1
    (item,) = await app.dead_letters(run_id="b")
    (old,) = await app.dead_letters(run_id="c")
    keys.rotate()  # the letters' payloads are under the old key: reseal rewrites them
    broken["on"] = False
    replay = asyncio.create_task(app.replay_dead_letter(item.id))
    while not started.is_set():
        await asyncio.sleep(0.02)
    (claimed,) = await app.dead_letters(run_id="b", include_resolved=True)
    assert claimed.resolution is not None and claimed.resolution["state"] == "replaying"
    # a claim an earlier version left (never renewed): taken over once stale
    _set_letter(store_url, old.id, '{"state": "replaying"}', time.time() - 3600)
    resealed = await app.reseal()
    assert resealed["dead_letters"] >= 4  # both letters' input and error
    assert _column(store_url, f"SELECT resolution FROM dead_letters WHERE id = {item.id}")[
        0
    ].startswith('{"state": "replaying"')
    gate.set()
    assert await asyncio.wait_for(replay, 20) == 70
    (done,) = await app.dead_letters(run_id="b", include_resolved=True)
    assert done.resolution == {"state": "replayed", "result": 70}
    assert done.resolved_at is not None and done.resolved_at > 0
    monkey = recovery.CLAIM_TTL
    recovery.CLAIM_TTL = 0.01
    try:
        await asyncio.sleep(0.05)
        assert await app.dead_letters(run_id="b") == []  # closed, not stale
        with pytest.raises(tether.RecoveryError):
            await app.replay_dead_letter(item.id)
        assert calls == [7, 8, 7]  # the step ran once more (the replay), not twice
        # the earlier version's claim stayed plain: still taken over once stale
        assert [d.id for d in await app.dead_letters(run_id="c")] == [old.id]
    finally:
        recovery.CLAIM_TTL = monkey
    assert await app.replay_dead_letter(old.id) == 80
    assert (await app.reseal())["dead_letters"] == 0  # outcomes are sealed under the new key
    app.store.close_sync()  # type: ignore[attr-defined]


_STARTER = """
import asyncio, os, sys, time
import tether
from tether.encryption import FileKeyring

url, keyring, ready, stop = sys.argv[1:5]


async def main() -> None:
    app = tether.App(store=url, encryption=FileKeyring(keyring))

    @app.workflow
    async def echo(text: str) -> str:
        return text

    i = 0
    while not os.path.exists(stop):
        try:
            await app.start("echo", f"acme {i}", run_id=f"N{i}", tenant="acme")
            print(f"N{i}", flush=True)
            if i == 5:
                open(ready, "w").close()
        except Exception as exc:
            print("start failed:", type(exc).__name__, exc, file=sys.stderr, flush=True)
        i += 1
        await asyncio.sleep(0.02)
    await app.close()


asyncio.run(main())
"""


async def test_runs_another_process_starts_while_a_tenant_is_erased_stay_readable(
    store_url: str, tmp_path: Path
) -> None:
    """Runs of the tenant that another, already running process starts while it is
    erased were sealed under the key the erasure then destroyed (that process reads the
    keyring file again only once a second): they survived the erasure unreadable for
    good. Each run started during the erasure is now either erased or readable."""
    keys = _keyring(tmp_path, per_tenant=True)
    app = tether.App(store=store_url, encryption=keys)
    ready, stop = tmp_path / "ready", tmp_path / "stop"
    starter = subprocess.Popen(
        [sys.executable, "-c", _STARTER, store_url, keys.path, str(ready), str(stop)],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent / "src")},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for _ in range(600):
            if ready.exists() or starter.poll() is not None:
                break
            await asyncio.sleep(0.05)
        assert ready.exists(), starter.stderr.read() if starter.stderr else ""
        old = keys.current("acme")
        counts = await app.erase_tenant("acme")
        await asyncio.sleep(1.5)  # starts go on after the erasure, as they did during it
    finally:
        stop.touch()
        out, err = starter.communicate(timeout=60)
    assert starter.returncode == 0, err
    assert "start failed" not in err, err
    started = out.split()
    assert counts["runs"] >= 5 and counts["keys_destroyed"] >= 1
    fresh = keys.current("acme")
    assert fresh != old
    with pytest.raises(KeyUnavailableError, match="destroyed"):
        keys.key(old)
    erased = kept = 0
    for run_id in started:
        try:
            info = await app.get(run_id)
        except tether.RunPurgedError as exc:
            assert "tenant erased" in str(exc)
            erased += 1
            continue
        assert info.input == f'{{"args":["acme {run_id[1:]}"],"kwargs":{{}}}}', run_id
        kept += 1
    assert erased >= 5 and kept >= 10, (erased, kept)
    # what survived is sealed under the tenant's fresh key, which the erasure kept
    inputs = _column(store_url, "SELECT input FROM runs WHERE tenant = 'acme'")
    assert len(inputs) == kept
    assert all(text.startswith(f"~e1:{fresh}:") for text in inputs), inputs
    # the keyring lists the fresh key as the tenant's current one, the old one destroyed
    listed = {k["key_id"]: k for k in keys.listing()}
    assert listed[fresh]["tenant"] == "acme" and listed[fresh]["current"]
    assert listed[old]["destroyed_at"] is not None and not listed[old]["current"]
    app.store.close_sync()


async def test_no_copy_taken_during_an_erasure_can_be_read_after_it(tmp_path: Path) -> None:
    """The erasure made the tenant a fresh key before it ended the tenant's runs, and
    kept that key: what a running run wrote under it meanwhile stayed readable in a copy
    taken during the erasure (a backup). Its runs end first now, and every key but the
    last fresh one, made after its rows are gone, is destroyed."""
    import sqlite3

    from tether.encryption import PREFIX

    keys = _keyring(tmp_path, per_tenant=True)
    db = tmp_path / "t.db"
    app = tether.App(store=f"sqlite:///{db}", encryption=keys)

    @app.activity
    async def slow_step(i: int) -> str:
        await asyncio.sleep(0.15)
        return f"SECRET-RESULT-{i}"

    @app.workflow
    async def steps(n: int) -> int:
        for i in range(n):
            await slow_step(i)
        return n

    copies: list[Path] = []

    def copy() -> None:
        target = tmp_path / f"copy{len(copies)}.db"
        src, dst = sqlite3.connect(db), sqlite3.connect(target)
        try:
            src.backup(dst)
        finally:
            src.close()
            dst.close()
        copies.append(target)

    async with app.worker(poll_interval=0.02):
        await app.start(steps, 60, run_id="busy", tenant="acme")
        while len(await app.history("busy")) < 6:
            await asyncio.sleep(0.05)
        erasing = asyncio.ensure_future(app.erase_tenant("acme"))
        for _ in range(12):  # a copy every 0.3 s while it runs
            await asyncio.sleep(0.3)
            await asyncio.to_thread(copy)
        await erasing
    sealer = Sealer(FileKeyring(keys.path))
    opened = sealed = 0
    for target in copies:
        conn = sqlite3.connect(target)
        try:
            texts = [t for (t,) in conn.execute("SELECT data FROM events WHERE run_id = 'busy'")]
        finally:
            conn.close()
        for text in texts:
            for value in [text, *json.loads(text).values()]:
                if isinstance(value, str) and value.startswith(PREFIX):
                    sealed += 1
                    with contextlib.suppress(KeyUnavailableError):
                        sealer.open(value)
                        opened += 1
    assert sealed > 0 and opened == 0, (sealed, opened)
    await app.close()


async def test_erasing_a_tenant_destroys_the_keys_it_had_and_makes_none_for_one_without(
    tmp_path: Path,
) -> None:
    keys = _keyring(tmp_path, per_tenant=True)
    first = keys.current("acme")
    fresh = keys.rotate("acme")
    assert sorted(keys.tenant_keys("acme")) == sorted([first, fresh])
    assert keys.shred("acme", [first]) == [first]  # only those named
    assert keys.current("acme") == fresh and keys.tenant_keys("acme") == [fresh]
    assert keys.shred("acme") == [fresh]  # all of them
    assert keys.tenant_keys("acme") == [] and keys.current("acme") not in (first, fresh)
    app = tether.App(store=f"sqlite:///{tmp_path / 't.db'}", encryption=keys)
    began = time.monotonic()
    counts = await app.erase_tenant("nobody")  # no key: none made, nothing to wait for
    assert counts["keys_destroyed"] == 0 and time.monotonic() - began < 1.0
    assert keys.tenant_keys("nobody") == []
    await app.close()  # type: ignore[attr-defined]


async def test_a_run_of_a_shredded_tenant_is_tried_again_only_after_the_longest_wait(
    store_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A run whose tenant was shredded (its key destroyed on purpose) was retried every
    workflow_retry_delay for ever, each an ERROR reading ``KeyUnavailableError: <N
    characters redacted>``. No retry brings the key back: the next try waits the longest
    (UNREADABLE_MAX_HOLD), and the one line logged names the run and the key."""
    keys = _keyring(tmp_path, per_tenant=True)
    app = tether.App(store=store_url, encryption=keys)
    _register(app)
    await app.start("echo", "acme one", run_id="a1", tenant="acme")
    (key_id,) = keys.shred("acme")
    caplog.set_level("ERROR", logger="tether")
    async with app.worker(poll_interval=0.05, workflow_retry_delay=0.2) as w:
        await asyncio.sleep(2.0)
        assert w.stats["workflow_task_failures"] == 1
    said = [r.getMessage() for r in caplog.records if "'a1'" in r.getMessage()]
    assert len(said) == 1, said
    assert key_id in said[0] and "tenant 'acme' erased" in said[0], said
    assert "redacted" not in said[0] and "tried again in 300 s" in said[0], said
    # the run says why, though its error cannot be sealed for the shredded tenant
    (info,) = [r for r in await app.list() if r.run_id == "a1"]
    assert key_id in (info.task_error or "") and "destroyed" in (info.task_error or "")
    app.store.close_sync()  # type: ignore[attr-defined]


async def test_an_erasure_ends_the_tenants_runs_once_per_pass(tmp_path: Path) -> None:
    """``erase_tenant`` listed the tenant's live runs (to end them) twice in a row at its
    start: once itself and again in its first pass. Now once without per-tenant keys;
    with them, before the first fresh key and after each key has settled (runs started
    meanwhile are ended before their rows go): three times."""
    for per_tenant in (False, True):
        keys = _keyring(tmp_path, per_tenant=True) if per_tenant else None
        app = tether.App(store=f"sqlite:///{tmp_path / f'{per_tenant}.db'}", encryption=keys)
        if keys is not None:
            keys.current("acme")  # the tenant has a key: the erasure makes two fresh ones
        endings = 0
        real = app._end_tenant_runs

        async def counted(tenant: str, batch: int, real: Any = real) -> None:
            nonlocal endings
            endings += 1
            await real(tenant, batch)

        app._end_tenant_runs = counted  # type: ignore[method-assign]
        await app.erase_tenant("acme")
        assert endings == (3 if per_tenant else 1), (per_tenant, endings)
        await app.close()  # type: ignore[attr-defined]


async def test_a_new_tenants_key_is_made_before_its_run_is_stored_not_in_the_write(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # made in the store's write transaction, the keyring file's write and fsync held
    # every other write of the process (one writer thread on SQLite, a write
    # transaction open on PostgreSQL)
    import threading

    keys = _keyring(tmp_path, per_tenant=True)
    app = tether.App(store=store_url, encryption=keys)
    _register(app)
    made_in: list[str] = []
    real = FileKeyring._tenant_key

    def watched(self: FileKeyring, tenant: str, *, new: bool) -> str:
        made_in.append(threading.current_thread().name)
        return real(self, tenant, new=new)

    monkeypatch.setattr(FileKeyring, "_tenant_key", watched)
    before = threading.current_thread().name
    async with app.worker(poll_interval=0.05):
        runs = [await app.start("echo", f"acme {i}", tenant="acme") for i in range(3)]
        for r in runs:
            await r.result(timeout=30)
    assert len(made_in) == 1, made_in  # once, then known to this process
    writer = made_in[0] == "tether-sqlite" or made_in[0].startswith("tether-pg-writer")
    assert not writer and made_in[0] != before, made_in  # nor on the event loop
    key = keys.current("acme")
    assert f"~e1:{key}:".encode() in _stored_bytes(store_url)
    # a tenant erased since gets a new key where it is needed, as before
    keys.shred("acme")
    async with app.worker(poll_interval=0.05):
        again = await app.start("echo", "acme again", tenant="acme")
        assert (await again.result(timeout=30)).startswith("ACME AGAIN")
    assert keys.current("acme") != key
    await app.close()


async def test_a_burst_of_a_new_tenants_starts_looks_for_its_key_once(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # twenty starts at once of a tenant not seen yet: each took a thread of its own
    # for the same key (the first had not come back when the others asked)
    import threading

    keys = _keyring(tmp_path, per_tenant=True)
    app = tether.App(store=store_url, encryption=keys)
    _register(app)
    looks: list[str] = []
    real = FileKeyring.current
    loop_thread = threading.current_thread()

    def watched(self: FileKeyring, tenant: str | None) -> str:
        if threading.current_thread() is not loop_thread and tenant == "acme":
            looks.append(threading.current_thread().name)
        return real(self, tenant)

    monkeypatch.setattr(FileKeyring, "current", watched)
    runs = await asyncio.gather(
        *(app.start("flow", f"acme {i}", run_id=f"b{i}", tenant="acme") for i in range(20))
    )
    assert len(runs) == 20
    store_looks = [n for n in looks if n.startswith(("tether-sqlite", "tether-pg"))]
    assert len(looks) - len(store_looks) == 1, looks  # one thread's look for all twenty
    assert not app._keying  # nothing left behind
    got = await app.get("b7")
    assert got.input == '{"args":["acme 7"],"kwargs":{}}'
    await app.close()


async def test_a_start_refused_for_another_tenants_run_id_never_decides_its_key(
    store_url: str, tmp_path: Path
) -> None:
    # a start names a run id another tenant's run holds: refused, but its tenant was
    # noted for the id first, so (PostgreSQL) the next payload of that run written by
    # this process was sealed under the refused tenant's key: erasing the run's own
    # tenant left it readable, erasing the other made it unreadable
    keys = _keyring(tmp_path, per_tenant=True)
    app = tether.App(store=store_url, encryption=keys)
    _register(app)
    await app.start("flow", "acme one", run_id="r1", tenant="acme")
    with pytest.raises(tether.RunIdConflictError):
        await app.start("flow", "globex one", run_id="r1", tenant="globex")
    await app.signal("r1", "note", {"secret": "s3cret"})
    stored = _stored_bytes(store_url)
    for key in keys.tenant_keys("globex"):
        assert f"~e1:{key}:".encode() not in stored, "sealed under the refused tenant's key"
    keys.shred("globex")
    got = await app.get("r1")  # the run's payloads still open with acme's key
    assert got.input == '{"args":["acme one"],"kwargs":{}}'
    events = await app.history("r1")
    assert any("s3cret" in json.dumps(e.data) for e in events)
    await app.close()


def test_threads_meeting_a_new_tenant_at_once_write_the_keyring_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # each thread that found no key wrote (and fsynced) the whole file again under the
    # lock, though the first had made the key: 30 starts of a new tenant, up to 30 writes
    import tether.encryption as encryption

    keys = _keyring(tmp_path, per_tenant=True)
    writes: list[str] = []
    real = encryption._write

    def counted(path: str, data: dict[str, Any]) -> None:
        writes.append(path)
        real(path, data)

    monkeypatch.setattr(encryption, "_write", counted)
    go = threading.Barrier(20)

    def meet() -> str:
        go.wait()
        return keys.current("acme")

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(20) as pool:
        got = set(pool.map(lambda _: meet(), range(20)))
    assert len(got) == 1 and len(writes) == 1, (got, writes)
    assert FileKeyring(tmp_path / "keys.json").current("acme") in got


async def test_an_eager_start_refused_for_another_tenants_run_id_never_decides_its_key(
    store_url: str, tmp_path: Path
) -> None:
    # an in-process worker runs a start's first task in the start's own commit: the
    # run's end noted the starting tenant for the id before PostgreSQL's fast path found
    # the id taken, so this process sealed the existing run's next payloads under the
    # refused tenant's key (acme's run unreadable once globex was erased)
    keys = _keyring(tmp_path, per_tenant=True)

    def register(app: tether.App) -> tuple[Any, Any]:
        @app.workflow(queue="slow")
        async def waits(text: str) -> str:
            await tether.wait_event("note", timeout=60)
            return "done"

        @app.workflow
        async def quick(text: str) -> str:
            return "quick " + text

        return waits, quick

    other = tether.App(store=store_url, encryption=keys)  # as another process would
    waits, _ = register(other)
    await other.start(waits, "acme one", run_id="r1", tenant="acme")
    await other.close()
    app = tether.App(store=store_url, encryption=keys)
    _, quick = register(app)
    async with app.worker(poll_interval=0.05, queues=["default"]):
        warm = await app.start(quick, "warm", run_id="g0", tenant="globex")
        assert await warm.result(timeout=30) == "quick warm"
        with pytest.raises(tether.RunIdConflictError):
            await app.start(quick, "globex", run_id="r1", tenant="globex")
        await app.signal("r1", "note", {"secret": "s3cret"})
    await app.close()
    keys.shred("globex")
    reader = tether.App(store=store_url, encryption=keys)
    events = await reader.history("r1")  # all of it opens with acme's key
    assert any("s3cret" in json.dumps(e.data) for e in events)
    await reader.close()


def test_a_claim_with_per_tenant_keys_reads_each_tasks_tenant_by_its_run_id(
    tmp_path: Path,
) -> None:
    """The tenant a claim returns with each task is found by the runs' primary key: a
    scan of every run per task claimed made each claim slower as the store grew."""
    import sqlite3

    from tether._codec import Codec
    from tether.store.ops._tx import _claimed_cols, _Tx
    from tether.store.sqlite import SqliteStore

    db = tmp_path / "plan.db"
    SqliteStore(str(db)).close_sync()  # the schema
    codec = Codec(Sealer(_keyring(tmp_path, per_tenant=True)))
    cols = _claimed_cols(_Tx(conn=None, now=0.0, codec=codec))
    assert "tenant" in cols
    conn = sqlite3.connect(db)
    try:
        plan = conn.execute(
            "EXPLAIN QUERY PLAN UPDATE tasks SET fence = fence + 1 WHERE task_id IN "
            f"(SELECT task_id FROM tasks WHERE queue = 'q' LIMIT 10) RETURNING {cols}"
        ).fetchall()
    finally:
        conn.close()
    steps = [row[3] for row in plan]
    assert any(s.startswith("SEARCH r USING") for s in steps), steps
    assert not any(s.startswith(("SCAN r", "SCAN runs")) for s in steps), steps


def test_each_reseal_batch_of_the_history_seeks_its_place_by_the_key(tmp_path: Path) -> None:
    """A batch of a reseal after the first starts where the last ended, by the history's
    (run_id, seq) key: it scanned the table from its start, so a whole reseal of a large
    store took time quadratic in its size."""
    import sqlite3

    from tether.store.ops import reseal
    from tether.store.sqlite import SqliteStore

    db = tmp_path / "plan.db"
    SqliteStore(str(db)).close_sync()  # the schema
    seen: list[tuple[str, tuple[Any, ...]]] = []

    class Recording:
        def execute(self, sql: str, args: tuple[Any, ...] = ()) -> Any:
            seen.append((sql, args))
            return sqlite3.connect(":memory:").execute("SELECT 1 WHERE 0")

    reseal._reseal_batch(Recording(), "events", ["run-1", 7], 100)  # type: ignore[arg-type]
    ((sql, args),) = seen
    conn = sqlite3.connect(db)
    try:
        plan = [row[3] for row in conn.execute(f"EXPLAIN QUERY PLAN {sql}", args)]
    finally:
        conn.close()
    assert any(step.startswith("SEARCH events USING") for step in plan), plan
    assert not any(step.startswith("SCAN events") for step in plan), plan


def test_a_wrapped_key_replaced_under_its_id_is_unwrapped_again(tmp_path: Path) -> None:
    """A keyring file replaced by another whose key of the same id is a different key
    (wrapped): the keyring hands out the new key, not the one it unwrapped before (a
    sealer compares a held key's bytes to learn that it changed)."""
    kms = _FakeKms(os.urandom(32))
    path = tmp_path / "keys.json"
    ring = FileKeyring.create(path, wrapper=kms)
    key_id = ring.current(None)
    old = ring.key(key_id)
    data = json.loads(path.read_text())
    new = os.urandom(32)
    data["keys"][key_id]["wrapped"] = base64.b64encode(kms.wrap(new)).decode()
    path.write_text(json.dumps(data))
    ring._fresh(force=True)
    assert ring.key(key_id) == new != old
