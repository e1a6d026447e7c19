-- `GET /v1/analyses` and `GET /v1/specviews` list a user's records newest first, a page at a
-- time, by keyset on (created_at, id) (`web::routes::listing`): id breaks ties, since the
-- requests one batch commits share their transaction's `now()`. With these indexes a page is
-- one range scan from the cursor, however many records the user has.
--
-- Built in the migration's transaction, not CONCURRENTLY (as fairlane_job_finalized_state, for
-- the same reasons): writes of records wait while they build, which reads only the tables'
-- heaps (results and Markdown live out of line).
CREATE INDEX analyses_user_recency ON analyses (user_id, created_at, id);
CREATE INDEX specviews_user_recency ON specviews (user_id, created_at, id);
-- Replaced: the index above serves everything it did.
DROP INDEX specviews_user;
-- An analysis's specviews: the list's `analysis_id` filter, a request for a specview of an
-- analysis that has one in flight (answered with it), and the cascade when an analysis is
-- deleted, which had to read every specview to find its own.
CREATE INDEX specviews_analysis ON specviews (analysis_id, created_at, id);
