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
import json
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import Body, Depends, FastAPI, Header, Query, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field

from .. import __version__
from .._app import App
from .._definitions import Workflow
from .._errors import (
    ApprovalNotFoundError,
    ConfigurationError,
    ResultTimeoutError,
    RunIdConflictError,
    RunNotFoundError,
    TetherError,
    WorkflowFailedError,
)
from .._history import Approval, RunInfo, RunStatus
from .._worker import Worker
from . import _problems
from ._auth import AuthError, Principal, authenticate
from ._models import (
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

__all__ = ["create_api"]

#: the longest ``?wait=`` a result request may hold its connection
MAX_WAIT = 60.0


def _idempotent_run_id(workflow: str, key: str) -> str:
    """The run id an ``Idempotency-Key`` stands for (per workflow)."""
    digest = hashlib.sha256(f"{workflow}\0{key}".encode()).hexdigest()[:32]
    return f"idem-{digest}"


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


class ForkBody(BaseModel):
    """Where to fork a run: the outcomes of its first ``at_step`` steps are reused."""

    at_step: int = Field(ge=0, description="Steps of the original run to reuse.")
    run_id: str | None = Field(None, description="The new run's id (made up when absent).")


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


def create_api(
    app: App,
    *,
    workers: int = 0,
    worker_options: dict[str, Any] | None = None,
    grace: float = 30,
    auth: bool | None = None,
) -> FastAPI:
    """The HTTP API of ``app``; with ``workers``, that many in-process workers serve its
    queues while the API runs (stopped, with ``grace`` seconds for in-flight work, on
    shutdown). ``auth``: require API keys (True), never (False), or when the store has
    a live key at start-up (None, the default)."""
    running: list[Worker] = []
    required = {"auth": bool(auth)}

    async def who(request: Request, authorization: Annotated[str | None, Header()] = None) -> None:
        """Authenticate every ``/v1`` request while keys are required."""
        request.state.principal = (
            await authenticate(app.store, authorization) if required["auth"] else None
        )

    async def visible(request: Request, run_id: str, *, follow: bool = True) -> RunInfo:
        """The run, if the caller may see it (a client key: only its tenant's runs)."""
        info = await app.get(run_id, follow=follow)
        principal: Principal | None = request.state.principal
        if principal is not None and not principal.admin and info.tenant != principal.tenant:
            raise RunNotFoundError(run_id)  # another tenant's run does not exist for it
        return info

    def admin_only(request: Request, action: str) -> None:
        principal: Principal | None = request.state.principal
        if principal is not None and not principal.admin:
            raise AuthError(403, "Admin key required", f"{action} needs an admin key")

    @contextlib.asynccontextmanager
    async def lifespan(_api: FastAPI) -> AsyncIterator[None]:
        if auth is None:
            required["auth"] = await app.store.has_api_keys()
        for _ in range(workers):
            w = app.worker(**(worker_options or {}))
            await w.start()
            running.append(w)
        try:
            yield
        finally:
            await asyncio.gather(*(w.stop(grace=grace) for w in running))
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

    for wf in app._workflows.values():
        _add_start_route(api, app, wf)

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
            for wf in app._workflows.values()
        ]

    @api.get("/v1/runs/{run_id}", summary="A run's status resource", response_model=RunView)
    async def get_run(run_id: str, request: Request) -> RunView:
        return run_view(await visible(request, run_id))

    @api.get(
        "/v1/runs/{run_id}/result",
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
            await app.get_run(run_id).result(timeout=min(wait, MAX_WAIT) or 0.001)
        except ResultTimeoutError:
            info = await app.get(run_id)
            response.status_code = 202
            response.headers["Retry-After"] = "1" if wait < 1 else "2"
            return ResultView(id=info.run_id, status=info.status.value)
        except WorkflowFailedError:
            pass
        info = await app.get(run_id)
        view = run_view(info)
        return ResultView(id=info.run_id, status=view.status, result=view.result, error=view.error)

    @api.get(
        "/v1/runs/{run_id}/history", summary="A run's events, paged", response_model=HistoryPage
    )
    async def get_history(
        run_id: str,
        request: Request,
        after: Annotated[int, Query(ge=0)] = 0,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    ) -> HistoryPage:
        info = await visible(request, run_id, follow=False)
        events = await app.store.read_history(info.run_id, after)
        page = events[:limit]
        more = len(events) > limit
        return HistoryPage(
            run_id=info.run_id,
            events=[event_view(e) for e in page],
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
        limit: Annotated[int, Query(ge=1, le=500)] = 50,
        cursor: str | None = None,
    ) -> RunPage:
        before = _uncursor(cursor) if cursor else None
        principal: Principal | None = request.state.principal
        infos = await app.list(
            tenant=principal.tenant if principal is not None and not principal.admin else None,
            workflow=workflow,
            status=status,
            waiting_for=waiting_for,
            limit=limit + 1,
            before=before,
        )
        page = infos[:limit]
        nxt = _cursor(page[-1].created_at, page[-1].run_id) if len(infos) > limit else None
        return RunPage(runs=[run_view(i) for i in page], next_cursor=nxt)

    @api.get(
        "/v1/runs/{run_id}/events",
        summary="A run's events as Server-Sent Events (resumable with Last-Event-ID)",
        response_class=StreamingResponse,
    )
    async def stream_events(
        run_id: str,
        request: Request,
        last_event_id: Annotated[str | None, Header()] = None,
        after: Annotated[int, Query(ge=0)] = 0,
    ) -> StreamingResponse:
        info = await visible(request, run_id, follow=False)  # 404 before the stream starts
        start = int(last_event_id) if last_event_id and last_event_id.isdigit() else after
        return StreamingResponse(
            _events(app, info.run_id, start, request),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    @api.post("/v1/runs/{run_id}/signals/{name}", status_code=202, summary="Send a signal")
    async def send_signal(
        run_id: str, name: str, request: Request, payload: Annotated[Any, Body()] = None
    ) -> dict[str, Any]:
        await visible(request, run_id)
        await app.signal(run_id, name, payload)
        return {"id": run_id, "signal": name, "accepted": True, "links": links(run_id)}

    for action in ("cancel", "terminate", "suspend", "resume"):
        _add_action(api, app, action, visible, admin_only)

    @api.post(
        "/v1/runs/{run_id}/fork",
        status_code=202,
        summary="Start a new run reusing a run's first recorded steps, the rest with today's code",
    )
    async def fork(run_id: str, body: ForkBody, request: Request, response: Response) -> RunView:
        admin_only(request, "fork")
        await visible(request, run_id)
        new = await app.fork(run_id, at_step=body.at_step, new_run_id=body.run_id)
        response.headers["Location"] = f"/v1/runs/{new.run_id}"
        return run_view(await app.get(new.run_id))

    async def review_of(request: Request, approval_id: str) -> Approval:
        """The review, if the caller may see its run."""
        review = await app.get_approval(approval_id)
        principal: Principal | None = request.state.principal
        if principal is not None and not principal.admin and review.tenant != principal.tenant:
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
        principal: Principal | None = request.state.principal
        reviews = await app.approvals(
            status=None if status == "all" else status,
            approver=approver,
            run_id=run_id,
            tenant=principal.tenant if principal is not None and not principal.admin else None,
            limit=limit,
        )
        return [dataclasses.asdict(r) for r in reviews]

    @api.get("/v1/approvals/{approval_id}", summary="One review, with its proposal and fingerprint")
    async def get_approval(approval_id: str, request: Request) -> dict[str, Any]:
        return dataclasses.asdict(await review_of(request, approval_id))

    @api.post(
        "/v1/approvals/{approval_id}/decision",
        status_code=202,
        summary="Approve or reject a review, naming the fingerprint of the proposal reviewed",
    )
    async def decide(approval_id: str, body: DecisionBody, request: Request) -> dict[str, Any]:
        review = await review_of(request, approval_id)
        await app.decide(
            approval_id,
            approve=body.approve,
            by=body.by,
            fingerprint=body.fingerprint,
            value=body.value,
            reason=body.reason,
        )
        return {"approval_id": approval_id, "accepted": True, "links": links(review.run_id)}

    @api.post(
        "/v1/runs/{run_id}/retry",
        status_code=202,
        summary="Retry a failed run from its failed step",
    )
    async def retry(run_id: str, request: Request) -> RunView:
        admin_only(request, "retry")
        await app.retry(run_id)
        return run_view(await app.get(run_id))

    return api


#: how often an event stream looks for new events, and sends a keep-alive comment
_STREAM_POLL = 0.25
_STREAM_KEEPALIVE = 15.0


async def _events(app: App, run_id: str, after: int, request: Request) -> AsyncIterator[str]:
    """The run's events after ``after`` as SSE messages (``id`` is the event's seq), then
    new ones as they are recorded, until the run has ended and everything was sent."""
    loop = asyncio.get_running_loop()
    quiet_since = loop.time()
    while True:
        events = await app.store.read_history(run_id, after)
        for e in events:
            after = e.seq
            payload = json.dumps(event_view(e).model_dump(), separators=(",", ":"))
            yield f"id: {e.seq}\nevent: {e.type.value}\ndata: {payload}\n\n"
        if events:
            quiet_since = loop.time()
        else:
            info = await app.get(run_id, follow=False)
            if info.is_finished:
                if info.continued_to:
                    yield f"event: continued\ndata: {json.dumps({'next': info.continued_to})}\n\n"
                return
            if loop.time() - quiet_since > _STREAM_KEEPALIVE:
                quiet_since = loop.time()
                yield ": keep-alive\n\n"
        if await request.is_disconnected():
            return
        await asyncio.sleep(_STREAM_POLL)


def _add_start_route(api: FastAPI, app: App, wf: Workflow[Any, Any]) -> None:
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
        if principal is not None and not principal.admin:
            if data.get("tenant") not in (None, principal.tenant):
                raise AuthError(
                    403, "Another tenant", f"this key starts runs for {principal.tenant!r} only"
                )
            data["tenant"] = principal.tenant
        kwargs = dict(body.input)  # type: ignore[attr-defined]
        run_id = data.get("run_id")
        if run_id is None and idempotency_key:
            run_id = _idempotent_run_id(wf.name, idempotency_key)
        existed = False
        if run_id is not None:
            with contextlib.suppress(TetherError):
                await app.get(run_id, follow=False)
                existed = True
        try:
            run = await app.start(
                wf,
                kwargs=kwargs,
                run_id=run_id,
                deadline=data.get("deadline"),
                tenant=data.get("tenant"),
            )
        except TetherError as exc:
            if (
                isinstance(exc, RunIdConflictError)
                and idempotency_key
                and data.get("run_id") is None
            ):
                return _problems.problem(
                    409,
                    "Idempotency-Key reused with another body",
                    f"Idempotency-Key {idempotency_key!r} already started run {run_id} of "
                    f"{wf.name!r} with other input; use a new key for new input",
                )
            raise
        info = await app.get(run.run_id, follow=False)
        view = run_view(info)
        return JSONResponse(
            {"id": view.id, "status": view.status, "links": view.links.model_dump()},
            status_code=200 if existed else 202,
            headers={"Location": view.links.self},
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


def _add_action(api: FastAPI, app: App, action: str, visible: Any, admin_only: Any) -> None:
    """``POST /v1/runs/{id}/<action>``; cancel and terminate take ``{"reason": ...}``;
    a client key may cancel its tenant's runs, the rest needs an admin key."""
    reasoned = action in ("cancel", "terminate")

    async def act(run_id: str, request: Request, body: Reason | None = None) -> RunView:
        if action != "cancel":
            admin_only(request, action)
        await visible(request, run_id)
        method = getattr(app, action)
        await (method(run_id, body.reason if body else None) if reasoned else method(run_id))
        return run_view(await app.get(run_id))

    api.add_api_route(
        f"/v1/runs/{{run_id}}/{action}",
        act,
        methods=["POST"],
        status_code=202,
        summary=f"{action.title()} a run",
        name=action,
        response_model=RunView,
    )
