"""tether.ai's shared state: the answer cache, daily model spend and budgets per scope,
and the estimates provider batches hold in the day's spend (by submit step)."""

from __future__ import annotations

import json
import time
from decimal import Decimal
from typing import Any

from ..._errors import RunNotFoundError
from ..._history import Task
from ...encryption import KeyUnavailableError
from ._tx import _Tx
from .tasks import _check_fence


def _cache_get(tx: _Tx, key: str) -> str | None:
    row = tx.execute(
        "SELECT value FROM ai_cache WHERE cache_key = ? AND expires_at > ?", (key, tx.now)
    ).fetchone()
    if row is None:
        return None
    try:
        return tx.open(str(row[0]), f"cached model answer {key!r}")
    except KeyUnavailableError:  # sealed under a key now gone: as good as not cached
        return None


def _cache_put(tx: _Tx, key: str, value: str, ttl: float) -> None:
    tx.execute(
        "INSERT INTO ai_cache (cache_key, value, created_at, expires_at) VALUES (?, ?, ?, ?) "
        "ON CONFLICT (cache_key) DO UPDATE SET value = excluded.value, "
        "created_at = excluded.created_at, expires_at = excluded.expires_at",
        (key, tx.seal(value), tx.now, tx.now + ttl),
    )
    # a few expired answers go with each write, so the table stays the size of its TTL
    tx.execute(
        "DELETE FROM ai_cache WHERE cache_key IN (SELECT cache_key FROM ai_cache "
        "WHERE expires_at <= ? LIMIT 20)",
        (tx.now,),
    )


def _set_model_budget(tx: _Tx, scope: str, tokens: int | None, cost: str | None) -> None:
    if tokens is None and cost is None:
        tx.execute("DELETE FROM ai_budgets WHERE scope = ?", (scope,))
        return
    tx.execute(
        "INSERT INTO ai_budgets (scope, tokens, cost, updated_at) VALUES (?, ?, ?, ?) "
        "ON CONFLICT (scope) DO UPDATE SET tokens = excluded.tokens, cost = excluded.cost, "
        "updated_at = excluded.updated_at",
        (scope, tokens, cost, tx.now),
    )
    _seed_spend(tx, scope, time.strftime("%Y-%m-%d", time.gmtime(tx.now)))


def _seed_spend(tx: _Tx, scope: str, day: str) -> None:
    """Today's spend of a budget's scope is at least what the usage ledger recorded
    today (the tenant's calls, or every call for the global scope): workers count a
    call against a scope only once it has a budget, so a budget set (or set again)
    partway through the day would otherwise start from zero. Never lowers the spend:
    the ledger lacks what is in flight and unpriced calls' estimates."""
    args: tuple[str, ...]
    if scope == "global":
        where, args = "day = ?", (day,)
    elif scope.startswith("tenant:"):
        where, args = "day = ? AND tenant = ?", (day, scope[len("tenant:") :])
    else:
        return
    # the ledger as folded, plus what workflow tasks appended since (not folded here:
    # a fold takes the counters' lock, which this write need not wait for)
    rows = tx.execute(
        f"SELECT tokens, cost FROM usage_days WHERE {where} "
        f"UNION ALL SELECT tokens, cost FROM usage_deltas WHERE {where}",
        args + args,
    ).fetchall()
    tokens = sum(int(r[0]) for r in rows)
    cost = sum((Decimal(r[1]) for r in rows), Decimal(0))
    if not tokens and not cost:
        return  # nothing recorded today: the spend (if any) stands
    spent_tokens, spent_cost = _locked_spend(tx, scope, day)
    _set_spend(tx, scope, day, max(spent_tokens, tokens), str(max(spent_cost, cost)))


def _model_budgets(tx: _Tx, day: str) -> list[tuple[Any, ...]]:
    """(scope, token limit, cost limit, tokens spent, cost spent) of every budget on ``day``."""
    rows = tx.execute(
        "SELECT b.scope, b.tokens, b.cost, s.tokens, s.cost FROM ai_budgets b "
        "LEFT JOIN ai_spend s ON s.scope = b.scope AND s.day = ? ORDER BY b.scope",
        (day,),
    ).fetchall()
    return [tuple(r) for r in rows]


def _add_spend(tx: _Tx, scopes: tuple[str, ...], day: str, tokens: int, cost: str) -> None:
    for scope in scopes:
        spent_tokens, spent_cost = _locked_spend(tx, scope, day)
        _set_spend(tx, scope, day, spent_tokens + tokens, _plain(spent_cost + Decimal(cost)))


def _locked_spend(tx: _Tx, scope: str, day: str) -> tuple[int, Decimal]:
    """(tokens, cost) spent in ``scope`` on ``day``, its row locked until the commit; the
    row is made first, so two first writers of a day cannot collide."""
    tx.execute(
        "INSERT INTO ai_spend (scope, day, tokens, cost, updated_at) VALUES (?, ?, 0, '0', ?) "
        "ON CONFLICT (scope, day) DO NOTHING",
        (scope, day, tx.now),
    )
    row = tx.execute(
        f"SELECT tokens, cost FROM ai_spend WHERE scope = ? AND day = ?{tx.for_update}",
        (scope, day),
    ).fetchone()
    return int(row[0]), Decimal(row[1])


def _set_spend(tx: _Tx, scope: str, day: str, tokens: int, cost: str) -> None:
    tx.execute(
        "UPDATE ai_spend SET tokens = ?, cost = ?, updated_at = ? WHERE scope = ? AND day = ?",
        (tokens, cost, tx.now, scope, day),
    )


def _reserve_spend(
    tx: _Tx, scopes: tuple[str, ...], day: str, tokens: int, cost: str | None
) -> tuple[Any, ...] | None:
    """Add a call's estimate to each scope's spend of ``day`` if that passes none of
    their budgets, all in one transaction (the rows locked: calls at the same moment are
    checked one after the other); else add nothing and return (scope, "tokens" |
    "cost", limit, tokens spent, cost spent) of the first budget it would pass. A cost
    of None (a model without a price) could be anything: a cost budget refuses it."""
    spent: list[tuple[str, int, Decimal]] = []
    for scope in scopes:
        used_tokens, used_cost = _locked_spend(tx, scope, day)
        limit = tx.execute(
            "SELECT tokens, cost FROM ai_budgets WHERE scope = ?", (scope,)
        ).fetchone()
        if limit is not None:
            if limit[0] is not None and used_tokens + tokens > int(limit[0]):
                return (scope, "tokens", str(limit[0]), used_tokens, str(used_cost))
            if limit[1] is not None and (
                cost is None or used_cost + Decimal(cost) > Decimal(limit[1])
            ):
                return (scope, "cost", str(limit[1]), used_tokens, str(used_cost))
        spent.append((scope, used_tokens, used_cost))
    for scope, used_tokens, used_cost in spent:
        _set_spend(tx, scope, day, used_tokens + tokens, _plain(used_cost + Decimal(cost or 0)))
    return None


#: a batch hold as the store keeps it: (scopes, day, tokens, cost)
Hold = tuple[list[str], str, int, str]


def _hold_spend(
    tx: _Tx,
    run_id: str,
    step: int,
    holder: str,
    scopes: tuple[str, ...],
    day: str,
    tokens: int,
    cost: str | None,
    how: str,
    task: Task | None = None,
) -> tuple[Hold | None, tuple[Any, ...] | None]:
    """The estimate a batch's submit step (``run_id``, ``step``) holds in the day's spend
    of ``scopes`` for its attempt ``holder``, and the budget it would pass: the hold an
    earlier attempt of the step left, reused as it is (``holder`` takes it over); else
    the estimate added (``how``: ``"check"``, as ``_reserve_spend``, nothing added when
    it would pass a budget; ``"add"``, unchecked; ``"noted"``, already counted: a hold
    an older build noted in the step's heartbeat) and the hold recorded in the same
    transaction. (None, None): nothing to hold. An attempt run by a worker passes its
    ``task``: once it lost the task (a later attempt holds it, or the run was removed)
    its hold, however late it comes, is refused (``LeaseLostError``), nothing written;
    a hold for a run that is gone (purged, erased) is refused too."""
    if task is not None:
        _check_fence(tx, task)
    # locked (PostgreSQL): a purge removing the run (its hold rows deleted, not yet
    # committed) is waited for and the run then found gone, not taken for a live one
    if (
        tx.execute(f"SELECT 1 FROM runs WHERE run_id = ?{tx.for_update}", (run_id,)).fetchone()
        is None
    ):
        raise RunNotFoundError(run_id)
    hold = _locked_hold(tx, run_id, step)
    if hold is not None:
        tx.execute(
            "UPDATE ai_holds SET holder = ? WHERE run_id = ? AND step = ?", (holder, run_id, step)
        )
        return hold, None
    if not scopes:
        return None, None
    if how == "check":
        over = _reserve_spend(tx, scopes, day, tokens, cost)
        if over is not None:
            return None, over
    elif how == "add":
        _add_spend(tx, scopes, day, tokens, cost or "0")
    held = _plain(Decimal(cost or 0))
    # only while the run is there (a second guard: its row is locked above): a purge
    # or erasure that removed it must not find a row of it put back
    tx.execute(
        "INSERT INTO ai_holds (run_id, step, holder, scopes, day, tokens, cost, created_at) "
        "SELECT ?, ?, ?, ?, ?, ?, ?, ? WHERE EXISTS (SELECT 1 FROM runs WHERE run_id = ?)",
        (run_id, step, holder, json.dumps(list(scopes)), day, tokens, held, tx.now, run_id),
    )
    return (list(scopes), day, tokens, held), None


def _release_hold(tx: _Tx, run_id: str, step: int, holder: str, task: Task | None = None) -> bool:
    """Give back the estimate the submit step (``run_id``, ``step``) holds for its
    attempt ``holder``, the record removed in the same transaction (a second give-back
    finds nothing, nor does one of an attempt whose hold a later attempt took over);
    whether it held. An attempt whose ``task`` a later attempt holds gives nothing back
    (``LeaseLostError``): the hold is that attempt's. A task gone (the run ended, or
    ``app.retry`` replaced it) refuses nothing: the holder decides (a later attempt
    that took the hold over renamed it)."""
    if task is not None:
        _check_fence(tx, task, gone_ok=True)
    hold = _locked_hold(tx, run_id, step, holder)
    if hold is None:
        return False
    _drop_hold(tx, run_id, step, hold)
    return True


def _settle_holds(tx: _Tx, run_id: str, steps: list[int]) -> None:
    """Give back what the batch holds of the run's submit ``steps`` still hold (the
    workflow commit that adds what their batches used), their records removed; a step
    whose hold is gone (given back already) gives back nothing. The hold rows are locked
    first, in step order, then the spend rows, as a hold or a give-back locks them."""
    held = [(step, _locked_hold(tx, run_id, step)) for step in sorted(set(steps))]
    for step, hold in held:
        if hold is not None:
            _drop_hold(tx, run_id, step, hold)


def _locked_hold(tx: _Tx, run_id: str, step: int, holder: str | None = None) -> Hold | None:
    """The hold of the submit step (``run_id``, ``step``), its row locked (PostgreSQL)
    for the caller to take over or remove; with ``holder``: only if that attempt holds it."""
    mine = " AND holder = ?" if holder is not None else ""
    row = tx.execute(
        f"SELECT scopes, day, tokens, cost FROM ai_holds WHERE run_id = ? AND step = ?{mine}"
        f"{tx.for_update}",
        (run_id, step) if holder is None else (run_id, step, holder),
    ).fetchone()
    if row is None:
        return None
    return list(json.loads(row[0])), str(row[1]), int(row[2]), str(row[3])


def _drop_hold(tx: _Tx, run_id: str, step: int, hold: Hold) -> None:
    """Remove the record of a hold (its row already locked) and subtract its amounts
    from its scopes' spend of its day."""
    scopes, day, tokens, cost = hold
    tx.execute("DELETE FROM ai_holds WHERE run_id = ? AND step = ?", (run_id, step))
    _add_spend(tx, tuple(scopes), day, -tokens, str(-Decimal(cost)))


def _plain(cost: Decimal) -> str:
    """A day's cost as stored: without the trailing zeros an estimate added and then
    taken back leaves (0.0001080 is kept as 0.000108)."""
    return "0" if cost == 0 else format(cost.normalize(), "f")
