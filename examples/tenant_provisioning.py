"""Tenant provisioning in waves, against a (simulated) cloud provider that is slow.

network -> database and storage in parallel -> app -> DNS -> readiness, then activation
as its own step. Each resource is created once (an idempotency key per step), then
polled on durable timers (a worker may restart between polls; nothing is held in
memory) until it is ready or its deadline passes. If a wave fails, what was built is
torn down, newest first (a saga); a teardown that fails too leaves the run
``needs_intervention`` for an operator instead of pretending it cleaned up.

    python examples/tenant_provisioning.py [--fail storage] [--stuck-teardown]
    (TETHER_EXAMPLE_STORE: the store)
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile

import tether
import tether.testing

STORE = os.environ.get("TETHER_EXAMPLE_STORE") or f"{tempfile.mkdtemp()}/provisioning.db"
app = tether.App(store=STORE)

#: the provider: resource -> state; creations by idempotency key (to prove "once")
PROVIDER: dict[str, dict[str, object]] = {}
CREATIONS: dict[str, int] = {}
FAULTS = {"fail": "", "stuck_teardown": False}
POLLS_UNTIL_READY = 3  # each resource needs a few polls (minutes, in life)


@app.activity(retry=tether.Retry(attempts=5, initial=0.1))
def create(tenant: str, kind: str) -> str:
    """Ask the provider to create a resource; a repeat of the same key is the same one."""
    key = tether.activity_context().idempotency_key
    CREATIONS[key] = CREATIONS.get(key, 0) + (0 if key in CREATIONS else 1)
    name = f"{tenant}-{kind}"
    PROVIDER.setdefault(name, {"state": "creating", "polls": 0})
    return name


@app.activity
def status(name: str) -> str:
    """Poll the provider: creating, ready or failed."""
    res = PROVIDER[name]
    res["polls"] = int(res["polls"]) + 1  # type: ignore[call-overload]
    if FAULTS["fail"] and name.endswith(str(FAULTS["fail"])):
        res["state"] = "failed"
    elif int(res["polls"]) >= POLLS_UNTIL_READY:  # type: ignore[call-overload]
        res["state"] = "ready"
    return str(res["state"])


@app.activity(retry=tether.Retry(attempts=2, initial=0.1))
def teardown(name: str) -> None:
    """Delete a resource (also one still being created: the provider cancels it)."""
    if FAULTS["stuck_teardown"] and name.endswith("network"):
        raise RuntimeError(f"provider refuses to delete {name}: dependent resources remain")
    PROVIDER.pop(name, None)


@app.activity
def activate(tenant: str) -> str:
    return f"{tenant} is live"


async def build(tenant: str, kind: str, saga: tether.Saga) -> str:
    """Create one resource and wait (durably) until it is ready; undo registered first,
    so even one still being created when something fails is torn down."""
    name = await create(tenant, kind)
    saga.add_undo(lambda: teardown(name), name=f"teardown {name}")
    for _ in range(20):  # poll every 30 s for at most 10 minutes
        state = await status(name)
        if state == "ready":
            return name
        if state == "failed":
            raise RuntimeError(f"the provider failed to create {name}")
        await tether.sleep(30)
    raise TimeoutError(f"{name} was not ready within 10 minutes")


@app.workflow
async def provision(tenant: str) -> str:
    async with tether.saga() as saga:
        await build(tenant, "network", saga)
        await tether.gather(build(tenant, "database", saga), build(tenant, "storage", saga))
        await build(tenant, "app", saga)
        await build(tenant, "dns", saga)
    return await activate(tenant)  # only once everything is ready


async def main() -> str:
    async with tether.testing.Env(app) as env:
        run = await app.start(provision, "acme")
        try:
            result = await run.result(timeout=60)
        except (tether.WorkflowFailedError, tether.RunNeedsInterventionError) as exc:
            result = f"{type(exc).__name__}: {exc}"
        print(f"virtual time: {env.skipped:.0f} s")
    return result


if __name__ == "__main__":
    if "--fail" in sys.argv:
        FAULTS["fail"] = sys.argv[sys.argv.index("--fail") + 1]
    FAULTS["stuck_teardown"] = "--stuck-teardown" in sys.argv
    print(asyncio.run(main()))
    print(f"left at the provider: {sorted(PROVIDER)}")
    print(f"creations per key: {sorted(set(CREATIONS.values()))}")
