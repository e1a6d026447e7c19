-- Usage quota (SPEC §5, seed ADR-21): billed usage events and the reservations that hold units
-- for jobs that have not finished. Why each piece exists: docs/quota.md.

CREATE TYPE fairlane_usage_event_type AS ENUM ('analysis', 'specview');

-- One row per billed unit batch. A job is billed at most once: job_id is UNIQUE (NULLs allowed
-- for rows without a job, such as manual adjustments or imported usage).
CREATE TABLE usage_events (
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    user_id      uuid NOT NULL REFERENCES users (id) ON DELETE CASCADE,
    event_type   fairlane_usage_event_type NOT NULL,
    amount       integer NOT NULL CHECK (amount > 0),
    job_id       bigint UNIQUE,
    occurred_at  timestamptz NOT NULL DEFAULT now()
);

-- Per-period sums: an index-only range scan per (user, event type).
CREATE INDEX usage_events_period ON usage_events (user_id, event_type, occurred_at) INCLUDE (amount);

-- Units held for a request whose job has not finished. job_id is NULL only between the insert
-- and the job insert of the same transaction (or forever, if a caller forgot to link it: the
-- TTL in expires_at bounds how long such a row counts). No foreign key to fairlane_job: the
-- queue's cleaner deletes old jobs, and a reservation must never block that.
CREATE TABLE quota_reservations (
    id               uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    user_id          uuid NOT NULL REFERENCES users (id) ON DELETE CASCADE,
    event_type       fairlane_usage_event_type NOT NULL,
    reserved_amount  integer NOT NULL CHECK (reserved_amount > 0),
    job_id           bigint UNIQUE,
    expires_at       timestamptz NOT NULL,
    created_at       timestamptz NOT NULL DEFAULT now()
);

-- The reserved sum of one user and event type (ADR-21's composite index).
CREATE INDEX quota_reservations_user ON quota_reservations (user_id, event_type, expires_at);
-- Cleanup of reservations that never got a job.
CREATE INDEX quota_reservations_unlinked ON quota_reservations (created_at) WHERE job_id IS NULL;
