-- Core configuration: services, their targets, routes and admin tokens.
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

CREATE TABLE targets (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    service_id      INTEGER NOT NULL REFERENCES services(id) ON DELETE CASCADE,
    source_id       INTEGER,
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
    created_at      INTEGER NOT NULL,
    updated_at      INTEGER NOT NULL
);
CREATE INDEX targets_by_service ON targets(service_id);

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
