"""Model usage and cost, summed from the recorded model calls in runs' histories.

A model call made through ``tether.ai`` is an activity whose recorded result
carries a ``"tether.ai.call"`` block (model, provider, tokens, cost, latency).
Usage is never kept anywhere else: it is read back from history, so the totals
are exactly what was recorded, retries and repairs included, and a replay that
reads the recorded results cannot count a call twice.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from decimal import Decimal
from typing import Any

from ._errors import ConfigurationError
from ._history import INT64_MAX, Event, EventType

#: the key of a model call's record inside its activity result
CALL_KEY = "tether.ai.call"


def amount(value: Any, what: str) -> Decimal:
    """``value`` as an amount of money (a budget, a price): a finite number >= 0, or a
    ``ConfigurationError`` naming ``what``, raised where the amount is written."""
    try:
        out = None if isinstance(value, bool) else Decimal(str(value))
    except ArithmeticError:
        out = None
    if out is None or not out.is_finite() or out < 0:
        raise ConfigurationError(f"{what} must be a number >= 0 (got {value!r})")
    return out


@dataclasses.dataclass(frozen=True, slots=True)
class Usage:
    """Tokens and cost of a set of model calls (a run, a tenant, a day)."""

    calls: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_tokens: int = 0
    #: exact, in the price table's currency (USD for genai-prices)
    cost: Decimal = Decimal(0)
    #: calls whose price was unknown (no entry for the model): their cost is not in ``cost``
    unpriced_calls: int = 0
    #: answers served from the answer cache: no tokens were spent on them
    cached_calls: int = 0
    #: tokens the cached answers would have cost (their recorded usage)
    tokens_saved: int = 0
    cost_saved: Decimal = Decimal(0)
    #: calls answered (so billed) after their run stopped waiting for them: a hedge's
    #: loser whose answer came before its cancel reached it, a step its run cancelled.
    #: Counted in the totals above like any call, once
    abandoned_calls: int = 0

    @property
    def tokens(self) -> int:
        """Input plus output tokens."""
        return self.input_tokens + self.output_tokens

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            **{
                f.name: getattr(self, f.name) + getattr(other, f.name)
                for f in dataclasses.fields(self)
            }
        )

    @classmethod
    def of_call(cls, call: dict[str, Any]) -> Usage:
        """The usage of one recorded call block."""
        cost = call.get("cost")
        tokens_in = int(call.get("input_tokens") or 0)
        tokens_out = int(call.get("output_tokens") or 0)
        if call.get("cache_hit"):
            return cls(
                calls=1,
                cached_calls=1,
                tokens_saved=tokens_in + tokens_out,
                cost_saved=Decimal(cost) if cost is not None else Decimal(0),
            )
        return cls(
            calls=1,
            input_tokens=tokens_in,
            output_tokens=tokens_out,
            cache_read_tokens=int(call.get("cache_read_tokens") or 0),
            cost=Decimal(cost) if cost is not None else Decimal(0),
            unpriced_calls=0 if cost is not None else 1,
        )

    def to_json(self) -> dict[str, Any]:
        """A JSON form (cost as a decimal string, so it stays exact)."""
        out: dict[str, Any] = dataclasses.asdict(self)
        out["cost"] = str(self.cost)
        out["cost_saved"] = str(self.cost_saved)
        out["tokens"] = self.tokens
        return out


def call_of(result: Any) -> dict[str, Any] | None:
    """The model-call block of a recorded activity result, if it is one."""
    if isinstance(result, dict):
        call = result.get(CALL_KEY)
        if isinstance(call, dict):
            return call
    return None


def usage_of(events: Iterable[Event]) -> Usage:
    """The summed usage of every model call recorded in ``events``."""
    total = Usage()
    cancelled: set[int | None] = set()
    for ev in events:
        if ev.type is EventType.ACTIVITY_CANCEL_REQUESTED:
            cancelled.add(ev.data.get("activity_step"))
        elif ev.type is EventType.ACTIVITY_COMPLETED:
            call = call_of(ev.data.get("result"))
            if call is not None:
                total = total + Usage.of_call(call)
                if ev.step in cancelled and not call.get("cache_hit"):
                    total = dataclasses.replace(total, abandoned_calls=total.abandoned_calls + 1)
    return total


def budget_cost(call: Mapping[str, Any]) -> Decimal:
    """What a recorded call counts against a cost budget: its cost, or, unpriced, the
    cost of its estimate (``estimated_cost``; zero only when that had no price either,
    and then no cost budget let the call through)."""
    cost = call.get("cost")
    if cost is None:
        cost = call.get("estimated_cost")
    return Decimal(str(cost)) if cost is not None else Decimal(0)


@dataclasses.dataclass(frozen=True, slots=True)
class Budget:
    """A bound on a run's model spend: ``app.start(..., budget=Budget(tokens=, cost=))``.

    Checked by ``tether.ai`` before each model call, against the usage recorded so
    far in the run plus the call's estimate: a call that would go over raises
    ``tether.ai.BudgetExceeded`` in the workflow, before anything is sent.
    """

    tokens: int | None = None
    cost: Decimal | float | str | None = None

    def __post_init__(self) -> None:
        tokens = self.tokens
        if tokens is not None and (
            isinstance(tokens, bool) or not isinstance(tokens, int) or not 0 <= tokens <= INT64_MAX
        ):
            # a store keeps token counts in 64-bit integer columns
            raise ConfigurationError(
                f"Budget tokens must be a whole number from 0 to 2**63 - 1 (got {self.tokens!r})"
            )
        if self.cost is not None:
            object.__setattr__(self, "cost", amount(self.cost, "Budget cost"))
        if self.tokens is None and self.cost is None:
            raise ConfigurationError("a Budget needs tokens=, cost= or both")

    def to_json(self) -> dict[str, Any]:
        """As recorded in the run's WorkflowStarted event."""
        return {"tokens": self.tokens, "cost": None if self.cost is None else str(self.cost)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Budget:
        """Back from ``to_json``."""
        return cls(tokens=data.get("tokens"), cost=data.get("cost"))


@dataclasses.dataclass
class Spend:
    """A run's model spend as its workflow code has met it (rebuilt on replay), which
    its budget is checked against: its calls' tokens and cost, the estimates of calls
    in flight, and its children's shares of its budget."""

    tokens: int = 0
    cost: Decimal = Decimal(0)
    #: estimates of calls (and batches) in flight
    reserved_tokens: int = 0
    reserved_cost: Decimal = Decimal(0)
    #: children started with a share of this run's budget: step -> the share (Budget JSON)
    shares: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)
    #: what those that ended reported spending (None: nothing reported, the share counts)
    reported: dict[int, dict[str, Any] | None] = dataclasses.field(default_factory=dict)
    #: calls the run stopped waiting for while they ran (a hedge's loser): step -> their
    #: estimate, which counts until their outcome is recorded
    abandoned: dict[int, tuple[int, Decimal]] = dataclasses.field(default_factory=dict)
    #: what those whose outcome came used: an answer's tokens and cost (its provider
    #: billed it), nothing for a call that ended without one (cancelled, failed)
    settled: dict[int, tuple[int, Decimal]] = dataclasses.field(default_factory=dict)

    def settle(self, step: int, result: Any) -> tuple[int, Decimal | None] | None:
        """An abandoned call's outcome came (``result``: its recorded result, None when
        it ended without an answer): it counts as what it used from now on. Returns the
        tokens and priced cost to add to the tenant's ledger (None: nothing)."""
        if step not in self.abandoned or step in self.settled:
            return None
        call = call_of(result) if result is not None else None
        if call is None or call.get("cache_hit"):
            self.settled[step] = (0, Decimal(0))
            return None
        tokens = int(call.get("input_tokens") or 0) + int(call.get("output_tokens") or 0)
        self.settled[step] = (tokens, budget_cost(call))
        cost = call.get("cost")
        return tokens, Decimal(str(cost)) if cost is not None else None

    def children(self) -> tuple[int, Decimal]:
        """What the children started with a share count: a running child its whole
        share, an ended one what it reported (its share when it reported nothing: it
        was terminated, or ended before it could say)."""
        tokens, cost = 0, Decimal(0)
        for step, share in self.shares.items():
            got = self.reported.get(step)
            if got is not None:
                tokens += int(got.get("tokens") or 0)
                cost += Decimal(str(got.get("cost") or 0))
            else:
                tokens += int(share.get("tokens") or 0)
                cost += Decimal(str(share.get("cost") or 0))
        return tokens, cost

    def spent(self) -> tuple[int, Decimal]:
        """Tokens and cost spent: the run's own calls and its children's."""
        tokens, cost = self.children()
        for step, estimate in self.abandoned.items():
            used = self.settled.get(step, estimate)
            tokens, cost = tokens + used[0], cost + used[1]
        return self.tokens + tokens, self.cost + cost

    def committed(self) -> tuple[int, Decimal]:
        """What a budget check counts as gone: spent plus the calls in flight."""
        tokens, cost = self.spent()
        return tokens + self.reserved_tokens, cost + self.reserved_cost

    def share(self, budget: Budget, asked: Budget | None) -> Budget:
        """A child's budget out of ``budget``: what is left of it, or ``asked`` when
        that is less (each limit on its own; a limit only ``asked`` has is kept)."""
        tokens, cost = self.committed()
        left_tokens = None if budget.tokens is None else max(0, budget.tokens - tokens)
        left_cost = None if budget.cost is None else max(Decimal(0), Decimal(budget.cost) - cost)
        if asked is not None:
            if asked.tokens is not None:
                left_tokens = (
                    asked.tokens if left_tokens is None else min(left_tokens, asked.tokens)
                )
            if asked.cost is not None:
                mine = Decimal(asked.cost)
                left_cost = mine if left_cost is None else min(left_cost, mine)
        return Budget(tokens=left_tokens, cost=left_cost)
