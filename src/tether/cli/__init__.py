"""The ``tether`` command line: serve workers, start runs, inspect and steer them.

    tether worker myproject.flows:app
    tether start myproject.flows:app summarise '"https://example.com"' --wait
    tether runs --status running
    tether queues --store postgresql://db/tether
    tether signal RUN_ID approve '{"by": "ada"}'

Needs the ``cli`` extra (typer and rich): ``pip install 'tether[cli]'``.
Exit codes: 0 success, 1 a tether error (unknown run, unreadable store, failed
run...), 2 a usage error (bad arguments, bad JSON, bad MODULE:ATTR).
"""

from __future__ import annotations

import importlib.util
import sys

#: exit code of a usage error (bad arguments), also when the CLI's extra is missing
_EXIT_USAGE = 2


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``tether`` console script."""
    missing = [m for m in ("typer", "rich") if importlib.util.find_spec(m) is None]
    if missing:
        print(
            f"error: the tether command line needs typer and rich ({', '.join(missing)} "
            "not installed); install them with: pip install 'tether[cli]'",
            file=sys.stderr,
        )
        raise SystemExit(_EXIT_USAGE)
    from .._errors import TetherError
    from ._common import EXIT_ERROR, EXIT_USAGE, UsageError, _fail
    from ._main import _build  # the command modules import typer and rich

    try:
        _build()(args=argv, prog_name="tether")
    except UsageError as exc:  # raised outside a command's store call: still one line
        _fail(str(exc), EXIT_USAGE)
    except TetherError as exc:
        _fail(str(exc), EXIT_ERROR)
