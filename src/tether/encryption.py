"""Encryption at rest: every stored payload sealed with AES-GCM under a named key.

With a keyring configured (``App(encryption=...)``, or ``TETHER_KEYRING`` /
``TETHER_ENCRYPTION_KEYS`` in the environment of every process that opens the store),
the store seals each payload it writes (event data, run input, output and errors,
task arguments, dead letters, debounced and scheduled inputs, review proposals, cached
model answers) and opens it again as it reads. A sealed value is text:

    ~e1:<key id>:<z|n>:<base64 of the 12-byte nonce and the ciphertext>

``z`` marks a payload compressed with zlib before sealing (done when that saves a
quarter or more), ``n`` one that is not. The key id travels with the value, so data
written under an old key stays readable after a rotation; the key id and the flag are
authenticated with the ciphertext. With per-tenant keys (``FileKeyring(per_tenant=
True)``) each tenant's payloads are sealed under a key of its own, and destroying that
key (``tether keyring shred``) leaves every copy of its data unreadable, backups included.
"""

from __future__ import annotations

import abc
import base64
import binascii
import contextlib
import hashlib
import hmac
import itertools
import json
import os
import re
import secrets
import sys
import tempfile
import threading
import time
import weakref
import zlib
from collections.abc import Collection, Iterator
from typing import Any

from ._errors import ConfigurationError, PayloadError
from ._redact import made_by_engine, marked_like

#: what every sealed value starts with (JSON text never starts with ``~``)
PREFIX = "~e1:"
_KEY_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")
#: payloads shorter than this are not worth compressing
_COMPRESS_FROM = 512
#: how many recently sealed small values a sealer remembers the text of
_RECENT = 4096
#: how much of a large payload is compressed first, to see whether the rest is worth it
_SAMPLE = 64 * 1024
#: what a key's fingerprint is the HMAC of (``Sealer.fingerprint``)
_FINGERPRINT_OF = b"tether key fingerprint v1"


class KeyUnavailableError(PayloadError):
    """A sealed payload names a key this process does not have (unknown or destroyed)."""

    def __init__(
        self, key_id: str, problem: str, where: str = "", *, damaged: bool = False
    ) -> None:
        self.key_id, self.problem, self.where = key_id, problem, where
        #: the key was there but the sealed bytes did not open with it: changed or
        #: truncated (or another key under the same id), not merely a key this lacks
        self.damaged = damaged
        place = f"{where}: " if where else ""
        super().__init__(f"{place}payload sealed with key {key_id!r}: {problem}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (_unavailable, (type(self), self.key_id, self.problem, self.where, self.damaged))

    @property
    def destroyed(self) -> bool:
        """True when the key was destroyed on purpose (the data is erased, not lost)."""
        return "destroyed" in self.problem


def _unavailable(
    cls: type[KeyUnavailableError], key_id: str, problem: str, where: str, damaged: bool
) -> KeyUnavailableError:
    """A ``KeyUnavailableError`` rebuilt from a pickle (``damaged`` is keyword-only)."""
    return cls(key_id, problem, where, damaged=damaged)


class KeyringMismatchError(ConfigurationError):
    """This process may not seal into the store: its key of an id differs from the one
    that sealed the store under that id (another keyring), or it has no keyring and the
    store is encrypted. Nothing was written."""

    def __init__(self, key_id: str | None, message: str) -> None:
        self.key_id = key_id
        super().__init__(message)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.key_id, str(self)))


class Keyring(abc.ABC):
    """Where keys come from: the key for new writes, and any key by its id."""

    #: whether each tenant gets keys of its own (``current`` then depends on the tenant)
    per_tenant: bool = False

    @abc.abstractmethod
    def current(self, tenant: str | None) -> str:
        """The id of the key new payloads of ``tenant`` are sealed with."""

    @abc.abstractmethod
    def key(self, key_id: str) -> bytes:
        """The 32 key bytes of ``key_id``; raise ``KeyUnavailableError`` if there are none."""

    def generation(self) -> object:
        """Changes whenever keys may have gone or a current key changed (a sealer then
        asks ``key`` again for each key it holds, forgetting those gone or changed, and
        ``current`` again). A keyring that keeps the default (None) is taken to never
        change."""
        return None

    #: seconds within which every process sharing the keyring sees a change to it (a
    #: rotation, a shred): 0 for a keyring that never changes under a process
    seen_within: float = 0.0

    def tenant_keys(self, tenant: str) -> list[str] | None:
        """The ids of ``tenant``'s own keys (None: this keyring cannot tell)."""
        return None

    def rotate(self, tenant: str | None = None) -> str:
        """Make a new key current (for ``tenant``, or the shared one); old keys stay."""
        raise ConfigurationError(f"a {type(self).__name__} cannot make new keys")

    def shred(self, tenant: str, only: Collection[str] | None = None) -> list[str]:
        """Destroy ``tenant``'s own keys (``only``: those of them among these ids), if it
        has any; the ids destroyed."""
        return []


class StaticKeyring(Keyring):
    """Fixed keys given in code or in ``TETHER_ENCRYPTION_KEYS`` (one for every tenant)."""

    def __init__(self, keys: dict[str, bytes], current: str) -> None:
        for key_id, key in keys.items():
            _check_key(key_id, key)
        if current not in keys:
            raise ConfigurationError(f"current key {current!r} is not among the keys given")
        self._keys, self._current = dict(keys), current

    @classmethod
    def parse(cls, text: str) -> StaticKeyring:
        """Keys from ``id=base64,id=base64``: the first one seals new payloads."""
        keys: dict[str, bytes] = {}
        for part in (p.strip() for p in text.split(",")):
            key_id, sep, b64 = part.partition("=")
            if not sep:
                raise ConfigurationError(
                    f"TETHER_ENCRYPTION_KEYS: {part[:12]!r}... is not id=base64 (make a key "
                    "with: tether keyring new-key)"
                )
            try:
                keys[key_id.strip()] = base64.b64decode(b64.strip() + "==", validate=False)
            except ValueError as exc:
                raise ConfigurationError(f"key {key_id!r} is not base64: {exc}") from None
        if not keys:
            raise ConfigurationError("TETHER_ENCRYPTION_KEYS holds no key")
        return cls(keys, next(iter(keys)))

    def current(self, tenant: str | None) -> str:
        return self._current

    def key(self, key_id: str) -> bytes:
        try:
            return self._keys[key_id]
        except KeyError:
            raise made_by_engine(
                KeyUnavailableError(key_id, "this keyring has no such key")
            ) from None


def new_key() -> str:
    """A fresh 256-bit key, base64 (for ``TETHER_ENCRYPTION_KEYS``)."""
    return base64.b64encode(secrets.token_bytes(32)).decode()


def _check_key(key_id: str, key: bytes) -> None:
    if not _KEY_ID.fullmatch(key_id):
        raise ConfigurationError(f"key id {key_id!r}: use 1-64 letters, digits, '.', '_' or '-'")
    if len(key) != 32:
        raise ConfigurationError(f"key {key_id!r} has {len(key)} bytes; AES-256 needs 32")


class KeyWrapper(abc.ABC):
    """Wraps the data keys a ``FileKeyring`` keeps under a master key held elsewhere (a
    KMS, an HSM, a secrets manager), so the keyring file, and every copy of it, opens
    nothing by itself. A process unwraps each key once, when it first needs it."""

    #: names the master key (a KMS key ARN, say): the keyring file records it and
    #: refuses a wrapper of another name
    name: str = "wrapper"

    @abc.abstractmethod
    def wrap(self, key: bytes) -> bytes:
        """``key`` sealed under the master key."""

    @abc.abstractmethod
    def unwrap(self, wrapped: bytes) -> bytes:
        """The key ``wrap`` sealed (raise if the master key refuses)."""


class LocalKeyWrapper(KeyWrapper):
    """Wraps keys with AES-256-GCM under a master key this process is given (from a
    secrets manager, say, kept apart from the keyring file). A KMS wrapper does the
    same through the KMS's encrypt and decrypt calls, so the master key never leaves
    it."""

    def __init__(self, master: bytes, name: str = "local") -> None:
        if len(master) != 32:
            raise ConfigurationError(f"master key {name!r} has {len(master)} bytes; needs 32")
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        self.name = name
        self._cipher = AESGCM(master)

    def wrap(self, key: bytes) -> bytes:
        nonce = secrets.token_bytes(12)
        return nonce + self._cipher.encrypt(nonce, key, self.name.encode())

    def unwrap(self, wrapped: bytes) -> bytes:
        data: bytes = self._cipher.decrypt(wrapped[:12], wrapped[12:], self.name.encode())
        return data


def wrapper_from_env() -> KeyWrapper | None:
    """The key wrapper ``TETHER_KEY_WRAPPER`` names, if set (``load_wrapper``)."""
    spec = os.environ.get("TETHER_KEY_WRAPPER")
    return load_wrapper(spec) if spec else None


def load_wrapper(spec: str) -> KeyWrapper:
    """The key wrapper ``spec`` names: ``module:attribute``, a ``KeyWrapper`` or a
    callable that returns one."""
    module_name, _, attr = spec.partition(":")
    try:
        import importlib

        found: Any = getattr(importlib.import_module(module_name), attr or "wrapper")
    except (ImportError, AttributeError) as exc:
        raise ConfigurationError(
            f"key wrapper {spec!r}: cannot load it ({exc}); name a module and an "
            "attribute, module:attribute, holding a tether.encryption.KeyWrapper"
        ) from None
    wrapper = found if isinstance(found, KeyWrapper) else found()
    if not isinstance(wrapper, KeyWrapper):
        raise ConfigurationError(
            f"key wrapper {spec!r} is a {type(wrapper).__name__}, not a "
            "tether.encryption.KeyWrapper"
        )
    return wrapper


class FileKeyring(Keyring):
    """Keys in a JSON file (mode 0600) that ``tether keyring`` manages.

    ``per_tenant=True`` gives each tenant its own key, made the first time a payload
    of the tenant is sealed; ``shred(tenant)`` destroys the tenant's keys. Processes
    sharing the file see a rotation or a shred within a second (``seen_within``). With
    a ``wrapper`` (a KMS's, ``KeyWrapper``) the file holds each key wrapped under the
    wrapper's master key, never in the clear; every process that seals or opens payloads
    needs the wrapper (``TETHER_KEY_WRAPPER``), listing and shredding do not.
    """

    #: how often a process looks whether the file changed (at most once this often)
    seen_within = 1.0

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        per_tenant: bool | None = None,
        wrapper: KeyWrapper | None = None,
    ) -> None:
        self.path = os.fspath(path)
        self._lock = threading.Lock()
        self._data: dict[str, Any] = {}
        self._stamp: tuple[int, int] | None = None
        self._checked = 0.0
        #: key id -> (its wrapped text, the key): unwrapped once, again if the file's
        #: wrapped text of that id changed (another keyring under the same path)
        self._unwrapped: dict[str, tuple[str, bytes]] = {}
        if not os.path.exists(self.path):
            raise ConfigurationError(
                f"keyring {self.path!r} does not exist; make one with: "
                f"tether keyring init {self.path}"
            )
        self._load()
        self.per_tenant = bool(self._data.get("per_tenant")) if per_tenant is None else per_tenant
        if wrapper is not None and wrapper.name != self.wrapped_by:
            raise ConfigurationError(
                f"keyring {self.path!r} "
                + (
                    f"keeps its keys wrapped by {self.wrapped_by!r}, not {wrapper.name!r}"
                    if self.wrapped_by
                    else "keeps its keys unwrapped; wrap them first with: "
                    f"tether keyring wrap {self.path}"
                )
            )
        self.wrapper = wrapper

    @classmethod
    def create(
        cls,
        path: str | os.PathLike[str],
        *,
        per_tenant: bool = False,
        wrapper: KeyWrapper | None = None,
    ) -> FileKeyring:
        """Write a new keyring file with one key (refuses to overwrite one); with a
        ``wrapper``, its keys are kept wrapped under the wrapper's master key."""
        path = os.fspath(path)
        if os.path.exists(path):
            raise ConfigurationError(f"{path!r} exists; a keyring is never overwritten")
        key_id = _new_id({}, "k")
        data: dict[str, Any] = {
            "version": 1,
            "per_tenant": per_tenant,
            "current": key_id,
            "keys": {key_id: _entry(None, wrapper)},
            "tenants": {},
            "destroyed": {},
            "retired": {},
        }
        if wrapper is not None:
            data["wrapped_by"] = wrapper.name
        _write(path, data)
        return cls(path, wrapper=wrapper)

    @property
    def wrapped_by(self) -> str | None:
        """The name of the wrapper the file's keys are wrapped by (None: in the clear)."""
        name: str | None = self._fresh().get("wrapped_by")
        return name

    def _wrapper(self) -> KeyWrapper | None:
        """The wrapper new keys are wrapped with (None: kept unwrapped); refuses a
        wrapped keyring opened without one."""
        if self.wrapped_by is not None and self.wrapper is None:
            raise ConfigurationError(
                f"keyring {self.path!r} keeps its keys wrapped by {self.wrapped_by!r}: set "
                "TETHER_KEY_WRAPPER=module:attribute (a tether.encryption.KeyWrapper) or "
                "pass FileKeyring(..., wrapper=)"
            )
        return self.wrapper

    # reading ------------------------------------------------------------------------

    def _load(self) -> None:
        try:
            stat = os.stat(self.path)
            with open(self.path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError) as exc:
            raise ConfigurationError(f"cannot read keyring {self.path!r}: {exc}") from None
        self._data, self._stamp = data, (stat.st_mtime_ns, stat.st_size)
        self._checked = time.monotonic()

    def _fresh(self, force: bool = False) -> dict[str, Any]:
        """The file's content, read again when it changed (looked at once a second)."""
        now = time.monotonic()
        if force or now - self._checked > self.seen_within:
            self._checked = now
            try:
                stat = os.stat(self.path)
            except OSError:
                return self._data
            if (stat.st_mtime_ns, stat.st_size) != self._stamp:
                with self._lock:
                    self._load()
        return self._data

    def key(self, key_id: str) -> bytes:
        data = self._fresh()
        entry = data["keys"].get(key_id)
        if entry is None:
            data = self._fresh(force=True)
            entry = data["keys"].get(key_id)
        if entry is None:
            gone = data.get("destroyed", {}).get(key_id)
            if gone:
                raise made_by_engine(
                    KeyUnavailableError(
                        key_id,
                        f"the key was destroyed (tenant {gone.get('tenant')!r} erased at "
                        f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(gone['at']))} UTC); "
                        "the data it sealed is unreadable for good",
                    )
                )
            retired = data.get("retired", {}).get(key_id)
            if retired:
                raise made_by_engine(
                    KeyUnavailableError(
                        key_id,
                        f"keyring {self.path!r} retired the key at "
                        f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(retired['at']))} UTC "
                        "(tether keyring retire); data still sealed with it opens only with a "
                        "copy of the keyring from before",
                    )
                )
            raise made_by_engine(
                KeyUnavailableError(
                    key_id, f"keyring {self.path!r} has no such key (is it the right keyring?)"
                )
            )
        if "wrapped" not in entry:
            return base64.b64decode(entry["key"])
        known = self._unwrapped.get(key_id)
        key = known[1] if known is not None and known[0] == entry["wrapped"] else None
        if key is None:
            if self.wrapper is None:
                raise made_by_engine(
                    KeyUnavailableError(
                        key_id,
                        f"keyring {self.path!r} keeps it wrapped by {self.wrapped_by!r} and this "
                        "process has no wrapper (set TETHER_KEY_WRAPPER)",
                    )
                )
            try:
                key = self.wrapper.unwrap(base64.b64decode(entry["wrapped"]))
            except Exception as exc:
                raise KeyUnavailableError(
                    key_id,
                    f"the key wrapper {self.wrapper.name!r} did not unwrap it "
                    f"({type(exc).__name__}: {str(exc)[:200]}); check the wrapper's access "
                    "to its master key",
                ) from None
            _check_key(key_id, key)
            self._unwrapped[key_id] = (entry["wrapped"], key)
        return key

    def current(self, tenant: str | None) -> str:
        data = self._fresh()
        if not self.per_tenant or tenant is None:
            return str(data["current"])
        key_id = data["tenants"].get(tenant)
        if key_id is None:
            key_id = self._tenant_key(tenant, new=False)
        return str(key_id)

    def generation(self) -> object:
        # asked before every seal and open: the clock alone while the file is not due
        # a look (what _fresh does, one call less)
        if time.monotonic() - self._checked > self.seen_within:
            self._fresh()
        return self._stamp

    def listing(self) -> list[dict[str, Any]]:
        """Every key: id, tenant, created, current or not, and the destroyed ones."""
        data = self._fresh(force=True)
        current = {data["current"], *data["tenants"].values()}
        out = [
            {
                "key_id": k,
                "tenant": e.get("tenant"),
                "created_at": e["created_at"],
                "current": k in current,
                "destroyed_at": None,
                "retired_at": None,
            }
            for k, e in data["keys"].items()
        ]
        out += [
            {
                "key_id": k,
                "tenant": g.get("tenant"),
                "created_at": None,
                "current": False,
                "destroyed_at": g["at"],
                "retired_at": None,
            }
            for k, g in data.get("destroyed", {}).items()
        ]
        out += [
            {
                "key_id": k,
                "tenant": g.get("tenant"),
                "created_at": g.get("created_at"),
                "current": False,
                "destroyed_at": None,
                "retired_at": g["at"],
            }
            for k, g in data.get("retired", {}).items()
        ]
        return out

    # changing -----------------------------------------------------------------------

    def rotate(self, tenant: str | None = None) -> str:
        """Make a new key current (for ``tenant``, or the shared one); old keys stay."""
        if tenant is not None:
            return self._tenant_key(tenant, new=True)
        wrapper = self._wrapper()
        with self._changing() as data:
            key_id = _new_id(data, "k")
            data["keys"][key_id] = _entry(None, wrapper)
            data["current"] = key_id
        return key_id

    def _tenant_key(self, tenant: str, *, new: bool) -> str:
        """The tenant's current key id, made under the file's lock if ``new`` or missing
        (so processes meeting a new tenant at once agree on one key)."""
        if not self.per_tenant:
            raise ConfigurationError(
                f"keyring {self.path!r} has no per-tenant keys (tether keyring init --per-tenant)"
            )
        wrapper = self._wrapper()
        with self._changing() as data:
            key_id = data["tenants"].get(tenant)
            if new or key_id is None:
                stem = "t" + hashlib.sha256(tenant.encode()).hexdigest()[:12] + "-"
                key_id = _new_id(data, stem)
                data["keys"][key_id] = _entry(tenant, wrapper)
                data["tenants"][tenant] = key_id
            else:  # another thread or process made it meanwhile: nothing to write
                raise _Unchanged
        return str(key_id)

    def tenant_keys(self, tenant: str) -> list[str]:
        data = self._fresh(force=True)
        return [k for k, e in data["keys"].items() if e.get("tenant") == tenant]

    def shred(self, tenant: str, only: Collection[str] | None = None) -> list[str]:
        """Destroy every key of ``tenant`` (``only``: those of them among these ids): what
        they sealed, wherever it is, is unreadable. A current key destroyed, the tenant's
        next payload gets a new key."""
        with self._changing() as data:
            gone = [
                k
                for k, e in data["keys"].items()
                if e.get("tenant") == tenant and (only is None or k in only)
            ]
            for key_id in gone:
                del data["keys"][key_id]
                self._unwrapped.pop(key_id, None)
                data.setdefault("destroyed", {})[key_id] = {"tenant": tenant, "at": time.time()}
            if data["tenants"].get(tenant) in gone or only is None:
                data["tenants"].pop(tenant, None)
        return gone

    def retire(self, key_id: str) -> None:
        """Remove a key that no longer seals anything (after ``tether store reseal`` moved its
        data to the current key), keeping its id listed so no later key takes it. What
        it still sealed, here or in a backup, no longer opens with this keyring."""
        with self._changing() as data:
            entry = data["keys"].get(key_id)
            if entry is None:
                raise ConfigurationError(f"keyring {self.path!r} has no key {key_id!r}")
            if key_id == data["current"] or key_id in data["tenants"].values():
                raise ConfigurationError(
                    f"key {key_id!r} is current (it seals new payloads): rotate first "
                    "(tether keyring rotate), then reseal the store (tether store reseal)"
                )
            del data["keys"][key_id]
            self._unwrapped.pop(key_id, None)
            data.setdefault("retired", {})[key_id] = {
                "tenant": entry.get("tenant"),
                "created_at": entry.get("created_at"),
                "at": time.time(),
            }

    def wrap_keys(self, wrapper: KeyWrapper) -> int:
        """Wrap every key the file keeps in the clear under ``wrapper``'s master key, in
        place; later keys are made wrapped. How many were wrapped."""
        if self.wrapped_by not in (None, wrapper.name):
            raise ConfigurationError(
                f"keyring {self.path!r} is wrapped by {self.wrapped_by!r} already"
            )
        n = 0
        with self._changing() as data:
            for entry in data["keys"].values():
                if "key" in entry:
                    raw = base64.b64decode(entry.pop("key"))
                    entry["wrapped"] = base64.b64encode(wrapper.wrap(raw)).decode()
                    n += 1
            data["wrapped_by"] = wrapper.name
        self.wrapper = wrapper
        return n

    @contextlib.contextmanager
    def _changing(self) -> Iterator[dict[str, Any]]:
        """Read, change and write the file under an exclusive lock shared by processes."""
        with self._lock, _file_lock(self.path + ".lock"):
            self._load()
            data = self._data
            try:
                yield data
            except _Unchanged:
                return  # (the caller found nothing to change: no write, no fsync)
            _write(self.path, data)
            self._load()


class _Unchanged(Exception):
    """Raised inside ``FileKeyring._changing`` when there turned out to be nothing to
    change: the file is left as it is."""


def _entry(tenant: str | None, wrapper: KeyWrapper | None) -> dict[str, Any]:
    """A new key's entry: the key in base64, or wrapped under ``wrapper``."""
    if wrapper is None:
        return {"key": new_key(), "tenant": tenant, "created_at": time.time()}
    wrapped = base64.b64encode(wrapper.wrap(secrets.token_bytes(32))).decode()
    return {"wrapped": wrapped, "tenant": tenant, "created_at": time.time()}


def _new_id(data: dict[str, Any], stem: str) -> str:
    """A key id never used before: ``<stem><n>-<8 random hex>``, ``n`` one more than the
    highest of the stem's ids this file has had (kept, retired or destroyed). The random
    part keeps two keyrings, or a keyring and a copy of it made before a key was added,
    from minting the same id for different keys."""
    taken = {*data.get("keys", {}), *data.get("destroyed", {}), *data.get("retired", {})}
    n = 0
    for key_id in taken:
        if key_id.startswith(stem):
            digits = key_id[len(stem) :].split("-", 1)[0]
            if digits.isdigit():
                n = max(n, int(digits))
    while True:
        key_id = f"{stem}{n + 1}-{secrets.token_hex(4)}"
        if key_id not in taken:
            return key_id


def _write(path: str, data: dict[str, Any]) -> None:
    """Replace the file atomically, readable by its owner only."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".keyring-")
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def _file_lock(path: str) -> Iterator[None]:
    if sys.platform == "win32":  # pragma: no cover
        yield
        return
    import fcntl

    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class Sealer:
    """Seals payloads for the store and opens them again (compression, then AES-GCM)."""

    def __init__(self, keyring: Keyring) -> None:
        try:
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM
        except ImportError as exc:
            raise ConfigurationError(
                f"encryption needs the cryptography package ({exc}); install it with: "
                "pip install 'tether[encryption]'"
            ) from None
        self._aesgcm = AESGCM
        self.keyring = keyring
        self._ciphers: dict[str, Any] = {}
        #: the key each cipher was made with (checked again when the keyring changes)
        self._keys: dict[str, bytes] = {}
        self._generation: object = keyring.generation()
        #: whether the keyring's keys can change under us (a file): asked before each use
        self._dynamic = type(keyring).generation is not Keyring.generation
        self._nonces = _Nonces()
        #: tenant -> (head as text, head as bytes, encrypt) for small payloads: the hot
        #: path of ``seal`` (forgotten with the ciphers when the keyring changes)
        self._small: dict[str | None, tuple[str, bytes, Any]] = {}
        #: small values this process sealed lately -> their text: a step's arguments are
        #: opened by the worker that runs it right after its workflow task sealed them.
        #: Keyed by the whole sealed text (a changed value misses and fails to open);
        #: each sealed with a key of ``_keys``, and all forgotten when the keyring drops
        #: or changes one of those (a destroyed key's values must not open from here),
        #: or when ``_keys`` is emptied. Two generations: when the newer fills up it becomes
        #: the older, so the latest ``_RECENT`` values are always remembered (clearing
        #: one dict when full forgot, at each clearing, values about to be opened)
        self._recent: dict[str, str] = {}
        self._recent_old: dict[str, str] = {}
        #: key ids this process sealed with whose fingerprint the store has not yet
        #: confirmed (the store's next operation that seals checks them: ``_Tx.seal``)
        self.unchecked: set[str] = set()
        #: key ids whose fingerprint the store holds and matches
        self.checked: set[str] = set()

    def fingerprint(self, key_id: str) -> str:
        """A fingerprint of the key of ``key_id`` (an HMAC under it of a constant): the
        same for the same key, never revealing it. The store keeps the fingerprint of
        each key id it was sealed under, to refuse another key under the same id."""
        key = self.keyring.key(key_id)
        return hmac.new(key, _FINGERPRINT_OF, hashlib.sha256).hexdigest()[:32]

    def _cipher(self, key_id: str) -> Any:
        if self._dynamic:
            generation = self.keyring.generation()
            if generation != self._generation:  # keys may have been destroyed: ask again
                self._changed(generation)
        cipher = self._ciphers.get(key_id)
        if cipher is None:
            key = self.keyring.key(key_id)
            _check_key(key_id, key)
            cipher = self._aesgcm(key)
            if len(self._ciphers) > 1024:
                self._ciphers.clear()
                self._keys.clear()
                self._small.clear()
                self._forget_recent()  # (sealed with keys no longer checked on a change)
            self._ciphers[key_id] = cipher
            self._keys[key_id] = key
        return cipher

    def _changed(self, generation: object) -> None:
        """The keyring changed (a key made, rotated, destroyed...): each key held is asked
        for again, and dropped with its cipher if it is gone or not the same; if any is,
        every value remembered is forgotten with it. A keyring that only gained keys (a
        new tenant's) leaves the values sealed lately to open from memory. The tenants'
        current keys are asked for again."""
        self._small.clear()
        dropped = False
        for key_id, key in list(self._keys.items()):
            try:
                same = self.keyring.key(key_id) == key
            except Exception:  # unavailable now, however the keyring says it
                same = False
            if not same:
                dropped = True
                self._keys.pop(key_id, None)
                self._ciphers.pop(key_id, None)
        if dropped:
            self._forget_recent()
        self._generation = generation  # (last: till then, other threads check too)

    def _seal(self, data: bytes, tenant: str | None) -> tuple[bytes, bytes]:
        """(head, nonce + ciphertext) of ``data`` under the tenant's current key."""
        key_id = self.keyring.current(tenant)
        if key_id not in self.checked:
            self.unchecked.add(key_id)
        flag = "n"
        packed = _compressed(data)
        if packed is not None:
            data, flag = packed, "z"
        nonce = self._nonces.next()
        head = f"{PREFIX}{key_id}:{flag}:".encode()
        return head, nonce + self._cipher(key_id).encrypt(nonce, data, head)

    def _open(self, key_id: str, flag: str, raw: bytes, where: str) -> bytes:
        head = f"{PREFIX}{key_id}:{flag}:".encode()
        try:
            cipher = self._ciphers.get(key_id) if not self._dynamic else None
            cipher = cipher or self._cipher(key_id)
        except KeyUnavailableError as exc:
            # the engine's when the keyring's was (a keyring of the user's words its own)
            again = KeyUnavailableError(key_id, exc.problem, where)
            raise marked_like(again, exc) from None
        try:
            data: bytes = cipher.decrypt(raw[:12], raw[12:], head)
        except Exception:
            raise made_by_engine(
                KeyUnavailableError(
                    key_id,
                    "it does not open with this keyring's key of that id (a different key "
                    "under the same id, or the value was changed)",
                    where,
                    damaged=True,
                )
            ) from None
        return zlib.decompress(data) if flag == "z" else data

    def seal(self, text: str, tenant: str | None = None) -> str:
        """``text`` sealed under the current key of ``tenant``, as text."""
        data = text.encode()
        if len(data) < _COMPRESS_FROM:  # most payloads: too small to compress
            if self._dynamic and self.keyring.generation() != self._generation:
                self._cipher(self.keyring.current(tenant))  # forgets what the keyring dropped
            small = self._small.get(tenant)
            if small is None:
                small = self._small_entry(tenant)
            nonces = self._nonces  # (its next(), inline: the hot path)
            n = next(nonces._count)
            nonce = nonces._prefix + n.to_bytes(4, "big") if n < 0xFFFFFFFF else nonces.next()
            body = small[2](nonce, data, small[1])
            out = small[0] + binascii.b2a_base64(nonce + body, newline=False).decode()
            recent = self._recent
            if len(recent) >= _RECENT:
                self._recent_old = recent
                recent = self._recent = {}
            recent[out] = text
            return out
        head, body = self._seal(data, tenant)
        return head.decode() + binascii.b2a_base64(body, newline=False).decode()

    def _forget_recent(self) -> None:
        self._recent = {}
        self._recent_old = {}

    def _small_entry(self, tenant: str | None) -> tuple[str, bytes, Any]:
        key_id = self.keyring.current(tenant)
        cipher = self._cipher(key_id)
        if key_id not in self.checked:
            self.unchecked.add(key_id)
        text_head = f"{PREFIX}{key_id}:n:"
        if len(self._small) > 1024:
            self._small.clear()
        entry = self._small[tenant] = (text_head, text_head.encode(), cipher.encrypt)
        return entry

    def open(self, text: str, where: str = "") -> str:
        """The text a sealed value holds; ``text`` itself if it is not sealed."""
        if not text.startswith(PREFIX):
            return text
        plain = self._recent.get(text)
        if plain is None:
            plain = self._recent_old.get(text)
        if plain is not None and self._dynamic:
            generation = self.keyring.generation()
            if generation != self._generation:
                self._changed(generation)
                plain = self._recent.get(text, self._recent_old.get(text))  # (if still held)
        if plain is not None:
            return plain
        key_id, flag, body = _parts(text, where)
        try:
            raw = binascii.a2b_base64(body)
        except binascii.Error:
            raise PayloadError(f"{where}: a sealed payload is damaged: {text[:40]!r}") from None
        return self._open(key_id, flag, raw, where).decode()

    def seal_bytes(self, data: bytes, tenant: str | None = None) -> bytes:
        """``data`` sealed under the current key of ``tenant``, as bytes (for blobs)."""
        head, body = self._seal(data, tenant)
        return head + body

    def open_bytes(self, data: bytes, where: str = "") -> bytes:
        """The bytes a sealed blob holds; ``data`` itself if it is not sealed."""
        if not data.startswith(PREFIX.encode()):
            return data
        key_id, flag, _body = _parts(data[:100].decode("ascii", "replace"), where)
        start = len(PREFIX) + len(key_id) + len(flag) + 2
        return self._open(key_id, flag, data[start:], where)


class _Nonces:
    """AES-GCM nonces: 8 random bytes drawn per process, then a 4-byte counter (the
    deterministic construction of NIST SP 800-38D, 8.2.1). Unique for a key as long as
    no two processes draw the same 64-bit prefix; a forked child draws its own, and the
    prefix is drawn again before the counter would wrap."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.draw()
        _ALL_NONCES.add(self)

    def draw(self) -> None:
        self._prefix = secrets.token_bytes(8)
        self._count = itertools.count()

    def next(self) -> bytes:
        n = next(self._count)
        if n >= 0xFFFFFFFF:
            with self._lock:
                if next(self._count) >= 0xFFFFFFFF:
                    self.draw()
            n = next(self._count)
        return self._prefix + n.to_bytes(4, "big")


_ALL_NONCES: weakref.WeakSet[_Nonces] = weakref.WeakSet()


def _redraw_after_fork() -> None:
    for nonces in list(_ALL_NONCES):
        nonces.draw()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_redraw_after_fork)


def _compressed(data: bytes) -> bytes | None:
    """``data`` compressed with zlib if that saves a quarter or more, else None. A large
    payload is judged by its first 64 KiB first: compressing 50 MB of random base64
    takes seconds to save nothing."""
    if len(data) < _COMPRESS_FROM:
        return None
    if len(data) > 4 * _SAMPLE:
        sample = data[:_SAMPLE]
        if len(zlib.compress(sample, 1)) * 4 > len(sample) * 3:
            return None
    packed = zlib.compress(data, 1)
    return packed if len(packed) * 4 <= len(data) * 3 else None


def _parts(text: str, where: str) -> tuple[str, str, str]:
    try:
        key_id, flag, body = text[len(PREFIX) :].split(":", 2)
    except ValueError:
        raise PayloadError(f"{where}: a sealed payload is cut short: {text[:40]!r}") from None
    if flag not in ("n", "z"):
        raise PayloadError(f"{where}: a sealed payload names no known codec: {text[:40]!r}")
    return key_id, flag, body


def no_keyring(sealed: str | bytes, where: str) -> KeyUnavailableError:
    """The error for a sealed payload (text or blob bytes) met by a process without a
    keyring, naming the key it was sealed with."""
    head = sealed[len(PREFIX) : len(PREFIX) + 80]
    text = head.decode("ascii", "replace") if isinstance(head, bytes) else head
    return made_by_engine(
        KeyUnavailableError(
            text.split(":", 1)[0],
            "this store is encrypted and this process has no keyring: set TETHER_KEYRING "
            "(a keyring file) or TETHER_ENCRYPTION_KEYS, or pass App(encryption=...)",
            where,
        )
    )


def keyring_from_env() -> Keyring | None:
    """The keyring ``TETHER_KEYRING`` (a file) or ``TETHER_ENCRYPTION_KEYS`` names, if any."""
    path = os.environ.get("TETHER_KEYRING")
    if path:
        ring = FileKeyring(path, wrapper=wrapper_from_env())
        ring._wrapper()  # a wrapped keyring without its wrapper: say so now, not per value
        return ring
    keys = os.environ.get("TETHER_ENCRYPTION_KEYS")
    if keys:
        return StaticKeyring.parse(keys)
    return None


__all__ = [
    "FileKeyring",
    "KeyUnavailableError",
    "KeyWrapper",
    "Keyring",
    "KeyringMismatchError",
    "LocalKeyWrapper",
    "Sealer",
    "StaticKeyring",
    "keyring_from_env",
    "load_wrapper",
    "new_key",
    "wrapper_from_env",
]
