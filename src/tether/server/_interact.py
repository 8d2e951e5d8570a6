"""HTTP routes for queries, updates, entities and schedules (``tether serve``).

- ``POST /v1/runs/{id}/queries/{name}`` ``{"args": [...]}``: the answer (read role);
- ``POST /v1/runs/{id}/updates/{name}`` ``{"args": [...], "timeout": 30}``: the update's
  result (operate); ``202`` when it is recorded but not applied within the wait, or
  once it is recorded when the server begins to stop (its workers stop too);
- ``POST /v1/entities/{entity}/{key}/operations/{op}`` and ``GET /v1/entities/{entity}/{key}``
  (an entity's state), ``GET /v1/entities/{entity}`` (its keys);
- ``GET /v1/schedules``, ``GET /v1/schedules/{id}``, ``POST .../pause|resume|trigger``
  and ``DELETE /v1/schedules/{id}``. Schedules are declared in code or with
  ``tether schedules create``.

Entities and schedules belong to no tenant, so their routes need an admin key bound to
no tenant (``unbound``).
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import FastAPI, Header, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from .._app import App
from .._errors import ResultTimeoutError
from ._models import links
from ._problems import problem
from ._stream import EventHub, ServerClosing


def _not_yet(exc: Exception) -> str:
    """Why an update's (or an entity operation's) outcome is not in its answer."""
    if isinstance(exc, ServerClosing):
        return (
            "the server is stopping: the update is recorded and applies when a worker runs "
            "the run; send it again with the same Idempotency-Key for its outcome (without "
            "one, sending it again applies it again)"
        )
    return str(exc)


class ArgsBody(BaseModel):
    """Positional arguments (JSON), and for updates how long to wait for the outcome."""

    args: list[Any] = Field(default_factory=list)
    timeout: float | None = Field(None, gt=0, description="seconds to wait (updates)")


def install_interactions(
    api: FastAPI,
    app: App,
    *,
    visible: Any,
    may: Any,
    unbound: Any,
    audit: Any,
    max_wait: float,
    hub: EventHub,
) -> None:
    """Add the routes above to ``api``."""

    @api.post("/v1/runs/{run_id:path}/queries/{name}", summary="Ask a run's query handler")
    async def query(run_id: str, name: str, body: ArgsBody, request: Request) -> dict[str, Any]:
        info = await visible(request, run_id)
        may(request, "read", "query")
        return {"id": info.run_id, "result": await app.query(info.run_id, name, *body.args)}

    @api.post("/v1/runs/{run_id:path}/updates/{name}", summary="Run an update in a run")
    async def update(
        run_id: str,
        name: str,
        body: ArgsBody,
        request: Request,
        idempotency_key: Annotated[str | None, Header()] = None,
    ) -> Any:
        info = await visible(request, run_id)
        may(request, "operate", "update")
        wait = min(body.timeout or 30.0, max_wait)
        recorded = asyncio.Event()
        try:
            # a retry with the same Idempotency-Key is the same update: applied once, and
            # answered with that one's outcome
            result = await hub.unless_closing(
                app._update(
                    info.run_id, name, tuple(body.args), wait, idempotency_key or None, recorded.set
                ),
                settled=recorded,
            )
        except (ResultTimeoutError, ServerClosing) as exc:
            await audit(request, "update", f"run:{info.run_id}", {"update": name})
            return JSONResponse(
                {"id": info.run_id, "status": "accepted", "detail": _not_yet(exc)},
                status_code=202,
                headers={"Retry-After": "1"},
            )
        await audit(request, "update", f"run:{info.run_id}", {"update": name})
        return {"id": info.run_id, "result": result, "links": links(info.run_id)}

    @api.get("/v1/entities/{entity}", summary="The keys of an entity class's live entities")
    async def entity_keys(entity: str, request: Request) -> list[str]:
        unbound(request, "listing entities")
        app.entity_ref(entity, "-")  # unknown class: 400 naming the known ones
        return await app.entities(entity)

    @api.get("/v1/entities/{entity}/{key}", summary="An entity's state")
    async def entity_state(entity: str, key: str, request: Request) -> dict[str, Any]:
        unbound(request, "reading entities")
        return await app.entity_ref(entity, key).state()

    @api.post("/v1/entities/{entity}/{key}/operations/{op}", summary="Apply an entity operation")
    async def entity_call(
        entity: str,
        key: str,
        op: str,
        body: ArgsBody,
        request: Request,
        idempotency_key: Annotated[str | None, Header()] = None,
    ) -> Any:
        unbound(request, "calling entities")
        ref = app.entity_ref(entity, key)
        recorded = asyncio.Event()
        try:
            result = await hub.unless_closing(
                ref._call(
                    op,
                    tuple(body.args),
                    min(body.timeout or 30.0, max_wait),
                    idempotency_key or None,
                    recorded.set,
                ),
                settled=recorded,
            )
        except (ResultTimeoutError, ServerClosing) as exc:
            # recorded, and it still applies: a 202, so a client does not send it again
            await audit(request, f"entity {op}", f"run:{ref.run_id}", None)
            return JSONResponse(
                {"entity": entity, "key": key, "status": "accepted", "detail": _not_yet(exc)},
                status_code=202,
                headers={"Retry-After": "1"},
            )
        await audit(request, f"entity {op}", f"run:{ref.run_id}", None)
        return {"entity": entity, "key": key, "result": result}

    @api.get("/v1/schedules", summary="Every schedule")
    async def schedules(request: Request) -> list[dict[str, Any]]:
        unbound(request, "listing schedules")
        return [s.to_json() for s in await app.schedules()]

    @api.get("/v1/schedules/{schedule_id}", summary="One schedule")
    async def schedule(schedule_id: str, request: Request) -> dict[str, Any]:
        unbound(request, "reading schedules")
        return (await app.get_schedule(schedule_id)).to_json()

    @api.post("/v1/schedules/{schedule_id}/{action}", summary="Pause, resume or trigger")
    async def schedule_action(schedule_id: str, action: str, request: Request) -> Any:
        unbound(request, f"{action} a schedule")
        if action == "pause":
            await app.pause_schedule(schedule_id, note="paused over HTTP")
        elif action == "resume":
            await app.resume_schedule(schedule_id)
        elif action == "trigger":
            run = await app.trigger_schedule(schedule_id)
            await audit(request, "schedule trigger", f"schedule:{schedule_id}", None)
            return JSONResponse(
                {"id": run.run_id, "links": links(run.run_id).model_dump()},
                status_code=202,
                headers={"Location": links(run.run_id).self},
            )
        else:
            return problem(404, "No such action", "schedule actions are pause, resume and trigger")
        await audit(request, f"schedule {action}", f"schedule:{schedule_id}", None)
        return (await app.get_schedule(schedule_id)).to_json()

    @api.delete("/v1/schedules/{schedule_id}", summary="Delete a schedule (its runs stay)")
    async def delete_schedule(schedule_id: str, request: Request) -> dict[str, Any]:
        unbound(request, "deleting a schedule")
        await app.delete_schedule(schedule_id)
        await audit(request, "schedule delete", f"schedule:{schedule_id}", None)
        return {"id": schedule_id, "deleted": True}
