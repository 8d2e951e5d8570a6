"""Breaking-news webhooks that arrive out of order and twice.

A newsroom's CMS posts a webhook for every revision of an article, but retries make
duplicates and the network reorders them. Three things keep the site right:

- an entity per article (``ArticleState``) keeps the highest revision seen and starts a
  ``publish`` run only for a newer one (out-of-order and duplicate webhooks stop here);
- a singleton controller per article (one run id per article, signal-with-start) counts
  what arrived and closes the article's story when told, however many webhooks race to
  create it;
- the destination itself refuses a stale write (``WHERE revision < new``): two publish
  runs for revisions 7 and 9 may still reach it in either order, and only its own fence
  can decide that (the entity serialises its operations, not their effects).

    python examples/breaking_news.py [STORE]
"""

from __future__ import annotations

import asyncio
import random
import sqlite3
import sys
import tempfile
from pathlib import Path

import tether

STORE = sys.argv[1] if len(sys.argv) > 1 else f"{tempfile.mkdtemp()}/news.db"
app = tether.App(store=STORE)
SITE = f"{STORE}.site.db"  # stands in for the website's database


def site() -> sqlite3.Connection:
    conn = sqlite3.connect(SITE, timeout=30, isolation_level=None)
    conn.execute("CREATE TABLE IF NOT EXISTS pages (article TEXT PRIMARY KEY, revision INT)")
    conn.execute("CREATE TABLE IF NOT EXISTS writes (article TEXT, revision INT)")
    return conn


@app.activity
def write_page(article: str, revision: int) -> bool:
    """The destination's own fence: a write older than the page is refused."""
    conn = site()
    try:
        conn.execute("BEGIN IMMEDIATE")
        changed = conn.execute(
            "INSERT INTO pages VALUES (?, ?) ON CONFLICT (article) DO UPDATE "
            "SET revision = excluded.revision WHERE excluded.revision > pages.revision",
            (article, revision),
        ).rowcount
        if changed:
            conn.execute("INSERT INTO writes VALUES (?, ?)", (article, revision))
        conn.execute("COMMIT")
        return bool(changed)
    finally:
        conn.close()


@app.workflow
async def publish(article: str, revision: int) -> bool:
    """Render and write one revision (a real one would render HTML, purge a CDN...)."""
    return await write_page(article, revision)


@app.entity
class ArticleState:
    """The highest revision of one article seen so far."""

    def __init__(self) -> None:
        self.revision = 0
        self.ignored = 0

    def offer(self, article: str, revision: int) -> bool:
        if revision <= self.revision:  # a duplicate or a late, older webhook
            self.ignored += 1
            return False
        self.revision = revision
        publish.options(run_id=f"publish:{article}:{revision}", parent_close="abandon")(
            article, revision
        )
        return True


@app.workflow
async def controller(article: str) -> dict[str, int]:
    """One per article (its run id is the article's): counts the webhooks until closed."""
    seen = 0
    while True:
        note = await tether.wait_event("webhook")
        if note == "close":
            return {"webhooks": seen}
        seen += 1


async def deliver(article: str, revision: int) -> None:
    """What the webhook endpoint does with one delivery."""
    await app.start(
        controller,
        article,
        run_id=f"controller:{article}",
        if_running="signal",
        signal=("webhook", revision),
    )
    await app.entity_ref(ArticleState, article).call("offer", article, revision)


async def main(articles: int = 3, revisions: int = 20) -> dict[str, dict[str, int]]:
    """Deliver every revision of each article twice, shuffled, all at once."""
    deliveries = [(f"story-{a}", r) for a in range(articles) for r in range(1, revisions + 1)]
    deliveries *= 2
    random.Random(42).shuffle(deliveries)
    report: dict[str, dict[str, int]] = {}
    async with app.worker(concurrency=50, poll_interval=0.05):
        await asyncio.gather(*(deliver(a, r) for a, r in deliveries))
        for a in range(articles):
            article = f"story-{a}"
            await app.signal(f"controller:{article}", "webhook", "close")
            counted = await app.get_run(f"controller:{article}").result(timeout=60)
            state = await app.entity_ref(ArticleState, article).state()
            report[article] = {**counted, **state}
        for _ in range(600):  # the last publish runs finish
            runs = await app.list(workflow="publish", limit=1000)
            if all(r.is_finished for r in runs):
                break
            await asyncio.sleep(0.05)
    return report


if __name__ == "__main__":
    result = asyncio.run(main())
    conn = site()
    for article, figures in sorted(result.items()):
        writes = [
            r
            for (r,) in conn.execute(
                "SELECT revision FROM writes WHERE article = ? ORDER BY rowid", (article,)
            )
        ]
        print(
            f"{article}: {figures['webhooks']} webhooks, page at revision "
            f"{figures['revision']}, {figures['ignored']} stale or duplicate ignored, "
            f"writes {writes}"
        )
    print(f"runs in {STORE}; the site in {Path(SITE).name}")
