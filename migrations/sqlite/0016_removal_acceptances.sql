-- Accepted removals (DESIGN §4): the last `POST …/accept-removals` of each source, stored so that
-- it survives a lost notification, a listener reconnect or a takeover; the lease holder applies a
-- pending one and records when. `hold` is the removal guard's hold (JSON) the request covers:
-- the one stored when the request was written (NULL: none), so a hold that began later is not
-- released by it. Times are the database's clock in epoch milliseconds. Not routing
-- configuration: no change-log trigger. Mirrors migrations/postgres/0016_removal_acceptances.sql.
CREATE TABLE removal_acceptances (
    source_id     INTEGER PRIMARY KEY REFERENCES discovery_sources(id) ON DELETE CASCADE,
    requested_at  INTEGER NOT NULL,
    requested_via TEXT   NOT NULL,
    hold          TEXT,
    released_at   INTEGER,
    released_by   TEXT,
    released      INTEGER
);
