"""The transaction view every operation runs in, and row codecs shared by all."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..._codec import MARKS, OFFLOADED, PLAIN_RAW, SECRET_KEYS, Codec, decode_text
from ..._errors import ConfigurationError, PayloadError
from ..._history import RunEnd, RunInfo, RunStatus, Task
from ..._redact import read_task_error, unavailable_text
from ..._serde import dumps
from ...blobs import BlobError
from ...encryption import PREFIX, KeyringMismatchError, KeyUnavailableError, Sealer

#: a run whose tenant the codec has not noted yet
_UNKNOWN: Any = object()

_TERMINAL = tuple(s.value for s in RunStatus if s.is_terminal)


_RUN_COLS = (
    "run_id, workflow, status, queue, input, output, error, custom_status, parent_run_id, "
    "continued_to, task_error, created_at, updated_at, completed_at, tenant, waiting_on, attrs"
)


_TASK_COLS = (
    "task_id, run_id, kind, step, queue, name, payload, options, fence, attempt, available_at, "
    "heartbeat, dependency"
)


def _claimed_cols(tx: _Tx) -> str:
    """What a claim's ``UPDATE tasks ... RETURNING`` returns: the task, and with
    per-tenant keys its run's tenant too (``Task.tenant``), so the worker need not read
    it before an attempt, nor an activity's ``put_blob`` during one. The CAST keeps
    SQLite on the primary key: a column of the updated row in RETURNING compares with
    numeric affinity, so ``r.run_id = tasks.run_id`` scanned every run per task claimed."""
    if tx.codec is None or not tx.codec.per_tenant:
        return _TASK_COLS
    return (
        f"{_TASK_COLS}, (SELECT r.tenant FROM runs r WHERE r.run_id = CAST(tasks.run_id AS TEXT))"
    )


Op = Callable[..., Any]


#: the schema upgrade that adds ``seal_keys`` marks a store already holding sealed
#: payloads encrypted (a row of key id ``''``: fingerprints unknown), so a process
#: without a keyring writes nothing in the clear into a store sealed before the upgrade
ENCRYPTED_BEFORE = (
    "INSERT INTO seal_keys (key_id, fingerprint, created_at) SELECT '', '', 0 "
    "WHERE EXISTS (SELECT 1 FROM runs WHERE substr(input, 1, 4) = '~e1:' "
    "OR substr(output, 1, 4) = '~e1:')"
)
#: ... and a store whose payloads were all offloaded holds references (``~b1:``), not
#: sealed values: whether its blobs are sealed is for Python to read (SQL cannot), so
#: the upgrade keeps the latest run's reference in the row of key id ``''`` (in place
#: of a fingerprint); the first process without a keyring that writes reads that blob's
#: head (``_Tx.encrypted``): sealed, the store is encrypted; plain, the row goes. Not
#: when a run holds a plain inline input or output (neither sealed nor offloaded): the
#: store was written plain, and a process that cannot read the blob (another blob root,
#: the blob collected) would be refused every write
OFFLOADED_BEFORE = (
    "INSERT INTO seal_keys (key_id, fingerprint, created_at) SELECT '', input, 0 FROM runs "
    "WHERE substr(input, 1, 4) = '~b1:' AND NOT EXISTS (SELECT 1 FROM seal_keys) "
    "AND NOT EXISTS (SELECT 1 FROM runs WHERE substr(input, 1, 4) NOT IN ('~e1:', '~b1:') "
    "OR substr(output, 1, 4) NOT IN ('~e1:', '~b1:')) "
    "ORDER BY created_at DESC LIMIT 1"
)
#: what clears that row in a store known to be plain whose blob cannot be read
CLEAR_OFFLOADED_MARK = "DELETE FROM seal_keys WHERE key_id = '' AND fingerprint <> ''"
#: the schema upgrade that adds ``chains`` (each continue-as-new chain's latest run, by
#: its first id): every chain made before it gets its row. A chain's head is the run a
#: continued run continued into that has not continued itself; its ids are its first
#: id with ``~1``, ``~2``, ... (the first id holds no ``~``), so the chain's id is the
#: head's id up to its last ``~`` (what ``chain_of`` says). One pass over the runs,
#: each continued run's successor read by primary key: the same on both databases.
CHAINS = (
    "CREATE TABLE IF NOT EXISTS chains (chain_id TEXT PRIMARY KEY, head_run_id TEXT NOT NULL)",
    "INSERT INTO chains (chain_id, head_run_id) "
    "SELECT substr(rtrim(h.run_id, '0123456789'), 1, "
    "length(rtrim(h.run_id, '0123456789')) - 1), h.run_id "
    "FROM runs p JOIN runs h ON h.run_id = p.continued_to "
    "WHERE p.status = 'continued_as_new' AND h.continued_to IS NULL "
    "ON CONFLICT (chain_id) DO NOTHING",
)


@dataclass
class SealState:
    """What a store knows of its encryption, shared by its operations: whether a keyring
    has sealed into it (a ``seal_keys`` row per key id, with the key's fingerprint).
    Looked up once, by the first operation of a process without a keyring that writes
    a payload."""

    encrypted: bool | None = None


@dataclass
class _Tx:
    """One operation's view of the open transaction, plus what to announce after commit."""

    conn: Any
    now: float
    paramstyle: str = "qmark"
    for_update: str = ""  #: " FOR UPDATE" where row locks exist
    skip_locked: str = ""  #: " FOR UPDATE SKIP LOCKED" where supported
    ready: set[str] = field(default_factory=set)
    #: runs this operation ended, with how they ended (None: changed, but look it up)
    finished: dict[str, RunEnd | None] = field(default_factory=dict)
    #: queues known to have limits or not, asked once per operation (the SQLite store
    #: shares one dict per batch: its write lock keeps other processes out meanwhile)
    limited: dict[str, bool] = field(default_factory=dict)
    #: queues seen with limits by this store (shared by its operations): treating a queue
    #: as limited is always safe (its work goes through the claim, which applies them)
    known_limited: set[str] = field(default_factory=set)
    #: the PostgreSQL fast path: skip a read whose answer is almost always the same and
    #: send a guard instead (``guard``), which fails the batch when the guess was wrong;
    #: the batch then runs again on the safe path, where every read is made
    optimistic: bool = False
    #: a fresh task id (optimistic mode): a task row inserted with it needs no RETURNING
    new_task_id: Callable[[], int] | None = None
    #: runs whose history this operation appended to (event streams wake on them); the
    #: store may share one set across a batch
    touched: set[str] = field(default_factory=set)
    #: seals payloads as they are written (``tether.encryption``); None: stored as given
    codec: Codec | None = None
    #: the store's encryption state (None: not checked, as for a store made in a test)
    keys: SealState | None = None

    #: what this operation sealed, by the id of the text (kept, so the id stays its
    #: own) with the run it was sealed for: a step's arguments go into its event and its
    #: task row as one sealed value
    _sealed: dict[int, tuple[str, str | None, str]] | None = None
    #: the tenants of the runs this operation inserts: sealing for them reads this, and
    #: the codec's cache learns them only from rows the store holds (``tenant_of``,
    #: claims), never from an insert that may yet fail (a start refused for a run id
    #: another tenant's run holds would have that run's payloads sealed under its key)
    inserting: dict[str, str | None] | None = None
    #: run tenants this operation read or wrote (``learn``): the store hands them to the
    #: codec's cache once the transaction has committed, never before (a row of a batch
    #: rolled back, a start refused on PostgreSQL's fast path, decides no key)
    learned: dict[str, str | None] | None = None

    def learn(self, run_id: str, tenant: str | None) -> None:
        """Note ``run_id``'s tenant for the codec's cache, taken in once this commits."""
        learned = self.learned
        if learned is None:
            learned = self.learned = {}
        learned[run_id] = tenant

    def seal(
        self,
        text: str | None,
        run_id: str | None = None,
        *,
        plain_ok: bool = False,
        offload: bool = False,
    ) -> str | None:
        """``text`` as the store keeps it: sealed under the run's tenant's key if
        encryption is on, else unchanged. Without a keyring, a payload is refused by an
        encrypted store (``refuse_plain``) unless ``plain_ok`` (tether's own words)."""
        codec = self.codec
        sealer = codec.sealer if codec is not None else None
        if sealer is None and text is not None and not plain_ok:
            keys = self.keys
            if keys is not None and keys.encrypted is not False:
                self.refuse_plain()
        if codec is None or text is None:
            return text
        memo = self._sealed
        if memo is None:
            memo = self._sealed = {}
        elif not offload:
            # the same text for the same run (whose tenant never changes): sealed already
            done = memo.get(id(text))
            if done is not None and done[0] is text and done[1] == run_id:
                return done[2]
        tenant = None
        if codec.per_tenant and run_id is not None:
            inserting = self.inserting
            if inserting is not None and run_id in inserting:
                tenant = inserting[run_id]
            else:
                tenant = codec.tenants.get(run_id, _UNKNOWN)  # (tenant_of's cache, inline)
                if tenant is _UNKNOWN:
                    tenant = self.tenant_of(run_id)
        above = codec.offload_above
        if sealer is not None and not offload and (above is None or len(text) * 4 <= above):
            # too small to offload whatever its bytes: what codec.encode does, inline
            out = sealer.seal(text, tenant)
        else:
            out = codec.encode(text, tenant, offload=offload)
        if sealer is not None and sealer.unchecked and self.keys is not None:
            self.check_keys(sealer)
        if len(memo) < 256 and not offload:
            memo[id(text)] = (text, run_id, out)
        return out

    def check_keys(self, sealer: Sealer) -> None:
        """Compare the fingerprints of the keys ``sealer`` sealed with lately to those the
        store keeps for their ids, recording those it has none for: a key id sealed
        under another key (a second keyring made with the same ids) is refused before
        anything sealed with it commits. Once per key id and process."""
        assert self.keys is not None
        for key_id in list(sealer.unchecked):
            mine = sealer.fingerprint(key_id)
            if not self.keys.encrypted and self._no_fingerprints():
                self._check_sealed_before(sealer)
            added = self.execute(
                "INSERT INTO seal_keys (key_id, fingerprint, created_at) VALUES (?, ?, ?) "
                "ON CONFLICT (key_id) DO NOTHING RETURNING key_id",
                (key_id, mine, self.now),
            ).fetchone()
            self.keys.encrypted = True
            if added is not None:
                continue  # confirmed by the next operation (this one may roll back)
            row = self.execute(
                "SELECT fingerprint FROM seal_keys WHERE key_id = ?", (key_id,)
            ).fetchone()
            if row is not None and row[0] != mine:
                raise _mismatch(key_id)
            sealer.checked.add(key_id)
            sealer.unchecked.discard(key_id)

    def _no_fingerprints(self) -> bool:
        row = self.execute("SELECT key_id FROM seal_keys WHERE key_id <> '' LIMIT 1").fetchone()
        return row is None

    def _check_sealed_before(self, sealer: Sealer) -> None:
        """The store's first fingerprint: a store sealed by a version that kept none
        holds values under ids this keyring may have too (every keyring it made started
        at ``k1``, a tenant's id came from its name): one value of each such id, among
        the first runs, must open with this keyring's key of that id. An offloaded
        input counts under the key its blob was sealed with."""
        heads = self.execute(
            "SELECT run_id, substr(input, 1, 80) FROM runs WHERE substr(input, 1, 4) = ? "
            "OR substr(input, 1, 4) = ? LIMIT 1000",
            (PREFIX, OFFLOADED),
        ).fetchall()
        some: dict[str, str] = {}
        blobs_read = 0
        for run_id, head in heads:
            if head.startswith(OFFLOADED):
                if blobs_read >= 100:
                    continue
                blobs_read += 1
                head = self._blob_head(head)
                if head is None or not head.startswith(PREFIX):
                    continue  # missing, or offloaded in the clear
            some.setdefault(head[len(PREFIX) :].split(":", 1)[0], run_id)
        for key_id, run_id in some.items():
            try:
                sealer.keyring.key(key_id)
            except (KeyUnavailableError, ConfigurationError):
                continue  # not this keyring's (or destroyed): nothing to compare
            row = self.execute("SELECT input FROM runs WHERE run_id = ?", (run_id,)).fetchone()
            try:
                decode_text(self.codec, row[0] if row is not None else "", f"run {run_id!r}")
            except KeyUnavailableError:
                raise _mismatch(key_id) from None
            except (PayloadError, BlobError):
                continue  # a damaged value or a missing blob: says nothing of the key

    def _blob_head(self, reference: str) -> str | None:
        """The first bytes of an offloaded payload's blob (``~e1:<key id>:`` if sealed),
        as text; None if this process has no blob store or the blob is missing."""
        blobs = self.codec.blobs if self.codec is not None else None
        if blobs is None:
            return None
        ref = reference[len(OFFLOADED) :].rpartition(":")[0]
        try:
            return blobs.head(ref, 80).decode("ascii", "replace")
        except (BlobError, OSError, ValueError):
            return None

    def encrypted(self) -> bool:
        """Whether a keyring has sealed into this store (looked up once per process:
        ``keys.encrypted``). A store upgraded with only offloaded payloads keeps one
        reference in place of a fingerprint (``OFFLOADED_BEFORE``): its blob says.
        Raises ``KeyringMismatchError`` if no such blob can be read."""
        assert self.keys is not None
        if self.keys.encrypted is None:
            rows = self.execute(
                "SELECT key_id, fingerprint FROM seal_keys ORDER BY key_id LIMIT 2"
            ).fetchall()
            marker = len(rows) == 1 and rows[0][0] == "" and rows[0][1].startswith(OFFLOADED)
            if marker and not self._offloaded_sealed(rows[0][1]):  # a plain store
                self.execute(
                    "DELETE FROM seal_keys WHERE key_id = '' AND fingerprint = ?", (rows[0][1],)
                )
                rows = []
            self.keys.encrypted = bool(rows)
        return self.keys.encrypted

    def _offloaded_sealed(self, reference: str) -> bool:
        """Whether the blob of ``reference`` (else of one of the latest runs' offloaded
        inputs, if it is gone) is sealed."""
        head = self._blob_head(reference)
        if head is None:
            for (other,) in self.execute(
                "SELECT input FROM runs WHERE substr(input, 1, 4) = ? "
                "ORDER BY created_at DESC LIMIT 5",
                (OFFLOADED,),
            ).fetchall():
                head = self._blob_head(other)
                if head is not None:
                    break
        if head is None:
            raise KeyringMismatchError(
                None,
                "this store may be encrypted (its payloads were offloaded to blobs before "
                f"it kept key fingerprints) and the blob {reference!r} could not be read "
                "to tell (this process has no blob store or another one, or the blob is "
                "gone): nothing was written. Open the store's blob store (TETHER_BLOBS "
                "or App(blobs=...)); if the store is encrypted, set TETHER_KEYRING (the "
                "keyring file) or TETHER_ENCRYPTION_KEYS; if it is known to be plain "
                "(never sealed), clear the mark in the store's database: "
                f"{CLEAR_OFFLOADED_MARK} (docs/data-lifecycle.md)",
            )
        return head.startswith(PREFIX)

    def refuse_plain(self) -> None:
        """Refuse to write a payload in the clear into a store a keyring has sealed into
        (this process has none); looked up once per store and process."""
        if self.encrypted():
            raise KeyringMismatchError(
                None,
                "this store is encrypted (a keyring has sealed payloads into it) and this "
                "process has no keyring: it would write payloads in the clear, so nothing "
                "was written. Set TETHER_KEYRING (the keyring file) or "
                "TETHER_ENCRYPTION_KEYS, or pass App(encryption=...)",
            )

    def seal_error(self, text: str | None, run_id: str | None = None) -> str | None:
        """An error's JSON as stored: sealed except its type and its cause's type and
        step name (runs are filtered by them). Never offloaded (tracebacks are capped)."""
        if self.codec is None or self.codec.sealer is None or text is None:
            return text
        try:
            error = json.loads(text)
        except ValueError:
            error = None
        shown: dict[str, Any] = {"type": error.get("type") if isinstance(error, dict) else None}
        cause = error.get("cause") if isinstance(error, dict) else None
        if isinstance(cause, dict):
            shown["cause"] = {k: cause[k] for k in ("type", "activity") if k in cause}
        return dumps({**shown, "sealed": self.seal(text, run_id)})

    def data(
        self,
        run_id: str,
        data: dict[str, Any],
        raw: dict[str, str] | None,
        offload: frozenset[str] = frozenset(),
    ) -> str:
        """An event's data column: its JSON; offloaded whole when large, and with
        encryption on, each payload and free text sealed in a field of its own
        (``"~args"`` for ``args``: the same sealed value as the step's task row), the
        rest (names, steps, times, options) left readable."""
        codec = self.codec
        if codec is None or codec.sealer is None:
            keys = self.keys
            if keys is not None and keys.encrypted is not False and _private(data, raw):
                self.refuse_plain()
            if codec is None:
                return _json(data, raw)
            return self.seal(_json(data, raw), run_id, plain_ok=True) or ""
        # sealed values and tether's raw keys need no JSON escaping
        parts: list[str] = []
        shown_raw = raw
        if raw:
            for k, v in raw.items():
                if k not in PLAIN_RAW:
                    parts.append(f'"~{k}":"{self.seal(v, run_id, offload=k in offload)}"')
            if parts and len(parts) < len(raw):
                shown_raw = {k: v for k, v in raw.items() if k in PLAIN_RAW}
            elif parts:
                shown_raw = None
        shown = data
        if not SECRET_KEYS.isdisjoint(data):
            shown = {}
            for k, v in data.items():
                if k in SECRET_KEYS:
                    parts.append(f'"~{k}":"{self.seal(dumps(v), run_id)}"')
                else:
                    shown[k] = v
        if not parts:
            return _json(data, raw)  # tether's own bookkeeping only
        text = _json(shown, shown_raw)
        return f"{text[:-1]}{',' if len(text) > 2 else ''}{','.join(parts)}}}"

    def tenant_of(self, run_id: str) -> str | None:
        """A run's tenant (remembered by the codec: a run's tenant never changes)."""
        assert self.codec is not None
        inserting = self.inserting
        if inserting is not None and run_id in inserting:
            return inserting[run_id]
        learned = self.learned
        if learned is not None and run_id in learned:
            return learned[run_id]
        known = self.codec.tenants
        if run_id in known:
            return known[run_id]
        row = self.execute("SELECT tenant FROM runs WHERE run_id = ?", (run_id,)).fetchone()
        tenant: str | None = row[0] if row else None
        self.learn(run_id, tenant)
        return tenant

    def open(self, text: str | None, where: str) -> str | None:
        """A stored payload as it was written (opened if sealed)."""
        if text is None or not text.startswith(MARKS):
            return text
        return decode_text(self.codec, text, where)

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Any:
        """Run one statement; ``?`` placeholders are translated for the backend."""
        if self.paramstyle != "qmark":
            sql = sql.replace("?", "%s")
        return self.conn.execute(sql, params)

    def guard(self, sql: str, params: Sequence[Any] = ()) -> None:
        """Send a statement that raises (division by zero) if an optimistic guess was
        wrong, without waiting for it: its error fails the batch before it commits."""
        self.conn.guard(sql.replace("?", "%s"), params)


def _mismatch(key_id: str) -> KeyringMismatchError:
    return KeyringMismatchError(
        key_id,
        f"this process's key {key_id!r} is not the key of that id this store was sealed "
        "with: another keyring, holding a different key under the same id, sealed it. "
        "Nothing was written. Give every process the keyring the store was sealed with "
        "(TETHER_KEYRING, a copy of the same file); a keyring made anew with tether "
        "keyring init is a different one",
    )


def _private(data: dict[str, Any], raw: dict[str, str] | None) -> bool:
    """Whether event data carries a payload or a user's words (what a keyring seals)."""
    return not SECRET_KEYS.isdisjoint(data) or any(k not in PLAIN_RAW for k in raw or ())


def _json(data: dict[str, Any], raw: dict[str, str] | None = None) -> str:
    """JSON for an event's data, embedding already-encoded payloads verbatim."""
    text = dumps(data)
    if not raw:
        return text
    inner = ",".join(f"{_key_json(k)}:{v}" for k, v in raw.items())
    return text[:-1] + ("," if data else "") + inner + "}"


_KEYS: dict[str, str] = {}  #: the few payload keys, JSON-encoded once


def _key_json(key: str) -> str:
    known = _KEYS.get(key)
    if known is None:
        known = json.dumps(key)
        if len(_KEYS) < 64:
            _KEYS[key] = known
    return known


def _opened(
    codec: Codec | None, text: str | None, run_id: str, what: str, keep: bool = False
) -> str | None:
    """``text`` decoded if sealed or offloaded (``_codec``); with ``keep``, a value whose
    key or blob is missing stays as stored (a worker holds its task back and says why)."""
    if text is None or not text.startswith(MARKS):
        return text
    try:
        return decode_text(codec, text, f"run {run_id!r}, {what}")
    except (KeyUnavailableError, BlobError):
        if keep:
            return text
        raise


def _error_json(codec: Codec | None, text: str | None, run_id: str, what: str) -> Any:
    """A stored error as a dict (``seal_error`` kept its type outside the seal)."""
    if not text:
        return None
    error = json.loads(text)
    if isinstance(error, dict) and isinstance(error.get("sealed"), str):
        sealed = decode_text(codec, error["sealed"], f"run {run_id!r}, {what}")
        error = json.loads(sealed)
    return error


def _run_from_row(row: Sequence[Any], codec: Codec | None = None, lenient: bool = False) -> RunInfo:
    """A run's row as a ``RunInfo``. A payload that cannot be read (a missing blob, a
    destroyed or absent key) raises; ``lenient`` (listings, pages, control actions):
    it is null and named in ``unavailable`` with the reason."""
    rid = row[0]
    unavailable: dict[str, str] = {}

    def read(field: str, decode: Callable[[], Any], instead: Any = None) -> Any:
        if not lenient:
            return decode()
        try:
            return decode()
        except (PayloadError, BlobError) as exc:
            unavailable[field] = unavailable_text(exc)
            return instead

    error = read("error", lambda: _error_json(codec, row[6], rid, "error"))
    if "error" in unavailable:  # its type (and its cause's) is kept outside the seal
        try:
            shown = json.loads(row[6])
        except ValueError:
            shown = None
        error = (
            {k: v for k, v in shown.items() if k != "sealed"} if isinstance(shown, dict) else None
        )
    # a task error the engine made is stored tagged: shown untagged, trusted as its own
    task_error = read(
        "task_error", lambda: read_task_error(_opened(codec, row[10], rid, "task error"))
    )
    return RunInfo(
        run_id=rid,
        workflow=row[1],
        status=RunStatus(row[2]),
        queue=row[3],
        input=read("input", lambda: _opened(codec, row[4], rid, "input")) or "null",
        output=read("output", lambda: _opened(codec, row[5], rid, "output")),
        error=error,
        custom_status=read(
            "custom_status", lambda: json.loads(_opened(codec, row[7], rid, "status") or "null")
        )
        if row[7]
        else None,
        parent_run_id=row[8],
        continued_to=row[9],
        # a stuck run stays marked stuck when its task error cannot be read
        task_error=unavailable.get("task_error", task_error),
        created_at=row[11],
        updated_at=row[12],
        completed_at=row[13],
        tenant=row[14],
        waiting_on=(
            [{"kind": "admission", "tenant": row[14]}]
            if row[2] == "queued"
            else json.loads(row[15])
            if row[15]
            else None
        ),
        attrs=json.loads(row[16]) if len(row) > 16 and row[16] else None,
        unavailable=unavailable or None,
    )


def _compact(value: Any) -> str:
    """JSON without spaces (``waiting_on`` is matched with LIKE patterns)."""
    return json.dumps(value, separators=(",", ":"))


#: the kinds of task whose ``run_id`` is a run's, there when the task is (a schedule's
#: is ``schedule:<id>``, no run's; a debounce's run is not started yet): a claim
#: remembers the run tenant of these only, never a None for an id no run has yet
_RUN_TASKS = frozenset({"workflow", "activity", "timer", "deadline"})


def _task_from_row(row: Sequence[Any], tx: _Tx | None = None) -> Task:
    tenant_known = len(row) > 13  # (``_claimed_cols``)
    codec = tx.codec if tx is not None else None
    if tenant_known and tx is not None and codec is not None and row[2] in _RUN_TASKS:
        tx.learn(row[1], row[13])  # (the commit of its outcome seals for it)
    return Task(
        task_id=row[0],
        run_id=row[1],
        kind=row[2],
        step=row[3],
        queue=row[4],
        name=row[5],
        payload=_opened(codec, row[6], row[1], f"step {row[3]}, arguments", keep=True),
        options=json.loads(row[7]) if row[7] else {},
        fence=row[8],
        attempt=row[9],
        lease_expires_at=row[10],
        heartbeat=_opened(codec, row[11], row[1], f"step {row[3]}, heartbeat", keep=True),
        dependency=row[12],
        tenant=row[13] if tenant_known else None,
        tenant_known=tenant_known,
    )
