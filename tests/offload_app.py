"""A worker process for the offload crash test: ``python tests/offload_app.py STORE BLOBS``.

Its activity returns a payload above the offload threshold, different on every
execution. With ``CRASH_MARK`` set to a path that does not exist yet, the process dies
(``os._exit``) right after the blob store wrote the first offloaded payload: between
the blob write and the commit that would refer to it.
"""

from __future__ import annotations

import asyncio
import os
import sys

import tether
from tether.blobs import Blob, BlobStore


def make_app(store: str, blobs: str) -> tether.App:
    """The App, its workflow and its activity (the test's client registers the same)."""
    app = tether.App(store=store, blobs=blobs, offload_above=64 * 1024)

    @app.activity
    def render(n: int) -> str:
        return os.urandom(n // 2).hex()

    @app.workflow
    async def report(n: int) -> int:
        return len(await render(n))

    return app


def _die_after_the_first_put() -> None:
    put = BlobStore.put

    def put_then_die(
        self: BlobStore, data: bytes, media_type: str | None = None, **kw: bool
    ) -> Blob:
        blob = put(self, data, media_type, **kw)
        mark = os.environ.get("CRASH_MARK")
        if mark and not os.path.exists(mark):
            with open(mark, "w") as f:
                f.write(blob.ref)
            os._exit(9)  # the blob is written; its commit never happens
        return blob

    BlobStore.put = put_then_die  # type: ignore[method-assign]


async def main() -> None:
    _die_after_the_first_put()
    await make_app(sys.argv[1], sys.argv[2]).worker(poll_interval=0.05, lease=2.0).run()


if __name__ == "__main__":
    asyncio.run(main())
