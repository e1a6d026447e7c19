-- A completed job is billed by the statement that deletes its reservation, so a bill is keyed by
-- that reservation, not by the job's id. Job ids are not unique over time: usage imported with
-- its old job ids, or a `fairlane_job` restored apart from `usage_events` (its identity starting
-- over), gave a new job an id an older event already held, and `UNIQUE (job_id)` then dropped the
-- new job's bill while its reservation was released: usage lost, quota overspent.
--
-- `reservation_id` is NULL on rows billed before this migration and on rows without a
-- reservation (imported usage, manual adjustments). `job_id` keeps an index of its own, for
-- finding what a job was billed.
ALTER TABLE usage_events ADD COLUMN reservation_id uuid;
ALTER TABLE usage_events ADD CONSTRAINT usage_events_reservation_id_key UNIQUE (reservation_id);
ALTER TABLE usage_events DROP CONSTRAINT usage_events_job_id_key;
CREATE INDEX usage_events_job ON usage_events (job_id) WHERE job_id IS NOT NULL;
