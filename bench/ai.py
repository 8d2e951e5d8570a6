"""The cost of recording a model call: tether.ai step vs a bare pydantic-ai call, on SQLite.

``python bench/ai.py [--calls N]`` starts the scripted OpenAI-compatible server
(``tether.testing.ModelServer``, answering at once) and, in one process and one run:

* ``bare``: ``pydantic_ai.direct.model_request`` in a loop, N calls;
* ``complete``: one workflow making N sequential ``tether.ai.complete`` steps;
* ``structured``: the same with ``tether.ai.structured`` (output tool + validation);
* a 100-turn conversation in one run, with message references (the default: each
  step records only its new messages) and with full message lists, for the history
  bytes per step (flat vs growing).

The server runs in a child process (in this one it would compete for the GIL).
The per-call time of the bare loop is each call's duration; of a recorded run, the
gap between consecutive ``ActivityCompleted`` events of its history (the step
before ends, the next is scheduled, run and recorded). The overhead is the p50
minus the bare p50. It also prints stored bytes per call
(history rows of the run), commits per call, and the raw commit rate of the same
disk (LIMIT, as in ``bench/run.py``) to put the overhead in commits.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import sqlite3
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import itertools

from pydantic import BaseModel
from pydantic_ai.direct import model_request
from pydantic_ai.messages import ModelRequest, UserPromptPart
from run import FULL, _percentile, bench_limit, check

import tether
from tether import ai
from tether.testing import ModelServer, model_reply


class Label(BaseModel):
    label: str
    score: float


def _serve(conn: Any) -> None:
    """The child process: a scripted server answering every request at once."""
    with ModelServer() as server:
        server.default = _answer
        conn.send(server.base_url)
        conn.recv()  # until the parent is done


async def bare(base_url: str, calls: int) -> list[float]:
    model = ai.openai_compatible("bare", base_url=base_url, api_key="k")
    msgs = [ModelRequest(parts=[UserPromptPart("classify: hello")])]
    out = []
    for _ in range(calls + 1):
        t0 = time.perf_counter()
        await model_request(model, msgs)
        out.append((time.perf_counter() - t0) * 1000)
    return out[1:]


async def recorded(workdir: Path, base_url: str, calls: int, mode: str) -> dict[str, Any]:
    db = workdir / f"{mode}.db"
    app = tether.App(store=f"sqlite:///{db}")
    gateway = ai.Gateway(app)
    model = gateway.model(mode, ai.openai_compatible(mode, base_url=base_url, api_key="k"))

    @app.workflow
    async def many(n: int) -> int:
        done = 0
        for i in range(n):
            if mode == "structured":
                out = await ai.structured(model, f"classify: hello {i}", output=Label)
                done += out.label == "greeting"
            else:
                done += (await ai.complete(model, f"classify: hello {i}")) == "greeting"
        return done

    try:
        async with app.worker(poll_interval=0.05):
            c0 = app.store.stats()["commits"]
            run = await app.start(many, calls + 1, run_id="bench")
            check(await run.result(timeout=600) == calls + 1, "wrong result")
            commits = app.store.stats()["commits"] - c0
            done = [
                e.created_at
                for e in await app.history("bench")
                if e.type is tether.EventType.ACTIVITY_COMPLETED
            ]
    finally:
        await app.close()
    conn = sqlite3.connect(db)
    try:
        (stored,) = conn.execute(
            "SELECT sum(length(data)) FROM events WHERE run_id = 'bench'"
        ).fetchone()
    finally:
        conn.close()
    return {
        "gaps": [(b - a) * 1000 for a, b in itertools.pairwise(done)],
        "bytes_per_call": stored / (calls + 1),
        "commits_per_call": commits / (calls + 1),
    }


async def conversation(workdir: Path, base_url: str, calls: int, refs: bool) -> dict[str, Any]:
    """One run holding a conversation of ``calls`` turns: history bytes per model step."""
    from pydantic_ai.messages import ModelMessage

    db = workdir / f"chat-{refs}.db"
    app = tether.App(store=f"sqlite:///{db}")
    gateway = ai.Gateway(app, message_refs=refs)
    model = gateway.model("chat", ai.openai_compatible("chat", base_url=base_url, api_key="k"))

    @app.workflow
    async def chat(n: int) -> int:
        messages: list[ModelMessage] = []
        for i in range(n):
            messages.append(ModelRequest(parts=[UserPromptPart(f"turn {i}: what next? " * 4)]))
            response, _call = await gateway.request(model, messages)
            messages.append(response)
        return len(messages)

    try:
        async with app.worker(poll_interval=0.05):
            run = await app.start(chat, calls, run_id="chat")
            check(await run.result(timeout=600) == 2 * calls, "wrong result")
    finally:
        await app.close()
    conn = sqlite3.connect(db)
    try:
        per_call = [
            n
            for (n,) in conn.execute(
                "SELECT length(data) FROM events WHERE run_id = 'chat' "
                "AND type IN ('ActivityScheduled', 'ActivityCompleted') ORDER BY seq"
            )
        ]
    finally:
        conn.close()
    steps = [a + b for a, b in zip(per_call[::2], per_call[1::2], strict=True)]
    return {
        "first10": sum(steps[:10]) / 10,
        "last10": sum(steps[-10:]) / 10,
        "total": sum(steps),
    }


def _answer(body: dict[str, Any]) -> Any:
    if body.get("tools"):
        return model_reply(tool=("final_result", {"label": "greeting", "score": 0.9}))
    return model_reply("greeting")


async def measure(workdir: Path, calls: int) -> dict[str, Any]:
    parent, child = multiprocessing.Pipe()
    proc = multiprocessing.Process(target=_serve, args=(child,), daemon=True)
    proc.start()
    try:
        base_url = parent.recv()
        out: dict[str, Any] = {"bare": {"gaps": await bare(base_url, calls)}}
        for mode in ("complete", "structured"):
            out[mode] = await recorded(workdir, base_url, calls, mode)
        out["conversation"] = {
            "by reference": await conversation(workdir, base_url, 100, True),
            "full lists": await conversation(workdir, base_url, 100, False),
        }
    finally:
        parent.send("stop")
        proc.join(10)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tether-ai-bench-") as tmp:
        workdir = Path(tmp)
        limit = bench_limit(workdir, FULL)
        t0 = time.perf_counter()
        res = asyncio.run(measure(workdir, args.calls))
        elapsed = time.perf_counter() - t0
    per_commit = 1000 / limit["commits_per_s"]
    base = _percentile(res["bare"]["gaps"], 50)
    print(f"LIMIT: {limit['commits_per_s']:,.0f} commits/s ({per_commit:.3f} ms/commit)")
    print(
        f"{'per call':<11} {'p50 ms':>7} {'p99 ms':>7} {'+p50 ms':>8} {'+/commit':>8} "
        f"{'commits':>8} {'bytes':>7}"
    )
    summary: dict[str, Any] = {"limit": limit, "calls": args.calls, "seconds": elapsed}
    chats = res.pop("conversation")
    for mode, r in res.items():
        p50, p99 = _percentile(r["gaps"], 50), _percentile(r["gaps"], 99)
        extra = p50 - base
        print(
            f"{mode:<11} {p50:7.2f} {p99:7.2f} {extra:8.2f} {extra / per_commit:8.2f} "
            f"{r.get('commits_per_call', 0):8.2f} {r.get('bytes_per_call', 0):7.0f}"
        )
        summary[mode] = {
            "p50_ms": p50,
            "p99_ms": p99,
            "overhead_p50_ms": extra,
            "commits_per_call": r.get("commits_per_call"),
            "bytes_per_call": r.get("bytes_per_call"),
        }
    print("history bytes per model step, one 100-turn conversation:")
    for how, c in chats.items():
        growth = c["last10"] / c["first10"]
        print(
            f"  {how:<13} first 10: {c['first10']:8.0f}  last 10: {c['last10']:8.0f}  "
            f"(x{growth:.2f})  total: {c['total'] / 1024:8.0f} KiB"
        )
    summary["conversation"] = chats
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
