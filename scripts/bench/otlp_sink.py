#!/usr/bin/env python3
"""A stand-in OTLP/HTTP collector for benchmarks: accepts POST /v1/traces, reads the body and
answers 200, counting exports and bytes (printed on SIGINT/SIGTERM). Decodes nothing: what it
costs is not what the benchmark measures (the proxy's CPU).

Usage: taskset -c 0 scripts/bench/otlp_sink.py [PORT]   (default 4318, 127.0.0.1 only)
Then run the proxy with RAAHI_TRACING_OTLP_ENDPOINT=http://127.0.0.1:PORT.
"""
import http.server
import signal
import sys
import threading

exports = 0
received = 0
lock = threading.Lock()


class Sink(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self):
        global exports, received
        length = int(self.headers.get("Content-Length", "0"))
        body = self.rfile.read(length)
        with lock:
            exports += 1
            received += len(body)
        status = 200 if self.path == "/v1/traces" else 404
        self.send_response(status)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def main():
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 4318
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Sink)

    def stop(*_):
        print(f"otlp sink: {exports} exports, {received} bytes", flush=True)
        threading.Thread(target=server.shutdown).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(f"otlp sink on 127.0.0.1:{port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
