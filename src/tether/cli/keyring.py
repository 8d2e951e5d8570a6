"""``tether keyring``: the encryption keys payloads are sealed with (tether.encryption)."""

from __future__ import annotations

import os
import time
from typing import Annotated, Any

import typer

from .._errors import ConfigurationError
from ..encryption import (
    FileKeyring,
    KeyUnavailableError,
    KeyWrapper,
    Sealer,
    load_wrapper,
    new_key,
    wrapper_from_env,
)
from ._common import (
    EXIT_ERROR,
    EXIT_USAGE,
    _client_app,
    _dump,
    _fail,
    _note,
    _opened,
    _run,
)


def _path_argument() -> typer.models.ArgumentInfo:
    return typer.Argument(  # type: ignore[no-any-return]
        metavar="PATH",
        help="The keyring file (default: $TETHER_KEYRING).",
        show_default=False,
    )


def _ring(path: str | None) -> FileKeyring:
    path = path or os.environ.get("TETHER_KEYRING")
    if not path:
        _fail("name the keyring file, or set TETHER_KEYRING", EXIT_USAGE)
    try:
        return FileKeyring(path, wrapper=wrapper_from_env())
    except ConfigurationError as exc:
        _fail(str(exc), EXIT_USAGE)


def _wrapper_option() -> typer.models.OptionInfo:
    return typer.Option(  # type: ignore[no-any-return]
        "--wrapper",
        metavar="MODULE:ATTR",
        help="A tether.encryption.KeyWrapper (a KMS's) to keep the keys wrapped with "
        "(default: $TETHER_KEY_WRAPPER).",
        show_default=False,
    )


def _load_wrapper(spec: str | None) -> KeyWrapper | None:
    try:
        return load_wrapper(spec) if spec else wrapper_from_env()
    except ConfigurationError as exc:
        _fail(str(exc), EXIT_USAGE)


def keyring_init_command(
    path: Annotated[str, typer.Argument(metavar="PATH", help="The keyring file to create.")],
    per_tenant: Annotated[
        bool,
        typer.Option(
            "--per-tenant",
            help="Give each tenant a key of its own (erasing a tenant destroys its keys).",
        ),
    ] = False,
    wrapper: Annotated[str | None, _wrapper_option()] = None,
) -> None:
    """Create a keyring file (mode 0600) with one key.

    Point TETHER_KEYRING at it in every process that opens the store (workers, tether
    serve, the CLI). With a wrapper the file keeps its keys wrapped under the
    wrapper's master key (set TETHER_KEY_WRAPPER in those processes too)."""
    wrap = _load_wrapper(wrapper)
    try:
        ring = FileKeyring.create(path, per_tenant=per_tenant, wrapper=wrap)
    except ConfigurationError as exc:
        _fail(str(exc), EXIT_USAGE)
    except OSError as exc:  # a missing directory, no permission
        _fail(f"cannot create keyring file {path!r}: {exc.strerror}", EXIT_ERROR)
    if wrap is not None:
        kept = f"wrapped by {wrap.name!r}"
    elif per_tenant:  # a copy kept elsewhere keeps a shredded tenant readable
        kept = (
            "keep copies of it only where a tenant's key can be destroyed too: a backup "
            "of the keyring defeats tether keyring shred (docs/data-lifecycle.md)"
        )
    else:
        kept = "keep a copy somewhere safe"
    _note(f"created {path}: new payloads are sealed with key {ring.current(None)}; {kept}")


def keyring_wrap_command(
    path: Annotated[str | None, _path_argument()] = None,
    wrapper: Annotated[str | None, _wrapper_option()] = None,
) -> None:
    """Wrap the keys the file keeps in the clear under a wrapper's master key (a KMS).

    It works in place; keys made later are wrapped too. Every process that seals or
    opens payloads then needs TETHER_KEY_WRAPPER."""
    wrap = _load_wrapper(wrapper)
    if wrap is None:
        _fail("name the wrapper: --wrapper MODULE:ATTR or TETHER_KEY_WRAPPER", EXIT_USAGE)
    path = path or os.environ.get("TETHER_KEYRING")
    if not path:
        _fail("name the keyring file, or set TETHER_KEYRING", EXIT_USAGE)
    try:
        n = FileKeyring(path).wrap_keys(wrap)
    except ConfigurationError as exc:
        _fail(str(exc), EXIT_USAGE)
    _note(f"wrapped {n} key(s) of {path} by {wrap.name!r}")


def keyring_list_command(
    path: Annotated[str | None, _path_argument()] = None,
    store: Annotated[
        str | None,
        typer.Option(
            "--store",
            "-s",
            metavar="URL",
            help="Also compare each key with the fingerprint this store keeps for its id "
            "(store_fingerprint, matches).",
            show_default=False,
        ),
    ] = None,
) -> None:
    """List the keys (never their bytes), with each key's fingerprint.

    For each key: id, tenant, created, current, destroyed, retired, and its
    fingerprint (an HMAC under it). With --store, the fingerprint the store keeps for
    the id and whether the key matches it: a key that does not is another key than
    the one the store was sealed with under that id."""
    ring = _ring(path)

    def ts(t: float | None) -> str | None:
        return None if t is None else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))

    recorded = _recorded_fingerprints(store) if store is not None else None
    sealer = Sealer(ring)
    listed: list[dict[str, Any]] = []
    for k in ring.listing():
        entry = {
            **k,
            "created_at": ts(k["created_at"]),
            "destroyed_at": ts(k["destroyed_at"]),
            "retired_at": ts(k["retired_at"]),
            "fingerprint": fingerprint_of(sealer, k["key_id"]),
        }
        if recorded is not None:
            entry["store_fingerprint"] = recorded.get(k["key_id"])
            entry["matches"] = (
                None
                if entry["store_fingerprint"] is None or entry["fingerprint"] is None
                else entry["fingerprint"] == entry["store_fingerprint"]
            )
            if entry["matches"] is False:
                _note(mismatch_problem(k["key_id"]))
        listed.append(entry)
    if recorded:
        unknown = sorted(set(recorded) - {k["key_id"] for k in listed})
        if unknown:
            _note(
                f"the store was also sealed under key id(s) this keyring does not have: "
                f"{', '.join(unknown)} (another keyring's, or a tenant's of another file)"
            )
    _dump(listed)


def _recorded_fingerprints(store: str) -> dict[str, str]:
    """The fingerprints the store at ``store`` keeps, per key id."""

    async def go() -> dict[str, str]:
        async with _opened(_client_app(store, None)) as opened:
            return await opened.store.seal_keys()

    return _run(go())


def fingerprint_of(sealer: Sealer, key_id: str) -> str | None:
    """The fingerprint of the keyring's key of ``key_id`` (None: it has no such key,
    or it was destroyed or retired)."""
    try:
        return sealer.fingerprint(key_id)
    except (KeyUnavailableError, ConfigurationError):
        return None


def mismatch_problem(key_id: str) -> str:
    """What a keyring whose key of ``key_id`` is not the store's means, and what to do."""
    return (
        f"key {key_id!r}: this keyring holds another key under that id than the one the "
        "store was sealed with (their fingerprints differ): payloads sealed with it do not "
        "open with this keyring, and a process using it is refused before writing. Give "
        "every process the keyring the store was sealed with (TETHER_KEYRING, a copy of the "
        "same file); a keyring made anew with tether keyring init is a different one"
    )


def keyring_rotate_command(
    path: Annotated[str | None, _path_argument()] = None,
    tenant: Annotated[
        str | None, typer.Option("--tenant", help="Rotate this tenant's key (per-tenant rings).")
    ] = None,
) -> None:
    """Make a new key current: new payloads are sealed with it, old ones stay readable."""
    ring = _ring(path)
    try:
        key_id = ring.rotate(tenant)
    except ConfigurationError as exc:
        _fail(str(exc), EXIT_USAGE)
    _note(f"new payloads{f' of tenant {tenant!r}' if tenant else ''} are sealed with {key_id}")


def keyring_retire_command(
    key_id: Annotated[str, typer.Argument(metavar="KEY_ID", help="The key to remove.")],
    path: Annotated[str | None, typer.Option("--keyring", help="The keyring file.")] = None,
    yes: Annotated[
        bool, typer.Option("--yes", help="Really remove (it cannot be undone).")
    ] = False,
) -> None:
    """Remove a key that seals nothing any more; its id stays listed.

    Use it after tether keyring rotate and tether store reseal moved its payloads to
    the current key; no later key takes its id. Payloads still sealed with it, in the
    store or in a backup, then open only with a copy of the keyring made before."""
    ring = _ring(path)
    if not yes:
        _fail(
            f"payloads still sealed with key {key_id!r} (in the store or a backup) will open "
            "only with a copy of this keyring made before: run tether store reseal first, then "
            "add --yes",
            EXIT_USAGE,
        )
    try:
        ring.retire(key_id)
    except ConfigurationError as exc:
        _fail(str(exc), EXIT_USAGE)
    _note(f"retired key {key_id}")


def keyring_shred_command(
    tenant: Annotated[str, typer.Argument(metavar="TENANT", help="The tenant whose keys go.")],
    path: Annotated[str | None, typer.Option("--keyring", help="The keyring file.")] = None,
    yes: Annotated[
        bool, typer.Option("--yes", help="Really destroy (it cannot be undone).")
    ] = False,
) -> None:
    """Destroy a tenant's keys: its payloads become unreadable for good.

    That is every payload of it, in the store and in every backup (tether
    erase-tenant destroys the keys the tenant had when it began, after removing
    rows)."""
    ring = _ring(path)
    if not yes:
        _fail(f"destroying the keys of tenant {tenant!r} cannot be undone: add --yes", EXIT_USAGE)
    gone = ring.shred(tenant)
    _dump({"tenant": tenant, "destroyed": gone})
    _note(f"destroyed {len(gone)} key(s) of tenant {tenant!r}")


def keyring_new_key_command() -> None:
    """Print a fresh 256-bit key, for TETHER_ENCRYPTION_KEYS="id=KEY".

    That variable gives keys in the environment instead of a keyring file; the first
    one listed seals new payloads."""
    print(new_key())
