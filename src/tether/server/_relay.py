"""The webhook relay: posts queued run outcomes to their callback URLs, at least once.

Deliveries are written to the store's outbox in the commit that ends a run
(``store/ops/webhooks.py``). The relay leases due ones, posts each signed
(``tether.webhooks.sign``), and records the answer: a 2xx is delivered; anything else,
a timeout or a refused connection is tried again with exponential backoff until
``give_up_after`` seconds have passed since the run ended (410 Gone, or a URL no client
can post to, gives up at once). Whatever goes wrong with one delivery is that delivery's
failed attempt, never the relay's end.
A relay that dies mid-post leaves its lease to expire; the next one posts again, so
receivers dedupe by the ``webhook-id`` header.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
from typing import Any

import httpx

from .._app import App
from .._errors import ConfigurationError
from ..store.base import Finished
from ..webhooks import _delivery_id, check_webhook_url, sign
from ._models import links

log = logging.getLogger("tether.webhooks")


class WebhookRelay:
    """Delivers the outbox of ``app``'s store while running (``start``/``stop``)."""

    def __init__(
        self,
        app: App,
        secret: str,
        *,
        timeout: float = 10.0,
        backoff: float = 1.0,
        max_backoff: float = 300.0,
        give_up_after: float = 3 * 86400.0,
        poll: float = 1.0,
        batch: int = 32,
    ) -> None:
        self._app = app
        self._secret = secret
        self._timeout = timeout
        self._backoff = backoff
        self._max_backoff = max_backoff
        self._give_up_after = give_up_after
        self._poll = poll
        self._batch = batch
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.delivered = 0
        self.failed_attempts = 0

    def start(self) -> None:
        """Begin delivering (call on the service's event loop)."""
        self._loop = asyncio.get_running_loop()
        self._app.store.add_listener(self._on_commit)
        self._task = asyncio.create_task(self._run(), name="tether-webhook-relay")

    async def stop(self) -> None:
        """Stop; deliveries in flight are abandoned to their leases (posted again later)."""
        self._app.store.remove_listener(self._on_commit)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def _on_commit(self, _ready: set[str], finished: Finished) -> None:
        # any thread: a run ended, so a delivery may be queued
        if finished and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._wake.set)

    async def _run(self) -> None:
        async with httpx.AsyncClient(timeout=self._timeout, follow_redirects=False) as client:
            while True:
                self._wake.clear()
                try:
                    due = await self._app.store.claim_webhooks(self._batch, self._timeout + 5)
                except Exception:  # a store hiccup must not end delivery for good
                    log.exception("webhook relay: claiming deliveries failed; trying again")
                    due = []
                if due:
                    await asyncio.gather(*(self._deliver(client, row) for row in due))
                    continue
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self._poll)

    async def _deliver(self, client: httpx.AsyncClient, row: tuple[Any, ...]) -> None:
        """Post one delivery and record the answer. Whatever goes wrong with it (a URL no
        client can post to, a payload that cannot be read) is this delivery's failed
        attempt, recorded like a refused connection: never the relay's end."""
        delivery_id, run_id, url, ended_at, attempts = row[0], row[1], row[2], row[8], row[9]
        wid = f"{run_id!r}:{delivery_id}"
        problem: str | None
        final = False  # no retry can help: give up now
        try:
            wid = _delivery_id(run_id, delivery_id)
            problem, final = await self._post(client, row, wid)
        except Exception as exc:
            problem = f"{type(exc).__name__}: {exc}"[:500]
        store = self._app.store
        try:
            if problem is None:
                await store.finish_webhook(delivery_id, True, None, None)
                self.delivered += 1
                return
            self.failed_attempts += 1
            now = store.clock()
            wait = min(self._backoff * 2 ** (attempts - 1), self._max_backoff)
            retry_at: float | None = now + wait * random.uniform(0.8, 1.2)
            if final or (ended_at is not None and now - ended_at > self._give_up_after):
                retry_at = None
                log.warning("webhook %s to %s given up: %s", wid, url, problem)
            await store.finish_webhook(delivery_id, False, problem, retry_at)
        except Exception:
            log.exception("webhook relay: recording delivery %s failed (posted again later)", wid)

    async def _post(
        self, client: httpx.AsyncClient, row: tuple[Any, ...], wid: str
    ) -> tuple[str | None, bool]:
        """Post ``row`` as ``wid``: None or what went wrong, and whether that is final."""
        (_, run_id, url, workflow, status, output, error, tenant, ended_at) = row[:9]
        if len(row) > 15 and row[15] is not None:  # its payload could not be read
            return str(row[15])[:500], False
        try:
            check_webhook_url(url)
        except ConfigurationError as exc:  # queued before start checked this
            return str(exc)[:500], True
        body = json.dumps(
            {
                "type": f"run.{status}",
                "run": {
                    "id": run_id,
                    "workflow": workflow,
                    "status": status,
                    "tenant": tenant,
                    "result": json.loads(output) if output else None,
                    "error": json.loads(error) if error else None,
                    "ended_at": ended_at,
                },
                "links": {"self": links(run_id).self},
            },
            separators=(",", ":"),
        ).encode()
        headers = {"content-type": "application/json", **sign(self._secret, wid, body)}
        try:
            resp = await client.post(url, content=body, headers=headers)
        except httpx.InvalidURL as exc:
            return f"{type(exc).__name__}: {exc}"[:500], True
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}: {exc}"[:500], False
        if 200 <= resp.status_code < 300:
            return None, False
        return f"HTTP {resp.status_code}", resp.status_code == 410
