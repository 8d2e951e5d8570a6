"""Sealing stored payloads again under the current keys (``tether store reseal``).

After a key rotation, data sealed under the old key stays readable as long as the
key is kept; to retire the key, every value sealed under it is rewritten under the
current one. The same pass seals values written before encryption was turned on. It
walks one table at a time in primary-key order, a batch per transaction, and writes a
value only if it is still what it read (a worker writing the row meanwhile wrote it
sealed under the current key already). An offloaded payload (``~b1:``) whose blob is
sealed under an older key (or not at all) is written again, to a new blob under a new
reference; the caller deletes the old blobs nothing refers to any more.
"""

from __future__ import annotations

import json
from typing import Any, cast

from ..._codec import (
    MARKS,
    OFFLOADED,
    PAYLOAD_KEYS,
    SEALED_FIELD,
    SECRET_KEYS,
    decode_text,
    open_fields,
    sealed_fields,
    sealed_keys,
)
from ..._serde import dumps
from ...blobs import BlobError
from ...encryption import PREFIX as SEALED
from ._tx import _Tx

#: each table with payload columns: its key columns and its payload columns
TABLES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "runs": (("run_id",), ("input", "output", "error", "custom_status", "task_error")),
    "events": (("run_id", "seq"), ("data",)),
    "tasks": (("task_id",), ("payload", "heartbeat", "last_error")),
    "dead_letters": (("id",), ("input", "error", "resolution")),
    "approvals": (("approval_id",), ("proposal", "reason")),
    "debounces": (("debounce_key",), ("input",)),
    "schedules": (("schedule_id",), ("input",)),
    "webhook_outbox": (("delivery_id",), ("output", "error")),
    "ai_cache": (("cache_key",), ("value",)),
}
#: columns holding an error's JSON (sealed with its types outside: ``_Tx.seal_error``)
_ERRORS = {("runs", "error"), ("tasks", "last_error"), ("dead_letters", "error")}
_ERRORS.add(("webhook_outbox", "error"))
#: an event offloaded whole, sealed again field by field: its payloads at least this
#: long (JSON characters) stay offloaded
KEEP_OFFLOADED = 1024
#: tables whose rows name a run (sealed under the run's tenant's key)
_BY_RUN = {"runs", "events", "tasks", "dead_letters", "approvals", "webhook_outbox"}


def _reseal_batch(
    tx: _Tx, table: str, after: list[Any] | None, limit: int
) -> tuple[int, list[Any] | None]:
    """Reseal up to ``limit`` rows of ``table`` after key ``after``; (values rewritten,
    the last key seen, None when the table is done)."""
    keys, columns = TABLES[table]
    where, args = "", cast(tuple[Any, ...], ())
    if after is not None:
        if len(keys) == 1:
            where, args = f" WHERE {keys[0]} > ?", (after[0],)
        else:
            # a row value, which both stores seek in the key's index (the equivalent
            # ``a > ? OR (a = ? AND b > ?)`` made SQLite scan the table from its start
            # for every batch: a whole reseal was quadratic in the history's size)
            where = f" WHERE ({keys[0]}, {keys[1]}) > (?, ?)"
            args = (after[0], after[1])
    order = ", ".join(keys)
    rows = tx.execute(
        f"SELECT {order}, {', '.join(columns)}{', run_id' if table in _BY_RUN else ''} "
        f"FROM {table}{where} ORDER BY {order} LIMIT ?",
        (*args, limit),
    ).fetchall()
    rewritten = 0
    for row in rows:
        key = list(row[: len(keys)])
        run_id = row[-1] if table in _BY_RUN else None
        for i, column in enumerate(columns):
            old = row[len(keys) + i]
            if not isinstance(old, str):
                continue
            new = _resealed(tx, table, column, old, run_id)
            if new is None or new == old:
                continue
            match = " AND ".join(f"{k} = ?" for k in keys)
            tx.execute(
                f"UPDATE {table} SET {column} = ? WHERE {match} AND {column} = ?",
                (new, *key, old),
            )
            rewritten += 1
    last = list(rows[-1][: len(keys)]) if len(rows) == limit else None
    return rewritten, last


def _stale(tx: _Tx, sealed: str, run_id: str | None) -> bool:
    """Whether a sealed (or offloaded) value's key is not the one new values of its run
    get: an offloaded value by the head of its blob (a plain blob is stale too)."""
    codec = tx.codec
    assert codec is not None and codec.sealer is not None
    if sealed.startswith(OFFLOADED):
        if codec.blobs is None:
            return False  # no blob store opened here: left as it is
        ref = sealed[len(OFFLOADED) :].rpartition(":")[0]
        try:
            head = codec.blobs.head(ref).decode("ascii", "replace")
        except BlobError:
            return False  # gone already: nothing to rewrite it from
        if not head.startswith(SEALED):
            return True
        sealed = head
    key_id = sealed[len(SEALED) :].split(":", 1)[0]
    tenant = tx.tenant_of(run_id) if run_id is not None and codec.per_tenant else None
    return key_id != codec.sealer.keyring.current(tenant)


def _resealed(tx: _Tx, table: str, column: str, old: str, run_id: str | None) -> str | None:
    """``old`` sealed under the current key, or None to leave it."""
    where = f"{table}.{column} of run {run_id!r}" if run_id else f"{table}.{column}"
    if (table, column) == ("dead_letters", "resolution") and _claim(old):
        return None
    if table == "events":
        return _resealed_event(tx, old, run_id or "", where)
    if old.startswith(MARKS):
        if not _stale(tx, old, run_id):
            return None
        offloaded = old.startswith(OFFLOADED)
        old = decode_text(tx.codec, old, where)
        if (table, column) not in _ERRORS:
            # offloaded once, offloaded still: this process's threshold may be higher
            return tx.seal(old, run_id, offload=offloaded)
    if (table, column) in _ERRORS:
        value = json.loads(old)
        sealed = value.get("sealed") if isinstance(value, dict) else None
        if isinstance(sealed, str):
            if not _stale(tx, sealed, run_id):
                return None
            return tx.seal_error(decode_text(tx.codec, sealed, where), run_id)
        return tx.seal_error(old, run_id)
    return tx.seal(old, run_id)


def _claim(resolution: str) -> bool:
    """Whether a letter's resolution is a replay's claim (``replaying``, live or left by
    an earlier version): it stays plain, since the replay (and a take-over of a stale
    one) finds its letter by the claim's text; a claim holds no payload."""
    if resolution.startswith(MARKS):
        return False
    try:
        value = json.loads(resolution)
    except ValueError:
        return False
    return isinstance(value, dict) and value.get("state") == "replaying"


def _resealed_event(tx: _Tx, old: str, run_id: str, where: str) -> str | None:
    """An event's data with its payloads and free text sealed under the current key,
    each in a field of its own (``_Tx.data``); None if it is so already."""
    whole = old.startswith(MARKS)  # offloaded (or sealed) whole: written without a keyring
    data = json.loads(decode_text(tx.codec, old, where) if whole else old)
    sealed = sealed_fields(data)
    plain = [k for k in data if k in SECRET_KEYS or k in PAYLOAD_KEYS]
    if (
        not whole
        and not plain
        and all(not _stale(tx, s, run_id) for s in sealed)
        and SEALED_FIELD not in data
    ):
        return None
    # the payloads that were offloaded stay so (this process's threshold may be higher
    # than the writer's): a field's own reference, or, for an event offloaded whole, its
    # payloads of KEEP_OFFLOADED bytes or more
    offloaded = {k[1:] for k in sealed_keys(data) if str(data[k]).startswith(OFFLOADED)}
    open_fields(tx.codec, data, where)
    raw = {k: dumps(data.pop(k)) for k in list(data) if k in PAYLOAD_KEYS}
    if whole and old.startswith(OFFLOADED):
        offloaded |= {k for k, v in raw.items() if len(v) >= KEEP_OFFLOADED}
    return tx.data(run_id, data, raw, frozenset(offloaded))


def _seal_keys(tx: _Tx) -> dict[str, str]:
    """Each key id the store was sealed under, with its key's fingerprint (not the row
    an upgrade writes for payloads sealed before fingerprints were kept: id ``''``)."""
    rows = tx.execute(
        "SELECT key_id, fingerprint FROM seal_keys WHERE key_id <> '' ORDER BY key_id"
    ).fetchall()
    return {key_id: fingerprint for key_id, fingerprint in rows}
