-- HTTP/2 upstreams (issue 32): the PING interval on connections with open streams (NULL: off).
ALTER TABLE services ADD COLUMN keepalive_ms INTEGER;
