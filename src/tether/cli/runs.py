"""Runs and run control: ``start``, ``runs``, ``get``, ``signal``, ``cancel``,
``terminate``, ``suspend``, ``resume``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import shlex
from collections.abc import Callable, Coroutine
from typing import Annotated, Any

import typer
from rich.table import Table
from rich.text import Text

from .._app import App, Run
from .._errors import PayloadError, ResultTimeoutError, TetherError
from .._history import RunInfo, RunStatus, describe_waiting
from .._serde import encode
from ._common import (
    EXIT_USAGE,
    MAX_LIMIT,
    UsageError,
    _app_option,
    _client_app,
    _console,
    _describe_store,
    _dump,
    _fail,
    _info_dict,
    _note,
    _opened,
    _parse_json,
    _reason_option,
    _run,
    _run_id_argument,
    _short_json,
    _status_text,
    _store_option,
    _ts,
    cli_actor,
    load_app,
)


def runs_command(
    store: Annotated[str | None, _store_option()] = None,
    app: Annotated[str | None, _app_option()] = None,
    status: Annotated[
        RunStatus | None, typer.Option("--status", help="Only runs with this status.")
    ] = None,
    workflow: Annotated[
        str | None, typer.Option("--workflow", "-w", help="Only runs of this workflow.")
    ] = None,
    limit: Annotated[
        int, typer.Option("--limit", "-n", min=1, max=MAX_LIMIT, help="Show at most N runs.")
    ] = 50,
    waiting_for: Annotated[
        str | None,
        typer.Option(
            "--waiting-for",
            metavar="KIND",
            help="Only live runs waiting for: signal (or signal:NAME), timer, activity, "
            "child, admission.",
        ),
    ] = None,
    stuck: Annotated[
        bool,
        typer.Option(
            "--stuck",
            help="Only live runs that cannot move on: their workflow task fails "
            "(non-determinism after a deploy, ...) or a step waits for a worker that "
            "registers its activity.",
        ),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """List runs, newest first, with what each live run waits for.

    A run that cannot move on shows the type of its task error too (`tether get`
    shows it whole)."""

    async def go() -> list[RunInfo]:
        async with _opened(_client_app(store, app)) as a:
            return await a.list(
                status=status,
                workflow=workflow,
                limit=limit,
                waiting_for=waiting_for,
                stuck=stuck,
            )

    infos = _run(go())
    if as_json:
        _dump([_info_dict(i) for i in infos])
        return
    if not infos:
        _note("no runs found")
        return
    table = Table(show_edge=False, header_style="bold")
    table.add_column("run id", no_wrap=True)
    table.add_column("workflow")
    table.add_column("status", no_wrap=True)
    table.add_column("custom status")
    table.add_column("waiting for")
    # a column only when a run shown cannot move on (its task error's type)
    stuck_types = {i.run_id: _task_error_type(i) for i in infos}
    if any(stuck_types.values()):
        table.add_column("task error", style="red")
    table.add_column("created", no_wrap=True)
    table.add_column("updated", no_wrap=True)
    for info in infos:
        table.add_row(
            Text(info.run_id),
            Text(info.workflow),
            _status_text(info.status),
            Text(_short_json(info.custom_status)),
            Text(_waiting_for(info)),
            *([Text(stuck_types[info.run_id])] if any(stuck_types.values()) else []),
            _ts(info.created_at),
            _ts(info.updated_at),
        )
    _console().print(table)


def _waiting_for(info: RunInfo) -> str:
    """What a run waits for; a pending run no worker has taken yet waits for a worker of
    its queue (it showed nothing, as if it waited for nothing)."""
    said = describe_waiting(info.waiting_on)
    if not said and info.status is RunStatus.PENDING:
        return f"a worker (queue {info.queue})"
    return said


def _task_error_type(info: RunInfo) -> str:
    """The type of a live run's task error ("" when it has none or has ended)."""
    if not info.task_error or info.is_finished:
        return ""
    return info.task_error.partition(": ")[0]


def get_command(
    run_id: Annotated[str, _run_id_argument()],
    store: Annotated[str | None, _store_option()] = None,
    app: Annotated[str | None, _app_option()] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Show one run: status, custom status, input, result or error, timestamps."""

    async def go() -> RunInfo:
        async with _opened(_client_app(store, app)) as a:
            return await a.get(run_id)

    info = _run(go())
    if as_json:
        _dump(_info_dict(info))
        return
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column()
    rows: list[tuple[str, Text | str]] = [
        ("run id", Text(info.run_id)),
        ("workflow", Text(info.workflow)),
        ("status", _status_text(info.status)),
        ("custom status", Text(_short_json(info.custom_status, 500))),
        ("queue", Text(info.queue)),
        ("created", _ts(info.created_at)),
        ("updated", _ts(info.updated_at)),
        ("completed", _ts(info.completed_at)),
        ("input", Text(info.input)),
    ]
    if info.output is not None:
        rows.append(("output", Text(info.output)))
    if info.error:
        err = info.error
        rows.append(("error", Text(f"{err.get('type', 'Error')}: {err.get('message', '')}")))
    if info.task_error:
        rows.append(("task error", Text(info.task_error)))
    if info.parent_run_id:
        rows.append(("parent run", Text(info.parent_run_id)))
    if info.continued_to:
        rows.append(("continued to", Text(info.continued_to)))
    for key, value in rows:
        grid.add_row(key, value)
    _console().print(grid)


def signal_command(
    run_id: Annotated[str, _run_id_argument()],
    name: Annotated[str, typer.Argument(metavar="NAME", help="The signal's name.")],
    payload: Annotated[
        str | None,
        typer.Argument(metavar="JSON_PAYLOAD", help="The payload as JSON (default null)."),
    ] = None,
    signal_id: Annotated[
        str | None,
        typer.Option(
            "--id",
            help="The signal's id: a signal of an id the run (or its continue-as-new "
            "chain) already received is not sent again (a safe retry); sent with "
            "another name or payload, it is refused.",
        ),
    ] = None,
    store: Annotated[str | None, _store_option()] = None,
    app: Annotated[str | None, _app_option()] = None,
) -> None:
    """Send the signal NAME (with an optional JSON payload) to a run."""
    value = None
    if payload is not None:
        try:
            value = _parse_json(payload, "JSON_PAYLOAD")
        except UsageError as exc:
            _fail(str(exc), EXIT_USAGE)
    sent: list[bool] = []

    async def send(a: App) -> None:
        sent.append(await a.signal(run_id, name, value, signal_id=signal_id))

    _act(
        store,
        app,
        send,
        lambda: (
            f"signal {name!r} sent to run {run_id}"
            if sent[0]
            else f"signal {signal_id!r} already sent to run {run_id}: not sent again"
        ),
        ("signal", run_id, {"signal": name}),
        skip_audit=lambda: not sent[0],
    )


def _act(
    store: str | None,
    app: str | None,
    action: Callable[[App], Coroutine[Any, Any, Any]],
    done: str | Callable[[], str],
    audit: tuple[str, str, dict[str, Any] | None],
    skip_audit: Callable[[], bool] | None = None,
) -> None:
    """Open the store, do one thing to a run, record who did it (``audit``: the action,
    the run id and details; not when ``skip_audit()`` says nothing was done), say what
    was done (``done``, or what it returns once the action ran)."""

    async def go() -> None:
        async with _opened(_client_app(store, app)) as a:
            await action(a)
            if skip_audit is not None and skip_audit():
                return
            what, run_id, detail = audit
            await a.store.audit(cli_actor(), what, f"run:{run_id}", detail)

    _run(go())
    print(done if isinstance(done, str) else done())


def cancel_command(
    run_id: Annotated[str, _run_id_argument()],
    reason: Annotated[str | None, _reason_option()] = None,
    store: Annotated[str | None, _store_option()] = None,
    app: Annotated[str | None, _app_option()] = None,
) -> None:
    """Ask a run to cancel; its code sees the cancellation at its next await."""
    _act(
        store,
        app,
        lambda a: a.cancel(run_id, reason),
        f"cancellation requested for run {run_id}",
        ("cancel", run_id, {"reason": reason} if reason else None),
    )


def terminate_command(
    run_id: Annotated[str, _run_id_argument()],
    reason: Annotated[str | None, _reason_option()] = None,
    store: Annotated[str | None, _store_option()] = None,
    app: Annotated[str | None, _app_option()] = None,
) -> None:
    """End a run (and its running children) now, running none of its code."""
    _act(
        store,
        app,
        lambda a: a.terminate(run_id, reason),
        f"run {run_id} terminated",
        ("terminate", run_id, {"reason": reason} if reason else None),
    )


def suspend_command(
    run_id: Annotated[str, _run_id_argument()],
    store: Annotated[str | None, _store_option()] = None,
    app: Annotated[str | None, _app_option()] = None,
) -> None:
    """Pause a run: no new steps are dispatched until resume."""
    _act(
        store,
        app,
        lambda a: a.suspend(run_id),
        f"run {run_id} suspended",
        ("suspend", run_id, None),
    )


def resume_command(
    run_id: Annotated[str, _run_id_argument()],
    store: Annotated[str | None, _store_option()] = None,
    app: Annotated[str | None, _app_option()] = None,
) -> None:
    """Continue a suspended run."""
    _act(store, app, lambda a: a.resume(run_id), f"run {run_id} resumed", ("resume", run_id, None))


def retry_command(
    run_id: Annotated[str, _run_id_argument()],
    store: Annotated[str | None, _store_option()] = None,
    app: Annotated[str | None, _app_option()] = None,
) -> None:
    """Retry a failed (or needs-intervention) run from its failed step.

    Earlier steps keep their recorded results."""
    _act(
        store,
        app,
        lambda a: a.retry(run_id),
        f"run {run_id} retried from its failed step",
        ("retry", run_id, None),
    )


def complete_step_command(
    run_id: Annotated[str, _run_id_argument()],
    step: Annotated[
        int, typer.Argument(metavar="STEP", min=1, help="The step's number (tether history).")
    ],
    result: Annotated[
        str,
        typer.Argument(
            metavar="JSON_RESULT", help="""The step's result, as JSON (a string: '"ch_123"')."""
        ),
    ],
    reason: Annotated[
        str,
        typer.Option("--reason", help="How the result was confirmed (recorded and audited)."),
    ],
    store: Annotated[str | None, _store_option()] = None,
    app: Annotated[str | None, _app_option()] = None,
) -> None:
    """Record an activity step's result without running it (the in-doubt protocol).

    For a step whose work is known done (checked at the provider by its idempotency key):
    a step waiting for its next retry, or the failed step of a failed run, which is
    reopened and continues with this result. A completed or running step is refused.
    With --app the result is checked against the activity's return type."""
    try:
        value = _parse_json(result, "JSON_RESULT")
    except UsageError as exc:
        _fail(str(exc), EXIT_USAGE)

    async def go() -> None:
        async with _opened(_client_app(store, app)) as a:
            # audited by complete_step itself, in the write that records the result
            await a.complete_step(run_id, step, value, reason=reason, by=cli_actor())

    _run(go())
    print(f"step {step} of run {run_id} completed with the given result")


def audit_command(
    run_id: Annotated[str, _run_id_argument()],
    store: Annotated[str | None, _store_option()] = None,
    app: Annotated[str | None, _app_option()] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON lines.")] = False,
) -> None:
    """Who or what started and acted on a run (API keys, console, CLI users, parent runs)."""

    async def go() -> list[dict[str, Any]]:
        async with _opened(_client_app(store, app)) as a:
            return await a.audit(run_id)

    trail = _run(go())
    if as_json:
        for entry in trail:
            print(json.dumps(entry, default=str))
        return
    table = Table(box=None)
    for col in ("at", "actor", "action", "detail"):
        table.add_column(col)
    for entry in trail:
        table.add_row(
            _ts(entry["at"]),
            entry["actor"],
            entry["action"],
            json.dumps(entry["detail"]) if entry["detail"] else "",
        )
    _console().print(table)


def start_command(
    app_spec: Annotated[
        str,
        typer.Argument(metavar="MODULE:ATTR", help="The tether.App defining the workflow."),
    ],
    workflow: Annotated[str, typer.Argument(metavar="WORKFLOW", help="The workflow's name.")],
    args: Annotated[
        list[str] | None,
        typer.Argument(
            metavar="JSON_ARGS",
            help="Positional arguments, each as JSON (strings quoted: '\"text\"'; put -- "
            "before negative numbers).",
            show_default=False,
        ),
    ] = None,
    run_id: Annotated[
        str | None,
        typer.Option(
            "--run-id", help="Run id to use; starting again with the same input is a no-op."
        ),
    ] = None,
    wait: Annotated[
        bool,
        typer.Option(
            "--wait",
            help="Wait for the run to finish and print its result as JSON. Needs a worker "
            "running elsewhere (tether worker MODULE:ATTR); this command does not run it.",
        ),
    ] = False,
    timeout: Annotated[
        float | None,
        typer.Option(
            "--timeout",
            metavar="SECONDS",
            help="With --wait (refused without it): give up waiting after this long (the run "
            "goes on).",
        ),
    ] = None,
) -> None:
    """Start a run of WORKFLOW and print its id (and its result with --wait)."""
    # checked before the run starts: an error after it would invite a duplicate retry
    if timeout is not None and not wait:
        _fail("--timeout applies only with --wait (it bounds the wait for the result)", EXIT_USAGE)
    if timeout is not None and not (math.isfinite(timeout) and timeout >= 0):
        _fail(
            f"--timeout must be a number of seconds, 0 or more (got {timeout}); leave it out "
            "to wait until the run ends",
            EXIT_USAGE,
        )
    try:
        values = [_parse_json(a, f"argument {i}") for i, a in enumerate(args or [], 1)]
    except UsageError as exc:
        _fail(str(exc), EXIT_USAGE)

    async def go() -> None:
        async with _opened(load_app(app_spec)) as a:
            try:
                run: Run[Any] = await a.start(workflow, *values, run_id=run_id, by=cli_actor())
            except PayloadError as exc:  # arguments do not bind or do not match the types
                raise UsageError(str(exc)) from None
            print(run.run_id, flush=True)
            if wait:
                result = await _wait_for(a, run, timeout, app_spec, workflow, args or [])
                print(encode(result, "the run's result"))

    _run(go())


#: seconds ``start --wait`` waits before it says that no worker has taken the run
UNCLAIMED_NOTICE_AFTER = 3.0
#: polls of a pending run's status (``start --wait``) between whole reads of it
UNCLAIMED_REREAD = 10


async def _wait_for(
    app: App, run: Run[Any], timeout: float | None, app_spec: str, workflow: str, args: list[str]
) -> Any:
    """The run's result; meanwhile, if no worker takes it, say so once (to stderr); on the
    timeout, the command that keeps waiting (a start with the run's id starts no other)."""
    noticing = asyncio.create_task(_say_if_unclaimed(app, run.run_id, app_spec))
    try:
        return await run.result(timeout)
    except ResultTimeoutError:
        try:
            status: RunStatus | None = (await app.get(run.run_id)).status
        except TetherError:
            status = None  # the store could not be read
        state = "not known to have ended" if status is None else f"still {status.value}"
        state += f" after {timeout:g} s"
        if status is RunStatus.PENDING:
            state += f" (no worker has taken it: is `tether worker {app_spec}` running?)"
        options = ["--run-id", run.run_id, "--wait"]
        # an argument that looks like an option (a negative number) goes after --
        dashed = any(a.startswith("-") for a in args)
        again = [*options, "--", *args] if dashed else [*args, *options]
        raise ResultTimeoutError(
            f"run {run.run_id!r} is {state}; it goes on. To keep "
            f"waiting: {shlex.join(['tether', 'start', app_spec, workflow, *again])} (the "
            "same run: no other starts)"
        ) from None
    finally:
        noticing.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await noticing


async def _say_if_unclaimed(app: App, run_id: str, app_spec: str) -> None:
    """Say once, on stderr, that no worker has taken the run, while it stays pending with
    nothing of its queue running (then whoever waits may be waiting for nothing)."""
    with contextlib.suppress(TetherError):  # only a hint: a store that fails is said later
        await asyncio.sleep(UNCLAIMED_NOTICE_AFTER)
        info = await app.get(run_id)  # read whole once (its queue); then its status is polled
        while info.status is RunStatus.PENDING:
            if info.task_error:  # a worker took it, and fails it
                _note(f"run {run_id} has not started yet: {info.task_error} (still waiting)")
                return
            if not _queue_busy(await app.queue_stats(), info.queue):
                store = getattr(app.store, "url", None) or _describe_store(app.store)
                _note(
                    f"no worker has taken run {run_id} yet: is `tether worker {app_spec}` "
                    f"running on store {store}? (still waiting)"
                )
                return
            # a worker is busy on its queue and may take it next: poll the status alone
            # (nothing decoded), and read the run again once the queue is idle, or every
            # UNCLAIMED_REREAD polls, for a task error a worker may have left on it since
            # (a worker that keeps failing it while other runs keep the queue busy)
            for _ in range(UNCLAIMED_REREAD):
                await asyncio.sleep(UNCLAIMED_NOTICE_AFTER)
                if await app.store.run_status(run_id) is not RunStatus.PENDING:
                    return
                if not _queue_busy(await app.queue_stats(), info.queue):
                    break
            info = await app.get(run_id)


def _queue_busy(stats: list[Any], queue: str) -> bool:
    """Whether ``queue`` has work running (a worker is serving it)."""
    return any(q.queue == queue and q.running > 0 for q in stats)
