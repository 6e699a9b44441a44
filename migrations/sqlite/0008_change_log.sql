-- The change log behind incremental reloads (DESIGN §2, §8): every write that changes what a
-- routing snapshot is built from appends one row naming what it touched, so a reader asks "what
-- changed since position N" and reloads only that. Triggers write it, so no store call can
-- forget to. Mirrors migrations/postgres/0008_change_log.sql; SQLite has one writer, so the
-- revision order is the commit order and a reader's position is the next revision it needs.
--
-- scope: 'service' (the service row, its targets, its discovery sources' settings and state;
-- service_id set), 'routes', 'stream_routes', 'certificates' (service_id NULL).
CREATE TABLE config_changes (
    revision    INTEGER PRIMARY KEY AUTOINCREMENT,
    at_ms       INTEGER NOT NULL,
    scope       TEXT    NOT NULL,
    service_id  INTEGER
);

-- The highest position trimmed away: a reader whose position is not above it may have missed a
-- change and reloads everything.
CREATE TABLE config_change_floor (
    id          INTEGER PRIMARY KEY CHECK (id = 1),
    position    INTEGER NOT NULL
);
INSERT INTO config_change_floor (id, position) VALUES (1, 0);

CREATE TRIGGER services_logged_insert AFTER INSERT ON services BEGIN
    INSERT INTO config_changes (at_ms, scope, service_id)
    VALUES (CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER), 'service', NEW.id);
END;
CREATE TRIGGER services_logged_update AFTER UPDATE ON services BEGIN
    INSERT INTO config_changes (at_ms, scope, service_id)
    VALUES (CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER), 'service', NEW.id);
END;
CREATE TRIGGER services_logged_delete AFTER DELETE ON services BEGIN
    INSERT INTO config_changes (at_ms, scope, service_id)
    VALUES (CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER), 'service', OLD.id);
END;

-- Targets: not on health checks (health, last_check), which stay local to each instance and
-- reach the data path through per-target atomics.
CREATE TRIGGER targets_logged_insert AFTER INSERT ON targets BEGIN
    INSERT INTO config_changes (at_ms, scope, service_id)
    VALUES (CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER), 'service', NEW.service_id);
END;
CREATE TRIGGER targets_logged_update
    AFTER UPDATE OF service_id, source_id, host, port, weight, priority, enabled, metadata,
        provider_key, state, ejected_until, remove_at, managed_by ON targets
BEGIN
    INSERT INTO config_changes (at_ms, scope, service_id)
    VALUES (CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER), 'service', NEW.service_id);
    INSERT INTO config_changes (at_ms, scope, service_id)
    SELECT CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER), 'service', OLD.service_id
    WHERE OLD.service_id <> NEW.service_id;
END;
CREATE TRIGGER targets_logged_delete AFTER DELETE ON targets BEGIN
    INSERT INTO config_changes (at_ms, scope, service_id)
    VALUES (CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER), 'service', OLD.service_id);
END;

-- Discovery sources: their settings and lifecycle state (which 503 the service answers), not
-- the progress of every refresh.
CREATE TRIGGER discovery_sources_logged_insert AFTER INSERT ON discovery_sources BEGIN
    INSERT INTO config_changes (at_ms, scope, service_id)
    VALUES (CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER), 'service', NEW.service_id);
END;
CREATE TRIGGER discovery_sources_logged_update
    AFTER UPDATE OF service_id, name, provider, config, enabled, stale_after_ms, removal_grace_ms,
        removal_guard, managed_by ON discovery_sources
BEGIN
    INSERT INTO config_changes (at_ms, scope, service_id)
    VALUES (CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER), 'service', NEW.service_id);
    INSERT INTO config_changes (at_ms, scope, service_id)
    SELECT CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER), 'service', OLD.service_id
    WHERE OLD.service_id <> NEW.service_id;
END;
CREATE TRIGGER discovery_sources_logged_state
    AFTER UPDATE OF state ON discovery_sources WHEN OLD.state IS NOT NEW.state
BEGIN
    INSERT INTO config_changes (at_ms, scope, service_id)
    VALUES (CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER), 'service', NEW.service_id);
END;
CREATE TRIGGER discovery_sources_logged_delete AFTER DELETE ON discovery_sources BEGIN
    INSERT INTO config_changes (at_ms, scope, service_id)
    VALUES (CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER), 'service', OLD.service_id);
END;

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

CREATE TRIGGER stream_routes_logged_insert AFTER INSERT ON stream_routes BEGIN
    INSERT INTO config_changes (at_ms, scope)
    VALUES (CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER), 'stream_routes');
END;
CREATE TRIGGER stream_routes_logged_update AFTER UPDATE ON stream_routes BEGIN
    INSERT INTO config_changes (at_ms, scope)
    VALUES (CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER), 'stream_routes');
END;
CREATE TRIGGER stream_routes_logged_delete AFTER DELETE ON stream_routes BEGIN
    INSERT INTO config_changes (at_ms, scope)
    VALUES (CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER), 'stream_routes');
END;

CREATE TRIGGER certificates_logged_insert AFTER INSERT ON certificates BEGIN
    INSERT INTO config_changes (at_ms, scope)
    VALUES (CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER), 'certificates');
END;
CREATE TRIGGER certificates_logged_update AFTER UPDATE ON certificates BEGIN
    INSERT INTO config_changes (at_ms, scope)
    VALUES (CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER), 'certificates');
END;
CREATE TRIGGER certificates_logged_delete AFTER DELETE ON certificates BEGIN
    INSERT INTO config_changes (at_ms, scope)
    VALUES (CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER), 'certificates');
END;
