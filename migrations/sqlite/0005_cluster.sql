-- Source leases: which gateway instance refreshes a discovery source (see src/store/leases.rs).
-- On SQLite one instance holds every lease; the table keeps both backends alike and lets the
-- status name the refreshing instance.
CREATE TABLE source_leases (
    source_id   INTEGER PRIMARY KEY REFERENCES discovery_sources(id) ON DELETE CASCADE,
    holder      TEXT    NOT NULL,
    expires_at  INTEGER NOT NULL
);
