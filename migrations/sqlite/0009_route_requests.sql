-- Per-route request rules (issue 20): a body size limit (NULL: none), the size up to which a
-- request body is read whole before a target is picked (0: always stream), and the Upgrade
-- protocols passed to targets. Existing routes keep passing WebSocket.
ALTER TABLE routes ADD COLUMN max_request_body_bytes INTEGER;
ALTER TABLE routes ADD COLUMN request_buffer_bytes INTEGER NOT NULL DEFAULT 1048576;
ALTER TABLE routes ADD COLUMN upgrades TEXT NOT NULL DEFAULT '["websocket"]';
