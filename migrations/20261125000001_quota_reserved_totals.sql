-- Reserved units as a running total per (user, event type), so a quota check reads one row
-- instead of summing the reservation of every job the user has waiting (ADR 0008,
-- docs/quota.md). Triggers keep it in the same statement as every change to
-- quota_reservations, whoever makes it (web, the quota hook, cleanup, hand edits); it counts
-- linked reservations only. Unlinked ones count while their TTL lasts, which a total cannot
-- express; the check sums those few from a partial index instead.

-- No writer may change reservations while the totals are created and filled.
LOCK TABLE quota_reservations IN SHARE ROW EXCLUSIVE MODE;

CREATE TABLE quota_reserved_totals (
    user_id     uuid NOT NULL REFERENCES users (id) ON DELETE CASCADE,
    event_type  fairlane_usage_event_type NOT NULL,
    reserved    bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (user_id, event_type)
);

-- Adds one statement's changes to the totals. Rows are upserted in key order, so statements
-- that touch several users' totals lock them in the same order and never deadlock each other.
CREATE FUNCTION fairlane_quota_reserved_apply() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        INSERT INTO quota_reserved_totals AS t (user_id, event_type, reserved)
        SELECT user_id, event_type, sum(reserved_amount) FROM new_rows
        WHERE job_id IS NOT NULL
        GROUP BY user_id, event_type ORDER BY user_id, event_type
        ON CONFLICT (user_id, event_type) DO UPDATE SET reserved = t.reserved + EXCLUDED.reserved;
    ELSIF TG_OP = 'DELETE' THEN
        -- Only users that still exist: deleting a user cascades to both tables.
        INSERT INTO quota_reserved_totals AS t (user_id, event_type, reserved)
        SELECT o.user_id, o.event_type, -sum(o.reserved_amount) FROM old_rows o
        WHERE o.job_id IS NOT NULL AND EXISTS (SELECT 1 FROM users u WHERE u.id = o.user_id)
        GROUP BY o.user_id, o.event_type ORDER BY o.user_id, o.event_type
        ON CONFLICT (user_id, event_type) DO UPDATE SET reserved = t.reserved + EXCLUDED.reserved;
    ELSE
        INSERT INTO quota_reserved_totals AS t (user_id, event_type, reserved)
        SELECT d.user_id, d.event_type, sum(d.amount) FROM (
            SELECT user_id, event_type, reserved_amount::bigint AS amount FROM new_rows
            WHERE job_id IS NOT NULL
            UNION ALL
            SELECT user_id, event_type, -reserved_amount::bigint FROM old_rows
            WHERE job_id IS NOT NULL
        ) d
        GROUP BY d.user_id, d.event_type HAVING sum(d.amount) <> 0
        ORDER BY d.user_id, d.event_type
        ON CONFLICT (user_id, event_type) DO UPDATE SET reserved = t.reserved + EXCLUDED.reserved;
    END IF;
    RETURN NULL;
END $$;

CREATE TRIGGER quota_reserved_on_insert AFTER INSERT ON quota_reservations
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION fairlane_quota_reserved_apply();
CREATE TRIGGER quota_reserved_on_update AFTER UPDATE ON quota_reservations
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION fairlane_quota_reserved_apply();
CREATE TRIGGER quota_reserved_on_delete AFTER DELETE ON quota_reservations
    REFERENCING OLD TABLE AS old_rows
    FOR EACH STATEMENT EXECUTE FUNCTION fairlane_quota_reserved_apply();

CREATE FUNCTION fairlane_quota_reserved_clear() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM quota_reserved_totals;
    RETURN NULL;
END $$;

CREATE TRIGGER quota_reserved_on_truncate AFTER TRUNCATE ON quota_reservations
    FOR EACH STATEMENT EXECUTE FUNCTION fairlane_quota_reserved_clear();

INSERT INTO quota_reserved_totals (user_id, event_type, reserved)
SELECT user_id, event_type, sum(reserved_amount) FROM quota_reservations
WHERE job_id IS NOT NULL
GROUP BY user_id, event_type;

-- The check's remaining sum: unlinked reservations of one user and event type (normally none).
CREATE INDEX quota_reservations_unlinked_user ON quota_reservations (user_id, event_type, expires_at)
    WHERE job_id IS NULL;
-- Nothing sums every reservation of a user any more; one index fewer to maintain per insert.
DROP INDEX quota_reservations_user;
