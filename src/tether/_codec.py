"""How the store keeps payload text: large ones in the blob store, sealed when encrypted.

Every payload the store writes (event data, run input and output, task arguments...)
passes ``Codec.encode``: text above ``offload_above`` bytes goes to the blob store and
the row keeps a reference (``~b1:sha256:<hex>:<size>``, the hash of the stored bytes);
with a keyring the text, or the blob, is sealed (``tether.encryption``). Reading
reverses it (``decode_text``). JSON never starts with ``~``, so values written before
either was turned on read as they are.
"""

from __future__ import annotations

import json
from typing import Any

from ._redact import made_by_engine, marked_like
from .blobs import Blob, BlobError, BlobStore
from .encryption import PREFIX as SEALED
from .encryption import Sealer, no_keyring

#: what a reference to an offloaded payload starts with
OFFLOADED = "~b1:"
#: what a payload the codec changed starts with (a plain one never does)
MARKS = (SEALED, OFFLOADED)
#: offload payloads larger than this by default (bytes of UTF-8)
OFFLOAD_ABOVE = 256 * 1024
#: what the keys of an event's sealed fields start with (``"~result"`` holds ``result``
#: sealed; tether's own keys never start with ``~``, so it cannot clash with one). A
#: field named ``"~"`` alone holds several sealed together (as the first encrypting
#: version wrote them).
SEALED_FIELD = "~"
#: the keys of event data that may carry a user's words (besides the payloads): sealed
SECRET_KEYS = frozenset({"error", "reason", "message", "traceback", "note", "detail", "decision"})
#: the keys of event data that hold payloads (pre-encoded when written)
PAYLOAD_KEYS = frozenset({"args", "kwargs", "result", "input", "output", "value", "payload"})
#: the pre-encoded parts of event data that are tether's bookkeeping, not payloads
PLAIN_RAW = frozenset({"through", "time", "attempt"})


class Codec:
    """A store's payload codec: offload to ``blobs`` above a size, seal with ``sealer``."""

    def __init__(
        self,
        sealer: Sealer | None = None,
        blobs: BlobStore | None = None,
        offload_above: int | None = OFFLOAD_ABOVE,
    ) -> None:
        self.sealer = sealer
        self.blobs = blobs
        self.offload_above = offload_above if blobs is not None else None
        #: whether payloads are sealed per tenant (the writer then needs the run's tenant)
        self.per_tenant = sealer is not None and sealer.keyring.per_tenant
        #: the tenant of each run written lately (per-tenant keys): run id -> tenant
        self.tenants: dict[str, str | None] = {}

    def learned(self, tenants: dict[str, str | None]) -> None:
        """Note the run tenants a committed transaction read or wrote (``_Tx.learn``)."""
        if len(self.tenants) + len(tenants) > 100_000:
            self.tenants.clear()
        self.tenants.update(tenants)

    def encode(self, text: str, tenant: str | None = None, *, offload: bool = False) -> str:
        """``text`` as the store keeps it; ``offload``: in the blob store whatever its
        size (a payload offloaded once stays so when sealed again: ``reseal``)."""
        # the bound is in bytes of UTF-8 (up to 4 a character): text of more than a
        # quarter of it may be over, so it is encoded to be sure
        offload = offload and self.blobs is not None
        if offload or (self.offload_above is not None and len(text) * 4 > self.offload_above):
            assert self.blobs is not None
            data = text.encode()
            if offload or (self.offload_above is not None and len(data) > self.offload_above):
                if self.sealer is not None:
                    data = self.sealer.seal_bytes(data, tenant)
                blob = self.blobs.put(data, sealed=True)
                return f"{OFFLOADED}{blob.ref}:{blob.size}"
        if self.sealer is not None:
            return self.sealer.seal(text, tenant)
        return text


def open_fields(codec: Codec | None, data: dict[str, Any], where: str) -> dict[str, Any]:
    """Event data with its sealed fields (``SEALED_FIELD``...) opened and put back."""
    for key in [k for k, v in data.items() if k[:1] == SEALED_FIELD and isinstance(v, str)]:
        value = json.loads(decode_text(codec, data.pop(key), where))
        if key == SEALED_FIELD:  # several fields sealed together
            data.update(value)
        else:
            data[key[1:]] = value
    return data


def sealed_keys(data: dict[str, Any]) -> list[str]:
    """The keys of an event's sealed fields (``"~args"``...; ``open_fields`` opens them)."""
    return [k for k, v in data.items() if k[:1] == SEALED_FIELD and isinstance(v, str)]


def sealed_fields(data: dict[str, Any]) -> list[str]:
    """The sealed values among an event's data (``open_fields`` opens them)."""
    return [v for k, v in data.items() if k[:1] == SEALED_FIELD and isinstance(v, str)]


def decode_text(codec: Codec | None, text: str, where: str) -> str:
    """The payload ``text`` stands for: opened if sealed, fetched if offloaded.

    A sealed value without a keyring, an unknown or destroyed key, a missing or changed
    blob: each is an error naming ``where`` (the run and step), never a wrong value.
    """
    if not text.startswith(MARKS):
        return text
    sealer = codec.sealer if codec is not None else None
    if text.startswith(SEALED):
        if sealer is None:
            raise no_keyring(text, where)
        text = sealer.open(text, where)
    if not text.startswith(OFFLOADED):
        return text
    ref, _, size = text[len(OFFLOADED) :].rpartition(":")
    blobs = codec.blobs if codec is not None else None
    if blobs is None:
        raise made_by_engine(
            BlobError(ref, f"{where}: kept in a blob store this process has not opened")
        )
    try:
        data = blobs.get(Blob(ref=ref, size=int(size)), sealed=True)
    except BlobError as exc:
        again = BlobError(ref, f"{where}: {exc.problem}")
        raise marked_like(again, exc) from None
    if data.startswith(SEALED.encode()):
        if sealer is None:
            raise no_keyring(data, where)
        data = sealer.open_bytes(data, where)
    return data.decode()
