-- The watch of a watch provider (connected, since, index) as JSON, kept with the rest of the
-- source's progress so every instance's status shows what the lease holder's watch is doing.
ALTER TABLE discovery_sources ADD COLUMN watch TEXT;
