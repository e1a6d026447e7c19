-- A completed job is billed by the statement that deletes its reservation, so a bill is keyed by
-- that reservation, not by the job's id. Job ids are not unique over time: usage imported with
-- its old job ids, or a `fairlane_job` restored apart from `usage_events` (its identity starting
-- over), gave a new job an id an older event already held, and `ON CONFLICT (job_id) DO NOTHING`
-- then dropped the new job's bill while its reservation was released: usage lost, quota
-- overspent.
--
-- `reservation_id` is NULL on rows billed before this migration and on rows without a
-- reservation (imported usage, manual adjustments). `UNIQUE (job_id)` stays, for now: binaries
-- of the previous release, still running while a rolling update replaces them, bill with
-- `ON CONFLICT (job_id)`, which PostgreSQL refuses outright once no unique index on `job_id`
-- exists. This release bills a job whose id an older event holds with `job_id` NULL (the
-- reservation names it); a later release can drop the constraint.
ALTER TABLE usage_events ADD COLUMN reservation_id uuid;
ALTER TABLE usage_events ADD CONSTRAINT usage_events_reservation_id_key UNIQUE (reservation_id);
