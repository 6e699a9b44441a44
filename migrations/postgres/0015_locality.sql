-- Locality (issue 34, TRAFFIC.md §4): a service's `locality` as JSON
-- (`{"min_available_percent": 70}`); null: every zone alike. Numbered 0015: 0014 belongs to the
-- canary half of the issue.
ALTER TABLE services ADD COLUMN locality TEXT;
