"""``python -m tether.cli``: the same as the ``tether`` command."""

from __future__ import annotations

from . import main

main()
