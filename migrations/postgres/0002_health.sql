-- Active health checks and passive ejection settings per service (JSON; NULL health_check: off,
-- NULL ejection: the defaults), and each target's latest check.
ALTER TABLE services ADD COLUMN health_check TEXT;
ALTER TABLE services ADD COLUMN ejection TEXT;
ALTER TABLE targets ADD COLUMN last_check TEXT;
