"""``tether demo``: run the document pipeline, crash it, resume it, ask a person, check it.

The pipeline's worker runs in a child process. Part-way through, the demo kills it
with SIGKILL (announced on screen) and starts another, which replays each run from
its history and goes on from the last recorded step. Reviews are asked at the
terminal (or approved with ``--auto-approve``). At the end a table shows each
document's outcome, steps, retries, time, tokens and cost, and the demo checks
itself against its side table: every document accounted for, the crash survived,
no recorded step executed again, every document published at most once.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.parse
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.panel import Panel
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.prompt import Prompt
from rich.table import Table
from rich.text import Text


@dataclass
class Options:
    """What ``tether demo`` was asked to do."""

    store: Path
    auto_approve: bool = False
    fast: bool = False
    crash: bool = True
    model: str | None = None
    base_url: str | None = None


#: the share of the pipeline's stages done (over every run) when the worker is killed
_CRASH_AT = 0.3


@dataclass
class _State:
    worker: subprocess.Popen[bytes] | None = None
    workers_started: int = 0
    killed_pid: int | None = None
    recorded_at_kill: int = 0
    decided: dict[str, str] = field(default_factory=dict)
    asked: set[str] = field(default_factory=set)


def main(options: Options, console: Console | None = None) -> int:
    """Run the demo; 0 when every self-check passed."""
    # a log or a pipe gets a wide table, not one cut to 80 columns (unless COLUMNS says)
    wide = sys.stdout.isatty() or os.environ.get("COLUMNS", "").isdigit()
    console = console or Console(width=None if wide else 120)
    refused = _no_folder(options.store) or _not_the_demos(options.store)
    if refused is not None:
        print(f"error: {refused}", file=sys.stderr)
        return 1
    unusable = _model_problem(options)
    if unusable is not None:
        print(f"error: cannot use --model {options.model}: {unusable}", file=sys.stderr)
        return 2
    for suffix in ("", "-wal", "-shm", ".side.db", ".side.db-wal", ".side.db-shm"):
        Path(f"{options.store}{suffix}").unlink(missing_ok=True)  # a demo starts afresh
    os.environ["TETHER_DEMO_STORE"] = str(options.store)
    os.environ["TETHER_DEMO_PACE"] = "0.05" if options.fast else "1.0"
    os.environ["TETHER_DEMO_MODEL"] = options.model or ""
    os.environ["TETHER_DEMO_BASE_URL"] = options.base_url or ""
    from .pipeline import side_table

    with side_table():  # made before the store: it marks the store as the demo's to replace
        pass
    return asyncio.run(_main(options, console))


def _model_problem(options: Options) -> str | None:
    """Why the model ``--model`` names cannot be built here (a missing API key...), or None.

    The worker builds the same model from the same environment: said once, up front,
    rather than as ten runs that fail. A server behind ``--base-url`` is not called.
    """
    if options.base_url or not options.model:
        return None
    provider, sep, _ = options.model.partition(":")
    variable = _KEY_VARIABLES.get(provider) if sep else None
    if variable is not None and not os.environ.get(variable):
        # the library's own message ends "or pass api_key=": no option of this command
        also = (
            " (or give --base-url URL of an OpenAI-compatible server, which may need no key)"
            if provider == "openai"
            else ""
        )
        return f"no API key: set {variable} in the environment tether demo runs in{also}"
    try:
        from ..ai import ModelConfigError
        from ..ai._models import UNKNOWN_MODEL_HINT, build
    except ImportError as exc:  # the ai extra is not installed
        return str(exc)
    try:
        build(options.model)
    except ModelConfigError as exc:
        text = str(exc)
        if text.endswith(UNKNOWN_MODEL_HINT):  # "or pass a Model": not for a command
            text = text.removesuffix(UNKNOWN_MODEL_HINT) + (
                "Give --model a 'provider:name' pydantic-ai knows (e.g. openai:gpt-4o-mini), "
                "or --base-url for an OpenAI-compatible server"
            )
        return text
    return None


#: the variable each provider tether builds itself reads its API key from
_KEY_VARIABLES = {"openai": "OPENAI_API_KEY", "anthropic": "ANTHROPIC_API_KEY"}


#: the tables of the demo's side table (``<store>.side.db``), which marks its store
_SIDE_TABLES = {"executions", "published"}


def _side_tables(path: Path) -> set[str] | None:
    """The tables of the SQLite file at ``path`` (read-only); None if it is not one."""
    try:
        conn = sqlite3.connect(f"file:{urllib.parse.quote(str(path))}?mode=ro", uri=True)
        try:
            return {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        finally:
            conn.close()
    except sqlite3.Error:
        return None


def _no_folder(store: Path) -> str | None:
    """Why the demo cannot write ``store`` (its folder does not exist), or None: said in
    one line, as the store says it, rather than as sqlite3's traceback."""
    folder = store.absolute().parent
    if folder.is_dir():
        return None
    return (
        f"cannot write the demo's store {str(store)!r}: folder {str(folder)!r} does not "
        "exist; create it or pass another --store"
    )


def _not_the_demos(store: Path) -> str | None:
    """Why the demo must not start afresh at ``store`` (deleting what is there), or None.

    The demo replaces only a store it made: one with its side table beside it (made
    first, see ``main``).
    """
    side = Path(f"{store}.side.db")
    if side.exists() and _side_tables(side) != _SIDE_TABLES:
        return (
            f"{str(side)!r} is not the side table of a demo store; tether did not modify it: "
            "pass another --store"
        )
    if store.exists() and not side.exists():
        return (
            f"{str(store)!r} exists and is not a store the demo made (the demo starts afresh "
            "by deleting its own store); tether did not modify it: pass another --store"
        )
    return None


async def _main(options: Options, console: Console) -> int:
    from . import pipeline
    from .documents import SAMPLES

    label = (
        f"model: [bold]{options.model or 'default'}[/] at {options.base_url}"
        if options.base_url
        else f"model: [bold]{options.model}[/]"
        if options.model
        else "model: [bold]offline scripted model[/] (deterministic, no network; "
        "--model to use a real one)"
    )
    console.print(
        Panel(
            f"{len(SAMPLES)} documents through extract -> classify -> analyse -> validate -> "
            f"review -> publish\nstore: [bold]{options.store}[/] (embedded SQLite)\n{label}",
            title="tether demo",
            expand=False,
        )
    )
    app = pipeline.app
    state = _State()
    _start_worker(state, console)
    started = time.time()
    try:
        runs = [
            await app.start(pipeline.process_document, doc, run_id=f"doc-{doc.doc_id}")
            for doc in SAMPLES
        ]
        await _follow(app, [r.run_id for r in runs], options, state, console)
    finally:
        _stop_worker(state)
    elapsed = time.time() - started
    ok = await _summary(app, pipeline, [r.run_id for r in runs], options, state, console)
    console.print(f"\nall done in {elapsed:.1f} s.")
    console.print(
        "See every run, its history and its approvals in the console:\n"
        f"  [bold]TETHER_DEMO_STORE={options.store} tether serve tether.demo.pipeline:app "
        "--no-auth --workers 1[/]  then open http://127.0.0.1:8000/\n"
        f"or from the shell: [bold]tether runs --store {options.store}[/]",
        soft_wrap=True,  # commands stay whole, to copy
    )
    await app.close()
    return 0 if ok else 1


def _start_worker(state: _State, console: Console) -> None:
    state.worker = subprocess.Popen(
        [sys.executable, "-m", "tether.demo.pipeline"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=os.environ.copy(),
    )
    state.workers_started += 1
    console.print(f"[dim]worker process started (pid {state.worker.pid})[/]")


def _stop_worker(state: _State) -> None:
    if state.worker is not None and state.worker.poll() is None:
        state.worker.send_signal(signal.SIGTERM)
        try:
            state.worker.wait(15)
        except subprocess.TimeoutExpired:
            state.worker.kill()
            state.worker.wait(5)


async def _follow(
    app: Any, run_ids: list[str], options: Options, state: _State, console: Console
) -> None:
    """Show progress until every run has ended; crash the worker once; ask for reviews."""
    total_stages = 6
    progress = Progress(
        TextColumn("{task.fields[doc]:<10}"),
        BarColumn(bar_width=24),
        TextColumn("{task.fields[stage]}"),
        TimeElapsedColumn(),
        console=console,
    )
    tasks: dict[str, TaskID] = {
        rid: progress.add_task("", total=total_stages, doc=rid[4:], stage="queued")
        for rid in run_ids
    }
    progress.start()
    try:
        while True:
            infos = [await app.get(rid) for rid in run_ids]
            done_stages = 0
            for info in infos:
                status = info.custom_status if isinstance(info.custom_status, dict) else {}
                done = int((status.get("progress") or {}).get("done") or 0)
                stage = str(status.get("stage") or info.status.value)
                if status.get("kind") and stage not in ("published", "rejected"):
                    stage = f"{stage} ({status['kind']})"
                if info.is_finished:
                    done = total_stages
                    if info.status.value != "completed":
                        stage = f"[red]{info.status.value}[/]"
                progress.update(tasks[info.run_id], completed=done, stage=stage)
                done_stages += done
            if all(i.is_finished for i in infos):
                return
            share = done_stages / (total_stages * len(infos))
            if options.crash and state.killed_pid is None and share >= _CRASH_AT:
                await _crash(app, run_ids, state, progress.console)
            # a decision is delivered at once and recorded by the run a moment later:
            # until then the review still reads open, so ask about each one once
            reviews = [
                r for r in await app.approvals(status="open") if r.approval_id not in state.asked
            ]
            if reviews:
                progress.stop()
                for review in reviews:
                    await _review(app, review, options, state, console)
                progress.start()
            await asyncio.sleep(0.15)
    finally:
        progress.stop()


async def _crash(app: Any, run_ids: list[str], state: _State, console: Console) -> None:
    """SIGKILL the worker mid-flight, say so, and start a new one."""
    assert state.worker is not None
    recorded = 0
    for rid in run_ids:
        recorded += sum(1 for e in await app.history(rid) if e.type.value == "ActivityCompleted")
    state.killed_pid = state.worker.pid
    state.recorded_at_kill = recorded
    state.worker.send_signal(signal.SIGKILL)
    state.worker.wait(10)
    console.print(
        f"[bold red]CRASH:[/] killed the worker process (pid {state.killed_pid}) with SIGKILL, "
        f"{recorded} steps recorded so far, others in flight. Starting a new worker: it "
        "replays each run from its history and runs only what was not recorded."
    )
    _start_worker(state, console)


async def _review(app: Any, review: Any, options: Options, state: _State, console: Console) -> None:
    """Ask the person at the terminal (or approve, with --auto-approve or no terminal)."""
    from .pipeline import KINDS, REVIEWER

    state.asked.add(review.approval_id)
    proposal = review.proposal
    body = (
        f"[bold]{proposal['doc_id']}[/] classified as [bold]{proposal['kind']}[/]\n"
        f"summary: {proposal['summary']}\n"
        f"details: {proposal.get('details') or '-'}\n"
        f"fingerprint: {review.fingerprint[:16]}..."
    )
    console.print(Panel(body, title=f"review needed ({review.approval_id})", expand=False))
    interactive = not options.auto_approve and sys.stdin.isatty()
    choice = "approve"
    if interactive:
        choice = Prompt.ask(
            "approve, edit the kind, or reject?",
            choices=["approve", "edit", "reject"],
            default="approve",
            console=console,
        )
    else:
        why = "--auto-approve" if options.auto_approve else "no terminal to ask"
        console.print(f"[dim]approved automatically ({why})[/]")
    value = None
    if choice == "edit":
        kind = Prompt.ask("kind", choices=sorted(KINDS), default=proposal["kind"], console=console)
        value = {**proposal, "kind": kind}
    await app.decide(
        review.approval_id,
        approve=choice != "reject",
        by=REVIEWER,
        fingerprint=review.fingerprint,
        value=value,
        reason=None if choice != "reject" else "rejected at the terminal",
    )
    state.decided[review.run_id] = {"approve": "approved", "edit": "edited"}.get(choice, "rejected")


#: below this width the outcome table merges columns to fit (80 columns fit)
_NARROW = 104
_COLUMNS = [
    "document",
    "kind",
    "outcome",
    "review",
    "steps",
    "retries",
    "re-run",
    "time",
    "tokens",
    "cost",
]
_NARROW_COLUMNS = ["document", "kind", "outcome", "steps", "retries", "time", "tokens", "cost"]


async def _summary(
    app: Any, pipeline: Any, run_ids: list[str], options: Options, state: _State, console: Console
) -> bool:
    """The outcome table, the runs' errors and the self-checks; True when every check passed."""
    narrow = console.width < _NARROW
    # narrow: the review goes under the outcome, the re-runs beside the retries ("1+1")
    columns = _NARROW_COLUMNS if narrow else _COLUMNS
    table = Table(
        title="outcome", box=box.SIMPLE_HEAD, pad_edge=not narrow, collapse_padding=narrow
    )
    for column in columns:
        numeric = column in {"steps", "retries", "re-run", "time", "tokens", "cost"}
        # what a cell cannot lose (an id, a figure) is never cut; the outcome may wrap
        table.add_column(
            column, justify="right" if numeric else "left", no_wrap=column != "outcome"
        )
    repeated: list[str] = []
    accounted = 0
    errors: dict[str, list[str]] = {}
    with pipeline.side_table() as conn:
        executions = conn.execute("SELECT run_id, step, at FROM executions").fetchall()
        published = conn.execute("SELECT doc_id, deliveries FROM published").fetchall()
    ran_at: dict[tuple[str, int], list[float]] = {}
    for rid, step, at in executions:
        ran_at.setdefault((rid, step), []).append(at)
    total_cost = Decimal(0)
    for rid in run_ids:
        info = await app.get(rid)
        history = await app.history(rid)
        completed = [e for e in history if e.type.value == "ActivityCompleted"]
        failed_at: dict[int, int] = {}
        for e in history:
            if e.type.value == "ActivityAttemptFailed":
                failed_at[e.step or 0] = failed_at.get(e.step or 0, 0) + 1
        failures = sum(failed_at.values())
        reruns = 0
        for event in completed:
            times = ran_at.get((rid, event.step or 0), [])
            # an execution beyond the first that no failed attempt accounts for
            reruns += max(0, len(times) - 1 - failed_at.get(event.step or 0, 0))
            if any(t > event.created_at for t in times):
                repeated.append(f"{rid} step {event.step}")
        status = info.custom_status if isinstance(info.custom_status, dict) else {}
        kind = str(status.get("kind") or "-")
        outcome = info.status.value  # failed, cancelled... when the run did not complete
        review = state.decided.get(rid, "-")
        if info.status.value == "completed":
            out = await app.get_run(rid).result(timeout=5)
            outcome, kind = out.status, out.kind
            accounted += 1
        if info.error:
            errors.setdefault(_error_line(info.error), []).append(rid)
        usage = await app.usage(rid)
        total_cost += usage.cost
        took = (info.completed_at or time.time()) - info.created_at
        figures = [f"{took:.1f} s", f"{usage.tokens:,}", f"${usage.cost:.6f}"]
        if narrow:
            if review not in ("-", outcome):
                outcome = f"{outcome} ({review})"
            retried = str(failures) + (f"+{reruns}" if reruns else "")
            table.add_row(rid[4:], kind, outcome, str(len(completed)), retried, *figures)
        else:
            table.add_row(
                rid[4:], kind, outcome, review, str(len(completed)), str(failures), str(reruns),
                *figures,
            )  # fmt: skip
    console.print(table)
    priced = "simulated price" if not (options.model or options.base_url) else "genai-prices"
    console.print(
        f"model cost, all documents: ${total_cost:.6f} ({priced}). retries: failed attempts "
        "tried again; "
        + ("+N" if narrow else "re-run")
        + ": steps in flight when the worker was killed (never recorded, so run again)"
    )
    if errors:
        failed = sum(len(rids) for rids in errors.values())
        console.print(f"\n[red]{failed} runs failed[/] (the distinct errors):")
        for line, rids in errors.items():
            which = ", ".join(r[4:] for r in rids[:3]) + (", ..." if len(rids) > 3 else "")
            console.print(Text(f"  {line} ({len(rids)}: {which})"))
        console.print(
            f"one in full: [bold]tether get {next(iter(errors.values()))[0]} "
            f"--store {options.store}[/]",
            soft_wrap=True,
        )
    per_doc: dict[str, int] = {}
    duplicates = 0
    for doc_id, deliveries in published:
        per_doc[doc_id] = per_doc.get(doc_id, 0) + 1
        duplicates += deliveries - 1
    checks = [
        (accounted == len(run_ids), f"{accounted}/{len(run_ids)} documents accounted for"),
        _crash_check(options, state),
        (
            not repeated,
            "no recorded step executed again"
            if not repeated
            else f"recorded steps executed again: {', '.join(repeated[:5])}",
        ),
        (
            all(n == 1 for n in per_doc.values()),
            f"{len(per_doc)} documents published once each"
            + (f" ({duplicates} repeated deliveries absorbed by the key)" if duplicates else ""),
        ),
    ]
    console.print()
    for ok, text in checks:
        console.print(f"  {'[green]ok[/]  ' if ok else '[red]FAIL[/]'} {text}")
    return all(ok for ok, _ in checks)


def _error_line(error: dict[str, Any]) -> str:
    """A run's error in one line: its type and the first line of its message."""
    message = str(error.get("message") or "").strip().splitlines()
    line = f"{error.get('type') or 'error'}: {message[0] if message else ''}"
    return line if len(line) <= 300 else line[:299] + "..."


def _crash_check(options: Options, state: _State) -> tuple[bool, str]:
    """Whether the worker was killed part-way and the runs went on on a new one."""
    if not options.crash:
        return True, "no crash asked for (--no-crash)"
    if state.killed_pid is None:
        return False, (
            "no crash: every run ended before the crash point (the worker is killed once "
            f"{_CRASH_AT:.0%} of the steps are done), so there was nothing to resume"
        )
    return state.workers_started == 2, (
        f"worker killed (pid {state.killed_pid}) after {state.recorded_at_kill} recorded "
        "steps, and the runs finished on a new worker"
    )
