-- Cluster-scope rate limits (TRAFFIC.md §6; src/store/rate_limits.rs): each gateway writes its
-- recent demand of the keys near their limit every `cluster.rate_sync_ms` and reads the others'.
-- Mirrors migrations/postgres/0013_rate_limits.sql; on SQLite one gateway uses the file, so it
-- finds itself alone and keeps the whole rate, by the same code.
--
-- Runtime state, not configuration: no change-log triggers, and no foreign key to routes (a
-- route deleted between a gateway's snapshot and its write must not fail the whole exchange);
-- rows of deleted routes and departed gateways are deleted once a minute old. Times are epoch
-- milliseconds of the database's clock.

-- `key_hash`: the limiter's 64-bit hash of the key, as a signed integer (never the key itself,
-- which may be an API key).
CREATE TABLE rate_limit_demand (
    route_id            INTEGER NOT NULL,
    key_hash            INTEGER NOT NULL,
    instance_id         TEXT    NOT NULL,
    demand_per_second   REAL    NOT NULL,
    updated_at          INTEGER NOT NULL,
    PRIMARY KEY (route_id, key_hash, instance_id)
);
CREATE INDEX rate_limit_demand_by_instance ON rate_limit_demand (instance_id, updated_at);
CREATE INDEX rate_limit_demand_by_age ON rate_limit_demand (updated_at);

-- The gateways taking part: N, the number seen within the freshness window, divides the rate.
CREATE TABLE rate_limit_members (
    instance_id TEXT    PRIMARY KEY,
    seen_at     INTEGER NOT NULL
);
