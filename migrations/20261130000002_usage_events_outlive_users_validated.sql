-- Validates the constraint the previous migration added NOT VALID, in a transaction of its own:
-- VALIDATE CONSTRAINT takes a SHARE UPDATE EXCLUSIVE lock, so completions keep billing while it
-- scans usage_events.
ALTER TABLE usage_events VALIDATE CONSTRAINT usage_events_user_id_fkey;
