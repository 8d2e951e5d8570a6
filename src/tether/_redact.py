"""What the engine may log of a text that may hold payload data (an error message).

By default nothing: such text is replaced by a placeholder. ``set_redactor`` installs
a hook that returns what may be shown (a masked copy, or the text itself).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import TypeVar

#: decides what of a payload-bearing text may be logged (None: nothing)
_redactor: Callable[[str], str | None] | None = None


def set_redactor(hook: Callable[[str], str | None] | None) -> None:
    """Let ``hook(text)`` decide what the engine may log of a text that may hold payload
    data (an error message): return it (or a masked copy) to log it, None to hide it.
    ``None`` restores the default: such text is never logged."""
    global _redactor
    _redactor = hook


def redact(text: str) -> str:
    """What the engine logs of ``text``: the redaction hook's answer, else a placeholder."""
    hook = _redactor
    if hook is not None and text:
        try:
            shown = hook(text)
        except Exception:  # a faulty hook must not leak the text or break the caller
            shown = None
        if shown is not None:
            return shown
    return f"<{len(text)} characters redacted>" if text else ""


#: the attribute the engine sets on an exception it made from names, ids and hashes
#: alone (a ``KeyUnavailableError``, ``BlobError`` or ``NonDeterminismError`` it raised)
_MARK = "_tether_engine_made"
#: what begins a stored task error the engine made (taken off when it is read): a user
#: error's text never begins so (``task_error_text`` sees to it)
TAG = "~n1:"
#: the ``"Type: message"`` texts the engine made or read marked, in this process, so
#: text alone (a log line, a run's ``task_error``) can be judged: the newest kept
_MADE: OrderedDict[str, None] = OrderedDict()
_MADE_MAX = 4096
_MADE_LOCK = threading.Lock()  # (sync activities run in threads)

_E = TypeVar("_E", bound=BaseException)


def _remember(text: str) -> None:
    with _MADE_LOCK:
        _MADE[text] = None
        _MADE.move_to_end(text)
        while len(_MADE) > _MADE_MAX:
            _MADE.popitem(last=False)


def made_by_engine(exc: _E) -> _E:
    """Mark ``exc`` as made by the engine from names, ids and hashes alone (no payload,
    no user text): its message may be logged and shown whole. Only engine code calls
    this, where it raises such an error; the same class made by user code (or a
    subclass) carries no mark and stays redacted, whatever its wording."""
    setattr(exc, _MARK, True)
    _remember(f"{type(exc).__name__}: {exc}")
    return exc


def marked_like(exc: _E, cause: BaseException) -> _E:
    """``exc``, made from ``cause``'s text, marked as the engine's only if ``cause`` was
    (re-raising a keyring's or blob store's error under another name keeps its trust)."""
    return made_by_engine(exc) if is_engine_made(cause) else exc


def is_engine_made(exc: BaseException) -> bool:
    """Whether the engine marked ``exc`` (``made_by_engine``): its text holds no payload."""
    return vars(exc).get(_MARK) is True


def engine_note(text: str) -> str:
    """A task note the engine wrote from names alone (``"Type: message"``), as stored:
    tagged, so whoever reads it back trusts it."""
    _remember(text)
    return TAG + text


def task_error_text(exc: BaseException) -> str:
    """A failed workflow task's error as stored (``"Type: message"``): tagged when the
    engine made it, else as it is, without a leading tag (user text cannot pass as the
    engine's)."""
    text = f"{type(exc).__name__}: {exc}"
    if is_engine_made(exc):
        return engine_note(text)
    while text.startswith(TAG):
        text = text[len(TAG) :]
    return text


def read_task_error(stored: str | None) -> str | None:
    """A stored task error as shown: its tag taken off (and its text trusted in this
    process, see ``engine_made``)."""
    if stored is None or not stored.startswith(TAG):
        return stored
    text = stored[len(TAG) :]
    _remember(text)
    return text


def engine_made(task_error: str) -> bool:
    """Whether a task error (``"Type: message"``) is one the engine made from names, ids
    and hashes alone, so it holds no payload: an exception it marked (``made_by_engine``),
    a note it wrote, or a stored task error it read back tagged. Decided by that mark,
    never by the wording: user text worded like the engine's is not trusted (texts seen
    in this process are remembered, the newest few thousand)."""
    return task_error in _MADE


def shown_error(exc: BaseException) -> str:
    """What the engine logs of ``exc``'s message: all of it when the engine made it
    (``made_by_engine``), else what ``redact`` allows."""
    return str(exc) if is_engine_made(exc) else redact(str(exc))


def unavailable_text(exc: BaseException) -> str:
    """Why a payload cannot be read, as a run or dead letter keeps it (``unavailable``,
    shown to every API key): the engine's message whole, else its type and what
    ``redact`` allows (a keyring of the user's may word its errors with a secret)."""
    return str(exc) if is_engine_made(exc) else f"{type(exc).__name__}: {redact(str(exc))}"


def redact_error(type_name: str, text: str) -> str:
    """What the engine logs of an error's message given as text: all of it when the
    engine made it (``engine_made``), else what ``redact`` allows."""
    return text if engine_made(f"{type_name}: {text}") else redact(text)
