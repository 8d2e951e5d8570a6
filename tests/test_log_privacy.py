"""The engine never logs payloads: a canary string in a run's input, its steps' errors,
a signal, a failed workflow and a failed compensation appears in no log record unless
the redaction hook lets it; the context filter and JSON lines carry run and trace ids."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

import tether
from tether import logs

CANARY = "canary-7f3a-secret-ssn-078-05-1120"


@pytest.fixture
def records() -> Iterator[list[logging.LogRecord]]:
    """Every record of every logger at DEBUG while the test runs."""
    got: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            got.append(record)

    root = logging.getLogger()
    handler, level = Keep(logging.DEBUG), root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        yield got
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
        logs.set_redactor(None)


def _text(records: list[logging.LogRecord]) -> str:
    out = []
    for r in records:
        out.append(r.getMessage())
        if r.exc_info and r.exc_info[1] is not None:
            out.append(repr(r.exc_info[1]))
        out.append(json.dumps({k: str(v) for k, v in vars(r).items()}))
    return "\n".join(out)


def _register(app: tether.App) -> tuple[tether.Workflow, tether.Workflow, tether.Workflow]:
    @app.activity(retry=tether.Retry(attempts=2, initial=0.01))
    async def leaky(text: str) -> str:
        raise ValueError(f"could not parse {text}")

    @app.activity
    async def hold(text: str) -> str:
        return text

    @app.activity(retry=tether.Retry(attempts=1))
    async def undo(text: str) -> None:
        raise RuntimeError(f"undo failed for {text}")

    @app.workflow
    async def parse(text: str) -> str:
        got = await tether.wait_event("more")
        return await leaky(f"{text} {got}")

    @app.workflow
    async def crash(text: str) -> None:
        raise KeyError(text)  # workflow code that quotes its input in an error

    @app.workflow
    async def rollback(text: str) -> None:
        async with tether.saga() as saga:
            await saga.step(hold(text), undo=undo)
            raise ValueError(f"then failed on {text}")

    return parse, crash, rollback


async def test_no_payload_reaches_a_log_line(
    app: tether.App, records: list[logging.LogRecord]
) -> None:
    parse, crash, rollback = _register(app)
    async with app.worker(poll_interval=0.05):
        run = await app.start(parse, CANARY)
        await app.signal(run.run_id, "more", CANARY)
        with pytest.raises(tether.WorkflowFailedError):
            await run.result(timeout=20)
        with pytest.raises(tether.WorkflowFailedError):
            await (await app.start(crash, CANARY)).result(timeout=20)
        with pytest.raises(tether.RunNeedsInterventionError):
            await (await app.start(rollback, CANARY)).result(timeout=20)
    text = _text(records)
    assert "needs intervention" in text  # the line was written, without the message
    assert CANARY not in text
    assert "characters redacted" in text


async def test_the_redaction_hook_decides_what_is_shown(
    app: tether.App, records: list[logging.LogRecord]
) -> None:
    _, _, rollback = _register(app)
    logs.set_redactor(lambda text: text.replace(CANARY, "***"))
    async with app.worker(poll_interval=0.05):
        with pytest.raises(tether.RunNeedsInterventionError):
            await (await app.start(rollback, CANARY)).result(timeout=20)
    text = _text(records)
    assert CANARY not in text and "undo failed for ***" in text
    logs.set_redactor(lambda text: text)  # a hook that shows everything
    async with app.worker(poll_interval=0.05):
        with pytest.raises(tether.RunNeedsInterventionError):
            await (await app.start(rollback, CANARY)).result(timeout=20)
    assert CANARY in _text(records)


async def test_records_carry_the_run_and_the_json_line_too(app: tether.App) -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(run_id)s %(workflow)s|%(message)s"))
    handler.addFilter(logs.ContextFilter())
    json_stream = io.StringIO()
    json_handler = logging.StreamHandler(json_stream)
    json_handler.setFormatter(logs.JsonFormatter())
    user = logging.getLogger("user.code")
    user.addHandler(handler)
    user.addHandler(json_handler)
    user.setLevel(logging.INFO)

    @app.activity
    async def chatty() -> None:
        user.info("hello from the activity")

    @app.workflow
    async def noisy() -> None:
        if not tether.is_replaying():
            user.info("hello from the workflow")
        await chatty()

    try:
        async with app.worker(poll_interval=0.05):
            run = await app.start(noisy, tenant="acme")
            await run.result(timeout=20)
    finally:
        user.removeHandler(handler)
        user.removeHandler(json_handler)
    assert f"{run.run_id} noisy|hello from the workflow" in stream.getvalue()
    line, step = (json.loads(x) for x in json_stream.getvalue().splitlines()[:2])
    assert line["run_id"] == run.run_id and line["tenant"] == "acme"
    assert step["activity"] == "chatty" and step["tenant"] == "acme" and step["attempt"] == 1


def test_the_context_filter_gives_every_field_outside_a_run() -> None:
    """A line logged outside any run, with a format using any documented field, is
    written with None for each field: not dropped with a formatting error."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    fields = ("run_id", "workflow", "step", "activity", "attempt", "tenant", "trace_id", "span_id")
    handler.setFormatter(
        logging.Formatter(" ".join(f"{f}=%({f})s" for f in fields) + " %(message)s")
    )
    handler.addFilter(logs.ContextFilter())
    user = logging.getLogger("user.outside")
    user.addHandler(handler)
    user.setLevel(logging.INFO)
    user.propagate = False
    try:
        user.info("outside any run")
        user.info("mine", extra={"step": "kept"})
    finally:
        user.removeHandler(handler)
        user.propagate = True
    lines = stream.getvalue().splitlines()
    assert lines[0] == " ".join(f"{f}=None" for f in fields) + " outside any run"
    assert "step=kept" in lines[1]


async def test_a_non_determinism_error_is_logged_whole_it_holds_only_names(
    store_url: str, records: list[logging.LogRecord]
) -> None:
    """The engine writes a NonDeterminismError's text from command types, names and a
    step number: an operator reading the worker log sees which step diverged how."""

    def build(first: bool) -> tether.App:
        app = tether.App(store=store_url)

        @app.activity
        def a(text: str) -> str:
            return text

        @app.workflow
        async def flow(text: str) -> str:
            if first:
                await a(text)
            await tether.wait_event("go")
            return text

        return app

    old, new = build(True), build(False)
    async with old.worker(poll_interval=0.05):
        await old.start(old.get_workflow("flow"), CANARY, run_id="nd")
        for _ in range(1000):
            if (await old.get("nd")).waiting_on:
                break
            await asyncio.sleep(0.02)
    await old.signal("nd", "go", CANARY)
    async with new.worker(poll_interval=0.05):
        for _ in range(1000):
            if (await new.get("nd")).task_error:
                break
            await asyncio.sleep(0.02)
    text = _text(records)
    assert CANARY not in text
    assert "at step 1: history recorded ActivityScheduled('a'), but the code now" in text
    for app in (old, new):
        await app.close()


def test_why_a_payload_cannot_be_read_is_logged_whole_it_holds_only_ids(tmp_path: Path) -> None:
    """A KeyUnavailableError's or BlobError's text, as tether.encryption and tether.blobs
    write it, names runs, events, key ids, hashes and paths, never a payload: the engine
    logs it whole (it was ``<N characters redacted>``). The same types carrying other
    text (raised by user code) are still redacted."""
    from tether._codec import decode_text
    from tether._redact import engine_made, redact_error
    from tether.blobs import BlobError, BlobStore
    from tether.encryption import FileKeyring, KeyUnavailableError, Sealer, no_keyring

    keys = FileKeyring.create(tmp_path / "keys.json", per_tenant=True)
    sealer = Sealer(keys)
    sealed = sealer.seal("x", "acme")
    made: list[Exception] = []
    for where in ("", "run 'r1', event 3 (step 2)"):
        made.append(no_keyring(sealed, where))
    keys.shred("acme")
    with pytest.raises(KeyUnavailableError) as destroyed:
        Sealer(FileKeyring(tmp_path / "keys.json")).open(sealed, "run 'r1', event 1")
    assert destroyed.value.destroyed
    made.append(destroyed.value)
    store = BlobStore(str(tmp_path / "blobs"))
    with pytest.raises(BlobError) as missing:
        decode_text(
            type("C", (), {"sealer": None, "blobs": store})(),  # type: ignore[arg-type]
            f"~b1:sha256:{'ab' * 32}:12",
            "dead letter 4 (run 'r1', step 2), input",
        )
    made.append(missing.value)
    for exc in made:
        kind = type(exc).__name__
        assert engine_made(f"{kind}: {exc}"), str(exc)
        assert redact_error(kind, str(exc)) == str(exc)
    for text in (f"blob sha256:{'ab' * 32}: {CANARY}", f"payload sealed with key 'k': {CANARY}"):
        for kind in ("BlobError", "KeyUnavailableError"):
            assert CANARY not in redact_error(kind, text)


async def test_a_users_error_worded_like_the_engines_is_not_shown_whole(
    store_url: str, tmp_path: Path, records: list[logging.LogRecord]
) -> None:
    """Which task errors were "engine-made" (logged whole, shown whole to a key without
    payloads) was decided by regexes on their text, which quote ids as ``'[^']*'``: a
    keyring of the user's whose ``KeyUnavailableError`` used the engine's wording with
    its own text (here a vault URL with its token) had that text logged and shown whole.
    Now only what the engine itself made and marked is trusted, whatever its wording."""
    from tether._redact import engine_made, redact_error
    from tether.encryption import FileKeyring, Keyring, KeyUnavailableError
    from tether.server._models import run_view

    class Vault(Keyring):
        """The user's keyring: refuses keys in the engine's words, naming its source."""

        def __init__(self, inner: FileKeyring, refuse: bool) -> None:
            self.inner, self.refuse = inner, refuse

        def current(self, tenant: str | None) -> str:
            return self.inner.current(tenant)

        def key(self, key_id: str) -> bytes:
            if self.refuse:
                raise KeyUnavailableError(
                    key_id,
                    f"keyring 'vault://ops:{CANARY}@vault' has no such key (is it the right "
                    "keyring?)",
                )
            return self.inner.key(key_id)

    keys = FileKeyring.create(tmp_path / "keys.json")
    starter = tether.App(store=store_url, encryption=Vault(keys, refuse=False))

    @starter.workflow
    async def hello(name: str) -> str:
        return name

    await starter.start(hello, "x", run_id="r1")
    app = tether.App(store=store_url, encryption=Vault(FileKeyring(keys.path), refuse=True))
    app.workflow(hello.fn, name="hello")  # type: ignore[attr-defined]
    async with app.worker(poll_interval=0.02):
        for _ in range(250):
            if "workflow task for run 'r1' failed" in _text(records):
                break
            await asyncio.sleep(0.02)
    text = _text(records)
    assert "workflow task for run 'r1' failed: KeyUnavailableError: <" in text, text
    assert CANARY not in text
    (info,) = await app.list()  # (a listing reads what it can)
    forged = [
        (
            "KeyUnavailableError",
            f"payload sealed with key '{CANARY}': this keyring has no such key",
        ),
        ("BlobError", f"missing from the blob store at '{CANARY}'"),
        (
            "UnknownActivityError",
            f"step 1 (activity '{CANARY}', queue 'q') waits for a worker that registers "
            "'x'; worker w does not",
        ),
    ]
    for kind, text in forged:
        assert not engine_made(f"{kind}: {text}"), text
        assert CANARY not in redact_error(kind, text)
        # a key without payloads sees its type alone
        shown = run_view(dataclasses.replace(info, task_error=f"{kind}: {text}"), payloads=False)
        assert shown.task_error == f"{kind}: [withheld]", shown.task_error
    for a in (starter, app):
        await a.close()  # type: ignore[attr-defined]


def test_an_error_the_engine_made_is_trusted_by_its_mark_not_its_wording() -> None:
    """A reworded engine message stays shown whole (it was trusted by its wording, so
    any rewording hid it); the same class made by user code is not trusted."""
    from tether._redact import engine_made, made_by_engine, redact_error
    from tether.encryption import KeyUnavailableError

    mine = made_by_engine(KeyUnavailableError("k1", "a wording no regex knows"))
    assert engine_made(f"KeyUnavailableError: {mine}")
    assert redact_error("KeyUnavailableError", str(mine)) == str(mine)

    class Sub(KeyUnavailableError):
        pass

    for theirs in (KeyUnavailableError("k2", CANARY), Sub("k1", "a wording no regex knows")):
        kind = type(theirs).__name__
        assert not engine_made(f"{kind}: {theirs}"), theirs
        assert redact_error(kind, str(theirs)).endswith("characters redacted>")


def test_a_divergence_quoting_a_runs_error_is_not_marked_the_engines() -> None:
    """A ``NonDeterminismError`` naming only commands is the engine's (shown whole); one
    whose description quotes a run's error message (a payload) is not."""
    from tether._errors import NonDeterminismError
    from tether._history import EventType
    from tether._redact import is_engine_made
    from tether.workflow._instance import _describe, _names_only

    named = (EventType.ACTIVITY_SCHEDULED, {"name": "a"})
    failed = (EventType.WORKFLOW_FAILED, {"error": {"type": "ValueError", "message": CANARY}})
    for commands, trusted in (((named,), True), ((named, failed), False)):
        expected = _describe(*commands[-1], detail=True)
        exc = _names_only(NonDeterminismError("r1", 1, expected, "no command"), *commands)
        assert is_engine_made(exc) is trusted, (commands, str(exc))


class _Vault(tether.encryption.Keyring):
    """A user's keyring: its keys by id, and an error naming its source (with a token)
    for any other."""

    def __init__(self, keys: dict[str, bytes], current: str) -> None:
        self.keys, self.cur = keys, current

    def current(self, tenant: str | None) -> str:
        return self.cur

    def key(self, key_id: str) -> bytes:
        if key_id in self.keys:
            return self.keys[key_id]
        raise tether.encryption.KeyUnavailableError(
            key_id, f"vault https://ops:{CANARY}@vault.example/k said 403"
        )


def _vault_apps(url: str) -> tuple[tether.App, tether.App, tether.Workflow]:
    """A writer sealing under key ``k2`` and a reader whose vault lacks it."""
    k1, k2 = bytes(range(32)), bytes(32)
    apps = []
    wf: tether.Workflow | None = None
    for vault in (_Vault({"k1": k1, "k2": k2}, "k2"), _Vault({"k1": k1}, "k1")):
        app = tether.App(store=url, encryption=vault)

        @app.activity(queue="acts")
        def act(x: str) -> str:
            return x

        @app.workflow
        async def wf_(x: str) -> str:
            return await act(x)

        apps.append(app)
        wf = wf or wf_
    assert wf is not None
    return apps[0], apps[1], wf


async def test_a_step_whose_arguments_a_users_keyring_cannot_open_is_logged_redacted(
    tmp_path: Path, records: list[logging.LogRecord]
) -> None:
    """An activity whose arguments are sealed under a key the worker's own keyring
    refuses waits for a worker that can read them; the log line saying so held the
    keyring's error whole, and with it what the user's keyring put in its text (here a
    vault URL with its token). It is now redacted unless the engine made it."""
    writer, reader, wf = _vault_apps(f"sqlite:///{tmp_path / 's.db'}")
    await writer.start(wf, "payload", run_id="r1")
    async with (
        writer.worker(poll_interval=0.02, queues=["default"]),
        reader.worker(poll_interval=0.02, queues=["acts"]),
    ):
        for _ in range(250):
            if "activity 'act' of run 'r1' waits" in _text(records):
                break
            await asyncio.sleep(0.02)
    text = _text(records)
    assert "activity 'act' of run 'r1' waits (try 1" in text, text
    assert CANARY not in text
    for a in (writer, reader):
        await a.close()


async def test_why_a_runs_payload_is_unavailable_shows_no_users_keyring_text(
    tmp_path: Path,
) -> None:
    """A run read leniently names each payload it cannot read and why
    (``RunInfo.unavailable``), shown by the API to every key, payloads or not: a keyring
    of the user's refusing a key had its error text (a vault URL with its token) shown
    there whole. It now shows the error's type and what the redaction hook allows; the
    engine's own messages stay whole."""
    from tether.encryption import FileKeyring
    from tether.server._models import run_view

    writer, reader, wf = _vault_apps(f"sqlite:///{tmp_path / 's.db'}")
    await writer.start(wf, "payload", run_id="r1")
    info = await reader.store.get_run("r1", lenient=True)
    for view in (run_view(info, payloads=False), run_view(info, payloads=True)):
        assert view.unavailable and "input" in view.unavailable, view.unavailable
        assert CANARY not in json.dumps(view.unavailable), view.unavailable
        assert view.unavailable["input"].startswith("KeyUnavailableError: <"), view.unavailable
    # the engine's own reason (a key its file keyring lacks) is shown whole
    keys = FileKeyring.create(tmp_path / "keys.json")
    sealed = tether.App(store=f"sqlite:///{tmp_path / 't.db'}", encryption=keys)
    sealed.workflow(wf.fn, name="wf_")  # type: ignore[attr-defined]
    await sealed.start("wf_", "payload", run_id="r2")
    other = tether.App(
        store=f"sqlite:///{tmp_path / 't.db'}",
        encryption=FileKeyring.create(tmp_path / "other.json"),
    )
    shown = (await other.store.get_run("r2", lenient=True)).unavailable or {}
    assert repr(keys.current(None)) in shown.get("input", ""), shown
    for a in (writer, reader, sealed, other):
        await a.close()


async def test_a_step_called_with_other_arguments_is_a_divergence_logged_whole(
    store_url: str, records: list[logging.LogRecord]
) -> None:
    """A step replayed with other arguments is a ``NonDeterminismError`` the engine words
    from names alone (values not shown), but it carried no engine mark: the worker log
    and a key without payloads saw ``<... redacted>``. It is now marked, shown whole."""
    from tether._redact import engine_made

    def build(suffix: str) -> tether.App:
        app = tether.App(store=store_url)

        @app.activity
        def a(text: str) -> str:
            return text

        @app.workflow
        async def flow(text: str) -> str:
            await a(text + suffix)
            await tether.wait_event("go")
            return text

        return app

    old, new = build(""), build("!")
    async with old.worker(poll_interval=0.05):
        await old.start(old.get_workflow("flow"), CANARY, run_id="nd")
        for _ in range(1000):
            if (await old.get("nd")).waiting_on:
                break
            await asyncio.sleep(0.02)
    await old.signal("nd", "go", CANARY)
    async with new.worker(poll_interval=0.05):
        for _ in range(1000):
            if (await new.get("nd")).task_error:
                break
            await asyncio.sleep(0.02)
    text = _text(records)
    assert CANARY not in text
    assert "called with other arguments" in text, text
    error = (await new.get("nd")).task_error
    assert error is not None and engine_made(error), error
    for app in (old, new):
        await app.close()


async def test_a_run_needing_intervention_logs_an_engine_error_whole(
    app: tether.App, records: list[logging.LogRecord]
) -> None:
    """With no on_alert hook, "run ... needs intervention" is logged with the run's error:
    whole when the engine made it (names and ids only; it was ``<N characters
    redacted>``), redacted when it is the user's (here quoting a canary)."""
    from tether._redact import made_by_engine
    from tether.encryption import KeyUnavailableError

    mine = made_by_engine(KeyUnavailableError("k1", "no such key in run 'r1', event 3"))
    theirs = KeyUnavailableError("k1", f"vault said {CANARY}")
    for run_id, exc in (("r-engine", mine), ("r-user", theirs)):
        await app._alert(run_id, {"type": type(exc).__name__, "message": str(exc)})
    lines = [r.getMessage() for r in records if "needs intervention" in r.getMessage()]
    assert len(lines) == 2, lines
    assert lines[0] == f"run 'r-engine' needs intervention: KeyUnavailableError: {mine}"
    assert CANARY not in _text(records)
    assert lines[1].startswith("run 'r-user' needs intervention: KeyUnavailableError: <")
