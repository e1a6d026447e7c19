-- The job queue: jobs, the worker processes that run them, and leader leases for fleet-wide
-- maintenance. Why each index and storage setting exists: docs/queue-storage.md.

CREATE TYPE fairlane_job_state AS ENUM (
    'available',  -- runnable now
    'scheduled',  -- runnable at scheduled_at (future insert or snooze)
    'running',    -- fetched by a worker; attempted_by's last entry is the worker
    'retryable',  -- failed, will be runnable at scheduled_at (backoff)
    'completed',  -- final: handler succeeded
    'cancelled',  -- final: cancelled by a user or a handler
    'discarded'   -- final: failed max_attempts times
);

-- Invariants of values written once are domains rather than table CHECKs: PostgreSQL re-checks
-- every table CHECK on every UPDATE, and a job row is updated at least twice in its life; a
-- domain is checked only when a value is assigned to it.
-- ASCII letters, digits, `_` and `-`, 1 to 128 characters. Written with ltrim over the allowed
-- set rather than a regular expression: the regex costs ~3 µs per inserted row, half of a bulk
-- load's time.
CREATE DOMAIN fairlane_queue_name AS text
    CHECK (VALUE <> '' AND octet_length(VALUE) <= 128 AND
           ltrim(VALUE, 'ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-') = '');
CREATE DOMAIN fairlane_job_kind AS text
    CHECK (char_length(VALUE) BETWEEN 1 AND 255);
CREATE DOMAIN fairlane_job_args AS jsonb
    CHECK (jsonb_typeof(VALUE) = 'object');
CREATE DOMAIN fairlane_job_errors AS jsonb
    CHECK (jsonb_typeof(VALUE) = 'array');
CREATE DOMAIN fairlane_job_priority AS smallint
    CHECK (VALUE BETWEEN 1 AND 4);
CREATE DOMAIN fairlane_job_max_attempts AS smallint
    CHECK (VALUE > 0);

CREATE TABLE fairlane_job (
    id            bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    state         fairlane_job_state NOT NULL DEFAULT 'available',
    queue         fairlane_queue_name NOT NULL,
    kind          fairlane_job_kind   NOT NULL,
    args          fairlane_job_args   NOT NULL DEFAULT '{}',
    -- Fairness and isolation key (a `users.id`); a job without it is a system job.
    user_id       uuid GENERATED ALWAYS AS ((args ->> 'user_id')::uuid) STORED,
    priority      fairlane_job_priority     NOT NULL DEFAULT 1,
    attempt       smallint                  NOT NULL DEFAULT 0,
    max_attempts  fairlane_job_max_attempts NOT NULL DEFAULT 25,
    scheduled_at  timestamptz NOT NULL DEFAULT now(),
    created_at    timestamptz NOT NULL DEFAULT now(),
    attempted_at  timestamptz,
    finalized_at  timestamptz,
    attempted_by  text[]      NOT NULL DEFAULT '{}',
    -- One entry per failed attempt: {attempt, at, error, kind}.
    errors        fairlane_job_errors NOT NULL DEFAULT '[]',
    -- snoozes (count), trace (W3C context), cancel_attempted_at, ...
    metadata      jsonb       NOT NULL DEFAULT '{}',
    -- What a successful handler returned, if anything.
    output        jsonb,
    unique_key    text,

    CONSTRAINT fairlane_job_attempt_non_negative CHECK (attempt >= 0),
    CONSTRAINT fairlane_job_finalized_iff_final CHECK (
        (state IN ('completed', 'cancelled', 'discarded')) = (finalized_at IS NOT NULL)
    )
) WITH (
    fillfactor = 85,
    autovacuum_vacuum_scale_factor = 0.0,
    autovacuum_vacuum_threshold = 5000,
    autovacuum_vacuum_insert_scale_factor = 0.0,
    autovacuum_vacuum_insert_threshold = 20000,
    autovacuum_analyze_scale_factor = 0.0,
    autovacuum_analyze_threshold = 5000,
    autovacuum_vacuum_cost_delay = 0
);

-- The share of rows in each state changes by the millisecond, so whatever ANALYZE last saw is
-- wrong: seeing almost no `running` rows, the planner would drive a completion batch from a scan
-- of "the one running row" and rescan the batch per row (seconds per batch). Without statistics it
-- assumes a fixed small share and looks completed ids up by primary key, at any table size.
ALTER TABLE fairlane_job ALTER COLUMN state SET STATISTICS 0;

-- The fetch query's index: only runnable rows, in exactly the fetch order.
CREATE INDEX fairlane_job_fetch ON fairlane_job (queue, priority, scheduled_at, id)
    WHERE state = 'available';

-- Promotion of due scheduled/retryable rows to available.
CREATE INDEX fairlane_job_due ON fairlane_job (scheduled_at)
    WHERE state IN ('scheduled', 'retryable');

-- Running rows. Both predicates say more than `state = 'running'` on purpose: the completion
-- updates are guarded by `state = 'running'` alone, so they can only use the primary key. If a
-- running-only index matched them, the planner (whose statistics see few running rows) would
-- drive a 2,000-row completion batch from that index and rescan the batch per row.
-- Per-user running counts (fairness):
CREATE INDEX fairlane_job_running_user ON fairlane_job (user_id, queue)
    WHERE state = 'running' AND user_id IS NOT NULL;
-- Running jobs by the worker running them (rescue, heartbeat reconciliation):
CREATE INDEX fairlane_job_running_worker ON fairlane_job ((attempted_by[cardinality(attempted_by)]))
    WHERE state = 'running' AND cardinality(attempted_by) > 0;

-- Uniqueness among jobs that are not final: a finished job frees its key.
CREATE UNIQUE INDEX fairlane_job_unique_key ON fairlane_job (unique_key)
    WHERE unique_key IS NOT NULL AND state IN ('available', 'scheduled', 'running', 'retryable');

-- The cleaner deletes old final rows.
CREATE INDEX fairlane_job_finalized ON fairlane_job (finalized_at)
    WHERE finalized_at IS NOT NULL;

-- Live worker processes. A process heartbeats its row; one whose heartbeat is stale is presumed
-- dead and its running jobs are rescued.
CREATE TABLE fairlane_worker (
    id            text        PRIMARY KEY,
    hostname      text        NOT NULL,
    pid           integer     NOT NULL,
    queues        text[]      NOT NULL DEFAULT '{}',
    started_at    timestamptz NOT NULL DEFAULT now(),
    heartbeat_at  timestamptz NOT NULL DEFAULT now()
) WITH (fillfactor = 50);

-- Leases for work that must happen once fleet-wide (queue maintenance, the scheduler's ticks).
CREATE TABLE fairlane_leader (
    name        text        PRIMARY KEY,
    leader_id   text        NOT NULL,
    elected_at  timestamptz NOT NULL DEFAULT now(),
    expires_at  timestamptz NOT NULL
) WITH (fillfactor = 50);
