"""Large payloads by reference: a content-addressed blob store beside the history.

A 50 MB document should never pass through a run's history (or workflow code). An
activity writes it with ``tether.put_blob(data)`` and returns the ``Blob`` (a hash, a
size, a media type); the history records only that reference, and the next activity
reads the bytes back with ``tether.read_blob(blob)``, which checks them against the
hash. The store is a directory beside a SQLite file (``tether.db.blobs``) by default,
or any place ``App(blobs="s3://bucket/prefix")`` names (``fsspec``, the ``blobs``
extra). Blobs are written before the commit that refers to them; one written by an
attempt that crashed before its commit is an orphan, removed by ``tether store gc-blobs``
once it is older than a grace period (so blobs of attempts still running are kept).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import os
import re
import tempfile
import time
from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel, Field

from ._errors import ConfigurationError, TetherError
from ._redact import made_by_engine, marked_like
from .encryption import PREFIX, KeyUnavailableError, Sealer, no_keyring

SEALED = PREFIX.encode()

#: a reference as it appears in histories: ``sha256:<64 hex digits>``
REF = re.compile(r"sha256:[0-9a-f]{64}")
#: what the bytes sealed in a tenant's ``put_blob`` document start with (inside the
#: sealing): this, the tenant as JSON, a newline, then the document. The blob is named
#: by the hash of all of it, so two tenants' copies of the same bytes are two blobs, each
#: sealed under its tenant's key (and erased, or shredded, with it)
TENANT_FRAME = b"~tb1:"


def framed(tenant: str, data: bytes) -> bytes:
    """``data`` as a tenant's blob keeps it (inside its sealing): ``TENANT_FRAME``."""
    return TENANT_FRAME + json.dumps(tenant).encode() + b"\n" + data


def unframed(data: bytes) -> tuple[str | None, bytes]:
    """(tenant, document) of bytes ``framed`` made; (None, ``data``) for any others."""
    if data.startswith(TENANT_FRAME):
        head, sep, rest = data[len(TENANT_FRAME) :].partition(b"\n")
        with contextlib.suppress(ValueError):
            tenant = json.loads(head) if sep else None
            if isinstance(tenant, str):
                return tenant, rest
    return None, data


def _key_id(head: bytes) -> str | None:
    """The id of the key a blob's first bytes say it is sealed under (None: plain)."""
    if not head.startswith(SEALED):
        return None
    return head[len(SEALED) :].split(b":", 1)[0].decode("ascii", "replace")


class Blob(BaseModel):
    """A reference to bytes in the blob store: what a history holds instead of them."""

    ref: str = Field(pattern=REF.pattern, description="sha256:<hex> of the bytes")
    size: int = Field(ge=0)
    media_type: str | None = None


class BlobError(TetherError):
    """A blob could not be read as recorded: missing, or not the bytes its hash names."""

    def __init__(self, ref: str, problem: str) -> None:
        super().__init__(f"blob {ref}: {problem}")
        self.ref, self.problem = ref, problem

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.ref, self.problem))


class BlobStore:
    """Content-addressed bytes under ``root`` (a directory, or an fsspec URL)."""

    def __init__(self, root: str) -> None:
        #: seals the bytes of blobs put from now on (``tether.encryption``); None: plain
        self.sealer: Sealer | None = None
        #: the default of a store with no file of its own (``./tether-blobs``): maybe
        #: other stores' blobs too, so nothing is deleted from it (``default_root``)
        self.shared = False
        self.root = root.rstrip("/")
        self._fs: Any = None
        if "://" in root and not root.startswith("file://"):
            try:
                fsspec = importlib.import_module("fsspec")
            except ImportError:
                raise ConfigurationError(
                    f"blob store {root!r} needs fsspec: pip install 'tether[blobs]' (plus "
                    "the filesystem's own package, e.g. s3fs)"
                ) from None
            self._fs, self.root = fsspec.core.url_to_fs(root)
        else:
            self.root = root.removeprefix("file://")  # made on the first put

    @property
    def shown_root(self) -> str:
        """``root`` as messages show it: a password in a URL's user info masked (these
        messages are logged and shown whole, to every role: they carry no payload)."""
        return re.sub(r"(://[^/@:]*):[^/@]*@", r"\1:***@", self.root)

    def _path(self, digest: str) -> str:
        return f"{self.root}/sha256/{digest[:2]}/{digest[2:]}"

    def put(
        self,
        data: bytes,
        media_type: str | None = None,
        *,
        sealed: bool = False,
        tenant: str | None = None,
    ) -> Blob:
        """Store ``data`` (once per content) and return its reference.

        With a sealer (encryption on) the bytes are kept sealed under the hash of the
        plain ones; ``sealed``: ``data`` is already as it is to be kept (the store's
        offloaded payloads, sealed per tenant), and its own hash names it. ``tenant``,
        with per-tenant keys: the document is the tenant's, sealed under its key and
        named by the hash of it and the tenant together (``framed``), apart from any
        other tenant's copy, so erasing the tenant shreds every copy of it.
        """
        size = len(data)
        per_tenant = not sealed and self.sealer is not None and self.sealer.keyring.per_tenant
        if per_tenant and tenant is not None:
            data = framed(tenant, data)
        else:
            tenant = None
            if per_tenant and data.startswith(TENANT_FRAME):
                # it would be named as a tenant's document is, under the shared key: the
                # tenant's own put of it would then find it there and leave it unshredded
                raise made_by_engine(
                    BlobError(
                        f"sha256:{hashlib.sha256(data).hexdigest()}",
                        f"a document beginning {TENANT_FRAME.decode()!r} (how a tenant's "
                        "documents are framed) cannot be put without a tenant with per-"
                        "tenant keys: put it for its tenant (tenant=...), or change its "
                        "first bytes",
                    )
                )
        digest = hashlib.sha256(data).hexdigest()
        if self.sealer is not None and not sealed:
            data = self.sealer.seal_bytes(data, tenant)
        path = self._path(digest)
        blob = Blob(ref=f"sha256:{digest}", size=size, media_type=media_type)
        # a blob that is there already, intact, gets a new modification time: a reference
        # to it is about to be committed, and gc spares blobs younger than its grace
        # period. A damaged one is written anew: putting the bytes again restores it.
        if self._fs is not None:
            if (
                not self._fs.exists(path)
                or not self._intact(blob, sealed)
                or not self._own(blob, tenant)
            ):
                self._fs.pipe_file(path, data)
            else:
                with contextlib.suppress(Exception):  # not every filesystem can touch
                    self._fs.touch(path, truncate=False)
        elif os.path.exists(path) and self._intact(blob, sealed) and self._own(blob, tenant):
            with contextlib.suppress(OSError):
                os.utime(path)
        else:
            self._write(path, data)
        return blob

    def _own(self, blob: Blob, tenant: str | None) -> bool:
        """Whether a stored tenant's document is sealed under one of ``tenant``'s keys
        (bytes named as its are, put under another key by an older version or by hand,
        would stay readable after its erasure: they are written anew)."""
        if tenant is None or self.sealer is None:
            return True
        key_id = _key_id(self.head(blob.ref))
        keyring = self.sealer.keyring
        if key_id == keyring.current(tenant):
            return True
        return key_id in (keyring.tenant_keys(tenant) or ())

    def _write(self, path: str, data: bytes) -> None:
        if self._fs is not None:
            self._fs.pipe_file(path, data)
            return
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)  # whole or not at all, whoever writes it first
        except BaseException:
            if os.path.exists(tmp):
                os.remove(tmp)
            raise

    def reseal(self, ref: str) -> bool:
        """Seal a blob again, in place, under the current key (of its tenant, for a
        tenant's document: ``framed``), if it is plain or sealed under another key: one
        ``put_blob`` wrote, named by the hash of what is sealed, so every reference to it
        holds. Offloaded payloads' blobs (named by the bytes as kept) are left to the
        store's reseal, which moves them to new blobs. One sealed under a destroyed key
        (a shredded tenant's) is left as it is. Whether it was rewritten."""
        assert self.sealer is not None
        keyring = self.sealer.keyring
        head = self.head(ref)
        if head.startswith(f"{PREFIX}{keyring.current(None)}:".encode()):
            return False  # (a tenant's document is never sealed under the shared key)
        digest = ref.removeprefix("sha256:")
        data = self.kept(ref)
        if data.startswith(SEALED) and hashlib.sha256(data).hexdigest() == digest:
            return False  # an offloaded payload's
        try:
            inner = self.sealer.open_bytes(data, f"blob {ref}")
        except KeyUnavailableError as exc:
            if exc.destroyed:
                return False  # shredded: nothing can read it, nor seal it again
            raise
        if hashlib.sha256(inner).hexdigest() != digest:
            raise made_by_engine(
                BlobError(ref, "the stored bytes do not match the hash: left as they are")
            )
        tenant = unframed(inner)[0] if keyring.per_tenant else None
        owned = keyring.tenant_keys(tenant) if tenant is not None else None
        if owned is not None and _key_id(head) not in owned:
            tenant = None  # framed bytes sealed under no key of that tenant: not its
        if tenant is not None and head.startswith(f"{PREFIX}{keyring.current(tenant)}:".encode()):
            return False
        self._write(self._path(digest), self.sealer.seal_bytes(inner, tenant))
        return True

    def sealed_payload(self, ref: str) -> bool:
        """Whether the blob is a sealed offloaded payload (named by its bytes as kept,
        which ``put_blob``'s sealed blobs never are)."""
        if not self.head(ref, len(SEALED)).startswith(SEALED):
            return False
        return hashlib.sha256(self.kept(ref)).hexdigest() == ref.removeprefix("sha256:")

    def kept(self, ref: str) -> bytes:
        """A blob's bytes as kept (sealed or not, unchecked): to copy it to another blob
        store (``tether store migrate``). ``BlobError`` if missing."""
        path = self._path(ref.removeprefix("sha256:"))
        try:
            if self._fs is not None:
                return bytes(self._fs.cat_file(path))
            with open(path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            raise made_by_engine(
                BlobError(ref, f"missing from the blob store at {self.shown_root!r}")
            ) from None

    def keep(self, ref: str, data: bytes, mtime: float | None = None) -> None:
        """Store bytes as ``kept`` read them from another blob store, under ``ref``;
        ``mtime``: the source's modification time, kept where the filesystem allows (a
        pending deletion skips a blob "put again since", and gc spares young ones)."""
        path = self._path(ref.removeprefix("sha256:"))
        self._write(path, data)
        if mtime is not None and self._fs is None:
            with contextlib.suppress(OSError):
                os.utime(path, (mtime, mtime))

    def _intact(self, blob: Blob, sealed: bool) -> bool:
        """Whether the stored bytes of ``blob`` still match its hash (read in full)."""
        try:
            self.get(blob, sealed=sealed)
        except Exception:  # damaged, truncated, a header no key opens: write it anew
            return False
        return True

    def get(self, blob: Blob | dict[str, Any], *, sealed: bool = False) -> bytes:
        """The bytes of ``blob``, checked against its hash and size (opened first if
        sealed; ``sealed``: as kept, for the store's offloaded payloads)."""
        b = blob if isinstance(blob, Blob) else Blob.model_validate(blob)
        digest = b.ref.removeprefix("sha256:")
        path = self._path(digest)
        try:
            if self._fs is not None:
                data: bytes = self._fs.cat_file(path)
            else:
                with open(path, "rb") as f:
                    data = f.read()
        except FileNotFoundError:
            raise made_by_engine(
                BlobError(b.ref, f"missing from the blob store at {self.shown_root!r}")
            ) from None
        if (
            sealed
            and self.sealer is not None
            and data.startswith(SEALED)
            and hashlib.sha256(data).hexdigest() != digest
        ):
            # plain bytes ``reseal`` sealed in place: what they were, if they open to it
            with contextlib.suppress(Exception):
                data = self.sealer.open_bytes(data, f"blob {b.ref}")
        if not sealed and data.startswith(SEALED):
            if self.sealer is None:
                raise no_keyring(data, b.ref)
            try:
                data = self.sealer.open_bytes(data, f"blob {b.ref}")
            except KeyUnavailableError as exc:
                if exc.destroyed:  # erased on purpose: no retry brings it back
                    raise
                # a key this keyring lacks (retired too soon, not given to this
                # process): the step fails and retries, so giving the key back heals it
                again = BlobError(b.ref, str(exc))
                raise marked_like(again, exc) from None
        matches = hashlib.sha256(data).hexdigest() == digest
        if matches and len(data) != b.size and data.startswith(TENANT_FRAME):
            data = unframed(data)[1]  # a tenant's document (``framed``)
        if not matches or len(data) != b.size:
            raise made_by_engine(
                BlobError(
                    b.ref,
                    f"the stored bytes do not match the hash ({len(data)} bytes, recorded "
                    f"{b.size}): the file was changed or damaged",
                )
            )
        return data

    def verify(self, ref: str) -> str | None:
        """Whether a stored blob is whole, for ``tether store check``: None if its bytes
        match its name (as kept, or opened with the sealer when sealed under the hash of
        the plain bytes), ``"unverified"`` when sealed under a key this process lacks,
        ``"shredded"`` when under a key destroyed (its tenant was erased), else why it is
        damaged or unreadable. Reads the blob once."""
        digest = ref.removeprefix("sha256:")
        try:
            data = self.kept(ref)
        except BlobError:
            return None  # deleted since it was listed
        except Exception as exc:  # unreadable: permissions, an I/O error
            # the error's text may carry a remote root's credentials: masked as it is
            text = str(exc).replace(self.root, self.shown_root)
            text = re.sub(r"(://[^/@:\s]*):[^/@\s]*@", r"\1:***@", text)
            return f"unreadable ({type(exc).__name__}: {text})"
        if hashlib.sha256(data).hexdigest() == digest:
            return None  # plain, or a sealed offloaded payload (named by its bytes as kept)
        if not data.startswith(SEALED):
            return "the stored bytes do not match the hash"
        if self.sealer is None:
            return "unverified"
        try:
            plain = self.sealer.open_bytes(data, f"blob {ref}")
        except KeyUnavailableError as exc:
            if exc.damaged:  # the key is here and the bytes do not open with it
                return "sealed bytes that do not open with their key (changed or truncated)"
            if exc.destroyed:  # expected: the document of an erased tenant
                return "shredded"
            return "unverified"
        except Exception as exc:  # tampered with, truncated
            return f"sealed bytes that do not open ({type(exc).__name__})"
        if hashlib.sha256(plain).hexdigest() != digest:
            return "the opened bytes do not match the hash"
        return None

    def refs(self) -> Iterator[tuple[str, float]]:
        """Every stored blob: (ref, modification time)."""
        base = f"{self.root}/sha256"
        if self._fs is not None:
            for path in self._fs.find(base):
                parts = path.rsplit("/", 2)
                info = self._fs.info(path)
                yield f"sha256:{parts[-2]}{parts[-1]}", float(info.get("mtime") or time.time())
            return
        if not os.path.isdir(base):
            return
        for prefix in os.listdir(base):
            folder = os.path.join(base, prefix)
            for name in os.listdir(folder):
                if name.startswith(".tmp-"):
                    continue
                yield f"sha256:{prefix}{name}", os.path.getmtime(os.path.join(folder, name))

    def leftovers(self) -> Iterator[tuple[str, float]]:
        """Half-written blobs (``.tmp-*``: a process killed inside ``_write``, before its
        rename), as (path, modification time): ``gc`` removes old ones."""
        base = f"{self.root}/sha256"
        if self._fs is not None or not os.path.isdir(base):
            return  # (fsspec writes whole objects: nothing is left half written)
        for prefix in os.listdir(base):
            folder = os.path.join(base, prefix)
            for name in os.listdir(folder):
                if name.startswith(".tmp-"):
                    path = os.path.join(folder, name)
                    with contextlib.suppress(FileNotFoundError):  # renamed meanwhile
                        yield path, os.path.getmtime(path)

    def remove_leftover(self, path: str) -> None:
        """Remove a half-written blob ``leftovers`` named (gone already: nothing to do)."""
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)

    def head(self, ref: str, size: int = 64) -> bytes:
        """The first ``size`` bytes of a blob as kept (whether and under which key it is
        sealed, without reading all of it); ``BlobError`` if missing."""
        path = self._path(ref.removeprefix("sha256:"))
        try:
            if self._fs is not None:
                with self._fs.open(path, "rb") as f:
                    return bytes(f.read(size))
            with open(path, "rb") as f:
                return f.read(size)
        except FileNotFoundError:
            raise made_by_engine(
                BlobError(ref, f"missing from the blob store at {self.shown_root!r}")
            ) from None

    def modified(self, ref: str) -> float | None:
        """When the blob was written or last put again (None: not stored)."""
        path = self._path(ref.removeprefix("sha256:"))
        try:
            if self._fs is not None:
                return float(self._fs.info(path).get("mtime") or time.time())
            return os.path.getmtime(path)
        except (FileNotFoundError, OSError):
            return None

    def delete(self, ref: str) -> None:
        """Remove one blob (orphans only: see ``gc``)."""
        path = self._path(ref.removeprefix("sha256:"))
        if self._fs is not None:
            self._fs.rm_file(path)
        elif os.path.exists(path):
            os.remove(path)


#: the default blob store of a PostgreSQL store: shared by every store whose processes
#: start in the same folder, so blobs are never deleted from it (name one per store)
SHARED_ROOT = "./tether-blobs"


def default_root(store_path: str | None) -> str:
    """Beside a SQLite file (``<file>.blobs``); else ``SHARED_ROOT``."""
    if store_path and store_path != ":memory:":
        return f"{store_path}.blobs"
    if store_path == ":memory:":
        return tempfile.mkdtemp(prefix="tether-blobs-")
    return SHARED_ROOT
