-- TLS: a per-service CA bundle for upstream verification, and certificates the HTTPS listener
-- serves by SNI. L4: stream routes (a listen address, optionally an SNI, and a tcp/tls service).

ALTER TABLE services ADD COLUMN tls_ca_pem TEXT;

CREATE TABLE certificates (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    -- JSON array of server names (exact or *.suffix), each unique across certificates.
    snis        TEXT    NOT NULL,
    cert_pem    TEXT    NOT NULL,
    key_pem     TEXT    NOT NULL,
    not_after   INTEGER NOT NULL,
    created_at  INTEGER NOT NULL,
    updated_at  INTEGER NOT NULL
);

-- One row per (certificate, name), so a name claimed twice is a unique violation.
CREATE TABLE certificate_snis (
    sni             TEXT    PRIMARY KEY,
    certificate_id  INTEGER NOT NULL REFERENCES certificates(id) ON DELETE CASCADE
);

CREATE TABLE stream_routes (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    listen      TEXT    NOT NULL,
    -- '' when the route has no SNI, so (listen, sni) can be unique.
    sni         TEXT    NOT NULL DEFAULT '',
    service_id  INTEGER NOT NULL REFERENCES services(id),
    created_at  INTEGER NOT NULL,
    updated_at  INTEGER NOT NULL,
    UNIQUE (listen, sni)
);
