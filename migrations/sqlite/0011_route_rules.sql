-- Route rules (issue 33): conditions, weighted backends and filters live in `rules` (JSON). A
-- redirect route has no service and a route with `path_exact` or `path_regex` no prefix, so
-- both columns become nullable, which SQLite can only do by rebuilding the table. Every
-- service a route sends to (its backends, its mirror) is listed in route_services, so a
-- service in use cannot be deleted.
CREATE TABLE routes_rebuilt (
    id                      INTEGER PRIMARY KEY AUTOINCREMENT,
    name                    TEXT    NOT NULL UNIQUE,
    hosts                   TEXT    NOT NULL,
    path_prefix             TEXT,
    methods                 TEXT    NOT NULL,
    service_id              INTEGER REFERENCES services(id) ON DELETE RESTRICT,
    preserve_host           INTEGER NOT NULL,
    strip_prefix            INTEGER NOT NULL,
    priority                INTEGER NOT NULL,
    created_at              INTEGER NOT NULL,
    updated_at              INTEGER NOT NULL,
    managed_by              TEXT,
    max_request_body_bytes  INTEGER,
    request_buffer_bytes    INTEGER NOT NULL DEFAULT 1048576,
    upgrades                TEXT    NOT NULL DEFAULT '["websocket"]',
    rules                   TEXT    NOT NULL DEFAULT '{}'
);
INSERT INTO routes_rebuilt (id, name, hosts, path_prefix, methods, service_id, preserve_host,
        strip_prefix, priority, created_at, updated_at, managed_by, max_request_body_bytes,
        request_buffer_bytes, upgrades)
    SELECT id, name, hosts, path_prefix, methods, service_id, preserve_host, strip_prefix,
        priority, created_at, updated_at, managed_by, max_request_body_bytes,
        request_buffer_bytes, upgrades
    FROM routes;
-- Route ids are never reused: the new table continues the old one's sequence.
INSERT INTO sqlite_sequence (name, seq)
    SELECT 'routes_rebuilt', seq FROM sqlite_sequence WHERE name = 'routes'
        AND NOT EXISTS (SELECT 1 FROM sqlite_sequence WHERE name = 'routes_rebuilt');
UPDATE sqlite_sequence
    SET seq = MAX(seq, COALESCE((SELECT seq FROM sqlite_sequence WHERE name = 'routes'), 0))
    WHERE name = 'routes_rebuilt';
DROP TABLE routes;
ALTER TABLE routes_rebuilt RENAME TO routes;
CREATE INDEX routes_by_service ON routes(service_id);

CREATE TRIGGER routes_logged_insert AFTER INSERT ON routes BEGIN
    INSERT INTO config_changes (at_ms, scope)
    VALUES (CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER), 'routes');
END;
CREATE TRIGGER routes_logged_update AFTER UPDATE ON routes BEGIN
    INSERT INTO config_changes (at_ms, scope)
    VALUES (CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER), 'routes');
END;
CREATE TRIGGER routes_logged_delete AFTER DELETE ON routes BEGIN
    INSERT INTO config_changes (at_ms, scope)
    VALUES (CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER), 'routes');
END;

CREATE TABLE route_services (
    route_id    INTEGER NOT NULL REFERENCES routes(id) ON DELETE CASCADE,
    service_id  INTEGER NOT NULL REFERENCES services(id) ON DELETE RESTRICT,
    PRIMARY KEY (route_id, service_id)
);
CREATE INDEX route_services_by_service ON route_services(service_id);
INSERT INTO route_services (route_id, service_id) SELECT id, service_id FROM routes;
