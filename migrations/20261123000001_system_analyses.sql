-- Re-analyses enqueued by the scheduler belong to no user (system jobs), and their commit is
-- only known once the worker resolves the repository's default branch. A user's analysis always
-- has both: the API resolves the ref before enqueueing, and the worker analyses exactly that
-- commit even if the branch has moved since.
ALTER TABLE analyses ALTER COLUMN user_id DROP NOT NULL;
ALTER TABLE analyses ALTER COLUMN commit DROP NOT NULL;
ALTER TABLE analyses ADD CONSTRAINT analyses_user_requests_are_resolved
    CHECK (user_id IS NULL OR commit IS NOT NULL);
-- The scheduler looks for repositories whose latest analysis is old.
CREATE INDEX analyses_repository_recency ON analyses (repository, completed_at DESC)
    WHERE state = 'completed';
