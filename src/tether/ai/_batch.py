"""Provider batch jobs as durable steps: submit a file of requests, poll on a durable
timer, download the results, resubmit only what failed.

Each provider call is a recorded activity of the gateway (``<gateway>.batch.submit``,
``.poll``, ``.fetch``), so the batch id is in the run's history the moment the
provider accepted it: a worker restarted between submit and completion polls the same
batch, never a second one. A submit whose answer was lost (the worker died after the
provider created the batch) finds its batch again by its key, kept in the batch's
metadata: the step's idempotency key and a random value recorded in the run (so two
stores sharing a provider account never take each other's batch), reading the
provider's list page by page back to the step's time. The whole batch's estimate is
checked against the run's budget and the daily ones before each submit, as a single
call's is, and held in the day's spend of the daily ones (checked and added in one
store transaction) until its results are fetched, when what it used replaces it (a
batch that failed, expired or was cancelled at the provider used nothing: its estimate
is given back); the store records the hold by the submit step in the transaction that
makes it (``ai_holds``), so any later attempt of the step (after a crash or failure, or
a replayed dead letter) reuses it rather than holding it twice. What it used is
recorded as the run's model usage (``app.usage``), counted against the run's budget and
the daily ones, and added to the tenant's daily ledger and the ``tether_ai_*`` counters.
Works with OpenAI's batch API and servers that copy it, through the model's own OpenAI
SDK client (SDK retries off: tether retries).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import secrets
from collections.abc import Mapping
from datetime import timedelta
from decimal import Decimal
from typing import Any

from .._activity_context import activity_context
from .._errors import ActivityError, ConfigurationError
from .._policy import Retry, seconds
from .._serde import encode
from .._usage import CALL_KEY
from .._usage import budget_cost as _budget_cost
from ..workflow._api import sleep
from ..workflow._instance import current_instance
from ._errors import ModelConfigError
from ._gateway import (
    _SENDING,
    EXTENSIONS,
    Gateway,
    ModelRef,
    _check_budget,
    _day,
    _release,
    _Tally,
    count_usage,
    daily_over,
    daily_refusal,
)

#: batch statuses after which polling stops
_DONE = frozenset({"completed", "failed", "expired", "cancelled"})
_ENDPOINT = "/v1/chat/completions"


class BatchError(Exception):
    """A batch job did not finish: its deadline passed, or the provider failed it."""


@dataclasses.dataclass(frozen=True)
class BatchResult:
    """What a batch job gave: answers by custom id, the ids that still failed after the
    resubmits (with why), ids the provider returned that were never asked, and the
    provider's batch ids in order."""

    results: dict[str, str]
    failed: dict[str, str]
    unknown: list[str]
    batches: list[str]


#: the patch marker of a run whose batches carry a value recorded in the run in their
#: key (``run-id:step:<uuid>``), unique across stores sharing a provider account; older
#: runs keep ``run-id:step`` (found again by it)
BATCH_NONCE = "tether.ai.batch-nonce"
#: how long before the submit step was scheduled a batch of it may have been created, by
#: the provider's clock (skew): the search for a lost batch reads no further back
_FIND_MARGIN = 3600.0
#: the most batches a search for a lost batch reads when the step's time is not known
#: (a run recorded before it was)
_FIND_MOST = 10_000


async def _find_again(
    client: Any, key: str, run_id: str, items: int, since: float | None
) -> str | None:
    """The id of the batch this submit step created before a crash lost the answer, if
    any: read page by page (newest first) until batches older than the step; a batch
    counts only if its metadata names this key and run, and it holds ``items`` requests."""
    read = 0
    async for b in client.batches.list(limit=100):
        read += 1
        created = getattr(b, "created_at", None)
        if since is not None and created is not None and created < since - _FIND_MARGIN:
            return None
        if since is None and read > _FIND_MOST:
            return None
        meta = b.metadata or {}
        if meta.get("tether_key") != key or meta.get("tether_run", run_id) != run_id:
            continue
        if meta.get("tether_items", str(items)) != str(items):
            continue
        counts = getattr(b, "request_counts", None)
        total = getattr(counts, "total", 0) if counts is not None else 0
        if total and total != items:
            continue
        return str(b.id)
    return None


class BatchJobs:
    """The batch activities of one gateway (registered with it, on every process)."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        app = gateway.app
        opts: dict[str, Any] = {"retry": Retry(attempts=5, initial=2.0), "timeout": 300.0}
        self.submit = app.activity(name=f"{gateway.name}.batch.submit", **opts)(self._submit)
        self.poll = app.activity(name=f"{gateway.name}.batch.poll", **opts)(self._poll)
        self.fetch = app.activity(name=f"{gateway.name}.batch.fetch", **opts)(self._fetch)
        for step in (self.submit, self.poll, self.fetch):  # as a model step (``_gateway``)
            step.replay_unchecked = frozenset(step.sig.sig.parameters)

    def _client(self, model: str) -> tuple[ModelRef, Any]:
        ref = self.gateway._models.get(model)
        if ref is None:
            raise ModelConfigError(f"model {model!r} is not registered on this gateway")
        client = getattr(self.gateway._resolve(ref), "client", None)
        if client is None or not hasattr(client, "batches"):
            raise ModelConfigError(
                f"model {model!r} has no OpenAI-compatible client: batch jobs need an "
                "OpenAI model or a server with the same batch API"
            )
        return ref, client

    async def _submit(
        self, model: str, items: dict[str, str], options: dict[str, Any]
    ) -> dict[str, Any]:
        ref, client = self._client(model)
        ctx = activity_context()
        key = ctx.idempotency_key
        if options.get("nonce"):  # a value recorded in the run: unique across stores
            key = f"{key}:{options['nonce']}"
        # the store keeps the estimate an attempt of this step holds by the step, written
        # with the hold: a later attempt (after a crash, a retry, a replayed dead letter)
        # reuses it. An attempt of an older build noted it in its heartbeat instead
        holder = secrets.token_hex(8)  # this attempt, as the store's record names it
        noted = _noted_hold(ctx.heartbeat_details)
        if noted:
            await self._hold_daily(ctx, holder, ref, items, options, how="noted", noted=noted)
            await _clear_noted_hold(ctx)
        # in doubt: did this step create its batch before a crash lost the answer?
        found = await _find_again(client, key, ctx.run_id, len(items), options.get("since"))
        if found is not None:
            # the batch exists (it will be paid for): its estimate stays held; held
            # (unchecked) if no attempt of this step holds it now
            held = await self._hold_daily(ctx, holder, ref, items, options, how="add")
            return {"batch_id": found, "found_again": True, **held}
        sending = {"sent": False}
        holding = asyncio.ensure_future(
            self._hold_daily(ctx, holder, ref, items, options, how="check")
        )
        try:
            held = await asyncio.shield(holding)
            batch_id = await self._create(client, ref, key, ctx.run_id, items, options, sending)
        except BaseException as exc:
            # the estimate is given back only when the batch is known not to exist: the
            # create was never sent, or the provider refused it; else it stays held (the
            # batch may run and be billed), kept by the step for the retry to reuse
            refused = getattr(exc, "status_code", None)
            if not sending["sent"] or (isinstance(refused, int) and refused < 500):
                await self._give_back(ctx, holder, holding)
            raise
        return {"batch_id": batch_id, "found_again": False, **held}

    async def _give_back(self, ctx: Any, holder: str, holding: asyncio.Future[Any]) -> None:
        """Give back the estimate this attempt (``holder``) of the submit step holds, once
        ``holding``, the hold it asked for, is written or failed, its record removed with
        it, even when the attempt is cancelled meanwhile (unless a later attempt has the
        step by then: the store refuses a give-back of an attempt that lost its task, and
        the hold is the later attempt's); a failure to write it leaves it held."""
        store = self.gateway._step_store()

        async def release() -> None:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await holding  # written or not: what it wrote (if anything) goes back
            await store.release_model_hold(ctx.run_id, ctx.step, holder, ctx.task)

        giving = asyncio.ensure_future(release())
        _SENDING.add(giving)
        giving.add_done_callback(_SENDING.discard)
        with contextlib.suppress(Exception):
            await asyncio.shield(giving)

    async def _create(
        self,
        client: Any,
        ref: ModelRef,
        key: str,
        run_id: str,
        items: dict[str, str],
        options: dict[str, Any],
        sending: dict[str, bool],
    ) -> str:
        """Upload ``items`` and create their batch; its id. ``sending["sent"]`` turns
        true when the create request may have reached the provider."""
        lines = []
        for cid, prompt in items.items():
            body: dict[str, Any] = {
                "model": ref.model_name,
                "messages": [{"role": "user", "content": prompt}],
            }
            if options.get("max_tokens"):
                body["max_tokens"] = options["max_tokens"]
            lines.append(
                json.dumps({"custom_id": cid, "method": "POST", "url": _ENDPOINT, "body": body})
            )
        upload = await client.files.create(
            file=("tether-batch.jsonl", "\n".join(lines).encode()), purpose="batch"
        )
        sending["sent"] = True
        batch = await client.batches.create(
            input_file_id=upload.id,
            endpoint=_ENDPOINT,
            completion_window=options.get("window", "24h"),
            metadata={"tether_key": key, "tether_run": run_id, "tether_items": str(len(items))},
        )
        return str(batch.id)

    async def _hold_daily(
        self,
        ctx: Any,
        holder: str,
        ref: ModelRef,
        items: dict[str, str],
        options: dict[str, Any],
        *,
        how: str,
        noted: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Hold the batch's whole estimate in today's spend of the daily budgets of its
        run's tenant (and the global one), as a single call's is, recorded by the submit
        step (for its attempt ``holder``) in the same store transaction; or the hold an
        earlier attempt of the step left. ``how``: ``"check"``, checked and added at once
        (``DailyBudgetExceeded`` when it would pass one); ``"add"``, unchecked;
        ``"noted"``, the hold ``noted`` in an older build's heartbeat, recorded only.
        Returns what is held, recorded with the submit (``daily_held``) so the fetch
        replaces it with what the batch used. A run without a tenant sends no estimate:
        the batch is estimated here (the global budget checks it too)."""
        tenant = options.get("tenant")
        scopes, _rows = await self.gateway.daily_scopes(tenant)
        store = self.gateway._step_store()
        if noted is not None:
            got = noted["daily_held"]
            scopes, day, estimate = tuple(got["scopes"]), got["day"], dict(got)
        else:
            day = _day(store.clock())
            estimate = (
                (options.get("estimate") or _estimate(ref, items, options.get("max_tokens")))
                if scopes
                else {}
            )
        cost = estimate.get("cost")
        held, over = await store.hold_model_spend(
            ctx.run_id,
            ctx.step,
            holder,
            scopes,
            day,
            int(estimate.get("tokens") or 0),
            None if cost is None else str(cost),
            how,
            ctx.task,  # a hold that comes after this attempt lost the step is refused
        )
        if over is not None:
            raise daily_over(over, estimate)
        if held is None:
            return {}
        scopes_held, day_held, tokens, cost_held = held
        return {
            "daily_held": {
                "scopes": scopes_held,
                "day": day_held,
                "tokens": tokens,
                "cost": cost_held,
            },
            # the store keeps the hold by step: the fetch's commit gives back what its
            # record still holds (a submit of an older build: ``daily_held``)
            "held_by_step": True,
        }

    async def _poll(self, model: str, batch_id: str) -> dict[str, Any]:
        _ref, client = self._client(model)
        b = await client.batches.retrieve(batch_id)
        counts = b.request_counts.model_dump() if b.request_counts is not None else None
        return {
            "status": b.status,
            "output_file_id": b.output_file_id,
            "error_file_id": b.error_file_id,
            "counts": counts,
        }

    async def _fetch(
        self,
        model: str,
        batch_id: str,
        files: list[str | None],
        asked: list[str],
        options: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        ref, client = self._client(model)
        wanted = set(asked)
        results: dict[str, str] = {}
        errors: dict[str, str] = {}
        unknown: list[str] = []
        tokens_in = tokens_out = 0
        for fid in files:
            if not fid:
                continue
            text = (await client.files.content(fid)).text
            for raw in text.splitlines():
                if not raw.strip():
                    continue
                line = json.loads(raw)
                cid = str(line.get("custom_id"))
                if cid not in wanted:
                    unknown.append(cid)
                    continue
                response = line.get("response") or {}
                body = response.get("body") or {}
                if response.get("status_code") == 200 and body.get("choices"):
                    results[cid] = body["choices"][0]["message"].get("content") or ""
                    usage = body.get("usage") or {}
                    tokens_in += int(usage.get("prompt_tokens") or 0)
                    tokens_out += int(usage.get("completion_tokens") or 0)
                else:
                    err = line.get("error") or body.get("error") or {}
                    errors[cid] = str(err.get("message") or err or "no answer")[:500]
        call = {
            "model": ref.name,
            "model_name": ref.model_name,
            "provider": ref.provider,
            "input_tokens": tokens_in,
            "output_tokens": tokens_out,
            "cache_read_tokens": 0,
            "cost": None,
            "latency_ms": 0.0,
            "finish_reason": "batch",
            "batch_id": batch_id,
            "items": len(results),
        }
        call["cost"], price_error = self.gateway.answer_cost(
            ref, tokens_in, tokens_out, 0, ref.model_name, None
        )
        if price_error is not None:
            call["price_error"] = price_error
        # what the batch used goes to its tenant's day (and the global one) with the
        # commit that records this result, not here: a fetch retried after a crash (its
        # result lost) downloads what was paid for once
        scopes, _rows = await self.gateway.daily_scopes((options or {}).get("tenant"))
        return {
            "results": results,
            "errors": errors,
            "unknown": unknown,
            "daily_scopes": list(scopes),
            CALL_KEY: call,
        }


async def batch(
    model: ModelRef,
    requests: Mapping[str, str],
    *,
    poll: float | timedelta = 60.0,
    max_poll: float | timedelta = 900.0,
    deadline: float | timedelta = 86_400.0,
    resubmits: int = 2,
    max_tokens: int | None = None,
    window: str = "24h",
) -> BatchResult:
    """Run ``requests`` (custom id -> prompt) as the provider's batch job, durably.

    Submits them as one recorded step, polls on durable timers from ``poll`` seconds
    doubling to ``max_poll``, gives up (``BatchError``) when ``deadline`` seconds have
    passed since the first submit, downloads the results, and resubmits only the items
    that failed or are missing, at most ``resubmits`` times. Inside a workflow only.
    """
    inst = current_instance()
    if inst is None:
        raise ConfigurationError("tether.ai.batch runs inside a workflow")
    if not requests:
        return BatchResult({}, {}, [], [])
    jobs: BatchJobs = model.gateway.extensions["batch"]
    first_wait = seconds(poll, "poll") or 60.0
    longest = seconds(max_poll, "max_poll") or first_wait
    give_up = inst.now + (seconds(deadline, "deadline") or 86_400.0)
    todo = dict(requests)
    results: dict[str, str] = {}
    failed: dict[str, str] = {}
    unknown: list[str] = []
    ids: list[str] = []
    started = inst.started
    tenant = (started.data if started is not None else {}).get("tenant")
    tally = inst.spend
    nonce: str | None = None
    for _round in range(resubmits + 1):
        # the whole batch is checked against the run's budget (and, on the worker, the
        # daily ones) before it is submitted, and holds its estimate until it is fetched
        estimate = _estimate(model, todo, max_tokens)
        checked = _check_budget(inst, tally, model, functools.partial(dict, estimate))
        options: dict[str, Any] = {"max_tokens": max_tokens, "window": window}
        if _round == 0 and inst.patched(BATCH_NONCE):
            # a random value recorded in the run makes the batches' key unique beyond
            # this store (drawn once the budget let the first batch go)
            nonce = _recorded_nonce(inst)
        if nonce is not None:
            options.update(nonce=nonce, since=inst.now)
        if tenant is not None:
            options.update(tenant=tenant, estimate=estimate)
        hold = {"tokens": checked["tokens"], "cost": Decimal(checked["cost"] or 0), "held": True}
        tally.reserved_tokens += hold["tokens"]
        tally.reserved_cost += hold["cost"]
        try:
            submit_step = inst.step + 1
            try:
                sub = await jobs.submit(model.name, todo, options)
            except ActivityError as exc:
                if exc.error_type != "DailyBudgetExceeded":
                    raise
                raise daily_refusal(model, exc) from None
            bid = sub["batch_id"]
            ids.append(bid)
            wait = first_wait
            while True:
                state = await jobs.poll(model.name, bid)
                if state["status"] in _DONE:
                    break
                if inst.now + wait > give_up:
                    raise BatchError(
                        f"batch {bid} of model {model.name!r} is still {state['status']} at "
                        "its deadline; its results, if any come, are not collected"
                    )
                await sleep(wait)
                wait = min(wait * 2, longest)
            files = [state.get("output_file_id"), state.get("error_file_id")]
            step = inst.step + 1  # the fetch's step
            got = await jobs.fetch(model.name, bid, files, sorted(todo), {"tenant": tenant})
        finally:
            _release(tally, hold)
        # what the batch used replaces the estimate its submit held in the day (by the run
        # that held it: a submit kept from before a retry or fork leaves it counted)
        held = None if inst.reused(submit_step) else sub.get("daily_held")
        _account(
            inst,
            step,
            model,
            got[CALL_KEY],
            tally,
            got.get("daily_scopes"),
            held,
            submit_step,
            by_step=bool(sub.get("held_by_step")),
        )
        results.update(got["results"])
        unknown.extend(u for u in got["unknown"] if u not in unknown)
        failed = {
            cid: got["errors"].get(cid) or f"missing from batch {bid} ({state['status']})"
            for cid in todo
            if cid not in got["results"]
        }
        todo = {cid: todo[cid] for cid in failed}
        if not todo:
            break
    return BatchResult(results=results, failed=failed, unknown=unknown, batches=ids)


def _noted_hold(details: Any) -> dict[str, Any]:
    """The estimate an attempt of the submit step by an older build noted it holds
    (``daily_held`` in its last heartbeat's details), or ``{}``."""
    got = details.get("daily_held") if isinstance(details, dict) else None
    return {"daily_held": got} if isinstance(got, dict) else {}


async def _clear_noted_hold(ctx: Any) -> None:
    """Clear the hold an older build's attempt noted in the submit step's heartbeat, once
    the store keeps it by step (awaited: a note left would be taken for a hold again
    after this attempt gave it back). Outside a worker there is nothing to clear."""
    if ctx._store is None or ctx.task is None:
        return
    note = {"daily_held": None}
    ctx.heartbeat_details = note
    await ctx._beat(encode(note, "heartbeat details"))


def _recorded_nonce(inst: Any) -> str:
    """A random value for the batch's key, recorded as the marker ``batch_key`` and read
    back on replay (``tether.uuid`` is seeded by the run id: two stores would draw the
    same)."""
    rec = inst.recorded_next()
    recorded = rec.data.get("value") if rec is not None else None
    if isinstance(recorded, dict) and isinstance(recorded.get("nonce"), str):
        nonce = recorded["nonce"]
    else:
        nonce = secrets.token_hex(8)
    inst.record("batch_key", {"nonce": nonce})
    return str(nonce)


def _estimate(model: ModelRef, items: Mapping[str, str], max_tokens: int | None) -> dict[str, Any]:
    """Tokens and cost a batch of ``items`` may use: each item's estimate, summed."""
    settings: Any = {"max_tokens": max_tokens} if max_tokens else None
    tokens_in = tokens_out = 0
    for prompt in items.values():
        i, o = model.estimated_tokens([{"role": "user", "content": prompt}], settings)
        tokens_in, tokens_out = tokens_in + i, tokens_out + o
    cost = model.gateway.price_of(model, tokens_in, tokens_out, 0, None, None)
    return {"tokens": tokens_in + tokens_out, "cost": cost}


def _account(
    inst: Any,
    step: int,
    model: ModelRef,
    call: dict[str, Any],
    tally: _Tally,
    daily: list[str] | None = None,
    held: dict[str, Any] | None = None,
    submit_step: int = 0,
    *,
    by_step: bool = False,
) -> None:
    """A fetched batch's tokens and cost: in the run's budget tally (on replay too, as a
    call's are), and in the tenant's daily ledger, the daily budgets' spend of ``daily``
    (its scopes; None: a fetch recorded before, which added them itself) and the
    ``tether_ai_*`` counters, as a single call's are (once, when the run first meets
    the fetch's result: never on replay, nor for a result kept from before a retry or
    fork), the estimate the submit (at ``submit_step``) ``held`` in the day given back in
    the same commit: what the store's record of the hold still holds (``by_step``: a
    submit of this build; a hold given back already is not subtracted again), else (an
    older build's submit) ``held`` as it recorded it."""
    inputs, outputs = int(call.get("input_tokens") or 0), int(call.get("output_tokens") or 0)
    tally.tokens += inputs + outputs
    tally.cost += _budget_cost(call)
    if inst.reused(step):
        return
    started = inst.started
    tenant = (started.data if started is not None else {}).get("tenant")
    labels = (inst.workflow.name, model.name, tenant or "")
    cost = Decimal(call["cost"]) if call.get("cost") is not None else None
    inst.count("tether_ai_calls", (*labels, "batch"), int(call.get("items") or 0))
    count_usage(inst, labels, inputs, outputs, cost)
    if held and by_step:
        inst.settle_hold(submit_step)
    elif held:
        inst.tally_spend(
            tuple(held["scopes"]), -int(held["tokens"]), -Decimal(held["cost"]), held["day"]
        )
    if daily:
        inst.tally_spend(tuple(daily), inputs + outputs, _budget_cost(call))


def _register(gateway: Gateway) -> None:
    gateway.extensions["batch"] = BatchJobs(gateway)


EXTENSIONS.append(_register)
