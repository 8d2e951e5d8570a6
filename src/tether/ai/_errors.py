"""Errors of ``tether.ai``: each names the step, the model and what to do."""

from __future__ import annotations

from typing import Any

from .._errors import NonRetryable, TetherError


class OutputInvalid(TetherError):
    """A model's output failed parsing or validation after every allowed repair.

    ``problems`` lists what was wrong with the last attempt, ``raw`` is that
    attempt's raw output, ``attempts`` how many answers were tried.
    """

    def __init__(self, model: str, problems: list[str], raw: str | None, attempts: int) -> None:
        self.model = model
        self.problems = problems
        self.raw = raw
        self.attempts = attempts
        shown = "; ".join(problems[:5]) + (
            f" (+{len(problems) - 5} more)" if len(problems) > 5 else ""
        )
        super().__init__(
            f"output of model {model!r} is still invalid after {attempts} attempt(s): {shown}. "
            "Raise max_repairs, relax the output type or validator, or declare default= "
            "for a safe fallback"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.model, self.problems, self.raw, self.attempts))


class BudgetExceeded(TetherError):
    """A model call would go over the run's budget; raised before the call is sent.

    ``spent`` and ``estimate`` are ``{"tokens": n, "cost": "0.0123"}``; the run
    decides what happens next (fail, wait for a raised budget, a cheaper model).
    """

    def __init__(
        self,
        model: str,
        what: str,
        limit: str,
        spent: dict[str, Any],
        estimate: dict[str, Any],
        scope: str = "run",
    ) -> None:
        self.model = model
        self.what = what
        self.limit = limit
        self.spent = spent
        self.estimate = estimate
        self.scope = scope  #: "run", "tenant:<name>" (daily) or "global" (daily)
        whose = "the run's" if scope == "run" else f"the daily ({scope})"
        if estimate.get(what) is None:  # only a cost: the model has no price
            super().__init__(
                f"model {model!r} has no price, so a call to it could exceed {whose} cost "
                f"budget of {limit} by any amount; give it one (gateway.model(..., "
                "price=tether.ai.Price(...)), or Gateway(prices=...); a free local model: "
                "Price(input_per_mtok=0, output_per_mtok=0)), or catch tether.ai.BudgetExceeded "
                "to fall back to a priced model"
            )
            return
        super().__init__(
            f"a call to model {model!r} would exceed {whose} {what} budget of {limit} "
            f"(spent {spent[what]}, this call's estimate {estimate[what]}); "
            "catch tether.ai.BudgetExceeded to fall back to a cheaper model or to wait for "
            "a raised budget, or give the run (or tenant) a larger budget"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            type(self),
            (self.model, self.what, self.limit, self.spent, self.estimate, self.scope),
        )


class ContentRefused(NonRetryable):
    """The provider refused the request on content policy; retrying would get the same."""


class ModelConfigError(NonRetryable):
    """A model could not be built (unknown name, missing package or API key): fix config."""
