#!/usr/bin/env python3
"""Measures issue 34's locality goal on loopback: a gateway in zone `a`, a service with
`locality: {"min_available_percent": 70}` over three upstreams in zone a and three in zone b.

Phases (each sends REQUESTS requests over CONCURRENCY keep-alive connections and counts which
upstream answered):
  healthy    every target up: the share kept in zone a, and each zone-a target's load against
             the zone's mean (goal: >= 95 % in zone, none above 1.25 x the mean);
  degraded   one zone-a upstream down (health checks see it): 2 of 3 = 66 % < 70 %, so the
             requests spread over the five available targets of both zones;
  recovered  the upstream back: in zone again.

Usage: scripts/locality-figures.py [path/to/raahi]   (default target/debug/raahi; build it with
`cargo build --bin raahi`). Needs only python3. Prints a Markdown table.
Environment: REQUESTS (20000), CONCURRENCY (8).
"""

import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

REQUESTS = int(os.environ.get("REQUESTS", "20000"))
CONCURRENCY = int(os.environ.get("CONCURRENCY", "8"))
TOKEN = "locality-figures-token-0123456789"
ZONES = {"a1": "a", "a2": "a", "a3": "a", "b1": "b", "b2": "b", "b3": "b"}


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Upstream:
    """An HTTP/1.1 server answering its name, on a fixed port, that can stop and start again."""

    def __init__(self, name):
        self.name = name
        self.port = free_port()
        self.server = None

    def start(self):
        name = self.name.encode()

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self):
                self.send_response(200)
                self.send_header("content-length", str(len(name)))
                self.end_headers()
                self.wfile.write(name)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


def admin(port, method, path, body=None):
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    headers = {"authorization": f"Bearer {TOKEN}", "content-type": "application/json"}
    connection.request(method, path, json.dumps(body) if body is not None else None, headers)
    response = connection.getresponse()
    data = response.read()
    if response.status >= 300:
        raise SystemExit(f"{method} {path}: {response.status} {data!r}")
    return json.loads(data) if data else None


def wait_for(what, probe, timeout=15):
    end = time.time() + timeout
    while time.time() < end:
        value = probe()
        if value:
            return value
        time.sleep(0.05)
    raise SystemExit(f"timed out waiting for {what}")


def load(port):
    counts = Counter()
    lock = threading.Lock()
    share = REQUESTS // CONCURRENCY

    def worker():
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        mine = Counter()
        for _ in range(share):
            connection.request("GET", "/")
            response = connection.getresponse()
            body = response.read().decode()
            mine[body if response.status == 200 else f"HTTP {response.status}"] += 1
        with lock:
            counts.update(mine)

    threads = [threading.Thread(target=worker) for _ in range(CONCURRENCY)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return counts


def row(phase, counts, locality):
    total = sum(counts.values())
    in_zone = sum(n for name, n in counts.items() if ZONES.get(name) == "a")
    zone_loads = [counts.get(name, 0) for name in ("a1", "a2", "a3")]
    live = [n for n in zone_loads if n > 0]
    mean = sum(live) / len(live) if live else 0
    worst = max(live) / mean if mean else 0
    per_target = " ".join(f"{name}={counts.get(name, 0)}" for name in ZONES)
    return (
        f"| {phase} | {locality['in_force']} ({locality['available']}/{locality['total']}) "
        f"| {total} | {100 * in_zone / total:.2f} % | {worst:.3f} | {per_target} |"
    )


def main():
    binary = sys.argv[1] if len(sys.argv) > 1 else "target/debug/raahi"
    upstreams = {name: Upstream(name) for name in ZONES}
    for upstream in upstreams.values():
        upstream.start()
    proxy_port, admin_port = free_port(), free_port()
    workdir = tempfile.mkdtemp(prefix="raahi-locality-")
    env = dict(
        os.environ,
        RAAHI_PROXY_LISTEN=f"127.0.0.1:{proxy_port}",
        RAAHI_ADMIN_LISTEN=f"127.0.0.1:{admin_port}",
        RAAHI_ADMIN_TOKEN=TOKEN,
        RAAHI_DATABASE_URL=f"sqlite://{workdir}/raahi.db",
        RAAHI_CLUSTER_ZONE="a",
        RUST_LOG="warn",
    )
    gateway = subprocess.Popen([binary, "serve"], env=env, stderr=subprocess.DEVNULL)
    try:
        wait_for("the admin API", lambda: _answers(admin_port))
        service = admin(admin_port, "POST", "/api/v1/services", {
            "name": "zoned",
            "locality": {"min_available_percent": 70},
            "health_check": {"path": "/", "interval_ms": 200, "timeout_ms": 500,
                             "healthy_threshold": 1, "unhealthy_threshold": 1},
        })["id"]
        for name, upstream in upstreams.items():
            admin(admin_port, "POST", f"/api/v1/services/{service}/targets", {
                "host": "127.0.0.1", "port": upstream.port, "metadata": {"zone": ZONES[name]},
            })
        admin(admin_port, "POST", "/api/v1/routes", {"name": "all", "service_id": service})
        runtime = f"/api/v1/services/{service}/runtime"

        def split(in_force, available):
            view = admin(admin_port, "GET", runtime)["locality"]
            return view if view["in_force"] == in_force and view["available"] == available else None

        rows = []
        view = wait_for("zone only", lambda: split("zone_only", 3))
        rows.append(row("healthy", load(proxy_port), view))
        upstreams["a1"].stop()
        view = wait_for("every zone", lambda: split("all_zones", 2))
        rows.append(row("degraded (a1 down)", load(proxy_port), view))
        upstreams["a1"].start()
        view = wait_for("zone only again", lambda: split("zone_only", 3))
        rows.append(row("recovered", load(proxy_port), view))
    finally:
        gateway.terminate()
        gateway.wait(timeout=40)
    print(f"{REQUESTS} requests per phase over {CONCURRENCY} keep-alive connections, "
          "round_robin, gateway in zone a.\n")
    print("| phase | split (available/total in zone a) | requests | in zone a "
          "| busiest zone-a target / zone-a mean | per target |")
    print("|---|---|---|---|---|---|")
    for line in rows:
        print(line)


def _answers(port):
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


if __name__ == "__main__":
    main()
