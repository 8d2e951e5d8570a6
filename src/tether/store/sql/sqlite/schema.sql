-- tether schema for SQLite (WAL). Applied idempotently at open; user_version
-- records the schema version so later releases can migrate forward.

-- One row per run. Status values equal tether.RunStatus. ``next_seq`` is the
-- next history sequence number: appends read and bump it in the same write
-- transaction, so one run's history can never get a gap or a duplicate.
CREATE TABLE IF NOT EXISTS runs (
    run_id         TEXT PRIMARY KEY,
    workflow       TEXT NOT NULL,
    status         TEXT NOT NULL,
    queue          TEXT NOT NULL,
    input          TEXT NOT NULL,
    output         TEXT,
    error          TEXT,            -- JSON {type, message, traceback}
    custom_status  TEXT,            -- JSON set by tether.set_status
    parent_run_id  TEXT,            -- set for child runs
    parent_step    INTEGER,         -- the parent's command step waiting on this run
    continued_to   TEXT,            -- run id this run continued as new into
    task_error     TEXT,            -- last workflow-task failure (e.g. non-determinism)
    next_seq       INTEGER NOT NULL DEFAULT 1,
    created_at     REAL NOT NULL,
    updated_at     REAL NOT NULL,
    completed_at   REAL,
    tenant         TEXT,              -- app.start(tenant=): admission limits
    waiting_on     TEXT,              -- JSON: what the run waits for after its last task
    attrs          TEXT               -- JSON: what it was started with (budget, model pins)
);
CREATE INDEX IF NOT EXISTS runs_by_status ON runs (status, created_at);
CREATE INDEX IF NOT EXISTS runs_by_workflow ON runs (workflow, created_at);
CREATE INDEX IF NOT EXISTS runs_by_tenant ON runs (tenant, status, created_at) WHERE tenant IS NOT NULL;

-- The append-only history. ``step`` is the workflow command number an event
-- belongs to (NULL for signals, markers and operator actions). A rowid table (not
-- WITHOUT ROWID, as before version 15): its rows, often hundreds of bytes (model
-- messages, sealed payloads), are appended at the table's end, and only the small
-- (run_id, seq) keys are spread over the key's index; a WITHOUT ROWID b-tree keeps
-- whole rows in its inner pages too, so each commit wrote about twice the pages.
CREATE TABLE IF NOT EXISTS events (
    run_id      TEXT NOT NULL,
    seq         INTEGER NOT NULL,
    type        TEXT NOT NULL,
    step        INTEGER,
    data        TEXT,
    created_at  REAL NOT NULL,
    PRIMARY KEY (run_id, seq)
);

-- Ready and leased work. A task is claimable when ``available_at`` has passed:
-- claiming sets it to the lease expiry, so an expired lease makes the task
-- claimable again with no extra column. Every claim bumps ``fence``; every
-- write that completes a task presents the fence it claimed with, and a stale
-- one is rejected.
CREATE TABLE IF NOT EXISTS tasks (
    task_id           INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id            TEXT NOT NULL,
    kind              TEXT NOT NULL,   -- workflow | activity | timer
    step              INTEGER,
    queue             TEXT NOT NULL,
    name              TEXT,
    payload           TEXT,
    options           TEXT,
    available_at      REAL NOT NULL,
    lease_owner       TEXT,
    fence             INTEGER NOT NULL DEFAULT 0,
    attempt           INTEGER NOT NULL DEFAULT 0,
    cancel_requested  INTEGER NOT NULL DEFAULT 0,
    heartbeat         TEXT,            -- last heartbeat details (JSON)
    heartbeat_timeout REAL,            -- set: only heartbeats extend the lease
    priority          INTEGER NOT NULL DEFAULT 0,  -- higher is claimed first
    limit_key         TEXT,            -- e.g. a tenant: key_concurrency and fairness
    dependency        TEXT,            -- tether.Dependency limiter (a queue_limits row)
    batch_key         TEXT,            -- tether.Batch: tasks with one key run as one call
    batch_max         INTEGER,         -- its max_items: a batch runs when this many are ready
    batch_wait        REAL,            -- its max_wait: ... or the oldest ready waited this long
    batch_id          INTEGER,         -- leased as part of the batch led by this task id
    last_error        TEXT,
    created_at        REAL NOT NULL
);
-- At most one workflow task per run: new events for a run whose task is
-- already queued or running fold into that task.
CREATE UNIQUE INDEX IF NOT EXISTS tasks_one_workflow_task ON tasks (run_id) WHERE kind = 'workflow';
-- (run_id, step) is unique for steps; workflow and deadline tasks have no step (NULLs
-- are distinct), and the index also serves every lookup by run_id.
CREATE UNIQUE INDEX IF NOT EXISTS tasks_by_run_step ON tasks (run_id, step);
CREATE INDEX IF NOT EXISTS tasks_ready ON tasks (queue, available_at);
-- The claim order (priority, then age) per queue: a claim reads only the rows it takes,
-- however large the backlog (no sort of every ready task).
CREATE INDEX IF NOT EXISTS tasks_ready_order ON tasks (queue, priority DESC, available_at);
CREATE INDEX IF NOT EXISTS tasks_by_dependency ON tasks (dependency, available_at) WHERE dependency IS NOT NULL;
-- Batched activity tasks (empty unless tether.Batch is used): grouped by key at each claim.
CREATE INDEX IF NOT EXISTS tasks_by_batch ON tasks (batch_key, available_at) WHERE batch_key IS NOT NULL;

-- Steps and runs that exhausted their failure policy, kept with their input and
-- last error until an operator replays or dismisses them.
CREATE TABLE IF NOT EXISTS dead_letters (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id       TEXT NOT NULL,
    step         INTEGER,
    kind         TEXT NOT NULL,   -- activity | run
    name         TEXT NOT NULL,   -- activity or workflow name
    input        TEXT,
    error        TEXT,
    attempts     INTEGER,
    reason       TEXT,
    created_at   REAL NOT NULL,
    resolved_at  REAL,
    resolution   TEXT             -- JSON: how it was resolved (replayed result, retried run)
);
CREATE INDEX IF NOT EXISTS dead_letters_open ON dead_letters (resolved_at, created_at);

-- Circuit breakers, shared by every worker: state is closed | open | half_open.
CREATE TABLE IF NOT EXISTS breakers (
    name          TEXT PRIMARY KEY,
    state         TEXT NOT NULL,
    opened_at     REAL,
    window_start  REAL NOT NULL,
    calls         INTEGER NOT NULL,
    failures      INTEGER NOT NULL,
    trial_at      REAL              -- when the half-open trial call was let through
);

-- Queue limits, shared by every worker (app.configure_queue). ``rate`` is in
-- tokens per second, spent one per claimed activity from a bucket of ``burst``
-- tokens; ``tokens`` and ``refilled_at`` are the live bucket. ``paused_until``
-- stops claims from the queue (app.pause_queue, or a 429 with Retry-After).
CREATE TABLE IF NOT EXISTS queue_limits (
    queue            TEXT PRIMARY KEY,
    max_concurrency  INTEGER,          -- running activity tasks, across all workers
    rate             REAL,
    burst            REAL,
    tokens           REAL,
    refilled_at      REAL,
    key_concurrency  INTEGER,          -- running activity tasks per limit_key
    fair             INTEGER NOT NULL DEFAULT 0,  -- interleave limit keys
    pause_on_429     INTEGER NOT NULL DEFAULT 1,
    paused_until     REAL,
    fair_cursor      TEXT,             -- fair queues: the limit key served last
    updated_at       REAL NOT NULL
);

-- Admission limits (app.configure_admission): at most ``max_running`` non-terminal
-- runs per tenant; tenant '' holds the default. A row per tenant that started a run
-- is also the lock that serialises its starts and finishes (NULL: use the default).
CREATE TABLE IF NOT EXISTS tenant_limits (
    tenant       TEXT PRIMARY KEY,
    max_running  INTEGER,
    updated_at   REAL NOT NULL,
    retention    REAL              -- seconds an ended run of the tenant is kept (NULL: ever)
);

-- Debounced starts (app.start_debounced): one row per key holds the last input; a
-- 'debounce' task due at ``due_at`` turns it into the run ``run_id``.
CREATE TABLE IF NOT EXISTS debounces (
    debounce_key  TEXT PRIMARY KEY,
    run_id        TEXT NOT NULL,
    workflow      TEXT NOT NULL,
    queue         TEXT NOT NULL,
    input         TEXT NOT NULL,
    triggers      INTEGER NOT NULL,
    first_at      REAL NOT NULL,
    due_at        REAL NOT NULL,
    updated_at    REAL NOT NULL
);

-- API keys of the HTTP service (tether serve): only a hash of the secret is kept; a key
-- acts for one tenant (role client) or for every tenant (role admin).
CREATE TABLE IF NOT EXISTS api_keys (
    key_id       TEXT PRIMARY KEY,
    secret_hash  TEXT NOT NULL,
    name         TEXT,
    tenant       TEXT,
    role         TEXT NOT NULL,
    created_at   REAL NOT NULL,
    revoked_at   REAL
);

-- tether.ai: answers kept for reuse across runs (opt-in per model), by a hash of the
-- model, prompt, tools, parameters and output type; a row past ``expires_at`` is dead.
CREATE TABLE IF NOT EXISTS ai_cache (
    cache_key    TEXT PRIMARY KEY,
    value        TEXT NOT NULL,
    created_at   REAL NOT NULL,
    expires_at   REAL NOT NULL
);

-- tether.ai: model spend per scope ('tenant:<name>' or 'global') and UTC day, added by
-- each call, and the daily budgets set on those scopes (app.configure_model_budget).
CREATE TABLE IF NOT EXISTS ai_spend (
    scope        TEXT NOT NULL,
    day          TEXT NOT NULL,
    tokens       BIGINT NOT NULL,
    cost         TEXT NOT NULL,
    updated_at   REAL NOT NULL,
    PRIMARY KEY (scope, day)
);

CREATE TABLE IF NOT EXISTS ai_budgets (
    scope        TEXT PRIMARY KEY,
    tokens       BIGINT,
    cost         TEXT,
    updated_at   REAL NOT NULL
);

-- tether.ai: the estimate a provider batch's submit step holds in the day's spend, by
-- its (run, step), written in the transaction that adds it to ai_spend: a later attempt
-- of the step (after a crash, a retry, a replayed dead letter) reuses it (and becomes
-- its holder: an earlier attempt's late give-back leaves it), and it goes when given
-- back or replaced by what the batch used. scopes: a JSON list.
CREATE TABLE IF NOT EXISTS ai_holds (
    run_id       TEXT NOT NULL,
    step         INTEGER NOT NULL,
    holder       TEXT NOT NULL,
    scopes       TEXT NOT NULL,
    day          TEXT NOT NULL,
    tokens       BIGINT NOT NULL,
    cost         TEXT NOT NULL,
    created_at   REAL NOT NULL,
    PRIMARY KEY (run_id, step)
);

-- Reviews opened by tether.approval, kept in step with the run's approval markers in the
-- same commit (store/ops/approvals.py): the list of open reviews, decidable from outside.
CREATE TABLE IF NOT EXISTS approvals (
    approval_id  TEXT PRIMARY KEY,
    run_id       TEXT NOT NULL,
    name         TEXT NOT NULL,
    fingerprint  TEXT NOT NULL,
    proposal     TEXT NOT NULL,
    approvers    TEXT NOT NULL,
    deadline_at  REAL NOT NULL,
    status       TEXT NOT NULL,
    level        INTEGER NOT NULL,
    allow_edit   INTEGER NOT NULL,
    decided_by   TEXT,
    decided_at   REAL,
    reason       TEXT,
    reminded_at  REAL,
    created_at   REAL NOT NULL,
    updated_at   REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS approvals_by_status ON approvals (status, created_at);
CREATE INDEX IF NOT EXISTS approvals_by_run ON approvals (run_id);

-- The webhook outbox (store/ops/webhooks.py): a run's outcome, queued for its callback URL
-- in the commit that ends the run, delivered at least once by the HTTP service's relay.
CREATE TABLE IF NOT EXISTS webhook_outbox (
    delivery_id  INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id       TEXT NOT NULL,
    url          TEXT NOT NULL,
    workflow     TEXT NOT NULL,
    status       TEXT NOT NULL,
    output       TEXT,
    error        TEXT,
    tenant       TEXT,
    ended_at     REAL,
    attempts     INTEGER NOT NULL,
    state        TEXT NOT NULL,            -- pending | delivered | failed (gave up)
    last_error   TEXT,
    next_at      REAL NOT NULL,
    delivered_at REAL,
    created_at   REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS webhook_outbox_due ON webhook_outbox (state, next_at);
CREATE INDEX IF NOT EXISTS webhook_outbox_by_run ON webhook_outbox (run_id);

-- Kill switches (store/ops/switches.py): a workflow, activity, model or tenant turned off
-- for every worker until removed.
CREATE TABLE IF NOT EXISTS switches (
    kind        TEXT NOT NULL,             -- workflow | activity | model | tenant
    name        TEXT NOT NULL,
    by_whom     TEXT,
    reason      TEXT,
    created_at  REAL NOT NULL,
    PRIMARY KEY (kind, name)
);

-- Who did what to which run or switch (API, console, CLI).
CREATE TABLE IF NOT EXISTS audit_log (
    id      INTEGER PRIMARY KEY AUTOINCREMENT,
    at      REAL NOT NULL,
    actor   TEXT NOT NULL,
    action  TEXT NOT NULL,
    target  TEXT NOT NULL,                 -- run:<id>, switch:<kind>:<name>, review:<id>, ...
    detail  TEXT
);
CREATE INDEX IF NOT EXISTS audit_log_by_target ON audit_log (target, id);

-- Schedules (app.schedule): one row each; a 'schedule' task (run_id "schedule:<id>",
-- name <id>) is due at the next tick plus jitter, and the worker that claims it fires
-- the tick in one commit (the run id <id>@<tick> makes a second firing impossible).
CREATE TABLE IF NOT EXISTS schedules (
    schedule_id TEXT PRIMARY KEY,
    workflow TEXT NOT NULL,
    queue TEXT NOT NULL,
    input TEXT NOT NULL,
    spec TEXT NOT NULL,
    tenant TEXT,
    paused INTEGER NOT NULL DEFAULT 0,
    note TEXT,
    next_at REAL,
    last_tick REAL,
    last_run_id TEXT,
    buffered REAL,
    fired BIGINT NOT NULL DEFAULT 0,
    skipped BIGINT NOT NULL DEFAULT 0,
    version BIGINT NOT NULL DEFAULT 1,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);

-- Runs removed by retention (tether purge) or tenant erasure: their ids answer as
-- purged, not as unknown. Nothing else of them is kept.
CREATE TABLE IF NOT EXISTS purged_runs (
    run_id     TEXT PRIMARY KEY,
    workflow   TEXT,
    reason     TEXT NOT NULL,
    purged_at  REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS dead_letters_by_run ON dead_letters (run_id);

-- Signals and updates sent with an id (app.signal(signal_id=), app.update(update_id=),
-- an HTTP Idempotency-Key): one row per id and continue-as-new chain (named by its
-- first run id), written in the commit that records the signal, so a repeat of the
-- id is recognised and recorded nowhere. ``run_id`` and ``seq``: where it went.
CREATE TABLE IF NOT EXISTS signal_ids (
    chain_id    TEXT NOT NULL,
    signal_id   TEXT NOT NULL,
    run_id      TEXT NOT NULL,
    seq         INTEGER NOT NULL,
    created_at  REAL NOT NULL,
    PRIMARY KEY (chain_id, signal_id)
);
CREATE INDEX IF NOT EXISTS signal_ids_by_run ON signal_ids (run_id);
-- The fingerprint (an HMAC under the key, never the key) of each key id payloads here
-- were sealed under: a process whose key of an id differs is refused before it seals
-- (tether.encryption). A row here also marks the store encrypted: a process without a
-- keyring writes no payload into it.
CREATE TABLE IF NOT EXISTS seal_keys (
    key_id       TEXT PRIMARY KEY,
    fingerprint  TEXT NOT NULL,
    created_at   REAL NOT NULL
);

-- blobs a purge or an erasure is to delete: recorded in the transaction that removes
-- the rows referring to them, removed once each is deleted (or found in use again), so
-- a process killed in between leaves them for the next purge, erasure or gc-blobs.
-- A blob written or put again at or after spare_from stays (gc-blobs judges it).
CREATE TABLE IF NOT EXISTS blob_deletions (
    ref        TEXT PRIMARY KEY,
    spare_from REAL NOT NULL,
    noted_at   REAL NOT NULL
);

-- the latest run of each continue-as-new chain (named by its first run id), written in
-- the commit that continues it: an operation on any id of the chain reads its head here
-- in one lookup instead of walking (and, on PostgreSQL, locking) every link.
CREATE TABLE IF NOT EXISTS chains (
    chain_id     TEXT PRIMARY KEY,
    head_run_id  TEXT NOT NULL
);
