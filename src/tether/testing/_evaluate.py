"""Evaluations: run an activity or a workflow over labelled cases and measure it.

    report = evaluate(classify, [("great film", "pos"), ("dull", "neg")],
                      thresholds={"accuracy": 0.9, "p95_ms": 200})
    print(report.table())

A case is ``(input, expected)`` or a dict ``{"input": x, "expected": y}`` /
``{"args": [...], "kwargs": {...}, "expected": y, "id": "..."}``. ``input`` is one
argument; a tuple input is spread as positional arguments. Activities are called
directly (their function, no store); workflows run through a fresh in-memory
store on a time-skipping ``Env``, so sleeps and retries cost no time.

The report has accuracy, a confusion matrix when the expected values are labels
(strings, booleans, small ints), failures (exceptions, counted by type), latency
p50/p95 in milliseconds, and the cost per case when outputs carry a ``cost``
attribute or key. ``thresholds`` (``accuracy``, ``error_rate``, ``p50_ms``,
``p95_ms``, ``mean_cost``, ``total_cost``) make ``evaluate`` raise
``EvaluationFailed`` listing everything that fell short.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._app import App, run_sync
from .._definitions import Activity, Workflow
from .._errors import ConfigurationError, TetherError, WorkflowFailedError
from .._history import Event, EventType
from .._usage import usage_of
from ._env import Env
from ._files import read_text

#: the thresholds ``evaluate`` understands: name -> (metric, direction)
THRESHOLDS = {
    "accuracy": "min",
    "error_rate": "max",
    "p50_ms": "max",
    "p95_ms": "max",
    "mean_cost": "max",
    "total_cost": "max",
    "repair_rate": "max",
    "validation_failure_rate": "max",
}

ERROR_LABEL = "<error>"


class EvaluationFailed(TetherError, AssertionError):
    """An evaluation fell below its thresholds; ``report`` has the details."""

    def __init__(self, message: str, report: EvalReport) -> None:
        super().__init__(message)
        self.report = report


@dataclass
class Case:
    """One evaluation case."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    expected: Any
    id: str = ""
    #: what to break results down by, e.g. a prompt or model version
    group: str = ""


@dataclass
class CaseResult:
    """What one case gave."""

    case: Case
    output: Any = None
    prediction: Any = None
    correct: bool = False
    error: str | None = None  #: ``Type: message`` when the target raised
    error_type: str | None = None
    latency_ms: float = 0.0
    cost: float | None = None
    #: repair rounds the output needed (an output's ``repairs`` attribute or key)
    repairs: int | None = None


def _percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (0 for no values)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[rank - 1]


def _is_label(value: Any) -> bool:
    return value is None or isinstance(value, str | bool) or type(value) is int


@dataclass
class EvalReport:
    """The results of an evaluation."""

    target: str
    results: list[CaseResult]
    thresholds: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> int:
        """Number of cases."""
        return len(self.results)

    @property
    def correct(self) -> int:
        """Cases whose prediction equals the expected value."""
        return sum(r.correct for r in self.results)

    @property
    def accuracy(self) -> float:
        """Correct cases over all cases (errors count as wrong)."""
        return self.correct / self.total if self.total else 0.0

    @property
    def failures(self) -> list[CaseResult]:
        """Cases where the target raised."""
        return [r for r in self.results if r.error is not None]

    @property
    def error_rate(self) -> float:
        """Failed cases over all cases."""
        return len(self.failures) / self.total if self.total else 0.0

    @property
    def errors_by_type(self) -> dict[str, int]:
        """How many cases failed with each exception type."""
        return dict(Counter(r.error_type or "Error" for r in self.failures))

    @property
    def p50_ms(self) -> float:
        """Median latency per case, in milliseconds."""
        return _percentile([r.latency_ms for r in self.results], 50)

    @property
    def p95_ms(self) -> float:
        """95th percentile latency per case, in milliseconds."""
        return _percentile([r.latency_ms for r in self.results], 95)

    @property
    def costs(self) -> list[float]:
        """The cost of every case that reported one."""
        return [r.cost for r in self.results if r.cost is not None]

    @property
    def total_cost(self) -> float | None:
        """Summed cost, or None when no output reported a cost."""
        return sum(self.costs) if self.costs else None

    @property
    def mean_cost(self) -> float | None:
        """Cost per case (over cases that reported one), or None."""
        return sum(self.costs) / len(self.costs) if self.costs else None

    @property
    def labels(self) -> list[Any] | None:
        """The label set when expected values are labels, else None."""
        expected = [r.case.expected for r in self.results]
        if not expected or not all(_is_label(v) for v in expected):
            return None
        seen: list[Any] = []
        for r in self.results:
            for v in (r.case.expected, r.prediction if r.error is None else ERROR_LABEL):
                if _is_label(v) and v not in seen:
                    seen.append(v)
        return seen if len(seen) <= 50 else None

    @property
    def confusion(self) -> dict[Any, dict[Any, int]] | None:
        """``confusion[expected][predicted]`` counts (errors predict ``"<error>"``)."""
        labels = self.labels
        if labels is None:
            return None
        matrix: dict[Any, dict[Any, int]] = {}
        for r in self.results:
            predicted = ERROR_LABEL if r.error is not None else r.prediction
            if not _is_label(predicted):
                predicted = repr(predicted)
            row = matrix.setdefault(r.case.expected, {})
            row[predicted] = row.get(predicted, 0) + 1
        return matrix

    @property
    def repair_rate(self) -> float | None:
        """Share of answered cases whose output needed a repair, or None if none says."""
        told = [r for r in self.results if r.repairs is not None]
        return sum(1 for r in told if r.repairs) / len(told) if told else None

    @property
    def validation_failure_rate(self) -> float:
        """Share of cases that failed with a validation error (malformed output)."""
        if not self.results:
            return 0.0
        bad = [
            r
            for r in self.results
            if r.error_type and ("Validation" in r.error_type or r.error_type == "OutputInvalid")
        ]
        return len(bad) / len(self.results)

    def by_group(self) -> dict[str, dict[str, float]]:
        """Accuracy, error rate and p50 latency per case group (e.g. prompt version)."""
        groups: dict[str, list[CaseResult]] = {}
        for r in self.results:
            groups.setdefault(r.case.group, []).append(r)
        return {
            name: {
                "cases": float(len(rs)),
                "accuracy": sum(1 for r in rs if r.correct) / len(rs),
                "error_rate": sum(1 for r in rs if r.error) / len(rs),
                "p50_ms": _percentile([r.latency_ms for r in rs], 50),
            }
            for name, rs in sorted(groups.items())
        }

    def metric(self, name: str) -> float | None:
        """The value of a threshold metric by name."""
        value: float | None = getattr(self, name)
        return value

    def shortfalls(self) -> list[str]:
        """Every threshold not met, as ``metric value vs limit`` lines."""
        out = []
        for name, limit in self.thresholds.items():
            value = self.metric(name)
            if value is None:
                out.append(f"{name}: no value (no output reported a cost), required {limit:g}")
            elif THRESHOLDS[name] == "min" and value < limit:
                out.append(f"{name} {value:.4g} < {limit:g} required")
            elif THRESHOLDS[name] == "max" and value > limit:
                out.append(f"{name} {value:.4g} > {limit:g} allowed")
        return out

    @property
    def ok(self) -> bool:
        """Whether every threshold was met."""
        return not self.shortfalls()

    def raise_for_thresholds(self) -> None:
        """Raise ``EvaluationFailed`` if any threshold was not met."""
        short = self.shortfalls()
        if short:
            raise EvaluationFailed(
                f"evaluation of {self.target} fell below its thresholds: " + "; ".join(short),
                self,
            )

    def table(self) -> str:
        """A plain-text summary: metrics, confusion matrix, failures."""
        lines = [f"evaluation of {self.target}: {self.total} cases"]
        rows = [
            ("accuracy", f"{self.accuracy:.3f} ({self.correct}/{self.total})"),
            ("errors", f"{len(self.failures)} ({self.error_rate:.1%})"),
            ("latency p50", f"{self.p50_ms:.1f} ms"),
            ("latency p95", f"{self.p95_ms:.1f} ms"),
        ]
        if self.total_cost is not None:
            rows.append(("cost total", f"{self.total_cost:.6g}"))
            rows.append(("cost per case", f"{self.mean_cost:.6g}"))
        if self.repair_rate is not None:
            rows.append(("repair rate", f"{self.repair_rate:.1%}"))
        rows.append(("validation failures", f"{self.validation_failure_rate:.1%}"))
        width = max(len(k) for k, _ in rows)
        lines += [f"  {k.ljust(width)}  {v}" for k, v in rows]
        groups = self.by_group()
        if len(groups) > 1:
            lines.append("")
            lines.append(
                "  by group: "
                + ", ".join(
                    f"{g or '-'} acc {m['accuracy']:.3f} err {m['error_rate']:.1%} "
                    f"p50 {m['p50_ms']:.1f} ms (n={int(m['cases'])})"
                    for g, m in groups.items()
                )
            )
        matrix = self.confusion
        if matrix is not None:
            labels = [str(v) for v in (self.labels or [])]
            cols = list(self.labels or [])
            if any(ERROR_LABEL in row for row in matrix.values()) and ERROR_LABEL not in cols:
                cols.append(ERROR_LABEL)
                labels.append(ERROR_LABEL)
            w = max([len("expected \\ predicted"), *(len(s) for s in labels)])
            lines.append("")
            lines.append(
                "  "
                + "expected \\ predicted".ljust(w)
                + "".join(f"  {s:>{max(5, len(s))}}" for s in labels)
            )
            for exp in self.labels or []:
                if exp not in matrix:
                    continue
                row = matrix[exp]
                cells = "".join(
                    f"  {row.get(c, 0):>{max(5, len(s))}}"
                    for c, s in zip(cols, labels, strict=True)
                )
                lines.append("  " + str(exp).ljust(w) + cells)
        if self.failures:
            lines.append("")
            lines.append(
                "failures by type: "
                + ", ".join(f"{k} x{n}" for k, n in sorted(self.errors_by_type.items()))
            )
            for r in self.failures[:10]:
                lines.append(f"  case {r.case.id}: {r.error}")
        short = self.shortfalls()
        if self.thresholds:
            lines.append("")
            lines.append(
                "thresholds: " + ("all met" if not short else "NOT MET: " + "; ".join(short))
            )
        return "\n".join(lines)


def _case(raw: Any, index: int) -> Case:
    cid = str(index)
    if isinstance(raw, Case):
        return raw
    if isinstance(raw, Mapping):
        if "expected" not in raw:
            raise ConfigurationError(f"case {index} has no 'expected' key: {dict(raw)!r}")
        cid = str(raw.get("id", cid))
        group = str(raw.get("group", ""))
        if "input" in raw:
            inp = raw["input"]
            args = inp if isinstance(inp, tuple) else (inp,)
            return Case(tuple(args), dict(raw.get("kwargs") or {}), raw["expected"], cid, group)
        return Case(
            tuple(raw.get("args") or ()),
            dict(raw.get("kwargs") or {}),
            raw["expected"],
            cid,
            group,
        )
    if isinstance(raw, tuple | list) and len(raw) == 2:
        inp, expected = raw
        args = inp if isinstance(inp, tuple) else (inp,)
        return Case(tuple(args), {}, expected, cid)
    raise ConfigurationError(
        f"case {index} must be (input, expected) or a dict with 'expected', got {raw!r}"
    )


def load_cases(path: str | Path) -> list[Case]:
    """Cases from a JSON Lines file, one dict per line (blank lines and # comments skipped)."""
    out: list[Case] = []
    lines = read_text(path, "cases file", "pass a JSON Lines file").split("\n")
    for n, line in enumerate(lines, 1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigurationError(f"{path}:{n} is not valid JSON ({exc.msg})") from None
        case = _case(doc, len(out))
        if "id" not in doc:
            case.id = f"line {n}"
        out.append(case)
    return out


def _cost(output: Any) -> float | None:
    value = output.get("cost") if isinstance(output, Mapping) else getattr(output, "cost", None)
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return None


def _error_type(exc: BaseException) -> str:
    if isinstance(exc, WorkflowFailedError) and exc.error:
        # the run's recorded error is "Type: message": report the type the code raised
        head = exc.error.split(":", 1)[0].strip()
        if head.isidentifier():
            return head
    return type(exc).__name__


async def aevaluate(
    target: Activity[Any, Any] | Workflow[Any, Any] | Callable[..., Any],
    cases: Iterable[Any],
    *,
    app: App | None = None,
    thresholds: Mapping[str, float] | None = None,
    key: Callable[[Any], Any] | None = None,
    timeout: float = 30.0,
    router: str | None = None,
) -> EvalReport:
    """The async form of ``evaluate`` (use it inside a running event loop)."""
    limits = dict(thresholds or {})
    for limit, value in limits.items():
        if limit not in THRESHOLDS:
            raise ConfigurationError(
                f"unknown threshold {limit!r}; use {', '.join(sorted(THRESHOLDS))}"
            )
        if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
            # NaN compares false with everything: the gate would pass whatever happened
            raise ConfigurationError(f"threshold {limit!r} must be a number (got {value!r})")
    items = [_case(c, i) for i, c in enumerate(cases)]
    label = str(getattr(target, "name", None) or getattr(target, "__name__", repr(target)))
    results: list[CaseResult] = []
    if isinstance(target, Workflow):
        results = await _run_workflow(target, items, app, key, timeout, router)
    else:
        fn = target.fn if isinstance(target, Activity) else target
        for case in items:

            async def go(c: Case = case) -> Any:
                return await _call(fn, c, timeout)

            results.append(await _measure(case, key, go))
    report = EvalReport(label, results, limits)
    report.raise_for_thresholds()
    return report


async def _call(fn: Callable[..., Any], case: Case, timeout: float) -> Any:
    if inspect.iscoroutinefunction(fn):
        return await asyncio.wait_for(fn(*case.args, **case.kwargs), timeout)
    value = fn(*case.args, **case.kwargs)
    if inspect.isawaitable(value):
        return await asyncio.wait_for(value, timeout)
    return value


async def _measure(
    case: Case, key: Callable[[Any], Any] | None, go: Callable[[], Any]
) -> CaseResult:
    res = CaseResult(case)
    t0 = time.perf_counter()
    try:
        res.output = await go()
    except Exception as exc:
        res.latency_ms = (time.perf_counter() - t0) * 1000
        res.error = f"{type(exc).__name__}: {exc}"
        res.error_type = _error_type(exc)
        return res
    res.latency_ms = (time.perf_counter() - t0) * 1000
    res.cost = _cost(res.output)
    repairs = (
        res.output.get("repairs")
        if isinstance(res.output, Mapping)
        else getattr(res.output, "repairs", None)
    )
    res.repairs = int(repairs) if isinstance(repairs, int | float) else None
    try:
        res.prediction = key(res.output) if key is not None else res.output
    except Exception as exc:
        res.error = f"key() failed: {type(exc).__name__}: {exc}"
        res.error_type = type(exc).__name__
        return res
    res.correct = res.prediction == case.expected
    return res


async def _from_history(res: CaseResult, history: list[Event], router: str | None) -> None:
    """What the run's history tells of a case: model repairs and cost (tether.ai), and
    with ``router`` the branch that router chose, as the prediction."""
    if res.repairs is None:
        tries = [
            e.data.get("value") or {}
            for e in history
            if e.type is EventType.MARKER and e.data.get("marker") == "output_invalid"
        ]
        calls = usage_of(history)
        if calls.calls:
            res.repairs = sum(1 for t in tries if t.get("repair"))
            if res.cost is None and not calls.unpriced_calls:
                res.cost = float(calls.cost)
    if router is None:
        return
    routes = [
        (e.data.get("value") or {})
        for e in history
        if e.type is EventType.MARKER and e.data.get("marker") == "route"
    ]
    chosen = [r.get("chosen") for r in routes if r.get("name") == router]
    if not chosen:
        if res.error is None:
            res.error = f"the run recorded no decision of router {router!r}"
            res.error_type = "NoRoute"
        return
    res.prediction = chosen[-1]
    res.correct = res.prediction == res.case.expected


async def _run_workflow(
    wf: Workflow[Any, Any],
    cases: list[Case],
    app: App | None,
    key: Callable[[Any], Any] | None,
    timeout: float,
    router: str | None = None,
) -> list[CaseResult]:
    if app is None:
        raise ConfigurationError(
            f"evaluating workflow {wf.name!r} needs app= (the App registering its activities)"
        )
    fresh = App(store=":memory:", queue=app.default_queue)
    fresh._workflows = dict(app._workflows)
    fresh._activities = dict(app._activities)
    fresh._workflows.setdefault(wf.name, wf)
    out: list[CaseResult] = []
    try:
        async with Env(fresh):
            for case in cases:
                started: list[str] = []

                async def go(c: Case = case, ids: list[str] = started) -> Any:
                    run = await fresh.start(wf, *c.args, kwargs=c.kwargs)
                    ids.append(run.run_id)
                    return await run.result(timeout=timeout)

                res = await _measure(case, key, go)
                if started:
                    await _from_history(res, await fresh.history(started[0]), router)
                out.append(res)
    finally:
        await fresh.close()
    return out


def evaluate(
    target: Activity[Any, Any] | Workflow[Any, Any] | Callable[..., Any],
    cases: Iterable[Any],
    *,
    app: App | None = None,
    thresholds: Mapping[str, float] | None = None,
    key: Callable[[Any], Any] | None = None,
    timeout: float = 30.0,
    router: str | None = None,
) -> EvalReport:
    """Run ``target`` over ``cases`` and report; see the module docstring.

    ``key`` extracts the prediction from an output (``lambda o: o.label``) before it
    is compared with the expected value. Raises ``EvaluationFailed`` when a threshold
    is not met. ``router`` (a workflow's ``tether.route(name=)``) scores that router:
    the prediction is the branch it chose, read from the run's history, so the
    confusion matrix is the router's. A workflow's model repairs and cost are read
    from its history too (``tether.ai``). Callable from sync code, or from a running
    loop (it then runs in a thread); inside async tests prefer ``await aevaluate(...)``.
    """
    return run_sync(
        aevaluate(
            target,
            cases,
            app=app,
            thresholds=thresholds,
            key=key,
            timeout=timeout,
            router=router,
        )
    )
