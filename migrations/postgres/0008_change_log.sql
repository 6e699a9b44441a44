-- The change log behind incremental reloads (DESIGN §2, §8): every write that changes what a
-- routing snapshot is built from appends one row naming what it touched, so an instance asks
-- "what changed since position N" and reloads only that. Mirrors
-- migrations/sqlite/0008_change_log.sql.
--
-- Concurrent writers take revisions from a sequence in one order and commit in another, so a
-- reader's position is not a revision but a transaction id: the xmin of the snapshot it read
-- with. Every transaction below it had ended, so its rows were seen; a reader asks for the rows
-- of transactions from that xmin on (some seen twice, which is harmless) and misses none.
--
-- scope: 'service' (the service row, its targets, its discovery sources' settings and state;
-- service_id set), 'routes', 'stream_routes', 'certificates', or 'all' (a TRUNCATE).
CREATE TABLE config_changes (
    revision    BIGSERIAL PRIMARY KEY,
    xid         xid8    NOT NULL DEFAULT pg_current_xact_id(),
    at_ms       BIGINT  NOT NULL DEFAULT (extract(epoch FROM clock_timestamp()) * 1000)::BIGINT,
    scope       TEXT    NOT NULL,
    service_id  BIGINT
);
CREATE INDEX config_changes_by_xid ON config_changes (xid);
CREATE INDEX config_changes_by_age ON config_changes (at_ms);

-- The highest position (transaction id) trimmed away: a reader whose position is not above it
-- may have missed a change and reloads everything.
CREATE TABLE config_change_floor (
    id          INTEGER PRIMARY KEY CHECK (id = 1),
    position    BIGINT  NOT NULL
);
INSERT INTO config_change_floor (id, position) VALUES (1, 0);

-- Logs one change and tells the other instances what it was. Notifications are sent at commit,
-- and repeats within one transaction are folded into one, so a transaction that writes twenty
-- targets of one service sends one notification for that service. The payload is JSON:
-- {"instance": the writer's application_name (its instance id), "scope", "service_id"}.
CREATE FUNCTION raahi_log_change(change_scope TEXT, changed_service BIGINT) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO config_changes (scope, service_id) VALUES (change_scope, changed_service);
    PERFORM pg_notify('raahi_config', json_build_object(
        'instance', current_setting('application_name'),
        'scope', change_scope,
        'service_id', changed_service)::text);
END;
$$;

CREATE FUNCTION raahi_service_row_changed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        PERFORM raahi_log_change('service', OLD.id);
    ELSE
        PERFORM raahi_log_change('service', NEW.id);
    END IF;
    RETURN NULL;
END;
$$;

-- Targets and discovery sources: the service they belong to (both, if one moved).
CREATE FUNCTION raahi_service_part_changed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP <> 'INSERT' THEN
        PERFORM raahi_log_change('service', OLD.service_id);
    END IF;
    IF TG_OP = 'INSERT' OR (TG_OP = 'UPDATE' AND NEW.service_id IS DISTINCT FROM OLD.service_id) THEN
        PERFORM raahi_log_change('service', NEW.service_id);
    END IF;
    RETURN NULL;
END;
$$;

-- Routes, stream routes and certificates are rebuilt as a whole: one change per statement.
CREATE FUNCTION raahi_scope_changed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM raahi_log_change(TG_ARGV[0], NULL);
    RETURN NULL;
END;
$$;

-- The statement-level notifications of 0005 and 0007 are replaced by the log's.
DROP TRIGGER services_changed ON services;
DROP TRIGGER routes_changed ON routes;
DROP TRIGGER stream_routes_changed ON stream_routes;
DROP TRIGGER certificates_changed ON certificates;
DROP TRIGGER targets_changed_rows ON targets;
DROP TRIGGER targets_changed_fields ON targets;
DROP TRIGGER discovery_sources_changed_rows ON discovery_sources;
DROP TRIGGER discovery_sources_changed_fields ON discovery_sources;
DROP TRIGGER discovery_sources_changed_state ON discovery_sources;
DROP FUNCTION raahi_notify_config();

CREATE TRIGGER services_logged AFTER INSERT OR UPDATE OR DELETE ON services
    FOR EACH ROW EXECUTE FUNCTION raahi_service_row_changed();
CREATE TRIGGER services_truncated AFTER TRUNCATE ON services
    FOR EACH STATEMENT EXECUTE FUNCTION raahi_scope_changed('all');

-- Targets: not on health checks (health, last_check), which every instance writes from its own
-- probes and which stay local to each instance.
CREATE TRIGGER targets_logged_rows AFTER INSERT OR DELETE ON targets
    FOR EACH ROW EXECUTE FUNCTION raahi_service_part_changed();
CREATE TRIGGER targets_logged_fields
    AFTER UPDATE OF service_id, source_id, host, port, weight, priority, enabled, metadata,
        provider_key, state, ejected_until, remove_at, managed_by ON targets
    FOR EACH ROW EXECUTE FUNCTION raahi_service_part_changed();
CREATE TRIGGER targets_truncated AFTER TRUNCATE ON targets
    FOR EACH STATEMENT EXECUTE FUNCTION raahi_scope_changed('all');

-- Discovery sources: their settings and lifecycle state (which 503 the service answers), not
-- the progress of every refresh.
CREATE TRIGGER discovery_sources_logged_rows AFTER INSERT OR DELETE ON discovery_sources
    FOR EACH ROW EXECUTE FUNCTION raahi_service_part_changed();
CREATE TRIGGER discovery_sources_logged_fields
    AFTER UPDATE OF service_id, name, provider, config, enabled, stale_after_ms, removal_grace_ms,
        removal_guard, managed_by ON discovery_sources
    FOR EACH ROW EXECUTE FUNCTION raahi_service_part_changed();
CREATE TRIGGER discovery_sources_logged_state
    AFTER UPDATE OF state ON discovery_sources
    FOR EACH ROW WHEN (OLD.state IS DISTINCT FROM NEW.state)
    EXECUTE FUNCTION raahi_service_part_changed();
CREATE TRIGGER discovery_sources_truncated AFTER TRUNCATE ON discovery_sources
    FOR EACH STATEMENT EXECUTE FUNCTION raahi_scope_changed('all');

CREATE TRIGGER routes_logged AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON routes
    FOR EACH STATEMENT EXECUTE FUNCTION raahi_scope_changed('routes');
CREATE TRIGGER stream_routes_logged AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON stream_routes
    FOR EACH STATEMENT EXECUTE FUNCTION raahi_scope_changed('stream_routes');
CREATE TRIGGER certificates_logged AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON certificates
    FOR EACH STATEMENT EXECUTE FUNCTION raahi_scope_changed('certificates');
