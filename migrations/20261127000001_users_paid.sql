-- The paid users and their tiers, for the fairness gate's look-ups (ADR 0015). Free is the
-- default tier and the limit of a user who is not found, so a gate that asks only this index
-- for a user's tier reads nothing for a free user, and reads an index the size of the paid
-- users, however many free users sign up. With its tier included, a look-up needs no heap visit
-- once the rows are all-visible.
CREATE INDEX users_paid ON users (id) INCLUDE (tier) WHERE tier <> 'free';
