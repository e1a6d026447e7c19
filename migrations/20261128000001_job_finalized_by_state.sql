-- no-transaction
-- The cleaner deletes each final state's rows older than that state's retention (completed
-- 1 day, cancelled and discarded 7 days by default). On an index of `finalized_at` alone, every
-- pass read every cancelled and discarded row between the two retentions from the heap and
-- dropped it by state. Keyed by state first, each state's delete reads only rows it deletes.
-- Built concurrently: writers of the job table are not held up while it builds (a file of one
-- statement, since PostgreSQL runs several in one implicit transaction).
CREATE INDEX CONCURRENTLY fairlane_job_finalized_state ON fairlane_job (state, finalized_at)
    WHERE finalized_at IS NOT NULL;
