-- Objects applied from a declarative resources file carry its mark, so operators can tell them
-- apart and the next apply knows what it may delete. NULL: created through the admin API.
ALTER TABLE services ADD COLUMN managed_by TEXT;
ALTER TABLE routes ADD COLUMN managed_by TEXT;
ALTER TABLE targets ADD COLUMN managed_by TEXT;
ALTER TABLE discovery_sources ADD COLUMN managed_by TEXT;
