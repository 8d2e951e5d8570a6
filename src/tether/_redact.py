"""What the engine may log of a text that may hold payload data (an error message).

By default nothing: such text is replaced by a placeholder. ``set_redactor`` installs
a hook that returns what may be shown (a masked copy, or the text itself).
"""

from __future__ import annotations

from collections.abc import Callable

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
