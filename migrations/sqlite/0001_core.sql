-- Core configuration: services, their discovery sources and targets, routes and admin tokens.
-- Times are unix epoch milliseconds.

CREATE TABLE services (
    id                          INTEGER PRIMARY KEY AUTOINCREMENT,
    name                        TEXT    NOT NULL UNIQUE,
    protocol                    TEXT    NOT NULL,
    upstream_authority          TEXT,
    tls_sni                     TEXT,
    tls_verify                  INTEGER NOT NULL,
    lb_policy                   TEXT    NOT NULL,
    connect_timeout_ms          INTEGER NOT NULL,
    response_header_timeout_ms  INTEGER NOT NULL,
    idle_timeout_ms             INTEGER NOT NULL,
    max_attempts                INTEGER NOT NULL,
    created_at                  INTEGER NOT NULL,
    updated_at                  INTEGER NOT NULL
);

CREATE TABLE discovery_sources (
    id                  INTEGER PRIMARY KEY AUTOINCREMENT,
    service_id          INTEGER NOT NULL REFERENCES services(id) ON DELETE CASCADE,
    name                TEXT    NOT NULL,
    provider            TEXT    NOT NULL,
    config              TEXT    NOT NULL,
    enabled             INTEGER NOT NULL,
    stale_after_ms      INTEGER NOT NULL,
    removal_grace_ms    INTEGER NOT NULL,
    -- What the refreshes did (the status endpoint), kept across restarts.
    state               TEXT    NOT NULL DEFAULT 'pending',
    last_error          TEXT,
    last_refresh_at     INTEGER,
    last_success_at     INTEGER,
    next_refresh_at     INTEGER,
    revision            TEXT,
    failing_since       INTEGER,
    created_at          INTEGER NOT NULL,
    updated_at          INTEGER NOT NULL,
    UNIQUE (service_id, name)
);

CREATE TABLE targets (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    service_id      INTEGER NOT NULL REFERENCES services(id) ON DELETE CASCADE,
    source_id       INTEGER REFERENCES discovery_sources(id) ON DELETE CASCADE,
    host            TEXT    NOT NULL,
    port            INTEGER NOT NULL,
    weight          INTEGER NOT NULL,
    priority        INTEGER NOT NULL,
    enabled         INTEGER NOT NULL,
    metadata        TEXT    NOT NULL,
    provider_key    TEXT,
    state           TEXT    NOT NULL,
    health          TEXT    NOT NULL,
    ejected_until   INTEGER,
    remove_at       INTEGER,
    created_at      INTEGER NOT NULL,
    updated_at      INTEGER NOT NULL
);
CREATE INDEX targets_by_service ON targets(service_id);
CREATE UNIQUE INDEX targets_by_source_key ON targets(source_id, provider_key) WHERE source_id IS NOT NULL;

CREATE TABLE routes (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    name            TEXT    NOT NULL UNIQUE,
    hosts           TEXT    NOT NULL,
    path_prefix     TEXT    NOT NULL,
    methods         TEXT    NOT NULL,
    service_id      INTEGER NOT NULL REFERENCES services(id) ON DELETE RESTRICT,
    preserve_host   INTEGER NOT NULL,
    strip_prefix    INTEGER NOT NULL,
    priority        INTEGER NOT NULL,
    created_at      INTEGER NOT NULL,
    updated_at      INTEGER NOT NULL
);
CREATE INDEX routes_by_service ON routes(service_id);

CREATE TABLE tokens (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    name        TEXT    NOT NULL UNIQUE,
    role        TEXT    NOT NULL,
    token_hash  TEXT    NOT NULL UNIQUE,
    created_at  INTEGER NOT NULL
);
