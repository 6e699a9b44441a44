-- Canaries (TRAFFIC.md §4; src/store/canary.rs). Mirrors migrations/postgres/0014_canary.sql.
--
-- route_canaries: where each route's canary stands. Configuration every gateway applies, so its
-- writes go to the change log as route changes; written with the route (a new or changed
-- `canary` starts at its first step), by the gateway holding the route's canary lease, and by
-- operators' actions. `spec` is the canary and backends it was started for: a route write that
-- changes them starts the canary again. Times are epoch milliseconds of the database's clock.
CREATE TABLE route_canaries (
    route_id            INTEGER PRIMARY KEY REFERENCES routes(id) ON DELETE CASCADE,
    spec                TEXT    NOT NULL,
    state               TEXT    NOT NULL,
    step                INTEGER NOT NULL,
    weight              INTEGER NOT NULL,
    round               INTEGER NOT NULL,
    interval_started_ms INTEGER NOT NULL,
    reason              TEXT    NOT NULL
);
CREATE TRIGGER route_canaries_logged_insert AFTER INSERT ON route_canaries BEGIN
    INSERT INTO config_changes (at_ms, scope)
    VALUES (CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER), 'routes');
END;
CREATE TRIGGER route_canaries_logged_update AFTER UPDATE ON route_canaries BEGIN
    INSERT INTO config_changes (at_ms, scope)
    VALUES (CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER), 'routes');
END;
CREATE TRIGGER route_canaries_logged_delete AFTER DELETE ON route_canaries BEGIN
    INSERT INTO config_changes (at_ms, scope)
    VALUES (CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER), 'routes');
END;

-- Every decision and action, newest last, with the counts it was taken on (JSON): the history
-- the canary view and the dashboard show. Runtime state: no change-log triggers.
CREATE TABLE canary_decisions (
    route_id    INTEGER NOT NULL REFERENCES routes(id) ON DELETE CASCADE,
    round       INTEGER NOT NULL,
    at_ms       INTEGER NOT NULL,
    state       TEXT    NOT NULL,
    step        INTEGER NOT NULL,
    weight      INTEGER NOT NULL,
    reason      TEXT    NOT NULL,
    counts      TEXT    NOT NULL,
    PRIMARY KEY (route_id, round)
);

-- Each gateway's counts of each backend of a canary route in each round (the interval the
-- request was served in, as the gateway's snapshot said), added to about once a second; the
-- lease holder sums the rows of the round it judges. `latency`: a JSON array of counts per
-- latency bucket (src/model/canary.rs). Runtime state: no triggers, no foreign key (a route
-- deleted meanwhile must not fail a flush); rows untouched for two days are deleted.
CREATE TABLE canary_counts (
    route_id    INTEGER NOT NULL,
    round       INTEGER NOT NULL,
    instance_id TEXT    NOT NULL,
    backend     INTEGER NOT NULL,
    requests    INTEGER NOT NULL,
    errors      INTEGER NOT NULL,
    latency     TEXT    NOT NULL,
    updated_at  INTEGER NOT NULL,
    PRIMARY KEY (route_id, round, instance_id, backend)
);
CREATE INDEX canary_counts_by_age ON canary_counts (updated_at);

-- Which gateway judges a route's canary: as source_leases, by the database's clock.
CREATE TABLE canary_leases (
    route_id    INTEGER PRIMARY KEY,
    holder      TEXT    NOT NULL,
    expires_at  INTEGER NOT NULL
);
