"""``tether worker``: serve an App's workflows and activities until SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import math
import os
import signal
import sys
from collections.abc import Callable
from typing import Annotated, Any

import typer

from .._app import App
from .._errors import ConfigurationError
from .._policy import env_number
from .._worker import MAX_CONCURRENCY, Worker
from ._common import (
    EXIT_ERROR,
    EXIT_USAGE,
    ThreadGraceOption,
    _describe_exception,
    _describe_store,
    _fail,
    _log_format_option,
    _log_level_option,
    _note,
    _opened,
    _run,
    _setup_logging,
    load_app,
)

#: the shortest ``--lease`` accepted (seconds)
MIN_LEASE = 1.0


def worker_command(
    app_spec: Annotated[
        str,
        typer.Argument(
            metavar="MODULE:ATTR", help="The tether.App to serve, e.g. myproject.flows:app."
        ),
    ],
    queue: Annotated[
        list[str] | None,
        typer.Option(
            "--queue",
            "-q",
            metavar="Q",
            help="Queue to serve; repeat for several (default: every queue the app uses).",
            show_default=False,
        ),
    ] = None,
    concurrency: Annotated[
        int,
        typer.Option(
            "--concurrency", "-c", min=1, max=MAX_CONCURRENCY, help="Tasks run at once, at most."
        ),
    ] = 100,
    lease: Annotated[
        float,
        typer.Option(
            "--lease",
            metavar="SECONDS",
            help="How long a claimed task stays ours without renewal (at least 1).",
        ),
    ] = 15.0,
    grace: Annotated[
        float,
        typer.Option(
            "--grace",
            metavar="SECONDS",
            min=0.0,
            max=86_400.0,
            help="On SIGTERM/Ctrl+C, how long in-flight work may take to finish (a sync "
            "activity still running is waited for: its thread cannot be interrupted).",
        ),
    ] = 10.0,
    thread_grace: ThreadGraceOption = 60.0,
    log_level: Annotated[str, _log_level_option()] = "info",
    log_format: Annotated[str, _log_format_option()] = "text",
    worker_id: Annotated[
        str | None,
        typer.Option(
            "--id",
            metavar="NAME",
            help="A stable, unique name for this worker (e.g. worker-1): after a crash its "
            "restart takes back the tasks it held within seconds instead of waiting for leases.",
        ),
    ] = None,
    version: Annotated[
        list[str] | None,
        typer.Option(
            "--version",
            metavar="V",
            help="Only continue runs recorded by these workflow versions; repeat for several.",
        ),
    ] = None,
    metrics_port: Annotated[
        int | None,
        typer.Option(
            "--metrics-port",
            metavar="PORT",
            min=0,
            max=65_535,
            help="Serve Prometheus metrics on this port (GET /metrics, no key asked: they "
            "name every tenant); needs prometheus-client.",
        ),
    ] = None,
    metrics_host: Annotated[
        str,
        typer.Option(
            "--metrics-host",
            metavar="HOST",
            help="Address the metrics port listens on; 0.0.0.0 lets other machines scrape "
            "it (only on a private network).",
        ),
    ] = "127.0.0.1",
) -> None:
    """Serve MODULE:ATTR's workflows and activities until SIGTERM or Ctrl+C."""
    check_worker_options(lease, worker_id, "--id")
    _setup_logging(log_level, log_format)
    if metrics_port is not None and importlib.util.find_spec("prometheus_client") is None:
        _fail("--metrics-port needs prometheus-client: pip install 'tether[server]'", EXIT_USAGE)
    code = _run(
        _serve(
            app_spec,
            queue or None,
            concurrency,
            lease,
            grace,
            worker_id,
            version or None,
            metrics_port,
            metrics_host,
            thread_grace,
        )
    )
    raise SystemExit(code)


def check_worker_options(lease: float, worker_id: str | None, id_option: str) -> None:
    """Refuse a ``--lease`` or a worker id (given as ``id_option``) a worker cannot use."""
    if not (math.isfinite(lease) and 0 < lease <= 86_400):
        _fail(
            f"--lease must be positive, a finite number of seconds up to a day (got {lease})",
            EXIT_USAGE,
        )
    if lease < MIN_LEASE:
        # renewed every lease/3 seconds: a store round trip or a busy loop longer than
        # that lets the lease run out under work that still runs, which then runs twice
        _fail(
            f"--lease must be at least {MIN_LEASE:g} second (got {lease:g}): a shorter "
            "lease runs out between renewals and the same work runs twice",
            EXIT_USAGE,
        )
    if worker_id is not None and not worker_id.strip():
        _fail(
            f"{id_option} needs a name (got an empty one); leave it out for a random id",
            EXIT_USAGE,
        )


def _add_signal_handlers(
    loop: asyncio.AbstractEventLoop, handler: Callable[[signal.Signals], None]
) -> list[signal.Signals]:
    installed = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, handler, sig)
        except (NotImplementedError, RuntimeError):  # e.g. Windows: plain handler
            signal.signal(sig, lambda s, _f: loop.call_soon_threadsafe(handler, signal.Signals(s)))
        else:
            installed.append(sig)
    return installed


async def _hint_foreign_leases(app: App, w: Worker) -> None:
    """Say plainly when work waits for other workers' leases (a crashed worker's tasks
    resume only when they expire, unless it restarts with the same --id)."""
    probe = getattr(app.store, "foreign_leases", None)
    if probe is None:
        return
    count, until = await probe(w.queues, w.id)
    if count and until is not None:
        left = max(0.0, until - app.store.clock())
        _note(
            f"tether worker {w.id}: {count} task(s) on these queues are leased to other "
            f"worker ids for up to {left:.0f}s more; if those workers are gone, their work "
            "resumes here when the leases expire (start workers with a stable --id NAME and "
            "a restarted one takes its tasks back within seconds)"
        )


async def _serve_metrics(app: App, w: Worker, port: int, host: str) -> Any:
    """Prometheus metrics of this worker and its store on ``host:port`` (a daemon
    thread; no key is asked, so only loopback unless told otherwise)."""
    from prometheus_client import REGISTRY, start_http_server

    from ..metrics import Metrics

    metrics = Metrics(app, [w])
    await metrics.update()
    metrics.start()
    REGISTRY.register(metrics)
    try:
        server, _thread = start_http_server(port, addr=host)
    except OSError as exc:
        REGISTRY.unregister(metrics)
        await metrics.stop()
        raise ConfigurationError(
            f"--metrics-host {host!r} --metrics-port {port}: cannot listen there ({exc}); "
            "pick a free port and an address of this machine"
        ) from None
    bound = server.server_address[1]
    _note(f"tether worker {w.id}: metrics on http://{host}:{bound}/metrics")
    return metrics


async def _serve(
    app_spec: str,
    queues: list[str] | None,
    concurrency: int,
    lease: float,
    grace: float,
    worker_id: str | None = None,
    versions: list[str] | None = None,
    metrics_port: int | None = None,
    metrics_host: str = "127.0.0.1",
    thread_grace: float = 60.0,
) -> int:
    app = load_app(app_spec)
    if metrics_port is not None:  # a bad refresh interval is one line, before any work
        env_number("TETHER_METRICS_REFRESH", 5.0, least=0.1)
    async with _opened(app):
        w = app.worker(
            queues=queues,
            concurrency=concurrency,
            lease=lease,
            worker_id=worker_id,
            versions=versions,
        )
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()

        def on_signal(sig: signal.Signals) -> None:
            if stop.is_set():
                _note(f"tether worker {w.id}: {sig.name} again, exiting without waiting")
                os._exit(EXIT_ERROR)  # leases expire and other workers take the work over
            _note(
                f"tether worker {w.id}: {sig.name} received, finishing in-flight work "
                f"(up to {grace:g}s; send it again to exit at once)"
            )
            stop.set()

        installed = _add_signal_handlers(loop, on_signal)
        metrics = None
        stopped = False
        try:
            await w.start()
            if metrics_port is not None:
                metrics = await _serve_metrics(app, w, metrics_port, metrics_host)
            _note(
                f"tether worker {w.id} serving queues {', '.join(w.queues)} on store "
                f"{_describe_store(app.store)} (concurrency {concurrency}, lease {lease:g}s)"
            )
            await _hint_foreign_leases(app, w)
            serving = asyncio.create_task(w.run())
            stopping = asyncio.create_task(stop.wait())
            await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
            stopping.cancel()
            code = 0
            if serving.done() and not serving.cancelled() and serving.exception() is not None:
                exc = serving.exception()
                assert exc is not None
                _note(f"error: tether worker {w.id} crashed: {_describe_exception(exc)}")
                code = EXIT_ERROR
            try:
                stopped = True
                await w.stop(grace=grace, thread_grace=thread_grace)
            except Exception as exc:
                if code == 0:
                    _note(f"error: tether worker {w.id} failed to stop cleanly: {exc}")
                code = EXIT_ERROR
            serving.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await serving
        finally:
            if not stopped:
                # something after start() raised (e.g. the metrics port is taken): hand
                # the work this worker already holds back, never leave it to asyncio.run's
                # cancellation; the error itself is reported by the caller
                stopped = True
                with contextlib.suppress(Exception):
                    await w.stop(grace=grace, thread_grace=thread_grace)
            if metrics is not None:
                await metrics.stop()
            for sig in installed:
                loop.remove_signal_handler(sig)
    _note(f"tether worker {w.id} stopped")
    if w._left_threads:
        # Python would wait for these threads at exit (it joins them), perhaps forever:
        # the store is closed and their attempts are left to their leases, so exit now
        _note(
            f"tether worker {w.id}: exiting with {len(w._left_threads)} sync activity "
            f"thread(s) still running ({', '.join(w._left_threads)}); each step is retried "
            "by another worker once its lease expires"
        )
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
