"""Opening a store from the URL a user gives (``tether.App(store=...)``, ``--store``)."""

from __future__ import annotations

from .._codec import Codec
from .._errors import ConfigurationError
from ..encryption import Keyring, Sealer, keyring_from_env
from .base import Store

#: URL schemes of PostgreSQL stores (all mean the same: tether always uses psycopg 3)
_PG_SCHEMES = ("postgresql://", "postgres://", "postgresql+psycopg://", "postgresql+psycopg2://")


def open_store(
    url: str | Store | None,
    *,
    schema: str | None = None,
    keyring: Keyring | None = None,
    read_only: bool = False,
) -> Store:
    """Open a store from a URL: a path, ``sqlite:///path``, ``:memory:``, or
    ``postgresql://user@host/db`` (``?schema=NAME`` or ``schema=`` picks a schema).

    Payloads are sealed under ``keyring``, or the one ``TETHER_KEYRING`` or
    ``TETHER_ENCRYPTION_KEYS`` names (``tether.encryption``); a store object given
    as it is keeps its own codec unless ``keyring`` is given.

    ``read_only`` opens a SQLite file as it is, never upgrading or writing it (a
    migration's source); it changes nothing for PostgreSQL or ``:memory:``.
    """
    if isinstance(url, Store):
        if keyring is not None:
            url.codec = Codec(Sealer(keyring))
        return url
    store = _open(url, schema, read_only)
    keyring = keyring if keyring is not None else keyring_from_env()
    if keyring is not None:
        store.codec = Codec(Sealer(keyring))
    return store


def _open(url: str | None, schema: str | None, read_only: bool = False) -> Store:
    if url is not None and url.startswith(_PG_SCHEMES):
        # SQLAlchemy (postgresql+psycopg://) and Heroku (postgres://) spellings too
        url = "postgresql://" + url.split("://", 1)[1]
        try:
            from .postgres import PostgresStore
        except ImportError as exc:
            raise ConfigurationError(
                f"the PostgreSQL store needs psycopg, which is not installed ({exc}); "
                "install it with: pip install 'tether[postgres]'"
            ) from exc
        return PostgresStore(url, schema=schema)
    if schema is not None:
        raise ConfigurationError(
            f"schema={schema!r} applies only to PostgreSQL store URLs (postgresql://...)"
        )
    from .sqlite import SqliteStore

    if url is None:
        return SqliteStore("./tether.db")
    if url == ":memory:" or url == "sqlite://:memory:":
        return SqliteStore(":memory:")
    if url.startswith("sqlite:///"):
        return SqliteStore(url[len("sqlite:///") :], read_only=read_only)
    if "://" in url:
        raise ConfigurationError(
            f"unsupported store URL {url!r}: use a file path, 'sqlite:///path/to/file.db', "
            "':memory:' or 'postgresql://user@host/dbname' (also spelled postgres://, "
            "postgresql+psycopg:// or postgresql+psycopg2://)"
        )
    return SqliteStore(url, read_only=read_only)
