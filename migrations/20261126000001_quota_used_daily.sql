-- Used units as running totals per (user, event type, UTC day), so a quota check reads at most
-- one row per day of its billing period instead of every usage event of the period (ADR 0011,
-- docs/quota.md). Every billing cycle cuts at UTC midnight, so a period is a whole number of
-- days. Triggers keep the totals in the same statement as every change to usage_events,
-- whoever makes it (the quota hook, imports, hand edits), like quota_reserved_totals.

-- No writer may change usage events while the totals are created and filled.
LOCK TABLE usage_events IN SHARE ROW EXCLUSIVE MODE;

CREATE TABLE quota_used_daily (
    user_id     uuid NOT NULL REFERENCES users (id) ON DELETE CASCADE,
    event_type  fairlane_usage_event_type NOT NULL,
    day         date NOT NULL,
    used        bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (user_id, event_type, day)
);

-- Adds one statement's changes to the totals, upserted in key order so that statements touching
-- several users' totals lock them in the same order and never deadlock each other.
CREATE FUNCTION fairlane_quota_used_apply() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        INSERT INTO quota_used_daily AS t (user_id, event_type, day, used)
        SELECT user_id, event_type, (occurred_at AT TIME ZONE 'UTC')::date, sum(amount)
        FROM new_rows
        GROUP BY 1, 2, 3 ORDER BY 1, 2, 3
        ON CONFLICT (user_id, event_type, day) DO UPDATE SET used = t.used + EXCLUDED.used;
    ELSIF TG_OP = 'DELETE' THEN
        -- Only users that still exist: deleting a user cascades to both tables.
        INSERT INTO quota_used_daily AS t (user_id, event_type, day, used)
        SELECT o.user_id, o.event_type, (o.occurred_at AT TIME ZONE 'UTC')::date, -sum(o.amount)
        FROM old_rows o
        WHERE EXISTS (SELECT 1 FROM users u WHERE u.id = o.user_id)
        GROUP BY 1, 2, 3 ORDER BY 1, 2, 3
        ON CONFLICT (user_id, event_type, day) DO UPDATE SET used = t.used + EXCLUDED.used;
    ELSE
        INSERT INTO quota_used_daily AS t (user_id, event_type, day, used)
        SELECT d.user_id, d.event_type, d.day, sum(d.amount) FROM (
            SELECT user_id, event_type, (occurred_at AT TIME ZONE 'UTC')::date AS day,
                   amount::bigint AS amount
            FROM new_rows
            UNION ALL
            SELECT user_id, event_type, (occurred_at AT TIME ZONE 'UTC')::date, -amount::bigint
            FROM old_rows
        ) d
        GROUP BY 1, 2, 3 HAVING sum(d.amount) <> 0
        ORDER BY 1, 2, 3
        ON CONFLICT (user_id, event_type, day) DO UPDATE SET used = t.used + EXCLUDED.used;
    END IF;
    RETURN NULL;
END $$;

CREATE TRIGGER quota_used_on_insert AFTER INSERT ON usage_events
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION fairlane_quota_used_apply();
CREATE TRIGGER quota_used_on_update AFTER UPDATE ON usage_events
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION fairlane_quota_used_apply();
CREATE TRIGGER quota_used_on_delete AFTER DELETE ON usage_events
    REFERENCING OLD TABLE AS old_rows
    FOR EACH STATEMENT EXECUTE FUNCTION fairlane_quota_used_apply();

CREATE FUNCTION fairlane_quota_used_clear() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM quota_used_daily;
    RETURN NULL;
END $$;

CREATE TRIGGER quota_used_on_truncate AFTER TRUNCATE ON usage_events
    FOR EACH STATEMENT EXECUTE FUNCTION fairlane_quota_used_clear();

INSERT INTO quota_used_daily (user_id, event_type, day, used)
SELECT user_id, event_type, (occurred_at AT TIME ZONE 'UTC')::date, sum(amount)
FROM usage_events
GROUP BY 1, 2, 3;

-- Nothing sums a period's events any more; one index fewer to maintain per billed job.
DROP INDEX usage_events_period;
