-- Affinity (issue 35): the hashing key, bounded load and cookie sessions of a service.
ALTER TABLE services ADD COLUMN hash_on TEXT;
ALTER TABLE services ADD COLUMN hash_balance_factor INTEGER;
ALTER TABLE services ADD COLUMN session_persistence TEXT;
