"""Provider batch jobs (``tether.ai.batch``) against the fake batch API of
``ModelServer``: the batch id is recorded, a worker killed between submit and completion
does not submit again, failed and missing items are resubmitted alone, unknown ids are
reported, usage is billed to the run (and to the tenant's day and the counters, once),
and a deadline fails the job."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

import tether
from helpers import eventually
from tether import EventType, ai
from tether._telemetry import RECORDER
from tether.testing import ModelServer, model_reply

HERE = Path(__file__).parent


@pytest.fixture
def models() -> Iterator[ModelServer]:
    with ModelServer() as s:
        # each request is answered from its own prompt
        s.default = lambda body: model_reply(f"answer to {body['messages'][-1]['content']}")
        yield s


def _batch_app(app: tether.App, models: ModelServer, **batch_kw: Any) -> Any:
    gw = ai.Gateway(app, retry=tether.Retry(attempts=3, initial=0.05), timeout=10)
    m = gw.model(
        "m", ai.openai_compatible("gpt-4o-mini", base_url=models.base_url, api_key="sk-test")
    )

    @app.workflow
    async def nightly(keys: list[str]) -> dict[str, Any]:
        res = await ai.batch(m, {k: f"q {k}" for k in keys}, **batch_kw)
        return dataclasses.asdict(res)

    return nightly


async def test_a_batch_survives_a_worker_killed_mid_job_and_resubmits_only_failures(
    app: tether.App, models: ModelServer
) -> None:
    nightly = _batch_app(app, models, poll=0.2, max_poll=0.4, deadline=120)
    fake = models.batches
    fake.complete_after = 1.5
    fake.fail_once = {"c"}
    fake.drop_once = {"d"}
    fake.unknown = ["zzz"]
    RECORDER.reset()
    first = app.worker(poll_interval=0.05, lease=1.0)
    await first.start()
    run = await app.start(nightly, list("abcde"), run_id="nightly-1")

    async def submitted() -> bool:
        history = await app.history(run.run_id)
        return any(
            e.type is EventType.ACTIVITY_COMPLETED and "batch_id" in (e.data.get("result") or {})
            for e in history
        )

    await eventually(submitted, 20, "the batch submitted and recorded")
    await first.kill()  # like SIGKILL: between submit and completion
    assert fake.created == 1
    second = app.worker(poll_interval=0.05, lease=1.0)
    await second.start()
    try:
        out = await run.result(timeout=60)
    finally:
        await second.stop()
    assert out["results"] == {k: f"answer to q {k}" for k in "abcde"}
    assert out["failed"] == {} and out["unknown"] == ["zzz"]
    assert out["batches"] == ["batch_1", "batch_2"]
    assert fake.created == 2  # the restart polled batch_1; only c and d went again
    resubmitted = fake.files[fake.batches["batch_2"]["input_file_id"]].decode().splitlines()
    assert sorted(json.loads(x)["custom_id"] for x in resubmitted) == ["c", "d"]
    usage = await app.usage(run.run_id)
    assert usage.tokens == 15 * 5  # five answers of 10 + 5 tokens, billed to the run
    # and to the day's ledger and the counters, once (the killed worker fetched nothing)
    day = time.strftime("%Y-%m-%d", time.gmtime())
    assert [(t, n, Decimal(c)) for t, n, c in await app.store.usage_on(day)] == [
        ("", 75, usage.cost)
    ]
    labels = ("nightly", "m", "")
    assert RECORDER.counter("tether_ai_calls", (*labels, "batch")) == 5
    assert RECORDER.counter("tether_ai_tokens", (*labels, "input")) == 50
    assert RECORDER.counter("tether_ai_tokens", (*labels, "output")) == 25
    history = await app.history(run.run_id)
    timers = [e for e in history if e.type is EventType.TIMER_STARTED]
    assert timers  # polled on durable timers


async def test_a_submit_whose_answer_was_lost_finds_its_batch_again(
    app: tether.App, models: ModelServer
) -> None:
    """The provider created the batch but the worker died before recording it: the
    retried submit finds the batch by the step's key in its metadata."""
    nightly = _batch_app(app, models, poll=0.2, max_poll=0.2, deadline=60)
    models.batches.complete_after = 0.2
    lost = {"n": 0}
    real_create = models.batches.create

    def create_then_fail(body: dict[str, Any]) -> dict[str, Any]:
        made = real_create(body)
        if lost["n"] == 0:
            lost["n"] += 1
            raise ConnectionResetError("the answer is lost on the way back")
        return made

    models.batches.create = create_then_fail  # type: ignore[method-assign]
    async with app.worker(poll_interval=0.05):
        out = await (await app.start(nightly, ["a", "b"])).result(timeout=30)
    assert out["results"] == {"a": "answer to q a", "b": "answer to q b"}
    assert models.batches.created == 1 and out["batches"] == ["batch_1"]


async def test_a_batch_past_its_deadline_fails_the_step(
    app: tether.App, models: ModelServer
) -> None:
    nightly = _batch_app(app, models, poll=0.2, max_poll=0.2, deadline=1.0)
    models.batches.complete_after = 3600
    async with app.worker(poll_interval=0.05):
        run = await app.start(nightly, ["a"])
        with pytest.raises(tether.WorkflowFailedError, match="still in_progress at its deadline"):
            await run.result(timeout=30)


async def test_two_stores_sharing_a_provider_account_never_take_each_others_batch(
    tmp_path: Any, models: ModelServer
) -> None:
    """Two deployments (two stores) with one provider account run a batch under the same
    run id: each submits its own batch and gets the answers to its own prompts (the key in
    the batch's metadata holds a value recorded in the run, not only ``run-id:step``)."""
    models.batches.complete_after = 0.2

    async def deployment(label: str) -> dict[str, Any]:
        app = tether.App(store=f"sqlite:///{tmp_path}/{label}.db")
        gw = ai.Gateway(app, retry=tether.Retry(attempts=3, initial=0.05), timeout=10)
        m = gw.model(
            "m", ai.openai_compatible("gpt-4o-mini", base_url=models.base_url, api_key="sk-org")
        )

        @app.workflow
        async def nightly(docs: dict[str, str]) -> dict[str, Any]:
            return dataclasses.asdict(await ai.batch(m, docs, poll=0.2, max_poll=0.2))

        docs = {"doc1": f"{label} prompt 1", "doc2": f"{label} prompt 2"}
        async with app.worker(poll_interval=0.05):
            run = await app.start(nightly, docs, run_id="nightly:2026-12-06")
            out: dict[str, Any] = await run.result(timeout=30)
        await app.close()
        return out

    outs = [await deployment("staging"), await deployment("prod")]
    for label, out in zip(("staging", "prod"), outs, strict=True):
        assert out["results"] == {f"doc{i}": f"answer to {label} prompt {i}" for i in (1, 2)}
    assert models.batches.created == 2


@pytest.mark.parametrize("recorded_key", ["new", "old"])
async def test_a_lost_submit_finds_its_batch_again_past_many_newer_batches(
    app: tether.App, models: ModelServer, monkeypatch: pytest.MonkeyPatch, recorded_key: str
) -> None:
    """The provider lists batches a page at a time (newest first): a retried submit whose
    batch is behind 150 newer ones (other runs of the account) reads on to find it rather
    than submitting (and paying for) a second one; a run recorded before the key held a
    recorded value (``old``) finds its batch by the old key."""
    if recorded_key == "old":
        from tether.ai import _batch
        from tether.workflow._instance import WorkflowInstance

        real = WorkflowInstance.patched

        def older(self: WorkflowInstance, patch_id: str, *, deprecated: bool = False) -> bool:
            if patch_id == _batch.BATCH_NONCE:
                return False
            return real(self, patch_id, deprecated=deprecated)

        monkeypatch.setattr(WorkflowInstance, "patched", older)
    nightly = _batch_app(app, models, poll=0.2, max_poll=0.2, deadline=60)
    fake = models.batches
    fake.complete_after = 0.2
    real_create = fake.create
    lost = {"n": 0}

    def create_then_fail(body: dict[str, Any]) -> dict[str, Any]:
        made = real_create(body)
        if lost["n"] == 0:
            lost["n"] += 1
            for i in range(150):  # others of the account meanwhile
                real_create({"input_file_id": body["input_file_id"], "metadata": {"i": str(i)}})
            raise ConnectionResetError("the answer is lost on the way back")
        return made

    fake.create = create_then_fail  # type: ignore[method-assign]
    async with app.worker(poll_interval=0.05):
        out = await (await app.start(nightly, ["a", "b"])).result(timeout=30)
    assert out["results"] == {"a": "answer to q a", "b": "answer to q b"}
    assert fake.created == 151 and out["batches"] == ["batch_1"]


def test_the_fake_batch_list_pages_like_openais(models: ModelServer) -> None:
    for i in range(5):
        models.batches.create({"input_file_id": "f", "metadata": {"i": str(i)}})
    page = models.batches.listing(limit=2)
    assert [b["id"] for b in page["data"]] == ["batch_5", "batch_4"] and page["has_more"]
    page = models.batches.listing(limit=2, after="batch_2")
    assert [b["id"] for b in page["data"]] == ["batch_1"] and not page["has_more"]


async def test_a_batch_killed_between_fetch_and_record_counts_its_tokens_once_a_day(
    tmp_path: Path, models: ModelServer
) -> None:
    """SIGKILL after a batch's results were downloaded but before they were recorded: the
    retried fetch downloads them again, and the tenant's daily spend counts them once
    (with the commit that records them, not inside the fetch)."""
    db, marker = tmp_path / "tether.db", tmp_path / "killed"
    sys.path.insert(0, str(HERE))
    try:
        import ai_crash_app
    finally:
        sys.path.remove(str(HERE))
    models.batches.complete_after = 0.2
    client = tether.App(store=f"sqlite:///{db}")
    client._workflows["nightly_batch"] = ai_crash_app.nightly_batch
    gw = ai.Gateway(client)
    await gw.set_budget(tenant="acme", tokens=1_000_000)
    run = await client.start(ai_crash_app.nightly_batch, ["a", "b", "c"], tenant="acme")
    env = {
        **os.environ,
        "PYTHONPATH": f"{HERE.parent / 'src'}{os.pathsep}{HERE}",
        "TETHER_TEST_KILL_AFTER_FETCH": str(marker),
    }

    def spawn() -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, str(HERE / "ai_crash_app.py"), str(db), models.base_url],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=open(tmp_path / "err", "ab"),
        )

    first = spawn()
    try:
        first.wait(60)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == -signal.SIGKILL and marker.exists()
    second = spawn()
    try:
        assert await run.result(timeout=60) == {k: f"answer to q {k}" for k in "abc"}
    finally:
        second.terminate()
        second.wait(10)
    history = await client.history(run.run_id)
    (call,) = [
        e.data["result"]["tether.ai.call"]
        for e in history
        if e.type is EventType.ACTIVITY_COMPLETED
        and "tether.ai.call" in (e.data.get("result") or {})
    ]
    used = call["input_tokens"] + call["output_tokens"]
    assert used > 0
    (acme,) = [b for b in await gw.budgets() if b["scope"] == "tenant:acme"]
    assert acme["spent_tokens"] == used  # once, not twice
    await client.close()
