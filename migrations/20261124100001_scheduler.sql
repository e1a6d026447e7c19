-- The scheduler's periodic actions, one row per task and tick (docs/scheduler.md).
--
-- A tick is claimed by inserting its row in the same transaction as the tick's work (the enqueue of
-- re-analyses), so it commits at most once whatever happens to leaders: a second replica, a paused
-- leader that wakes up, or a new leader catching up, all hit the primary key. The newest tick of a
-- task is also where a new leader resumes (it catches up the ticks after it).
CREATE TABLE scheduler_ticks (
    task        text        NOT NULL,
    tick_at     timestamptz NOT NULL,
    -- The scheduler replica (candidate id) that did it.
    claimed_by  text        NOT NULL,
    claimed_at  timestamptz NOT NULL DEFAULT now(),
    -- What the tick did (counts), for operators.
    result      jsonb,
    PRIMARY KEY (task, tick_at)
);

-- "Was this repository re-analysed recently?": system analyses (no user) by repository and age,
-- so a repository whose re-analysis failed is not queued again on every tick.
CREATE INDEX analyses_system_recency ON analyses (repository, created_at DESC)
    WHERE user_id IS NULL;
