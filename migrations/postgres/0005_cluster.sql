-- Several gateway instances on one database.
--
-- Source leases: which instance refreshes a discovery source (see src/store/leases.rs); mirrors
-- migrations/sqlite/0005_cluster.sql.
CREATE TABLE source_leases (
    source_id   BIGINT  PRIMARY KEY REFERENCES discovery_sources(id) ON DELETE CASCADE,
    holder      TEXT    NOT NULL,
    expires_at  BIGINT  NOT NULL
);

-- Change notification (PostgreSQL only; SQLite serves one instance): every statement that changes
-- what instances route with raises NOTIFY raahi_config, with the writer's application_name (its
-- instance id) as the payload so the writer can skip its own changes. Notifications are sent at
-- commit, and repeats within one transaction are folded into one.
CREATE FUNCTION raahi_notify_config() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('raahi_config', current_setting('application_name'));
    RETURN NULL;
END;
$$;

CREATE TRIGGER services_changed AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON services
    FOR EACH STATEMENT EXECUTE FUNCTION raahi_notify_config();
CREATE TRIGGER routes_changed AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON routes
    FOR EACH STATEMENT EXECUTE FUNCTION raahi_notify_config();
CREATE TRIGGER stream_routes_changed AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON stream_routes
    FOR EACH STATEMENT EXECUTE FUNCTION raahi_notify_config();
CREATE TRIGGER certificates_changed AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON certificates
    FOR EACH STATEMENT EXECUTE FUNCTION raahi_notify_config();
-- Targets: not on health checks (health, last_check), which every instance writes from its own
-- probes and which stay local to each instance.
CREATE TRIGGER targets_changed_rows AFTER INSERT OR DELETE OR TRUNCATE ON targets
    FOR EACH STATEMENT EXECUTE FUNCTION raahi_notify_config();
CREATE TRIGGER targets_changed_fields
    AFTER UPDATE OF service_id, source_id, host, port, weight, priority, enabled, metadata,
        provider_key, state, ejected_until, remove_at, managed_by ON targets
    FOR EACH STATEMENT EXECUTE FUNCTION raahi_notify_config();
-- Discovery sources: their settings, not the progress of every refresh (status reads it from the
-- store on demand).
CREATE TRIGGER discovery_sources_changed_rows AFTER INSERT OR DELETE OR TRUNCATE ON discovery_sources
    FOR EACH STATEMENT EXECUTE FUNCTION raahi_notify_config();
CREATE TRIGGER discovery_sources_changed_fields
    AFTER UPDATE OF service_id, name, provider, config, enabled, stale_after_ms, removal_grace_ms,
        managed_by ON discovery_sources
    FOR EACH STATEMENT EXECUTE FUNCTION raahi_notify_config();
