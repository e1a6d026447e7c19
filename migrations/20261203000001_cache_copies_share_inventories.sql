-- A cache hit's copy (`cached_from` set, no job of its own) stored the whole inventory of its
-- original again: megabytes per user of a popular commit, written inside the enqueue batch
-- while it holds its users' locks. A copy made from now on stores none (`result` NULL) and is
-- read with its original's (`web::routes::ANALYSES_READ`, `records::specviews`); the inventory
-- of a public commit is the same for everyone. Copies made before keep theirs, and so does a
-- copy its own job filled (it ran and stored one).
--
-- Before an original is deleted (with its user), its inventory is written into the copies that
-- share it, so they keep reading what they read before. The enqueue batch locks the original it
-- copies `FOR KEY SHARE`, as a foreign key would: a deletion that meets a copy not yet committed
-- waits for it, and a copy made while a deletion is under way waits for that and then finds no
-- original (the request is then analysed anew). A single `DELETE` that removes both an
-- original and a copy sharing it is refused by PostgreSQL (the copy was changed by a trigger of
-- the same command): a user never holds such a copy of their own original (the cache look-up
-- answers with the original itself), so the cascade from `users` never meets it.
--
-- The copies of an original, for that write. The records the API and the workers write have no
-- `cached_from` and are not in it. The predicate names `cached_from` alone: naming `result` too
-- would make the worker's staging of a result (an update of `result` only) a non-HOT update,
-- writing an entry in every index of the table.
CREATE INDEX analyses_copies ON analyses (cached_from) WHERE cached_from IS NOT NULL;

CREATE FUNCTION fairlane_analysis_copies_keep_inventory() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    UPDATE analyses SET result = OLD.result
    WHERE cached_from = OLD.id AND result IS NULL;
    RETURN OLD;
END
$$;

CREATE TRIGGER analyses_copies_keep_inventory
    BEFORE DELETE ON analyses
    FOR EACH ROW
    WHEN (OLD.cached_from IS NULL AND OLD.result IS NOT NULL)
    EXECUTE FUNCTION fairlane_analysis_copies_keep_inventory();
