"""The operator console: see, inspect and steer runs in a browser (``tether serve`` at ``/``).

Server-rendered pages (Jinja2) over the same App and store as the HTTP API, with the
same keys, roles and tenants; htmx (vendored, no CDN) refreshes lists and a run's
timeline in place. Every action is a form POST carrying a CSRF token, confirmed in the
browser, and names who did it (the key) in what the run records.
"""

from __future__ import annotations

import dataclasses
import json
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import parse_qs, urlencode, urlsplit

from fastapi import FastAPI, Request
from fastapi import Path as PathParam
from fastapi.responses import RedirectResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates

from ..._app import App
from ..._definitions import CHAIN_SEPARATOR, chain_of
from ..._errors import (
    ApprovalNotFoundError,
    PayloadError,
    RunNotFoundError,
    RunPurgedError,
    TetherError,
)
from ..._history import INT64_MAX, OUTCOMES, DeadLetter, Event, EventType, RunInfo, RunStatus
from ...blobs import BlobError
from ...store.ops.recovery import _retried_failure
from ...store.ops.switches import SWITCH_KINDS
from .._auth import AuthError, Principal, actor_of, visible_run
from .._limits import RateLimiter, authenticate_limited
from .._models import path_quote, run_view
from .._stream import EventHub
from ._charts import outcomes_svg
from ._compare import compare
from ._session import COOKIE, LoginRequired, check_csrf, csrf_token, principal_of
from ._timeline import bars, svg

__all__ = ["install_console"]

HERE = Path(__file__).parent
_ACTIONS = {
    "cancel": "operate",
    "suspend": "operate",
    "resume": "operate",
    "retry": "operate",
    "terminate": "admin",
}
_OVERVIEW_TTL = 5.0  #: seconds the overview's aggregates are reused
_EVENTS_PAGE = 500  #: history events on a run's page
_BARS = 300  #: timeline bars on a run's page (the latest steps)


def install_console(
    api: FastAPI, app: App, *, auth: bool, limiter: RateLimiter | None = None
) -> None:
    """Add the console's pages and static files to ``api``; ``limiter`` limits failed
    sign-ins per client address (the service's ``--rate-limit``)."""
    templates = Jinja2Templates(directory=str(HERE / "templates"))
    templates.env.filters["when"] = _when
    templates.env.filters["pretty"] = _pretty
    plain_urlencode = templates.env.filters["urlencode"]
    # ids with '.', '..' or empty parts (accepted by older versions) are linked whole
    templates.env.filters["urlencode"] = lambda value: (
        path_quote(value, safe="/") if isinstance(value, str) else plain_urlencode(value)
    )
    api.mount("/static", StaticFiles(directory=str(HERE / "static")), name="static")
    cache: dict[str | None, tuple[float, dict[str, Any]]] = {}

    async def who(request: Request) -> Principal | None:
        principal = await principal_of(request, app.store, auth)
        if principal is not None and not principal.sees_payloads:
            raise AuthError(403, "Monitor key", "the console needs a read key or above")
        return principal

    def page(request: Request, name: str, principal: Principal | None, **ctx: Any) -> Response:
        ctx |= {
            "principal": principal,
            # what to offer: every action's form is shown only to keys that may take it
            # (the routes below still refuse the others); without auth, all of them
            "can": lambda role: principal is None or principal.allows(role),
            "can_switch": principal is None
            or (principal.allows("admin") and principal.tenant is None),
            "auth": auth,
            "csrf": csrf_token(request),
            "tenant": principal.tenant if principal else None,
        }
        return templates.TemplateResponse(request, name, ctx)

    async def visible(principal: Principal | None, run_id: str) -> RunInfo:
        """The run, if the caller may see it: another tenant's, purged or not, is not
        there at all for a tenant's key (as in the API)."""
        return await visible_run(app, principal, run_id, follow=False)

    async def form(request: Request) -> dict[str, str]:
        """An urlencoded form (no multipart parser needed), CSRF checked."""
        fields = await _fields(request)
        check_csrf(request, fields.get("csrf"))
        return fields

    def actor(principal: Principal | None) -> str:
        return actor_of(principal, "console")

    async def audit(
        principal: Principal | None, action: str, target: str, detail: dict[str, Any] | None
    ) -> None:
        await app.store.audit(actor(principal), f"{action} (console)", target, detail)

    @api.exception_handler(LoginRequired)
    async def to_login(request: Request, _exc: Exception) -> Response:
        if request.headers.get("hx-request"):
            # a page's htmx refresh (the session ended, e.g. its key was revoked): the
            # whole page goes to the login page, not a login form swapped into a table
            shown = urlsplit(request.headers.get("hx-current-url", ""))
            nxt = shown.path + (f"?{shown.query}" if shown.query else "")
            if not nxt.startswith("/") or nxt.startswith("//"):
                nxt = "/"
            return Response(headers={"HX-Redirect": f"/login?{urlencode({'next': nxt})}"})
        return RedirectResponse(f"/login?{urlencode({'next': request.url.path})}", 303)

    @api.get("/login", include_in_schema=False)
    async def login_page(request: Request, next: str = "/", error: str | None = None) -> Response:
        return templates.TemplateResponse(
            request, "login.html", {"next": next, "error": error, "auth": auth}
        )

    @api.post("/login", include_in_schema=False)
    async def login(request: Request) -> Response:
        fields = await _fields(request)
        key, nxt = fields.get("key", "").strip(), fields.get("next", "/")
        if not nxt.startswith("/") or nxt.startswith("//"):
            nxt = "/"  # never redirect off this site
        try:
            client = request.client.host if request.client else "?"
            principal = await authenticate_limited(app.store, f"Bearer {key}", limiter, client)
            if not principal.sees_payloads:
                raise AuthError(
                    403,
                    "Monitor key",
                    "a monitor key sees no payloads, and the console shows them: sign in "
                    "with a read key or above (monitor keys are for the API and dashboards)",
                )
        except AuthError as exc:
            return templates.TemplateResponse(
                request,
                "login.html",
                {"next": nxt, "error": exc.detail, "auth": auth},
                status_code=exc.status if exc.status == 429 else 401,
                headers={"Retry-After": str(exc.retry_after)} if exc.retry_after else None,
            )
        response = RedirectResponse(nxt, 303)
        response.set_cookie(
            COOKIE,
            key,
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
            max_age=12 * 3600,
        )
        return response

    @api.post("/logout", include_in_schema=False)
    async def logout(request: Request) -> Response:
        await form(request)
        response = RedirectResponse("/login", 303)
        response.delete_cookie(COOKIE)
        return response

    @api.get("/", include_in_schema=False)
    async def overview(request: Request) -> Response:
        principal = await who(request)
        scope = principal.tenant if principal else None
        hit = cache.get(scope)
        if hit is None or time.monotonic() - hit[0] > _OVERVIEW_TTL:
            hit = (time.monotonic(), await _overview(app, scope))
            cache[scope] = hit
        return page(request, "overview.html", principal, **hit[1])

    @api.get("/runs", include_in_schema=False)
    async def runs(
        request: Request,
        workflow: str | None = None,
        status: str | None = None,
        tenant: str | None = None,
        age: str | None = None,  # the form sends an empty field as ""
        error_type: str | None = None,
        q: str | None = None,
        stuck: bool = False,
        cursor: str | None = None,
        partial: bool = False,
    ) -> Response:
        principal = await who(request)
        mine = principal.tenant if principal else None
        if q:
            try:
                info = await visible(principal, q.strip())
                return RedirectResponse(f"/runs/{path_quote(info.run_id)}", 303)
            except TetherError:
                pass
        before = None
        infos: list[RunInfo] = []
        problem = None
        try:
            if cursor:
                created, _, rid = cursor.partition("|")
                try:
                    before = (float(created), rid)
                except ValueError:
                    raise ValueError(
                        f"cursor {cursor[:40]!r} is not one this page gave out: "
                        "follow its 'older runs' link"
                    ) from None
            try:
                seconds = float(age) if age else None
            except ValueError:
                raise ValueError(f"age {(age or '')[:40]!r} is not a number of seconds") from None
            infos = await app.list(
                workflow=workflow or None,
                status=RunStatus(status) if status else None,
                tenant=mine or tenant or None,
                since=app.store.clock() - seconds if seconds else None,
                error_type=error_type or None,
                search=q.strip() if q else None,
                stuck=stuck,
                limit=51,
                before=before,
            )
        except (ValueError, TetherError) as exc:
            problem = str(exc)
        shown = infos[:50]
        nxt = f"{shown[-1].created_at!r}|{shown[-1].run_id}" if len(infos) > 50 else None
        filters = {
            "workflow": workflow or "",
            "status": status or "",
            "tenant": tenant or "",
            "age": age or "",
            "error_type": error_type or "",
            "q": q or "",
            "stuck": "1" if stuck else "",
        }
        return page(
            request,
            "_runs_table.html" if partial else "runs.html",
            principal,
            runs=[run_view(i) for i in shown],
            next_cursor=nxt,
            filters=filters,
            query=urlencode({k: v for k, v in filters.items() if v}),
            statuses=[s.value for s in RunStatus],
            workflows=sorted(app._workflows),
            problem=problem,
        )

    @api.get("/changes", include_in_schema=False)
    async def changes(request: Request) -> Response:
        """Server-Sent Events telling the runs list that a run it may show changed."""
        principal = await who(request)
        hub: EventHub | None = getattr(request.app.state, "hub", None)
        if hub is None:
            return Response(status_code=404)

        async def sees(runs: set[str]) -> bool:
            if principal is None or principal.tenant is None:
                return bool(runs)
            for run_id in runs:
                try:
                    info = await app._peek(run_id, follow=False)
                except TetherError:
                    continue  # purged meanwhile
                if principal.sees(info.tenant):
                    return True
            return False

        return StreamingResponse(
            hub.changes(request, sees),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    @api.get("/runs/{run_id:path}", include_in_schema=False)
    async def run_detail(
        request: Request, run_id: str, partial: bool = False, before: int | None = None
    ) -> Response:
        principal = await who(request)
        try:
            info = await visible(principal, run_id)
        except RunPurgedError as exc:  # (a key bound to a tenant is told "not found")
            return page(request, "missing.html", principal, what=f"run {run_id}", gone=exc)
        except RunNotFoundError:
            return page(request, "missing.html", principal, what=f"run {run_id}")
        unreadable = None
        try:
            history = await app.store.read_history(info.run_id)
        except (PayloadError, BlobError) as exc:  # the page still shows it, and its actions
            history, unreadable = [], f"its history cannot be read: {exc}"
        now = app.store.clock()
        steps = bars(history)
        # long runs: the latest steps and a page of events (older ones by ?before=seq)
        shown_events = [e for e in history if before is None or e.seq < before][-_EVENTS_PAGE:]
        older = shown_events[0].seq if shown_events and shown_events[0].seq > 1 else None
        ctx = {
            "run": run_view(info),
            "info": info,
            "timeline": svg(steps[-_BARS:], info.created_at, info.completed_at or now),
            "steps": steps,
            "hidden_steps": max(0, len(steps) - _BARS),
            "events": shown_events,
            "older": older,
            "total_events": len(history),
            "calls": _model_calls(history),
            "children": [
                e.data.get("child_run_id") for e in history if e.type is EventType.CHILD_STARTED
            ],
            "input": _pretty_raw(info.input),
            "reviews": await app.approvals(status="open", run_id=info.run_id),
            "letters": await app.dead_letters(run_id=info.run_id),
            "audit": (await app.audit(info.run_id))[-50:],
            "finished": info.is_finished,
            "continues": await _continues(app, info.run_id),
            "forked": _forked_from(history),
            "completable": _completable(history, info, now),
            "message": request.query_params.get("message") or unreadable,
        }
        name = "_run_live.html" if partial else "run.html"
        return page(request, name, principal, **ctx)

    @api.post("/runs/{run_id:path}/act", include_in_schema=False)
    async def act(request: Request, run_id: str) -> Response:
        principal = await who(request)
        fields = await form(request)
        action = fields.get("action", "")
        if action not in _ACTIONS:
            raise AuthError(400, "Unknown action", f"no console action {action!r}")
        info = await visible(principal, run_id)  # (first: another tenant's run is not there)
        if principal is not None:
            principal.require(_ACTIONS[action], action)
        reason = f"{actor(principal)} via console: {fields.get('reason') or 'no reason given'}"
        try:
            if action in ("cancel", "terminate"):
                await getattr(app, action)(info.run_id, reason)
            else:
                await getattr(app, action)(info.run_id)
        except TetherError as exc:  # e.g. the run ended since the page was shown
            return _back(run_id, f"{action} not done: {exc}")
        await audit(principal, action, f"run:{info.run_id}", {"reason": fields.get("reason")})
        return _back(run_id, f"{action} requested by {actor(principal)}")

    @api.post("/runs/{run_id:path}/signal", include_in_schema=False)
    async def signal(request: Request, run_id: str) -> Response:
        principal = await who(request)
        fields = await form(request)
        info = await visible(principal, run_id)
        if principal is not None:
            principal.require("operate", "signal")
        name = fields.get("name", "").strip()
        try:
            payload = json.loads(fields.get("payload") or "null")
        except ValueError as exc:
            return _back(run_id, f"signal not sent: the payload is not JSON ({exc})")
        if not name:
            return _back(run_id, "signal not sent: give it a name")
        # optional: the signal's id (signal_id), so a form sent again records nothing
        signal_id = fields.get("signal_id", "").strip() or None
        try:
            new = await app.signal(info.run_id, name, payload, signal_id=signal_id)
        except TetherError as exc:
            return _back(run_id, f"signal not sent: {exc}")
        if not new:
            return _back(run_id, f"signal {signal_id!r} already sent to this run: not sent again")
        await audit(principal, "signal", f"run:{info.run_id}", {"signal": name})
        return _back(run_id, f"signal {name!r} sent by {actor(principal)}")

    @api.post("/runs/{run_id:path}/complete", include_in_schema=False)
    async def complete_step(request: Request, run_id: str) -> Response:
        """Record a step's result without running it (``App.complete_step``, as
        ``POST /v1/runs/{id}/steps/{step}/complete``: admin keys; the store writes the
        audit entry with the result, actor the key)."""
        principal = await who(request)
        fields = await form(request)
        info = await visible(principal, run_id)
        if principal is not None:
            principal.require("admin", "completing a step")
        text = fields.get("step", "").strip()
        if not text.isdigit() or not 1 <= int(text) <= INT64_MAX:
            return _back(run_id, f"step not completed: {text[:40]!r} is not a step number")
        step = int(text)
        raw = fields.get("result", "")
        if not raw.strip():
            return _back(
                run_id, f'step {step} not completed: give its result as JSON (e.g. "re_9")'
            )
        try:
            result = json.loads(raw)
        except ValueError as exc:
            return _back(
                run_id,
                f"step {step} not completed: the result is not JSON ({exc}); a text is "
                'written in double quotes: "re_9"',
            )
        reason = fields.get("reason", "").strip()
        if not reason:
            return _back(run_id, f"step {step} not completed: say how the result was confirmed")
        try:
            await app.complete_step(info.run_id, step, result, reason=reason, by=actor(principal))
        except TetherError as exc:  # refused (it runs now, it completed meanwhile, a type)
            return _back(run_id, f"step {step} not completed: {exc}")
        return _back(run_id, f"step {step} completed by {actor(principal)}")

    @api.post("/runs/{run_id:path}/fork", include_in_schema=False)
    async def fork(request: Request, run_id: str) -> Response:
        principal = await who(request)
        fields = await form(request)
        info = await visible(principal, run_id)
        if principal is not None:
            principal.require("admin", "fork")
        models, prompts = _pairs(fields.get("models")), _pairs(fields.get("prompts"))
        try:
            at_step = int(fields.get("at_step") or "0")
            new = await app.fork(
                info.run_id, at_step=at_step, models=models or None, prompts=prompts or None
            )
        except (ValueError, TetherError) as exc:
            return _back(run_id, f"not forked: {exc}")
        detail = {"at_step": at_step, "new": new.run_id, "models": models or None}
        if prompts:
            detail["prompts"] = prompts
        await audit(principal, "fork", f"run:{info.run_id}", detail)
        return RedirectResponse(f"/compare?{urlencode({'a': info.run_id, 'b': new.run_id})}", 303)

    @api.get("/compare", include_in_schema=False)
    async def compare_runs(request: Request, a: str, b: str) -> Response:
        principal = await who(request)
        try:
            left, right = await visible(principal, a), await visible(principal, b)
        except RunNotFoundError:
            return page(request, "missing.html", principal, what=f"run {a} or {b}")
        rows = compare(
            await app.store.read_history(left.run_id), await app.store.read_history(right.run_id)
        )
        return page(
            request,
            "compare.html",
            principal,
            a=run_view(left),
            b=run_view(right),
            rows=rows,
            differing=sum(1 for r in rows if r["differs"]),
        )

    @api.get("/approvals", include_in_schema=False)
    async def approvals(request: Request) -> Response:
        principal = await who(request)
        reviews = await app.approvals(
            status="open", tenant=principal.tenant if principal else None, limit=200
        )
        return page(request, "approvals.html", principal, reviews=reviews)

    @api.post("/approvals/{approval_id}", include_in_schema=False)
    async def decide(request: Request, approval_id: str) -> Response:
        principal = await who(request)
        fields = await form(request)
        review = await app.get_approval(approval_id)
        try:
            await visible(principal, review.run_id)
        except RunNotFoundError:  # another tenant's review does not exist for this key
            raise ApprovalNotFoundError(approval_id, "no such review") from None
        if principal is not None:
            principal.require("operate", "deciding a review")
        value = None
        if fields.get("value"):
            try:
                value = json.loads(fields["value"])
            except ValueError as exc:
                return _back(review.run_id, f"not decided: the edited value is not JSON ({exc})")
        try:
            await app.decide(
                approval_id,
                approve=fields.get("decision") == "approve",
                by=fields.get("by") or actor(principal),
                fingerprint=fields.get("fingerprint", ""),
                value=value,
                reason=fields.get("reason") or None,
            )
        except TetherError as exc:
            return _back(review.run_id, f"not decided: {exc}")
        approved = fields.get("decision") == "approve"
        detail = {"approval_id": approval_id, "approve": approved}
        await audit(principal, "decide", f"run:{review.run_id}", detail)
        return _back(review.run_id, f"review {approval_id} decided by {actor(principal)}")

    @api.get("/switches", include_in_schema=False)
    async def switches(request: Request) -> Response:
        principal = await who(request)
        mine = principal.tenant if principal else None
        if mine is None:
            shown, log = await app.switches(), await app.audit_log(limit=30)
        else:  # a tenant's key: its own tenant's switch, never the global audit log
            shown = [s for s in await app.switches() if (s["kind"], s["name"]) == ("tenant", mine)]
            log = await app.audit_log(target=f"tenant:{mine}", limit=30)
        return page(
            request,
            "switches.html",
            principal,
            switches=shown,
            kinds=SWITCH_KINDS,
            message=request.query_params.get("message"),
            log=log,
        )

    @api.post("/switches", include_in_schema=False)
    async def switch(request: Request) -> Response:
        principal = await who(request)
        fields = await form(request)
        if principal is not None:
            principal.require("admin", "flipping a kill switch")
            if principal.tenant is not None:
                raise AuthError(
                    403,
                    "Admin key for every tenant required",
                    "flipping a kill switch needs an admin key not bound to a tenant",
                )
        kind, name = fields.get("kind", ""), fields.get("name", "").strip()
        try:
            if fields.get("off") == "1":
                await app.disable(kind, name, reason=fields.get("reason"), by=actor(principal))
                message = f"{kind} {name} switched off by {actor(principal)}"
            else:
                await app.enable(kind, name, by=actor(principal))
                message = f"{kind} {name} switched on by {actor(principal)}"
        except TetherError as exc:
            message = f"not changed: {exc}"
        return RedirectResponse(f"/switches?{urlencode({'message': message})}", 303)

    @api.get("/dead-letters", include_in_schema=False)
    async def dead_letters(request: Request) -> Response:
        principal = await who(request)
        letters = await app.dead_letters(tenant=principal.tenant if principal else None, limit=500)
        message = request.query_params.get("message")
        return page(request, "dead_letters.html", principal, letters=letters, message=message)

    @api.post("/dead-letters/{letter_id}/replay", include_in_schema=False)
    async def replay(
        request: Request, letter_id: Annotated[int, PathParam(ge=1, le=INT64_MAX)]
    ) -> Response:
        principal = await who(request)
        await form(request)
        letter = await letter_for(principal, letter_id, "replaying a dead letter")
        if letter is None:
            return page(request, "missing.html", principal, what=f"dead letter {letter_id}")
        try:
            await app.replay_dead_letter(letter_id)
            message = f"dead letter {letter_id} replayed by {actor(principal)}"
            target = f"run:{letter.run_id}"
            await audit(principal, "replay dead letter", target, {"letter": letter_id})
        except Exception as exc:  # the replay's own failure is the operator's answer
            message = f"replay of dead letter {letter_id} failed: {type(exc).__name__}: {exc}"
        return _back(letter.run_id, message)

    @api.post("/dead-letters/{letter_id}/resolve", include_in_schema=False)
    async def resolve(
        request: Request, letter_id: Annotated[int, PathParam(ge=1, le=INT64_MAX)]
    ) -> Response:
        principal = await who(request)
        fields = await form(request)
        letter = await letter_for(principal, letter_id, "resolving a dead letter")
        if letter is None:
            return page(request, "missing.html", principal, what=f"dead letter {letter_id}")
        try:  # recorded in the audit log by the app, with this actor
            await app.resolve_dead_letter(
                letter_id, note=fields.get("note", ""), by=actor(principal)
            )
            message = f"dead letter {letter_id} resolved by {actor(principal)}"
        except TetherError as exc:
            message = f"dead letter {letter_id} not resolved: {exc}"
        if fields.get("back") == "run":  # the form on the run's page
            return _back(letter.run_id, message)
        return RedirectResponse(f"/dead-letters?{urlencode({'message': message})}", 303)

    async def letter_for(
        principal: Principal | None, letter_id: int, doing: str
    ) -> DeadLetter | None:
        """The letter an operator acts on, or None when it is missing (or another
        tenant's: as missing as one that never was)."""
        letters = await app.dead_letters(include_resolved=True, letter_id=letter_id, limit=1)
        try:
            if letters:
                await visible(principal, letters[0].run_id)
        except RunNotFoundError:
            return None
        if principal is not None:  # (after: another tenant's letter is simply not there)
            principal.require("operate", doing)
        return letters[0] if letters else None


async def _fields(request: Request) -> dict[str, str]:
    """An urlencoded form's fields (400 when the body is not UTF-8)."""
    try:
        text = (await request.body()).decode()
    except UnicodeDecodeError:
        raise AuthError(
            400, "Malformed form", "the form's body is not UTF-8 urlencoded text"
        ) from None
    return {k: v[-1] for k, v in parse_qs(text).items()}


def _completable(history: list[Event], info: RunInfo, now: float) -> list[dict[str, Any]]:
    """The activity steps ``App.complete_step`` takes now, as far as the history tells:
    the failed step of a failed (or needs_intervention) run, or a live run's steps
    waiting for their next retry. ``{"step", "name", "error"}`` each.

    The store decides at the write (a step that began an attempt since is refused
    there, with the reason); a step queued and never tried is not offered, since the
    history cannot tell it from one running now."""
    voided: set[int] = set()
    for e in history:
        if e.type is EventType.RUN_RETRIED:
            voided.update(e.data.get("voided", []))
    events = [e for e in history if e.seq not in voided and e.type is not EventType.RUN_RETRIED]
    cancelled = {
        e.data.get("activity_step") for e in events if e.type is EventType.ACTIVITY_CANCEL_REQUESTED
    }
    names = {e.step: e.data.get("name") for e in events if e.type is EventType.ACTIVITY_SCHEDULED}
    if info.status in (RunStatus.FAILED, RunStatus.NEEDS_INTERVENTION):
        failed = _retried_failure(events)
        if (
            failed is None
            or failed.type is not EventType.ACTIVITY_FAILED
            or failed.step not in names
            or failed.step in cancelled
        ):
            return []
        error = failed.data.get("error")
        return [{"step": failed.step, "name": names[failed.step], "error": _said(error)}]
    if info.status.is_terminal:
        return []
    ended = {e.step for e in events if e.type in OUTCOMES}
    waiting: dict[int, Event] = {}
    for e in events:
        if e.type is EventType.ACTIVITY_ATTEMPT_FAILED and e.step is not None:
            waiting[e.step] = e  # its latest failed attempt
    out = []
    for step, attempt in sorted(waiting.items()):
        retry_at = attempt.data.get("retry_at")
        if (
            step in names
            and step not in ended
            and step not in cancelled
            and isinstance(retry_at, int | float)
            and retry_at > now
        ):
            error = _said(attempt.data.get("error"))
            out.append({"step": step, "name": names[step], "error": error, "retry_at": retry_at})
    return out


def _said(error: Any) -> str:
    """An event's error, in a line: ``Type: message``."""
    if isinstance(error, dict):
        return f"{error.get('type', 'Error')}: {error.get('message', '')}"[:300]
    return str(error or "")[:300]


def _forked_from(history: list[Event]) -> dict[str, Any] | None:
    """``{"run_id", "at_step"}`` of the run this one was forked from, if it was."""
    for e in history[:1]:
        if e.type is EventType.WORKFLOW_STARTED and isinstance(e.data.get("forked_from"), dict):
            return dict(e.data["forked_from"])
    return None


async def _continues(app: App, run_id: str) -> str | None:
    """The run that ``run_id`` continued as new (``x`` for ``x~1``), if it did."""
    first, n = chain_of(run_id)
    if not n:
        return None
    previous = first if n == 1 else f"{first}{CHAIN_SEPARATOR}{n - 1}"
    try:
        info = await app._peek(previous, follow=False)
    except TetherError:  # purged meanwhile: still the run it continued
        return previous
    return previous if info.continued_to == run_id else None


def _back(run_id: str, message: str) -> Response:
    where = path_quote(run_id)  # a child's id holds a slash: kept, the route takes it
    return RedirectResponse(f"/runs/{where}?{urlencode({'message': message})}", 303)


def _pairs(text: str | None) -> dict[str, str]:
    """``"a=x, b=y"`` (a form field) as ``{"a": "x", "b": "y"}``."""
    out: dict[str, str] = {}
    for pair in (text or "").split(","):
        name, _, value = pair.strip().partition("=")
        if name.strip() and value.strip():
            out[name.strip()] = value.strip()
    return out


async def _overview(app: App, tenant: str | None) -> dict[str, Any]:
    """The overview's figures (reused for a few seconds)."""
    store = app.store
    now = store.clock()
    counts = await store.run_counts(tenant)
    by_status: dict[str, int] = {}
    by_workflow: dict[str, dict[str, int]] = {}
    for wf, status, n in counts:
        by_status[status] = by_status.get(status, 0) + n
        by_workflow.setdefault(wf, {})[status] = n
    hours = 24
    since = (int(now // 3600) - hours + 1) * 3600  # whole hours: read from the counters
    outcomes = await store.run_outcomes(since, 3600, tenant)
    ended = sum(n for _, _, n in outcomes)
    failed = sum(n for _, s, n in outcomes if s != "completed")
    oldest = await app.approvals(status="open", tenant=tenant, limit=1)
    letters = await app.dead_letters(tenant=tenant, limit=1000)
    day = datetime.fromtimestamp(now, UTC).strftime("%Y-%m-%d")
    return {
        "by_status": by_status,
        "by_workflow": by_workflow,
        "statuses": [s.value for s in RunStatus],
        "chart": outcomes_svg(outcomes, hours, since),
        "ended": ended,
        "failure_rate": failed / ended if ended else 0.0,
        "queues": await app.queue_stats(),
        "dead_letters": len(letters),
        "intervention": by_status.get("needs_intervention", 0) + by_status.get("failed", 0),
        "oldest_review": oldest[0] if oldest else None,
        "usage": await store.usage_on(day, tenant),
        "spend": await store.spend_on(day) if tenant is None else [],
        "now": now,
    }


def _model_calls(history: list[Any]) -> list[dict[str, Any]]:
    """Model calls of ``tether.ai`` recorded in the run: model, tokens, cost, latency."""
    scheduled: dict[int | None, Any] = {}
    out = []
    for e in history:
        if e.type is EventType.ACTIVITY_SCHEDULED and e.data.get("name") == "tether.ai.call":
            scheduled[e.step] = e
        elif e.type is EventType.ACTIVITY_COMPLETED and e.step in scheduled:
            result = e.data.get("result")
            call = result.get("tether.ai.call") if isinstance(result, dict) else None
            if not isinstance(call, dict):
                continue
            out.append(
                {
                    "step": e.step,
                    "model": f"{call.get('model')} ({call.get('provider')}:"
                    f"{call.get('model_name')})",
                    "prompt": call.get("prompt_version") or "",
                    "input_tokens": call.get("input_tokens"),
                    "output_tokens": call.get("output_tokens"),
                    "cost": call.get("cost"),
                    "latency_ms": call.get("latency_ms"),
                    "attempt": call.get("attempt"),
                }
            )
    return out


def _when(ts: float | None) -> str:
    if ts is None:
        return ""
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _pretty(value: Any) -> str:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    return json.dumps(value, indent=2, default=str, ensure_ascii=False)


def _pretty_raw(text: str | None) -> str:
    if not text:
        return ""
    try:
        return _pretty(json.loads(text))
    except ValueError:
        return text
