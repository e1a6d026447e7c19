-- Users and their subscription tier. The tier decides the lane (seed ADR-16), the per-user
-- concurrency limit (fairness) and the quota limits; it is read from here, never from job args.

CREATE TYPE fairlane_tier AS ENUM ('free', 'pro', 'pro_plus', 'enterprise');

CREATE TABLE users (
    id          uuid        PRIMARY KEY DEFAULT gen_random_uuid(),
    name        text        NOT NULL CHECK (char_length(name) BETWEEN 1 AND 200),
    tier        fairlane_tier NOT NULL DEFAULT 'free',
    created_at  timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now()
);
