"""Run counters kept by triggers (``store/_counters.py``): what the overview and
``/metrics`` read agrees with counting the runs table, through starts, ends,
failures, retries, purges and tenant erasure, with folds racing the writers."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

import tether

pytestmark = pytest.mark.timeout(120)


async def _truth(app: tether.App, tenant: str | None = None) -> list[tuple[str, str, int]]:
    """Counted the slow way, from the runs table."""
    where, args = ("WHERE tenant = ?", (tenant,)) if tenant is not None else ("", ())

    def count(tx: Any) -> list[tuple[str, str, int]]:
        rows = tx.execute(
            f"SELECT workflow, status, COUNT(*) FROM runs {where} GROUP BY workflow, status "
            "ORDER BY workflow, status",
            args,
        ).fetchall()
        return [(r[0], r[1], int(r[2])) for r in rows]

    out: list[tuple[str, str, int]] = await app.store._do(count, write=False)  # type: ignore[attr-defined]
    return out


async def _ended_truth(app: tether.App, since: float) -> list[tuple[int, str, int]]:
    def count(tx: Any) -> list[tuple[int, str, int]]:
        rows = tx.execute(
            "SELECT completed_at, status FROM runs WHERE completed_at >= ?", (since,)
        ).fetchall()
        out: dict[tuple[int, str], int] = {}
        for at, status in rows:
            key = (int((at - since) // 3600), status)
            out[key] = out.get(key, 0) + 1
        return [(b, s, n) for (b, s), n in sorted(out.items())]

    got: list[tuple[int, str, int]] = await app.store._do(count, write=False)  # type: ignore[attr-defined]
    return got


async def _settled(run: tether.Run[Any]) -> None:
    try:
        await run.result(timeout=30)
    except tether.WorkflowFailedError:
        pass


async def _agrees(app: tether.App) -> None:
    assert await app.store.run_counts() == await _truth(app)
    for tenant in ("acme", "globex"):
        assert await app.store.run_counts(tenant) == await _truth(app, tenant)
    since = (int(time.time() // 3600) - 23) * 3600.0  # whole hours: the counters
    assert await app.store.run_outcomes(since, 3600) == await _ended_truth(app, since)


async def test_counters_agree_with_the_runs_table_through_a_runs_whole_life(
    app: tether.App,
) -> None:
    fails = {"n": 0}

    @app.activity(retry=tether.Retry(attempts=1))
    def work(i: int) -> int:
        if i % 5 == 0 and fails["n"] < 1000:
            raise RuntimeError("bad input")
        return i

    @app.workflow
    async def job(i: int) -> int:
        return await work(i)

    @app.workflow
    async def waits() -> str:
        return str(await tether.wait_event("go"))

    async with app.worker(poll_interval=0.02):

        async def folds() -> None:  # folds racing the writers
            for _ in range(30):
                await app.store.fold_run_counts()
                await asyncio.sleep(0.01)

        runs = [await app.start(job, i, tenant=("acme", "globex", None)[i % 3]) for i in range(30)]
        await asyncio.gather(folds(), *(_settled(r) for r in runs))
        await app.start(waits, run_id="waiting", tenant="acme")
        await asyncio.sleep(0.2)
        await _agrees(app)
        counts = dict(((wf, st), n) for wf, st, n in await app.store.run_counts())
        assert counts[("job", "completed")] == 24 and counts[("job", "failed")] == 6
        assert counts[("waits", "running")] == 1
        # a retried run leaves "failed" and ends again
        fails["n"] = 1000
        statuses = [(await app.get(r.run_id)).status for r in runs]
        failed = runs[statuses.index(tether.RunStatus.FAILED)]
        await app.retry(failed.run_id)
        await _settled(app.get_run(failed.run_id))
        await app.signal("waiting", "go", 1)
        await _settled(app.get_run("waiting"))
        await _agrees(app)
    # purged and erased runs leave the counts, and an erased tenant leaves no row
    await app.purge(0, workflow="job", tenant="globex")
    await _agrees(app)
    await app.erase_tenant("acme")
    await _agrees(app)

    def rows_of(tx: Any) -> int:
        return sum(
            int(tx.execute(f"SELECT COUNT(*) FROM {t} WHERE tenant = 'acme'").fetchone()[0])
            for t in ("run_counts", "run_ends", "run_count_deltas")
        )

    assert await app.store._do(rows_of, write=False) == 0  # type: ignore[attr-defined]
    assert [wf for wf, _st, _n in await app.store.run_counts("acme")] == []
