-- The HTTP API's tables: API keys, and the analysis and specview records that the API creates
-- (state pending) and the workers fill in. Column meanings: docs/web.md.

-- Only a SHA-256 of the key is stored; `id` is the key's public part (`flk_<id>_<secret>`).
CREATE TABLE api_keys (
    id           text PRIMARY KEY CHECK (id ~ '^[0-9a-f]{16}$'),
    user_id      uuid NOT NULL REFERENCES users (id) ON DELETE CASCADE,
    key_hash     bytea NOT NULL UNIQUE CHECK (octet_length(key_hash) = 32),
    created_at   timestamptz NOT NULL DEFAULT now(),
    revoked_at   timestamptz
);
CREATE INDEX api_keys_user ON api_keys (user_id);

CREATE TYPE fairlane_work_state AS ENUM ('pending', 'running', 'completed', 'failed');

CREATE TABLE analyses (
    id             uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    user_id        uuid NOT NULL REFERENCES users (id) ON DELETE CASCADE,
    -- Normalised repository URL (inventory's URL policy form).
    repository     text NOT NULL,
    -- The ref as requested (NULL: the default branch).
    requested_ref  text,
    -- The commit the ref resolved to when the request was made (lower-case hex).
    commit         text NOT NULL,
    state          fairlane_work_state NOT NULL DEFAULT 'pending',
    -- The job that fills this row (NULL for a cache hit).
    job_id         bigint,
    -- For a cache hit: the analysis whose result was copied.
    -- (No foreign key: deleting the source must not turn copies into originals.)
    cached_from    uuid,
    result         jsonb,
    error          text,
    created_at     timestamptz NOT NULL DEFAULT now(),
    updated_at     timestamptz NOT NULL DEFAULT now(),
    completed_at   timestamptz
);
-- Cache lookups: at most one original completed analysis per repository and commit.
CREATE UNIQUE INDEX analyses_cache ON analyses (repository, commit)
    WHERE state = 'completed' AND cached_from IS NULL;
-- A user's own analyses (their cache hits, listing).
CREATE INDEX analyses_user ON analyses (user_id, repository, commit);
CREATE INDEX analyses_job ON analyses (job_id) WHERE job_id IS NOT NULL;

CREATE TABLE specviews (
    id            uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    user_id       uuid NOT NULL REFERENCES users (id) ON DELETE CASCADE,
    analysis_id   uuid NOT NULL REFERENCES analyses (id) ON DELETE CASCADE,
    state         fairlane_work_state NOT NULL DEFAULT 'pending',
    job_id        bigint,
    result        jsonb,
    markdown      text,
    error         text,
    created_at    timestamptz NOT NULL DEFAULT now(),
    updated_at    timestamptz NOT NULL DEFAULT now(),
    completed_at  timestamptz
);
CREATE INDEX specviews_user ON specviews (user_id, created_at);
CREATE INDEX specviews_job ON specviews (job_id) WHERE job_id IS NOT NULL;
