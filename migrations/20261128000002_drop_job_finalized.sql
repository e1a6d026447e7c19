-- no-transaction
-- Replaced by `fairlane_job_finalized_state`, which serves everything it did.
DROP INDEX CONCURRENTLY fairlane_job_finalized;
