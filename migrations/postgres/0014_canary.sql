-- Canaries (TRAFFIC.md §4; src/store/canary.rs). Mirrors migrations/sqlite/0014_canary.sql,
-- which says what each table is for. Every integer is BIGINT, as in the other tables: the store
-- reads them all as i64, which an INTEGER (INT4) column refuses to decode into.
CREATE TABLE route_canaries (
    route_id            BIGINT  PRIMARY KEY REFERENCES routes(id) ON DELETE CASCADE,
    spec                TEXT    NOT NULL,
    state               TEXT    NOT NULL,
    step                BIGINT  NOT NULL,
    weight              BIGINT  NOT NULL,
    round               BIGINT  NOT NULL,
    interval_started_ms BIGINT  NOT NULL,
    reason              TEXT    NOT NULL
);
CREATE TRIGGER route_canaries_logged AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON route_canaries
    FOR EACH STATEMENT EXECUTE FUNCTION raahi_scope_changed('routes');

CREATE TABLE canary_decisions (
    route_id    BIGINT  NOT NULL REFERENCES routes(id) ON DELETE CASCADE,
    round       BIGINT  NOT NULL,
    at_ms       BIGINT  NOT NULL,
    state       TEXT    NOT NULL,
    step        BIGINT  NOT NULL,
    weight      BIGINT  NOT NULL,
    reason      TEXT    NOT NULL,
    counts      TEXT    NOT NULL,
    PRIMARY KEY (route_id, round)
);

CREATE TABLE canary_counts (
    route_id    BIGINT  NOT NULL,
    round       BIGINT  NOT NULL,
    instance_id TEXT    NOT NULL,
    backend     BIGINT  NOT NULL,
    requests    BIGINT  NOT NULL,
    errors      BIGINT  NOT NULL,
    latency     TEXT    NOT NULL,
    updated_at  BIGINT  NOT NULL,
    PRIMARY KEY (route_id, round, instance_id, backend)
);
CREATE INDEX canary_counts_by_age ON canary_counts (updated_at);

CREATE TABLE canary_leases (
    route_id    BIGINT  PRIMARY KEY,
    holder      TEXT    NOT NULL,
    expires_at  BIGINT  NOT NULL
);
