"""Workflows for the migration tests; ``app`` and ``changed`` are for ``--app`` (code only)."""

from __future__ import annotations

import tether


def build(store: str, *, changed: bool = False) -> tether.App:
    app = tether.App(store=store)

    @app.activity
    def double(x: int) -> int:
        return 2 * x

    @app.activity(retry=tether.Retry(attempts=1))
    def refuse(x: int) -> int:
        raise tether.NonRetryable(f"refused {x}")

    @app.workflow
    async def quick(x: int) -> int:
        return await double(x)

    @app.workflow
    async def failing(x: int) -> int:
        return await refuse(x)

    @app.workflow
    async def approval(x: int) -> str:
        y = await double(x)
        if changed:
            y = await double(y)  # a deploy that changed the code under in-flight runs
        who = await tether.wait_event("approve")
        return f"{y} approved by {who}"

    @app.workflow
    async def napper(x: int) -> int:
        y = await double(x)
        await tether.sleep(2.0)
        return y + 1

    return app


app = build(":memory:")
changed = build(":memory:", changed=True)
