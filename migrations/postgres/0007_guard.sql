-- The removal guard (DESIGN §4): its settings as JSON (NULL: off; sources that existed before
-- get the default guard), and the removals it holds back, kept with the source's progress.
ALTER TABLE discovery_sources ADD COLUMN removal_guard TEXT
    DEFAULT '{"max_percent":50,"min_endpoints":1,"confirm_ms":60000}';
ALTER TABLE discovery_sources ADD COLUMN guard TEXT;
