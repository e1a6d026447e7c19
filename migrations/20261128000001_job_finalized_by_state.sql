-- The cleaner deletes each final state's rows older than that state's retention (completed
-- 1 day, cancelled and discarded 7 days by default). On an index of `finalized_at` alone, every
-- pass read every cancelled and discarded row between the two retentions from the heap and
-- dropped it by state. Keyed by state first, each state's delete reads only rows it deletes.
--
-- Built in the migration's transaction, not CONCURRENTLY: a concurrent build waits for every
-- older snapshot, including a second migrator's waiting on sqlx's migration lock, which
-- deadlocks, and a failed one leaves an invalid index that a rerun trips over. Job writes wait
-- while it builds, which takes seconds for a table its retentions keep to about a week of jobs.
CREATE INDEX fairlane_job_finalized_state ON fairlane_job (state, finalized_at)
    WHERE finalized_at IS NOT NULL;
-- Replaced: the index above serves everything it did.
DROP INDEX fairlane_job_finalized;
