"""Payloads: typed round-trips through the store, and bad values rejected early."""

from __future__ import annotations

import dataclasses
import datetime as dt
import uuid
from typing import Any

import pydantic
import pytest

import tether
from helpers import eventually
from tether import RunStatus

FAST = tether.Retry(attempts=3, initial=0.01, max_interval=0.05)


# module level so the annotations resolve (``from __future__ import annotations``)


@dataclasses.dataclass
class Point:
    x: int
    y: int


@dataclasses.dataclass
class Shape:
    name: str
    points: list[Point]
    created: dt.datetime
    tag: uuid.UUID | None = None


class Doc(pydantic.BaseModel):
    id: int
    title: str
    tags: list[str] = []
    published: dt.date | None = None


class Summary(pydantic.BaseModel):
    doc: Doc
    words: int
    shape: Shape


class Unserialisable:
    def __repr__(self) -> str:
        return "<Unserialisable sentinel-7f3a>"


SHAPE = Shape(
    name="tri",
    points=[Point(0, 0), Point(3, 0), Point(0, 4)],
    created=dt.datetime(2024, 5, 6, 7, 8, 9, tzinfo=dt.UTC),
    tag=uuid.UUID("12345678-1234-5678-1234-567812345678"),
)
DOC = Doc(id=7, title="On durability", tags=["db", "wal"], published=dt.date(2024, 1, 2))


# -- round trips ---------------------------------------------------------------------------


async def test_dataclass_round_trips_as_activity_args_and_result(
    app: tether.App, worker: tether.Worker
) -> None:
    seen: list[Any] = []

    @app.activity
    def shift(shape: Shape, by: Point) -> Shape:
        seen.append((type(shape), type(shape.points[0]), type(shape.created), type(by)))
        return dataclasses.replace(
            shape,
            name=shape.name + "+",
            points=[Point(p.x + by.x, p.y + by.y) for p in shape.points],
        )

    @app.workflow
    async def mover() -> list[str]:
        moved = await shift(SHAPE, Point(1, 1))
        # the workflow sees the annotated type, not a dict
        return [
            type(moved).__name__,
            type(moved.points[0]).__name__,
            moved.name,
            str(moved.points[2].y),
            moved.created.isoformat(),
            str(moved.tag),
        ]

    run = await app.start(mover)
    assert await run.result(timeout=10) == [
        "Shape",
        "Point",
        "tri+",
        "5",
        "2024-05-06T07:08:09+00:00",
        "12345678-1234-5678-1234-567812345678",
    ]
    assert seen == [(Shape, Point, dt.datetime, Point)]


async def test_pydantic_model_round_trips_as_activity_args_and_result(
    app: tether.App, worker: tether.Worker
) -> None:
    seen: list[type] = []

    @app.activity
    async def summarise(doc: Doc, shape: Shape) -> Summary:
        seen.append(type(doc))
        seen.append(type(shape))
        return Summary(doc=doc, words=len(doc.title.split()), shape=shape)

    @app.workflow
    async def summariser() -> dict[str, Any]:
        s = await summarise(DOC, SHAPE)
        return {
            "type": type(s).__name__,
            "doc_type": type(s.doc).__name__,
            "published": s.doc.published.isoformat() if s.doc.published else None,
            "words": s.words,
            "shape_point": type(s.shape.points[0]).__name__,
            "equal": s.doc == DOC and s.shape == SHAPE,
        }

    run = await app.start(summariser)
    assert await run.result(timeout=10) == {
        "type": "Summary",
        "doc_type": "Doc",
        "published": "2024-01-02",
        "words": 2,
        "shape_point": "Point",
        "equal": True,
    }
    assert seen == [Doc, Shape]


async def test_workflow_input_and_output_round_trip_to_annotated_types(
    app: tether.App, worker: tether.Worker
) -> None:
    received: list[Any] = []

    @app.workflow
    async def pass_through(doc: Doc, shapes: list[Shape], when: dt.datetime) -> Summary:
        received.append((type(doc), [type(s) for s in shapes], type(when)))
        return Summary(doc=doc, words=len(shapes), shape=shapes[0])

    when = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
    run = await app.start(pass_through, DOC, [SHAPE, SHAPE], when)
    out = await run.result(timeout=10)
    assert isinstance(out, Summary)
    assert out == Summary(doc=DOC, words=2, shape=SHAPE)
    assert isinstance(out.shape.points[0], Point)
    assert received == [(Doc, [Shape, Shape], dt.datetime)]
    # a bare handle (no workflow object) also decodes via the registry
    again = await app.get_run(run.run_id).result(timeout=5)
    assert again == out


async def test_workflow_kwargs_round_trip(app: tether.App, worker: tether.Worker) -> None:
    @app.workflow
    async def kw(p: Point, *, scale: int = 1) -> Point:
        return Point(p.x * scale, p.y * scale)

    run = await app.start(kw, Point(2, 3), kwargs={"scale": 10})
    assert await run.result(timeout=10) == Point(20, 30)


async def test_child_workflow_dataclass_input_and_result(
    app: tether.App, worker: tether.Worker
) -> None:
    @app.workflow
    async def child(p: Point) -> Point:
        assert isinstance(p, Point)
        return Point(p.y, p.x)

    @app.workflow
    async def parent() -> list[str]:
        r = await child(Point(1, 2))
        return [type(r).__name__, str(r.x), str(r.y)]

    run = await app.start(parent)
    assert await run.result(timeout=10) == ["Point", "2", "1"]


async def test_wait_event_type_decodes_signal_payload(
    app: tether.App, worker: tether.Worker
) -> None:
    @app.workflow
    async def typed_wait() -> list[str]:
        doc = await tether.wait_event("doc", type=Doc)
        return [type(doc).__name__, doc.title]

    run = await app.start(typed_wait)
    await eventually(lambda: _running(app, run.run_id), what="running")
    await app.signal(run.run_id, "doc", DOC)
    assert await run.result(timeout=10) == ["Doc", "On durability"]


async def _running(app: tether.App, run_id: str) -> bool:
    return (await app.get(run_id)).status is RunStatus.RUNNING


# -- rejected at app.start ---------------------------------------------------------------------


async def test_start_unserialisable_argument_raises_payload_error_naming_value(
    app: tether.App,
) -> None:
    @app.workflow
    async def takes(x: Any) -> None:
        return None

    with pytest.raises(tether.PayloadError) as ei:
        await app.start(takes, {"ok": 1, "bad": Unserialisable()}, run_id="nope")
    msg = str(ei.value)
    assert "sentinel-7f3a" in msg
    assert "'bad'" in msg  # the path to the offending value
    assert await app.list() == []
    with pytest.raises(tether.RunNotFoundError):
        await app.get("nope")


async def test_start_unserialisable_nested_in_list_names_position(app: tether.App) -> None:
    @app.workflow
    async def takes(items: list[Any]) -> None:
        return None

    with pytest.raises(tether.PayloadError) as ei:
        await app.start(takes, [1, 2, Unserialisable()])
    assert "sentinel-7f3a" in str(ei.value)
    assert "[2]" in str(ei.value)
    assert await app.list() == []


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        pytest.param(("not a number", Point(1, 2)), {}, id="str-for-int"),
        pytest.param((3, {"x": "a", "y": 2}), {}, id="bad-dataclass-field"),
        pytest.param((3, [1, 2]), {}, id="list-for-dataclass"),
        pytest.param((3,), {"p": {"x": 1}}, id="missing-dataclass-field"),
    ],
)
async def test_start_wrong_argument_types_rejected(
    app: tether.App, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    @app.workflow
    async def typed(n: int, p: Point) -> int:
        return n + p.x

    with pytest.raises(tether.PayloadError):
        await app.start(typed, *args, kwargs=kwargs, run_id="typed")
    assert await app.list() == []


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        pytest.param((), {}, id="missing"),
        pytest.param((1, 2, 3), {}, id="too-many"),
        pytest.param((1,), {"nope": 2}, id="unknown-kwarg"),
        pytest.param((1, 2), {"b": 3}, id="duplicate"),
    ],
)
async def test_start_wrong_arity_rejected(
    app: tether.App, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    @app.workflow
    async def two(a: int, b: int) -> int:
        return a + b

    with pytest.raises(TypeError) as ei:
        await app.start(two, *args, kwargs=kwargs, run_id="arity")
    assert "two" in str(ei.value)
    assert await app.list() == []


async def test_start_model_accepts_equivalent_dict(app: tether.App, worker: tether.Worker) -> None:
    @app.workflow
    async def title(doc: Doc) -> str:
        return f"{type(doc).__name__}:{doc.title}"

    run = await app.start(title, {"id": 1, "title": "from dict"})
    assert await run.result(timeout=10) == "Doc:from dict"


# -- bad payloads inside a run ---------------------------------------------------------------


async def test_activity_unserialisable_result_fails_once_without_retries(
    app: tether.App, worker: tether.Worker
) -> None:
    attempts: list[int] = []

    @app.activity(retry=FAST)
    def leaky() -> Any:
        attempts.append(tether.activity_context().attempt)
        return Unserialisable()

    @app.workflow
    async def wf() -> dict[str, Any]:
        try:
            await leaky()
        except tether.ActivityError as exc:
            return {"type": exc.error_type, "msg": exc.message, "attempts": exc.attempts}
        return {}

    run = await app.start(wf)
    out = await run.result(timeout=10)
    assert out["attempts"] == 1
    assert "sentinel-7f3a" in out["msg"]
    assert attempts == [1]


async def test_activity_unserialisable_argument_fails_workflow_with_payload_error(
    app: tether.App, worker: tether.Worker
) -> None:
    ran: list[int] = []

    @app.activity
    def sink(x: Any) -> None:
        ran.append(1)

    @app.workflow
    async def wf() -> None:
        await sink(Unserialisable())

    run = await app.start(wf)
    with pytest.raises(tether.WorkflowFailedError) as ei:
        await run.result(timeout=10)
    assert "PayloadError" in (ei.value.error or "")
    assert "sentinel-7f3a" in (ei.value.error or "")
    assert ran == []


async def test_workflow_unserialisable_result_fails_run(
    app: tether.App, worker: tether.Worker
) -> None:
    @app.workflow
    async def wf() -> Any:
        return Unserialisable()

    run = await app.start(wf)
    with pytest.raises(tether.WorkflowFailedError) as ei:
        await run.result(timeout=10)
    assert "PayloadError" in (ei.value.error or "")
    info = await app.get(run.run_id)
    assert info.status is RunStatus.FAILED
    assert info.error is not None and "sentinel-7f3a" in info.error["message"]


async def test_signal_unserialisable_payload_rejected_before_storing(
    app: tether.App, worker: tether.Worker
) -> None:
    @app.workflow
    async def wf() -> Any:
        return await tether.wait_event("x")

    run = await app.start(wf)
    await eventually(lambda: _running(app, run.run_id), what="running")
    before = len(await app.history(run.run_id))
    with pytest.raises(tether.PayloadError) as ei:
        await app.signal(run.run_id, "x", Unserialisable())
    assert "sentinel-7f3a" in str(ei.value)
    assert len(await app.history(run.run_id)) == before
    await app.signal(run.run_id, "x", "fine")
    assert await run.result(timeout=10) == "fine"
