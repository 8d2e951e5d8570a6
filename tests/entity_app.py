"""The App of the entity tests: ``tether worker entity_app:app`` with TETHER_TEST_STORE
(the store) and ENTITY_DESTINATION (a side table standing for an external system)."""

from __future__ import annotations

import os
import sqlite3
import time

import tether
from helpers import shared_side_db

app = tether.App(store=os.environ["TETHER_TEST_STORE"])


@app.entity(ops_per_run=7)  # short runs: the tests cross many continue-as-new boundaries
class Counter:
    """A counter: the classic lost-update trap."""

    def __init__(self) -> None:
        self.value = 0

    def add(self, n: int) -> int:
        self.value += n
        return self.value

    def get(self) -> int:
        return self.value


def destination() -> sqlite3.Connection:
    return shared_side_db(
        os.environ["ENTITY_DESTINATION"],
        "CREATE TABLE IF NOT EXISTS docs (doc TEXT PRIMARY KEY, revision INTEGER, body TEXT)",
        "CREATE TABLE IF NOT EXISTS writes (doc TEXT, revision INTEGER, at REAL)",
    )


@app.activity
def write_revision(doc: str, revision: int, body: str) -> bool:
    """Write to the destination with its own fence (never over a newer revision), and
    log the write in the same transaction, so the log's order is the writes' order."""
    destination()  # the schema, once per process
    conn = sqlite3.connect(os.environ["ENTITY_DESTINATION"], timeout=30, isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        cur = conn.execute(
            "INSERT INTO docs VALUES (?, ?, ?) ON CONFLICT (doc) DO UPDATE SET "
            "revision = excluded.revision, body = excluded.body "
            "WHERE excluded.revision > docs.revision",
            (doc, revision, body),
        )
        written = bool(cur.rowcount)
        if written:
            conn.execute("INSERT INTO writes VALUES (?, ?, ?)", (doc, revision, time.time()))
        conn.execute("COMMIT")
    finally:
        conn.close()
    return written


@app.workflow
async def publish(doc: str, revision: int, body: str) -> bool:
    return await write_revision(doc, revision, body)


@app.entity(ops_per_run=10)
class Document:
    """Keeps the highest revision of a document seen so far and publishes each newer one."""

    def __init__(self) -> None:
        self.revision = 0
        self.ignored = 0

    def offer(self, doc: str, revision: int, body: str) -> bool:
        if revision <= self.revision:  # out of order or a duplicate: an older write
            self.ignored += 1
            return False
        self.revision = revision
        publish.options(run_id=f"publish:{doc}:{revision}", parent_close="abandon")(
            doc, revision, body
        )
        return True
