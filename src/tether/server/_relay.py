"""The webhook relay: posts queued run outcomes to their callback URLs, at least once.

Deliveries are written to the store's outbox in the commit that ends a run
(``store/ops/webhooks.py``). The relay leases due ones, posts each signed
(``tether.webhooks.sign``) in its own task, up to ``batch`` at once, under one
``timeout`` deadline for the whole post (shorter than the lease), and records the
answer: a 2xx is delivered; anything else, a timeout or a refused connection is tried
again with exponential backoff until ``give_up_after`` seconds have passed since the
run ended (410 Gone, or a URL no client can post to, gives up at once). Whatever goes
wrong with one delivery is that delivery's failed attempt, never the relay's end.
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
        # deliveries run side by side, at most ``batch`` at once, none waiting for another:
        # a receiver slow to answer holds its own post (until the deadline), not the rest
        inflight: dict[asyncio.Task[None], int] = {}
        lease = self._timeout + 5  # a post ends by its deadline, well before its lease
        async with httpx.AsyncClient(timeout=self._timeout, follow_redirects=False) as client:
            try:
                while True:
                    self._wake.clear()
                    room = self._batch - len(inflight)
                    full = False  # the claim took all it could: more may be due at once
                    if room > 0:
                        try:
                            due = await self._app.store.claim_webhooks(room, lease)
                        except Exception:  # a store hiccup must not end delivery for good
                            log.exception("webhook relay: claiming deliveries failed; trying again")
                            due = []
                        full = len(due) >= room
                        busy = set(inflight.values())
                        for row in due:
                            if row[0] in busy:  # its lease ran out while it is still posted
                                continue
                            task = asyncio.create_task(self._deliver(client, row))
                            inflight[task] = row[0]
                    if full and len(inflight) < self._batch:
                        continue
                    # wait for a wake-up, the poll, or (when the claim was full) a free slot
                    waiter = asyncio.ensure_future(self._wake.wait())
                    watched: set[asyncio.Future[Any]] = {waiter}
                    if full or room <= 0:
                        watched.update(inflight)
                    try:
                        await asyncio.wait(
                            watched, timeout=self._poll, return_when=asyncio.FIRST_COMPLETED
                        )
                    finally:
                        waiter.cancel()
                    for task in [t for t in inflight if t.done()]:
                        delivery_id = inflight.pop(task)
                        if not task.cancelled() and task.exception() is not None:
                            log.error(
                                "webhook relay: delivery %s failed",
                                delivery_id,
                                exc_info=task.exception(),
                            )
            finally:  # stopped: deliveries in flight are left to their leases
                for task in inflight:
                    task.cancel()
                await asyncio.gather(*inflight, return_exceptions=True)

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
            # one deadline for the whole post (httpx's timeouts are per read: a receiver
            # sending a byte at a time never trips them); the answer's status line and
            # headers decide, its body is never read
            async with (
                asyncio.timeout(self._timeout),
                client.stream("POST", url, content=body, headers=headers) as resp,
            ):
                code = resp.status_code
        except TimeoutError:
            return f"no answer within {self._timeout:g} s (the deadline of a post)", False
        except httpx.InvalidURL as exc:
            return f"{type(exc).__name__}: {exc}"[:500], True
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}: {exc}"[:500], False
        if 200 <= code < 300:
            return None, False
        return f"HTTP {code}", code == 410
