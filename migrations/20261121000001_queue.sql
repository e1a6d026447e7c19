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

CREATE TABLE fairlane_job (
    id            bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    state         fairlane_job_state NOT NULL DEFAULT 'available',
    queue         text        NOT NULL,
    kind          text        NOT NULL,
    args          jsonb       NOT NULL DEFAULT '{}',
    -- Fairness and isolation key; a job without it is a system job.
    user_id       text GENERATED ALWAYS AS (args ->> 'user_id') STORED,
    priority      smallint    NOT NULL DEFAULT 1,
    attempt       smallint    NOT NULL DEFAULT 0,
    max_attempts  smallint    NOT NULL DEFAULT 25,
    scheduled_at  timestamptz NOT NULL DEFAULT now(),
    created_at    timestamptz NOT NULL DEFAULT now(),
    attempted_at  timestamptz,
    finalized_at  timestamptz,
    attempted_by  text[]      NOT NULL DEFAULT '{}',
    -- One entry per failed attempt: {attempt, at, error, kind}.
    errors        jsonb       NOT NULL DEFAULT '[]',
    -- snoozes (count), trace (W3C context), cancel_attempted_at, ...
    metadata      jsonb       NOT NULL DEFAULT '{}',
    -- What a successful handler returned, if anything.
    output        jsonb,
    unique_key    text,

    CONSTRAINT fairlane_job_queue_name CHECK (queue ~ '^[A-Za-z0-9_-]{1,128}$'),
    CONSTRAINT fairlane_job_kind_length CHECK (char_length(kind) BETWEEN 1 AND 255),
    CONSTRAINT fairlane_job_priority_range CHECK (priority BETWEEN 1 AND 4),
    CONSTRAINT fairlane_job_max_attempts_positive CHECK (max_attempts > 0),
    CONSTRAINT fairlane_job_attempt_non_negative CHECK (attempt >= 0),
    CONSTRAINT fairlane_job_finalized_iff_final CHECK (
        (state IN ('completed', 'cancelled', 'discarded')) = (finalized_at IS NOT NULL)
    ),
    CONSTRAINT fairlane_job_errors_is_array CHECK (jsonb_typeof(errors) = 'array'),
    CONSTRAINT fairlane_job_args_is_object CHECK (jsonb_typeof(args) = 'object')
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

-- The fetch query's index: only runnable rows, in exactly the fetch order.
CREATE INDEX fairlane_job_fetch ON fairlane_job (queue, priority, scheduled_at, id)
    WHERE state = 'available';

-- Promotion of due scheduled/retryable rows to available.
CREATE INDEX fairlane_job_due ON fairlane_job (scheduled_at)
    WHERE state IN ('scheduled', 'retryable');

-- Running rows: rescue, per-user running counts (fairness), the heartbeat's reconciliation.
CREATE INDEX fairlane_job_running ON fairlane_job (user_id, queue)
    WHERE state = 'running';

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
