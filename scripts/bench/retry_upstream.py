#!/usr/bin/env python3
"""A target behind every proxy in scripts/bench-retry.sh: a small asyncio HTTP/1.1 server that
counts the requests it receives, so that "upstream attempts per client request" is exact.

Keep-alive; reads request bodies by Content-Length or chunked coding. --mode:
  ok               every request: 200 "ok"
  503              every request: 503 "unavailable" (no Retry-After), connection kept
  stall-1-in-100   each request it receives is answered 200 after --stall-ms (2,000 ms) with a
                   chance of 1 in --stall-every (100), at once otherwise. The draws come from a
                   random generator seeded with --name, so a target stalls the same requests
                   (its n-th, m-th, ...) in every run, and targets stall independently of each
                   other (every 100th request of each target, under round robin, would stall
                   the targets in step: a hedge sent to the next target would often be its
                   stalled one)
  500-1-in-10      every 10th request it receives: 500 "failed", the others 200 (scripts/bench-canary.sh)
GET /__mode/<mode> switches the mode at once (answered 200 with Connection: close, not counted).
A request counts as a hit as soon as its head has been read, whatever happens to it after (a
proxy that cancels a hedged or timed-out attempt still cost the target one). GET /__hits is not
counted: it answers, with Connection: close, one JSON object
{"name", "mode", "hits", "stalled", "per_second": {"<unix second>": hits}}; the same object is
printed to stdout on SIGTERM or SIGINT. Only 127.0.0.1 is used; no dependency beyond Python 3.
"""
import argparse
import asyncio
import json
import random
import os
import signal
import time

MODES = ("ok", "503", "stall-1-in-100", "500-1-in-10")
STATE = {"name": "", "mode": "ok", "hits": 0, "stalled": 0, "per_second": {}}
STALL_EVERY = 100
STALL = 2.0
RANDOM = random.Random()


def response(status, reason, body, name, close=False):
    head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: text/plain\r\n"
            f"Content-Length: {len(body)}\r\nX-Upstream: {name}\r\n")
    if close:
        head += "Connection: close\r\n"
    return (head + "\r\n").encode() + body


OK = b""
OK_CLOSE = b""
FAILED = b""
FAILED_CLOSE = b""
UNAVAILABLE = b""
UNAVAILABLE_CLOSE = b""


class Aborted(Exception):
    pass


async def read_body(reader, headers):
    te = headers.get(b"transfer-encoding", b"").lower()
    if te:
        if not te.endswith(b"chunked"):
            raise Aborted()
        while True:
            line = await reader.readline()
            if not line.endswith(b"\n"):
                raise Aborted()
            size = int(line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while True:  # trailers, up to the empty line
                    line = await reader.readline()
                    if not line.endswith(b"\n"):
                        raise Aborted()
                    if line in (b"\r\n", b"\n"):
                        return
            await reader.readexactly(size + 2)
    length = int(headers.get(b"content-length", b"0") or b"0")
    while length > 0:
        chunk = await reader.read(min(length, 65536))
        if not chunk:
            raise Aborted()
        length -= len(chunk)


def snapshot():
    return json.dumps(STATE, separators=(",", ":"))


async def handle(reader, writer):
    try:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                return
            lines = head.split(b"\r\n")
            request_line = lines[0].split(b" ")
            target = request_line[1] if len(request_line) > 1 else b""
            version = request_line[-1]
            if target == b"/__hits":
                body = snapshot().encode() + b"\n"
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
                await writer.drain()
                return
            if target.startswith(b"/__mode/"):
                mode = target[len(b"/__mode/"):].decode(errors="replace")
                ok = mode in MODES
                if ok:
                    STATE["mode"] = mode
                status = b"200 OK" if ok else b"404 Not Found"
                writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                await writer.drain()
                return
            STATE["hits"] += 1
            second = str(int(time.time()))
            per_second = STATE["per_second"]
            per_second[second] = per_second.get(second, 0) + 1
            stall = STATE["mode"] == "stall-1-in-100" and RANDOM.randrange(STALL_EVERY) == 0
            headers = {}
            for line in lines[1:]:
                if b":" in line:
                    name, value = line.split(b":", 1)
                    headers[name.strip().lower()] = value.strip()
            try:
                await read_body(reader, headers)
            except (Aborted, asyncio.IncompleteReadError, ValueError, ConnectionError, OSError):
                return
            close = (headers.get(b"connection", b"").lower() == b"close"
                     or version == b"HTTP/1.0")
            if stall:
                STATE["stalled"] += 1
                await asyncio.sleep(STALL)
            if STATE["mode"] == "503":
                writer.write(UNAVAILABLE_CLOSE if close else UNAVAILABLE)
            elif STATE["mode"] == "500-1-in-10" and STATE["hits"] % 10 == 0:
                STATE["failed"] = STATE.get("failed", 0) + 1
                writer.write(FAILED_CLOSE if close else FAILED)
            else:
                writer.write(OK_CLOSE if close else OK)
            await writer.drain()
            if close:
                return
    except (ConnectionError, asyncio.LimitOverrunError, OSError):
        pass
    finally:
        writer.close()


async def main():
    global OK, OK_CLOSE, FAILED, FAILED_CLOSE, UNAVAILABLE, UNAVAILABLE_CLOSE, STALL_EVERY, STALL
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--mode", choices=MODES, default="ok")
    parser.add_argument("--name", default="u")
    parser.add_argument("--stall-ms", type=float, default=2000.0)
    parser.add_argument("--stall-every", type=int, default=100)
    args = parser.parse_args()
    if args.stall_every < 1:
        parser.error("--stall-every must be at least 1")
    STATE["name"], STATE["mode"] = args.name, args.mode
    STALL_EVERY, STALL = args.stall_every, args.stall_ms / 1000
    RANDOM.seed(f"retry-upstream-{args.name}")
    OK = response(200, "OK", b"ok\n", args.name)
    OK_CLOSE = response(200, "OK", b"ok\n", args.name, close=True)
    FAILED = response(500, "Internal Server Error", b"failed\n", args.name)
    FAILED_CLOSE = response(500, "Internal Server Error", b"failed\n", args.name, close=True)
    UNAVAILABLE = response(503, "Service Unavailable", b"unavailable\n", args.name)
    UNAVAILABLE_CLOSE = response(503, "Service Unavailable", b"unavailable\n", args.name, close=True)
    server = await asyncio.start_server(handle, "127.0.0.1", args.port, backlog=4096,
                                        limit=65536, reuse_address=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    print(snapshot(), flush=True)
    # not server.wait_closed(): it would wait for every proxy's idle keep-alive connection
    server.close()
    os._exit(0)


if __name__ == "__main__":
    asyncio.run(main())
