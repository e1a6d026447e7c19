-- Billed usage is never deleted with its user: a `DELETE FROM users` of someone with usage events
-- is refused (foreign key violation) instead of erasing their billing history, as the cascade
-- did. Deleting such a user is a decision about their billing records, made by removing or
-- anonymising them first (docs/quota.md). Reservations, keys, records and the derived daily
-- totals still go with the user.
--
-- The constraint is replaced NOT VALID, so this takes its locks for a moment and scans nothing
-- (every row already references a user: the old constraint held); the next migration validates
-- it without blocking writers. The name stays, so binaries of the previous release see no
-- difference but the refusal.
ALTER TABLE usage_events
    DROP CONSTRAINT usage_events_user_id_fkey,
    ADD CONSTRAINT usage_events_user_id_fkey FOREIGN KEY (user_id) REFERENCES users (id)
        ON DELETE RESTRICT NOT VALID;
