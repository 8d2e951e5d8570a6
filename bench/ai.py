"""The cost of recording a model call: tether.ai step vs a bare pydantic-ai call, on SQLite.

``python bench/ai.py [--calls N]`` starts the scripted OpenAI-compatible server
(``tether.testing.ModelServer``, answering at once) and, in one process and one run:

* ``bare``: ``pydantic_ai.direct.model_request`` in a loop, N calls;
* ``bare-structured``: the same with the output tool a structured step sends, its
  arguments validated into the output type (the baseline of ``structured``);
* ``bare-paced``: the ``bare`` loop with the client busy ``PACE_MS`` between calls
  (not timed): the server idles between requests as it does in a recorded run, so its
  ``+p50`` over ``bare`` is what an idle server adds to a call, whoever makes it;
* ``bare-durable``: the ``bare`` loop writing each answer (its JSON, as pydantic-ai
  dumps it) to a SQLite file in its own committed transaction (WAL, ``synchronous=FULL``,
  as tether's store) on the calling thread, inside the timed call: the floor of any
  durable record of a model call on this disk, without an engine around it;
* ``complete``: one workflow making N sequential ``tether.ai.complete`` steps;
* ``structured``: the same with ``tether.ai.structured`` (output tool + validation);
* a 100-turn conversation in one run, with message references (the default: each
  step records only its new messages) and with full message lists, for the history
  bytes per step (flat vs growing) and the time of a step early and late in it;
* ``phases``: one more ``complete`` run with timers around the stages of a step
  (the model call as the worker makes it, the gateway around it, the workflow's
  advance, the store operation, its commit and the two thread hand-offs), so the
  overhead is read off stage by stage instead of guessed.

The server runs in a child process (in this one it would compete for the GIL).
The per-call time of the bare loop is each call's duration; of a recorded run, the
gap between consecutive ``ActivityCompleted`` events of its history (the step
before ends, the next is scheduled, run and recorded). The overhead is the p50
minus the p50 of the bare loop doing the same work. ``own p50`` is the p50 of each
step's gap minus that step's model call as the worker made it (timed around
``model_request``): tether's own time a step, whatever the call cost; ``call p50`` is that
call's p50. A bare loop calls the server back to back, while a recorded run leaves it idle
for tether's part of each step, so a call in the worker can take longer than a bare one
(the local server's process wakes from idle): ``+p50`` holds that, ``own p50`` does not.
It also prints stored bytes per call
(history rows of the run), commits per call, and the raw commit rate of the same
disk (LIMIT, as in ``bench/run.py``) to put the overhead in commits.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import itertools

from pydantic import BaseModel
from pydantic_ai.direct import model_request
from pydantic_ai.messages import (
    ModelMessagesTypeAdapter,
    ModelRequest,
    ToolCallPart,
    UserPromptPart,
)
from pydantic_ai.models import ModelRequestParameters
from pydantic_ai.tools import ToolDefinition
from run import FULL, _percentile, bench_limit, check

import tether
from tether import ai
from tether.testing import ModelServer, model_reply

#: the provider's model name every mode asks for: one genai-prices knows, so a recorded
#: step prices its answer as a user's would (the scripted server answers any name)
MODEL = "gpt-4o-mini"


#: how long ``bare-paced`` keeps the client busy between calls: about a recorded
#: step's own time (``own p50``), so its server idles as a recorded run's does
PACE_MS = 1.0


class Label(BaseModel):
    label: str
    score: float


def _serve(conn: Any) -> None:
    """The child process: a scripted server answering every request at once."""
    with ModelServer() as server:
        server.default = _answer
        conn.send(server.base_url)
        conn.recv()  # until the parent is done


async def bare(
    base_url: str,
    calls: int,
    structured: bool = False,
    pace_ms: float = 0.0,
    durable: Path | None = None,
) -> list[float]:
    """Bare pydantic-ai calls; ``structured``: with the output tool a structured step
    sends, its arguments validated into ``Label`` (what ``structured`` is compared to);
    ``pace_ms``: this process stays busy that long between calls (timed apart), leaving
    the server idle as a recorded step's own work does; ``durable``: each answer is
    committed to this SQLite file before the call counts as done."""
    model = ai.openai_compatible(MODEL, base_url=base_url, api_key="k")
    db = None
    if durable is not None:
        db = sqlite3.connect(durable, isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        db.execute("CREATE TABLE IF NOT EXISTS answers (id INTEGER PRIMARY KEY, data BLOB)")
    msgs = [ModelRequest(parts=[UserPromptPart("classify: hello")])]
    params = ModelRequestParameters(
        output_mode="tool",
        output_tools=[
            ToolDefinition(name="final_result", parameters_json_schema=Label.model_json_schema())
        ],
        allow_text_output=False,
    )
    out = []
    for _ in range(calls + 1):
        t0 = time.perf_counter()
        if structured:
            response = await model_request(model, msgs, model_request_parameters=params)
            call = response.parts[0]
            assert isinstance(call, ToolCallPart)
            Label.model_validate(call.args_as_dict())
        else:
            response = await model_request(model, msgs)
            if db is not None:
                data = ModelMessagesTypeAdapter.dump_json([response])
                db.execute("INSERT INTO answers (data) VALUES (?)", (data,))
        done = time.perf_counter()
        out.append((done - t0) * 1000)
        while time.perf_counter() < done + pace_ms / 1000:
            pass  # busy, as a worker is with a step's own work: the server idles
    if db is not None:
        db.close()
    return out[1:]


async def recorded(workdir: Path, base_url: str, calls: int, mode: str) -> dict[str, Any]:
    workdir.mkdir(exist_ok=True)
    db = workdir / f"{mode}.db"
    app = tether.App(store=f"sqlite:///{db}")
    gateway = ai.Gateway(app)
    model = gateway.model(mode, ai.openai_compatible(MODEL, base_url=base_url, api_key="k"))

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
        with _call_timer() as call_ms:
            async with app.worker(poll_interval=0.05):
                c0 = app.store.stats()["commits"]
                run = await app.start(many, calls + 1, run_id="bench")
                check(await run.result(timeout=600) == calls + 1, "wrong result")
                commits = app.store.stats()["commits"] - c0
                usage = await app.usage("bench")
                check(usage.unpriced_calls == 0 and usage.cost > 0, f"unpriced calls: {usage}")
                done = [
                    e.created_at
                    for e in await app.history("bench")
                    if e.type is tether.EventType.ACTIVITY_COMPLETED
                ]
    finally:
        await app.close()
    check(len(call_ms) == len(done), f"{len(call_ms)} model calls for {len(done)} steps")
    gaps = [(b - a) * 1000 for a, b in itertools.pairwise(done)]
    conn = sqlite3.connect(db)
    try:
        (stored,) = conn.execute(
            "SELECT sum(length(data)) FROM events WHERE run_id = 'bench'"
        ).fetchone()
    finally:
        conn.close()
    return {
        "gaps": gaps,
        # the gap before a step's end holds that step's model call: what is left is
        # tether's own time for the step (scheduling, recording, the workflow's turn)
        "own": [gap - call for gap, call in zip(gaps, call_ms[1:], strict=True)],
        "calls": call_ms[1:],
        "bytes_per_call": stored / (calls + 1),
        "commits_per_call": commits / (calls + 1),
    }


async def conversation(workdir: Path, base_url: str, calls: int, refs: bool) -> dict[str, Any]:
    """One run holding a conversation of ``calls`` turns: history bytes per model step."""
    from pydantic_ai.messages import ModelMessage

    db = workdir / f"chat-{refs}.db"
    app = tether.App(store=f"sqlite:///{db}")
    gateway = ai.Gateway(app, message_refs=refs)
    model = gateway.model("chat", ai.openai_compatible(MODEL, base_url=base_url, api_key="k"))

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
        done = [
            t
            for (t,) in conn.execute(
                "SELECT created_at FROM events WHERE run_id = 'chat' "
                "AND type = 'ActivityCompleted' ORDER BY seq"
            )
        ]
    finally:
        conn.close()
    steps = [a + b for a, b in zip(per_call[::2], per_call[1::2], strict=True)]
    gaps = [(b - a) * 1000 for a, b in itertools.pairwise(done)]
    return {
        "first10": sum(steps[:10]) / 10,
        "last10": sum(steps[-10:]) / 10,
        "total": sum(steps),
        # a step's time early and late in the conversation (it grows with its length)
        "ms_first10": statistics.median(gaps[:10]),
        "ms_last10": statistics.median(gaps[-10:]),
    }


@contextlib.contextmanager
def _call_timer() -> Iterator[list[float]]:
    """The duration (ms) of each model call the gateway makes, as the worker makes it
    (``pydantic_ai.direct.model_request``, which the gateway looks up at each call)."""
    import pydantic_ai.direct as direct

    times: list[float] = []
    orig = direct.model_request

    async def timed(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return await orig(*a, **k)
        finally:
            times.append((time.perf_counter() - t0) * 1000)

    direct.model_request = timed  # type: ignore[assignment]
    try:
        yield times
    finally:
        direct.model_request = orig  # type: ignore[assignment]


@contextlib.contextmanager
def _stage_timers() -> Iterator[dict[str, list[float]]]:
    """Time a recorded step's stages (ms) by wrapping them; every wrapper is undone
    on exit. Internal names: this is a benchmark's probe, not an API."""
    import pydantic_ai.direct as direct

    from tether import _worker
    from tether.ai import _gateway
    from tether.store import _handoff, ops, sqlite
    from tether.workflow import _instance

    times: dict[str, list[float]] = {}
    marks: dict[str, float] = {}
    undo: list[tuple[Any, str, Any]] = []

    def patch(obj: Any, name: str, new: Any) -> None:
        undo.append((obj, name, getattr(obj, name)))
        setattr(obj, name, new)

    def timed_async(obj: Any, name: str, label: str) -> None:
        orig = getattr(obj, name)

        async def wrapper(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return await orig(*a, **k)
            finally:
                times.setdefault(label, []).append((time.perf_counter() - t0) * 1000)

        patch(obj, name, wrapper)

    timed_async(direct, "model_request", "model call (in the worker)")
    timed_async(_gateway.Gateway, "_call", "gateway step (call included)")
    timed_async(_worker.Worker, "_record_result", "record result (advance + commit)")
    advance = _instance.WorkflowInstance.advance

    def timed_advance(self: Any, *a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return advance(self, *a, **k)
        finally:
            times.setdefault("workflow advance", []).append((time.perf_counter() - t0) * 1000)

    patch(_instance.WorkflowInstance, "advance", timed_advance)
    op = ops._complete_activity_fast

    def timed_op(*a: Any, **k: Any) -> Any:
        marks["begin"] = marks.get("pending_begin", time.perf_counter())
        t0 = time.perf_counter()
        try:
            return op(*a, **k)
        finally:
            times.setdefault("store operation", []).append((time.perf_counter() - t0) * 1000)

    patch(ops, "_complete_activity_fast", timed_op)
    attempt = sqlite.SqliteStore._attempt

    def timed_attempt(self: Any, conn: Any, live: Any, *, savepoints: bool) -> Any:
        marks["pending_begin"] = time.perf_counter()
        try:
            return attempt(self, conn, live, savepoints=savepoints)
        finally:
            marks["end"] = time.perf_counter()
            marks.pop("pending_begin", None)

    patch(sqlite.SqliteStore, "_attempt", timed_attempt)
    resolve = _handoff._resolve

    def timed_resolve(items: Any) -> None:
        marks["resolved"] = time.perf_counter()
        resolve(items)

    patch(_handoff, "_resolve", timed_resolve)
    do = sqlite.SqliteStore._do

    async def timed_do(self: Any, fn: Any, *args: Any, write: bool = True) -> Any:
        if fn is not timed_op:
            return await do(self, fn, *args, write=write)
        t0 = time.perf_counter()
        out = await do(self, fn, *args, write=write)
        t1 = time.perf_counter()
        for label, ms in (
            ("hand-off to the writer thread", marks["begin"] - t0),
            ("transaction + commit (fsync)", marks["end"] - marks["begin"]),
            ("hand-back to the event loop", t1 - marks["end"]),
        ):
            times.setdefault(label, []).append(ms * 1000)
        return out

    patch(sqlite.SqliteStore, "_do", timed_do)
    try:
        yield times
    finally:
        for obj, name, orig in reversed(undo):
            setattr(obj, name, orig)


async def phases(workdir: Path, base_url: str, calls: int) -> dict[str, float]:
    """p50 (ms) of each stage of a ``complete`` step, from one timed run."""
    with _stage_timers() as times:
        got = await recorded(workdir / "phases", base_url, calls, "complete")
    out = {label: statistics.median(v[5:]) for label, v in times.items() if len(v) > 5}
    out["step (gap between completions)"] = statistics.median(got["gaps"])
    return out


def _answer(body: dict[str, Any]) -> Any:
    if body.get("tools"):
        return model_reply(tool=("final_result", {"label": "greeting", "score": 0.9}))
    return model_reply("greeting")


async def measure(workdir: Path, calls: int, rounds: int) -> dict[str, Any]:
    """Every mode ``rounds`` times, interleaved (the order rotated each round): each
    round's p50 of a recorded mode is compared with the bare p50 of the same round."""
    parent, child = multiprocessing.Pipe()
    proc = multiprocessing.Process(target=_serve, args=(child,), daemon=True)
    proc.start()
    try:
        base_url = parent.recv()
        modes = (
            "bare",
            "bare-structured",
            "bare-paced",
            "bare-durable",
            "complete",
            "structured",
        )
        out: dict[str, Any] = {m: {"rounds": []} for m in modes}
        for r in range(rounds):
            k = r % len(modes)
            for mode in modes[k:] + modes[:k]:
                if mode.startswith("bare"):
                    pace = PACE_MS if mode == "bare-paced" else 0.0
                    durable = workdir / f"durable-{r}.db" if mode == "bare-durable" else None
                    got: dict[str, Any] = {
                        "gaps": await bare(
                            base_url,
                            calls,
                            structured=mode == "bare-structured",
                            pace_ms=pace,
                            durable=durable,
                        )
                    }
                else:
                    got = await recorded(workdir / f"r{r}", base_url, calls, mode)
                out[mode]["rounds"].append(got)
        out["conversation"] = {
            "by reference": await conversation(workdir, base_url, 100, True),
            "full lists": await conversation(workdir, base_url, 100, False),
        }
        out["phases"] = await phases(workdir, base_url, calls)
    finally:
        parent.send("stop")
        proc.join(10)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds of each mode")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tether-ai-bench-") as tmp:
        workdir = Path(tmp)
        limit = bench_limit(workdir, FULL)
        t0 = time.perf_counter()
        res = asyncio.run(measure(workdir, args.calls, args.rounds))
        elapsed = time.perf_counter() - t0
    per_commit = 1000 / limit["commits_per_s"]
    bare_p50 = {
        mode: [_percentile(g["gaps"], 50) for g in res[mode]["rounds"]]
        for mode in ("bare", "bare-structured")
    }
    #: each recorded mode against the bare call that does the same work
    baseline = {
        "complete": "bare",
        "structured": "bare-structured",
        "bare-paced": "bare",
        "bare-durable": "bare",
    }
    print(f"LIMIT: {limit['commits_per_s']:,.0f} commits/s ({per_commit:.3f} ms/commit)")
    print(f"{args.rounds} interleaved rounds of {args.calls} calls; per round, the p50 of a")
    print("recorded mode minus the p50 of the same round's bare call doing the same work")
    print("(complete: a text call; structured: the output tool, validated); the median:")
    print(
        f"{'per call':<15} {'p50 ms':>7} {'p99 ms':>7} {'+p50 ms':>8} {'rounds':>15} "
        f"{'+/commit':>8} {'commits':>8} {'bytes':>7} {'own p50':>8} {'call p50':>9}"
    )
    summary: dict[str, Any] = {"limit": limit, "calls": args.calls, "seconds": elapsed}
    chats = res.pop("conversation")
    res_phases = res.pop("phases")
    for mode, r in res.items():
        p50s = [_percentile(g["gaps"], 50) for g in r["rounds"]]
        p99 = statistics.median(_percentile(g["gaps"], 99) for g in r["rounds"])
        base = bare_p50[baseline.get(mode, mode)]
        extras = [p - b for p, b in zip(p50s, base, strict=True)]
        extra = statistics.median(extras)
        last = r["rounds"][-1]
        spread = f"{min(extras):+.2f}..{max(extras):+.2f}"
        own = [_percentile(g["own"], 50) for g in r["rounds"] if "own" in g]
        call = [_percentile(g["calls"], 50) for g in r["rounds"] if "calls" in g]
        shown = f" {statistics.median(own):8.2f} {statistics.median(call):9.2f}" if own else ""
        print(
            f"{mode:<15} {statistics.median(p50s):7.2f} {p99:7.2f} {extra:8.2f} {spread:>15} "
            f"{extra / per_commit:8.2f} {last.get('commits_per_call', 0):8.2f} "
            f"{last.get('bytes_per_call', 0):7.0f}{shown}"
        )
        summary[mode] = {
            "p50_ms": statistics.median(p50s),
            "p99_ms": p99,
            "overhead_p50_ms": extra,
            "overhead_p50_ms_rounds": extras,
            "own_p50_ms": statistics.median(own) if own else None,
            "own_p50_ms_rounds": own,
            "call_in_worker_p50_ms": statistics.median(call) if call else None,
            "commits_per_call": last.get("commits_per_call"),
            "bytes_per_call": last.get("bytes_per_call"),
        }
    print("history bytes per model step, one 100-turn conversation:")
    for how, c in chats.items():
        growth = c["last10"] / c["first10"]
        print(
            f"  {how:<13} first 10: {c['first10']:8.0f}  last 10: {c['last10']:8.0f}  "
            f"(x{growth:.2f})  total: {c['total'] / 1024:8.0f} KiB  "
            f"ms a step: {c['ms_first10']:.2f} -> {c['ms_last10']:.2f}"
        )
    summary["conversation"] = chats
    stages = res_phases
    print("where a complete step's time goes (p50 ms, one timed run; stages nest):")
    for label, ms in stages.items():
        print(f"  {label:<36} {ms:7.3f}")
    summary["phases"] = stages
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
