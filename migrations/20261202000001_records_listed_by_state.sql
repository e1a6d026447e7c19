-- A list filtered by state (`GET /v1/analyses?state=failed`) read the caller's records newest
-- first through (user_id, created_at, id) until a page of that state was full: the whole history
-- of a user with many records and few of that state, on every page. With the state after the
-- user, such a page is one range scan. An unfiltered page reads each state's range from its
-- cursor, a page at most from each of the four, and keeps the newest
-- (`web::routes::listing::page_statement`).
--
-- The old index serves nothing the new one does not. For analyses, replacing it costs the writes
-- nothing: a state change already wrote a new entry in every index (state is in the predicates of
-- partial indexes, so no update of it is HOT). A specview's state changes (to running, and back
-- to pending when its job is retried) now write its index entries too.
--
-- Built in the migration's transaction, as the index it replaces was (and for the same reasons).
CREATE INDEX analyses_user_state_recency ON analyses (user_id, state, created_at, id);
DROP INDEX analyses_user_recency;
CREATE INDEX specviews_user_state_recency ON specviews (user_id, state, created_at, id);
DROP INDEX specviews_user_recency;
