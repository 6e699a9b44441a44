-- Per-route request rules and per-service upstream limits (issue 20). Routes: a body size limit (NULL: none), the size up to which a
-- request body is read whole before a target is picked (0: always stream), and the Upgrade
-- protocols passed to targets. Existing routes keep passing WebSocket.
ALTER TABLE routes ADD COLUMN max_request_body_bytes INTEGER;
ALTER TABLE routes ADD COLUMN request_buffer_bytes INTEGER NOT NULL DEFAULT 1048576;
ALTER TABLE routes ADD COLUMN upgrades TEXT NOT NULL DEFAULT '["websocket"]';
-- Services: requests in flight per target, waiting requests and their wait (JSON; NULL: the
-- defaults, no per-target limit).
ALTER TABLE services ADD COLUMN limits TEXT;
