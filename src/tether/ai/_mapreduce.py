"""Map-reduce over long inputs: bounded fan-out, hierarchical reduce in input order.

``await ai.map_reduce(chunks, map=summarise, reduce=merge, concurrency=8, fan_in=8)``
maps every chunk (at most ``concurrency`` steps at a time, ``tether.map``), sets
aside the chunks whose step failed (poison: reported, never blocking the rest),
then reduces the results in groups of ``fan_in``, level by level, always in the
order of the input, never in the order steps happened to finish. The result says
which chunks contributed. ``chunk_text`` cuts a document on its natural
boundaries (headings, then paragraphs, then sentences) under a size limit.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Generic, TypeVar

from .._errors import ConfigurationError, TetherError
from ..workflow._api import map as durable_map

C = TypeVar("C")
M = TypeVar("M")


class MapReduceError(TetherError):
    """A reduce step failed, or too few chunks were mapped to reduce at all."""


@dataclasses.dataclass(frozen=True)
class ChunkFailure:
    """A chunk whose map step failed (after its retries)."""

    index: int
    error: str


@dataclasses.dataclass(frozen=True)
class MapReduceResult(Generic[M]):
    """The reduction, and which chunks it is made of."""

    value: M
    contributed: list[int]  #: indexes of the chunks in ``value``, in input order
    failed: list[ChunkFailure]  #: poison chunks, left out
    levels: int  #: reduce levels (0: a single chunk, nothing to merge)


async def map_reduce(
    chunks: Sequence[C],
    *,
    map: Callable[[C], Awaitable[M]],
    reduce: Callable[[list[M]], Awaitable[M]],
    concurrency: int = 8,
    fan_in: int = 8,
    min_success: float = 0.5,
) -> MapReduceResult[M]:
    """Map every chunk, then reduce the results ``fan_in`` at a time, in input order.

    ``map`` and ``reduce`` are activities (or child workflows); ``reduce`` takes a
    list of results in input order and returns one. Chunks whose map failed are
    reported in ``failed`` and left out; when fewer than ``min_success`` of the
    chunks (a share) mapped, or a reduce step fails, ``MapReduceError`` is raised.
    """
    if fan_in < 2:
        raise ConfigurationError("map_reduce fan_in must be at least 2")
    if not 0.0 <= min_success <= 1.0:
        raise ConfigurationError("map_reduce min_success is a share between 0 and 1")
    items = list(chunks)
    if not items:
        raise ConfigurationError("map_reduce needs at least one chunk")
    outcomes = await durable_map(map, items, concurrency=concurrency)
    good = [(o.index, o.value) for o in outcomes if o.ok]
    failed = [ChunkFailure(o.index, o.error or "failed") for o in outcomes if not o.ok]
    if not good or len(good) < min_success * len(items):
        raise MapReduceError(
            f"only {len(good)} of {len(items)} chunks were mapped (at least "
            f"{min_success:.0%} needed); failed: "
            + ", ".join(f"#{f.index} {f.error}" for f in failed[:5])
        )
    level: list[Any] = [v for _, v in good]
    levels = 0
    while len(level) > 1:
        groups = [level[i : i + fan_in] for i in range(0, len(level), fan_in)]
        reduced = await durable_map(reduce, groups, concurrency=concurrency)
        broken = [o for o in reduced if not o.ok]
        if broken:
            raise MapReduceError(
                f"reduce step failed at level {levels + 1} (group {broken[0].index}): "
                f"{broken[0].error}"
            )
        level = [o.value for o in reduced]  # tether.map keeps input order
        levels += 1
    return MapReduceResult(
        value=level[0], contributed=[i for i, _ in good], failed=failed, levels=levels
    )


_HEADING = re.compile(r"^(#{1,6} |[A-Z][^\n]{0,80}\n[=-]{3,}$)", re.MULTILINE)
_SENTENCE = re.compile(r"(?<=[.!?])\s+")


def chunk_text(text: str, *, max_chars: int = 4000) -> list[str]:
    """Cut ``text`` into pieces of at most ``max_chars``, on natural boundaries.

    Sections start at Markdown headings; a section too long is cut between
    paragraphs, a paragraph too long between sentences, and a sentence too long
    at the limit. Adjacent small pieces are joined up to the limit; order is kept.
    """
    if max_chars < 100:
        raise ConfigurationError("chunk_text max_chars must be at least 100")
    starts = [m.start() for m in _HEADING.finditer(text)]
    if not starts or starts[0] != 0:
        starts.insert(0, 0)
    sections = [text[a:b] for a, b in zip(starts, [*starts[1:], len(text)], strict=True)]
    pieces: list[str] = []
    for section in sections:
        pieces += _split(section.strip(), max_chars)
    out: list[str] = []
    for piece in pieces:
        if not piece:
            continue
        if out and len(out[-1]) + 2 + len(piece) <= max_chars and not _HEADING.match(piece):
            out[-1] = f"{out[-1]}\n\n{piece}"
        else:
            out.append(piece)
    return out


def _split(text: str, limit: int) -> list[str]:
    if len(text) <= limit:
        return [text]
    for pattern, sep in ((r"\n\s*\n", "\n\n"), (_SENTENCE.pattern, " ")):
        parts = [p.strip() for p in re.split(pattern, text) if p.strip()]
        if len(parts) > 1:
            out: list[str] = []
            for part in parts:
                for piece in _split(part, limit):
                    if out and len(out[-1]) + len(sep) + len(piece) <= limit:
                        out[-1] = f"{out[-1]}{sep}{piece}"
                    else:
                        out.append(piece)
            return out
    return [text[i : i + limit] for i in range(0, len(text), limit)]
