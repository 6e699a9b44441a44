-- Route rules (issue 33): conditions, weighted backends and filters live in `rules` (JSON). A
-- redirect route has no service and a route with `path_exact` or `path_regex` no prefix. Every
-- service a route sends to (its backends, its mirror) is listed in route_services, so a
-- service in use cannot be deleted.
ALTER TABLE routes ALTER COLUMN service_id DROP NOT NULL;
ALTER TABLE routes ALTER COLUMN path_prefix DROP NOT NULL;
ALTER TABLE routes ADD COLUMN rules TEXT NOT NULL DEFAULT '{}';

CREATE TABLE route_services (
    route_id    BIGINT NOT NULL REFERENCES routes(id) ON DELETE CASCADE,
    service_id  BIGINT NOT NULL REFERENCES services(id) ON DELETE RESTRICT,
    PRIMARY KEY (route_id, service_id)
);
CREATE INDEX route_services_by_service ON route_services(service_id);
INSERT INTO route_services (route_id, service_id) SELECT id, service_id FROM routes;
