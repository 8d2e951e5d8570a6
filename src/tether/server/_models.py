"""Request and response bodies of the HTTP API, including one input model per workflow
built from the workflow function's own annotations (so the OpenAPI document shows it)."""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
from typing import Any, Literal
from urllib.parse import quote

from pydantic import BaseModel, ConfigDict, Field, create_model

from .._codec import PAYLOAD_KEYS, SECRET_KEYS
from .._definitions import Workflow
from .._history import Event, RunInfo
from .._redact import engine_made


class Links(BaseModel):
    """Where to follow a run."""

    self: str
    result: str
    history: str
    events: str


class Progress(BaseModel):
    """Units of work done (``tether.set_progress``)."""

    done: int
    total: int | None = None
    unit: str | None = None


class RunView(BaseModel):
    """A run as the API shows it."""

    id: str
    workflow: str
    status: str
    custom_status: Any = None
    progress: Progress | None = Field(None, description="units of work done, when the run says")
    waiting_on: list[dict[str, Any]] | None = Field(
        None, description="what the live run waits for (signals with deadlines, timers, ...)"
    )
    tenant: str | None = None
    parent_run_id: str | None = None
    continued_to: str | None = None
    created_at: float
    updated_at: float
    completed_at: float | None = None
    result: Any = Field(None, description="the run's result, once it completed")
    error: dict[str, Any] | None = None
    task_error: str | None = Field(
        None,
        description=(
            'why a live run cannot move on ("Type: message"): its workflow task fails '
            "(non-determinism after a deploy, ...) or a step waits for a worker that "
            "registers its activity; cleared once the run moves on"
        ),
    )
    attrs: dict[str, Any] | None = Field(
        None, description="what the run was started with: its model budget, model pins"
    )
    unavailable: dict[str, str] | None = Field(
        None,
        description=(
            "fields whose stored value cannot be read, and why (a missing blob, a "
            "destroyed or absent key): shown as null"
        ),
    )
    links: Links


class RunPage(BaseModel):
    """One page of runs, newest first; pass ``next_cursor`` as ``cursor`` for the next."""

    runs: list[RunView]
    next_cursor: str | None


class EventView(BaseModel):
    """One history event."""

    seq: int
    type: str
    step: int | None
    data: dict[str, Any]
    created_at: float


class HistoryPage(BaseModel):
    """Events after ``after``, in order; ``next_after`` continues (None: no more now)."""

    run_id: str
    events: list[EventView]
    next_after: int | None


class ResultView(BaseModel):
    """A finished run's outcome."""

    id: str
    status: str
    result: Any = None
    error: dict[str, Any] | None = None


class SignalOption(BaseModel):
    """A signal sent with a start (signal-with-start)."""

    model_config = ConfigDict(extra="forbid")

    name: str
    payload: Any = None


class StartOptions(BaseModel):
    """Options of a start, beside the workflow's input."""

    model_config = ConfigDict(extra="forbid")

    run_id: str | None = Field(None, description="choose the run id (idempotent by id)")
    deadline: float | None = Field(None, gt=0, description="seconds the whole run may take")
    tenant: str | None = Field(None, description="whose admission limit applies")
    callback_url: str | None = Field(
        None,
        description="an http(s) URL that gets one signed POST of the run's outcome when it "
        "ends (at least once: dedupe by the webhook-id header)",
    )
    if_running: Literal["return", "reject", "signal"] | None = Field(
        None,
        description="with run_id, when that run exists: return it whatever its input, "
        "reject the start (409), or signal it (signal-with-start: give signal)",
    )
    signal: SignalOption | None = Field(
        None, description="signal-with-start: delivered to the run, or first to a new one"
    )
    on_limit: Literal["raise", "queue"] | None = Field(
        None,
        description="with a tenant at its admission limit: refuse the start (429, the "
        "default) or create the run queued until one of the tenant's runs ends",
    )


def path_quote(run_id: str, safe: str = "/@:") -> str:
    """``run_id`` percent-encoded for a URL path, its slashes kept when ``safe`` has
    '/', unless a part between them is empty, '.' or '..' (an id an older version
    accepted): clients resolve those away (``/runs/a/../b`` is ``/runs/b``), so its
    slashes are encoded too, and the dots of an id of dots only."""
    if any(part in ("", ".", "..") for part in run_id.split("/")):
        if not run_id.strip("."):
            return run_id.replace(".", "%2E")
        safe = safe.replace("/", "")
    return quote(run_id, safe=safe)


def links(run_id: str) -> Links:
    """The URLs of a run's resources (the id percent-encoded: ids may hold any text)."""
    base = f"/v1/runs/{path_quote(run_id, safe='@:')}"
    return Links(
        self=base, result=f"{base}/result", history=f"{base}/history", events=f"{base}/events"
    )


#: what a key that may not see payloads gets in their place (role ``monitor``)
WITHHELD = "[withheld]"


def withhold(data: dict[str, Any]) -> dict[str, Any]:
    """Event data with its payloads and free text replaced by ``WITHHELD``."""
    return {k: WITHHELD if k in PAYLOAD_KEYS or k in SECRET_KEYS else v for k, v in data.items()}


def _error_type(error: dict[str, Any] | None) -> dict[str, Any] | None:
    """An error as a key without payloads sees it: its type (and the cause's)."""
    if not error:
        return error
    out: dict[str, Any] = {"type": error.get("type"), "message": WITHHELD}
    if isinstance(error.get("cause"), dict):
        out["cause"] = _error_type(error["cause"])
    return out


def _task_error_type(text: str | None) -> str | None:
    """A task error as a key without payloads sees it: whole when the engine made it
    from names alone (a ``NonDeterminismError``), else its type."""
    if not text or engine_made(text):
        return text
    kind, sep, _message = text.partition(": ")
    return f"{kind}: {WITHHELD}" if sep and kind.isidentifier() else WITHHELD


def run_view(info: RunInfo, payloads: bool = True) -> RunView:
    """``RunInfo`` as the API shows it (the result decoded from its JSON); without
    ``payloads``, its result, custom status and error message withheld, and its task
    error's message unless the engine made it from names alone."""
    if not payloads:
        return run_view(
            dataclasses.replace(
                info,
                output=json.dumps(WITHHELD) if info.output else None,
                error=_error_type(info.error),
                custom_status=(
                    {"progress": info.custom_status["progress"]}
                    if _progress(info.custom_status)
                    else None
                ),
                task_error=_task_error_type(info.task_error),
            )
        )
    return RunView(
        id=info.run_id,
        workflow=info.workflow,
        status=info.status.value,
        custom_status=info.custom_status,
        progress=_progress(info.custom_status),
        waiting_on=info.waiting_on,
        tenant=info.tenant,
        parent_run_id=info.parent_run_id,
        continued_to=info.continued_to,
        created_at=info.created_at,
        updated_at=info.updated_at,
        completed_at=info.completed_at,
        result=json.loads(info.output) if info.output else None,
        error=info.error,
        task_error=info.task_error,
        attrs=info.attrs,
        unavailable=info.unavailable,
        links=links(info.run_id),
    )


def _progress(status: Any) -> Progress | None:
    """The progress a custom status holds (``tether.set_progress``), if any."""
    value = status.get("progress") if isinstance(status, dict) else None
    if isinstance(value, dict) and isinstance(value.get("done"), int):
        try:
            return Progress.model_validate(value)
        except ValueError:
            return None
    return None


def event_view(e: Event, payloads: bool = True) -> EventView:
    """One event as the API shows it (without ``payloads``: ``withhold``)."""
    return EventView(
        seq=e.seq,
        type=e.type.value,
        step=e.step,
        data=e.data if payloads else withhold(e.data),
        created_at=e.created_at,
    )


def input_model(wf: Workflow[Any, Any]) -> type[BaseModel]:
    """A model of ``wf``'s parameters, from its annotations (``Any`` where there is none)."""
    fields: dict[str, Any] = {}
    for p, tp in zip(wf.sig.params, wf.sig.param_types, strict=True):
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        annotation = Any if tp is inspect.Parameter.empty else tp
        default = ... if p.default is inspect.Parameter.empty else p.default
        fields[p.name] = (annotation, default)
    name = _model_name(wf.name)
    model: type[BaseModel] = create_model(
        f"{name}Input", __config__=ConfigDict(extra="forbid"), **fields
    )
    return model


def start_model(wf: Workflow[Any, Any]) -> type[BaseModel]:
    """The body of ``POST /v1/workflows/{name}/runs``: the input and the start's options."""
    name = _model_name(wf.name)
    model: type[BaseModel] = create_model(
        f"Start{name}",
        __base__=StartOptions,
        input=(input_model(wf), Field(description=f"the arguments of {wf.name}")),
    )
    return model


def _model_name(workflow: str) -> str:
    """A schema name for a workflow: letters, digits and underscores only (OpenAPI)."""
    parts = re.split(r"[^0-9A-Za-z]+", workflow)
    return "".join(p[:1].upper() + p[1:] for p in parts if p) or "Workflow"
