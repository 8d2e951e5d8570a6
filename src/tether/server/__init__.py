"""The HTTP service: start, follow and steer runs from any language (``tether serve``).

``create_api(app)`` builds a FastAPI application over a ``tether.App``; ``tether serve
module:app`` runs it on uvicorn. Slow work never runs inside a request: a start
answers ``202 Accepted`` with the run's ``Location`` at once, and clients follow the
run's status resource or wait on its result with a bound. Needs the ``server`` extra:
``pip install 'tether[server]'``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import hashlib
import importlib.util
import json
import math
import signal
import sys
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any

from fastapi import Body, Depends, FastAPI, Header, HTTPException, Path, Query, Request, Response
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field, ValidationError
from starlette.routing import Route

from .. import __version__
from .._app import App
from .._definitions import Workflow
from .._entities import PREFIX as ENTITY_PREFIX
from .._errors import (
    ApprovalNotFoundError,
    ConfigurationError,
    DeadLetterNotFoundError,
    ResultTimeoutError,
    RunIdConflictError,
    RunNotFoundError,
    RunPurgedError,
    TetherError,
    WorkflowFailedError,
)
from .._history import INT64_MAX, REVIEW_STATUSES, Approval, DeadLetter, RunInfo, RunStatus
from .._policy import env_number
from .._tracing import joined
from .._worker import Worker
from ..alerts import AlertWatcher
from ..metrics import Metrics
from ..webhooks import _delivery_id
from . import _problems
from ._auth import AuthError, Principal, actor_of, visible_run
from ._interact import install_interactions
from ._limits import BodyLimit, RateLimiter, authenticate_limited
from ._models import (
    WITHHELD,
    HistoryPage,
    ResultView,
    RunPage,
    RunView,
    event_view,
    input_model,
    links,
    run_view,
    start_model,
)
from ._opening import StoreOpening
from ._relay import WebhookRelay
from ._stream import EventHub, ServerClosing
from .console import install_console
from .console._session import COOKIE as CONSOLE_COOKIE

__all__ = ["create_api"]

#: the longest ``?wait=`` a result request may hold its connection
MAX_WAIT = 60.0
#: the largest request body by default (bytes): big documents go by reference
MAX_BODY = 4 * 1024 * 1024


#: the methods whose bodies the API reads (as JSON)
_WRITES = frozenset({"POST", "PUT", "PATCH"})
#: how often the API looks whether plain uvicorn began to stop (``_notice``)
NOTICE_EVERY = 0.1


def _json_typed(content_type: str | None) -> bool:
    """Whether a request's Content-Type says JSON (or says nothing: read as JSON)."""
    if content_type is None:
        return True
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    )


def _idempotent_run_id(workflow: str, key: str, tenant: str | None) -> str:
    """The run id an ``Idempotency-Key`` stands for (per workflow and tenant: each
    tenant has its own keys). Without a tenant, the id keys were always given."""
    basis = f"{workflow}\0{key}" if tenant is None else f"{workflow}\0{key}\0tenant:{tenant}"
    digest = hashlib.sha256(basis.encode()).hexdigest()[:32]
    return f"idem-{digest}"


def _start_signal_id(key: str) -> str:
    """The id of the signal of a signal-with-start sent with an ``Idempotency-Key``
    (``App.signal``'s ``signal_id``): the same key signals once."""
    return "start-" + hashlib.sha256(key.encode()).hexdigest()[:32]


def _cursor(created_at: float, run_id: str) -> str:
    return base64.urlsafe_b64encode(json.dumps([created_at, run_id]).encode()).decode()


def _uncursor(cursor: str) -> tuple[float, str]:
    try:
        created_at, run_id = json.loads(base64.urlsafe_b64decode(cursor.encode()))
        return float(created_at), str(run_id)
    except (ValueError, TypeError) as exc:
        raise ConfigurationError(
            f"cursor {cursor!r} is not one this API gave out: pass next_cursor as it came"
        ) from exc


#: a dead letter's id in a path: a 64-bit row id (422 beyond, never a store error); ids,
#: positions and step counts in requests are bounded by INT64_MAX the same way
LetterId = Annotated[int, Path(ge=1, le=INT64_MAX)]


class ForkBody(BaseModel):
    """Where to fork a run: the outcomes of its first ``at_step`` steps are reused."""

    at_step: int = Field(ge=0, le=INT64_MAX, description="Steps of the original run to reuse.")
    run_id: str | None = Field(None, description="The new run's id (made up when absent).")
    models: dict[str, str] | None = Field(
        None,
        description="Models to call instead in the fork: {model name: 'provider:name'}.",
    )
    prompts: dict[str, str] | None = Field(
        None,
        description="Prompt versions the fork's later steps render: {prompt name: version}.",
    )


class DecisionBody(BaseModel):
    """A decision on a review; the run checks it before it counts."""

    approve: bool
    by: str = Field(min_length=1, description="Who decides (recorded).")
    fingerprint: str = Field(description="The fingerprint of the proposal reviewed.")
    value: Any = Field(None, description="An edited proposal, when the review allows edits.")
    reason: str | None = None


class Reason(BaseModel):
    """Why an operator acts (recorded with the run)."""

    reason: str | None = None


class StepResult(BaseModel):
    """An activity step's result, confirmed by an operator (recorded and audited)."""

    result: Any = Field(description="The step's return value, as the activity would return it.")
    reason: str = Field(
        min_length=1, max_length=10_000, description="How the result was confirmed."
    )


class Note(BaseModel):
    """What an operator did about a dead letter (stored on it and in the audit log)."""

    note: str = Field(min_length=1, max_length=10_000)


def create_api(
    app: App,
    *,
    workers: int = 0,
    worker_options: dict[str, Any] | None = None,
    grace: float = 30,
    thread_grace: float | None = 60.0,
    auth: bool = True,
    rate_limit: float | None = None,
    max_body: int = MAX_BODY,
    webhook_secret: str | None = None,
    webhook_options: dict[str, Any] | None = None,
    max_wait: float = MAX_WAIT,
    console: bool = True,
) -> FastAPI:
    """The HTTP API of ``app``; with ``workers``, that many in-process workers serve its
    queues while the API runs (stopped, with ``grace`` seconds for in-flight work and
    ``thread_grace`` more for sync activity threads, on shutdown: ``Worker.stop``),
    each made with ``worker_options`` (``app.worker``; a ``worker_id`` names the only
    worker, or ``<worker_id>-1`` ... ``<worker_id>-N`` of ``workers`` N over 1).
    ``auth=False`` serves without API keys (anyone who reaches the port acts as admin:
    only for a private network or a test). ``rate_limit``: requests per second
    per key (429 beyond, with Retry-After); ``max_body``: the largest request body in
    bytes (413 beyond). ``webhook_secret`` signs the outcomes posted to runs' callback
    URLs (the relay runs only with one; ``webhook_options`` tune its retries).
    ``max_wait``: the longest a ``/result?wait=`` request holds its connection.
    ``console``: serve the operator console at ``/`` (same keys, in a cookie)."""
    running: list[Worker] = []
    hub = EventHub(app)
    relay = WebhookRelay(app, webhook_secret, **(webhook_options or {})) if webhook_secret else None
    limiter = RateLimiter(rate_limit) if rate_limit else None

    async def who(request: Request, authorization: Annotated[str | None, Header()] = None) -> None:
        """Authenticate (while keys are required) and rate-limit every ``/v1`` request;
        while the store is not open yet, any request that needs it is a 503."""
        if not opening.ready and request.url.path not in _WITHOUT_STORE:
            opening.check()  # (the database was down when the service started)
        if not request.url.path.startswith("/v1/"):
            request.state.principal = None
            return  # health checks and the OpenAPI document are open
        if auth and authorization is None and request.method == "GET":
            # the console's browser follows event streams with its session cookie
            # (SameSite=Strict: never sent by another site); only for reads
            cookie = request.cookies.get(CONSOLE_COOKIE)
            authorization = f"Bearer {cookie}" if cookie else None
        client = request.client.host if request.client else "?"
        principal = (
            await authenticate_limited(app.store, authorization, limiter, client) if auth else None
        )
        request.state.principal = principal
        ctype = request.headers.get("content-type")
        # a body the routes would take as raw bytes
        if request.method in _WRITES and not _json_typed(ctype) and await request.body():
            raise HTTPException(
                415,
                f"the body is sent as {ctype!r}; send it as "
                "JSON with Content-Type: application/json (curl: add -H "
                "'Content-Type: application/json' to -d)",
            )
        if limiter is not None:
            wait = limiter.take(principal.key_id if principal else f"addr:{client}")
            if wait:
                raise AuthError(
                    429,
                    "Too many requests",
                    f"this key is limited to {limiter.rate:g} requests/s; "
                    f"retry after {math.ceil(wait)} s",
                    retry_after=math.ceil(wait),
                )

    def may(request: Request, role: str, action: str) -> Principal | None:
        """The caller, if its key's role allows ``action`` (403 otherwise)."""
        principal: Principal | None = request.state.principal
        if principal is not None:
            principal.require(role, action)
        return principal

    def unbound(request: Request, action: str) -> Principal | None:
        """The caller, if it is an admin key bound to no tenant (403 otherwise): what
        belongs to no tenant (switches, the global audit log, schedules, entities)."""
        principal = may(request, "admin", action)
        if principal is not None and principal.tenant is not None:
            raise AuthError(
                403,
                "Admin key for every tenant required",
                f"{action} needs an admin key not bound to a tenant "
                f"(this key acts for {principal.tenant!r})",
            )
        return principal

    def shows(request: Request) -> bool:
        """Whether the caller may see payloads (a ``monitor`` key may not)."""
        principal: Principal | None = request.state.principal
        return principal is None or principal.sees_payloads

    def scope(request: Request) -> str | None:
        """The tenant the caller's queries are limited to (None: every tenant)."""
        principal: Principal | None = request.state.principal
        return principal.tenant if principal is not None else None

    async def audit(
        request: Request, action: str, target: str, detail: dict[str, Any] | None = None
    ) -> None:
        """Record who did ``action`` (after it succeeded)."""
        await app.store.audit(actor_of(request.state.principal, "api"), action, target, detail)

    async def visible(request: Request, run_id: str, *, follow: bool = True) -> RunInfo:
        """The run, if the caller may see it (a tenant's key: only that tenant's runs)."""
        return await visible_run(app, request.state.principal, run_id, follow=follow)

    metrics = Metrics(app, running) if importlib.util.find_spec("prometheus_client") else None
    # read when the API is built, so a bad value is one line before the server starts
    alert_interval = env_number("TETHER_ALERT_INTERVAL", 30.0, least=0.1)

    stopping: list[asyncio.Future[Any]] = []
    #: sync activities whose threads the workers' stop left running ("<name> of run <id>")
    left_threads: list[str] = []

    def begin_shutdown() -> None:
        """The server begins to stop (on its loop, before it waits for connections to
        close): event streams end now, their clients reconnect elsewhere; the workers
        stop claiming and in-flight work has ``grace`` seconds from now."""
        hub.close()
        if not stopping:
            stopping.append(
                asyncio.gather(*(w.stop(grace=grace, thread_grace=thread_grace) for w in running))
            )

    #: what ``begin_serving`` started (of this lifespan)
    began: set[str] = set()
    watchers: list[AlertWatcher] = []

    async def begin_serving() -> None:
        """Start what needs the store, once it is open; called again after a
        ``StoreError``, it goes on from what it had not started. Nothing more starts
        once the server began to stop."""
        if stopping:
            return
        if "hub" not in began:
            hub.start()
            began.add("hub")
        if relay is not None and "relay" not in began:
            relay.start()
            began.add("relay")
        while len(running) < workers and not stopping:
            options = dict(worker_options or {})
            if workers > 1 and options.get("worker_id") is not None:  # one id each
                options["worker_id"] = f"{options['worker_id']}-{len(running) + 1}"
            w = app.worker(**options)
            await w.start()
            running.append(w)
            if stopping:  # the server began to stop while this one started
                await w.stop(grace=grace, thread_grace=thread_grace)
        if metrics is not None and "metrics" not in began:
            await metrics.update()
            metrics.start()
            began.add("metrics")
        if not watchers:
            # the conditions of tether.alerts, told to the App's on_alert hook (or the log)
            watchers.append(AlertWatcher(app, interval=alert_interval))
            watchers[0].start()

    def cannot_serve() -> None:
        """The store opened in the background but the service could not start: stop."""
        api.state.start_failed = True
        server = _uvicorn_server()
        if server is not None:
            server.should_exit = True

    opening = StoreOpening(app, begin_serving, cannot_serve)

    @contextlib.asynccontextmanager
    async def lifespan(_api: FastAPI) -> AsyncIterator[None]:
        began.clear()
        try:
            await opening.start()  # or, while the database is down, in the background
        except Exception as exc:
            api.state.start_error = exc  # ``tether serve`` says it in one line
            raise
        # served by plain uvicorn (``uvicorn module:api``, not ``tether serve``), nothing
        # tells the API the server begins to stop: uvicorn waits for open connections
        # first, so an open event stream would hold it (and this shutdown) for ever
        server = _uvicorn_server()
        noticing = None if server is None else asyncio.create_task(_notice(server, begin_shutdown))
        try:
            yield
        finally:
            if noticing is not None:
                noticing.cancel()
            begin_shutdown()  # (done already when the server began to stop)
            await opening.stop()
            for watcher in watchers:
                await watcher.stop()
            watchers.clear()
            if metrics is not None:
                await metrics.stop()
            if "hub" in began:
                hub.stop()
            if relay is not None and "relay" in began:
                await relay.stop()
            await stopping.pop()
            for w in running:  # threads a stop left running: the process exits only after
                left_threads.extend(w._left_threads)
            running.clear()
            await app.close()

    api = FastAPI(
        title="tether",
        version=__version__,
        description="Start, follow and steer durable workflow runs.",
        lifespan=lifespan,
        dependencies=[Depends(who)],
    )
    _problems.install(api)
    api.add_middleware(BodyLimit, max_bytes=max_body)
    # outermost: a request uvicorn cancels when --grace runs out gets a 503, not a 500
    api.add_middleware(_problems.CutOffAtStop, stopping=lambda: hub.closing)
    api.state.relay = relay
    api.state.hub = hub
    #: ``tether serve`` calls it when uvicorn begins a graceful shutdown
    api.state.begin_shutdown = begin_shutdown
    api.state.left_threads = left_threads
    api.state.start_failed = False
    #: why the start failed (the store could not be opened...), or None
    api.state.start_error = None
    if console:
        install_console(api, app, auth=auth, limiter=limiter)

    @api.get(
        "/metrics",
        summary="Prometheus metrics (a key of any role bound to no tenant, when keys are required)",
        tags=["health"],
        response_class=Response,
    )
    async def prometheus(request: Request) -> Response:
        if auth:
            client = request.client.host if request.client else "?"
            principal = await authenticate_limited(
                app.store, request.headers.get("authorization"), limiter, client
            )
            if principal.tenant is not None:  # the figures name every tenant
                raise AuthError(
                    403,
                    "Key for every tenant required",
                    "the metrics cover every tenant (their names, runs and model spend): "
                    f"scrape with a key bound to no tenant (this key acts for "
                    f"{principal.tenant!r}; a monitor key is enough)",
                )
        if metrics is None:
            return _problems.problem(
                501, "Metrics need prometheus-client", "pip install 'tether[server]'"
            )
        return Response(metrics.exposition(), media_type="text/plain; version=0.0.4")

    @api.get("/healthz", summary="The process is up", tags=["health"])
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @api.get(
        "/readyz",
        summary="The store answers and its schema is this version's",
        tags=["health"],
        responses={503: {"description": "the store does not answer"}},
    )
    async def readyz() -> JSONResponse:
        if opening.failure is not None:  # (waiting will not mend it)
            return _not_ready(
                f"the store cannot be opened: {opening.failure}; see the service's log",
                "Store cannot be opened",
            )
        if not opening.ready:
            return _not_ready("the store could not be opened yet: see the service's log")
        try:
            await asyncio.wait_for(app.store.get_run("-readyz-"), 5)
        except Exception as exc:  # any failure to answer is "not ready"
            # the store's message names its URL: the log gets it, not an anonymous caller
            _problems.log.warning("not ready: the store did not answer: %s", exc)
            return _not_ready(
                f"the store did not answer ({type(exc).__name__}): see the service's log"
            )
        return JSONResponse({"status": "ready", "workers": len(running)})

    # entities are reached through /v1/entities, not started as runs
    startable = [wf for wf in app._workflows.values() if not wf.name.startswith(ENTITY_PREFIX)]
    for wf in startable:
        _add_start_route(api, app, wf, who)

    @api.get("/v1/workflows", summary="The workflows this service starts, with input schemas")
    async def list_workflows() -> list[dict[str, Any]]:
        return [
            {
                "name": wf.name,
                "version": wf.version,
                "queue": wf.queue,
                "input_schema": input_model(wf).model_json_schema(),
                "start": f"/v1/workflows/{wf.name}/runs",
            }
            for wf in startable
        ]

    @api.post("/v1/workflows/{name}/runs", include_in_schema=False)
    async def start_unknown(name: str) -> None:
        """A workflow this service does not start (its own are matched first)."""
        known = ", ".join(sorted(wf.name for wf in startable)) or "none"
        raise HTTPException(
            404, f"this service starts no workflow {name!r} (it starts: {known}; GET /v1/workflows)"
        )

    @api.get("/v1/runs/{run_id:path}", summary="A run's status resource", response_model=RunView)
    async def get_run(run_id: str, request: Request) -> RunView:
        return run_view(await visible(request, run_id), shows(request))

    @api.get(
        "/v1/runs/{run_id:path}/result",
        summary="Wait up to `wait` seconds for the run's outcome (202 + Retry-After if not yet)",
        response_model=ResultView,
        responses={202: {"description": "still running: ask again after Retry-After"}},
    )
    async def get_result(
        run_id: str,
        request: Request,
        response: Response,
        wait: Annotated[float, Query(ge=0)] = 0,
    ) -> ResultView:
        await visible(request, run_id)
        try:
            waited = app.get_run(run_id).result(timeout=min(wait, max_wait) or 0.001)
            await (hub.unless_closing(waited) if wait else waited)
        except RunPurgedError:  # purged while waited on: as visible() answers it
            principal: Principal | None = request.state.principal
            if principal is not None and principal.tenant is not None:
                raise RunNotFoundError(run_id) from None
            raise
        except (ResultTimeoutError, ServerClosing):  # not yet (or the server stops): again
            info = await app._peek(run_id)
            response.status_code = 202
            response.headers["Retry-After"] = "1" if wait < 1 else "2"
            return ResultView(id=info.run_id, status=info.status.value)
        except WorkflowFailedError:
            pass
        info = await app.get(run_id)
        view = run_view(info, shows(request))
        return ResultView(id=info.run_id, status=view.status, result=view.result, error=view.error)

    @api.get(
        "/v1/runs/{run_id:path}/history",
        summary="A run's events, paged",
        response_model=HistoryPage,
    )
    async def get_history(
        run_id: str,
        request: Request,
        after: Annotated[int, Query(ge=0, le=INT64_MAX)] = 0,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    ) -> HistoryPage:
        info = await visible(request, run_id, follow=False)
        events = await app.store.read_history(info.run_id, after)
        page = events[:limit]
        more = len(events) > limit
        return HistoryPage(
            run_id=info.run_id,
            events=[event_view(e, shows(request)) for e in page],
            next_after=page[-1].seq if page and more else None,
        )

    @api.get(
        "/v1/runs", summary="Runs, newest first, filtered; cursor paging", response_model=RunPage
    )
    async def list_runs(
        request: Request,
        workflow: str | None = None,
        status: RunStatus | None = None,
        waiting_for: str | None = None,
        tenant: str | None = None,
        age: Annotated[
            float | None, Query(gt=0, description="only runs created in the last AGE seconds")
        ] = None,
        error_type: Annotated[
            str | None, Query(description="only runs whose error (or its cause) has this type")
        ] = None,
        stuck: Annotated[
            bool, Query(description="only live runs that cannot move on (task_error set)")
        ] = False,
        limit: Annotated[int, Query(ge=1, le=500)] = 50,
        cursor: str | None = None,
    ) -> RunPage:
        before = _uncursor(cursor) if cursor else None
        mine = scope(request)
        if mine is not None and tenant not in (None, mine):
            return RunPage(runs=[], next_cursor=None)  # another tenant has no runs for it
        infos = await app.list(
            tenant=mine or tenant,
            workflow=workflow,
            status=status,
            waiting_for=waiting_for,
            limit=limit + 1,
            before=before,
            since=app.store.clock() - age if age else None,
            error_type=error_type,
            stuck=stuck,
        )
        page = infos[:limit]
        nxt = _cursor(page[-1].created_at, page[-1].run_id) if len(infos) > limit else None
        return RunPage(runs=[run_view(i, shows(request)) for i in page], next_cursor=nxt)

    @api.get(
        "/v1/runs/{run_id:path}/events",
        summary="A run's events as Server-Sent Events (resumable with Last-Event-ID)",
        response_class=StreamingResponse,
    )
    async def stream_events(
        run_id: str,
        request: Request,
        last_event_id: Annotated[str | None, Header()] = None,
        after: Annotated[int, Query(ge=0, le=INT64_MAX)] = 0,
    ) -> StreamingResponse:
        info = await visible(request, run_id, follow=False)  # 404 before the stream starts
        start = after
        if last_event_id:
            if not (last_event_id.isascii() and last_event_id.isdigit()):
                raise ConfigurationError(
                    f"Last-Event-ID {last_event_id[:40]!r} is not an event's id (a seq, "
                    "0-9 only): send back the id of the last event received"
                )
            start = min(int(last_event_id), INT64_MAX)  # a resumed stream's last seq
        return StreamingResponse(
            hub.stream(info.run_id, start, request, shows(request)),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    @api.post("/v1/runs/{run_id:path}/signals/{name}", status_code=202, summary="Send a signal")
    async def send_signal(
        run_id: str,
        name: str,
        request: Request,
        response: Response,
        payload: Annotated[Any, Body()] = None,
        idempotency_key: Annotated[str | None, Header()] = None,
    ) -> dict[str, Any]:
        await visible(request, run_id)  # (first: another tenant's run is not there at all)
        may(request, "operate", "signal")
        # a retry with the same Idempotency-Key is the same signal: recorded once (a 200
        # for the repeat, as for a repeated start)
        new = await app.signal(run_id, name, payload, signal_id=idempotency_key or None)
        if new:
            await audit(request, "signal", f"run:{run_id}", {"signal": name})
        else:
            response.status_code = 200
        return {
            "id": run_id,
            "signal": name,
            "accepted": True,
            "duplicate": not new,
            "links": links(run_id),
        }

    install_interactions(
        api,
        app,
        visible=visible,
        may=may,
        unbound=unbound,
        audit=audit,
        max_wait=max_wait,
        hub=hub,
    )

    for action, role in (
        ("cancel", "operate"),
        ("suspend", "operate"),
        ("resume", "operate"),
        ("terminate", "admin"),
    ):
        _add_action(api, app, action, role, visible, may, audit)

    @api.post(
        "/v1/runs/{run_id:path}/fork",
        status_code=202,
        summary="Start a new run reusing a run's first recorded steps, the rest with today's code",
    )
    async def fork(run_id: str, body: ForkBody, request: Request, response: Response) -> RunView:
        await visible(request, run_id)
        may(request, "admin", "fork")
        new = await app.fork(
            run_id,
            at_step=body.at_step,
            new_run_id=body.run_id,
            models=body.models,
            prompts=body.prompts,
        )
        detail = {"at_step": body.at_step, "new": new.run_id}
        detail.update({k: v for k, v in (("models", body.models), ("prompts", body.prompts)) if v})
        await audit(request, "fork", f"run:{run_id}", detail)
        response.headers["Location"] = links(new.run_id).self
        return run_view(await app._peek(new.run_id))

    async def review_of(request: Request, approval_id: str) -> Approval:
        """The review, if the caller may see its run."""
        review = await app.get_approval(approval_id)
        principal: Principal | None = request.state.principal
        if principal is not None and not principal.sees(review.tenant):
            raise ApprovalNotFoundError(approval_id, "no such review")
        return review

    @api.get("/v1/approvals", summary="Reviews opened by tether.approval (open ones by default)")
    async def list_approvals(
        request: Request,
        status: str = "open",
        approver: str | None = None,
        run_id: str | None = None,
        limit: Annotated[int, Query(ge=1, le=500)] = 100,
    ) -> list[dict[str, Any]]:
        if status not in _REVIEW_STATUSES:
            raise ConfigurationError(
                f"status {status[:40]!r} is not a review's status: one of "
                + ", ".join(_REVIEW_STATUSES)
            )
        reviews = await app.approvals(
            status=None if status == "all" else status,
            approver=approver,
            run_id=run_id,
            tenant=scope(request),
            limit=limit,
        )
        return [
            _shown(dataclasses.asdict(r), shows(request), "proposal", "reason") for r in reviews
        ]

    @api.get("/v1/approvals/{approval_id}", summary="One review, with its proposal and fingerprint")
    async def get_approval(approval_id: str, request: Request) -> dict[str, Any]:
        review = dataclasses.asdict(await review_of(request, approval_id))
        return _shown(review, shows(request), "proposal", "reason")

    @api.post(
        "/v1/approvals/{approval_id}/decision",
        status_code=202,
        summary="Approve or reject a review, naming the fingerprint of the proposal reviewed",
    )
    async def decide(approval_id: str, body: DecisionBody, request: Request) -> dict[str, Any]:
        review = await review_of(request, approval_id)
        may(request, "operate", "deciding a review")
        await app.decide(
            approval_id,
            approve=body.approve,
            by=body.by,
            fingerprint=body.fingerprint,
            value=body.value,
            reason=body.reason,
        )
        await audit(
            request,
            "decide",
            f"run:{review.run_id}",
            {"approval_id": approval_id, "approve": body.approve, "by": body.by},
        )
        return {"approval_id": approval_id, "accepted": True, "links": links(review.run_id)}

    @api.post(
        "/v1/runs/{run_id:path}/retry",
        status_code=202,
        summary="Retry a failed run from its failed step",
    )
    async def retry(run_id: str, request: Request) -> RunView:
        await visible(request, run_id)
        may(request, "operate", "retry")
        await app.retry(run_id)
        await audit(request, "retry", f"run:{run_id}")
        return run_view(await app._peek(run_id))

    @api.post(
        "/v1/runs/{run_id:path}/steps/{step}/complete",
        status_code=202,
        summary="Record an activity step's result without running it (admin, audited)",
    )
    async def complete_step(
        run_id: str,
        step: Annotated[int, Path(ge=1, le=INT64_MAX)],
        body: StepResult,
        request: Request,
    ) -> RunView:
        await visible(request, run_id, follow=False)
        principal = may(request, "admin", "completing a step")
        # the result, the run's reopening and the audit entry are one write
        await app.complete_step(
            run_id, step, body.result, reason=body.reason, by=actor_of(principal, "api")
        )
        return run_view(await app._peek(run_id, follow=False))

    @api.get(
        "/v1/switches",
        summary="Kill switches that are off (a tenant's key: its own tenant's switch only)",
    )
    async def list_switches(request: Request) -> list[dict[str, Any]]:
        mine = scope(request)
        return [
            _shown(s, shows(request), "reason")
            for s in await app.switches()
            if mine is None or (s["kind"] == "tenant" and s["name"] == mine)
        ]

    @api.put(
        "/v1/switches/{kind}/{name:path}",
        summary="Switch a workflow, activity, model or tenant off for every worker (admin)",
    )
    async def switch_off(
        kind: str, name: str, request: Request, body: Reason | None = None
    ) -> dict[str, Any]:
        principal = unbound(request, "switching off")
        changed = await app.disable(
            kind, name, reason=body.reason if body else None, by=actor_of(principal, "api")
        )
        return {"kind": kind, "name": name, "off": True, "changed": changed}

    @api.delete("/v1/switches/{kind}/{name:path}", summary="Switch it back on (admin)")
    async def switch_on(kind: str, name: str, request: Request) -> dict[str, Any]:
        principal = unbound(request, "switching on")
        changed = await app.enable(kind, name, by=actor_of(principal, "api"))
        return {"kind": kind, "name": name, "off": False, "changed": changed}

    @api.get("/v1/audit", summary="Who did what, newest first (admin)")
    async def audit_log(
        request: Request,
        target: str | None = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    ) -> list[dict[str, Any]]:
        unbound(request, "reading the audit log")
        return await app.audit_log(target=target, limit=limit)

    @api.get(
        "/v1/runs/{run_id:path}/audit", summary="Who started and acted on the run, oldest first"
    )
    async def run_audit(run_id: str, request: Request) -> list[dict[str, Any]]:
        await visible(request, run_id, follow=False)
        may(request, "read", "reading a run's audit trail")
        return await app.audit(run_id)

    @api.get(
        "/v1/runs/{run_id:path}/webhooks",
        summary="The run's webhook deliveries: state, attempts, last error",
    )
    async def run_webhooks(run_id: str, request: Request) -> list[dict[str, Any]]:
        info = await visible(request, run_id, follow=False)
        rows = await app.store.webhook_deliveries(run_id=info.run_id)
        return [_delivery(r) for r in rows]

    async def letter_of(request: Request, letter_id: int) -> DeadLetter:
        letters = await app.dead_letters(include_resolved=True, letter_id=letter_id, limit=1)
        if not letters:
            raise DeadLetterNotFoundError(letter_id)
        try:
            await visible(request, letters[0].run_id, follow=False)
        except (RunNotFoundError, RunPurgedError):
            # another tenant's letter is as missing as one that never was
            raise DeadLetterNotFoundError(letter_id) from None
        return letters[0]

    @api.get("/v1/dead-letters", summary="Steps and runs that exhausted their failure policy")
    async def list_dead_letters(
        request: Request,
        include_resolved: bool = False,
        run_id: str | None = None,
        limit: Annotated[int, Query(ge=1, le=500)] = 100,
    ) -> list[dict[str, Any]]:
        letters = await app.dead_letters(
            include_resolved=include_resolved, run_id=run_id, limit=limit, tenant=scope(request)
        )
        return [
            _shown(dataclasses.asdict(d), shows(request), "input", "error", "resolution")
            for d in letters
        ]

    @api.get("/v1/dead-letters/{letter_id}", summary="One dead letter, with its input and error")
    async def get_dead_letter(letter_id: LetterId, request: Request) -> dict[str, Any]:
        letter = dataclasses.asdict(await letter_of(request, letter_id))
        return _shown(letter, shows(request), "input", "error", "resolution")

    @api.post(
        "/v1/dead-letters/{letter_id}/replay",
        summary="Run a dead letter's step again with today's code; its outcome resolves it",
    )
    async def replay_dead_letter(
        letter_id: LetterId, request: Request, force: bool = False
    ) -> dict[str, Any]:
        await letter_of(request, letter_id)
        may(request, "operate", "replaying a dead letter")
        outcome = await app.replay_dead_letter(letter_id, force=force)
        letter = await letter_of(request, letter_id)
        detail: dict[str, Any] = {"letter": letter_id, **({"force": True} if force else {})}
        await audit(request, "replay dead letter", f"run:{letter.run_id}", detail)
        return {"id": letter_id, "replayed": True, "outcome": jsonable_encoder(outcome)}

    @api.post(
        "/v1/dead-letters/{letter_id}/resolve",
        summary="Close a dead letter with a note, running nothing (audited)",
    )
    async def resolve_dead_letter(
        letter_id: LetterId, body: Note, request: Request
    ) -> dict[str, Any]:
        await letter_of(request, letter_id)
        may(request, "operate", "resolving a dead letter")
        by = actor_of(request.state.principal, "api")
        letter = await app.resolve_dead_letter(letter_id, note=body.note, by=by)
        return _shown(dataclasses.asdict(letter), shows(request), "input", "error", "resolution")

    longest_suffix_first(api, "/v1/runs/{run_id:path}")
    longest_suffix_first(api, "/runs/{run_id:path}")  # the console's
    return api


def longest_suffix_first(api: FastAPI, prefix: str) -> None:
    """Order the routes under ``prefix`` (a ``{run_id:path}``: a child's id holds a
    slash, ``parent/1``) so that the one with the most segments after the run id is
    tried first: ``/v1/runs/a/1/history`` is run ``a/1``'s history, not run
    ``a/1/history``, and ``/signals/{name}`` wins over a one-segment suffix."""
    routes = api.router.routes
    places = [i for i, r in enumerate(routes) if getattr(r, "path", "").startswith(prefix)]
    ordered = sorted((routes[i] for i in places), key=lambda r: -getattr(r, "path", "").count("/"))
    for i, route in zip(places, ordered, strict=True):
        routes[i] = route


#: the routes that answer without the store (served before it could be opened)
_WITHOUT_STORE = frozenset({"/healthz", "/readyz"})


def _not_ready(detail: str, title: str = "Store not ready") -> JSONResponse:
    """``/readyz``'s 503, with the ``Retry-After`` every 503 of the store has."""
    response = _problems.problem(503, title, detail)
    response.headers["Retry-After"] = str(_problems.STORE_RETRY_AFTER)
    return response


def _uvicorn_server() -> Any:
    """The ``uvicorn.Server`` serving this process, or None: found by the handler it
    installs for SIGTERM and SIGINT while it serves (uvicorn 0.29 and later always use
    ``signal.signal``, on the main thread: ``uvicorn module:api``, ``uvicorn.run``)."""
    uvicorn = sys.modules.get("uvicorn")  # not imported: not what serves this process
    if uvicorn is None:
        return None
    for sig in (signal.SIGTERM, signal.SIGINT):
        owner = getattr(signal.getsignal(sig), "__self__", None)
        if isinstance(owner, uvicorn.Server):
            return owner
    return None


async def _notice(server: Any, begin: Callable[[], None]) -> None:
    """Call ``begin`` once ``server`` begins to stop (a signal sets ``should_exit``;
    uvicorn waits for open connections next): event streams end, the workers stop."""
    while not (server.should_exit or server.force_exit):  # noqa: ASYNC110 (plain flags)
        await asyncio.sleep(NOTICE_EVERY)
    begin()


def _unseen_run_id(run_id: str | None) -> JSONResponse:
    """The answer to a start naming a run id this key may not see (another tenant's,
    live or purged): it is taken, and nothing more."""
    return _problems.problem(
        409,
        "Run id already used",
        f"run id {run_id!r} is already used by a run this key cannot see: pick a new run id",
    )


#: what ``GET /v1/approvals?status=`` takes (``all``: every review)
_REVIEW_STATUSES = (*REVIEW_STATUSES, "all")


def _shown(item: dict[str, Any], payloads: bool, *keys: str) -> dict[str, Any]:
    """``item`` with ``keys`` withheld unless the caller may see payloads."""
    if payloads:
        return item
    return {k: WITHHELD if k in keys and v is not None else v for k, v in item.items()}


def _delivery(row: tuple[Any, ...]) -> dict[str, Any]:
    """A webhook delivery row as the API shows it."""
    return {
        "delivery_id": _delivery_id(row[1], row[0]),  # the webhook-id header
        "url": row[2],
        "status": row[4],
        "attempts": row[9],
        "state": row[10],
        "last_error": row[11],
        "next_at": row[12] if row[10] == "pending" else None,
        "delivered_at": row[13],
        "created_at": row[14],
    }


def _add_start_route(api: FastAPI, app: App, wf: Workflow[Any, Any], who: Any) -> None:
    """``POST /v1/workflows/{name}/runs`` for one workflow, its body typed by its input."""
    body_model = start_model(wf)

    async def start(
        body: body_model,  # type: ignore[valid-type]
        request: Request,
        response: Response,
        idempotency_key: Annotated[str | None, Header()] = None,
    ) -> JSONResponse:
        data = body.model_dump()  # type: ignore[attr-defined]
        principal: Principal | None = request.state.principal
        if principal is not None:
            principal.require("operate", "starting a run")
        if principal is not None and principal.tenant is not None:
            if data.get("tenant") not in (None, principal.tenant):
                raise AuthError(
                    403, "Another tenant", f"this key starts runs for {principal.tenant!r} only"
                )
            data["tenant"] = principal.tenant
        if data.get("callback_url") and api.state.relay is None:
            return _problems.problem(
                422,
                "Webhooks are not configured",
                "this service has no webhook signing secret, so callback_url would never be "
                "posted; start tether serve with --webhook-secret (or TETHER_WEBHOOK_SECRET)",
            )
        kwargs = dict(body.input)  # type: ignore[attr-defined]
        run_id = data.get("run_id")
        if run_id is None and idempotency_key:
            run_id = _idempotent_run_id(wf.name, idempotency_key, data.get("tenant"))
        try:
            run = await app.start(
                wf,
                kwargs=kwargs,
                run_id=run_id,
                deadline=data.get("deadline"),
                tenant=data.get("tenant"),
                webhook=data.get("callback_url"),
                by=actor_of(principal, "api"),
                if_running=data.get("if_running"),
                on_limit=data.get("on_limit") or "raise",
                signal=None
                if data.get("signal") is None
                else (data["signal"]["name"], data["signal"].get("payload")),
                # a retried signal-with-start signals once
                signal_id=_start_signal_id(idempotency_key)
                if idempotency_key and data.get("signal") is not None
                else None,
            )
        except RunPurgedError:
            if principal is not None and principal.tenant is not None:
                # whose the purged run was (and when it went) is not this key's to know:
                # answered as a live run of another tenant is
                return _unseen_run_id(run_id)
            raise
        except RunIdConflictError as exc:
            assert run_id is not None
            if idempotency_key and data.get("run_id") is None:
                if data.get("if_running") == "reject":  # refused to join, whatever the body
                    return _problems.problem(
                        409,
                        "Idempotency-Key already used",
                        f"Idempotency-Key {idempotency_key!r} already started run {run_id} of "
                        f"{wf.name!r}, and if_running='reject' refuses to join it",
                    )
                # the body's fields that differ (their values are not repeated)
                differ = [_BODY_FIELD.get(f, f) for f in exc.fields] or ["input"]
                return _problems.problem(
                    409,
                    "Idempotency-Key reused with another body",
                    f"Idempotency-Key {idempotency_key!r} already started run {run_id} of "
                    f"{wf.name!r} with other {', '.join(differ)}; a retry sends the same "
                    "body: use a new key for a new request",
                )
            if not await _seen_by(app, principal, run_id):
                # another tenant's run: this key learns nothing of it (tenant, workflow,
                # status), and nothing reaches it
                return _unseen_run_id(run_id)
            raise
        info = run.started or await app._peek(run.run_id, follow=False)
        where = links(info.run_id)  # the id percent-encoded: a header is Latin-1 only
        return JSONResponse(
            {"id": info.run_id, "status": info.status.value, "links": where.model_dump()},
            status_code=200 if run.created is False else 202,
            headers={"Location": where.self},
        )

    # this module uses postponed annotations; FastAPI reads the body's type from here
    start.__annotations__ = {
        "body": body_model,
        "request": Request,
        "response": Response,
        "idempotency_key": Annotated[str | None, Header()],
        "return": JSONResponse,
    }
    api.add_api_route(
        f"/v1/workflows/{wf.name}/runs",
        start,
        methods=["POST"],
        status_code=202,
        summary=f"Start a run of {wf.name}",
        responses={
            202: {"description": "started: follow Location"},
            200: {"description": "the run this Idempotency-Key or run id already started"},
            409: {"description": "the key or run id was used with other input"},
        },
        name=f"start_{wf.name}",
    )

    async def fast_start(request: Request) -> Response:
        """The same start without FastAPI's per-request dependency solving (the hot
        path of the service): authenticate, validate the body with its model, start."""
        await who(request, request.headers.get("authorization"))
        try:
            body = body_model.model_validate_json(await request.body() or b"null")
        except ValidationError as exc:
            errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]
            raise RequestValidationError(errors) from None
        with joined(request.headers):  # a caller's traceparent: the run joins it
            return await start(body, request, Response(), request.headers.get("idempotency-key"))

    # served by this route, documented by the one above (routes match in order)
    api.router.routes.insert(
        0, Route(f"/v1/workflows/{wf.name}/runs", fast_start, methods=["POST"])
    )


#: a start's field as the request body names it (``RunIdConflictError.fields``)
_BODY_FIELD = {"webhook": "callback_url"}


async def _seen_by(app: App, principal: Principal | None, run_id: str) -> bool:
    """Whether the run ``run_id`` (which exists, or did) is one ``principal`` may see."""
    if principal is None or principal.tenant is None:
        return True
    try:
        info = await app._peek(run_id, follow=False)
    except TetherError:  # purged (or gone): whose it was is not this key's to know
        return False
    return principal.sees(info.tenant)


def _add_action(
    api: FastAPI, app: App, action: str, role: str, visible: Any, may: Any, audit: Any
) -> None:
    """``POST /v1/runs/{id}/<action>`` for keys of ``role`` or above; cancel and
    terminate take ``{"reason": ...}``."""
    reasoned = action in ("cancel", "terminate")

    async def act(run_id: str, request: Request, body: Reason | None = None) -> RunView:
        await visible(request, run_id)
        may(request, role, action)
        method = getattr(app, action)
        await (method(run_id, body.reason if body else None) if reasoned else method(run_id))
        await audit(request, action, f"run:{run_id}", {"reason": body.reason} if body else None)
        return run_view(await app._peek(run_id))

    api.add_api_route(
        f"/v1/runs/{{run_id:path}}/{action}",
        act,
        methods=["POST"],
        status_code=202,
        summary=f"{action.title()} a run",
        name=action,
        response_model=RunView,
    )
