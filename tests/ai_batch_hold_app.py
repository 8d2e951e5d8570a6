"""A worker process for the batch daily-hold crash tests:
``python tests/ai_batch_hold_app.py STORE_URL BASE_URL [held]`` (``test_ai_batch_daily``).
With ``held`` the process SIGKILLs itself as soon as the store call that holds a batch's
estimate in the day's spend returns (committed), before the submit does anything else."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from typing import Any

import tether
from tether import ai


def build(url: str, base_url: str) -> tuple[tether.App, ai.Gateway, Any]:
    """The App, its gateway and the ``nightly`` batch workflow (the test builds the same)."""
    app = tether.App(store=url)
    gw = ai.Gateway(app, retry=tether.Retry(attempts=3, initial=0.05), timeout=10)
    m = gw.model("m", ai.openai_compatible("gpt-4o-mini", base_url=base_url, api_key="k"))

    @app.workflow
    async def nightly(keys: list[str]) -> Any:
        try:
            res = await ai.batch(
                m, {k: f"q{k}" for k in keys}, poll=0.1, max_poll=0.2, max_tokens=100
            )
        except ai.BudgetExceeded as exc:
            return {"refused": f"{exc.scope} {exc.what}"}
        return sorted(res.results)

    return app, gw, nightly


def _die_when_held(app: tether.App) -> None:
    """SIGKILL this process right after the store commits the hold of a batch's estimate
    (``hold_model_spend``; ``reserve_model_spend`` before holds were kept by step)."""
    cls = type(app.store)
    for name in ("hold_model_spend", "reserve_model_spend"):
        real = getattr(cls, name, None)
        if real is None:
            continue

        async def held(self: Any, *args: Any, _real: Any = real, **kw: Any) -> Any:
            out = await _real(self, *args, **kw)
            os.kill(os.getpid(), signal.SIGKILL)
            return out

        setattr(cls, name, held)


async def _serve(url: str, base_url: str, kill: str | None) -> None:
    app, _gw, _nightly = build(url, base_url)
    if kill == "held":
        _die_when_held(app)
    async with app.worker(poll_interval=0.05, lease=1.0):
        await asyncio.sleep(600)


if __name__ == "__main__":
    asyncio.run(_serve(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None))
