from __future__ import annotations

import tether


async def test_sequential_and_parallel_steps_complete(
    app: tether.App, worker: tether.Worker
) -> None:
    calls: list[int] = []

    @app.activity
    def add(a: int, b: int) -> int:
        calls.append(a)
        return a + b

    @app.workflow
    async def wf(n: int) -> int:
        x = 0
        for i in range(n):
            x = await add(x, i)
        y, z = await tether.gather(add(x, 1), add(x, 2))
        return y + z

    run = await app.start(wf, 5)
    assert await run.result(timeout=10) == 23
    assert len(calls) == 7
