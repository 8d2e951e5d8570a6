"""The examples run as a user runs them, and prove what they claim."""

from __future__ import annotations

import os
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent


def test_breaking_news_out_of_order_duplicated_webhooks(tmp_path: Path) -> None:
    """Three articles, revisions 1-20 each delivered twice, shuffled, concurrently: each
    page ends at revision 20, no older revision is ever written after a newer one, and
    one controller per article counted all 40 webhooks."""
    store = tmp_path / "news.db"
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "breaking_news.py"), str(store)],
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("story-")]
    assert len(lines) == 3
    for line in lines:
        assert "40 webhooks, page at revision 20" in line, line
        ignored = int(re.search(r"(\d+) stale or duplicate ignored", line).group(1))  # type: ignore[union-attr]
        assert ignored >= 20  # every duplicate, at least
    with sqlite3.connect(f"{store}.site.db") as conn:
        for article in ("story-0", "story-1", "story-2"):
            writes = [
                r
                for (r,) in conn.execute(
                    "SELECT revision FROM writes WHERE article = ? ORDER BY rowid", (article,)
                )
            ]
            assert writes == sorted(set(writes)) and writes[-1] == 20  # never backwards
