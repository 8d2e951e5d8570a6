"""API keys of the HTTP service: created, looked up, listed and revoked."""

from __future__ import annotations

from typing import Any

from ._tx import _Tx

_KEY_COLS = "key_id, secret_hash, name, tenant, role, created_at, revoked_at"


def _create_api_key(
    tx: _Tx, key_id: str, secret_hash: str, name: str | None, tenant: str | None, role: str
) -> None:
    tx.execute(
        "INSERT INTO api_keys (key_id, secret_hash, name, tenant, role, created_at) "
        "VALUES (?, ?, ?, ?, ?, ?)",
        (key_id, secret_hash, name, tenant, role, tx.now),
    )


def _api_key(tx: _Tx, key_id: str) -> tuple[Any, ...] | None:
    row = tx.execute(f"SELECT {_KEY_COLS} FROM api_keys WHERE key_id = ?", (key_id,)).fetchone()
    return tuple(row) if row else None


def _list_api_keys(tx: _Tx) -> list[tuple[Any, ...]]:
    rows = tx.execute(f"SELECT {_KEY_COLS} FROM api_keys ORDER BY created_at, key_id").fetchall()
    return [tuple(r) for r in rows]


def _revoke_api_key(tx: _Tx, key_id: str) -> bool:
    row = tx.execute(
        "UPDATE api_keys SET revoked_at = ? WHERE key_id = ? AND revoked_at IS NULL "
        "RETURNING key_id",
        (tx.now, key_id),
    ).fetchone()
    return row is not None


def _has_api_keys(tx: _Tx) -> bool:
    row = tx.execute("SELECT 1 FROM api_keys WHERE revoked_at IS NULL LIMIT 1").fetchone()
    return row is not None
