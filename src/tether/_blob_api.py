"""Reading and writing blobs from inside an activity (``tether.put_blob``,
``tether.read_blob``): the App's blob store, found through the activity's context."""

from __future__ import annotations

from typing import Any

from ._activity_context import activity_context
from ._errors import ConfigurationError
from .blobs import Blob, BlobStore


def put_blob(data: bytes, media_type: str | None = None) -> Blob:
    """Inside an activity: store ``data`` in the App's blob store; return its reference
    (return that from the activity: the history records only the reference). With
    per-tenant keys, a document put by a tenant's run is sealed under the tenant's key,
    apart from other tenants' copies of the same bytes (shredded with the tenant)."""
    return _blobs().put(data, media_type, tenant=activity_context()._tenant)


def read_blob(blob: Blob | dict[str, Any]) -> bytes:
    """Inside an activity: the bytes of ``blob`` (``BlobError`` if missing, damaged or
    sealed under a key this keyring lacks: the step fails and retries, so restoring the
    blob or the key lets the run go on)."""
    return _blobs().get(blob)


def _blobs() -> BlobStore:
    store = activity_context()._store
    blobs = getattr(store, "blobs", None)
    if blobs is None:
        raise ConfigurationError("this App has no blob store (App(blobs=...))")
    return blobs  # type: ignore[no-any-return]
