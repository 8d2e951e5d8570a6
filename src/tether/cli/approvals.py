"""``tether approvals``: list, show and decide the reviews opened by ``tether.approval``."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any

import typer
from rich.table import Table
from rich.text import Text

from .._history import REVIEW_STATUSES, Approval
from ._common import (
    EXIT_USAGE,
    MAX_LIMIT,
    _app_option,
    _client_app,
    _console,
    _dump,
    _fail,
    _note,
    _opened,
    _parse_json,
    _run,
    _short_json,
    _store_option,
    _ts,
    cli_actor,
)


def _as_dict(review: Approval) -> dict[str, Any]:
    out = dataclasses.asdict(review)
    for key in ("deadline_at", "decided_at", "reminded_at", "created_at"):
        out[key] = _ts(out[key]) if out[key] else None
    return out


#: what ``--status`` takes (``all``: every review)
_STATUSES = ("open", "all", *(s for s in REVIEW_STATUSES if s != "open"))


def approvals_list_command(
    store: Annotated[str | None, _store_option()] = None,
    app: Annotated[str | None, _app_option()] = None,
    approver: Annotated[
        str | None, typer.Option("--approver", help="Only reviews this person may decide now.")
    ] = None,
    status: Annotated[
        str,
        typer.Option(
            "--status",
            help="open (default), all, deciding (a decision on its way to the run), approved, "
            "rejected, expired_rejected, expired_approved, closed (the run ended undecided).",
        ),
    ] = "open",
    run_id: Annotated[str | None, typer.Option("--run", help="Only this run's reviews.")] = None,
    limit: Annotated[
        int, typer.Option("--limit", "-n", min=1, max=MAX_LIMIT, help="At most N reviews.")
    ] = 50,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """List reviews, oldest first (open ones by default)."""
    if status not in _STATUSES:
        _fail(f"--status {status!r} is none of {', '.join(_STATUSES)}", EXIT_USAGE)

    async def go() -> list[Approval]:
        async with _opened(_client_app(store, app)) as a:
            return await a.approvals(
                status=None if status == "all" else status,
                approver=approver,
                run_id=run_id,
                limit=limit,
            )

    reviews = _run(go())
    if as_json:
        _dump([_as_dict(r) for r in reviews])
        return
    if not reviews:
        _note("no reviews found")
        return
    table = Table(show_edge=False, header_style="bold")
    for column in ("approval id", "name", "status", "approvers", "deadline", "proposal"):
        table.add_column(column, no_wrap=column != "proposal")
    for r in reviews:
        table.add_row(
            Text(r.approval_id),
            Text(r.name),
            Text(r.status),
            Text(", ".join(r.approvers) or "anyone"),
            _ts(r.deadline_at),
            Text(_short_json(r.proposal)),
        )
    _console().print(table)


def approvals_show_command(
    approval_id: Annotated[str, typer.Argument(metavar="APPROVAL_ID", help="run-id:step")],
    store: Annotated[str | None, _store_option()] = None,
    app: Annotated[str | None, _app_option()] = None,
) -> None:
    """Show one review with its proposal and fingerprint, as JSON."""

    async def go() -> Approval:
        async with _opened(_client_app(store, app)) as a:
            return await a.get_approval(approval_id)

    _dump(_as_dict(_run(go())))


def approvals_decide_command(
    approval_id: Annotated[str, typer.Argument(metavar="APPROVAL_ID", help="run-id:step")],
    by: Annotated[str, typer.Option("--by", help="Who decides (recorded).")],
    fingerprint: Annotated[
        str, typer.Option("--fingerprint", help="The fingerprint of the proposal you reviewed.")
    ],
    approve: Annotated[
        bool, typer.Option("--approve/--reject", help="Approve or reject the proposal.")
    ],
    value: Annotated[
        str | None,
        typer.Option("--value", help="An edited proposal, as JSON (when the review allows it)."),
    ] = None,
    reason: Annotated[str | None, typer.Option("--reason", help="Why (recorded).")] = None,
    store: Annotated[str | None, _store_option()] = None,
    app: Annotated[str | None, _app_option()] = None,
) -> None:
    """Approve or reject an open review, naming the proposal's fingerprint."""
    edited = _parse_json(value, "--value") if value is not None else None

    async def go() -> None:
        async with _opened(_client_app(store, app)) as a:
            await a.decide(
                approval_id,
                approve=approve,
                by=by,
                fingerprint=fingerprint,
                value=edited,
                reason=reason,
            )
            review = await a.get_approval(approval_id)
            await a.store.audit(
                cli_actor(),
                "decide",
                f"run:{review.run_id}",
                {"approval_id": approval_id, "approve": approve, "by": by},
            )

    _run(go())
    _note(f"{'approval' if approve else 'rejection'} of {approval_id} delivered")
