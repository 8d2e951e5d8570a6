"""Reading a file a user named on the command line or in a call (cases, histories).

One place decides the one-line error for each way it can go wrong: missing (an
unexpanded shell pattern said so), a directory, unreadable, not UTF-8 text.
"""

from __future__ import annotations

from pathlib import Path

from .._errors import ConfigurationError


def read_text(path: str | Path, what: str, if_directory: str) -> str:
    """The text of ``path``; a ``ConfigurationError`` naming the ``what`` (e.g. "cases
    file") and the path otherwise, with ``if_directory`` as the advice for a folder."""
    name = str(path)
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        hint = " (an unexpanded shell pattern: nothing matched it)" if "*" in name else ""
        raise ConfigurationError(f"{what} {name!r} does not exist{hint}") from None
    except IsADirectoryError:
        raise ConfigurationError(f"{what} {name!r} is a directory; {if_directory}") from None
    except OSError as exc:
        raise ConfigurationError(f"cannot read {what} {name!r}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ConfigurationError(f"{what} {name!r} is not UTF-8 text ({exc.reason})") from None
