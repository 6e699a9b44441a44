-- The removal guard (DESIGN §4): its settings as JSON (NULL: off; sources that existed before
-- get the default guard), and the removals it holds back, kept with the source's progress.
ALTER TABLE discovery_sources ADD COLUMN removal_guard TEXT
    DEFAULT '{"max_percent":50,"min_endpoints":1,"confirm_ms":60000}';
ALTER TABLE discovery_sources ADD COLUMN guard TEXT;

-- Other instances follow a changed guard setting like any other source setting.
DROP TRIGGER discovery_sources_changed_fields ON discovery_sources;
CREATE TRIGGER discovery_sources_changed_fields
    AFTER UPDATE OF service_id, name, provider, config, enabled, stale_after_ms, removal_grace_ms,
        removal_guard, managed_by ON discovery_sources
    FOR EACH STATEMENT EXECUTE FUNCTION raahi_notify_config();
-- A source's lifecycle decides which 503 its service answers (discovery_unavailable or
-- no_available_target), so a change of state reloads the other instances; the progress of each
-- refresh does not.
CREATE TRIGGER discovery_sources_changed_state
    AFTER UPDATE OF state ON discovery_sources
    FOR EACH ROW WHEN (OLD.state IS DISTINCT FROM NEW.state)
    EXECUTE FUNCTION raahi_notify_config();
